"""A server optimizer from outside the repository: a class in a package of its own plus ONE
registration line (its entry point, group ``fedagent.server_optimizers``), and nothing edited here.

The toy (``halfavg``: FedAvg with η scaled by its hyper-parameter ``half_scale``) is set in the config
like a built-in (``server.optimizer``, ``server.lr``, ``server.half_scale``); the tiny workflow runs
round 1 through real Snakemake (its jobs, forked by a warm server started with the plugin on its path,
find the entry point too); the merged model must be prev + η·half_scale·Δ̄ to the bit, and ``fedagent
verify`` (a fresh process) with the same flags must pass (and fail with another ``--half-scale``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import yaml

from fedagent.model.hf_dir import TensorReader, read_header, tensor_index
from workflow_helpers import REPO, RUN, make_workdir, run_snakemake

TOY = '''
from fedagent.server.bounds import axpy
from fedagent.server.optimizer_base import WEIGHT, Hparam, ServerOptimizer


class HalfAvg(ServerOptimizer):
    """FedAvg with η scaled: w ← w + (η·half_scale)·Δ̄."""

    name = "halfavg"
    HPARAMS = (Hparam("half_scale", 0.5, "the factor on η", exclusive_minimum=0.0),)

    def step(self, w, delta, state):
        return w.add_(delta, alpha=self.lr * self.half_scale)

    def bound(self, p, d, old, got):
        return {WEIGHT: axpy(p, self.lr * self.half_scale, d, 0.0)}
'''

# The one registration line (besides the distribution's name: the entry-point group's header).
ENTRY_POINTS = "[fedagent.server_optimizers]\nhalfavg = toyopt:HalfAvg\n"


def _plugin(root: Path) -> Path:
    """A distribution on sys.path: toyopt/ and toyopt-0.dist-info/ (METADATA, entry_points.txt)."""
    (root / "toyopt").mkdir(parents=True)
    (root / "toyopt" / "__init__.py").write_text(textwrap.dedent(TOY))
    info = root / "toyopt-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyopt\nVersion: 0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return root


def test_a_toy_server_optimizer_runs_a_round_and_verifies(tmp_path, monkeypatch):
    plugin = _plugin(tmp_path / "plugin")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(plugin)]))
    work = make_workdir(tmp_path / "work")
    cfg_path = work / "config" / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    lr, scale = 0.75, 0.25
    cfg.update(rounds=1, server={"optimizer": "halfavg", "lr": lr, "half_scale": scale})
    cfg_path.write_text(yaml.safe_dump(cfg))

    # The jobs go through a warm server started with this PYTHONPATH (as test_env_plugin's toy env does);
    # the fresh processes that must find the entry point too are Snakemake's (the plan) and verify's below.
    run_snakemake(work, f"{RUN}/round_001/model")

    run = work / RUN
    prev, agg, model = run / "round_000/model", run / "round_001/aggregate", run / "round_001/model"
    prev_idx, delta_idx, got_idx = tensor_index(prev), read_header(agg / "delta.safetensors"), tensor_index(model)
    assert set(prev_idx) == set(got_idx) == set(delta_idx)
    with TensorReader() as reader:
        for name, info in prev_idx.items():
            want = reader.read(info).to(torch.float32).add_(reader.read(delta_idx[name]), alpha=lr * scale)
            assert torch.equal(reader.read(got_idx[name]), want), name
    server = yaml.safe_load((model / "server.json").read_text())
    assert server["optimizer"] == "halfavg" and server["hparams"] == {"lr": lr, "half_scale": scale}

    clients = sorted(str(p) for p in (run / "round_001/clients").iterdir())

    def verify(half_scale: float) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "fedagent.cli", "verify", "--prev", str(prev), "--clients", *clients]
        cmd += ["--aggregate", str(agg), "--model", str(model), "--server-opt", "halfavg"]
        cmd += ["--server-lr", repr(lr), "--half-scale", repr(half_scale)]
        return subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=300)

    ok = verify(scale)
    assert ok.returncode == 0, ok.stderr
    assert "verify: OK" in ok.stdout and "halfavg" in ok.stdout
    bad = verify(0.5)
    assert bad.returncode == 1
    assert "server.json: hparams half_scale=0.25 != --half-scale 0.5" in bad.stderr, bad.stderr
