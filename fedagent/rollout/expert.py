"""Expert answers in the rollout's own format: what the warm start's demonstrations are made of.

An expert (the env service's ``/expert_batch``: TextWorld's walkthrough, ALFWorld's planner,
WebShop's oracle) names an action; :func:`expert_generation` writes the answer a model would have
had to produce for it, after the same prompt and the same prefilled answer start as a sampled turn
(:func:`fedagent.rollout.prompts.response_prefix`), ending with the chat turn's end token. The
episode loop (:func:`fedagent.rollout.episode.run_episodes` with ``expert=True``) steps the env
with it as with a sampled answer, so a demonstration's turns are samples of the training format.
"""

from __future__ import annotations

from fedagent.model.policy import Generation

# The reasoning an expert answer carries (the rollout format requires one in think_action).
THOUGHT = "The goal is not reached yet. The admissible action that moves toward it now is: {action}."
END_OF_TURN = "<|im_end|>"  # ChatML's end of a turn (SmolLM2); else the tokenizer's eos


def answer_text(action: str, answer_format: str) -> str:
    """The answer after its prefilled start (``<think>`` / ``<action>``) for ``action``."""
    if answer_format == "think_action":
        return f"{THOUGHT.format(action=action)}</think><action>{action}</action>"
    if answer_format == "action":
        return f"{action}</action>"
    raise ValueError(f"unknown answer_format {answer_format!r}")


def end_of_turn_id(tokenizer) -> int:
    """The token that ends an answer: ChatML's ``<|im_end|>`` when the vocabulary has it, else eos."""
    vocab = tokenizer.get_vocab()
    if END_OF_TURN in vocab:
        return int(vocab[END_OF_TURN])
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has neither <|im_end|> nor an eos token to end an answer with")
    return int(tokenizer.eos_token_id)


def expert_generation(tokenizer, prompt_ids: list[int], action: str | None, answer_format: str) -> Generation:
    """The :class:`Generation` of the expert's answer for ``action`` after ``prompt_ids``.

    ``action`` None (the expert has no move: its episode is over) gives an empty action, which
    the env parses as a no-op.
    """
    text = answer_text(action or "", answer_format)
    ids = list(tokenizer.encode(text, add_special_tokens=False)) + [end_of_turn_id(tokenizer)]
    return Generation(prompt_ids=list(prompt_ids), response_ids=ids, text=text, finished=True)
