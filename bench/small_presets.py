"""Run -small presets end to end, one at a time, and record what each did.

    PYTHONPATH=. python bench/small_presets.py [--out bench/small_presets.jsonl] [--work /tmp/presets] [NAME ...]

Each preset (``config/experiments/<name>.yaml``; all ``*-small`` ones when no NAME is given)
runs in a fresh copy of the workflow (``<work>/<name>``: Snakefile, rules, workflow, profiles,
envs, the repository's ``config/config.yaml``) with the user's command line::

    snakemake --profile profiles/local --configfile config/experiments/<name>.yaml

and appends one JSON line to ``--out``: preset, return code, wall seconds, rounds completed
(round folders with an ``eval.json``), the expected rounds, and the final ``summary.csv`` row.
Presets run sequentially (the 2-core machine is shared); the Snakemake log stays in
``<work>/<name>/snakemake.log``. ``--markdown`` prints the table of an existing ``--out``;
``--collect`` records runs already finished in ``<work>`` (wall time: Snakemake's "Elapsed time").
After each record the run's ``*.safetensors`` are deleted (about 2.6 GB a run) unless ``--keep-models``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

from fedagent.core.workflow_copy import copy_workflow

REPO = Path(__file__).resolve().parent.parent


def small_presets() -> list[Path]:
    """Every ``config/experiments/*-small.yaml``, sorted by name."""
    return sorted((REPO / "config" / "experiments").glob("*-small.yaml"))


def workdir_for(preset: Path, work: Path) -> Path:
    """A fresh workflow copy for ``preset`` under ``work`` (an old one is removed first)."""
    path = work / preset.stem
    if path.exists():
        shutil.rmtree(path)
    return copy_workflow(REPO, path, REPO / "config" / "config.yaml", presets=[preset])


def elapsed_from_log(log: Path) -> float | None:
    """Seconds from Snakemake's closing ``Elapsed time: H:MM:SS.ff`` line, if the log has one."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("Elapsed time:"):
            h, m, sec = line.split(":", 1)[1].strip().split(":")
            return int(h) * 3600 + int(m) * 60 + float(sec)
    return None


def record(preset: Path, wd: Path, rc, wall: float, started: str) -> dict:
    """What a finished run in ``wd`` did: rounds with an eval, the final summary.csv row."""
    cfg = yaml.safe_load(preset.read_text())
    run_dir = wd / "results" / cfg["run"]
    done = sorted(p.parent.name for p in run_dir.glob("round_*/eval.json"))
    summary = run_dir / "summary.csv"
    rows = summary.read_text().strip().splitlines() if summary.is_file() else []
    return {
        "preset": preset.stem,
        "started": started,
        "rc": rc,
        "wall_s": round(wall, 1),
        "rounds": cfg["rounds"],
        "rounds_done": max(len(done) - 1, 0),  # round_000 is the base model
        "summary_header": rows[0] if rows else "",
        "summary_last": rows[-1] if len(rows) > 1 else "",
    }


def run_preset(preset: Path, work: Path, timeout: int) -> dict:
    """Run one preset end to end; the record of what it did."""
    wd = workdir_for(preset, work)
    exe = Path(sys.executable).parent / "snakemake"
    cmd = [str(exe), "--profile", "profiles/local", "--configfile", f"config/experiments/{preset.name}"]
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHONHASHSEED", "0")
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    t0 = time.monotonic()
    with open(wd / "snakemake.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=wd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return record(preset, wd, rc, time.monotonic() - t0, started)


def markdown(records: list[dict]) -> str:
    """The results table (the last record of each preset)."""
    last = {r["preset"]: r for r in records}
    lines = ["| preset | rc | wall | rounds done | final summary.csv row |", "|---|---|---|---|---|"]
    for name in sorted(last):
        r = last[name]
        m, s = divmod(int(round(r["wall_s"])), 60)
        lines.append(
            f"| {name} | {r['rc']} | {m} min {s:02d} s | {r['rounds_done']}/{r['rounds']} | `{r['summary_last']}` |"
        )
    total = sum(r["wall_s"] for r in last.values())
    lines.append(f"\n{len(last)} presets, {total / 60:.1f} min in all.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="preset names (default: every *-small preset)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "small_presets.jsonl")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fedagent-presets"))
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--markdown", action="store_true", help="print the table of --out and exit")
    ap.add_argument(
        "--keep-models",
        action="store_true",
        help="keep each run's model weights (default: delete *.safetensors after the record)",
    )
    ap.add_argument(
        "--collect",
        action="store_true",
        help="record runs already finished in <work>/<name> (wall time from Snakemake's log) instead of running",
    )
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown([json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]))
        return 0
    presets = [REPO / "config" / "experiments" / f"{n}.yaml" for n in args.names] if args.names else small_presets()
    for p in presets:
        if not p.is_file():
            raise SystemExit(f"no preset {p}")
    args.work.mkdir(parents=True, exist_ok=True)
    failed = 0
    for p in presets:
        if args.collect:
            log = args.work / p.stem / "snakemake.log"
            wall = elapsed_from_log(log) if log.is_file() else None
            rec = record(
                p,
                args.work / p.stem,
                0 if wall is not None else "unfinished",
                wall or 0.0,
                datetime.fromtimestamp(log.stat().st_mtime - (wall or 0.0), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                if log.is_file()
                else "",
            )
        else:
            rec = run_preset(p, args.work, args.timeout)
            if not args.keep_models:  # ~2.6 GB of fp32 weights per run: 24 runs fill a disk
                for f in (args.work / p.stem).rglob("*.safetensors"):
                    f.unlink()
        failed += rec["rc"] != 0
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
