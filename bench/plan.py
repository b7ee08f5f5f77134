"""Benchmark: planning cost of the workflow against a bare Snakemake graph of the same shape.

    python bench/plan.py [--reps 5] [--rounds 70] [--workdir DIR]

Two cases, each timed as the wall time of a fresh ``snakemake`` process (what a user, a
cron job or a Slurm status round pays):

- dry-run:  ``snakemake -n --config rounds=70`` on an empty results dir (the whole 70-round
            plan: 3 + 3 + 70 × (4 + M) jobs).
- no-op:    ``snakemake --cores 2`` on a finished run of the default config ("Nothing to be
            done"), i.e. what every resume or status check of a finished run pays.

The baseline is a bare Snakefile with the same rules per round (games, partition, val_set,
base_model, select, train_client ×M, aggregate, merge, eval, report), the same inputs and
outputs (directories where the workflow has directories) and the same workflow profile, but
trivial jobs (``mkdir``/``touch``), no config validation and no imports. Its finished run is
made by running it; the workflow's is made by the workflow's own rules with a stand-in
``fedagent`` executable first on PATH that only creates each job's outputs (planning does not
look inside them), so both runs carry Snakemake's own metadata of a real execution.

Variants are interleaved rep by rep so that both see the same machine load; the minimum of
``--reps`` is reported, with the median beside it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_PARTS = ("Snakefile", "rules", "workflow", "profiles", "envs", "config")

BARE_SNAKEFILE = r"""
# Bare graph of the fedagent workflow's shape: same rules per round, trivial jobs.
config.setdefault("rounds", 2)
config.setdefault("clients", 2)
RUN = "results/bare"
GAMES, PARTITION, VAL_SET = f"{RUN}/plan/games", f"{RUN}/plan/partition.json", f"{RUN}/plan/val_set.json"

wildcard_constraints:
    round=r"\d{3}",
    client=r"\d+",

def round_dir(r):
    return f"{RUN}/round_{int(r):03d}"

def model_dir(r):
    return f"{round_dir(r)}/model"

rule all:
    input:
        [f"{round_dir(r)}/summary.csv" for r in range(config["rounds"] + 1)],
        [f"{round_dir(r)}/curves.png" for r in range(config["rounds"] + 1)],
    default_target: True

rule games:
    output: directory(GAMES)
    shell: "mkdir -p {output}"

rule partition:
    input: GAMES
    output: PARTITION
    shell: "touch {output}"

rule val_set:
    input: GAMES
    output: VAL_SET
    shell: "touch {output}"

rule base_model:
    output: directory(model_dir(0))
    shell: "mkdir -p {output}"

rule select:
    output: f"{RUN}/round_{{round}}/selection.json"
    wildcard_constraints: round=r"(?!000)\d{3}"
    shell: "touch {output}"

rule train_client:
    input:
        model=lambda w: model_dir(int(w.round) - 1),
        ref=model_dir(0),
        games=GAMES,
        partition=PARTITION,
    output: directory(f"{RUN}/round_{{round}}/clients/{{client}}")
    wildcard_constraints: round=r"(?!000)\d{3}"
    shell: "mkdir -p {output}"

rule aggregate:
    input:
        prev=lambda w: model_dir(int(w.round) - 1),
        selection=f"{RUN}/round_{{round}}/selection.json",
        clients=lambda w: [f"{round_dir(w.round)}/clients/{c}" for c in range(config["clients"])],
    output: directory(f"{RUN}/round_{{round}}/aggregate")
    wildcard_constraints: round=r"(?!000)\d{3}"
    shell: "mkdir -p {output}"

rule merge:
    input:
        prev=lambda w: model_dir(int(w.round) - 1),
        aggregate=f"{RUN}/round_{{round}}/aggregate",
    output: directory(f"{RUN}/round_{{round}}/model")
    wildcard_constraints: round=r"(?!000)\d{3}"
    shell: "mkdir -p {output}"

rule eval:
    input:
        model=lambda w: model_dir(w.round),
        games=GAMES,
        val_set=VAL_SET,
    output: f"{RUN}/round_{{round}}/eval.json"
    shell: "touch {output}"

