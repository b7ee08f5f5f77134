"""Action parsing from <think>…</think><action>…</action>."""

import pytest

from fedagent.rollout.parsing import parse_action


def test_valid_answer():
    p = parse_action("<think>the key is here</think><action>Take  Key</action>")
    assert p.valid and p.action == "take key"


def test_first_action_wins():
    assert parse_action("<think>x</think><action>go north</action><action>go south</action>").action == "go north"


@pytest.mark.parametrize(
    "text",
    [
        "<action>open door</action>",  # no think
        "<think>x</think> open door",  # no action tags
        "<think>x</think><action>  </action>",  # empty action
        "<think>想</think><action>open door</action>",  # CJK
    ],
)
def test_invalid_answers(text):
    assert not parse_action(text).valid


def test_fallback_is_tail_of_answer():
    p = parse_action("I will just say things and then open the door", fallback_chars=13)
    assert not p.valid and p.action == "open the door"


def test_non_string_rejected():
    with pytest.raises(TypeError):
        parse_action(None)
