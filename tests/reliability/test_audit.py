"""The kill suite's read audit: a job reading another job's staging (or the quarantine) is caught."""

from __future__ import annotations

import os
import subprocess
import sys

from kill_driver import HOOK, _partial_reads


def _job(tmp_path, out: str, reads: list[str], audit):
    script = tmp_path / "fedagent"  # the audit hooks only processes named fedagent
    script.write_text("import sys\nfor p in sys.argv[sys.argv.index('--read') + 1:]:\n    open(p).read()\n")
    env = {
        **os.environ,
        "PYTHONPATH": f"{HOOK}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "FEDAGENT_READ_AUDIT": str(audit),
    }
    subprocess.run(
        [sys.executable, str(script), "aggregate", "--out", out, "--read", *reads], cwd=tmp_path, env=env, check=True
    )


def test_only_a_writer_may_read_its_own_staging(tmp_path):
    run = tmp_path / "results" / "t" / "round_001"
    for d in (".partial-aggregate", "clients/.partial-1", "clients/0"):
        (run / d).mkdir(parents=True)
        (run / d / "f").write_text("x")
    (tmp_path / "results" / "t" / "_failed").mkdir()
    (tmp_path / "results" / "t" / "_failed" / "q").write_text("x")
    audit = tmp_path / "audit.jsonl"
    _job(
        tmp_path,
        "results/t/round_001/aggregate",
        ["results/t/round_001/.partial-aggregate/f", "results/t/round_001/clients/0/f"],
        audit,
    )
    assert _partial_reads(audit) == []  # its own staging (hashing for the manifest) and a finished input
    _job(
        tmp_path,
        "results/t/round_001/aggregate",
        ["results/t/round_001/clients/.partial-1/f", "results/t/_failed/q"],
        audit,
    )
    bad = _partial_reads(audit)
    assert len(bad) == 2 and "clients/.partial-1/f" in bad[0] and "_failed/q" in bad[1]
