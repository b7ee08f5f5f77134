"""Server optimizers: formulas (Reddi et al. Alg. 2) and exact resume of FedAdam state."""

from __future__ import annotations

import gc
import hashlib

import pytest
import torch

from fedagent.server.aggregate import aggregate
from fedagent.server.merge import merge
from fedagent.server.optimizers import FedAdam, FedYogi, make_optimizer
from fedagent.core.seeds import torch_generator
from test_aggregate import make_round


def test_fedadam_fedyogi_one_step_by_hand():
    g = torch_generator(7, "server-opt-test")
    w = torch.randn(50, generator=g, dtype=torch.float64)
    d = 1e-2 * torch.randn(50, generator=g, dtype=torch.float64)
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    m = (1 - b1) * d
    v_adam = b2 * tau**2 + (1 - b2) * d * d
    v_yogi = tau**2 - (1 - b2) * d * d * torch.sign(tau**2 - d * d)
    for cls, v in ((FedAdam, v_adam), (FedYogi, v_yogi)):
        opt = cls(lr, b1, b2, tau)
        st = opt.init_state(w.float())
        new = opt.step(w.float().clone(), d.float(), st)
        want = w + lr * m / (v.sqrt() + tau)
        assert torch.allclose(new.double(), want, rtol=1e-5, atol=1e-6), cls.name
        assert torch.allclose(st["v"].double(), v, rtol=1e-5, atol=1e-12), cls.name


def _hash_dir(d) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.iterdir())
        if p.name not in ("server.json", "manifest.json", "provenance.json")
    }  # these name input paths


def test_fedadam_resume_is_byte_identical(tmp_path):
    prev, prev_dir, clients, dirs = make_round(tmp_path, 3)
    aggregate(prev_dir, dirs, tmp_path / "agg1")
    # Round-2 clients start from somewhere else, so round 2 has a different delta.
    _, _, _, dirs2 = make_round(tmp_path / "b", 2)
    aggregate(tmp_path / "b" / "prev", dirs2, tmp_path / "agg2")
    hp = dict(lr=0.05, beta1=0.9, beta2=0.99, tau=1e-3)

    # Uninterrupted: one optimizer object lives across both rounds.
    opt = make_optimizer("fedadam", **hp)
    merge(prev_dir, tmp_path / "agg1", tmp_path / "cont" / "r1", opt, round_=1)
    merge(
        tmp_path / "cont" / "r1",
        tmp_path / "agg2",
        tmp_path / "cont" / "r2",
        opt,
        round_=2,
        prev_state_dir=tmp_path / "cont" / "r1",
    )

    # "Killed" after round 1: everything in memory is discarded, round 2 restarts from disk.
    opt = make_optimizer("fedadam", **hp)
    merge(prev_dir, tmp_path / "agg1", tmp_path / "kill" / "r1", opt, round_=1)
    del opt
    gc.collect()
    merge(
        tmp_path / "kill" / "r1",
        tmp_path / "agg2",
        tmp_path / "kill" / "r2",
        make_optimizer("fedadam", **hp),
        round_=2,
        prev_state_dir=tmp_path / "kill" / "r1",
    )

    a, b = _hash_dir(tmp_path / "cont" / "r2"), _hash_dir(tmp_path / "kill" / "r2")
    assert a == b and "model.safetensors" in a and "server_state.safetensors" in a
    # And the state really carried over: a fresh-state round 2 differs.
    merge(
        tmp_path / "kill" / "r1",
        tmp_path / "agg2",
        tmp_path / "fresh" / "r2",
        make_optimizer("fedadam", **hp),
        round_=2,
    )
    assert _hash_dir(tmp_path / "fresh" / "r2")["model.safetensors"] != a["model.safetensors"]


