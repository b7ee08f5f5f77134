"""The round graph under real Snakemake: caching, forcing, resume after kills, round targets.

Issue 2, Must show 2, 3a–3e and 4. One 3-round run is built once per session; tests that
change it work on `cp -a` copies.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from workflow_helpers import (
    REPO,
    RUN,
    clone_workdir,
    executed_jobs,
    make_workdir,
    run_snakemake,
    snakemake_cmd,
    snakemake_env,
    started_jobs,
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


TRACKED = "report: {trackers: [tensorboard, mlflow]}"


def tracked_workdir(path: Path) -> Path:
    """make_workdir with the report's trackers on (the test config has none: the suite's time)."""
    work = make_workdir(path)
    cfg = work / "config" / "config.yaml"
    text = cfg.read_text()
    assert "report: {trackers: []}" in text
    cfg.write_text(text.replace("report: {trackers: []}", TRACKED))
    return work


@pytest.fixture(scope="session")
def finished3(tmp_path_factory) -> Path:
    """A finished 3-round run of the test config, with TensorBoard and MLflow stores."""
    work = tracked_workdir(tmp_path_factory.mktemp("finished3") / "w")
    # Two cores, as CI has (the profile's `cores: all`): a train job's 2 threads fill them, so the
    # scheduler must choose among ready jobs (test_a_rounds_record_goes_before_the_next_rounds_training)
    run_snakemake(work, "--cores", "2")
    return work


def check_stores(run_dir: Path, rounds: int) -> None:
    """The run's TensorBoard events and MLflow store, read back with their own readers, hold every round's
    validation success (= summary.csv) and every client's metrics (= its metrics.json), each once."""
    import pandas as pd

    from test_watch import read_mlflow, read_tensorboard

    summary = pd.read_csv(run_dir / "summary.csv")
    success = [(int(r), pytest.approx(float(v))) for r, v in zip(summary["round"], summary["success_rate"])]
    clients = {}
    for r in range(1, rounds + 1):
        for c in json.loads((run_dir / f"round_{r:03d}" / "selection.json").read_text())["clients"]:
            m = json.loads((run_dir / f"round_{r:03d}" / "clients" / str(c) / "metrics.json").read_text())
            clients.setdefault(c, []).append((r, m))
    tb = read_tensorboard(run_dir / "tensorboard")
    (ml,) = read_mlflow(run_dir / "mlruns").values()
    assert ml["status"] == "FINISHED" and ml["params"]["rounds"] == str(rounds)
    for got in (tb, ml["metrics"]):
        assert got["eval/success_rate"] == success
        assert [s for s, _ in got["eval/ci95_high"]] == list(range(rounds + 1))
        assert [s for s, _ in got["eval_type/textworld/success_rate"]] == list(range(rounds + 1))
        for c, rows in clients.items():
            for key, field in (("kl", "kl"), ("mean_return", "mean_return"), ("num_tokens", "num_tokens")):
                assert got[f"client/{c}/{key}"] == [(r, pytest.approx(m[field], rel=1e-6)) for r, m in rows], (c, key)
            assert [s for s, _ in got[f"client/{c}/steps.entropy"]] == [r for r, _ in rows]
            assert [s for s, _ in got[f"client/{c}/bytes_sent"]] == [r for r, _ in rows]
        assert [s for s, _ in got["time/train_job_s"]] == list(range(rounds + 1))


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
    check_stores(finished3 / RUN, 3)
    for r in range(1, 4):
        sel = json.loads((finished3 / RUN / f"round_{r:03d}" / "selection.json").read_text())
        assert sel["clients"] == [0, 1]
        # The run's mode in every output dir's provenance, not only in selection.json.
        for d in ("clients/0", "clients/1", "aggregate", "model"):
            prov = json.loads((finished3 / RUN / f"round_{r:03d}" / d / "provenance.json").read_text())
            assert prov["run_mode"] == sel["mode"] == "federated", d


def _planned_priorities(proc) -> dict[str, set[int]]:
    """Rule → the priorities its jobs carry in a `-n` plan (Snakemake prints `priority: N` when not 0)."""
    out: dict[str, set[int]] = {}
    rule = None
    for line in proc.stdout.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):\s*$", line)
        if m:
            rule = m.group(1)
            out.setdefault(rule, set()).add(0)
        p = re.match(r"^\s+priority: (\d+)$", line)
        if p and rule is not None:
            out[rule] = (out[rule] - {0}) | {int(p.group(1))}
    return out


