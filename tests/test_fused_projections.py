"""Merged q/k/v and gate/up projections (the GPU sampler's ``fused``), checked on the CPU against the unfused model."""

from __future__ import annotations

import copy

import pytest
import torch

from fake_env import build_tiny_model
from fedagent.model.base_model_random import build_random_model
from fedagent.model.fused_projections import fuse_projections, is_fused
from fedagent.model.policy import load_policy, sample
from fedagent.model.static_sampler import StaticSampler
from test_scale import tiny_architecture


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def policy(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    # qwen2: q/k/v biases, grouped KV heads, an untied LM head
    build_random_model(
        f"random:{tiny_architecture(d / 'arch', model_type=request.param, tied=request.param == 'llama')}",
        d / "model",
        seed=3,
    )
    return load_policy(d / "model", threads=1)


def _batch():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def _logits(model):
    ids, mask, pos = _batch()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


def test_a_fused_model_computes_the_same_logits_and_keeps_its_parameters(policy):
    model, _ = policy
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == len(model.model.layers) and is_fused(fused)
    assert fuse_projections(fused) == len(model.model.layers)  # idempotent
    # the parameters a checkpoint, an optimizer or the weight sync see: same names, order, shapes, values
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in model.named_parameters()]
    for (_, a), (_, b) in zip(fused.named_parameters(), model.named_parameters()):
        assert a.shape == b.shape and torch.equal(a, b)
    assert list(fused.state_dict()) == list(model.state_dict())
    torch.testing.assert_close(_logits(fused), _logits(model), rtol=1e-5, atol=1e-5)
    attn = fused.model.layers[0].self_attn
    assert attn._fused_qkv_weight.shape[0] == sum(m.weight.shape[0] for m in (attn.q_proj, attn.k_proj, attn.v_proj))


def test_weights_copied_into_a_fused_model_reach_its_merged_projections(policy):
    """The train job's per-epoch sync (``dst.copy_(src)`` over ``parameters()``) must move the merged
    tensors too. Seen failing with the modules' parameters as copies of the merged tensor, not views."""
    model, _ = policy
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    rollout = copy.deepcopy(model)
    fuse_projections(rollout)
    before = _logits(rollout)
    with torch.no_grad():
        for dst, src in zip(rollout.parameters(), trained.parameters()):
            dst.copy_(src)
    after = _logits(rollout)
    assert not torch.allclose(after, before, atol=1e-3)
    torch.testing.assert_close(after, _logits(trained), rtol=1e-5, atol=1e-5)


def test_the_fused_static_sampler_gives_the_cpu_samplers_greedy_tokens(tmp_path):
    model, tok = load_policy(build_tiny_model(tmp_path / "m", seed=11), threads=1)
    ps = [tok.encode(t, add_special_tokens=False) for t in ("go", "You are in the kitchen. Take the key")]
    ref = sample(model, tok, ps, 10, 0.0, None)
    s = StaticSampler(model, tok, batch_size=3, max_prompt_tokens=32, max_new_tokens=10, mode="eager", fused=True)
    assert is_fused(model)
    got = s(model, tok, ps, 10, 0.0, None)
    assert [g.response_ids for g in got] == [g.response_ids for g in ref]


def test_a_fused_model_cast_afterwards_is_an_error_not_stale_weights(tmp_path):
    model, tok = load_policy(build_tiny_model(tmp_path / "m", seed=11), threads=1)
    s = StaticSampler(model, tok, batch_size=2, max_prompt_tokens=16, max_new_tokens=4, mode="eager", fused=True)
    model.to(torch.float64)  # new storage for every parameter; the merged tensors stay as they were
    with pytest.raises(RuntimeError, match=r"no longer view .*\.to\(\)"):
        s(model, tok, [[5, 6, 7]], 4, 0.0, None)


def test_an_unsupported_architecture_is_refused_before_anything_changes():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ValueError, match="has no model.layers"):
        fuse_projections(model)
    assert not is_fused(model)


def test_dynamo_traces_the_fused_forward_in_one_graph(policy):
    """The sampler's compiled modes trace the fused forward: it must add no graph break (a break would
    split the decode step's fused kernels and CUDA graph)."""
    model, _ = policy
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    ids, mask, pos = _batch()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda i, m, p: fused(input_ids=i, attention_mask=m, position_ids=p).logits)(
        ids, mask, pos
    )
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
