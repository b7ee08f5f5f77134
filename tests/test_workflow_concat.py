"""Concat mode (with FedProx armed) through the same Snakefile as windowed runs (issue 11, must-show 4).

One round of the tiny test config with ``rollout.mode: concat`` and ``train.fedprox_mu``: the
client jobs train on whole-episode samples, eval plays concat too, and a default (windowed,
μ = 0) plan's job params do not mention the new keys (its cached jobs stay valid).
"""

from __future__ import annotations

import json

import pytest

from workflow_helpers import RUN, make_workdir, run_snakemake

pytestmark = [pytest.mark.workflow, pytest.mark.slow]

CONCAT = """rounds: 1
rollout: {mode: concat}
train: {fedprox_mu: 0.01, max_prompt_tokens: 1024}
eval: {max_prompt_tokens: 1024}
"""


def test_concat_round_through_the_snakefile(tmp_path):
    work = make_workdir(tmp_path / "w")
    plain = run_snakemake(work, "-n", "-p", "--config", "rounds=1")
    assert "fedagent train-client" in plain.stdout
    assert "rollout_mode" not in plain.stdout and "fedprox_mu" not in plain.stdout and "history" not in plain.stdout
    assert "residual_dtype" not in plain.stdout  # nor train.residual_dtype at its default (float32)

    (work / "concat.yaml").write_text(CONCAT)
    run_snakemake(work, "--configfile", "concat.yaml")
    run_dir = work / RUN
    episodes = 0
    for c in (0, 1):
        upd = run_dir / "round_001" / "clients" / str(c)
        m = json.loads((upd / "metrics.json").read_text())
        assert m["params"]["rollout_mode"] == "concat" and m["params"]["fedprox_mu"] == 0.01
        # one sample per episode (concat), not one per turn
        assert m["num_samples"] == m["num_episodes"] == 2
        recs = [json.loads(line) for line in (upd / "samples.jsonl").read_text().splitlines()]
        episodes += sum(1 for r in recs if r["n_turns"] == 2)
        # every turn after the first was generated from the whole episode so far
        for r in recs:
            lens = [t["prompt_tokens"] for t in r["turns"]]
            assert lens == sorted(lens) and len(set(lens)) == len(lens)
    assert episodes > 0, "no episode reached a second turn: concat glue never exercised"
    ev = json.loads((run_dir / "round_001" / "eval.json").read_text())
    assert ev["params"]["rollout_mode"] == "concat"
    assert (run_dir / "summary.csv").is_file()
