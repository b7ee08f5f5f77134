"""The GPU path's static-cache sampler, run on the CPU (compile off): same tokens as the CPU sampler."""

from __future__ import annotations

import pytest
import torch

from fake_env import build_tiny_model
from fedagent.model.policy import load_policy, sample
from fedagent.core.seeds import torch_generator
from fedagent.model.static_sampler import StaticSampler


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    d = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=11)
    return load_policy(d, threads=1)


def _prompts(tok):
    texts = [
        "go",
        "You are in the kitchen. There is a table and a key here, take it",
        "Your admissible actions are: 'go north', 'take key', 'look' and more",
    ]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def test_greedy_tokens_equal_the_cpu_sampler_at_any_batch_fill(policy):
    model, tok = policy
    ps = _prompts(tok)
    ref = sample(model, tok, ps, 10, 0.0, None)
    s = StaticSampler(model, tok, batch_size=4, max_prompt_tokens=64, max_new_tokens=10, mode="eager")
    for k in (3, 1, 2):  # padded rows and a reused (reset) cache change nothing
        got = s(model, tok, ps[:k], 10, 0.0, None)
        assert [g.response_ids for g in got] == [g.response_ids for g in ref[:k]]
        assert [g.text for g in got] == [g.text for g in ref[:k]]
        assert [g.finished for g in got] == [g.finished for g in ref[:k]]
    assert s.first_token_time is not None and s.tokens > 0


def test_sampling_is_seeded_by_the_callers_generator_only(policy):
    model, tok = policy
    ps = _prompts(tok)
    s = StaticSampler(model, tok, batch_size=3, max_prompt_tokens=64, max_new_tokens=8, mode="eager")
    before = torch.get_rng_state()
    a = s(model, tok, ps, 8, 1.0, torch_generator(5, "t"))
    s2 = StaticSampler(model, tok, batch_size=3, max_prompt_tokens=64, max_new_tokens=8, mode="eager")
    b = s2(model, tok, ps, 8, 1.0, torch_generator(5, "t"))
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    assert torch.equal(before, torch.get_rng_state())


def test_shape_limits_are_errors(policy):
    model, tok = policy
    s = StaticSampler(model, tok, batch_size=2, max_prompt_tokens=8, max_new_tokens=4, mode="eager")
    with pytest.raises(ValueError, match="batch size"):
        s(model, tok, _prompts(tok), 4, 0.0, None)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        s(model, tok, _prompts(tok)[1:2], 4, 0.0, None)
    with pytest.raises(ValueError, match="max_new_tokens"):
        s(model, tok, _prompts(tok)[:1], 5, 0.0, None)
    with pytest.raises(ValueError, match="Generator"):
        s(model, tok, _prompts(tok)[:1], 4, 1.0, None)


def test_non_finite_logits_are_a_clear_error_not_a_device_assert(policy, tmp_path):
    import copy

    model, tok = policy
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.get_output_embeddings().weight[5, 0] = float("nan")
    s = StaticSampler(broken, tok, batch_size=2, max_prompt_tokens=64, max_new_tokens=4, mode="eager")
    with pytest.raises(FloatingPointError, match="non-finite logits"):
        s(broken, tok, _prompts(tok)[:2], 4, 1.0, torch_generator(1, "t"))


def test_gumbel_pick_draws_from_the_tempered_softmax():
    """The fused pick is an exact draw from softmax(logits / T) (checked by frequency)."""
    from fedagent.model.static_sampler import _pick

    g = torch.Generator().manual_seed(3)
    p = torch.tensor([0.5, 0.3, 0.2])
    rows = 40000
    logits = p.log().expand(rows, 3).clone()
    for temperature in (1.0, 0.5):
        noise = torch.empty(rows, 3).exponential_(generator=g)
        tok, finite = _pick(logits, noise, torch.tensor(1.0 / temperature))
        assert bool(finite.all())
        freq = torch.bincount(tok, minlength=3).float() / rows
        want = torch.softmax(logits[0] / temperature, dim=-1)
        assert torch.allclose(freq, want, atol=0.01), (temperature, freq, want)
    tok, _ = _pick(logits, None, None)
    assert bool((tok == 0).all())
    bad = logits[:2].clone()
    bad[1, 1] = float("nan")
    _, finite = _pick(bad, torch.ones(2, 3), torch.tensor(1.0))
    assert finite.tolist() == [True, False]


