"""ALFWorld's prompt family (``alfworld``): the reference's wording."""

from __future__ import annotations

from typing import Sequence  # noqa: F401 - the helpers' signatures

from fedagent.rollout.prompts import _ACTION_INSTRUCTION, _window


# ---------------------------------------------------------------- ALFWorld (the reference's)
# Wording: verl-agent/GiGPO ALFWORLD_TEMPLATE_NO_HIS / ALFWORLD_TEMPLATE
# (langfengQ/verl-agent agent_system/environments/prompts/alfworld.py; "observaitons" is in the
# source), rendered as the reference FedAgent stack does (legacy_prompts.build_alfworld_obs):
# actions "\n ".join-ed inside one bracket, no task line without history.
_ALF_HEAD = "You are an expert agent operating in the ALFRED Embodied Environment."
_ALF_INSTRUCTIONS = {
    "think_action": (
        "Now it's your turn to take an action.\n"
        "You should first reason step-by-step about the current situation. This reasoning process MUST be "
        "enclosed within <think> </think> tags. \n"
        "Once you've finished your reasoning, you should choose an admissible action for current step and "
        "present it within <action> </action> tags."
    ),
    "action": _ACTION_INSTRUCTION,  # ours: the reference has no action-only format
}


def alfworld_actions(admissible: Sequence[str]) -> str:
    """ALFWorld: every command quoted, joined by a newline and a space, ``help`` dropped."""
    return "\n ".join(f"'{a}'" for a in admissible if a != "help")


class _Alfworld:
    fallback_chars = 30  # the reference's tail length of an answer without action tags
    instructions = _ALF_INSTRUCTIONS

    def windowed(self, task, observation, admissible, history, history_length, answer_format) -> str:
        instruction = self.instructions[answer_format]
        actions = alfworld_actions(admissible)
        if not history or history_length <= 0:
            return (
                f"\n{_ALF_HEAD}\n"
                f"Your current observation is: {observation}\n"
                f"Your admissible actions of the current situation are: [{actions}].\n\n"
                f"{instruction}\n"
            )
        k, n, entries = _window(history, history_length)
        return (
            f"\n{_ALF_HEAD} Your task is to: {task}\n"
            f"Prior to this step, you have already taken {k} step(s). Below are the most recent {n} "
            f"observaitons and the corresponding actions you took: {entries}\n"
            f"You are now at step {k + 1} and your current observation is: {observation}\n"
            f"Your admissible actions of the current situation are: [{actions}].\n\n"
            f"{instruction}\n"
        )

    def concat_turn(self, observation, admissible, step, answer_format) -> str:
        return (
            f"You are now at step {step} and your current observation is: {observation}\n"
            f"Your admissible actions of the current situation are: [{alfworld_actions(admissible)}].\n\n"
            f"{self.instructions[answer_format]}"
        )


TEMPLATE = _Alfworld()
