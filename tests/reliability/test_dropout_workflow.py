"""Client dropout (clients.min_per_round) under real Snakemake: strict stops, min 1 goes on.

Client 1 cannot train (``FEDAGENT_FAIL_TRAIN_CLIENT=1``, injected by hook/sitecustomize.py).
Strict (the default): the run stops with the failed job named and nothing aggregated. Then
``min_per_round: 1`` in the same work dir: the same command finishes the round with client 0
alone; client 1's directory is a drop record, listed in aggregate.json, the aggregate's
provenance.json, eval.json, the report's summary.csv and ``fedagent status``; ``fedagent verify``
accepts the round.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kill_driver import _env, start_state
from workflow_helpers import RUN, executed_jobs, snakemake_cmd

pytestmark = [pytest.mark.workflow, pytest.mark.slow]


def _snakemake(work, env):
    return subprocess.run(snakemake_cmd(), cwd=work, env=env, capture_output=True, text=True, timeout=1800)


def test_strict_stops_then_min_per_round_1_finishes_with_the_survivor(reference_run, tmp_path):
    work = start_state(reference_run, tmp_path / "w", "select")
    env = _env({"FEDAGENT_FAIL_TRAIN_CLIENT": "1"})
    rd = work / RUN / "round_001"

    strict = _snakemake(work, env)
    out = strict.stdout + strict.stderr
    assert strict.returncode != 0
    assert "Error in rule train_client" in out and "client=1" in out
    log = (work / RUN / "logs" / "round_001" / "train_client_1.log").read_text()
    assert "not dropped: strict" in log
    assert not (rd / "aggregate").exists() and not (rd / "clients" / "1").exists()

    cfg = work / "config" / "config.yaml"
    cfg.write_text(
        cfg.read_text().replace(
            "clients: {total: 2, per_round: 2}", "clients: {total: 2, per_round: 2, min_per_round: 1}"
        )
    )
    assert "min_per_round: 1" in cfg.read_text()
    again = _snakemake(work, env)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert ("train_client", "round=001, client=1") in executed_jobs(again)
    dropped = json.loads((rd / "clients" / "1" / "dropped.json").read_text())
    assert dropped["client"] == 1 and "exited 1" in dropped["reason"] and "injected failure" in dropped["reason"]
    agg = json.loads((rd / "aggregate" / "aggregate.json").read_text())
    assert [c["dir"] for c in agg["clients"]] == [f"{RUN}/round_001/clients/0"]
    assert agg["dropped"][0]["dir"] == f"{RUN}/round_001/clients/1"
    prov = json.loads((rd / "aggregate" / "provenance.json").read_text())
    assert prov["dropped"] == agg["dropped"] and prov["params"]["min_clients"] == 1
    assert json.loads((rd / "eval.json").read_text())["dropped_clients"] == ["1"]
    rows = (rd / "summary.csv").read_text().splitlines()
    header, last = rows[0].split(","), rows[-1].split(",")
    assert last[header.index("clients_dropped")] == "1"  # the report says so too

    st = subprocess.run(
        [sys.executable, "-m", "fedagent.cli", "status", RUN, "--json"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    r1 = json.loads(st.stdout)["rounds"][1]
    assert r1["jobs"]["train_client/1"] == "dropped" and r1["complete"]
    assert "injected failure" in r1["dropped"]["1"]
    ver = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedagent.cli",
            "verify",
            "--prev",
            f"{RUN}/round_000/model",
            "--clients",
            f"{RUN}/round_001/clients/0",
            f"{RUN}/round_001/clients/1",
            "--aggregate",
            f"{RUN}/round_001/aggregate",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert ver.returncode == 0, ver.stderr
