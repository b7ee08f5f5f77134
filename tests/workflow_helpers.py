"""Helpers for workflow tests: a copy of the workflow in a temp dir, run by real Snakemake."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from fedagent.core.workflow_copy import copy_workflow

REPO = Path(__file__).resolve().parent.parent
TEST_CONFIG = Path(__file__).resolve().parent / "workflow_config.yaml"
RUN = "results/t"


def make_workdir(path: Path) -> Path:
    """A fresh checkout-like directory: the workflow files plus the test config as the default."""
    return copy_workflow(REPO, path, TEST_CONFIG)


def clone_workdir(src: Path, dst: Path) -> Path:
    """Copy a finished workdir keeping mtimes (cp -a), as a user would back one up."""
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def snakemake_cmd(*args: str) -> list[str]:
    """The user's command line: `snakemake --profile profiles/local ...` from this venv."""
    exe = Path(sys.executable).parent / "snakemake"
    return [str(exe), "--profile", "profiles/local", *args]


def snakemake_env() -> dict:
    """Environment for Snakemake runs: the venv's bin first on PATH (rules call `fedagent`)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHONHASHSEED", "0")
    return env


def run_snakemake(workdir: Path, *args: str, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run Snakemake in ``workdir``; on failure show its output and the failed job logs."""
    proc = subprocess.run(snakemake_cmd(*args), cwd=workdir, env=snakemake_env(), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-6000:]}\n{proc.stderr[-8000:]}")
    return proc


_JOB = re.compile(r"^(?:local)?rule (\w+):\s*$")
_WILDCARDS = re.compile(r"^\s+wildcards: (.*)$")


def executed_jobs(proc: subprocess.CompletedProcess) -> list[tuple[str, str]]:
    """(rule, wildcards) of every job Snakemake started, from its log ('all' excluded)."""
    jobs, current = [], None
    for line in (proc.stdout + "\n" + proc.stderr).splitlines():
        m = _JOB.match(line)
        if m:
            if current and current[0] != "all":
                jobs.append(tuple(current))
            current = [m.group(1), ""]
            continue
        w = _WILDCARDS.match(line)
        if w and current is not None:
            current[1] = w.group(1).strip()
    if current and current[0] != "all":
        jobs.append(tuple(current))
    return sorted(jobs)


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under ``root`` — to prove nothing was touched."""
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}
