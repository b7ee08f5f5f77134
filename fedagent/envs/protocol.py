"""The env service's wire format: request/response models (pydantic, strict) and the size limits
(the endpoints themselves are :mod:`fedagent.envs.service`; the client is :mod:`fedagent.envs.client`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fedagent.envs.client import MAX_BATCH_ITEMS

MAX_BODY_BYTES = 64 * 1024
MAX_TEXT_CHARS = 16 * 1024
# /step_batch carries up to MAX_BATCH_ITEMS answers: room for every item at its longest
# (plain ASCII) twice over, still a bounded buffer.
MAX_BATCH_BODY_BYTES = 2 * MAX_BATCH_ITEMS * MAX_TEXT_CHARS
SESSION_ID_PATTERN = r"^[A-Za-z0-9_.:\-]{1,128}$"
BATCH_PATHS = ("/create_batch", "/reset_batch", "/step_batch", "/close_batch", "/expert_batch")


class _Strict(BaseModel):
    # Strict types and no unknown fields: "1" is not a seed, a typo'd key is an error.
    model_config = ConfigDict(strict=True, extra="forbid")


class SessionRequest(_Strict):
    """Body of /create and /close."""

    session_id: str = Field(pattern=SESSION_ID_PATTERN)


class ResetRequest(_Strict):
    """Body of /reset."""

    session_id: str = Field(pattern=SESSION_ID_PATTERN)
    seed: int = Field(ge=0, lt=2**63)


class StepRequest(_Strict):
    """Body of /step: the raw model answer, parsed by the service."""

    session_id: str = Field(pattern=SESSION_ID_PATTERN)
    text: str = Field(max_length=MAX_TEXT_CHARS)
    step_id: int = Field(ge=0, lt=2**31)


class BatchRequest(_Strict):
    """Body of every /*_batch route; items are validated one by one so a bad one fails only itself."""

    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)


class HealthResponse(BaseModel):
    """Body of /health."""

    ok: bool
    pool_free: int
    pool_total: int
    sessions: int
    split: str
    client_id: str | None
    mode: str
    num_tasks: int
    tasks_sha256: str
    task_types: dict[str, int]
    max_turns: int
    counters: dict[str, int]
    env_info: dict[str, Any] = {}  # what the task source reports (WebShop: arm, catalog_size, variant)


class SessionResponse(BaseModel):
    """Body of /create and /close."""

    ok: bool
    session_id: str
    created: bool = False  # /create: this call borrowed the env (False: already existed)
    existed: bool = False  # /close: the session was open


class ResetResponse(BaseModel):
    """Body of /reset."""

    observation: str
    task: str
    admissible_commands: list[str]
    task_id: str
    task_type: str
    prompt_template: str  # the prompt family of this env (fedagent.rollout.prompts.PROMPT_TEMPLATES)


class StepResponse(BaseModel):
    """Body of /step."""

    observation: str
    reward: float
    done: bool
    won: bool
    is_action_valid: bool
    action: str
    admissible_commands: list[str]
    task_id: str
    task_type: str
    score: float
    step_id: int
    turns: int


class ItemError(BaseModel):
    """Why one batch item failed: the HTTP status /step would have answered, and its detail."""

    status: int
    detail: str


class StepItemError(BaseModel):
    """A failed /step_batch item."""

    error: ItemError


class StepBatchResponse(BaseModel):
    """Body of /step_batch: one entry per item, in item order."""

    results: list[StepResponse | StepItemError]


class SessionBatchResponse(BaseModel):
    """Body of /create_batch and /close_batch: one entry per item, in item order."""

    results: list[SessionResponse | StepItemError]


class ResetBatchResponse(BaseModel):
    """Body of /reset_batch: one entry per item, in item order."""

    results: list[ResetResponse | StepItemError]


class ExpertResponse(BaseModel):
    """The expert's next action in a session (``None`` once its episode is over)."""

    session_id: str
    action: str | None


class ExpertBatchResponse(BaseModel):
    results: list[ExpertResponse | ItemError]
