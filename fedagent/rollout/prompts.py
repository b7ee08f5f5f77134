"""The windowed prompt (FACTS §4/§5): one user message per turn, history of the last 2 steps.

Turn 1 uses the no-history template; later turns add "already taken k step(s)" and the
last ``history_length`` ``[Observation j: '…', Action j: '…']`` entries (the observation
*before* the action and the action the service projected). Admissible commands are quoted,
comma-terminated, one per line. Unlike ALFWorld's no-history template, ours keeps the task
line: a TextWorld reset observation need not restate the goal.
"""

from __future__ import annotations

from typing import Sequence

HISTORY_LENGTH = 2

_HEAD = "You are an expert agent playing a text-based game."

_INSTRUCTION = (
    "Now it's your turn to take an action.\n"
    "You should first reason step-by-step about the current situation. This reasoning process "
    "MUST be enclosed within <think> </think> tags.\n"
    "Once you've finished your reasoning, you should choose an admissible action for current "
    "step and present it within <action> </action> tags.\n"
    "Keep the reasoning to one short sentence, then give the action. "
    "Example: <think>The door is closed, so I open it.</think><action>open door</action>"
)

# The assistant turn starts with this text (part of the prompt, not of the trained response).
# Measured on SmolLM2-135M-Instruct at temperature 1.0 (16 samples): with neither the example
# above nor this prefix 0/16 answers had the required format; with both 4/16. Without any
# well-formed answer every GRPO advantage is zero and training cannot move the policy.
RESPONSE_PREFIX = "<think>"

# The ``action`` answer format (``rollout.answer_format: action``): no reasoning block, the
# answer is one admissible command in <action> tags, and the assistant turn is prefilled with
# "<action>" so the model only has to name the command. No example action is printed (a
# printed example is what a small model copies instead of reading the admissible list).
_ACTION_INSTRUCTION = (
    "Now it's your turn to take an action.\n"
    "Answer with exactly one of the admissible actions above, copied as written, "
    "within <action> </action> tags."
)

ANSWER_FORMATS = ("think_action", "action")
_PREFIXES = {"think_action": RESPONSE_PREFIX, "action": "<action>"}
_INSTRUCTIONS = {"think_action": _INSTRUCTION, "action": _ACTION_INSTRUCTION}


def _check_format(answer_format: str) -> str:
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    return answer_format


def response_prefix(answer_format: str = "think_action") -> str:
    """The text the assistant turn is prefilled with for ``answer_format``."""
    return _PREFIXES[_check_format(answer_format)]


def format_actions(admissible: Sequence[str]) -> str:
    """Admissible commands, each quoted and comma-terminated, one per line (``help`` dropped)."""
    return "\n".join(f"'{a}'," for a in admissible if a.strip().lower() != "help")


def windowed_prompt(
    task: str,
    observation: str,
    admissible: Sequence[str],
    history: Sequence[tuple[str, str]],
    history_length: int = HISTORY_LENGTH,
    answer_format: str = "think_action",
) -> str:
    """The user-message text for the next turn.

    ``history`` holds every earlier ``(observation_before_action, projected_action)`` pair
    of the episode, oldest first; its length is the number of steps already taken.
    """
    instruction = _INSTRUCTIONS[_check_format(answer_format)]
    task_line = f" Your task is to: {task}" if task else ""
    actions = format_actions(admissible)
    if not history:
        return (
            f"{_HEAD}{task_line}\n"
            f"Your current observation is: {observation}\n"
            f"Your admissible actions of the current situation are: [\n{actions}\n].\n\n"
            f"{instruction}"
        )
    k = len(history)
    window = list(history)[-history_length:] if history_length > 0 else []
    first = k - len(window) + 1
    entries = "\n".join(
        f"[Observation {first + j}: '{obs}', Action {first + j}: '{act}']" for j, (obs, act) in enumerate(window)
    )
    return (
        f"{_HEAD}{task_line}\n"
        f"Prior to this step, you have already taken {k} step(s). Below are the most recent "
        f"{len(window)} observations and the corresponding actions you took:\n{entries}\n"
        f"You are now at step {k + 1} and your current observation is: {observation}\n"
        f"Your admissible actions of the current situation are: [\n{actions}\n].\n\n"
        f"{instruction}"
    )


def concat_turn_prompt(observation: str, admissible: Sequence[str], step: int,
                       answer_format: str = "think_action") -> str:
    """The user message of a later turn in concat mode (the chat above it holds the history).

    ``step`` is the 1-based number of the step about to be taken.
    """
    instruction = _INSTRUCTIONS[_check_format(answer_format)]
    return (
        f"You are now at step {step} and your current observation is: {observation}\n"
        f"Your admissible actions of the current situation are: [\n{format_actions(admissible)}\n].\n\n"
        f"{instruction}"
    )


def render_chat(tokenizer, messages: Sequence[dict], answer_format: str = "think_action") -> str:
    """The chat template's text of ``messages`` with the generation prompt and the answer prefix."""
    return tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=False
    ) + response_prefix(answer_format)


def encode_prompt(tokenizer, content: str, max_prompt_tokens: int, answer_format: str = "think_action") -> list[int]:
    """Chat-format one user message (generation prompt + the format's prefix), left-truncated.

    Left truncation keeps the end of the prompt (current observation, actions, instruction
    and the assistant header), the same cap for generation and for the stored sample.
    """
    if max_prompt_tokens <= 0:
        raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
    text = render_chat(tokenizer, [{"role": "user", "content": content}], answer_format)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return ids[-max_prompt_tokens:]
