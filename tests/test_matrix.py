"""Experiment matrices (config/matrices/, workflow/matrix.smk, fedagent.plan.matrix, fedagent matrix-table)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from fedagent.core.config import ConfigError
from fedagent.core.provenance import CONFIG_HASH_ENV, RUN_MODE_ENV, RUNS_ENV, config_sha256, register_run, run_record
from fedagent.plan.matrix import start_settings, load_matrix
from fedagent.report.matrix_table import (
    PAIRED_COLUMNS,
    auc,
    build_table,
    episode_outcomes,
    markdown,
    newcombe_interval,
    t_interval,
    welch_interval,
    wilson,
)
from workflow_helpers import REPO, executed_jobs, make_workdir, run_snakemake

MATRICES = sorted((REPO / "config" / "matrices").glob("*.yaml"))
DEFAULTS = yaml.safe_load((REPO / "tests" / "workflow_config.yaml").read_text())

# 2 arms x 2 seeds on the tiny model, one round each, one client trained a round (the suite's budget).
TINY = {
    "seeds": [7, 8],
    "reference": "uniform",
    "common": {"rounds": 1, "clients": {"per_round": 1}},
    "arms": {"uniform": {}, "pinned": {"clients": {"pinned": 1}}},
}


def _matrix_file(root: Path, name: str, spec: dict) -> None:
    (root / "config" / "matrices").mkdir(parents=True, exist_ok=True)
    (root / "config" / "matrices" / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


# --------------------------------------------------------------------------- expansion
def test_arms_that_differ_only_in_training_share_one_round_0_per_seed(tmp_path):
    """start_key: the seed and everything round 0 reads; an arm's partition, pinned client, rounds or
    WebShop env arm leave it alone (its round 0 is the same), its eval, model or PPO (a round-0
    critic) do not."""
    arms = {
        "uniform": {},
        "pinned": {"clients": {"pinned": 1}},
        "longer": {"rounds": 3, "train": {"lr": 1e-3}},
        "hardness": {"partition": {"strategy": "hardness", "success_std": 1.0, "labels_model": "random"}},
        "more_val": {"eval": {"n": 1}},
        "ppo": {"train": {"algorithm": "ppo", "group_size": 1}},
    }
    _matrix_file(tmp_path, "m", {**TINY, "arms": arms})
    m = load_matrix("m", DEFAULTS, {"matrix": "m"}, root=tmp_path)
    start = {(r.arm, r.seed): r.config["start"] for r in m.runs}
    for seed in (7, 8):
        shared = {start[(a, seed)] for a in ("uniform", "pinned", "longer", "hardness")}
        assert len(shared) == 1 and shared.pop().startswith(f"results/m/_start/seed{seed}-")
        assert len({start[(a, seed)] for a in arms}) == 3  # + more_val's own, + ppo's own
    assert len(m.starts) == 6 and all(cfg["start"] is None for cfg in m.starts.values())
    # the start's module is a run of the reference arm's config, under _start/<key>
    (key,) = [k for k, v in m.starts.items() if f"results/m/_start/{k}" == start[("uniform", 7)]]
    assert m.starts[key]["results_dir"] == "results/m/_start" and m.starts[key]["run"] == key
    assert m.starts[key]["clients"]["pinned"] is None
    # WebShop's env arms perturb only the training clients: one start for all of them
    ws = start_settings({**m.runs[0].config, "env": {"kind": "webshop", "webshop": {"arm": "lookalike"}}})
    assert "arm" not in ws["env"]["webshop"]


def test_runs_are_arms_times_seeds_with_one_shared_catalogue(tmp_path):
    _matrix_file(tmp_path, "m", {**TINY, "seeds": [7, 8, 9]})
    m = load_matrix("m", DEFAULTS, {"matrix": "m"}, root=tmp_path)
    assert [(r.arm, r.seed) for r in m.runs] == [(a, s) for a in ("uniform", "pinned") for s in (7, 8, 9)]
    assert {r.run_dir for r in m.runs} == {f"results/m/{a}/seed_{s}" for a in ("uniform", "pinned") for s in (7, 8, 9)}
    assert len(m.catalogues) == 1
    (key,) = m.catalogues
    assert {r.config["catalogue"] for r in m.runs} == {f"results/m/_catalogue/{key}/plan/games"}
    pinned = [r for r in m.runs if r.arm == "pinned"][0].config
    assert pinned["clients"]["pinned"] == 1 and pinned["clients"]["per_round"] == 1
    assert [r.config["seed"] for r in m.runs[:3]] == [7, 8, 9]


def test_default_seeds_are_the_references_and_command_line_keys_reach_every_run(tmp_path):
    _matrix_file(tmp_path, "m", {"arms": {"a": {}, "b": {"train": {"lr": 0.5}}}})
    m = load_matrix("m", {**DEFAULTS, "rounds": 5}, {"matrix": "m", "rounds": 5}, root=tmp_path)
    assert m.seeds == (42, 21, 84) and m.reference == "a"
    assert {r.config["rounds"] for r in m.runs} == {5}
    assert {r.config["train"]["lr"] for r in m.runs if r.arm == "b"} == {0.5}


def test_a_different_catalogue_gets_its_own_copy_and_arms_never_change_the_shared_one(tmp_path):
    _matrix_file(tmp_path, "m", {"seeds": [1], "arms": {"a": {}, "big": {"env": {"train_games": 3}}}})
    m = load_matrix("m", DEFAULTS, {}, root=tmp_path)
    assert len(m.catalogues) == 2
    # adding an arm before the others changes no existing catalogue module's config
    _matrix_file(
        tmp_path,
        "m2",
        {"seeds": [1], "arms": {"z": {"train": {"lr": 0.9}}, "a": {}, "big": {"env": {"train_games": 3}}}},
    )
    m2 = load_matrix("m2", DEFAULTS, {}, root=tmp_path)
    strip = lambda c: {k: v for k, v in c.items() if k != "results_dir"}  # noqa: E731
    assert [strip(c) for c in m.catalogues.values()] == [strip(c) for c in m2.catalogues.values()]


@pytest.mark.parametrize(
    "spec, cli, message",
    [
        ({"arms": {"a": {"seed": 3}}}, {}, "arm a: 'seed' is set per run by the matrix"),
        ({"arms": {"a": {"run": "x"}}}, {}, "arm a: 'run' is set per run"),
        ({"arms": {"a": {}}, "bogus": 1}, {}, "unknown key 'bogus'"),
        ({"arms": {"a": {}}, "reference": "b"}, {}, "reference: 'b' is not one of the arms"),
        ({"arms": {}}, {}, "arms: expected a non-empty mapping"),
        ({"arms": {"a b": {}}}, {}, "arm 'a b': not a valid name"),
        ({"arms": {"a": {}}, "seeds": [1, 1]}, {}, "seeds: expected a list of distinct"),
        ({"arms": {"a": {"train": {"lr": -1}}}}, {}, "arm a, seed 42: config key 'train.lr'"),
        ({"arms": {"a": {"trian": {}}}}, {}, "arm a, seed 42: "),
        ({"arms": {"a": {}}}, {"seed": 3}, "--config seed=...: set per run by matrix m"),
    ],
)
def test_a_bad_matrix_is_one_error_naming_the_file_and_the_arm(tmp_path, spec, cli, message):
    _matrix_file(tmp_path, "m", spec)
    with pytest.raises(ConfigError) as err:
        load_matrix("m", DEFAULTS, {"matrix": "m", **cli}, root=tmp_path)
    assert message in str(err.value)


def test_a_missing_matrix_names_its_file(tmp_path):
    with pytest.raises(ConfigError, match="config/matrices/nope.yaml does not exist"):
        load_matrix("nope", DEFAULTS, {}, root=tmp_path)


# --------------------------------------------------------------------------- provenance per run
def test_each_run_of_a_matrix_records_its_own_config_hash_and_mode(tmp_path):
    env: dict = {}
    register_run("results/m/a/seed_1", "h1", "federated", environ=env)
    assert env[CONFIG_HASH_ENV] == "h1" and env[RUN_MODE_ENV] == "federated"  # one run: as before
    register_run("results/m/a/seed_10", "h10", "local", environ=env)
    assert CONFIG_HASH_ENV not in env and RUN_MODE_ENV not in env  # two: only by directory
    assert run_record("results/m/a/seed_1/round_001/clients/.staging-0", env)["config_sha256"] == "h1"
    assert run_record("results/m/a/seed_10/round_001/model", env) == {"config_sha256": "h10", "run_mode": "local"}
    assert run_record("results/elsewhere", env) == {"config_sha256": None, "run_mode": None}
    assert json.loads(env[RUNS_ENV])


# --------------------------------------------------------------------------- the table
def _summary(path: Path, finals: list[float], n: int = 20, base: float | None = None) -> str:
    rows = []
    if base is not None:
        rows.append({"round": 0, "model": "base", "n": n, "success_rate": base})
    for r, s in enumerate(finals):
        rows.append(
            {
                "round": r,
                "model": ("warm_start" if base is not None else "base") if r == 0 else "aggregated",
                "n": n,
                "success_rate": s,
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).assign(ci95_low=0.0, ci95_high=1.0, score_mean=0.0, return_mean=0.0, clients_dropped="").to_csv(
        path, index=False
    )
    return str(path)


def test_the_table_by_hand(tmp_path):
    def s(a, seed, curve, **kw):
        return {"arm": a, "seed": seed, "summary": _summary(tmp_path / a / f"{seed}.csv", curve, **kw)}

    runs = [
        s("ref", 1, [0.0, 0.2, 0.4]),
        s("ref", 2, [0.0, 0.3, 0.5]),
        s("ref", 3, [0.0, 0.1, 0.3]),
        s("hi", 1, [0.0, 0.6, 0.9]),
        s("hi", 2, [0.0, 0.7, 0.95]),
        s("hi", 3, [0.0, 0.5, 0.85]),
        s("ws", 1, [0.5, 0.45], base=0.05),
    ]
    table, _ = build_table(runs, "ref")
    ref, hi, ws = (table.set_index("arm").loc[a] for a in ("ref", "hi", "ws"))
    assert ref["final_mean"] == pytest.approx(0.4)
    # t(0.975, 2) = 4.302653; sd of (0.4, 0.5, 0.3) = 0.1
    assert ref["final_ci_low"] == pytest.approx(0.4 - 4.302653 * 0.1 / math.sqrt(3), abs=1e-6)
    assert (ref["pooled_wins"], ref["pooled_n"]) == (24, 60)  # 8 + 10 + 6 of 3 x 20
    assert (hi["pooled_wins"], hi["pooled_n"]) == (54, 60)  # 18 + 19 + 17
    assert ref["final_per_seed"] == "1:0.4000 2:0.5000 3:0.3000"
    assert ref["auc"] == pytest.approx(np.mean([(0.1 + 0.3) / 2, (0.15 + 0.4) / 2, (0.05 + 0.2) / 2]))
    assert ref["rounds_to_half_best"] == 1 and hi["rounds_to_half_best"] == 1
    assert hi["diff"] == pytest.approx(0.5) and hi["significant"] == "higher"
    assert hi["diff_pooled_ci_low"] == pytest.approx(newcombe_interval(54, 60, 24, 60)[0])
    assert ref["significant"] == "-" and ws["significant"] == "-"  # one seed: no across-seed interval
    assert ws["base_mean"] == pytest.approx(0.05) and ws["final_mean"] == pytest.approx(0.45)
    assert ws["auc"] == pytest.approx(0.475) and ws["rounds"] == 1


def _eval_json(path: Path, won: list[int], seeds: list[int] | None = None) -> str:
    """An eval.json with one sample per validation episode (seed k, task t<k>)."""
    seeds = list(range(len(won))) if seeds is None else seeds
    samples = [{"seed": k, "task_id": f"t{k}", "won": bool(w)} for k, w in zip(seeds, won)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"round": 0, "n": len(won), "success_rate": sum(won) / len(won), "samples": samples}))
    return str(path)


def test_paired_columns_count_the_episodes_each_side_won_and_test_them_exactly(tmp_path):
    """Against round 0 and against the reference, the discordant episodes of one validation set, summed over
    seeds, and the exact McNemar p. Seen failing with the counts taken from the two success rates (unpaired):
    seed 1's ``hi`` wins 6 more episodes than its round 0, in 7 gained and 1 lost."""
    start = [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    ref_last = [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    hi_last = [0, 1, 1, 1, 1, 1, 1, 1, 1, 0]  # against start: +7 (t2..t8), -1 (t0)
    runs = []
    for arm, last in (("ref", ref_last), ("hi", hi_last)):
        d = tmp_path / arm
        runs.append(
            {
                "arm": arm,
                "seed": 1,
                "summary": _summary(d / "summary.csv", [sum(start) / 10, sum(last) / 10], n=10),
                "eval": _eval_json(d / "last.json", last),
                "start_eval": _eval_json(d / "start.json", start),
            }
        )
    table, _ = build_table(runs, "ref")
    assert list(table.columns)[-6:] == PAIRED_COLUMNS
    ref, hi = (table.set_index("arm").loc[a] for a in ("ref", "hi"))
    assert (hi["start_gained"], hi["start_lost"]) == (7, 1)
    assert hi["start_p"] == pytest.approx(2 * (1 + 8) / 2**8)  # P(X <= 1), X ~ Bin(8, 1/2), two-sided
    assert (ref["start_gained"], ref["start_lost"]) == (1, 0) and ref["start_p"] == 1.0
    assert (hi["ref_gained"], hi["ref_lost"]) == (6, 1)  # t3..t8 against t0
    assert hi["ref_p"] == pytest.approx(2 * (1 + 7) / 2**7)
    assert math.isnan(ref["ref_p"])
    md = markdown(table, "m", "ref")
    assert "| hi | +7 / −1 | 0.07 | +6 / −1 | 0.12 |" in md
    # without eval files the table has no paired columns; two evals of different episodes do not pair
    plain, _ = build_table([{k: v for k, v in r.items() if "eval" not in k} for r in runs], "ref")
    assert not set(PAIRED_COLUMNS) & set(plain.columns)
    runs[1]["start_eval"] = _eval_json(tmp_path / "other.json", start, seeds=list(range(10, 20)))
    with pytest.raises(ValueError, match="different episodes"):
        build_table(runs, "ref")
    # an eval whose samples lack what pairing reads: named, not a bare KeyError
    bad = tmp_path / "no-won.json"
    bad.write_text(json.dumps({"samples": [{"seed": 0, "task_id": "t0"}]}))
    with pytest.raises(ValueError, match=r"no-won\.json: a sample without 'won'"):
        episode_outcomes(bad)
    # the CLI: one line naming the arm and seed, exit 2, no table
    import argparse

    from fedagent.report import matrix_table

    parser = argparse.ArgumentParser()
    matrix_table.add_args(parser)
    args = ["--matrix", "m", "--runs", json.dumps(runs), "--reference", "ref"]
    args += ["--csv", str(tmp_path / "t.csv"), "--md", str(tmp_path / "t.md"), "--curves", str(tmp_path / "c.png")]
    assert matrix_table.run(parser.parse_args(args)) == 2
    assert not (tmp_path / "t.csv").exists()


def test_overlapping_arms_are_not_marked_significant(tmp_path):
    runs = [
        {"arm": a, "seed": k, "summary": _summary(tmp_path / f"{a}{k}.csv", [0.0, v])}
        for a, vals in (("ref", (0.4, 0.5, 0.3)), ("b", (0.45, 0.55, 0.35)))
        for k, v in enumerate(vals)
    ]
    table, _ = build_table(runs, "ref")
    assert table.set_index("arm").loc["b", "significant"] == "no"


def test_interval_helpers():
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    # Newcombe 1998, table II example: 56/70 vs 48/80 → [0.0524, 0.3339]
    lo, hi = newcombe_interval(56, 70, 48, 80)
    assert (lo, hi) == (pytest.approx(0.0524, abs=1e-4), pytest.approx(0.3339, abs=1e-4))
    assert auc(pd.DataFrame({"round": [0, 1, 2], "success_rate": [0.0, 1.0, 1.0]})) == pytest.approx(0.75)
    # two seeds far apart: t(0.975, 1) = 12.7 puts the raw interval far outside [0, 1]; a rate's is clipped
    assert t_interval([0.0, 0.4]) == (0.0, pytest.approx(1.0))
    assert welch_interval([0.0, 0.9], [0.5, 0.5]) == (-1.0, pytest.approx(1.0))


# --------------------------------------------------------------------------- through Snakemake
def _matrix_workdir(tmp_path: Path) -> Path:
    work = make_workdir(tmp_path)
    (work / "config" / "config.yaml").write_text((REPO / "config" / "config.yaml").read_text())
    shutil.copytree(REPO / "config" / "matrices", work / "config" / "matrices")
    shutil.copytree(REPO / "config" / "experiments", work / "config" / "experiments")
    return work


@pytest.mark.workflow
@pytest.mark.parametrize("matrix", MATRICES, ids=[p.stem for p in MATRICES])
def test_every_shipped_matrix_plans(tmp_path, matrix):
    work = _matrix_workdir(tmp_path / "w")
    proc = run_snakemake(work, "-n", "--config", f"matrix={matrix.stem}", timeout=600)
    spec = yaml.safe_load(matrix.read_text())
    m = load_matrix(matrix.stem, yaml.safe_load((REPO / "config" / "config.yaml").read_text()), {}, root=REPO)
    assert len(m.runs) == len(spec["arms"]) * len(spec.get("seeds", [42, 21, 84]))
    for run in m.runs:
        assert f"{run.run_dir}/round_{run.config['rounds']:03d}/summary.csv" in proc.stdout
    assert f"results/{matrix.stem}/table.csv" in proc.stdout
    assert proc.stdout.count("rule catalogue_") == len(m.catalogues)


@pytest.mark.workflow
@pytest.mark.slow
def test_a_tiny_matrix_end_to_end_then_a_new_seed_runs_only_its_own_jobs(tmp_path):
    """Seen failing (2026-12-03) with a shared output path keyed by the seed list (the catalogue's run
    directory named after every seed): adding seed 9 re-ran the catalogue and seeds 7 and 8's jobs."""
    work = make_workdir(tmp_path / "w")
    tracked = {**TINY, "common": {**TINY["common"], "report": {"trackers": ["tensorboard", "mlflow"]}}}
    _matrix_file(work, "tiny", tracked)
    first = run_snakemake(work, "--config", "matrix=tiny", timeout=1800)
    out = work / "results" / "tiny"

    # the matrix's MLflow store: one experiment, one run per arm x seed, each holding its run's curve (MLflow's
    # own client); every run also has its own TensorBoard events (tensorboard --logdir results/tiny)
    from test_watch import read_mlflow, read_tensorboard

    store = read_mlflow(out / "mlruns")
    assert sorted(store) == [f"{a}/seed_{s}" for a in ("pinned", "uniform") for s in (7, 8)]
    for name, got in store.items():
        arm, seed = name.split("/seed_")
        summ = pd.read_csv(out / arm / f"seed_{seed}" / "summary.csv")
        curve = [(int(r), pytest.approx(float(v))) for r, v in zip(summ["round"], summ["success_rate"])]
        assert got["metrics"]["eval/success_rate"] == curve and got["params"]["seed"] == seed
        assert read_tensorboard(out / arm / f"seed_{seed}" / "tensorboard")["eval/success_rate"] == curve
    assert not (out / "tensorboard").exists()  # the runs' own event files are the matrix's

    # round 0 built once per seed (the arms share it), and every arm's copy is the start's, byte for byte
    built = [rule for rule, _ in executed_jobs(first)]
    assert sorted(r for r in built if r.endswith("__base_model")) == sorted(
        f"start_{k.replace('-', '_')}__base_model"
        for k in load_matrix("tiny", DEFAULTS, {"matrix": "tiny"}, root=work).starts
    )
    assert sum(r.endswith("__base_model") for r in built) == 2 and sum(r.endswith("__start_copy") for r in built) == 4
    for seed in (7, 8):
        (start,) = (out / "_start").glob(f"seed{seed}-*")
        for arm in ("uniform", "pinned"):
            run0 = out / arm / f"seed_{seed}" / "round_000"
            for rel in ("model/model.safetensors", "model/manifest.json", "eval.json"):
                assert (run0 / rel).read_bytes() == (start / "round_000" / rel).read_bytes(), (arm, seed, rel)
    table = pd.read_csv(out / "table.csv").set_index("arm")
    assert (out / "table.md").is_file() and (out / "curves.png").stat().st_size > 0

    # the table's numbers, recomputed from the runs' own summary.csv files
    for arm in ("uniform", "pinned"):
        finals = []
        for seed in (7, 8):
            summ = pd.read_csv(out / arm / f"seed_{seed}" / "summary.csv")
            last = summ[summ["round"] == summ["round"].max()].iloc[-1]
            finals.append((float(last["success_rate"]), int(last["n"])))
        assert table.loc[arm, "final_mean"] == pytest.approx(np.mean([f for f, _ in finals]))
        assert table.loc[arm, "pooled_n"] == sum(n for _, n in finals)
        assert table.loc[arm, "pooled_wins"] == sum(round(f * n) for f, n in finals)
        assert table.loc[arm, "final_per_seed"] == " ".join(f"{s}:{f:.4f}" for s, (f, _) in zip((7, 8), finals))

    # the paired columns, from each run's last and round-0 eval.json, episode by episode
    def won(path):
        return {(x["seed"], x["task_id"]): x["won"] for x in json.loads(path.read_text())["samples"]}

    for arm in ("uniform", "pinned"):
        gained = lost = 0
        for seed in (7, 8):
            rd = out / arm / f"seed_{seed}"
            last_round = int(pd.read_csv(rd / "summary.csv")["round"].max())
            new, old = won(rd / f"round_{last_round:03d}" / "eval.json"), won(rd / "round_000" / "eval.json")
            assert new.keys() == old.keys()
            gained += sum(new[k] and not old[k] for k in new)
            lost += sum(old[k] and not new[k] for k in new)
        assert (table.loc[arm, "start_gained"], table.loc[arm, "start_lost"]) == (gained, lost)
    assert np.isnan(table.loc["uniform", "ref_p"]) and 0 <= table.loc["pinned", "ref_p"] <= 1

    # clients.csv: one row per train job of every run, its numbers those of the job's own metrics.json
    jobs = pd.read_csv(out / "clients.csv")
    assert list(jobs.columns[:4]) == ["arm", "seed", "round", "client"] and (out / "clients.md").is_file()
    expected = []
    for seed in (7, 8):
        for arm in ("uniform", "pinned"):  # the matrix file's order, after (seed, round, client)
            rd = out / arm / f"seed_{seed}" / "round_001"
            for c in json.loads((rd / "selection.json").read_text())["clients"]:
                m = json.loads((rd / "clients" / str(c) / "metrics.json").read_text())
                expected.append((arm, seed, 1, c, pytest.approx(m["success_rate"]), pytest.approx(m["kl"])))
    got = list(jobs[["arm", "seed", "round", "client", "success_rate", "kl"]].itertuples(index=False, name=None))
    assert got == sorted(expected, key=lambda e: (e[1], e[2], e[3])), got

    # each run's jobs recorded their own run's config hash and mode (not the last module's)
    m = load_matrix("tiny", DEFAULTS, {"matrix": "tiny"}, root=work)
    for run in m.runs:
        prov = json.loads((work / run.run_dir / "round_001" / "model" / "provenance.json").read_text())
        assert prov["run_mode"] == ("local" if run.arm == "pinned" else "federated")
        assert prov["config_sha256"] == config_sha256(_as_validated(run))

    again = run_snakemake(work, "--config", "matrix=tiny")
    assert executed_jobs(again) == []

    # a third seed: only its own runs' jobs (and the table) run; nothing of seeds 7 and 8, no catalogue
    _matrix_file(work, "tiny", {**tracked, "seeds": [7, 8, 9]})
    plan = run_snakemake(work, "-n", "--config", "matrix=tiny")
    rules = {rule for rule, _ in executed_jobs(plan)}
    assert rules and all(
        r.endswith("__s9") or "__s9__" in r or r.startswith(("matrix", "start_seed9_")) for r in rules
    ), rules
    assert "matrix_table" in rules and "matrix_tracking" in rules and not any(r.startswith("catalogue_") for r in rules)


def _as_validated(run) -> dict:
    """The config a run's module validated (what workflow/common.smk hashes): the run's config as loaded."""
    return run.config


def test_start_copy_is_byte_identical_and_refuses_a_damaged_start(tmp_path, capsys):
    """fedagent start-copy: the start model's manifest is checked before anything is written; a damaged
    start leaves no model directory behind (the atomic staging goes to the quarantine)."""
    import argparse

    from fedagent.core.atomic import write_manifest
    from fedagent.plan import start_copy

    src = tmp_path / "start" / "round_000"
    (src / "model").mkdir(parents=True)
    (src / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    (src / "model" / "config.json").write_text('{"a": 1}\n')
    write_manifest(src / "model")
    (src / "eval.json").write_text('{"success_rate": 0.5}\n')
    dst = tmp_path / "run" / "round_000"

    def copy(*extra):
        p = argparse.ArgumentParser()
        start_copy.add_args(p)
        return start_copy.run(
            p.parse_args(
                [
                    "--model",
                    str(src / "model"),
                    str(dst / "model"),
                    "--quarantine",
                    str(tmp_path / "run" / "_failed"),
                    *extra,
                ]
            )
        )

    assert copy("--file", str(src / "eval.json"), str(dst / "eval.json")) == 0
    for rel in ("model/model.safetensors", "model/config.json", "model/manifest.json", "eval.json"):
        assert (dst / rel).read_bytes() == (src / rel).read_bytes()

    # a missing start file: exit 2, naming it
    assert copy("--file", str(src / "nope.json"), str(dst / "nope.json")) == 2
    assert "nope.json" in capsys.readouterr().err

    # one flipped byte in the start's weights: refused, and this run's model directory is not there
    import shutil

    shutil.rmtree(dst)
    blob = bytearray((src / "model" / "model.safetensors").read_bytes())
    blob[7] ^= 1
    (src / "model" / "model.safetensors").write_bytes(bytes(blob))
    assert copy() == 1
    assert "sha256" in capsys.readouterr().err
    assert not (dst / "model").exists()


def test_matrix_table_names_a_bad_runs_argument(tmp_path, capsys):
    """--runs that is not JSON (e.g. a file's path without @): exit 2 and one line saying what to give,
    not a JSONDecodeError traceback (seen before the check)."""
    import argparse

    from fedagent.report import matrix_table

    p = argparse.ArgumentParser()
    matrix_table.add_args(p)
    common = [
        "--matrix",
        "m",
        "--reference",
        "a",
        "--csv",
        str(tmp_path / "t.csv"),
        "--md",
        str(tmp_path / "t.md"),
        "--curves",
        str(tmp_path / "c.png"),
    ]
    assert matrix_table.run(p.parse_args(["--runs", str(tmp_path / "runs.json"), *common])) == 2
    assert "give the JSON itself or @FILE" in capsys.readouterr().err
    assert matrix_table.run(p.parse_args(["--runs", f"@{tmp_path / 'missing.json'}", *common])) == 2
    assert "missing.json" in capsys.readouterr().err
