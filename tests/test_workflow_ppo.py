"""PPO through the real workflow (issue 11, Must show 2): 2 rounds × 2 clients of the tiny model.

Each round's actor AND critic are trained by every client, aggregated and merged (FedAvgM, so the
critic's server state is real); ``fedagent verify`` recomputes both in float64 and passes, and
fails naming the file when the critic's delta is tampered (with and without a re-signed
manifest).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workflow_helpers import RUN, make_workdir, run_snakemake, snakemake_env

pytestmark = [pytest.mark.workflow, pytest.mark.slow]

PPO_CONFIG = """\
rounds: 2
train:
  algorithm: ppo
  group_size: 1
  groups_per_epoch: 2
  max_turns: 2
  mini_batch_size: 4
  micro_batch_size: 2
  ppo: {critic_lr: 1.0e-3}
server: {optimizer: fedavgm}
"""
SERVER = ["--server-opt", "fedavgm", "--server-lr", "1.0", "--momentum", "0.9"]


def _fedagent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedagent.cli", *args], capture_output=True, text=True, env=snakemake_env()
    )


def _verify(run: Path, r: int, aggregate: Path | None = None) -> subprocess.CompletedProcess:
    rd = run / f"round_{r:03d}"
    prev = run / f"round_{r - 1:03d}" / "model"
    clients = sorted(str(c) for c in (rd / "clients").iterdir())
    return _fedagent(
        "verify",
        "--prev",
        str(prev),
        "--clients",
        *clients,
        "--aggregate",
        str(aggregate or rd / "aggregate"),
        "--model",
        str(rd / "model"),
        "--prev-server-state",
        "none" if r == 1 else str(prev),
        *SERVER,
    )


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory) -> Path:
    work = make_workdir(tmp_path_factory.mktemp("ppo") / "w")
    (work / "ppo.yaml").write_text(PPO_CONFIG)
    run_snakemake(work, "--configfile", "ppo.yaml")
    return work / RUN


def test_actor_and_critic_are_trained_aggregated_and_merged_each_round(ppo_run):
    from safetensors.torch import load_file

    base = json.loads((ppo_run / "round_000/model/provenance.json").read_text())
    assert base["critic"] == {"critic_init": "fresh-value-head", "start_critic": None, "value_head_seed": 7}
    for r in (1, 2):
        rd = ppo_run / f"round_{r:03d}"
        prev = ppo_run / f"round_{r - 1:03d}" / "model"
        for c in sorted((rd / "clients").iterdir()):
            m = json.loads((c / "metrics.json").read_text())
            assert m["params"]["algorithm"] == "ppo" and m["params"]["group_size"] == 1
            assert all("vf_loss" in s and s["critic_grad_norm"] > 0 for s in m["steps"])
            assert (c / "critic" / "model.safetensors").is_file()
        assert json.loads((rd / "aggregate/critic/aggregate.json").read_text())["num_tensors"] > 0
        for part in ("model.safetensors", "server_state.safetensors", "server.json"):
            assert (rd / "model" / "critic" / part).is_file(), part
        assert json.loads((rd / "model/critic/server.json").read_text())["step"] == r
        # the merged critic moved, and its value head is there
        before, after = load_file(prev / "critic/model.safetensors"), load_file(rd / "model/critic/model.safetensors")
        assert "score.weight" in after and not before["score.weight"].equal(after["score.weight"])
        assert set(before) == set(after)
        assert (rd / "eval.json").is_file()


def test_verify_passes_on_both_rounds(ppo_run):
    for r in (1, 2):
        res = _verify(ppo_run, r)
        assert res.returncode == 0, res.stderr
        assert "verify: OK" in res.stdout and "critic/ likewise" in res.stdout  # says the critic passed too


def test_verify_fails_on_a_tampered_critic_delta_naming_the_file(ppo_run, tmp_path):
    from safetensors.torch import load_file, save_file

    from fedagent.core.atomic import write_manifest

    agg = tmp_path / "aggregate"
    shutil.copytree(ppo_run / "round_002" / "aggregate", agg)
    f = agg / "critic" / "delta.safetensors"
    tensors = load_file(f)
    tensors["score.weight"][0, 0] += 1e-3
    save_file(tensors, f)
    res = _verify(ppo_run, 2, aggregate=agg)  # manifest not re-signed: the manifest names the file
    assert res.returncode == 1
    assert "critic/delta.safetensors" in res.stderr, res.stderr
    (agg / ".snakemake_timestamp").unlink(missing_ok=True)  # Snakemake's marker, not in a manifest
    write_manifest(agg)  # re-signed: the float64 recomputation catches it
    res = _verify(ppo_run, 2, aggregate=agg)
    assert res.returncode == 1
    assert "critic: aggregate: tensor 'score.weight'" in res.stderr, res.stderr
    assert f"in {f}" in res.stderr, res.stderr
    # the merged critic no longer follows from the (tampered) delta either
    assert "critic: merged model: tensor 'score.weight'" in res.stderr, res.stderr


def test_verify_names_a_critic_swapped_in_from_another_client(ppo_run, tmp_path):
    """Both clients' critics sit in folders called critic/: whose critic it is comes from the update's
    metrics.json (critic_sha256), so another client's critic (re-signed) is named, file and owner."""
    from fedagent.core.atomic import write_manifest

    rd = ppo_run / "round_002"
    a, b = (shutil.copytree(c, tmp_path / c.name) for c in sorted((rd / "clients").iterdir()))
    shutil.rmtree(a / "critic")
    shutil.copytree(b / "critic", a / "critic")
    (a / ".snakemake_timestamp").unlink(missing_ok=True)
    write_manifest(a)
    prev = ppo_run / "round_001" / "model"
    res = _fedagent(
        "verify",
        "--prev",
        str(prev),
        "--clients",
        str(a),
        str(b),
        "--aggregate",
        str(rd / "aggregate"),
        "--model",
        str(rd / "model"),
        "--prev-server-state",
        str(prev),
        *SERVER,
    )
    assert res.returncode == 1
    assert (
        f"verify: FAIL critic: identity: {a / 'critic' / 'model.safetensors'} is not the critic that "
        f"{a / 'metrics.json'} records"
    ) in res.stderr, res.stderr
    assert f"it is the critic of the update {b} (client {int(b.name)}, round 2)" in res.stderr, res.stderr