def test_one_fedadam_round_pinned_against_a_hand_computation(tmp_path):
    """A whole round (aggregate → merge) with FedAdam, against numbers worked by hand (issue 31).

    prev w, two clients (uniform weights): Δ̄ = mean(cᵢ − w); m = (1−β1)Δ̄; v = β2·τ² + (1−β2)Δ̄²
    (v starts at τ², not Flower's 0); w' = w + η·m/(√v + τ) (no bias correction, unlike Flower's
    FedAdam). E.g. the last element: Δ̄ = 0.001 → m = 1e-4, v = 0.99e-6 + 0.01e-6 = 1e-6, so
    w' = 1 + 0.1·1e-4/(1e-3 + 1e-3) = 1.005 exactly in real numbers.
    """
    import json
    import math

    from safetensors.torch import load_file

    from fedagent.model.hf_dir import save_model_dir

    w = [0.5, -0.25, 0.0, 1.0]
    deltas = ([0.01, -0.02, 0.0, 0.004], [0.03, 0.0, -0.01, -0.002])
    prev_dir = save_model_dir(tmp_path / "prev", {"w": torch.tensor(w, dtype=torch.float32)})
    dirs = [
        save_model_dir(
            tmp_path / f"c{i}",
            {"w": torch.tensor([a + b for a, b in zip(w, d)], dtype=torch.float32)},
            json_files={"metrics.json": {"num_samples": 1, "num_tokens": 1, "num_episodes": 1}},
        )
        for i, d in enumerate(deltas)
    ]
    aggregate(prev_dir, dirs, tmp_path / "agg")
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    merge(
        prev_dir,
        tmp_path / "agg",
        tmp_path / "r1",
        make_optimizer("fedadam", lr=lr, beta1=b1, beta2=b2, tau=tau),
        round_=1,
    )
    got = load_file(str(tmp_path / "r1" / "model.safetensors"))["w"].double().tolist()
    hand = []
    for wi, a, b in zip(w, *deltas):
        d = (a + b) / 2
        m, v = (1 - b1) * d, b2 * tau**2 + (1 - b2) * d * d
        hand.append(wi + lr * m / (math.sqrt(v) + tau))
    # the same numbers, written out (fp32 arithmetic: 1e-6 relative)
    pinned = [0.5618461549, -0.2914821816, -0.0236568485, 1.005]
    assert hand == pytest.approx(pinned, rel=1e-9, abs=1e-10)
    assert got == pytest.approx(pinned, rel=2e-6, abs=1e-7)
    state = load_file(str(tmp_path / "r1" / "server_state.safetensors"))
    assert state["v/w"].double().tolist() == pytest.approx([4.99e-6, 1.99e-6, 1.24e-6, 1.0e-6], rel=1e-5)
    assert state["m/w"].double().tolist() == pytest.approx([2e-3, -1e-3, -5e-4, 1e-4], rel=1e-4)  # fp32 inputs near 1
    assert json.loads((tmp_path / "r1" / "server.json").read_text())["optimizer"] == "fedadam"


def test_adaptive_optimizers_need_an_explicit_lr():
    """server.lr null: 1.0 for fedavg/fedavgm; fedadam/fedyogi refused naming server.lr (plan time
    and the merge job; seen failing when null fell back to 1.0 for every optimizer)."""
    from pathlib import Path

    from fedagent.core.config import ConfigError, load_config

    repo = Path(__file__).resolve().parent.parent
    for name in ("fedadam", "fedyogi"):
        with pytest.raises(ConfigError, match=r"config key 'server.lr': server.optimizer %s needs an explicit" % name):
            load_config(repo / "config" / "config.yaml", {"server.optimizer": name})
        with pytest.raises(ConfigError, match="config key 'server.lr'"):
            make_optimizer(name)
        assert make_optimizer(name, lr=0.01).lr == 0.01
    assert load_config(repo / "config" / "config.yaml", {"server.optimizer": "fedadam", "server.lr": 0.01})
    assert make_optimizer("fedavg").lr == 1.0 and make_optimizer("fedavgm").lr == 1.0
    assert load_config(repo / "config" / "config.yaml")["server"]["lr"] is None
