"""bench/rollout_host.py: the rollout loop's host time with a canned sampler, both prompt lookups in one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from env_fixtures import tw_games_dir

ROOT = Path(__file__).resolve().parents[1]


def test_the_bench_plays_the_same_episodes_with_both_lookups_and_reports_their_ratio(tmp_path):
    games = tw_games_dir(n_train=2, n_val=2)
    out = tmp_path / "b.json"
    cmd = [sys.executable, str(ROOT / "bench" / "rollout_host.py"), "--games", str(games), "--tasks", "2"]
    cmd += ["--rows", "2", "--turns", "3", "--procs", "0", "--answer-format", "think_action", "--action", "look"]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["tasks"] == 2 and got["distributions"] > 0
    for mode in ("listed", "kept"):
        run = got[mode]
        assert (run["episodes"], run["calls"]) == (2, 3) and 2 <= run["turns"] <= 6
        assert run["loop_s"] >= run["env_service_s"] > 0 and run["mean_s_between_calls"] > 0
    assert got["listed"]["turns"] == got["kept"]["turns"]
    assert got["ratio_between_calls_listed_over_kept"] > 0 and "listed / kept" in proc.stdout
