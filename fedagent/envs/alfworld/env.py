"""One ALFWorld env instance (implements :class:`fedagent.envs.base.TextEnv`).

A game (real ``game.tw-pddl`` or generated) runs in TextWorld's ``PddlEnv`` wrapped by
ALFWorld's ``AlfredDemangler`` (readable names: ``cabinet 3``; ``shuffle=False`` so names are
deterministic) and ``AlfredInfos`` (the game file in the state), as ALFWorld's own
``AlfredTWEnv`` builds it. Reward is ``10 * won``; an episode ends when won or after
``max_turns`` steps; ``help`` is never offered as an admissible command.

Thread safety: TextWorld's PDDL translation (``fast_downward.pddl2sas``) rewrites ``sys.argv``,
swaps ``sys.stdout`` and uses module-global options, so every load/reset/step in this process
goes through one lock (as in the reference system). Each instance owns its private copy of
the planner library, so instances never share game state.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path
from typing import Mapping

from fedagent.envs.alfworld import assets, parse_cache
from fedagent.envs.base import ResetResult, StepResult
from fedagent.envs.textworld.env import engine_text  # the same Z-machine/TextWorld engine underneath

WIN_REWARD = 10.0
DEFAULT_MAX_TURNS = 50
TASK_MARKER = "Your task is to: "
_PDDL_LOCK = threading.RLock()


def _request_infos(policy_commands: bool):
    import textworld

    return textworld.EnvInfos(won=True, admissible_commands=True, policy_commands=policy_commands, extras=["gamefile"])


@contextlib.contextmanager
def locked():
    """Hold the process-wide PDDL lock; restore ``sys.argv``, which ``pddl2sas`` overwrites."""
    with _PDDL_LOCK:
        argv = list(sys.argv)
        try:
            yield
        finally:
            sys.argv[:] = argv


def open_game(game: str | Path | Mapping | None = None, *, policy_commands: bool = False):
    """A wrapped PddlEnv (demangler + infos), with ``game`` (path or game dict) loaded if given."""
    from textworld.envs.pddl import PddlEnv

    parse_cache.install()  # TextWorld re-parses its grammar's strings every step: memoized, same text
    demangler, infos = assets.wrappers()
    with locked():
        env = infos(demangler(PddlEnv(_request_infos(policy_commands)), shuffle=False))
        if game is not None:
            env.load(str(game) if isinstance(game, Path) else game)
    return env


def task_text(observation: str) -> str:
    """The goal: the text after ``Your task is to: `` in the reset observation."""
    if TASK_MARKER not in observation:
        return ""
    return observation.split(TASK_MARKER, 1)[1].strip()


def _admissible(state) -> list[str]:
    return [c for c in (state["admissible_commands"] or []) if c != "help"]


def close_game(env) -> None:
    """Close a wrapped PddlEnv and free its private planner library's state.

    The library itself is not dlclose()d: fast-downward registers C++ static destructors with
    atexit, and unmapping their code made every process that had closed an env segfault at
    exit (exit status 139, which fails CI even when every test passed).
    """
    inner = env
    while hasattr(inner, "_wrapped_env"):
        inner = inner._wrapped_env
    lib = getattr(inner, "downward_lib", None)
    env.close()
    if lib is not None:
        lib.cleanup()
        inner.downward_lib = None


class AlfworldEnv:
    """A pool slot able to play the ALFWorld games in ``game_paths`` (task id -> game file)."""

    def __init__(
        self,
        game_paths: Mapping[str, Path],
        task_types: Mapping[str, str],
        *,
        max_turns: int = DEFAULT_MAX_TURNS,
        policy_commands: bool = False,
    ):
        """Remember the games; the PDDL env is created on the first reset."""
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self.game_paths = {k: Path(v) for k, v in game_paths.items()}
        self.task_types = dict(task_types)
        self.max_turns = int(max_turns)
        self.policy_commands = bool(policy_commands)
        self._env = None
        self._loaded: str | None = None
        self._task_id: str | None = None
        self._turns = 0
        self._done = True
        self._last: StepResult | None = None
        self._plan: list[str] = []

    def reset(self, task_id: str) -> ResetResult:
        """Load ``task_id`` (kept loaded while it is replayed) and start a fresh episode."""
        if task_id not in self.game_paths:
            raise KeyError(f"unknown task id {task_id!r}")
        with locked():
            if self._env is None:
                self._env = open_game(policy_commands=self.policy_commands)
            if self._loaded != task_id:
                self._loaded = None
                self._env.load(str(self.game_paths[task_id]))
                self._loaded = task_id
            state = self._env.reset()
        self._task_id, self._turns, self._done = task_id, 0, False
        obs = state["feedback"]
        self._plan = list(state.get("policy_commands") or [])
        self._last = StepResult(obs, 0.0, False, False, _admissible(state), 0.0)
        return ResetResult(obs, task_text(obs), _admissible(state), task_id, self.task_types[task_id])

    def step(self, action: str) -> StepResult:
        """Apply one action; after the episode ended, repeat the last state with reward 0."""
        if self._task_id is None:
            raise RuntimeError("step before reset")
        if self._done:
            last = self._last
            return StepResult(last.observation, 0.0, True, last.won, last.admissible_commands, last.score)
        with locked():
            state, _score, _done = self._env.step(engine_text(action))
        self._turns += 1
        won = bool(state["won"])
        self._done = won or self._turns >= self.max_turns
        self._plan = list(state.get("policy_commands") or [])
        self._last = StepResult(
            state["feedback"], WIN_REWARD if won else 0.0, self._done, won, _admissible(state), 1.0 if won else 0.0
        )
        return self._last

    def expert_plan(self) -> list[str]:
        """The planner's remaining commands from the current state (needs ``policy_commands=True``)."""
        if not self.policy_commands:
            raise RuntimeError("expert_plan needs an env made with policy_commands=True")
        return list(self._plan)

    def expert_action(self) -> str | None:
        """The planner's next command from the current state (:meth:`expert_plan`), or None."""
        plan = self.expert_plan()
        return plan[0] if plan else None

    def close(self) -> None:
        """Release the PDDL env and its planner library."""
        if self._env is not None:
            with locked():
                close_game(self._env)
            self._env, self._loaded = None, None
