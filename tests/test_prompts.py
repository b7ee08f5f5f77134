"""Windowed prompt template (FACTS §4/§5) and chat formatting with left truncation."""

from __future__ import annotations

import pytest

from fedagent.base_model_tiny import build_tokenizer
from fedagent.rollout.prompts import RESPONSE_PREFIX, encode_prompt, windowed_prompt

ACTIONS = ["go north", "take key", "help"]


def test_first_turn_uses_no_history_template():
    p = windowed_prompt("find the key", "You are in a hall.", ACTIONS, [])
    assert "Your task is to: find the key" in p
    assert "You are in a hall." in p
    assert "already taken" not in p and "Observation 1" not in p
    assert "'go north',\n'take key'," in p
    assert "'help'" not in p
    assert "<think> </think>" in p and "<action> </action>" in p


def test_later_turn_keeps_last_two_steps():
    hist = [("obs one", "go north"), ("obs two", "take key"), ("obs three", "look")]
    p = windowed_prompt("find the key", "obs four", ACTIONS, hist)
    assert "already taken 3 step(s)" in p
    assert "Observation 1" not in p and "obs one" not in p
    assert "[Observation 2: 'obs two', Action 2: 'take key']" in p
    assert "[Observation 3: 'obs three', Action 3: 'look']" in p
    assert "You are now at step 4 and your current observation is: obs four" in p
    assert p.index("Observation 2") < p.index("Observation 3") < p.index("obs four")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_chat_template_and_generation_prompt(tok):
    content = windowed_prompt("t", "o", ACTIONS, [])
    ids = encode_prompt(tok, content, 10_000)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>")
    assert "<|im_start|>user\n" + content + "<|im_end|>" in text
    # The assistant turn is opened with the prefilled start of a well-formed answer.
    assert text.endswith("<|im_start|>assistant\n" + RESPONSE_PREFIX)


def test_left_truncation_keeps_the_tail(tok):
    content = windowed_prompt("t", "a long observation " * 50, ACTIONS, [])
    full = encode_prompt(tok, content, 100_000)
    cut = encode_prompt(tok, content, 64)
    assert len(full) > 64 and len(cut) == 64
    assert cut == full[-64:]
    with pytest.raises(ValueError):
        encode_prompt(tok, content, 0)


def test_action_answer_format_prompt_and_prefix():
    from fedagent.rollout.parsing import parse_action
    from fedagent.rollout.prompts import response_prefix

    p = windowed_prompt("find the key", "You are in a hall.", ACTIONS, [], answer_format="action")
    assert "<action> </action>" in p and "<think>" not in p and "Example" not in p
    tok = build_tokenizer()
    ids = encode_prompt(tok, p, 4096, answer_format="action")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<action>")
    assert response_prefix("action") == "<action>" and response_prefix() == RESPONSE_PREFIX
    assert parse_action("<action>take key</action>", require_think=False).valid
    assert not parse_action("<action>take key</action>").valid
    with pytest.raises(ValueError):
        windowed_prompt("t", "o", ACTIONS, [], answer_format="json")
