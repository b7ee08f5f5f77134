"""bench/alfworld_env.py's projection reads a preset or a matrix's shared recipe."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_alfworld_env", ROOT / "bench" / "alfworld_env.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_matrix_is_projected_with_its_base_preset_and_common_recipe():
    """A matrix file (base + common + arms) projects its base preset with `common` over it, as its arms run,
    not config.yaml's defaults with the matrix's top-level keys (seen failing that way: no env.procs at all)."""
    bench = _bench()
    matrix = bench._config(ROOT / "config" / "matrices" / "gpu-alfworld-gigpo.yaml")
    preset = bench._config(ROOT / "config" / "experiments" / "gpu-alfworld.yaml")
    assert matrix["env"]["procs"] == preset["env"]["procs"] == 16
    assert matrix["train"]["epochs"] == 3 and preset["train"]["epochs"] == 2  # the matrix's common block
    assert matrix["eval"]["n"] == 256 and matrix["warm_start"]["demos"] == 256
    costs = {"load_reset": 0.34, "reset": 0.05, "step": 0.021, "expert_load_reset": 0.64, "expert_step": 0.049}
    out = bench.project(matrix, costs, plan_len=5.5, cores=16)
    assert out["train_job_episodes"] == 3 * matrix["train"]["groups_per_epoch"] * matrix["train"]["group_size"]
    assert out["procs_per_service"] == 16 and out["eval_cpu_s"] > 0
