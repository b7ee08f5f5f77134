"""The tiny-model workflow on a real single-node Slurm (issue 15).

scripts/slurm-local.sh installs Debian's slurm-wlm + munge when they are missing and starts
munged, slurmctld and slurmd by hand; the test runs one round through `--profile
profiles/slurm` and checks that every job that is not a `localrule` went through sbatch (one
Slurm job per train_client, per eval and per round's server group), that the models and evals are
byte-identical to a local run's, and that a re-run submits nothing. The node has two GPUs as GRES
(`start DIR --gpus 2`: stand-in device files, no card): a round whose train jobs run on cuda has
its two train_client jobs asking a GPU each, given their own card by Slurm at the same time (each
logs its CUDA_VISIBLE_DEVICES before touching CUDA, then fails here for want of a real one). The
daemons are stopped by their pid files. Skipped, with the script's reason, only where Slurm cannot be had (not root,
no apt-get or package index, or another Slurm's /etc/slurm/slurm.conf).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fedagent.core.config import load_config
from fedagent.model.memory import job_host_mib
from workflow_helpers import REPO, RUN, TEST_CONFIG, executed_jobs, make_workdir, snakemake_env

sys.path.insert(0, str(Path(__file__).resolve().parent / "reliability"))
from kill_driver import start_state  # noqa: E402 - after the sys.path entry above

pytestmark = [pytest.mark.workflow, pytest.mark.slow, pytest.mark.slurm]

SCRIPT = REPO / "scripts" / "slurm-local.sh"
# The profile asks cluster-sized memory; this node is one small VM: restate every resource key
# (a command-line --default-resources / --set-resources replaces the profile's whole key) and
# cap threads at the node's CPUs (`games` asks 8). Status checks every second, not the profile's 5 s:
# each step of the round's chain is noticed that much sooner (what the test checks does not change).
SMALL_NODE = [
    "--seconds-between-status-checks",
    "1",
    "--max-threads",
    "2",
    "--default-resources",
    "mem_mb=1000",
    "runtime=30",
    "slurm_partition=''",
    "--set-resources",
    "train_client:mem_mb=2000",
    "train_client:runtime=30",
    "eval:slurm_extra='--nice=100'",
]
LOCAL_RULES = {"select", "partition", "val_set", "report"}


@pytest.fixture(scope="module")
def slurm():
    """A running single-node Slurm; yields its directory (slurm.conf, logs, pid files)."""
    work = Path(tempfile.mkdtemp(prefix="fedagent-slurm-"))  # short: munge's socket path lives here
    proc = subprocess.run(
        ["bash", str(SCRIPT), "start", str(work), "--gpus", "2"], capture_output=True, text=True, timeout=600
    )
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip())
    try:
        assert proc.returncode == 0, f"slurm-local.sh start failed:\n{proc.stdout}\n{proc.stderr}"
        yield work
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(work)], check=True, timeout=120)


def slurm_jobs(fields: str = "%i|%k|%T") -> list[tuple[str, ...]]:
    """(job id, comment, state, ...) of every job slurmctld knows (MinJobAge is an hour there)."""
    out = subprocess.run(
        ["squeue", "--states=all", "--noheader", f"--format={fields}"], capture_output=True, text=True, check=True
    ).stdout
    return sorted(tuple(line.split("|")) for line in out.splitlines() if line.strip())


def run_slurm_profile(work: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "snakemake"
    cmd = [str(exe), "--profile", "profiles/slurm", *SMALL_NODE, *args]
    proc = subprocess.run(cmd, cwd=work, env=snakemake_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"slurm run failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-8000:]}"
    return proc


def digests(work: Path) -> dict[str, str]:
    """sha256 of every model weight file and every eval.json of a run."""
    run = work / RUN
    files = sorted(run.glob("round_*/model/*.safetensors")) + sorted(run.glob("round_*/clients/*/*.safetensors"))
    files += sorted(run.glob("round_*/eval.json"))
    return {p.relative_to(run).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_one_round_on_slurm_equals_local_and_rerun_submits_nothing(slurm, reference_run, tmp_path):
    # The local run to compare with: the session's 1-round run of the test config under
    # profiles/local (tests/conftest.py), the same config as `--config rounds=1` here.
    work = make_workdir(tmp_path / "slurm")
    before = slurm_jobs()
    proc = run_slurm_profile(work, "--config", "rounds=1")
    log = proc.stdout + proc.stderr
    submitted = [j for j in slurm_jobs() if j not in before]

    # Bookkeeping ran on this host, everything else as Slurm jobs: the 2 plan jobs (games,
    # base_model), one job per client, round 1's server group (aggregate → merge), 2 evals.
    for rule in LOCAL_RULES:
        assert f"localrule {rule}:" in log, rule
    comments = sorted(comment for _, comment, _ in submitted)
    assert all(state == "COMPLETED" for _, _, state in submitted), submitted
    assert not any(rule in c for c in comments for rule in LOCAL_RULES), comments
    assert [c for c in comments if c.startswith("rule_train_client")] == [
        "rule_train_client_wildcards_001_0",
        "rule_train_client_wildcards_001_1",
    ], comments
    assert sum(c.startswith("rule_games") for c in comments) == 1
    assert sum(c.startswith("rule_base_model") for c in comments) == 1
    assert [c for c in comments if "server_" in c] == ["rule_server_001_aggregate_merge"]
    assert [c for c in comments if c.startswith("rule_eval")] == ["rule_eval_wildcards_000", "rule_eval_wildcards_001"]
    assert len(comments) == 7, comments
    # Each submission is one line of the driver's log; the group's two jobs share one.
    assert log.count("has been submitted with SLURM jobid") == 7

    local_digests, slurm_digests = digests(reference_run), digests(work)
    assert "round_001/model/model.safetensors" in slurm_digests and "round_001/eval.json" in slurm_digests
    assert slurm_digests == local_digests

    again = run_slurm_profile(work, "--config", "rounds=1")
    assert executed_jobs(again) == []
    assert "Nothing to be done" in again.stdout + again.stderr
    assert slurm_jobs() == sorted(before + submitted)


def test_two_gpu_jobs_of_a_round_get_their_own_card_at_once(slurm, reference_run, tmp_path):
    # train.device: cuda makes each train_client job ask a GPU through the rule's own decision
    # (fedagent.model.job_resources); the node has two (GRES), so both of the round's jobs start at once,
    # each with its own index. The jobs log CUDA_VISIBLE_DEVICES first, then fail (no CUDA here).
    # The plan and round 0 come from the shared reference run (the same config; train.device is none of
    # their params): the round's two train jobs are all this run submits.
    work = start_state(reference_run, tmp_path / "gpu", "train-client")
    before = slurm_jobs()
    exe = Path(sys.executable).parent / "snakemake"
    cmd = [str(exe), "--profile", "profiles/slurm", "--retries", "0", "--max-threads", "1"]
    cmd += ["--seconds-between-status-checks", "1"]
    cmd += ["--default-resources", "mem_mb=1000", "runtime=30", "slurm_partition=''"]
    cmd += ["--config", "rounds=1", "train={device: cuda}", "--until", "train_client"]
    # cold jobs: each is the process Slurm started, with the environment Slurm gave it. The node has no
    # nvidia-smi, so its two cards' sizes are given by hand (FEDAGENT_GPUS, exported to the jobs): each
    # job's placement then keeps the card Slurm's CUDA_VISIBLE_DEVICES names (fedagent.core.placement).
    env = {**snakemake_env(warm=False), "FEDAGENT_GPUS": "0:81559,1:81559"}
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, "a train job on cuda ran without a GPU?\n" + out[-3000:]
    known = {job_id for job_id, *_ in before}
    jobs = {
        comment: (start, end, mem)
        for job_id, comment, start, end, mem in slurm_jobs(fields="%i|%k|%S|%e|%m")
        if comment.startswith("rule_train_client") and job_id not in known
    }
    assert sorted(jobs) == ["rule_train_client_wildcards_001_0", "rule_train_client_wildcards_001_1"], out[-3000:]
    # sbatch --mem is the rule's host-memory estimate (no profile value hides it)
    cfg = load_config(TEST_CONFIG, {"rounds": 1, "train.device": "cuda"})
    assert {mem for _, _, mem in jobs.values()} == {f"{job_host_mib(cfg, 'train')}M"}, jobs
    starts, ends = [s for s, _, _ in jobs.values()], [e for _, e, _ in jobs.values()]
    assert max(starts) <= min(ends), f"the two GPU jobs did not overlap: {jobs}"
    logs = work / RUN / "logs" / "round_001"
    seen = []
    for client in (0, 1):
        first = (logs / f"train_client_{client}.log").read_text().splitlines()[:1]
        assert first and first[0].startswith("CUDA_VISIBLE_DEVICES="), (client, first, out[-2000:])
        seen.append(first[0].split("=", 1)[1])
    assert sorted(seen) == ["0", "1"], seen
