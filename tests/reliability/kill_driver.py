"""Seeded SIGKILLs of a real workflow run, then the documented recovery; results compared.

    python tests/reliability/kill_driver.py --kills 20          # the full suite (run alone)

One uninterrupted reference run (the test config: tiny model, tiny games, 2 clients,
``rounds: 1``) is made first. Every trial starts from a copy of it without round 1 (plan and
round 0 done), runs ``snakemake --profile profiles/local``, SIGKILLs at a seeded moment
either Snakemake's whole process tree or the one job process, then

1. reads ``fedagent status`` of the killed run and checks that its finished jobs are exactly
   those Snakemake's dry run does not plan again (the one allowed difference: a job killed
   after its complete output landed at the final path, which Snakemake re-runs to be safe);
2. re-runs the same command (after ``snakemake --unlock`` when Snakemake says its lock was
   left, as README.md says), which must finish;
3. compares the final model directory (every file) and every ``eval.json`` (and round 1's
   ``summary.csv``) byte for byte with the reference, checks every output directory against
   its manifest, that no staging directory is left outside ``_failed/``, and that no job of the
   killed run or the re-run read a file of another job's staging directory or of the quarantine
   (every job runs with ``hook/sitecustomize.py``'s read audit: Python's ``open`` audit event).

Phases, cycled over the trials: during ``train-client``, ``aggregate``, ``merge``, ``eval``,
``report`` (a seeded delay after the job's process appears; the phase actually hit is
recorded from the live processes at the kill), and at a rename of an output into place
(``hook/sitecustomize.py`` stops the job just before or just after its n-th rename, then the
driver kills). Kill mode (tree / job) is drawn from the seed. Prints one line to quote:
``kills: K survived: S identical: I`` (and ``status exact: E``).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from workflow_helpers import (  # noqa: E402 - after the sys.path entry above
    RUN,
    executed_jobs,
    make_workdir,
    run_snakemake,
    snakemake_cmd,  # noqa: E402
    snakemake_env,
)

from fedagent.core.atomic import MANIFEST, STAGING_PREFIX, verify_manifest  # noqa: E402
from fedagent.core.seeds import python_rng  # noqa: E402

HOOK = HERE / "hook"
PHASES = ("train-client", "aggregate", "merge", "eval", "report", "rename")
# Seconds after a job's process appears within which to kill it: short of how long the job
# takes on a busy 2-core machine (python start-up with torch is most of the short jobs).
WINDOW = {
    "train-client": (0.5, 6.0),
    "aggregate": (0.3, 2.0),
    "merge": (0.3, 2.0),
    "eval": (0.5, 5.0),
    "report": (0.3, 1.5),
}
# (command, number of output renames it makes) for the rename phase
RENAMES = (("train-client", 1), ("aggregate", 1), ("merge", 1), ("eval", 1), ("select", 1), ("report", 4))
ROUND1_JOBS = {
    "select@001",
    "train_client/0@001",
    "train_client/1@001",
    "aggregate@001",
    "merge@001",
    "eval@001",
    "report@001",
}
COMPARED = ("round_000/eval.json", "round_001/eval.json", "round_001/summary.csv", "round_001/model")
RULE_NAME = {"merge_protected": "merge", "merge_temporary": "merge"}


@dataclass
class Trial:
    index: int
    phase: str
    mode: str
    hit: str = ""  # what was running when the kill landed
    survived: bool = False
    identical: bool = False
    status_exact: bool | None = None
    partial_reads: int = 0  # files read from another job's staging or from the quarantine
    notes: list[str] = field(default_factory=list)


def _env(extra: dict | None = None) -> dict:
    # cold jobs: the hook (sitecustomize on PYTHONPATH) runs at each job's interpreter start and the
    # kills aim at the jobs' own process trees under Snakemake (the warm server's are tests/test_warm.py's)
    env = snakemake_env(warm=False)
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("FEDAGENT_KILL_RENAME", None)
    env.update(extra or {})
    return env


def _job_name(cmdline: list[str]) -> str:
    """``<rule>[/<client>]@<round>`` of a ``fedagent <command> ...`` command line (status's names)."""
    i = next(i for i, part in enumerate(cmdline) if os.path.basename(part) == "fedagent")
    command, args = cmdline[i + 1], cmdline[i + 2 :]

    def flag(name: str) -> str:
        return args[args.index(name) + 1] if name in args else ""

    name = _JOB_OF_COMMAND.get(command, command)
    if command == "train-client":
        name += "/" + flag("--client")
    rnd = flag("--round")
    if not rnd:  # aggregate, report: the round is in the output path (round_<rrr>/...)
        out = flag("--out") or flag("--summary")
        rnd = next((p.removeprefix("round_") for p in Path(out).parts if p.startswith("round_")), "")
    return f"{name}@{int(rnd):03d}" if rnd.isdigit() else name


def _fedagent_procs(root: psutil.Process) -> list[tuple[psutil.Process, str]]:
    """(process, command) of every ``fedagent <command>`` process under ``root``."""
    out = []
    try:
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for p in children:
        try:
            cmd = p.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for i, part in enumerate(cmd[:-1]):
            if os.path.basename(part) == "fedagent" and not cmd[i + 1].startswith("-"):
                if cmd[i + 1] != "serve-env":
                    out.append((p, cmd[i + 1]))
                break
    return out


def _kill_tree(root: psutil.Process) -> None:
    """SIGKILL Snakemake and every process under it (its group first, then stragglers)."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    try:
        os.killpg(root.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _wait_gone(procs: list[psutil.Process], timeout: float = 60) -> None:
    gone, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:  # e.g. an env service whose parent was the killed job: it exits by itself; make sure
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


# What a trial starts without, by the first job it must run: the reference minus that job's
# outputs and everything after them (a kill during aggregation need not redo the training).
_LATER = ("round_001/summary.csv", "round_001/curves.png", "summary.csv", "curves.png")
START_WITHOUT = {
    "train-client": ("round_001", "summary.csv", "curves.png"),
    "select": ("round_001", "summary.csv", "curves.png"),
    "aggregate": ("round_001/aggregate", "round_001/model", "round_001/eval.json", *_LATER),
    "merge": ("round_001/model", "round_001/eval.json", *_LATER),
    "eval": ("round_001/eval.json", *_LATER),
    "report": _LATER,
}


def build_reference(base: Path, extra: dict | None = None) -> Path:
    """The uninterrupted run (test config, rounds: 1, with the keys of ``extra`` merged in, e.g. another
    update format's); a finished one already in ``base`` is reused. Its jobs go through the warm server
    (nothing is killed or hooked here; a warm job writes a cold one's bytes: tests/test_warm.py), the
    trials' runs stay cold."""
    ref = base / "reference"
    if (ref / RUN / "round_001" / "summary.csv").is_file() and not any((ref / ".snakemake" / "locks").glob("*")):
        run_snakemake(ref, timeout=1800)  # finishes anything left, normally nothing to do
        return ref
    ref = make_workdir(ref)
    cfg = ref / "config" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("rounds: 3", "rounds: 1"))
    assert "rounds: 1" in cfg.read_text()
    if extra:
        import yaml

        from fedagent.core.config import merge_into

        cfg.write_text(yaml.safe_dump(merge_into(yaml.safe_load(cfg.read_text()), extra), sort_keys=False))
    run_snakemake(ref, timeout=1800)
    return ref


def start_state(ref: Path, work: Path, first_job: str) -> Path:
    """A copy of the reference (cp -a) without ``first_job``'s outputs and all later ones."""
    subprocess.run(["cp", "-a", str(ref), str(work)], check=True)
    for rel in START_WITHOUT[first_job]:
        p = work / RUN / rel
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
    return work


def _compare(ref: Path, work: Path) -> list[str]:
    """Differences between the trial's results and the reference (empty: byte-identical)."""
    diffs = []
    for rel in COMPARED:
        a, b = ref / RUN / rel, work / RUN / rel
        if a.is_dir():
            files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
            got = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file()) if b.is_dir() else []
            if files != got:
                diffs.append(f"{rel}: files {got} != reference {files}")
                continue
            diffs += [f"{rel}/{f}: bytes differ" for f in files if not filecmp.cmp(a / f, b / f, shallow=False)]
        elif not b.is_file() or not filecmp.cmp(a, b, shallow=False):
            diffs.append(f"{rel}: bytes differ or missing")
    return diffs


def _partial_reads(audit: Path) -> list[str]:
    """Reads (logged by hook/sitecustomize.py) of a staging or quarantined file by any job but
    the writer of that staging (which hashes its own files for the manifest)."""
    if not audit.is_file():
        return []
    bad = []
    for line in audit.read_text().splitlines():
        rec = json.loads(line)
        path, out = os.path.normpath(rec["path"]), os.path.normpath(rec["out"]) if rec["out"] else ""
        own = os.path.join(os.path.dirname(out), STAGING_PREFIX + os.path.basename(out)) if out else None
        if own is None or not (path == own or path.startswith(own + os.sep)):
            bad.append(f"partial read: {rec['command']} (pid {rec['pid']}) read {rec['path']}")
    return bad


def _integrity(work: Path) -> list[str]:
    """Every output directory verifies against its manifest; no staging left outside _failed/."""
    run_dir = work / RUN
    problems = []
    for manifest in run_dir.rglob(MANIFEST):
        d = manifest.parent
        if "_failed" in d.relative_to(run_dir).parts:
            continue
        try:
            verify_manifest(d)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            problems.append(f"manifest: {exc}")
    for p in run_dir.rglob(f"{STAGING_PREFIX}*"):
        if "_failed" not in p.relative_to(run_dir).parts:
            problems.append(f"staging left at {p.relative_to(run_dir)}")
    for d in (run_dir / "round_001" / "clients").iterdir():
        if d.is_dir() and not (d / MANIFEST).is_file():
            problems.append(f"output without manifest: {d.relative_to(run_dir)}")
    return problems


def _status_check(work: Path, trial: Trial, killed_jobs: set[str]) -> None:
    """fedagent status's finished jobs == the jobs Snakemake's dry run does not plan again.

    Every job Snakemake counts as done must be finished in status. Status may list one more
    only if it is a job that was running at the kill and whose complete output had already
    landed (killed after its rename, before it exited): Snakemake redoes such a job to be safe.
    """
    env = _env()
    st = subprocess.run(
        [sys.executable, "-m", "fedagent.cli", "status", RUN, "--json"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if st.returncode != 0:
        trial.status_exact = False
        trial.notes.append(f"status failed: {st.stderr[-500:]}")
        return
    from fedagent.report.status import finished_jobs

    finished = {j for j in finished_jobs(json.loads(st.stdout)) if j.endswith("@001")}
    dry = subprocess.run(snakemake_cmd("-n"), cwd=work, env=env, capture_output=True, text=True, timeout=600)
    planned = set()
    for rule, wildcards in executed_jobs(dry):
        w = dict(part.strip().split("=", 1) for part in wildcards.split(",") if "=" in part)
        name = RULE_NAME.get(rule, rule)
        if "client" in w:
            name += f"/{w['client']}"
        planned.add(f"{name}@{w.get('round', '')}")
    expected = ROUND1_JOBS - planned
    extra = finished - expected
    trial.status_exact = expected <= finished and extra <= killed_jobs
    if extra:
        trial.notes.append(f"status also lists as finished {sorted(extra)}: output landed before the kill")
    if not trial.status_exact:
        trial.notes.append(f"status finished {sorted(finished)} vs snakemake-done {sorted(expected)}")


_JOB_OF_COMMAND = {
    "train-client": "train_client",
    "aggregate": "aggregate",
    "merge": "merge",
    "eval": "eval",
    "select": "select",
    "report": "report",
}


def run_trial(i: int, seed: int, ref: Path, base: Path, *, check_status: bool) -> Trial:
    rng = python_rng(seed, "kill_trial", index=i)
    phase = PHASES[i % len(PHASES)]
    mode = rng.choice(("tree", "job"))
    trial = Trial(i, phase, mode)
    work = base / f"trial_{i:03d}"
    audit = base / f"trial_{i:03d}.audit"
    extra = {"FEDAGENT_READ_AUDIT": str(audit)}
    marker = base / f"trial_{i:03d}.marker"
    command = phase
    if phase == "rename":
        command, n_renames = RENAMES[rng.randrange(len(RENAMES))]
        when = rng.choice(("before", "after"))
        extra["FEDAGENT_KILL_RENAME"] = f"{command}:{rng.randint(1, n_renames)}:{when}:{marker}"
    start_state(ref, work, command)
    proc = subprocess.Popen(
        snakemake_cmd(),
        cwd=work,
        env=_env(extra),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    root = psutil.Process(proc.pid)
    killed_jobs: set[str] = set()
    deadline = time.monotonic() + 900
    try:
        target = None
        while time.monotonic() < deadline and proc.poll() is None:
            if phase == "rename":
                if marker.exists():
                    info = json.loads(marker.read_text())
                    target = psutil.Process(info["pid"])
                    dst = Path(info["dst"]) if Path(info["dst"]).is_absolute() else work / info["dst"]
                    trial.hit = f"{info['when']} rename -> {dst.relative_to(work / RUN)}"
                    break
            else:
                found = [p for p, cmd in _fedagent_procs(root) if cmd == phase]
                if found:
                    target = found[0]
                    lo, hi = WINDOW[phase]
                    time.sleep(lo + rng.random() * (hi - lo))
                    break
            time.sleep(0.05)
        if target is None:
            trial.notes.append("the phase never came (run ended or timed out)")
        procs = _fedagent_procs(root)
        live = sorted({cmd for _, cmd in procs})
        for p, _ in procs:
            try:
                killed_jobs.add(_job_name(p.cmdline()))
            except (psutil.NoSuchProcess, psutil.ZombieProcess, StopIteration, ValueError, IndexError):
                pass
        if phase != "rename":
            trial.hit = "+".join(live) if live else "between jobs"
        victims = [root, *root.children(recursive=True)] if proc.poll() is None else []
        if mode == "tree":
            _kill_tree(root)
        elif target is not None:
            try:
                victims = [target, *target.children(recursive=True)]
                target.kill()
            except psutil.NoSuchProcess:
                trial.notes.append("job ended before the kill")
        proc.wait(timeout=900)
        _wait_gone([v for v in victims if v.pid != proc.pid], timeout=60)
    finally:
        if proc.poll() is None:
            _kill_tree(root)
            proc.wait()

    if check_status:
        _status_check(work, trial, killed_jobs)

    # The documented recovery: the same command; `snakemake --unlock` first if it asks for it.
    def snakemake(*args: str) -> subprocess.CompletedProcess:  # with the read audit, no kill
        return subprocess.run(
            snakemake_cmd(*args),
            cwd=work,
            env=_env({"FEDAGENT_READ_AUDIT": str(audit)}),
            capture_output=True,
            text=True,
            timeout=1800,
        )

    again = snakemake()
    if again.returncode != 0 and "unlock" in (again.stdout + again.stderr).lower():
        snakemake("--unlock")
        again = snakemake()
    reads = _partial_reads(audit)
    trial.partial_reads = len(reads)
    trial.notes += reads
    trial.survived = again.returncode == 0
    if not trial.survived:
        trial.notes.append("re-run failed: " + (again.stdout + again.stderr)[-1500:])
        return trial
    diffs = _compare(ref, work) + _integrity(work)
    trial.identical = not diffs and not reads
    trial.notes += diffs
    return trial


def run_suite(
    kills: int, seed: int, base: Path, *, check_status: bool = True, keep: bool = False, log=print
) -> list[Trial]:
    """Reference run + ``kills`` trials; returns the trials (the summary line is logged)."""
    t0 = time.monotonic()
    ref = build_reference(base)
    log(f"reference run: {time.monotonic() - t0:.0f} s")
    trials = []
    for i in range(kills):
        t = time.monotonic()
        try:
            trial = run_trial(i, seed, ref, base, check_status=check_status)
        except Exception as exc:  # noqa: BLE001 - a driver error counts as a failed trial, the suite goes on
            trial = Trial(i, PHASES[i % len(PHASES)], "?", notes=[f"driver error: {exc!r}"])
        trials.append(trial)
        log(
            f"kill {i:02d} {trial.phase:12s} {trial.mode:4s} hit [{trial.hit}] survived={trial.survived} "
            f"identical={trial.identical} status_exact={trial.status_exact} ({time.monotonic() - t:.0f} s)"
            + "".join(f"\n    {n}" for n in trial.notes)
        )
        if not keep and trial.survived and trial.identical:
            shutil.rmtree(base / f"trial_{i:03d}", ignore_errors=True)
    hits = Counter(t.hit.split(" -> ")[0] if t.phase == "rename" else t.hit for t in trials)
    log("phases hit: " + ", ".join(f"{k}: {v}" for k, v in sorted(hits.items())))
    n_status = sum(t.status_exact is not None for t in trials)
    log(
        f"kills: {len(trials)} survived: {sum(t.survived for t in trials)} "
        f"identical: {sum(t.identical for t in trials)}"
        + (f" status exact: {sum(bool(t.status_exact) for t in trials)}/{n_status}" if n_status else "")
        + f" partial reads: {sum(t.partial_reads for t in trials)}"
        + f" ({time.monotonic() - t0:.0f} s)"
    )
    return trials


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--workdir", type=Path, default=None, help="keep everything here (default: a temp dir)")
    parser.add_argument("--no-status", action="store_true", help="skip the fedagent status check")
    args = parser.parse_args(argv)
    base = args.workdir or Path(tempfile.mkdtemp(prefix="fedagent-kills-"))
    base.mkdir(parents=True, exist_ok=True)
    trials = run_suite(
        args.kills,
        args.seed,
        base,
        check_status=not args.no_status,
        keep=args.workdir is not None,
        log=lambda s: print(s, flush=True),
    )
    if args.workdir is None:
        shutil.rmtree(base, ignore_errors=True)
    ok = all(t.survived and t.identical and t.status_exact is not False for t in trials)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
