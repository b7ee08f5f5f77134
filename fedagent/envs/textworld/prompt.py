"""TextWorld's prompt family (``textworld``): the generic text-game prompt."""

from __future__ import annotations

from typing import Sequence  # noqa: F401 - the helpers' signatures

from fedagent.rollout.prompts import _HEAD, _INSTRUCTIONS, _window, format_actions


# ---------------------------------------------------------------- TextWorld (ours)
class _TextWorld:
    """The generic text-game prompt (TextWorld games); unchanged since the first rollout."""

    fallback_chars = 30  # the reference's tail length of an answer without action tags

    instructions = _INSTRUCTIONS

    def windowed(self, task, observation, admissible, history, history_length, answer_format) -> str:
        instruction = self.instructions[answer_format]
        task_line = f" Your task is to: {task}" if task else ""
        actions = format_actions(admissible)
        if not history:
            return (
                f"{_HEAD}{task_line}\n"
                f"Your current observation is: {observation}\n"
                f"Your admissible actions of the current situation are: [\n{actions}\n].\n\n"
                f"{instruction}"
            )
        k, n, entries = _window(history, history_length)
        return (
            f"{_HEAD}{task_line}\n"
            f"Prior to this step, you have already taken {k} step(s). Below are the most recent "
            f"{n} observations and the corresponding actions you took:\n{entries}\n"
            f"You are now at step {k + 1} and your current observation is: {observation}\n"
            f"Your admissible actions of the current situation are: [\n{actions}\n].\n\n"
            f"{instruction}"
        )

    def concat_turn(self, observation, admissible, step, answer_format) -> str:
        return (
            f"You are now at step {step} and your current observation is: {observation}\n"
            f"Your admissible actions of the current situation are: [\n{format_actions(admissible)}\n].\n\n"
            f"{self.instructions[answer_format]}"
        )


TEMPLATE = _TextWorld()
