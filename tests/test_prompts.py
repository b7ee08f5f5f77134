"""Windowed prompt templates (FACTS §4/§5), one family per env, and chat formatting with left truncation."""

from __future__ import annotations

import functools
import hashlib
import json

import pytest

from fedagent.model.base_model_tiny import build_tokenizer
from fedagent.rollout import prompts
from fedagent.rollout.prompts import RESPONSE_PREFIX, encode_prompt

# The tests above the per-environment section cover the TextWorld family (the default env's).
windowed_prompt = functools.partial(prompts.windowed_prompt, template="textworld")

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


# ---------------------------------------------------------------- per-environment families
TW_ACTIONS = ["go north", "take key", "help", "open chest"]
TW_HISTORY = [("You are in a hall.", "go north"), ("You are in a kitchen.", "take key"), ("obs three", "open chest")]
_TW_THINK = (
    "Now it's your turn to take an action.\n"
    "You should first reason step-by-step about the current situation. This reasoning process MUST be "
    "enclosed within <think> </think> tags.\n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and "
    "present it within <action> </action> tags.\n"
    "Keep the reasoning to one short sentence, then give the action. "
    "Example: <think>The door is closed, so I open it.</think><action>open door</action>"
)
_TW_ACT = (
    "Now it's your turn to take an action.\n"
    "Answer with exactly one of the admissible actions above, copied as written, "
    "within <action> </action> tags."
)
_TW_LIST = "Your admissible actions of the current situation are: [\n'go north',\n'take key',\n'open chest',\n].\n\n"


def _textworld_cases() -> list[str]:
    """22 TextWorld renderings over both formats, 0/1/3 steps and history 2/0/1, concat turns."""
    out = []
    for fmt in ("think_action", "action"):
        for n in (0, 1, 3):
            for hl in (2, 0, 1):
                out.append(
                    prompts.windowed_prompt(
                        "find the key", "You see a chest.", TW_ACTIONS, TW_HISTORY[:n], hl, fmt, template="textworld"
                    )
                )
        out.append(prompts.concat_turn_prompt("You see a chest.", TW_ACTIONS, 4, fmt, template="textworld"))
        out.append(prompts.windowed_prompt("", "no task", TW_ACTIONS, [], 2, fmt, template="textworld"))
    return out


def test_textworld_prompts_are_byte_identical_to_before_the_per_env_families():
    """The default run's prompts did not move: literal renderings, plus the sha256 of 22 cases
    computed with the single-template code (commit edfe8d2) before the families were added."""
    assert prompts.windowed_prompt("find the key", "You see a chest.", TW_ACTIONS, [], template="textworld") == (
        "You are an expert agent playing a text-based game. Your task is to: find the key\n"
        "Your current observation is: You see a chest.\n" + _TW_LIST + _TW_THINK
    )
    assert prompts.windowed_prompt(
        "find the key", "You see a chest.", TW_ACTIONS, TW_HISTORY, template="textworld"
    ) == (
        "You are an expert agent playing a text-based game. Your task is to: find the key\n"
        "Prior to this step, you have already taken 3 step(s). Below are the most recent 2 observations and the "
        "corresponding actions you took:\n"
        "[Observation 2: 'You are in a kitchen.', Action 2: 'take key']\n"
        "[Observation 3: 'obs three', Action 3: 'open chest']\n"
        "You are now at step 4 and your current observation is: You see a chest.\n" + _TW_LIST + _TW_THINK
    )
    assert prompts.concat_turn_prompt("You see a chest.", TW_ACTIONS, 4, "action", template="textworld") == (
        "You are now at step 4 and your current observation is: You see a chest.\n" + _TW_LIST + _TW_ACT
    )
    digest = hashlib.sha256(json.dumps(_textworld_cases()).encode()).hexdigest()
    assert digest == "514c11ee334cf8cedeceebd8c58b72c4c6b1fa39d07e60e39ade61ec9c5ea9c0"


WS_TASK = "i need a red cotton shirt in size large, and price lower than 40.00 dollars"
WS_ACTIONS = ["search[<your query>]", "click[search]"]
WS_RESULTS = ["click[back to search]", "click[next >]", "click[b0001]", "click[b0002]"]
# verl-agent's WebShop wording (agent_system/environments/prompts/webshop.py), "\u2011" = non-breaking hyphen
_WS_HEAD = "\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce environment."
_WS_THINK = (
    "Now it's your turn to take one action for the current step.\n"
    "You should first reason step-by-step about the current situation, then think carefully which admissible "
    "action best advances the shopping goal. This reasoning process MUST be enclosed within <think> </think> "
    "tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and present "
    "it within <action> </action> tags.\n"
)
_WS_FIRST = (
    _WS_HEAD + " \n"
    f"Your task is to: {WS_TASK}.\n"
    "Your current observation is: 'Search'.\n"
    "Your admissible actions of the current situation are: \n"
    "[\n'search[<your query>]',\n'click[search]',\n].\n\n" + _WS_THINK
)


