"""An in-process stand-in for the env client: a tiny deterministic text game, no HTTP.

Same methods as :class:`fedagent.envs.client.EnvClient` (``create``, ``reset``, ``step``,
``close``) and the same seed → task rule as the service (``index``: tasks[seed % n];
``draw``: tasks[Random(seed).randrange(n)]). Each task has one target action among the
admissible commands; taking it wins (reward 10, score 1, done). Any other action is a
no-op; an answer without the required tags is invalid (parsed with the real parser).
``win_if`` replaces the target check by a predicate on the raw answer text, which gives a
tiny random model something it can actually learn.
"""

from __future__ import annotations

import random
from typing import Callable

from fedagent.rollout.parsing import parse_action

COMMANDS = ["go north", "go south", "take key", "open chest", "look"]


def default_tasks(n: int = 6) -> list[str]:
    """Task ids ``fake-000`` … in canonical order."""
    return [f"fake-{i:03d}" for i in range(n)]


class FakeEnv:
    """Deterministic text game with the env client's interface; records every call."""

    def __init__(
        self,
        tasks: list[str] | None = None,
        *,
        mode: str = "index",
        max_turns: int = 5,
        pool_size: int = 64,
        win_if: Callable[[str], bool] | None = None,
        prompt_template: str = "textworld",
    ):
        self.tasks = list(tasks or default_tasks())
        self.prompt_template = prompt_template  # the prompt family this env names at reset
        self.mode = mode
        self.max_turns = max_turns
        self.pool_size = pool_size
        self.win_if = win_if
        self.sessions: dict[str, dict] = {}
        self.log: list[tuple] = []

    def _task(self, seed: int) -> str:
        if self.mode == "index":
            return self.tasks[seed % len(self.tasks)]
        return self.tasks[random.Random(seed).randrange(len(self.tasks))]

    @staticmethod
    def target(task_id: str) -> str:
        """The winning action of a task (a pure function of its id)."""
        return COMMANDS[int(task_id.rsplit("-", 1)[1]) % len(COMMANDS)]

    def health(self) -> dict:
        return {"ok": True, "env_info": {}}

    def create(self, session_id: str) -> dict:
        self.log.append(("create", session_id))
        if session_id not in self.sessions:
            if len(self.sessions) >= self.pool_size:
                raise RuntimeError("pool exhausted")
            self.sessions[session_id] = {}
        return {"ok": True}

    def reset(self, session_id: str, seed: int) -> dict:
        self.log.append(("reset", session_id, seed))
        task = self._task(seed)
        self.sessions[session_id] = {"task": task, "turns": 0, "done": False}
        return {
            "observation": f"You are in room {task[-1]}. There is a chest here.",
            "task": f"do the right thing in {task}",
            "admissible_commands": list(COMMANDS),
            "task_id": task,
            "task_type": "even" if int(task[-1]) % 2 == 0 else "odd",
            "prompt_template": self.prompt_template,
        }

    def step(self, session_id: str, text: str) -> dict:
        s = self.sessions[session_id]
        if s.get("done") or "task" not in s:
            raise RuntimeError(f"step on finished or unreset session {session_id}")
        self.log.append(("step", session_id, text))
        parsed = parse_action(text)
        s["turns"] += 1
        if self.win_if is not None:
            won = bool(self.win_if(text))
        else:
            won = parsed.valid and parsed.action == self.target(s["task"])
        done = won or s["turns"] >= self.max_turns
        s["done"] = done
        obs = "You won!" if won else ("Nothing happens." if parsed.valid else "Invalid format.")
        return {
            "observation": obs,
            "reward": 10.0 if won else 0.0,
            "done": done,
            "won": won,
            "is_action_valid": parsed.valid,
            "action": parsed.action,
            "admissible_commands": list(COMMANDS),
            "task_id": s["task"],
            "task_type": "even" if int(s["task"][-1]) % 2 == 0 else "odd",
            "score": 1.0 if won else 0.0,
        }

    def close(self, session_id: str) -> dict:
        self.log.append(("close", session_id))
        self.sessions.pop(session_id, None)
        return {"ok": True}


class Pending:
    """A started-but-not-health-gated env (``env_service(..., wait=False)``): ``ready()`` gives it."""

    def __init__(self, env):
        self.env = env
        self.readied = 0

    def ready(self):
        self.readied += 1
        return self.env


# A local client's knobs for the tiny model on a FakeEnv (test_grpo, test_gigpo, test_lora, test_scale): two
# epochs of two groups of three short episodes, mini-batches of 3 in micro-batches of 2.
TINY_TRAIN = dict(
    base_seed=3,
    epochs=2,
    groups_per_epoch=2,
    group_size=3,
    max_turns=2,
    max_new_tokens=8,
    temperature=1.0,
    lr=1e-3,
    mini_batch_size=3,
    micro_batch_size=2,
    max_prompt_tokens=256,
    pool_size=4,
)


def build_tiny_model(out_dir, seed: int = 1):
    """A tiny HF model dir (with manifest) for tests; see fedagent.model.base_model_tiny."""
    from pathlib import Path

    from fedagent.model.base_model_tiny import write_tiny_model

    return write_tiny_model(Path(out_dir), seed)
