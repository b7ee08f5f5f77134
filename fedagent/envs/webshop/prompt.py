"""WebShop's prompt family (``webshop``): the reference's wording."""

from __future__ import annotations

from typing import Sequence  # noqa: F401 - the helpers' signatures

from fedagent.rollout.prompts import _window


# ---------------------------------------------------------------- WebShop (the reference's)
# Wording: verl-agent/GiGPO WEBSHOP_TEMPLATE_NO_HIS / WEBSHOP_TEMPLATE
# (langfengQ/verl-agent agent_system/environments/prompts/webshop.py), as the reference
# FedAgent stack renders it (sunblaze-ucb/FedAgent fedagent/envs/legacy_prompts.py,
# build_webshop_obs). "\u2011" (non-breaking hyphen) and the trailing spaces are in the source.
WEBSHOP_MAX_PROMPT_CHARS = 13000
_WS_HEAD = "You are an expert autonomous agent operating in the WebShop e\u2011commerce environment."
_WS_ACTIONS_LINE = "Your admissible actions of the current situation are: \n"
_WS_INSTRUCTIONS = {
    "think_action": (
        "Now it's your turn to take one action for the current step.\n"
        "You should first reason step-by-step about the current situation, then think carefully which "
        "admissible action best advances the shopping goal. This reasoning process MUST be enclosed within "
        "<think> </think> tags. \n"
        "Once you've finished your reasoning, you should choose an admissible action for current step and "
        "present it within <action> </action> tags."
    ),
    "action": (  # ours: the reference has no action-only format
        "Now it's your turn to take one action for the current step.\n"
        "Answer with exactly one of the admissible actions above within <action> </action> tags, copied as "
        "written (in search[<your query>], write your search words in place of <your query>)."
    ),
}


def webshop_actions(admissible: Sequence[str]) -> str:
    """WebShop: every action quoted and comma-terminated, one per line (the reference drops nothing)."""
    return "\n".join(f"'{a}'," for a in admissible)


class _WebShop:
    fallback_chars = 20  # the reference's tail length of an answer without action tags
    instructions = _WS_INSTRUCTIONS

    def no_history(self, task, observation, admissible, answer_format) -> str:
        return (
            f"\n{_WS_HEAD} \n"
            f"Your task is to: {task}.\n"
            f"Your current observation is: {observation}.\n"
            f"{_WS_ACTIONS_LINE}[\n{webshop_actions(admissible)}\n].\n\n"
            f"{self.instructions[answer_format]}\n"
        )

    def windowed(self, task, observation, admissible, history, history_length, answer_format) -> str:
        if not history or history_length <= 0:
            return self.no_history(task, observation, admissible, answer_format)
        k, n, entries = _window(history, history_length)
        prompt = (
            f"\n{_WS_HEAD}\n"
            f"Your task is to: {task}.\n"
            f"Prior to this step, you have already taken {k} step(s). Below are the most recent {n} "
            f"observations and the corresponding actions you took: {entries}\n"
            f"You are now at step {k + 1} and your current observation is: {observation}.\n"
            f"{_WS_ACTIONS_LINE}[\n{webshop_actions(admissible)}\n].\n\n"
            f"{self.instructions[answer_format]}\n"
        )
        if len(prompt) > WEBSHOP_MAX_PROMPT_CHARS:  # the reference's guard: drop the history
            return self.no_history(task, observation, admissible, answer_format)
        return prompt

    def concat_turn(self, observation, admissible, step, answer_format) -> str:
        # ours (the reference's concat mode is a different recipe): the template's current-step
        # lines; no outer newlines, so chat templates that trim messages keep it intact.
        return (
            f"You are now at step {step} and your current observation is: {observation}.\n"
            f"{_WS_ACTIONS_LINE}[\n{webshop_actions(admissible)}\n].\n\n"
            f"{self.instructions[answer_format]}"
        )


TEMPLATE = _WebShop()
