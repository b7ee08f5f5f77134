"""Per-round wall time and overhead of the Slurm profile on a real Slurm (docs/results/slurm.md).

    python bench/slurm_rounds.py --variant before=/path/to/old/checkout --variant after=. \
        [--rounds 3] [--local] [--keep DIR]

Each variant is a checkout whose workflow (Snakefile, rules, workflow, profiles, envs) runs the
test config (tests/workflow_config.yaml: tiny model, 2 clients) from an empty workdir through
`--profile profiles/slurm` plus the small-node overrides below (small_node), one variant after the other
(back to back, so both see the same machine load). The fedagent code is this checkout's in all
of them (PYTHONPATH): only the workflow and profile differ. Needs a running Slurm
(scripts/slurm-local.sh start DIR).

A round's wall time runs from the first train_client submission of round r to the moment the
driver notices round r's merge finished. Its compute is what runs on the critical path inside
that span, from Snakemake's benchmark files: both trainings (one after the other on a 2-CPU
node, each takes both CPUs), aggregate, merge, and eval when it finishes inside the span (the
server group). Overhead = wall - compute. `--local` adds a run of profiles/local and compares
every model weight file and eval.json of all runs byte for byte.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from fedagent.core.workflow_copy import copy_workflow

HERE = Path(__file__).resolve().parent.parent
RUN = "results/t"
# The node is small (2 CPUs, ~20 GB): cap threads (`games` asks 8) and shrink the memory asks.
# A command-line --default-resources / --set-resources replaces the profile's whole key, so
# small_node() restates the variant's own set-resources with only mem_mb and runtime changed.
SMALL_DEFAULTS = ["--max-threads", "2", "--default-resources", "mem_mb=2000", "runtime=120", "slurm_partition=''"]
SMALL_MEM = {"train_client": ("8000", "720")}


def small_node(profile: Path) -> list[str]:
    import yaml

    entries = []
    for rule, res in (yaml.safe_load(profile.read_text()).get("set-resources") or {}).items():
        mem, runtime = SMALL_MEM.get(rule, ("1000", "30"))
        for key, value in res.items():
            value = {"mem_mb": mem, "runtime": runtime}.get(key, value)
            entries.append(f"{rule}:{key}={value}")
    return SMALL_DEFAULTS + (["--set-resources", *entries] if entries else [])


_TS = re.compile(r"^\s*\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]")
_RULE = re.compile(r"^\s*(?:local)?rule (\w+):$")
_JOBID = re.compile(r"^\s+jobid: (\d+)$")
_WILD = re.compile(r"^\s+wildcards: (.*)$")
_FINISHED = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$")
_SUBMITTED = re.compile(r"has been submitted with SLURM jobid")


def parse_log(text: str) -> dict[int, dict]:
    """jobid → {rule, round, start, end} (epoch seconds, 1 s resolution) from Snakemake's log."""
    jobs, ts, current = {}, None, None
    for line in text.splitlines():
        if m := _TS.match(line):
            ts = datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y").timestamp()
        elif m := _RULE.match(line):
            current = {"rule": m.group(1), "round": None, "start": ts, "end": None}
        elif (m := _JOBID.match(line)) and current is not None:
            jobs[int(m.group(1))] = current
        elif (m := _WILD.match(line)) and current is not None:
            for part in m.group(1).split(","):
                key, _, value = part.strip().partition("=")
                if key == "round":
                    current["round"] = int(value)
        elif m := _FINISHED.match(line):
            if int(m.group(1)) in jobs:
                jobs[int(m.group(1))]["end"] = ts
    return jobs


def bench_seconds(path: Path) -> float:
    with path.open() as f:
        return float(next(csv.DictReader(f, delimiter="\t"))["s"])


def rounds_table(work: Path, jobs: dict[int, dict]) -> list[dict]:
    rows = []
    rounds = sorted({j["round"] for j in jobs.values() if j["rule"] == "train_client"})
    for r in rounds:
        mine = [j for j in jobs.values() if j["round"] == r]
        start = min(j["start"] for j in mine if j["rule"] == "train_client")
        end = max(j["end"] for j in mine if j["rule"].startswith("merge"))
        bdir = work / RUN / "benchmarks" / f"round_{r:03d}"
        compute = sum(bench_seconds(p) for p in bdir.glob("train_client_*.tsv"))
        compute += bench_seconds(bdir / "aggregate.tsv") + bench_seconds(bdir / "merge.tsv")
        ev = [j for j in mine if j["rule"] == "eval"]
        if ev and ev[0]["end"] is not None and ev[0]["end"] <= end:
            compute += bench_seconds(bdir / "eval.tsv")
        rows.append({"round": r, "wall": end - start, "compute": compute, "overhead": end - start - compute})
    return rows


def digests(work: Path) -> dict[str, str]:
    run = work / RUN
    files = sorted(run.glob("round_*/model/*.safetensors")) + sorted(run.glob("round_*/clients/*/*.safetensors"))
    files += sorted(run.glob("round_*/eval.json"))
    return {p.relative_to(run).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def make_workdir(src: Path, dst: Path) -> Path:
    return copy_workflow(src, dst, HERE / "tests" / "workflow_config.yaml")


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run_variant(name: str, src: Path, root: Path, rounds: int, profile: str) -> dict:
    work = make_workdir(src, root / name)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(HERE),
        "PYTHONHASHSEED": "0",
    }
    extra = small_node(work / "profiles" / "slurm" / "config.yaml") if profile == "slurm" else []
    cmd = [
        str(Path(sys.executable).parent / "snakemake"),
        "--profile",
        f"profiles/{profile}",
        *extra,
        "--config",
        f"rounds={rounds}",
    ]
    load_before, t0 = load(), time.monotonic()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall, load_after = time.monotonic() - t0, load()
    log = proc.stdout + proc.stderr
    (root / f"{name}.log").write_text(" ".join(cmd) + "\n" + log)
    if proc.returncode != 0:
        sys.exit(f"{name}: snakemake failed ({proc.returncode}), log in {root / f'{name}.log'}")
    jobs = parse_log(log)
    return {
        "name": name,
        "work": work,
        "wall": wall,
        "load": (load_before, load_after),
        "submissions": len(_SUBMITTED.findall(log)),
        "rounds": rounds_table(work, jobs) if profile == "slurm" else [],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=CHECKOUT")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--local", action="store_true", help="also run profiles/local and compare outputs")
    ap.add_argument("--keep", type=Path, help="keep the workdirs and logs here")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="slurm-rounds-"))
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for spec in args.variant:
        name, _, path = spec.partition("=")
        results.append(run_variant(name, Path(path).resolve(), root, args.rounds, "slurm"))
    if args.local:
        results.append(run_variant("local", HERE, root, args.rounds, "local"))
    print("| variant | round | wall s | compute s | overhead s |")
    print("|---|---|---|---|---|")
    for res in results:
        for row in res["rounds"]:
            print(
                f"| {res['name']} | {row['round']} | {row['wall']:.0f} | {row['compute']:.1f} | {row['overhead']:.1f} |"
            )
    print()
    for res in results:
        print(
            f"{res['name']}: whole run {res['wall']:.0f} s, {res['submissions']} sbatch submissions, "
            f"load average before {res['load'][0]}, after {res['load'][1]}"
        )
    ref = digests(results[0]["work"])
    for res in results[1:]:
        same = digests(res["work"]) == ref
        print(f"{res['name']} vs {results[0]['name']}: {len(ref)} model/eval files, byte-identical: {same}")
    print(f"workdirs and logs: {root}")


if __name__ == "__main__":
    main()