def test_warmup_leaves_the_sampled_stream_unchanged(policy):
    model, tok = policy
    ps = _prompts(tok)
    plain = StaticSampler(model, tok, batch_size=3, max_prompt_tokens=64, max_new_tokens=8, mode="eager")
    warmed = StaticSampler(model, tok, batch_size=3, max_prompt_tokens=64, max_new_tokens=8, mode="eager")
    warmed.warmup(1.0)
    assert warmed.calls == 0 and warmed.first_token_time is None and warmed.tokens == 0
    for call in range(2):
        a = plain(model, tok, ps, 8, 1.0, torch_generator(5, "t", index=call))
        b = warmed(model, tok, ps, 8, 1.0, torch_generator(5, "t", index=call))
        assert [g.response_ids for g in a] == [g.response_ids for g in b]


def _masked_eager(s):
    """What mode "graph" records, run eagerly on the CPU: the step through the static-buffer
    dict and the in-graph 4-D mask (built from the 2-D mask and the slot being written)."""

    def step(tok, pos, cache_pos, mask, noise, inv_t):
        return s._masked_step({"tok": tok, "pos": pos, "slot": cache_pos, "mask": mask, "noise": noise, "inv_t": inv_t})

    s._decode = step
    return s


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graph_modes_masked_step_samples_what_the_plain_step_does(policy, temperature):
    model, tok = policy
    ps = _prompts(tok)
    plain = StaticSampler(model, tok, batch_size=4, max_prompt_tokens=64, max_new_tokens=10, mode="eager")
    masked = _masked_eager(
        StaticSampler(model, tok, batch_size=4, max_prompt_tokens=64, max_new_tokens=10, mode="eager")
    )
    for call, k in enumerate((3, 1, 2)):  # padded rows, reused cache
        gen = (lambda: torch_generator(5, "t", index=call)) if temperature else (lambda: None)
        a = plain(model, tok, ps[:k], 10, temperature, gen())
        b = masked(model, tok, ps[:k], 10, temperature, gen())
        assert [g.response_ids for g in a] == [g.response_ids for g in b]
    if not temperature:
        ref = sample(model, tok, ps, 10, 0.0, None)
        assert [g.response_ids for g in masked(model, tok, ps, 10, 0.0, None)] == [g.response_ids for g in ref]


def test_sampler_modes_are_checked(policy):
    model, tok = policy
    with pytest.raises(ValueError, match="sampler mode 'fast'"):
        StaticSampler(model, tok, batch_size=2, max_prompt_tokens=8, max_new_tokens=4, mode="fast")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StaticSampler(model, tok, batch_size=2, max_prompt_tokens=8, max_new_tokens=4, mode="graph")


def test_stats_count_the_real_calls_longest_prompts(policy):
    """metrics.json / eval_timings.json's ``sampler`` (GPU path): what the fixed width costs against the
    longest prompt of each call; warm-up calls are not counted."""
    model, tok = policy
    ps = _prompts(tok)
    s = StaticSampler(model, tok, batch_size=4, max_prompt_tokens=64, max_new_tokens=4, mode="eager")
    s.warmup(0.0)
    assert s.stats()["calls"] == 0 and s.stats()["longest_prompt_max"] is None
    s(model, tok, ps[:1], 4, 0.0, None)
    s(model, tok, ps, 4, 0.0, None)
    lens = [len(p) for p in ps]
    st = s.stats()
    assert st["calls"] == 2 and st["width"] == 64 and st["rows"] == 4
    assert st["longest_prompt_max"] == max(lens)
    assert st["longest_prompt_mean"] == round((lens[0] + max(lens)) / 2, 1)
    assert st["prompt_tokens_per_row"] == round((lens[0] + sum(lens)) / 4, 1)
    assert st["rows_filled"] == round(4 / 8, 3)