def test_a_rounds_record_goes_before_the_next_rounds_training(finished3, tmp_path):
    """When a round's eval and the next round's train jobs are ready together and the cores hold only
    some of them, the eval starts first (workflow/common.smk
    ROUND_RECORD_PRIORITY): a run stopped at a time limit has scored every round it trained past.
    The plan: every job finishing a round ranks above every train job (without the priority the started
    order below is a tie Snakemake breaks either way: seen failing in 2 of 4 runs; the plan's check in all)."""
    plan = _planned_priorities(run_snakemake(make_workdir(tmp_path / "w"), "-n"))
    record = {r: plan[r] for r in plan if r in {"aggregate", "eval", "report"} or r.startswith("merge")}
    assert {"aggregate", "eval", "report"} <= set(record) and any(r.startswith("merge") for r in record), plan
    assert plan["train_client"] == {0} and all(v == {1} for v in record.values()), plan
    logs = sorted((finished3 / ".snakemake" / "log").glob("*.snakemake.log"))
    # (rule, round) in start order, of the fixture's own run (tests clone it before running more)
    order = [(rule, _round_of(w)) for rule, w in started_jobs(logs[0].read_text())]
    for r in range(3):
        ev = order.index(("eval", f"{r:03d}"))
        first_train = min(i for i, job in enumerate(order) if job == ("train_client", f"{r + 1:03d}"))
        assert ev < first_train, (r, order)


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
    # Rounds 2 and 3 again: their points rewritten, never added (seen failing with an appending writer)
    check_stores(work / RUN, 3)

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


