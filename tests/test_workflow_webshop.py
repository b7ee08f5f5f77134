"""WebShop through the real round graph: 2 rounds × 2 clients of GRPO on the synthetic catalogue
with the tiny test model and the catalog_split arm (issue 12, Must show 4)."""

from __future__ import annotations

import json

import pytest

from workflow_helpers import RUN, executed_jobs, make_workdir, run_snakemake

pytestmark = [pytest.mark.workflow, pytest.mark.slow]

CATEGORIES = {"beauty", "electronics", "fashion", "food", "furniture"}
CONFIG = """run: t
seed: 7
rounds: 2
clients: {total: 2, per_round: 2}
model: tiny
env:
  kind: webshop
  pool_size: 2
  webshop: {n_products: 200, val_goals: 50, arm: catalog_split, env_div: 0.7, keep_ratio: 0.7, search_return_n: 200}
train: {epochs: 1, groups_per_epoch: 1, group_size: 2, max_turns: 3, max_new_tokens: 8, max_prompt_tokens: 256,
        mini_batch_size: 2, lr: 1.0e-3, threads: 1}
eval: {n: 2, max_turns: 3, max_new_tokens: 8, max_prompt_tokens: 256, threads: 1}
"""


def _env_info(log):
    for line in log.read_text().splitlines():
        if line.startswith('{"env_info"'):
            return json.loads(line)["env_info"]
    raise AssertionError(f"{log}: no env_info line")


def test_webshop_grpo_two_rounds_two_clients(tmp_path):
    work = make_workdir(tmp_path / "w")
    (work / "config" / "config.yaml").write_text(CONFIG)
    proc = run_snakemake(work)
    jobs = [rule for rule, _ in executed_jobs(proc)]
    assert jobs.count("games") == 1  # the one catalogue rule, WebShop's builder through the registry
    assert jobs.count("train_client") == 4 and jobs.count("eval") == 3
    run = work / RUN
    games = json.loads((run / "plan/games/games.json").read_text())
    assert games["kind"] == "webshop" and len(games["val"]) == 50
    assert json.loads((run / "plan/val_set.json").read_text())["tasks"] == games["val"]
    partition = json.loads((run / "plan/partition.json").read_text())
    assert sorted(sum(partition["clients"].values(), [])) == sorted(games["train"])
    for r in (0, 1, 2):
        ev = json.loads((run / f"round_{r:03d}/eval.json").read_text())
        assert ev["n"] == 2 and set(ev["per_task_type"]) <= CATEGORIES
        assert [s["task_id"] for s in ev["samples"]] == games["val"][:2]
    for r in (1, 2):
        for c in (0, 1):
            info = _env_info(run / f"logs/round_{r:03d}/train_client_{c}.log")
            assert info["arm"] == "catalog_split" and info["env_div"] == 0.7 and info["search_return_n"] == 200
            assert info["catalog_size"] < 200
            m = json.loads((run / f"round_{r:03d}/clients/{c}/metrics.json").read_text())
            assert m["num_samples"] > 0
        eval_info = _env_info(run / f"logs/round_{r:03d}/eval.log")
        assert eval_info == {"arm": "none", "search_return_n": 50, "catalog_size": 200}  # unperturbed
    assert "Nothing to be done" in (lambda p: p.stdout + p.stderr)(run_snakemake(work))
