"""scripts/gpu/verl-reset-memory.py on the CPU (its ``--device cpu`` check): verl's real FSDP engines reset
again and again hold no old model's weights with the release, and one more set of them per reset without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is installed by scripts/setup.sh (envs/verl-cpu.txt)")

REPO = Path(__file__).resolve().parent.parent


def _probe(out: Path, *flags: str) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "gpu" / "verl-reset-memory.py"),
            str(out),
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--resets",
            "2",
            "--ppo",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "reset-memory.json").read_text())


@pytest.mark.slow
def test_the_reset_memory_probe_sees_the_old_models_only_without_the_release(tmp_path):
    kept = [r["orphan_flat_param_bytes"] for r in _probe(tmp_path / "a")["rows"]]
    assert kept == [0] * 5  # step, reset, step, reset, step
    leak = [r["orphan_flat_param_bytes"] for r in _probe(tmp_path / "b", "--no-release")["rows"]]
    # the actor's and the reference's fp32 weights, once more after every reset (the critic's: tests/verl_fsdp_reset.py)
    assert leak[0] == 0 and leak[1] > 0 and leak == [0, leak[1], leak[1], 2 * leak[1], 2 * leak[1]]
