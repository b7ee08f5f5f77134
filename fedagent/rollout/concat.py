"""Concat rollout mode (``rollout.mode: concat``): the whole episode as one token sequence.

FACTS §5: the chat grows turn by turn (first turn: the windowed no-history prompt; later
turns: the observation as a user message, :func:`fedagent.rollout.prompts.concat_turn_prompt`),
and the model generates from the *accumulated token ids*, never from a re-tokenized render:

    context_{t+1} = context_t + response_ids_t + encode(glue_t)

so the sequence trained on (:func:`fedagent.train.grpo.episode_samples`) is token for token
the context each turn was generated from, with the model's tokens masked 1 and the glue 0.

The glue (end of the assistant turn, the next user turn, the next generation prompt and
answer prefix) is recovered by rendering the chat with the chat template *after* the turn
and diffing it against what was sampled: the glue is the text after the assistant's content
in that render (found by searching backwards from the new user message, so templates that
drop or rewrite *earlier* turns do not matter), and for templates that rewrite the turn
itself (a Qwen3-style template deleting ``<think>…</think>`` from history) the content is
re-anchored on the part the template keeps. The glue is text, encoded on its own (never a
token diff), and a turn terminator the sampler already emitted is not repeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedagent.rollout.prompts import render_chat

MIN_ANCHOR_CHARS = 8  # shorter re-anchoring candidates could match inside unrelated text


class GlueError(RuntimeError):
    """The assistant turn cannot be located in the re-rendered chat."""


def _anchors(content: str) -> list[str]:
    """Forms of an assistant message a template may keep when it renders it as history."""
    out = [content, content.strip()]
    if "</think>" in content:  # Qwen3-style: the reasoning block deleted
        out.append(content.rsplit("</think>", 1)[1].strip())
    lines = content.split("\n")
    out += ["\n".join(lines[k:]).strip() for k in range(1, len(lines))]  # a prefix dropped at a line break
    seen, keep = set(), []
    for i, a in enumerate(out):
        if a and a not in seen and (i < 2 or len(a) >= MIN_ANCHOR_CHARS):
            seen.add(a)
            keep.append(a)
    return keep


def turn_glue(rendered: str, content: str, next_user: str) -> str:
    """The text that follows the assistant turn ``content`` in ``rendered`` (the next render).

    ``rendered`` is the chat template's text of the chat with the assistant turn and the
    next user message ``next_user``, plus the generation prompt and answer prefix.
    """
    u = rendered.rfind(next_user)
    if u < 0:
        raise GlueError(
            "concat: the next user message is not in the re-rendered chat (the chat template rewrites user turns)"
        )
    for anchor in _anchors(content):
        e = rendered.rfind(anchor, 0, u)
        if e >= 0:
            return rendered[e + len(anchor) :]
    raise GlueError(
        f"concat: the assistant turn {content[:60]!r}… is not in the re-rendered chat "
        "(no form of it the template keeps was found)"
    )


@dataclass
class ConcatChat:
    """One session's growing chat: messages (for rendering) and the token context (for sampling)."""

    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, tokenizer, first_user: str, answer_format: str, max_prompt_tokens: int) -> "ConcatChat":
        """The first context: the rendered first user turn (left-truncated to the budget, like windowed)."""
        messages = [{"role": "user", "content": first_user}]
        ids = list(tokenizer.encode(render_chat(tokenizer, messages, answer_format), add_special_tokens=False))
        return cls(messages, ids[-max_prompt_tokens:])

    def extend(
        self,
        tokenizer,
        *,
        prefix: str,
        text: str,
        response_ids: list[int],
        finished: bool,
        next_user: str,
        answer_format: str,
    ) -> list[int]:
        """Append the sampled turn and the next user message; returns the glue ids appended."""
        content = prefix + text
        self.messages += [{"role": "assistant", "content": content}, {"role": "user", "content": next_user}]
        glue = turn_glue(render_chat(tokenizer, self.messages, answer_format), content, next_user)
        if finished and response_ids:
            # The sampler's stop token (e.g. <|im_end|>) is already in the context: not twice.
            stop_text = tokenizer.decode([response_ids[-1]], skip_special_tokens=False)
            if stop_text and glue.startswith(stop_text):
                glue = glue[len(stop_text) :]
        glue_ids = list(tokenizer.encode(glue, add_special_tokens=False))
        self.ids = self.ids + list(response_ids) + glue_ids
        return glue_ids
