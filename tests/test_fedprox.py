"""FedProx (issue 11, must-show 3): μ·(w − w_t) on the actor's gradient, never on a value head;
μ = 0 is exactly FedAvg (byte-identical client update)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from fake_env import FakeEnv, build_tiny_model
from fedagent.model.policy import load_policy
from fedagent.core.seeds import python_rng
from fedagent.train import fedprox, grpo
from fedagent.train.local import TrainParams, train_client
from fedagent.train.actor import grpo_epoch


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_prox") / "m", seed=6)


class WithValueHead(torch.nn.Module):
    """An actor with a scalar value head on the same module (PPO-style names: ``score.*``)."""

    def __init__(self, actor):
        super().__init__()
        self.actor = actor
        self.score = torch.nn.Linear(actor.config.hidden_size, 1)


def _drift(model, seed=0, scale=0.01):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in model.parameters():
            q.add_(scale * torch.randn(q.shape, generator=g))


def test_proximal_gradient_is_mu_times_drift_on_the_actor_and_zero_on_the_value_head(tiny_dir):
    model = WithValueHead(load_policy(tiny_dir, threads=1)[0])
    anchor = fedprox.snapshot(model)
    assert anchor and not any("score" in n for n in anchor)  # the value head takes no w_t
    assert fedprox.is_actor_param("actor.model.layers.0.mlp.up_proj.weight")
    assert not fedprox.is_actor_param("score.weight") and not fedprox.is_actor_param("critic.v_head.bias")
    start = {n: q.detach().clone() for n, q in model.named_parameters()}
    _drift(model)
    mu = 0.37
    fedprox.add_proximal_grad(model, anchor, mu)
    for n, q in model.named_parameters():
        if n.startswith("score."):
            assert q.grad is None, n
        else:
            assert torch.allclose(q.grad, mu * (q.detach() - start[n]), rtol=1e-6, atol=1e-9), n


def test_grpo_epoch_adds_the_proximal_term_before_clipping(tiny_dir):
    """One step's gradient with FedProx = the GRPO gradient + μ·(w − w_t), and the norm that
    clipping sees (reported grad_norm) includes it."""
    samples = [
        grpo.Sample([5, 6, 7], [40, 41], 1.0, 0, advantage=1.0),
        grpo.Sample([5, 6], [50, 51, 52], 0.0, 0, advantage=-1.0),
    ]
    mu = 0.5
    grads, norms = [], []
    for armed in (False, True):
        model, _ = load_policy(tiny_dir, threads=1)
        anchor = fedprox.snapshot(model)
        _drift(model, seed=1, scale=0.05)  # w ≠ w_t: mid-round weights
        p = TrainParams(mini_batch_size=2, kl_coef=0.0, fedprox_mu=mu if armed else 0.0, grad_clip=1e9)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        steps = grpo_epoch(model, None, opt, samples, p, python_rng(0, "t"), 0, prox_anchor=anchor if armed else None)
        grads.append({n: q.grad.clone() for n, q in model.named_parameters()})
        norms.append(steps[0]["grad_norm"])
        drift = {n: q.detach() - anchor[n] for n, q in model.named_parameters()}
    for n in grads[0]:
        assert torch.allclose(grads[1][n] - grads[0][n], mu * drift[n], rtol=1e-4, atol=1e-7), n
    want = torch.cat([g.flatten() for g in grads[1].values()]).norm()
    assert norms[1] == pytest.approx(float(want), rel=1e-5) and norms[1] != pytest.approx(norms[0], rel=1e-3)


# Two groups of three with reward variance (a learning signal) and several steps per round:
# w moves away from w_t after the first step, so the proximal term is live.
PARAMS = dict(
    base_seed=3,
    epochs=2,
    groups_per_epoch=2,
    group_size=3,
    max_turns=2,
    max_new_tokens=8,
    lr=1e-3,
    mini_batch_size=1,
    micro_batch_size=1,
    max_prompt_tokens=256,
    pool_size=4,
)


def _update(tiny_dir, out, monkeypatch=None, **kw):
    train_client(
        tiny_dir,
        tiny_dir,
        FakeEnv(mode="draw", win_if=lambda t: len(t) % 2 == 0),
        round=1,
        client=0,
        params=TrainParams.from_dict({**PARAMS, **kw}),
        threads=1,
        out_dir=out,
    )
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


def test_mu_zero_is_byte_identical_to_a_run_without_fedprox(tiny_dir, tmp_path, monkeypatch):
    import fedagent.train.local as local

    zero = _update(tiny_dir, tmp_path / "mu0", fedprox_mu=0.0)
    armed = _update(tiny_dir, tmp_path / "mu", fedprox_mu=0.5)

    def absent(*a, **k):  # the feature removed: any use of it fails the run
        raise AssertionError("FedProx used")

    monkeypatch.setattr(local.fedprox, "snapshot", absent)
    monkeypatch.setattr(local.fedprox, "add_proximal_grad", absent)
    plain = _update(tiny_dir, tmp_path / "plain")
    assert zero == plain
    assert armed != plain