rule report:
    input: lambda w: [f"{round_dir(r)}/eval.json" for r in range(0, int(w.round) + 1)]
    output:
        summary=f"{RUN}/round_{{round}}/summary.csv",
        curves=f"{RUN}/round_{{round}}/curves.png",
    shell: "touch {output}"
"""

# Stands in for the `fedagent` CLI when making the workflow's finished run: creates the
# job's outputs (a file for .json/.csv/.png paths, else a directory) and nothing else.
FAKE_FEDAGENT = r"""#!{python}
import sys
from pathlib import Path
args = sys.argv[1:]
for flag in ("--out", "--summary", "--curves", "--timings"):
    if flag in args:
        p = Path(args[args.index(flag) + 1])
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.suffix in (".json", ".csv", ".png"):
            p.write_text("{{}}")
        else:
            p.mkdir(parents=True, exist_ok=True)
            (p / "done").write_text("")
"""


def snakemake_exe() -> str:
    return str(Path(sys.executable).parent / "snakemake")


def timed(cmd: list[str], cwd: Path, env: dict, expect: str | None = None) -> float:
    """Wall seconds of one command (which must succeed, and print ``expect`` when given)."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    if expect is not None and expect not in proc.stdout + proc.stderr:
        raise SystemExit(f"{' '.join(cmd)} in {cwd}: expected {expect!r} in its output:\n{proc.stderr[-3000:]}")
    return dt


def setup(work: Path, env: dict) -> tuple[Path, Path, dict]:
    """The workflow copy, the bare copy (both with a finished default run) and the PATH env."""
    wf, bare, fake_bin = work / "workflow", work / "bare", work / "fakebin"
    for d in (wf, bare, fake_bin):
        if d.exists():
            shutil.rmtree(d)
    wf.mkdir(parents=True)
    for part in WORKFLOW_PARTS:
        src = REPO / part
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, wf / part)
    bare.mkdir()
    (bare / "Snakefile").write_text(BARE_SNAKEFILE)
    shutil.copytree(REPO / "profiles" / "default", bare / "profiles" / "default")
    fake_bin.mkdir()
    (fake_bin / "fedagent").write_text(FAKE_FEDAGENT.format(python=sys.executable))
    (fake_bin / "fedagent").chmod(0o755)
    fake_env = {**env, "PATH": f"{fake_bin}{os.pathsep}{env['PATH']}"}
    sm = snakemake_exe()
    timed([sm, "--cores", "2", "--quiet"], bare, env)
    timed([sm, "--cores", "2", "--quiet"], wf, fake_env)
    return wf, bare, fake_env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=70)
    ap.add_argument("--workdir", type=Path, default=None, help="scratch dir (default: a temp dir, removed)")
    args = ap.parse_args(argv)

    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    tmp = None
    work = args.workdir
    if work is None:
        tmp = tempfile.TemporaryDirectory(prefix="fedagent-bench-plan-")
        work = Path(tmp.name)
    try:
        wf, bare, fake_env = setup(work, env)
        sm = snakemake_exe()
        cases = {
            "dry-run": (["-n", "--quiet", "--config", f"rounds={args.rounds}"], None),
            "no-op": (["--cores", "2"], "Nothing to be done"),
        }
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.reps):
            for case, (extra, expect) in cases.items():
                for name, cwd, e in (("bare", bare, env), ("workflow", wf, fake_env)):
                    times.setdefault((case, name), []).append(timed([sm, *extra], cwd, e, expect))
    finally:
        if tmp is not None:
            tmp.cleanup()

    print(
        f"planning cost, {args.reps} reps interleaved (min / median seconds), "
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'case':<28} {'bare':>14} {'workflow':>14} {'ratio (min)':>12} {'ratio (median)':>15}")
    worst = 0.0
    for case in cases:
        b, w = times[(case, "bare")], times[(case, "workflow")]
        label = f"{case} (rounds={args.rounds})" if case == "dry-run" else f"{case} (finished default)"
        r_min, r_med = min(w) / min(b), statistics.median(w) / statistics.median(b)
        worst = max(worst, r_min)
        print(
            f"{label:<28} {min(b):6.2f} / {statistics.median(b):5.2f} {min(w):6.2f} / {statistics.median(w):5.2f}"
            f" {r_min:11.2f}x {r_med:14.2f}x"
        )
    print(f"goal: each ratio <= 1.5x: {'met' if worst <= 1.5 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
