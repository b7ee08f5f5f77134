"""Concat rollout mode and the windowed prompt budget (issue 11, must-show 4 and the windowed detail).

Concat: the whole episode is one token sequence; the model generates each turn from exactly
the ids the trainer later sees, the loss mask covers exactly the model's own tokens, and the
turn glue survives chat templates that rewrite the assistant turn or drop earlier turns.
Windowed: the prompt the policy generated from is the prompt stored for training (both cut
to ``max_prompt_tokens`` from the left).
"""

from __future__ import annotations

import pytest
import torch

from fake_env import FakeEnv, build_tiny_model
from fedagent.model.policy import load_policy, sample
from fedagent.rollout.concat import ConcatChat, GlueError, turn_glue
from fedagent.rollout.episode import run_episodes
from fedagent.rollout.prompts import render_chat
from fedagent.train import grpo


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = build_tiny_model(tmp_path_factory.mktemp("tiny_concat") / "m", seed=5)
    return load_policy(d, threads=1)


class Recorder:
    """policy.sample, recording every (context, generation) the rollout asked for."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, tokenizer, prompts, max_new_tokens, temperature, generator):
        gens = sample(model, tokenizer, prompts, max_new_tokens, temperature, generator)
        self.calls += [(list(p), g) for p, g in zip(prompts, gens)]
        return gens


def _play(tiny, mode, **kw):
    model, tok = tiny
    rec = Recorder()
    args = dict(
        max_turns=3,
        max_new_tokens=6,
        temperature=1.0,
        generator=torch.Generator().manual_seed(3),
        session_prefix="t",
        max_prompt_tokens=2048,
        rollout_mode=mode,
        sampler=rec,
    )
    args.update(kw)
    trajs = run_episodes(model, tok, FakeEnv(max_turns=3), [0, 1], **args)
    return trajs, rec


def test_concat_loss_mask_covers_exactly_the_models_tokens(tiny):
    _, tok = tiny
    trajs, rec = _play(tiny, "concat")
    samples = grpo.episode_samples(trajs, [0, 0], invalid_penalty=0.1)
    assert len(samples) == 2
    for traj, s in zip(trajs, samples):
        seq = s.prompt_ids + s.response_ids
        mask = [0] * len(s.prompt_ids) + s.response_mask
        calls = [c for c in rec.calls if any(c[0] == t.prompt_ids for t in traj.turns)]
        assert len(calls) == traj.n_turns == 3
        model_positions = set()
        for ctx, g in calls:
            # the context generated from is, token for token, the head of the trained sequence
            assert seq[: len(ctx)] == ctx
            assert seq[len(ctx) : len(ctx) + len(g.response_ids)] == g.response_ids
            model_positions |= set(range(len(ctx), len(ctx) + len(g.response_ids)))
        assert {i for i, m in enumerate(mask) if m} == model_positions
        assert s.trained_count() == sum(len(g.response_ids) for _, g in calls)
        # the masked-out glue holds the observations as user turns and the turn boundaries
        glue = tok.decode([t for t, m in zip(seq, mask) if not m][len(s.prompt_ids) :])
        assert glue.count("<|im_start|>user") == 2 and glue.count("<|im_start|>assistant") == 2
        assert "You are now at step 2" in glue and "You are now at step 3" in glue
        assert s.reward == pytest.approx(traj.episode_return - 0.1 * sum(not t.valid for t in traj.turns))


def test_concat_episode_ends_at_the_context_budget(tiny):
    trajs, rec = _play(tiny, "concat", max_prompt_tokens=500)
    for t in trajs:
        assert 1 <= t.n_turns < 3
        assert all(len(x.prompt_ids) <= 500 for x in t.turns)
    assert all(len(ctx) <= 500 for ctx, _ in rec.calls)


def test_a_context_that_is_not_the_generated_one_is_refused():
    t0 = type("T", (), {})
    turns = []
    for p, r in (([1, 2, 3], [4, 5]), ([1, 2, 3, 4, 9, 7], [8])):  # 9 ≠ 5: not the sampled context
        t = t0()
        t.prompt_ids, t.response_ids, t.valid = p, r, True
        turns.append(t)
    traj = type("Tr", (), {"turns": turns, "episode_return": 1.0, "seed": 0})()
    with pytest.raises(RuntimeError, match="not a prefix"):
        grpo.episode_samples([traj], [0], 0.1)


# A Qwen3-style template: a finished assistant turn is rendered without its <think>…</think>
# block, and only the last 4 messages are kept (earlier turns dropped).
REWRITING = (
    "{% for m in messages[-4:] %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and '</think>' in m['content'] %}"
    "{{ m['content'].split('</think>')[-1].lstrip('\n') }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _glue_text(tok, template, contents, nxt):
    old = tok.chat_template
    tok.chat_template = template
    try:
        msgs = [{"role": "user", "content": "first"}]
        for i, c in enumerate(contents):
            msgs += [
                {"role": "assistant", "content": c},
                {"role": "user", "content": nxt if i == len(contents) - 1 else f"obs {i}"},
            ]
        return turn_glue(render_chat(tok, msgs), contents[-1], nxt)
    finally:
        tok.chat_template = old


def test_glue_survives_templates_that_rewrite_or_drop_turns(tiny):
    _, tok = tiny
    want = "<|im_end|>\n<|im_start|>user\nYou see a chest.<|im_end|>\n<|im_start|>assistant\n<think>"
    act = "<think>the chest is here so I open it</think><action>open chest</action>"
    # the template keeps the turn verbatim (ChatML of the tiny model)
    assert _glue_text(tok, tok.chat_template, [act], "You see a chest.") == want
    # Qwen3-style: the reasoning block of the finished turn is deleted when rendered as history
    assert _glue_text(tok, REWRITING, [act], "You see a chest.") == want
    # earlier identical turns, some dropped by the template: the glue is after the *last* turn
    assert _glue_text(tok, REWRITING, [act, act, act], "You see a chest.") == want
    with pytest.raises(GlueError):
        turn_glue("<|im_start|>user\nhello<|im_end|>\n", "<think>gone entirely</think>", "hello")


def test_concat_rollout_under_a_rewriting_template_keeps_the_turn_boundaries(tiny):
    """The generated-from context keeps <|im_end|> + the user turn after each answer."""
    model, tok = tiny
    old = tok.chat_template
    tok.chat_template = REWRITING
    try:
        chat = ConcatChat.start(tok, "first", "think_action", 512)
        head = list(chat.ids)
        ans = tok.encode("a b</think><action>look</action>", add_special_tokens=False)
        glue = chat.extend(
            tok,
            prefix="<think>",
            text="a b</think><action>look</action>",
            response_ids=ans,
            finished=False,
            next_user="You see a chest.",
            answer_format="think_action",
        )
    finally:
        tok.chat_template = old
    assert chat.ids == head + ans + glue
    assert (
        tok.decode(glue) == "<|im_end|>\n<|im_start|>user\nYou see a chest.<|im_end|>\n<|im_start|>assistant\n<think>"
    )


def test_concat_glue_does_not_repeat_the_sampled_stop_token(tiny):
    _, tok = tiny
    chat = ConcatChat.start(tok, "first", "action", 512)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ans = tok.encode("look</action>", add_special_tokens=False) + [end]
    glue = chat.extend(
        tok,
        prefix="<action>",
        text="look</action>",
        response_ids=ans,
        finished=True,
        next_user="obs",
        answer_format="action",
    )
    assert tok.decode(glue).startswith("\n<|im_start|>user\nobs")
    text = tok.decode(chat.ids)
    assert text.count("<|im_end|>") == 4 and "<|im_end|><|im_end|>" not in text  # system, user, answer, user


def test_windowed_generation_prompt_is_the_stored_prompt_cut_to_the_budget(tiny):
    """Left truncation: the policy generated from the same (cut) ids the training sample holds."""
    from fedagent.rollout.prompts import windowed_prompt

    model, tok = tiny
    budget = 64
    trajs, rec = _play(tiny, "windowed", max_prompt_tokens=budget)
    samples = grpo.turn_samples(trajs, [0, 0], 0.1)
    assert len(rec.calls) == len(samples) == sum(t.n_turns for t in trajs)
    generated = sorted((tuple(ctx), tuple(g.response_ids)) for ctx, g in rec.calls)
    assert all(len(ctx) == budget for ctx, _ in generated)  # the prompts are longer than the budget: cut
    # every training sample is (the exact ids generated from, the ids generated)
    assert sorted((tuple(s.prompt_ids), tuple(s.response_ids)) for s in samples) == generated
    # the cut keeps the end: the answer prefix and the assistant header the model continues from
    full = tok.encode(
        render_chat(
            tok,
            [
                {
                    "role": "user",
                    "content": windowed_prompt(
                        "do the right thing in fake-000",
                        "You are in room 0. There is a chest here.",
                        ["go north", "go south", "take key", "open chest", "look"],
                        [],
                        template="textworld",
                    ),
                }
            ],
        ),
        add_special_tokens=False,
    )
    assert rec.calls[0][0] == full[-budget:]


@pytest.mark.parametrize("mode", ["windowed", "concat"])
def test_the_env_names_the_prompt_family(tiny, mode):
    """A WebShop env's episodes are prompted in the WebShop family, in both rollout modes."""
    from fedagent.rollout.prompts import concat_turn_prompt, windowed_prompt

    model, tok = tiny
    rec = Recorder()
    env = FakeEnv(max_turns=2, prompt_template="webshop")
    trajs = run_episodes(
        model,
        tok,
        env,
        [0],
        max_turns=2,
        max_new_tokens=6,
        temperature=1.0,
        generator=torch.Generator().manual_seed(3),
        session_prefix="w",
        max_prompt_tokens=4096,
        rollout_mode=mode,
        sampler=rec,
    )
    probe = FakeEnv(prompt_template="webshop")
    probe.create("p")
    r = probe.reset("p", 0)
    first = windowed_prompt(r["task"], r["observation"], r["admissible_commands"], [], template="webshop")
    render = lambda msgs: tok.encode(render_chat(tok, msgs), add_special_tokens=False)  # noqa: E731
    assert rec.calls[0][0] == render([{"role": "user", "content": first}])
    s2 = probe.step("p", "<think>" + trajs[0].turns[0].text)  # replay turn 1 (answer prefix + text)
    if mode == "windowed":
        second = windowed_prompt(
            r["task"],
            s2["observation"],
            s2["admissible_commands"],
            [(r["observation"], s2["action"])],
            template="webshop",
        )
        assert rec.calls[1][0] == render([{"role": "user", "content": second}])
    else:
        nxt = concat_turn_prompt(s2["observation"], s2["admissible_commands"], 2, template="webshop")
        assert nxt.startswith(f"You are now at step 2 and your current observation is: {s2['observation']}.\n")
        assert rec.calls[1][0][: len(rec.calls[0][0])] == rec.calls[0][0]
        assert tok.decode(rec.calls[1][0]).endswith(nxt + "<|im_end|>\n<|im_start|>assistant\n<think>")
