"""scripts/gpu/verl-startup.py: the per-job start-up table of docs/results/verl.md, from the jobs' metrics.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu" / "verl-startup.py"
RUN = REPO / "docs" / "runs" / "2026-12-04-verl-ppo3"


def test_one_row_per_job_with_its_own_phase_times(tmp_path):
    files = sorted(RUN.glob("round_*-metrics.json"))
    refit = json.loads(files[0].read_text())
    refit["verl"]["warm_refit"] = True
    refit["timings_s"].update(launch_to_refit=250.0, refit_to_first_generation=12.5)
    (tmp_path / "refit-metrics.json").write_text(json.dumps(refit))
    # a warm job of train.verl.engines: run names its set and its place there
    eng = json.loads(files[1].read_text())
    eng["verl"]["engine_set"] = {"set": "fa-eng-slot-0-1-0a1b2c3d", "warm": True, "jobs_before": 2, "fit_s": 9.0}
    eng["timings_s"].update(refit_to_first_generation=4.5)
    (tmp_path / "z-engines-metrics.json").write_text(json.dumps(eng))
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *map(str, files),
            str(tmp_path / "refit-metrics.json"),
            str(tmp_path / "z-engines-metrics.json"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    header, rows = out[0].split(" | "), out[2:]
    assert len(rows) == len(files) + 2
    warm = next(r for r in rows if "engine set" in r).strip("| ").split(" | ")
    assert "engine set 0a1b2c3d warm (job 3)" in warm[0] and warm[header.index("**refit → first token**")] == "4.5"
    first = json.loads(files[0].read_text())
    cells = (
        next(r for r in rows if "warm_refit" not in r and "engine set" not in r).strip("| ").split(" | ")
    )  # sorted by path: round 1, client 0
    assert cells[0].startswith("round 1, client 0 (ppo, kl_coef=0.01;")
    assert cells[header.index("**first token**")] == f"{first['timings_s']['launch_to_first_generation']:.1f}"
    assert cells[header.index("refit began")] == "–" and cells[-1] == f"{first['wall_time_s']:.1f}"
    mine = next(r for r in rows if "warm_refit=True" in r).strip("| ").split(" | ")
    assert mine[header.index("**refit → first token**")] == "12.5" and mine[header.index("refit began")] == "250.0"


def test_no_files_is_a_usage_error():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 2 and "verl-startup.py" in out.stderr
