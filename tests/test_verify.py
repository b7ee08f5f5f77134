"""`fedagent verify` through the CLI: passes on a good round, fails (non-zero) on tampering."""

from __future__ import annotations

import shutil
import subprocess
import sys

import torch

from fedagent.aggregate import aggregate
from fedagent.atomic import write_manifest
from fedagent.hf_dir import TensorReader, read_header, write_tensors
from fedagent.merge import merge
from fedagent.server_opt import FedAvg
from test_aggregate import make_round


def run_verify(prev_dir, dirs, agg, model=None, weighting="samples"):
    cmd = [sys.executable, "-m", "fedagent.cli", "verify", "--prev", str(prev_dir), "--clients", *map(str, dirs),
           "--weighting", weighting, "--aggregate", str(agg)]
    if model is not None:
        cmd += ["--model", str(model), "--server-opt", "fedavg"]
    return subprocess.run(cmd, capture_output=True, text=True)


def good_round(tmp_path):
    prev, prev_dir, clients, dirs = make_round(tmp_path, 3)
    aggregate(prev_dir, dirs, tmp_path / "agg", weighting="samples")
    merge(prev_dir, tmp_path / "agg", tmp_path / "model", FedAvg(), round_=1)
    return prev_dir, dirs


def rewrite_delta(agg, fn):
    """Change delta.safetensors and re-sign the manifest, so only the values are wrong."""
    path = agg / "delta.safetensors"
    with TensorReader() as r:
        tensors = {n: r.read(i).clone() for n, i in read_header(path).items()}
    fn(tensors)
    write_tensors(path, tensors)
    write_manifest(agg)


def test_verify_passes_on_good_round(tmp_path):
    prev_dir, dirs = good_round(tmp_path)
    res = run_verify(prev_dir, dirs, tmp_path / "agg", tmp_path / "model")
    assert res.returncode == 0, res.stderr
    assert "verify: OK" in res.stdout


def test_verify_fails_on_tampered_tensor(tmp_path):
    prev_dir, dirs = good_round(tmp_path)

    def tamper(t):
        t["layer.0.attn.weight"][2, 3] += 1e-4  # far below a bf16 ulp of the weights, far above fp32 rounding

    rewrite_delta(tmp_path / "agg", tamper)
    res = run_verify(prev_dir, dirs, tmp_path / "agg")
    assert res.returncode != 0
    assert "'layer.0.attn.weight': 1 element(s) outside tolerance" in res.stderr


def test_verify_fails_on_tampered_bytes_manifest(tmp_path):
    prev_dir, dirs = good_round(tmp_path)
    with open(tmp_path / "model" / "model.safetensors", "r+b") as fh:
        fh.seek(-1, 2)
        fh.write(b"\x7f")
    res = run_verify(prev_dir, dirs, tmp_path / "agg", tmp_path / "model")
    assert res.returncode != 0 and "manifest" in res.stderr and "sha256" in res.stderr


def test_verify_fails_on_wrong_weighting(tmp_path):
    prev_dir, dirs = good_round(tmp_path)
    res = run_verify(prev_dir, dirs, tmp_path / "agg", weighting="uniform")
    assert res.returncode != 0 and "weighting" in res.stderr


def test_verify_fails_on_missing_file(tmp_path):
    prev_dir, dirs = good_round(tmp_path)
    (dirs[1] / "metrics.json").unlink()
    res = run_verify(prev_dir, dirs, tmp_path / "agg")
    assert res.returncode != 0 and "missing" in res.stderr and "metrics.json" in res.stderr
    shutil.rmtree(tmp_path / "agg")
    res = run_verify(prev_dir, dirs, tmp_path / "agg")
    assert res.returncode != 0 and "no manifest.json" in res.stderr and "metrics.json" in res.stderr


def test_verify_fails_on_shape_mismatch(tmp_path):
    prev_dir, dirs = good_round(tmp_path)

    def reshape(t):
        t["layer.0.mlp.weight"] = t["layer.0.mlp.weight"][:-1].contiguous()

    rewrite_delta(tmp_path / "agg", reshape)
    res = run_verify(prev_dir, dirs, tmp_path / "agg")
    assert res.returncode != 0 and "'layer.0.mlp.weight'" in res.stderr and "expected F32[24, 16]" in res.stderr


def test_verify_fails_on_bf16_truncated_aggregate(tmp_path):
    """The reference system's bug: an fp32 mean stored through bf16. Must not pass."""
    prev_dir, dirs = good_round(tmp_path)
    rewrite_delta(tmp_path / "agg", lambda t: t.update({k: v.to(torch.bfloat16).float() for k, v in t.items()}))
    res = run_verify(prev_dir, dirs, tmp_path / "agg")
    assert res.returncode != 0 and "outside tolerance" in res.stderr
