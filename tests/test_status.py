"""fedagent status: job states read from output files only (a hand-built run directory)."""

from __future__ import annotations

import json

from fedagent.core.atomic import atomic_dir, atomic_write_json, quarantine
from fedagent.cli import main as cli_main
from fedagent.report.status import finished_jobs, run_status


def _dir(path, files=None):
    with atomic_dir(path) as stage:
        for name, text in (files or {"w.bin": "x"}).items():
            (stage / name).write_text(text)


def make_run(root):
    run = root / "results" / "r"
    _dir(run / "plan" / "games")
    atomic_write_json(run / "plan" / "partition.json", {})
    atomic_write_json(run / "plan" / "val_set.json", {})
    r0 = run / "round_000"
    _dir(r0 / "model")
    atomic_write_json(
        r0 / "eval.json", {"round": 0, "n": 2, "success_rate": 0.5, "ci95": [0.1, 0.9], "score_mean": 1.0}
    )
    (r0 / "summary.csv").write_text("round\n0\n")
    (r0 / "curves.png").write_bytes(b"png")
    r1 = run / "round_001"
    atomic_write_json(r1 / "selection.json", {"round": 1, "clients": [0, 2, 5, 7, 9]})
    _dir(r1 / "clients" / "0")  # finished
    _dir(r1 / "clients" / "2", {"dropped.json": json.dumps({"reason": "exit 1: OOM"})})  # dropped
    (r1 / "clients" / ".partial-5").mkdir()  # running (or killed, not re-run)
    (r1 / "clients" / ".partial-5" / "half.bin").write_text("x")
    bad = r1 / "clients" / ".partial-7"  # failed: only a quarantined attempt
    bad.mkdir()
    quarantine(bad, run / "_failed", "round_001__clients__7")
    _dir(r1 / "clients" / "9")  # a finished output whose manifest no longer matches: not finished
    (r1 / "clients" / "9" / "w.bin").write_text("changed size")
    return run


def test_states_from_files(tmp_path):
    run = make_run(tmp_path)
    st = run_status(run)
    assert st["plan"] == {"games": "finished", "partition": "finished", "val_set": "finished"}
    r0, r1 = st["rounds"]
    assert r0["complete"] and r0["jobs"] == {"base_model": "finished", "eval": "finished", "report": "finished"}
    assert r1["jobs"] == {
        "select": "finished",
        "train_client/0": "finished",
        "train_client/2": "dropped",
        "train_client/5": "running",
        "train_client/7": "failed",
        "train_client/9": "failed",
        "aggregate": "missing",
        "merge": "missing",
        "eval": "missing",
        "report": "missing",
    }
    assert not r1["complete"] and r1["dropped"] == {"2": "exit 1: OOM"}
    assert st["latest"]["round"] == 0 and st["latest"]["success_rate"] == 0.5
    assert finished_jobs(st) >= {"select@001", "train_client/0@001", "train_client/2@001", "eval@000"}
    assert "train_client/5@001" not in finished_jobs(st)


def test_a_consumed_temporary_output_is_not_missing(tmp_path):
    run = make_run(tmp_path)
    r1 = run / "round_001"
    _dir(r1 / "aggregate")
    for c in ("0", "2"):  # temp client updates deleted by Snakemake after the aggregate read them
        import shutil

        shutil.rmtree(r1 / "clients" / c)
    st = run_status(run)["rounds"][1]["jobs"]
    assert st["train_client/0"] == "consumed" and st["aggregate"] == "finished"


def test_cli_text_and_json(tmp_path, capsys):
    run = make_run(tmp_path)
    assert cli_main(["status", str(run)]) == 0
    text = capsys.readouterr().out
    assert (
        "round 001: incomplete" in text and "train_client/5 running" in text and "client 2 dropped: exit 1: OOM" in text
    )
    assert "latest eval: round 000 success_rate 0.5" in text
    assert cli_main(["status", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"][1]["jobs"]["train_client/7"] == "failed"
    assert cli_main(["status", str(tmp_path / "nope")]) == 1
