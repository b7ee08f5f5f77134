"""The tests' Snakemake fork server (tests/snakemake_fork.py through workflow_helpers.snakemake_run): a
forked run is what a fresh ``snakemake`` process runs. The same plan text (but for its date and workflow
id) and exit code, the same refusal of a bad config, and a timeout ends the run with its jobs."""

from __future__ import annotations

import re
import subprocess
import time

import psutil
import pytest

import workflow_helpers

from workflow_helpers import RUN, make_workdir, snakemake_cmd, snakemake_env, snakemake_run

pytestmark = pytest.mark.workflow


_CLOCK = re.compile(r"^(  Date: .*|  Workflow ID: .*|\[\w{3} \w{3} +\d+ [\d:]+ \d{4}\])$")


def _stable(text: str) -> list[str]:
    """The lines of Snakemake's output that do not hold the clock or the run's random id."""
    return [line for line in text.splitlines() if not _CLOCK.match(line)]


def test_a_forked_run_prints_and_exits_as_a_fresh_process(tmp_path):
    work = make_workdir(tmp_path / "w")
    env = snakemake_env(warm=False)
    for args in (("-n", "--config", "rounds=2"), ("-n", "--config", "train={lr: -1}")):
        cmd = snakemake_cmd(*args)
        forked = snakemake_run(cmd, work, env, 300)
        fresh = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert forked.returncode == fresh.returncode, (args, forked.stderr[-2000:], fresh.stderr[-2000:])
        # the same lines; not their order: a dry run lists jobs that are ready together in an order Snakemake
        # does not fix (`rule select:` before `rule games:` or after it)
        assert sorted(_stable(forked.stdout)) == sorted(_stable(fresh.stdout)), args
        assert _stable(forked.stderr) == _stable(fresh.stderr), args
    assert forked.returncode != 0 and "train.lr" in forked.stderr  # the second: refused, naming the key
    # One server for every environment with the same start-up variables (pytest's PYTEST_CURRENT_TEST
    # changes with each test); a forked run takes on its own environment (test_job_resources' FEDAGENT_GPUS).
    servers = set(workflow_helpers._FORK.values())
    snakemake_run(snakemake_cmd("-n"), work, {**env, "PYTEST_CURRENT_TEST": "another"}, 300)
    assert set(workflow_helpers._FORK.values()) == servers


def test_each_forked_run_has_its_own_environment_and_directory(tmp_path):
    """Two runs of one server (the same start-up variables): each job sees its own request's variable and
    writes into its own run's directory."""
    exe = snakemake_cmd()[0]
    env = snakemake_env(warm=False)
    for value in ("first", "second"):
        work = tmp_path / value
        work.mkdir()
        (work / "Snakefile").write_text(
            'rule all:\n    output: "env.txt"\n    shell: "echo $FA_FORK_PROBE > {output}"\n'
        )
        proc = snakemake_run([exe, "--cores", "1"], work, {**env, "FA_FORK_PROBE": value}, 300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert (work / "env.txt").read_text() == value + "\n"


def test_a_timeout_ends_the_run_and_its_jobs(tmp_path):
    work = make_workdir(tmp_path / "w")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        snakemake_run(snakemake_cmd("--config", "rounds=1"), work, snakemake_env(warm=False), 8)
    assert time.monotonic() - start < 30  # not once the run had finished

    def left():
        found = []
        for p in psutil.process_iter(["cwd", "status"]):
            if p.info["cwd"] and str(work) in p.info["cwd"] and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        return found

    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left(), left()
    assert not (work / RUN / "summary.csv").exists()
