"""Server optimizers: formulas (Reddi et al. Alg. 2) and exact resume of FedAdam state."""

from __future__ import annotations

import gc
import hashlib

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
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.name not in ("server.json", "manifest.json", "provenance.json")}  # these name input paths


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
    merge(tmp_path / "cont" / "r1", tmp_path / "agg2", tmp_path / "cont" / "r2", opt, round_=2,
          prev_state_dir=tmp_path / "cont" / "r1")

    # "Killed" after round 1: everything in memory is discarded, round 2 restarts from disk.
    opt = make_optimizer("fedadam", **hp)
    merge(prev_dir, tmp_path / "agg1", tmp_path / "kill" / "r1", opt, round_=1)
    del opt
    gc.collect()
    merge(tmp_path / "kill" / "r1", tmp_path / "agg2", tmp_path / "kill" / "r2", make_optimizer("fedadam", **hp),
          round_=2, prev_state_dir=tmp_path / "kill" / "r1")

    a, b = _hash_dir(tmp_path / "cont" / "r2"), _hash_dir(tmp_path / "kill" / "r2")
    assert a == b and "model.safetensors" in a and "server_state.safetensors" in a
    # And the state really carried over: a fresh-state round 2 differs.
    merge(tmp_path / "kill" / "r1", tmp_path / "agg2", tmp_path / "fresh" / "r2", make_optimizer("fedadam", **hp),
          round_=2)
    assert _hash_dir(tmp_path / "fresh" / "r2")["model.safetensors"] != a["model.safetensors"]