def test_webshop_first_turn_is_the_reference_no_history_template():
    assert prompts.windowed_prompt(WS_TASK, "'Search'", WS_ACTIONS, [], template="webshop") == _WS_FIRST


def test_webshop_later_turn_shows_the_last_two_steps():
    page = "'Back to Search' [SEP] 'Page 1 (Total results: 50)' [SEP] 'Next >' [SEP] 'B0001' [SEP] 'Red Shirt'"
    history = [("'Search'", "search[red shirt]"), (page, "click[next >]"), ("'Page 2'", "click[< prev]")]
    got = prompts.windowed_prompt(WS_TASK, page, WS_RESULTS, history, template="webshop")
    assert got == (
        _WS_HEAD + "\n"
        f"Your task is to: {WS_TASK}.\n"
        "Prior to this step, you have already taken 3 step(s). Below are the most recent 2 observations and the "
        "corresponding actions you took: "
        f"[Observation 2: '{page}', Action 2: 'click[next >]']\n"
        "[Observation 3: ''Page 2'', Action 3: 'click[< prev]']\n"
        f"You are now at step 4 and your current observation is: {page}.\n"
        "Your admissible actions of the current situation are: \n"
        "[\n'click[back to search]',\n'click[next >]',\n'click[b0001]',\n'click[b0002]',\n].\n\n" + _WS_THINK
    )
    one = prompts.windowed_prompt(WS_TASK, page, WS_RESULTS, history[:1], template="webshop")
    assert (
        "already taken 1 step(s). Below are the most recent 1 observations and the corresponding actions you "
        "took: [Observation 1: ''Search'', Action 1: 'search[red shirt]']\nYou are now at step 2 and"
    ) in one
    # history 0 (the reference's history_length <= 0): always the no-history template
    assert prompts.windowed_prompt(WS_TASK, "'Search'", WS_ACTIONS, history, 0, template="webshop") == _WS_FIRST


def test_webshop_prompt_over_13000_characters_falls_back_to_no_history():
    long_obs = "'" + "x" * 6000 + "'"
    history = [(long_obs, "click[b0001]"), (long_obs, "click[< prev]")]
    short = prompts.windowed_prompt(WS_TASK, "'Search'", WS_ACTIONS, history, template="webshop")
    assert len(short) > 12000 and "already taken 2 step(s)" in short  # history kept: under the cap
    page = "'" + "y" * 1000 + "'"
    got = prompts.windowed_prompt(WS_TASK, page, WS_ACTIONS, history, template="webshop")
    assert got == _WS_FIRST.replace("'Search'.", f"{page}.")  # over the cap: no history at all
    # the cap counts characters of the history rendering: exactly 13000 keeps it, 13001 drops it
    full = prompts.windowed_prompt(WS_TASK, "", WS_ACTIONS, history, template="webshop")
    for extra, kept in ((13000 - len(full), True), (13001 - len(full), False)):
        p = prompts.windowed_prompt(WS_TASK, "z" * extra, WS_ACTIONS, history, template="webshop")
        assert ("already taken 2 step(s)" in p) is kept
    from fedagent.envs.webshop.prompt import WEBSHOP_MAX_PROMPT_CHARS

    assert WEBSHOP_MAX_PROMPT_CHARS == 13000


def test_webshop_action_format_swaps_only_the_instruction():
    got = prompts.windowed_prompt(WS_TASK, "'Search'", WS_ACTIONS, [], answer_format="action", template="webshop")
    assert got == _WS_FIRST.replace(
        _WS_THINK,
        (
            "Now it's your turn to take one action for the current step.\n"
            "Answer with exactly one of the admissible actions above within <action> </action> tags, copied as written "
            "(in search[<your query>], write your search words in place of <your query>).\n"
        ),
    )
    turn = prompts.concat_turn_prompt("'Search'", WS_ACTIONS, 2, template="webshop")
    assert turn == (
        "You are now at step 2 and your current observation is: 'Search'.\n"
        "Your admissible actions of the current situation are: \n"
        "[\n'search[<your query>]',\n'click[search]',\n].\n\n" + _WS_THINK.rstrip("\n")
    )