def test_a_run_moved_in_pieces_to_a_fresh_checkout_resumes_where_it_stopped(finished3, tmp_path):
    """A run's directory alone, moved by scripts/gpu/state.sh (a tar in pieces, every mtime kept; no
    .snakemake record) into a fresh checkout, as a run goes on on another node: the same command with
    rounds=4 runs round 4 only, and a piece that changed on the way is refused before anything unpacks."""
    script = REPO / "scripts" / "gpu" / "state.sh"
    pieces_dir = tmp_path / "pieces"
    out = subprocess.run(
        ["bash", str(script), "out", str(pieces_dir), RUN],
        cwd=finished3,
        env={**os.environ, "STATE_PIECE_MB": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    pieces = sorted(pieces_dir.glob("state-[0-9]*"))
    assert int(out.stdout.strip()) == len(pieces) > 1  # split: each piece within one call's limit
    work = make_workdir(tmp_path / "w")
    assert not (work / RUN).exists()

    bad = tmp_path / "bad"
    bad.mkdir()
    for p in [*pieces, pieces_dir / "state.sha256"]:
        (bad / p.name).write_bytes(p.read_bytes())
    with (bad / pieces[0].name).open("r+b") as fh:
        fh.seek(100)
        fh.write(b"x")
    refused = subprocess.run(["bash", str(script), "in", *sorted(bad.glob("state-[0-9]*"))], cwd=work)
    assert refused.returncode == 1 and not (work / RUN).exists()

    subprocess.run(["bash", str(script), "in", *pieces], cwd=work, check=True)
    assert tree_state(work / RUN) == tree_state(finished3 / RUN)  # every file, size and mtime
    proc = run_snakemake(work, "--config", "rounds=4")
    jobs = executed_jobs(proc)
    assert jobs and {_round_of(w) for r, w in jobs} == {"004"}, jobs


def test_e_one_round_target_builds_only_what_it_needs(finished3, tmp_path):
    work = tracked_workdir(tmp_path / "w")  # finished3's config (the provenance records its hash)
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
    # The plan and round 0 first, warm (the kill comes in round 1's training; cold, each of their jobs
    # would pay its imports for nothing the test looks at).
    run_snakemake(work, *one, "--omit-from", "train_client")
    assert (work / RUN / "round_000" / "eval.json").is_file() and not clients.exists()

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


def _fedagent(*args: str) -> str:
    exe = Path(snakemake_env()["PATH"].split(os.pathsep)[0]) / "fedagent"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, check=True, timeout=120).stdout


def test_status_during_a_running_round_shows_progress_and_an_eta(finished3, tmp_path):
    """A fourth round on a copy of the 3-round run: while a round-4 train job runs (stopped for the
    moment of reading: SIGSTOP, then SIGCONT; cold jobs, so the job is Snakemake's own process),
    `fedagent status` shows its progress line and the run's ETA (3 rounds' mean span × 1 round left);
    `--watch`, started beside the run, ends by itself once the run is complete; afterwards no ETA and no
    running job, and the totals are right."""
    work = clone_workdir(finished3, tmp_path / "w")
    run_dir = work / RUN
    proc = subprocess.Popen(
        snakemake_cmd("--config", "rounds=4"),
        cwd=work,
        env=snakemake_env(warm=False),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    watch = None
    try:
        _wait_for(
            lambda: json.loads((run_dir / "config.json").read_text())["config"]["rounds"] == 4, 300, "onstart", proc
        )
        watch = subprocess.Popen(
            [
                str(Path(snakemake_env()["PATH"].split(os.pathsep)[0]) / "fedagent"),
                "status",
                str(run_dir),
                "--watch",
                "0.5",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

        def running_trainer():
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    cmd = child.cmdline()
                    if "train-client" in cmd and cmd[cmd.index("--round") + 1] == "004" and "--client" in cmd:
                        log = run_dir / "logs" / "round_004" / f"train_client_{cmd[cmd.index('--client') + 1]}.log"
                        if log.is_file() and "fedagent progress:" in log.read_text():
                            return child
            return None

        _wait_for(lambda: running_trainer() is not None, 600, "a round-4 train job with a progress line", proc)
        job = running_trainer()
        client = job.cmdline()[job.cmdline().index("--client") + 1]
        job.send_signal(signal.SIGSTOP)
        try:
            text = _fedagent("status", str(run_dir))
            data = json.loads(_fedagent("status", str(run_dir), "--json"))
        finally:
            job.send_signal(signal.SIGCONT)
        assert f"running train_client/{client}: episodes " in text and "/2, " in text, text
        assert data["rounds"][4]["jobs"][f"train_client/{client}"] == "running"
        assert data["rounds"][4]["progress"][f"train_client/{client}"]["total"] == 2
        pace = data["pace"]
        assert pace["rounds_total"] == 4 and pace["rounds_done"] == 3 and not pace["complete"]
        assert pace["mean_round_s"] > 0 and pace["eta_s"] == pytest.approx(pace["mean_round_s"], abs=0.2)
        (pace_line,) = [x for x in text.splitlines() if x.startswith("rounds done")]
        assert re.fullmatch(r"rounds done 3/4, mean round \d+s, ETA \d+s", pace_line), text
        assert proc.wait(timeout=600) == 0
        watched = watch.communicate(timeout=120)[0]
    finally:
        for p in (proc, watch):
            if p is not None and p.poll() is None:
                p.kill()
        _kill_stray_services(work)
    assert watch.returncode == 0 and watched.count("rounds done") >= 2, watched  # refreshed, then ended
    after = _fedagent("status", str(run_dir))
    (pace_line,) = [x for x in after.splitlines() if x.startswith("rounds done")]
    assert re.fullmatch(r"rounds done 4/4, mean round \d+s, run complete", pace_line), after  # no ETA
    assert not any(x.startswith("  running ") for x in after.splitlines()), after
    assert after.count(": complete |") == 5 and "latest eval: round 004" in after, after
    check_stores(run_dir, 4)


def test_the_html_report_opens_in_a_browser_with_curves_and_table(finished3, tmp_path):
    """`snakemake --report` of the 3-round run: one self-contained file, opened in headless Chromium
    (Debian's, scripts/browser-local.sh; playwright drives it): the round-3 summary page shows the curve
    and the table with a row per round; the captions of workflow/report/ are in it. The screenshot is kept
    in the test's directory (its path printed)."""
    out = tmp_path / "report.html"
    run_snakemake(finished3, "--report", str(out))
    html = out.read_text()
    for caption in sorted((REPO / "workflow" / "report").glob("*.rst")):
        assert caption.read_text().strip()[:60] in html, caption.name
    browser = subprocess.run(
        ["bash", str(REPO / "scripts" / "browser-local.sh"), "install"], capture_output=True, text=True, timeout=900
    )
    if browser.returncode == 3:
        pytest.skip(browser.stderr.strip())
    assert browser.returncode == 0, browser.stderr
    from playwright.sync_api import sync_playwright

    shot = tmp_path / "report.png"
    with sync_playwright() as pw:
        chrome = pw.chromium.launch(executable_path=browser.stdout.strip(), args=["--no-sandbox"])
        try:
            page = chrome.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(out.as_uri())
            page.get_by_text("Summary", exact=True).click()
            row = page.locator("tr", has_text="003").filter(has_text="summary page")
            row.locator("a[iconname=eye]").click()
            frame = page.frame_locator("iframe").first
            curves = frame.locator("img#curves")
            curves.wait_for(state="visible", timeout=30_000)
            assert curves.evaluate("img => img.complete && img.naturalWidth") > 300
            table = frame.locator("table#summary")
            assert table.is_visible()
            assert table.locator("tbody tr").count() == 4  # rounds 0..3
            assert frame.locator("table#summary td").first.inner_text().strip() == "0"
            page.screenshot(path=str(shot))
        finally:
            chrome.close()
    print(f"report screenshot: {shot}")
    assert shot.stat().st_size > 10_000