def test_width_buckets_sample_what_the_fixed_width_does_and_share_its_cache(policy):
    """Width buckets (issue 29): a call runs at the narrowest width holding its longest prompt; the
    greedy tokens equal the fixed-width sampler's and the CPU sampler's, at every width, for
    every call order, and the narrower caches are views of the widest's buffers."""
    model, tok = policy
    ps = _prompts(tok)
    lens = sorted(len(p) for p in ps)
    ref = sample(model, tok, ps, 10, 0.0, None)
    fixed = StaticSampler(model, tok, batch_size=4, max_prompt_tokens=64, max_new_tokens=10, mode="eager")
    widths = (lens[0], lens[0] + 3, 40)
    s = StaticSampler(model, tok, batch_size=4, max_prompt_tokens=64, max_new_tokens=10, mode="eager", widths=widths)
    # what mode "graph" records per width (the in-graph mask from the width's slots), run eagerly
    masked = _masked_eager(
        StaticSampler(model, tok, batch_size=4, max_prompt_tokens=64, max_new_tokens=10, mode="eager", widths=widths)
    )
    assert s.widths == (*widths, 64)
    for idx in ([0], [2, 0], [1], [0, 1, 2], [0]):  # narrow, wide, back to narrow: shared bytes reset per call
        got = s(model, tok, [ps[i] for i in idx], 10, 0.0, None)
        assert [g.response_ids for g in got] == [ref[i].response_ids for i in idx]
        got = masked(model, tok, [ps[i] for i in idx], 10, 0.0, None)
        assert [g.response_ids for g in got] == [ref[i].response_ids for i in idx]
        assert [g.response_ids for g in got] == [
            g.response_ids for g in fixed(model, tok, [ps[i] for i in idx], 10, 0.0, None)
        ]
    short = next(i for i, p in enumerate(ps) if len(p) == lens[0])
    s(model, tok, [ps[short]], 10, 0.0, None)
    assert s._w == lens[0]
    st = s.stats()
    assert st["widths"] == [*widths, 64] and sum(st["calls_per_width"].values()) == st["calls"] == 6
    assert st["calls_per_width"][str(lens[0])] >= 1
    widest = s._caches[64].layers[0].keys
    narrower = [w for w in s._index if w != 64]
    for w in narrower:
        k = s._caches[w].layers[0].keys
        assert k.data_ptr() == widest.data_ptr() and k.shape[2] == w + 10 and k.is_contiguous()
    assert narrower, "no narrower width was used"
    with pytest.raises(ValueError, match="sampler widths"):
        StaticSampler(model, tok, batch_size=4, max_prompt_tokens=64, max_new_tokens=10, mode="eager", widths=(64,))


def test_width_buckets_sampling_stream_equals_the_fixed_widths(policy):
    """With temperature, too: the Gumbel noise does not depend on the width a call ran at."""
    model, tok = policy
    ps = _prompts(tok)
    fixed = StaticSampler(model, tok, batch_size=3, max_prompt_tokens=64, max_new_tokens=8, mode="eager")
    s = StaticSampler(model, tok, batch_size=3, max_prompt_tokens=64, max_new_tokens=8, mode="eager", widths=(16, 32))
    s.warmup(1.0)
    for call, idx in enumerate(([0], [0, 1, 2], [2])):
        a = fixed(model, tok, [ps[i] for i in idx], 8, 1.0, torch_generator(5, "t", index=call))
        b = s(model, tok, [ps[i] for i in idx], 8, 1.0, torch_generator(5, "t", index=call))
        assert [g.response_ids for g in a] == [g.response_ids for g in b]