AW_RESET = (
    "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, "
    "you see a cabinet 1, and a countertop 1.\n\nYour task is to: put a clean mug in coffeemachine."
)
AW_TASK = "put a clean mug in coffeemachine."
AW_ACTIONS = ["go to cabinet 1", "go to countertop 1", "inventory", "look", "help"]
_AW_LIST = (
    "Your admissible actions of the current situation are: ['go to cabinet 1'\n 'go to countertop 1'\n "
    "'inventory'\n 'look'].\n\n"
)
# verl-agent's ALFWorld wording (agent_system/environments/prompts/alfworld.py)
_AW_THINK = (
    "Now it's your turn to take an action.\n"
    "You should first reason step-by-step about the current situation. This reasoning process MUST be "
    "enclosed within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step and "
    "present it within <action> </action> tags.\n"
)
_AW_FIRST = (
    "\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
    f"Your current observation is: {AW_RESET}\n" + _AW_LIST + _AW_THINK
)


def test_alfworld_first_turn_has_no_task_line():
    got = prompts.windowed_prompt(AW_TASK, AW_RESET, AW_ACTIONS, [], template="alfworld")
    assert got == _AW_FIRST
    assert got.count("Your task is to:") == 1  # only inside the reset observation itself


def test_alfworld_later_turn_and_formats():
    history = [(AW_RESET, "go to cabinet 1"), ("You arrive at cabinet 1. The cabinet 1 is closed.", "open cabinet 1")]
    got = prompts.windowed_prompt(AW_TASK, "You open the cabinet 1.", AW_ACTIONS, history, template="alfworld")
    assert got == (
        "\nYou are an expert agent operating in the ALFRED Embodied Environment. "
        f"Your task is to: {AW_TASK}\n"
        "Prior to this step, you have already taken 2 step(s). Below are the most recent 2 observaitons and the "
        f"corresponding actions you took: [Observation 1: '{AW_RESET}', Action 1: 'go to cabinet 1']\n"
        "[Observation 2: 'You arrive at cabinet 1. The cabinet 1 is closed.', Action 2: 'open cabinet 1']\n"
        "You are now at step 3 and your current observation is: You open the cabinet 1.\n" + _AW_LIST + _AW_THINK
    )
    assert prompts.windowed_prompt(AW_TASK, AW_RESET, AW_ACTIONS, history, 0, template="alfworld") == _AW_FIRST
    act = prompts.windowed_prompt(AW_TASK, AW_RESET, AW_ACTIONS, [], answer_format="action", template="alfworld")
    assert act == _AW_FIRST.replace(_AW_THINK, _TW_ACT + "\n")
    turn = prompts.concat_turn_prompt("You open the cabinet 1.", AW_ACTIONS, 3, template="alfworld")
    assert turn == (
        "You are now at step 3 and your current observation is: You open the cabinet 1.\n"
        + _AW_LIST
        + _AW_THINK.rstrip("\n")
    )


def test_template_names_are_checked():
    with pytest.raises(ValueError, match="prompt_template"):
        prompts.windowed_prompt("t", "o", ACTIONS, [], template="webshopp")
    with pytest.raises(ValueError, match="prompt_template"):
        prompts.template_of({"observation": "o"})
    assert prompts.template_of({"prompt_template": "alfworld"}) == "alfworld"
    with pytest.raises(TypeError):
        prompts.windowed_prompt("t", "o", ACTIONS, [])  # the env's family is never implied


def test_a_prompt_family_is_found_once_per_process_and_an_unknown_one_is_looked_up_anew(monkeypatch):
    """The rollout loop asks for its family at every prompt of every turn, and listing the env kinds reads
    every installed distribution's entry points (≈ 6 ms: 0.43 s of host time per 64-row generation call in
    an ALFWorld rollout, bench/rollout_host.py). Seen failing with the family not kept (the entry points read
    at each of the 64 prompts)."""
    from fedagent.core import envs

    listed = []
    real = envs._entry_points
    monkeypatch.setattr(envs, "_entry_points", lambda: listed.append(1) or real())
    monkeypatch.setattr(envs, "_TEMPLATES", {})
    windowed_prompt("find the key", "You are in a hall.", ACTIONS, [])  # found (the specs not loaded yet: listed)
    assert listed
    listed.clear()
    for _ in range(64):
        windowed_prompt("find the key", "You are in a hall.", ACTIONS, [])
    assert envs.prompt_template("textworld") is envs.prompt_template("textworld")
    assert listed == []
    with pytest.raises(ValueError, match="nosuch"):  # not found: the kinds are listed again (a plugin added since)
        envs.prompt_template("nosuch")
    assert listed
