"""The windowed prompt (FACTS §4/§5): one user message per turn, history of the last 2 steps.

Each environment has its own template family, named by the env service in every ``/reset``
answer (``prompt_template``: ``textworld`` | ``webshop`` | ``alfworld``, declared by the task
source) so the rollout loops (:mod:`fedagent.rollout.episode`, :mod:`fedagent.rollout.concat`,
the verl agent loop) pick the right one without knowing the env. All share one contract:
turn 1 (no history) uses the family's no-history template; later turns add "already taken k
step(s)" and the last ``history_length`` ``[Observation j: '…', Action j: '…']`` entries (the
observation *before* the action and the action the service projected); then the current
observation, the admissible actions and the answer instruction.

- ``textworld`` (ours): quoted, comma-terminated actions one per line, a one-line example
  action; unlike ALFWorld's no-history template ours keeps the task line (a TextWorld reset
  observation need not restate the goal).
- ``webshop`` / ``alfworld``: the reference's wording (verl-agent/GiGPO's WEBSHOP_TEMPLATE(_NO_HIS)
  and ALFWORLD_TEMPLATE(_NO_HIS), ``agent_system/environments/prompts/{webshop,alfworld}.py``
  in langfengQ/verl-agent, as the reference FedAgent stack renders them in its windowed mode:
  ``fedagent/envs/legacy_prompts.py`` of sunblaze-ucb/FedAgent), reproduced byte for byte:
  the leading and trailing newline, the trailing spaces, WebShop's non-breaking hyphen in
  "e\u2011commerce" and ALFWorld's "observaitons" are all in the source. WebShop: actions quoted
  and comma-terminated, one per line; a prompt over ``WEBSHOP_MAX_PROMPT_CHARS`` (13000)
  characters falls back to the no-history template. ALFWorld: actions quoted and joined by
  ``"\n "`` inside one bracket, ``help`` dropped; its no-history template has no task line.
  ``history_length <= 0`` always gives the no-history template (as in the reference).
  ``answer_format: action`` swaps only the instruction block (the reference has no such format).

The observation and history texts arrive already formatted by the env (WebShop's
``format_obs`` runs inside :class:`fedagent.envs.webshop.env.WebShopEnv` before a page leaves
it), so the prompt holds the formatted rendering byte for byte (FACTS §10 invariant 6).
"""

from __future__ import annotations

from typing import Sequence

from fedagent.core import envs

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
    """TextWorld: admissible commands, each quoted and comma-terminated, one per line (``help`` dropped)."""
    return "\n".join(f"'{a}'," for a in admissible if a.strip().lower() != "help")


def _window(history: Sequence[tuple[str, str]], history_length: int) -> tuple[int, int, str]:
    """(steps taken k, entries shown, the entries' text) of the last ``history_length`` steps."""
    k = len(history)
    window = list(history)[-history_length:] if history_length > 0 else []
    first = k - len(window) + 1
    entries = "\n".join(
        f"[Observation {first + j}: '{obs}', Action {first + j}: '{act}']" for j, (obs, act) in enumerate(window)
    )
    return k, len(window), entries


def prompt_templates() -> tuple[str, ...]:
    """Every prompt family the registered environments declare (:attr:`fedagent.core.envs.EnvSpec.prompt_templates`)."""
    return envs.prompt_template_names()


def template_object(name: str):
    """The template object of the prompt family ``name`` (its env's); ValueError naming the choices if none."""
    return envs.prompt_template(name)


def check_template(template_name: str) -> str:
    """``template_name`` if it names a prompt family, else a ValueError naming the choices."""
    template_object(template_name)
    return template_name


def template_of(reset_answer: dict) -> str:
    """The prompt family an env's ``/reset`` answer names (the service always sends it)."""
    if "prompt_template" not in reset_answer:
        raise ValueError(
            "the env's reset answer names no prompt_template (an env service older than the per-environment prompts?)"
        )
    return check_template(str(reset_answer["prompt_template"]))


def windowed_prompt(
    task: str,
    observation: str,
    admissible: Sequence[str],
    history: Sequence[tuple[str, str]],
    history_length: int = HISTORY_LENGTH,
    answer_format: str = "think_action",
    *,
    template: str,
) -> str:
    """The user-message text for the next turn, in ``template``'s wording.

    ``history`` holds every earlier ``(observation_before_action, projected_action)`` pair
    of the episode, oldest first; its length is the number of steps already taken.
    ``template`` is the env's ``prompt_template`` (:func:`template_of`).
    """
    _check_format(answer_format)
    return template_object(template).windowed(task, observation, admissible, history, history_length, answer_format)


def concat_turn_prompt(
    observation: str, admissible: Sequence[str], step: int, answer_format: str = "think_action", *, template: str
) -> str:
    """The user message of a later turn in concat mode (the chat above it holds the history).

    ``step`` is the 1-based number of the step about to be taken.
    """
    _check_format(answer_format)
    return template_object(template).concat_turn(observation, admissible, step, answer_format)


def render_chat(tokenizer, messages: Sequence[dict], answer_format: str = "think_action") -> str:
    """The chat template's text of ``messages`` with the generation prompt and the answer prefix."""
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False) + response_prefix(
        answer_format
    )


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
