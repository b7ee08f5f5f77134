"""The round graph under real Snakemake: caching, forcing, resume after kills, round targets.

Issue 2, Must show 2, 3a–3e and 4. One 3-round run is built once per session; tests that
change it work on `cp -a` copies.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from workflow_helpers import (
    RUN,
    clone_workdir,
    executed_jobs,
    make_workdir,
    run_snakemake,
    snakemake_cmd,
    snakemake_env,
    tree_state,
)

pytestmark = [pytest.mark.workflow, pytest.mark.slow]

ROUND_JOBS = {"select", "train_client", "aggregate", "merge", "eval"}
KEEP_FEW = "keep: {client_updates: false, aggregates: false, models_every: 2, protect_models: true}\n"


def _round_of(wildcards: str) -> str | None:
    for part in wildcards.split(","):
        key, _, value = part.strip().partition("=")
        if key == "round":
            return value
    return None


@pytest.fixture(scope="session")
def finished3(tmp_path_factory) -> Path:
    """A finished 3-round run of the test config."""
    work = make_workdir(tmp_path_factory.mktemp("finished3") / "w")
    run_snakemake(work)
    return work


def test_dry_run_plans_70_rounds_without_running(tmp_path):
    work = make_workdir(tmp_path / "w")
    proc = run_snakemake(work, "-n", "--config", "rounds=70", "-q", "rules")
    counts = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
    assert counts["train_client"] == 140 and counts["aggregate"] == 70
    assert counts["merge"] == 70 and counts["select"] == 70 and counts["eval"] == 71
    assert counts["report"] == 71
    assert not (work / "results").exists()


def test_finished_run_has_one_summary_row_per_round(finished3):
    import pandas as pd

    table = pd.read_csv(finished3 / RUN / "summary.csv")
    assert list(table["round"]) == [0, 1, 2, 3]
    assert (finished3 / RUN / "summary.csv").resolve() == (finished3 / RUN / "round_003" / "summary.csv").resolve()
    assert (finished3 / RUN / "curves.png").stat().st_size > 1000
    for r in range(1, 4):
        sel = json.loads((finished3 / RUN / f"round_{r:03d}" / "selection.json").read_text())
        assert sel["clients"] == [0, 1]
        # The run's mode in every output dir's provenance, not only in selection.json.
        for d in ("clients/0", "clients/1", "aggregate", "model"):
            prov = json.loads((finished3 / RUN / f"round_{r:03d}" / d / "provenance.json").read_text())
            assert prov["run_mode"] == sel["mode"] == "federated", d


def test_a_second_invocation_runs_nothing(finished3, tmp_path):
    work = clone_workdir(finished3, tmp_path / "w")
    proc = run_snakemake(work)
    assert executed_jobs(proc) == []
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_b_forcing_round2_aggregate(finished3, tmp_path):
    work = clone_workdir(finished3, tmp_path / "w")
    before = tree_state(work / RUN / "round_001")
    proc = run_snakemake(work, "-R", f"{RUN}/round_002/aggregate")
    jobs = executed_jobs(proc)
    assert ("aggregate", "round=002") in jobs and ("merge", "round=002") in jobs and ("eval", "round=002") in jobs
    assert not any(r == "train_client" and _round_of(w) == "002" for r, w in jobs), jobs
    assert all(_round_of(w) in ("002", "003") for r, w in jobs), jobs
    assert {r for r, w in jobs if _round_of(w) == "003"} == {"train_client", "aggregate", "merge", "eval", "report"}
    assert tree_state(work / RUN / "round_001") == before  # nothing upstream touched

    # Targeting round 2's eval with the same -R: just those three jobs.
    work2 = clone_workdir(finished3, tmp_path / "w2")
    proc = run_snakemake(work2, f"{RUN}/round_002/eval.json", "-R", f"{RUN}/round_002/aggregate")
    assert executed_jobs(proc) == [("aggregate", "round=002"), ("eval", "round=002"), ("merge", "round=002")]


def test_d_changing_rounds(finished3, tmp_path):
    """rounds=2 on a 3-round run does nothing; rounds=4 runs only round 4. The rounds=4 run
    also switches on the issue-4 keep-policy (temporary updates/aggregates, models every 2),
    so one extra round shows both: Snakemake deletes what round 4 consumed and is no longer
    kept, and re-runs then have nothing to do."""
    work = clone_workdir(finished3, tmp_path / "w")
    before = tree_state(work / RUN)
    proc = run_snakemake(work, "--config", "rounds=2")
    assert executed_jobs(proc) == []
    assert tree_state(work / RUN) == before  # nothing deleted, nothing rewritten

    (work / "keep.yaml").write_text("rounds: 4\n" + KEEP_FEW)
    proc = run_snakemake(work, "--configfile", "keep.yaml")
    jobs = executed_jobs(proc)
    assert {_round_of(w) for r, w in jobs} == {"004"}, jobs
    assert {r for r, _ in jobs} == {"select", "train_client", "aggregate", "merge_protected", "eval", "report"}
    after = tree_state(work / RUN)
    for r in ("000", "001", "002", "003"):
        unchanged = {k: v for k, v in before.items() if k.startswith(f"round_{r}/")}
        if r == "003":  # was the last round's model; now temporary, and used by round 4
            unchanged = {k: v for k, v in unchanged.items() if not k.startswith("round_003/model/")}
        assert {k: v for k, v in after.items() if k.startswith(f"round_{r}/")} == unchanged, r
    rd = work / RUN
    assert not (rd / "round_003" / "model").exists()
    assert not (rd / "round_004" / "aggregate").exists() and not (rd / "round_004" / "clients" / "0").exists()
    model4 = rd / "round_004" / "model"
    assert (model4 / "manifest.json").is_file()
    assert not any(p.stat().st_mode & 0o222 for p in [model4, *model4.rglob("*")])  # protected(): read-only
    for extra in ([], ["-n"]):
        proc = run_snakemake(work, "--configfile", "keep.yaml", *extra)
        assert executed_jobs(proc) == [], extra
        assert "Nothing to be done" in proc.stdout + proc.stderr


def test_e_one_round_target_builds_only_what_it_needs(finished3, tmp_path):
    work = make_workdir(tmp_path / "w")
    proc = run_snakemake(work, f"{RUN}/round_002/eval.json")
    jobs = executed_jobs(proc)
    rounds = {_round_of(w) for _, w in jobs if _round_of(w)}
    assert rounds == {"000", "001", "002"} or rounds == {"001", "002"}, jobs
    assert ("eval", "round=000") not in jobs and ("eval", "round=001") not in jobs
    assert "report" not in {r for r, _ in jobs}
    assert not (work / RUN / "round_003").exists() and not (work / RUN / "summary.csv").exists()

    # Must show 4: the same config gives byte-identical plans, selections and models.
    for rel in (
        "plan/partition.json",
        "plan/val_set.json",
        "plan/games/games.json",
        "round_001/selection.json",
        "round_002/selection.json",
        "round_000/model/manifest.json",
        "round_001/model/manifest.json",
        "round_002/model/manifest.json",
        "round_002/eval.json",
    ):
        assert (work / RUN / rel).read_bytes() == (finished3 / RUN / rel).read_bytes(), rel


def _wait_for(predicate, timeout: float, what: str, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"snakemake ended (rc={proc.returncode}) before {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _kill_stray_services(work: Path):
    # Env services of killed jobs must not outlive the test (they are the job's children).
    subprocess.run(["pkill", "-9", "-f", f"serve-env.*{work}"], check=False)


def test_c_sigkill_of_the_whole_tree_then_documented_recovery(tmp_path):
    """A 1-round run killed in round 1's training, then a second round whose trainer is killed:
    the rounds after the kill would only repeat jobs that the other tests already run. Cold jobs: the
    kills aim at the jobs' own process trees (a warm-forked job outlives its killed caller for a moment,
    and may finish its update: tests/test_warm.py covers that path)."""
    work = make_workdir(tmp_path / "w")
    one = ("--config", "rounds=1")
    clients = work / RUN / "round_001" / "clients"
    logs = work / RUN / "logs" / "round_001"

    def one_done_other_running():
        done = [c for c in ("0", "1") if (clients / c / "manifest.json").exists()]
        running = [c for c in ("0", "1") if (logs / f"train_client_{c}.log").exists() and not (clients / c).exists()]
        return len(done) == 1 and len(running) == 1

    proc = subprocess.Popen(
        snakemake_cmd(*one),
        cwd=work,
        env=snakemake_env(warm=False),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_for(one_done_other_running, 600, "one client finished and the other training", proc)
        time.sleep(1.5)  # well inside the second client's job
        done = next(c for c in ("0", "1") if (clients / c / "manifest.json").exists())
        killed = "1" if done == "0" else "0"
        done_state = tree_state(clients / done)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_stray_services(work)
    assert not (clients / killed).exists()  # the partial update never reached its final path

    # Documented recovery: the same command; --unlock first when Snakemake's lock was left. (The
    # recoveries kill nothing: their jobs go through the warm server like the other tests'.)
    first = run_snakemake(work, *one, check=False)
    if first.returncode != 0:
        assert "unlock" in (first.stdout + first.stderr).lower(), first.stderr[-3000:]
        run_snakemake(work, "--unlock")
        first = run_snakemake(work, *one)
    jobs = executed_jobs(first)
    assert ("train_client", f"round=001, client={killed}") in jobs
    assert ("train_client", f"round=001, client={done}") not in jobs  # finished client kept
    assert tree_state(clients / done) == done_state
    assert (work / RUN / "summary.csv").exists()
    # Leftovers of the killed attempt (if it got as far as writing) are quarantined, never in place.
    assert not list(clients.glob(".partial-*"))

    # SIGKILL of only the training process: the plain same command recovers.
    proc = subprocess.Popen(
        snakemake_cmd("--config", "rounds=2"),
        cwd=work,
        env=snakemake_env(warm=False),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    try:

        def trainer_pids():  # this run's own (other runs may train a round 2 on this machine)
            pids = []
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    cmd = child.cmdline()
                    if "train-client" in cmd and "--round" in cmd and cmd[cmd.index("--round") + 1] == "002":
                        pids.append(child.pid)
            return pids

        _wait_for(lambda: bool(trainer_pids()), 600, "a round-2 training process", proc)
        time.sleep(1.0)
        for pid in trainer_pids():
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=600)
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_stray_services(work)
    run_snakemake(work, "--config", "rounds=2")
    assert (work / RUN / "round_002" / "eval.json").exists()
    assert not list((work / RUN / "round_002" / "clients").glob(".partial-*"))


def _would_remove(proc) -> set[str]:
    text = proc.stdout + proc.stderr
    return {
        line.split("Would remove temporary output ", 1)[1].strip().removeprefix(f"{RUN}/")
        for line in text.splitlines()
        if "Would remove temporary output " in line
    }


def test_keep_policy_plan_deletes_all_but_every_kth_and_last_model(tmp_path):
    """Issue 4 keep-policy: the dry run of a 5-round run with models_every=2 shows what goes."""
    work = make_workdir(tmp_path / "w")
    (work / "keep.yaml").write_text("rounds: 5\n" + KEEP_FEW)
    proc = run_snakemake(work, "-n", "--configfile", "keep.yaml")
    removed = _would_remove(proc)
    assert {p for p in removed if p.endswith("/model")} == {"round_001/model", "round_003/model"}
    for r in range(1, 6):
        assert {f"round_{r:03d}/clients/0", f"round_{r:03d}/clients/1", f"round_{r:03d}/aggregate"} <= removed
    jobs = executed_jobs(proc)
    assert {w for r, w in jobs if r == "merge_protected"} == {"round=002", "round=004"}
    assert {w for r, w in jobs if r == "merge"} == {"round=005"}  # the last: kept, not protected
    assert {w for r, w in jobs if r == "merge_temporary"} == {"round=001", "round=003"}


def test_another_optimizers_knob_reruns_no_merge(finished3, tmp_path):
    """params of merge carry only the chosen optimizer's hyper-parameters."""
    work = clone_workdir(finished3, tmp_path / "w")
    (work / "srv.yaml").write_text("server: {optimizer: fedavg, momentum: 0.5, beta2: 0.9}\n")
    assert executed_jobs(run_snakemake(work, "-n", "--configfile", "srv.yaml")) == []
    (work / "srv.yaml").write_text("server: {optimizer: fedavg, lr: 0.5}\n")
    jobs = executed_jobs(run_snakemake(work, "-n", "--configfile", "srv.yaml"))
    assert ("merge", "round=001") in jobs
