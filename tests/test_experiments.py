"""The experiment matrix through the real Snakemake graph: two seeds, presets, ALFWorld."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from fedagent.envs.alfworld.assets import alfworld_available
from workflow_helpers import REPO, RUN, make_workdir, run_snakemake

PRESETS = sorted((REPO / "config" / "experiments").glob("*.yaml"))
PLAN_TARGETS = (f"{RUN}/plan/partition.json", f"{RUN}/plan/val_set.json")


def plan_bytes(workdir: Path) -> dict[str, str]:
    """sha256 of every file under the run's plan/ folder."""
    root = workdir / RUN / "plan"
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.workflow
@pytest.mark.slow
def test_seed_leaves_plan_byte_identical_and_data_seed_changes_it(tmp_path):
    base = make_workdir(tmp_path / "a")
    run_snakemake(base, *PLAN_TARGETS)
    other_seed = make_workdir(tmp_path / "b")
    run_snakemake(other_seed, *PLAN_TARGETS, "--config", "seed=8")
    other_data = make_workdir(tmp_path / "c")
    run_snakemake(other_data, *PLAN_TARGETS, "--config", "data_seed=43")
    a, b, c = plan_bytes(base), plan_bytes(other_seed), plan_bytes(other_data)
    assert a and a == b                               # seed 7 → 8: plan/ byte-identical
    assert a["partition.json"] != c["partition.json"]   # data_seed 42 → 43: other shards
    games = [json.loads((w / RUN / "plan/games/games.json").read_text()) for w in (base, other_data)]
    shard = json.loads((base / RUN / "plan/partition.json").read_text())["clients"]["0"]
    assert [games[0]["game_sha256"][t] for t in shard] != [games[1]["game_sha256"][t] for t in shard]


@pytest.mark.workflow
@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_plans(tmp_path, preset):
    work = make_workdir(tmp_path / "w")
    (work / "config" / "config.yaml").write_text((REPO / "config" / "config.yaml").read_text())
    proc = run_snakemake(work, "-n", "--configfile", str(preset), timeout=300)
    cfg = yaml.safe_load(preset.read_text())
    assert "rule train_client" in proc.stdout
    assert f"results/{cfg['run']}/round_{cfg['rounds']:03d}/summary.csv" in proc.stdout