def test_compiled_prefill_samples_what_the_eager_prefill_does(policy, monkeypatch):
    """compile_prefill: a width's first prefill runs eagerly (its cache initialised outside any trace),
    later ones through torch.compile (Dynamo's eager backend here: the trace, not inductor's code);
    the greedy tokens are the CPU sampler's at every width."""
    import functools

    model, tok = policy
    ps = _prompts(tok)
    ref = sample(model, tok, ps, 10, 0.0, None)
    traced = []
    real_compile = torch.compile

    def compile_eager(fn, **kw):
        traced.append(fn.__name__)
        return real_compile(fn, backend="eager", **{k: v for k, v in kw.items() if k != "mode"})

    monkeypatch.setattr(torch, "compile", compile_eager)
    for widths, compiled in (((), 3), ((32,), 4)):
        traced.clear()
        s = StaticSampler(
            model,
            tok,
            batch_size=4,
            max_prompt_tokens=64,
            max_new_tokens=10,
            mode="eager",
            compile_prefill=True,
            widths=widths,
        )
        assert traced == ["_prefill"]
        calls = []
        s._prefill_compiled = functools.partial(lambda f, *a: calls.append(1) or f(*a), s._prefill_compiled)
        for idx in ([0], [0, 1, 2], [0], [1, 2]):
            got = s(model, tok, [ps[i] for i in idx], 10, 0.0, None)
            assert [g.response_ids for g in got] == [ref[i].response_ids for i in idx]
        # one width: its first prefill initialises the cache eagerly, the rest are compiled; with
        # buckets every cache is initialised (as views of the widest's) before its first prefill
        assert len(calls) == compiled


def test_compile_graph_modes_step_traces_and_samples_what_the_plain_step_does(policy, monkeypatch):
    """Mode "compile_graph" records ``torch.compile(_masked_step)`` per width (the CUDA graph needs a
    GPU; here Dynamo traces the step with its eager backend and the step runs as the graph would
    run it): the same tokens as the plain step, at every width, greedy and sampling."""
    model, tok = policy
    ps = _prompts(tok)
    with pytest.raises(ValueError, match="'compile_graph' needs a CUDA device"):
        StaticSampler(model, tok, batch_size=2, max_prompt_tokens=8, max_new_tokens=4, mode="compile_graph")
    real_compile = torch.compile
    monkeypatch.setattr(
        torch,
        "compile",
        lambda fn, **kw: real_compile(fn, backend="eager", **{k: v for k, v in kw.items() if k != "mode"}),
    )
    plain = StaticSampler(model, tok, batch_size=4, max_prompt_tokens=64, max_new_tokens=10, mode="eager")
    s = StaticSampler(model, tok, batch_size=4, max_prompt_tokens=64, max_new_tokens=10, mode="eager", widths=(32,))
    s._step_fn = torch.compile(s._masked_step, fullgraph=False, dynamic=False)  # what __init__ builds on cuda
    s._decode = lambda tok_, pos, cache_pos, mask, noise, inv_t: s._step_fn(
        {"tok": tok_, "pos": pos, "slot": cache_pos, "mask": mask, "noise": noise, "inv_t": inv_t}
    )
    for call, idx in enumerate(([0], [0, 1, 2], [1])):
        for temperature in (0.0, 1.0):
            gen = (lambda: torch_generator(5, "t", index=call)) if temperature else (lambda: None)
            a = plain(model, tok, [ps[i] for i in idx], 10, temperature, gen())
            b = s(model, tok, [ps[i] for i in idx], 10, temperature, gen())
            assert [g.response_ids for g in a] == [g.response_ids for g in b]


def test_each_widths_index_tensors_are_made_once_and_kept(policy):
    """A recorded CUDA graph (mode "graph") reads ``_slots`` at its captured address: a call must never
    replace a width's index tensors (a fresh tensor per call would leave the graph reading freed
    memory the allocator hands to other tensors, silently changing the attention mask)."""
    model, tok = policy
    ps = _prompts(tok)
    s = StaticSampler(
        model,
        tok,
        batch_size=4,
        max_prompt_tokens=64,
        max_new_tokens=4,
        mode="eager",
        widths=(min(len(p) for p in ps),),
    )
    seen = {}
    for idx in ([0], [0, 1, 2], [0], [1, 2], [0]):
        s(model, tok, [ps[i] for i in idx], 4, 0.0, None)
        ids = (s._slots.data_ptr(), s._cache_positions.data_ptr(), id(s._slots), id(s._cache_positions))
        assert seen.setdefault(s._w, ids) == ids, f"width {s._w}: index tensors replaced between calls"
    assert len(seen) == 2
