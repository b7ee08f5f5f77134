"""verl FSDP checkpoint → client update, exact in fp32.

A real 2-rank FSDP run on CPU (gloo, file rendezvous) of the tiny model, saved by verl
0.9.1's own FSDPCheckpointManager, for both of verl's strategies (FSDP1 with a device
mesh, verl's default, and FSDP2); the converted update must equal the gathered full state
dict bit for bit and have the local backend's file set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is installed by scripts/setup.sh (envs/verl-cpu.txt)")

import torch  # noqa: E402
from fake_env import build_tiny_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from fedagent.core.atomic import atomic_dir, verify_manifest  # noqa: E402
from fedagent.train.verl.convert import CheckpointError, merge_fsdp_shards, write_update  # noqa: E402

pytestmark = pytest.mark.slow


def _spawn(model_dir: Path, out: Path, strategy: str) -> None:
    import torch.multiprocessing as mp

    import verl_fsdp_worker

    # For the spawned workers only: left in this process's environment, it reached every later
    # subprocess, e.g. `nproc` in scripts/slurm-local.sh (test_slurm's node then had 1 CPU and the
    # 2-thread jobs pended forever when that test ran after this one).
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        out.mkdir(parents=True)
        mp.spawn(verl_fsdp_worker.run, args=(2, str(model_dir), str(out), strategy), nprocs=2, join=True)
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module", params=["fsdp", "fsdp2"])
def ckpt(request, tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"ckpt-{request.param}") / "run"
    _spawn(tiny, out, request.param)
    return out / "global_step_2" / "actor", torch.load(out / "reference.pt", weights_only=True)


def test_merge_is_exact_fp32(ckpt, tiny):
    actor, ref = ckpt
    assert json.loads((actor / "fsdp_config.json").read_text())["world_size"] == 2
    merged = merge_fsdp_shards(actor)
    assert set(merged) == set(ref)
    start = load_file(tiny / "model.safetensors")
    moved = 0
    for k, v in ref.items():
        assert merged[k].dtype == torch.float32
        assert torch.equal(merged[k], v), k
        moved += int(k in start and not torch.equal(start[k], v))
    assert moved > 0  # training changed the weights


def test_update_dir_holds_the_masters_and_the_local_file_set(ckpt, tiny, tmp_path):
    from fedagent.model.policy import load_policy, save_policy

    actor, ref = ckpt
    with atomic_dir(tmp_path / "update") as staging:
        info = write_update(actor, tiny, staging)
    assert info["world_size"] == 2
    verify_manifest(tmp_path / "update")
    got = load_file(tmp_path / "update" / "model.safetensors")
    for k, v in got.items():
        assert v.dtype == torch.float32 and torch.equal(v, ref[k]), k
    model, tok = load_policy(tiny, 1)
    save_policy(model, tok, tmp_path / "local")
    assert sorted(p.name for p in (tmp_path / "update").iterdir() if p.name != "manifest.json") == sorted(
        p.name for p in (tmp_path / "local").iterdir()
    )


def test_bf16_shards_and_missing_ranks_are_refused(ckpt, tmp_path):
    import shutil

    actor, _ = ckpt
    bad = tmp_path / "actor"
    shutil.copytree(actor, bad)
    import torch.distributed.tensor  # noqa: F401

    sd = torch.load(bad / "model_world_size_2_rank_1.pt", weights_only=True)
    key = sorted(sd)[0]
    sd[key] = sd[key].to(torch.bfloat16)
    torch.save(sd, bad / "model_world_size_2_rank_1.pt")
    with pytest.raises(CheckpointError, match="not float32"):
        merge_fsdp_shards(bad)
    (bad / "model_world_size_2_rank_1.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rank files \[1\] are missing"):
        merge_fsdp_shards(bad)
