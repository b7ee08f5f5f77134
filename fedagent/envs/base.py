"""The in-process environment interface every served environment implements.

The HTTP service (``fedagent.envs.service``) only ever talks to this interface, so TextWorld
games, ALFWorld games (generated or real data) and future environments share one code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


@dataclass
class ResetResult:
    """What an environment reports at the start of an episode."""

    observation: str
    task: str  # the goal text shown to the agent
    admissible_commands: list[str]
    task_id: str
    task_type: str


@dataclass
class StepResult:
    """What an environment reports after one action."""

    observation: str
    reward: float  # sparse env reward (already scaled, e.g. 10 * won)
    done: bool
    won: bool
    admissible_commands: list[str] = field(default_factory=list)
    score: float = 0.0  # graded diagnostic score in [0, 1]


class TextEnv(Protocol):
    """One environment instance; the service keeps a pool of these."""

    def reset(self, task_id: str) -> ResetResult:
        """Start an episode of ``task_id``."""

    def step(self, action: str) -> StepResult:
        """Apply one (already parsed) action."""

    def close(self) -> None:
        """Release resources held by this instance."""


class TaskSource(Protocol):
    """A set of tasks plus a way to build env instances that can play them.

    ``prompt_template`` names the prompt family the agent sees for these tasks
    (:data:`fedagent.rollout.prompts.PROMPT_TEMPLATES`); the service sends it with every reset.
    """

    prompt_template: str

    def task_ids(self, split: str) -> Sequence[str]:
        """Canonical (deterministic) task order of ``split``."""

    def task_type(self, task_id: str) -> str:
        """The task's type (ALFWorld: pick/look/clean/heat/cool/pick_two; TextWorld: textworld)."""

    def make_env(self, max_turns: int) -> TextEnv:
        """A fresh env instance able to play any task of this source."""
