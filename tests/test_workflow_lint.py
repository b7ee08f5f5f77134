"""`snakemake --lint` finds nothing in the workflow (issue 31): rule files hold rules only (their
helpers live in workflow/common.smk), no params that hard-code an output prefix.

Run from the checkout itself (its config/config.yaml) and for the configs that add rules or
branches (WebShop's catalogue rule, per-client evals, hardness labels, PPO).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from workflow_helpers import snakemake_env, snakemake_run

REPO = Path(__file__).resolve().parent.parent

CASES = {
    "default": [],
    "webshop-clients-hardness": [
        "--config",
        "env={kind: webshop}",
        "eval={clients: true}",
        "partition={strategy: hardness, labels_model: random}",
    ],
    "matrix": ["--config", "matrix=gpu-textworld-quest2"],  # workflow/matrix.smk and its modules
    "ppo-keep-temp": [
        "--config",
        "train={algorithm: ppo, group_size: 1, groups_per_epoch: 2}",
        "keep={client_updates: false, aggregates: false, models_every: 2, protect_models: true}",
    ],
}


@pytest.mark.workflow
@pytest.mark.parametrize("name", sorted(CASES))
def test_snakemake_lint_is_clean(name):
    exe = Path(sys.executable).parent / "snakemake"
    proc = snakemake_run([str(exe), "--lint", *CASES[name]], REPO, snakemake_env(warm=False), 300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Lints for" not in out and "Congratulations, your workflow is in a good condition!" in out, out[-3000:]
