"""scripts/gpu/verl-scale.sh (issue 48's must-show 1 on the GPU node) in a scratch checkout, with a `snakemake`
that writes a run's round files one after another (as the round graph's jobs do) and a `fedagent verify` that
records its arguments: every round verified once its merge is done, then pruned once Snakemake is done with it
(its clients and aggregate after its report, the round before's model after that round's eval, the last and
every keep.models_every-th model kept), and a failed verify stopping Snakemake with the round's files kept."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A stand-in for the round graph: for each round, the clients, aggregate and model (manifest last), then the
# round's eval and report; round r's report only after the round before's eval. It records its arguments and
# whether it was interrupted.
FAKE_SNAKEMAKE = r"""#!/usr/bin/env bash
echo "$@" > "$FAKE_LOG/snakemake.args"
trap 'echo interrupted > "$FAKE_LOG/snakemake.int"; exit 130' INT
run=; rounds=
for a in "$@"; do case "$a" in run=*) run=${a#run=} ;; rounds=*) rounds=${a#rounds=} ;; esac; done
R=results/$run
mkdir -p "$R/round_000/model" && touch "$R/round_000/model/manifest.json" "$R/round_000/eval.json"
for r in $(seq 1 "$rounds"); do
  d=$(printf '%s/round_%03d' "$R" "$r")
  for f in "$d"/*; do [ -e "$f" ] && { echo "round $r exists before it ran" >&2; exit 3; }; done
  mkdir -p "$d/clients/0" "$d/clients/1" "$d/aggregate" "$d/model"
  echo '{"verl": {"memory": {"micro_batch_size": 4}}}' > "$d/clients/0/metrics.json"
  echo '{}' > "$d/clients/1/metrics.json"; echo '{}' > "$d/aggregate/aggregate.json"; echo '{}' > "$d/model/server.json"
  touch "$d/model/manifest.json"
  sleep 0.6
  # the round's jobs read what the rounds before left: the start model, and the report the clients
  p=$(printf '%s/round_%03d' "$R" $(( r - 1 )))
  [ -f "$p/model/manifest.json" ] || { echo "round $r: its start model is gone" >&2; exit 4; }
  echo '{}' > "$d/eval.json"
  [ -f "$d/clients/0/metrics.json" ] || { echo "round $r's report: its clients are gone" >&2; exit 5; }
  printf 'round,round_wall_s\n%s,1.0\n' "$r" > "$d/timings.csv"; touch "$d/summary.csv" "$d/points.csv"
  sleep 0.6
done
"""

FAKE_FEDAGENT = r"""#!/usr/bin/env bash
[ "$1" = verify ] || { echo "unexpected fedagent $*" >&2; exit 9; }
echo "$*" >> "$FAKE_LOG/verify.args"
case "$*" in *"round_00${FAKE_VERIFY_FAIL:-x}/model"*) echo "verify: FAIL"; exit 1 ;; esac
echo "verify: OK"
"""


def _run(tmp_path: Path, **env_extra) -> tuple[subprocess.CompletedProcess, Path, Path]:
    repo = tmp_path / "repo"
    (repo / "scripts" / "gpu").mkdir(parents=True)
    for name in ("verl-scale.sh", "node-env.sh", "verl-memory.py", "verl-scale-short.yaml"):
        shutil.copy(REPO / "scripts" / "gpu" / name, repo / "scripts" / "gpu" / name)
    (repo / "preset.yaml").write_text("run: scale\nrounds: 3\nkeep: {client_updates: false, models_every: 4}\n")
    fa, log, out = tmp_path / "fa", tmp_path / "log", tmp_path / "out"
    (fa / "bin").mkdir(parents=True)
    log.mkdir()
    for name, text in (("snakemake", FAKE_SNAKEMAKE), ("fedagent", FAKE_FEDAGENT)):
        (fa / "bin" / name).write_text(text)
        (fa / "bin" / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "FA_GPU": str(fa),
        "FAKE_LOG": str(log),
        "CONFIG": "preset.yaml",
        "POLL_S": "0.2",
        **env_extra,
    }
    proc = subprocess.run(
        ["bash", "scripts/gpu/verl-scale.sh", "run", str(out)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, repo / "results" / "scale-short", log


def test_every_round_is_verified_then_pruned_keeping_the_last_model(tmp_path):
    proc, run, log = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = (log / "snakemake.args").read_text().split()
    # one Snakemake for every round (the engine sets stay warm), temp() files kept for the verify loop,
    # the short budgets layered over the preset, one --config
    assert "--notemp" in args and args.count("--config") == 1 and "run=scale-short" in args and "rounds=3" in args
    assert args[args.index("--configfile") + 1 : args.index("--configfile") + 3] == [
        "preset.yaml",
        "scripts/gpu/verl-scale-short.yaml",
    ]
    verifies = (log / "verify.args").read_text().splitlines()
    assert len(verifies) == 3
    for r, line in enumerate(verifies, start=1):
        assert f"--model results/scale-short/round_00{r}/model" in line
        assert f"--prev results/scale-short/round_00{r - 1}/model" in line
        assert ("--prev-server-state" in line) == (r > 1)
    for r in (1, 2, 3):
        d = run / f"round_00{r}"
        assert (d / ".verified").is_file() and not (d / "aggregate").exists() and not any((d / "clients").iterdir())
        assert (d / "eval.json").is_file() and (d / "summary.csv").is_file()
    # the rounds' models: 1 and 2 temporary (pruned), 3 the last (kept); the base model stays
    assert not (run / "round_001" / "model").exists() and not (run / "round_002" / "model").exists()
    assert (run / "round_003" / "model" / "manifest.json").is_file() and (run / "round_000" / "model").is_dir()
    # the records the pruning deleted, and the rounds' own, came back
    out = tmp_path / "out" / "scale-short"
    m = json.loads((out / "round_001_client_0_metrics.json").read_text())
    assert m["verl"]["memory"]["micro_batch_size"] == 4
    assert (out / "round_002_aggregate.json").is_file() and (out / "round_003_timings.csv").is_file()
    assert "| round | client |" in (out / "memory.md").read_text()
    assert (tmp_path / "out" / "scale-short.tgz").is_file()


def test_a_round_that_does_not_verify_stops_snakemake_and_keeps_its_files(tmp_path):
    proc, run, log = _run(tmp_path, FAKE_VERIFY_FAIL="2")
    assert proc.returncode != 0
    assert (log / "snakemake.int").is_file(), "Snakemake was not stopped"
    d = run / "round_002"
    assert not (d / ".verified").exists() and (d / "aggregate").is_dir() and any((d / "clients").iterdir())
    assert (run / "round_001" / ".verified").is_file()
    assert "round 3" not in (tmp_path / "out" / "scale-short" / "verify.log").read_text()
