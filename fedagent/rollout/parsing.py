"""Parse the agent's answer ``<think>…</think><action>…</action>`` into an env action.

The answer is valid iff it has a ``<think>`` block, an ``<action>`` block and no CJK text
(``require_think=False``, the ``action`` answer format: an ``<action>`` block and no CJK text).
The action is the first ``<action>`` block's content, stripped and lower-cased; an answer
without one yields its last ``fallback_chars`` characters instead. What the environment does
with an invalid answer is ``rollout.projection`` (:data:`PROJECTIONS`, the env service):
``reference`` (the reference's server-side projection, FACTS §4) sends the projected string
to the env all the same — a format error (missing ``<think>``, CJK text) still executes its
tagged action, and an answer with no tags sends its last 20 (WebShop) / 30 (ALFWorld, TextWorld)
characters, usually a no-op; ``noop`` makes every invalid answer a no-op turn. The
invalid-format penalty is applied by training only, in both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fedagent.rollout.prompts import template_object

_ACTION = re.compile(r"<action>(.*?)</action>", re.DOTALL | re.IGNORECASE)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
FALLBACK_CHARS = 30
# rollout.projection: what the env does with an invalid answer (see the module docstring).
PROJECTIONS = ("reference", "noop")


def fallback_chars(template: str | None, projection: str) -> int:
    """The tail length of a tagless answer: the reference's per env (``reference``), else 30."""
    if projection not in PROJECTIONS:
        raise ValueError(f"rollout.projection must be one of {PROJECTIONS}, got {projection!r}")
    if projection != "reference" or template is None:
        return FALLBACK_CHARS
    # the reference's tail length of an answer without action tags: the prompt family's (its env's)
    try:
        return getattr(template_object(str(template)), "fallback_chars", FALLBACK_CHARS)
    except ValueError:  # no such family: the default
        return FALLBACK_CHARS


@dataclass(frozen=True)
class ParsedAction:
    """The projected action and whether the answer followed the required format."""

    action: str
    valid: bool


def parse_action(text: str, fallback_chars: int = FALLBACK_CHARS, *, require_think: bool = True) -> ParsedAction:
    """Project a model answer onto an action string; see the module docstring."""
    if not isinstance(text, str):
        raise TypeError(f"answer must be a string, got {type(text).__name__}")
    match = _ACTION.search(text)
    if match is None:
        tail = text[-fallback_chars:].strip().lower() if fallback_chars > 0 else ""
        return ParsedAction(action=tail, valid=False)
    action = " ".join(match.group(1).split()).lower()
    has_think = _THINK.search(text) is not None or not require_think
    valid = bool(action) and has_think and _CJK.search(text) is None
    return ParsedAction(action=action, valid=valid)
