"""One TextWorld env instance (implements :class:`fedagent.envs.base.TextEnv`).

An instance can play any game of its games directory; ``reset(task_id)`` loads that game
(loaded games are kept in a small per-instance LRU cache: loading costs ~30 ms, a reset
~25 ms, a step ~10 ms). Reward is sparse: 10 on the step that wins, else 0. Observations are
cleaned of TextWorld's ASCII-art banner, the trailing ``>`` prompt with its status line, and
the "RESTART, RESTORE ... UNDO" epilogue.

Thread safety: jericho loads a private copy of libfrotz per game instance, so distinct
instances can step concurrently; one instance must not be used by two threads at once
(the service's per-session lock guarantees that). Loading a game goes through a
process-wide lock because TextWorld's game/grammar loading was not written for threads.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Mapping

from fedagent.envs.base import ResetResult, StepResult

WIN_REWARD = 10.0
TASK_TYPE = "textworld"
_LOAD_LOCK = threading.Lock()
# "\n>  <spaces>  -= Room =-0/1" at the end of every feedback: prompt + status line.
_PROMPT_TAIL = re.compile(r"\s*>\s*(?:-=.*?=-\s*\d+/\d+)?\s*$", re.DOTALL)
_EPILOGUE = re.compile(r"\s*You scored .*$", re.DOTALL)
_BLANKS = re.compile(r"\n{3,}")


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\\]")


def engine_text(action: str) -> str:
    """An action as the Z-machine interpreter can take it: control characters and backslashes
    become spaces. A NUL ended the interpreter's process, a DLE (0x10) hung it, and dumb-frotz reads
    a line starting with a backslash as its own command (seen with a tiny random model's byte-level
    tokens, whose tagless answers the reference projection sends on); other text, CJK and emoji
    the parser answers itself ("That's not a verb I recognise.")."""
    return _CONTROL.sub(" ", str(action))


def clean_observation(text: str, objective: str | None = None) -> str:
    """Strip banner (everything before the objective), prompt/status tail and epilogue."""
    if objective and objective in text:
        text = text[text.index(objective) :]
    text = _PROMPT_TAIL.sub("", text)
    if "*** The End ***" in text:
        text = _EPILOGUE.sub("", text)
    # Inform pads lines with spaces and separates paragraphs with runs of blank lines.
    text = "\n".join(line.strip() for line in text.splitlines())
    return _BLANKS.sub("\n\n", text).strip()


def _request_infos(policy_commands: bool = False):
    import textworld

    return textworld.EnvInfos(
        admissible_commands=True,
        won=True,
        lost=True,
        score=True,
        max_score=True,
        objective=True,
        feedback=True,
        policy_commands=policy_commands,
    )


class TextWorldEnv:
    """A pool slot able to play the games in ``game_paths`` (id → .z8 path)."""

    def __init__(
        self, game_paths: Mapping[str, Path], *, max_turns: int = 50, cache_size: int = 8, policy_commands: bool = False
    ):
        """Remember the games; nothing is loaded until the first reset. ``policy_commands``: ask
        TextWorld for the winning commands from every state (the expert, :meth:`expert_action`)."""
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self.game_paths = {k: Path(v) for k, v in game_paths.items()}
        self.max_turns = int(max_turns)
        self.cache_size = max(1, int(cache_size))
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._env = None
        self._task_id: str | None = None
        self._objective = ""
        self._turns = 0
        self._done = True
        self._last = None
        self.policy_commands = bool(policy_commands)
        self._plan: list[str] = []

    def _load(self, task_id: str):
        if task_id in self._cache:
            self._cache.move_to_end(task_id)
            return self._cache[task_id]
        if task_id not in self.game_paths:
            raise KeyError(f"unknown task id {task_id!r}")
        import textworld

        with _LOAD_LOCK:
            env = textworld.start(str(self.game_paths[task_id]), request_infos=_request_infos(self.policy_commands))
        self._cache[task_id] = env
        while len(self._cache) > self.cache_size:
            _, old = self._cache.popitem(last=False)
            old.close()
        return env

    def reset(self, task_id: str) -> ResetResult:
        """Load ``task_id`` (cached) and start a fresh episode."""
        env = self._load(task_id)
        state = env.reset()
        self._env, self._task_id = env, task_id
        self._objective = state["objective"] or ""
        self._turns, self._done = 0, False
        obs = clean_observation(state["feedback"], self._objective)
        self._plan = list(state.get("policy_commands") or []) if self.policy_commands else []
        self._last = StepResult(obs, 0.0, False, False, list(state["admissible_commands"]), self._score(state))
        return ResetResult(obs, self._objective, list(state["admissible_commands"]), task_id, TASK_TYPE)

    @staticmethod
    def _score(state) -> float:
        max_score = state["max_score"] or 0
        return float(state["score"]) / max_score if max_score else 0.0

    def step(self, action: str) -> StepResult:
        """Apply one action; after the episode ended, repeat the last state with reward 0."""
        if self._env is None:
            raise RuntimeError("step before reset")
        if self._done:
            last = self._last
            return StepResult(last.observation, 0.0, True, last.won, last.admissible_commands, last.score)
        state, _score, done = self._env.step(engine_text(action))
        self._turns += 1
        self._plan = list(state.get("policy_commands") or []) if self.policy_commands else []
        won, lost = bool(state["won"]), bool(state["lost"])
        self._done = bool(done) or won or lost or self._turns >= self.max_turns
        result = StepResult(
            observation=clean_observation(state["feedback"]),
            reward=WIN_REWARD if won else 0.0,
            done=self._done,
            won=won,
            admissible_commands=list(state["admissible_commands"] or []),
            score=self._score(state),
        )
        self._last = result
        return result

    def expert_action(self) -> str | None:
        """The walkthrough expert's next command from the current state (TextWorld's
        ``policy_commands``: the quest's winning commands, recomputed after every step), or None
        when it has none (the episode is over)."""
        if not self.policy_commands:
            raise RuntimeError("expert_action needs an env made with policy_commands=True")
        return self._plan[0] if self._plan and not self._done else None

    def close(self) -> None:
        """Close every loaded game."""
        for env in self._cache.values():
            env.close()
        self._cache.clear()
        self._env = None
