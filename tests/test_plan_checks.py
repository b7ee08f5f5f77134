"""Plan-time config handling: nested --config coercion, one constraint definition for plan and
jobs, `fedagent config show`, and light workflow imports.

The constraint tests derive their cases from the job-side checks themselves: every
:class:`fedagent.core.config.JobKeys` (the config key behind each job parameter) and every schema
constraint of those keys, plus every :data:`fedagent.core.config.CROSS_RULES` entry. All of them are
checked in-process against both the job's check and the plan-time check (the function
``workflow/common.smk`` calls), and all of them (with the plan-only keys' constraints) go through
Snakemake's own command line, ``snakemake -n`` run once per bad config inside one process (its
≈1 s start-up paid once); three also run as fresh ``snakemake -n`` processes.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

from fedagent.core import config as fc
from workflow_helpers import TEST_CONFIG, make_workdir, snakemake_cmd, snakemake_env, snakemake_run

REPO = Path(__file__).resolve().parent.parent
for _module in fc.job_modules():
    importlib.import_module(_module)

CONSTRAINT_KEYWORDS = (
    "type",
    "enum",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "pattern",
    "minLength",
    "maxLength",
)


def bad_values(sub: dict) -> list[tuple[str, object]]:
    """One value per constraint keyword of a schema entry that breaks exactly that keyword."""
    out = []
    for kw in CONSTRAINT_KEYWORDS:
        if kw not in sub:
            continue
        if kw == "type":
            cands = ["not-a-value", 1.5, [1]]
        elif kw == "enum":
            cands = ["no-such-choice", 12345]
        elif kw in ("minimum", "exclusiveMinimum"):
            cands = [sub[kw] - 1 if kw == "minimum" else sub[kw]]
        elif kw in ("maximum", "exclusiveMaximum"):
            cands = [sub[kw] + 1 if kw == "maximum" else sub[kw]]
        elif kw == "pattern":
            cands = ["-bad value/", "?"]
        elif kw == "minLength":
            cands = ["x" * (sub[kw] - 1)]
        else:
            cands = ["x" * (sub[kw] + 1)]
        only = Draft202012Validator({kw: sub[kw]})
        value = next((c for c in cands if not only.is_valid(c)), None)
        assert value is not None, f"no bad value for {kw}={sub[kw]!r}"
        out.append((kw, value))
    return out


def job_cases() -> list[tuple[str, str, str, str, object]]:
    """(job, parameter, config key, keyword, bad value) for every job-side single-key check."""
    cases = []
    for job, jk in sorted(fc.JOB_KEYS.items()):
        for param, key in jk.keys.items():
            for kw, value in bad_values(fc.subschema(key)):
                cases.append((job, param, key, kw, value))
    return cases


def default_config() -> dict:
    return fc.load_config(TEST_CONFIG)


def with_overrides(config: dict, overrides: dict) -> dict:
    out = copy.deepcopy(config)
    for key, value in overrides.items():
        fc.set_path(out, key, value)
    return out


def nested(overrides: dict) -> dict:
    out: dict = {}
    for key, value in overrides.items():
        fc.set_path(out, key, value)
    return out


# --------------------------------------------------------------------------- coercion (in-process)
def test_command_line_strings_take_the_schema_types_and_files_keep_theirs():
    cli = {
        "eval": {"n": "30", "temperature": "0.25"},
        "train": {"lr": "1e-6"},
        "keep": {"protect_models": "true", "aggregates": "No"},
        "run": "007",
    }
    config = yaml.safe_load(TEST_CONFIG.read_text())
    for key, value in [
        ("eval.n", "30"),
        ("eval.temperature", "0.25"),
        ("train.lr", "1e-6"),
        ("keep.protect_models", "true"),
        ("keep.aggregates", "No"),
        ("run", "007"),
    ]:
        fc.set_path(config, key, value)
    fc.set_path(config, "train.max_turns", "2")  # from a file: stays a string, and is refused
    fc.coerce_cli_strings(config, cli)
    assert config["eval"] == {**config["eval"], "n": 30, "temperature": 0.25}
    assert config["train"]["lr"] == 1e-6 and isinstance(config["train"]["lr"], float)
    assert config["keep"]["protect_models"] is True and config["keep"]["aggregates"] is False
    assert config["run"] == "007"  # a string key stays a string
    assert fc.coerce_scalar("eval.n", "2.0", {"integer"}) == 2 and fc.coerce_scalar("x", "1e3", {"integer"}) == 1000
    with pytest.raises(fc.ConfigError, match="'eval.n'"):
        fc.coerce_scalar("eval.n", "2.5", {"integer"})
    top = with_overrides(yaml.safe_load(TEST_CONFIG.read_text()), {"rounds": 4.0, "eval.n": 2.0})
    fc.prepare_config(top)  # integral floats (Snakemake parses rounds=4.0 as a float) become ints
    assert top["rounds"] == 4 and type(top["rounds"]) is int and type(top["eval"]["n"]) is int
    with pytest.raises(fc.ConfigError, match="'train.max_turns'"):
        fc.prepare_config(config)


@pytest.mark.parametrize(
    "cli, key",
    [
        ({"eval": {"n": "thirty"}}, "eval.n"),
        ({"train": {"lr": "fast"}}, "train.lr"),
        ({"train": {"lr": "nan"}}, "train.lr"),
        ({"keep": {"aggregates": "maybe"}}, "keep.aggregates"),
        ({"rounds": "abc"}, "rounds"),
    ],
)
def test_a_string_that_does_not_convert_is_refused_naming_the_key(cli, key):
    config = yaml.safe_load(TEST_CONFIG.read_text())
    for k, v in cli.items():
        if isinstance(v, dict):
            config.setdefault(k, {}).update(v)
        else:
            config[k] = v
    with pytest.raises(fc.ConfigError, match=f"config key '{key}'"):
        fc.prepare_config(config, cli)


# --------------------------------------------------------------------------- one constraint definition
def test_every_job_parameter_check_is_a_plan_time_check():
    """Each job-side single-key check refuses its bad value, and so does planning, naming the key."""
    base = default_config()
    cases = job_cases()
    jobs = {c[0] for c in cases}
    assert {"train-client", "eval", "partition", "select", "val-set", "games", "merge", "aggregate"} <= jobs
    assert len(cases) >= 40
    for job, param, key, kw, value in cases:
        values = fc.JOB_KEYS[job].from_config(base)
        values[param] = value
        with pytest.raises(fc.ConfigError, match=f"config key '{key}'"):
            fc.JOB_KEYS[job].check(values)
        with pytest.raises(fc.ConfigError, match=f"config key '{key}'"):
            fc.prepare_config(with_overrides(base, {key: value}))


def test_every_cross_rule_is_checked_at_plan_time_and_by_each_job_that_carries_its_keys():
    base = default_config()
    assert {r.key for r in fc.CROSS_RULES} >= {
        "clients.per_round",
        "partition.min_tasks_per_client",
        "train.mini_batch_size",
        "env.pool_size",
        "model",
    }
    for rule in fc.CROSS_RULES:
        bad = with_overrides(base, rule.violation)
        with pytest.raises(fc.ConfigError, match=f"config key '{rule.key}'"):
            fc.prepare_config(bad)
        carriers = [jk for jk in fc.JOB_KEYS.values() if set(rule.needs) <= set(jk.keys.values())]
        for jk in carriers:
            with pytest.raises(fc.ConfigError, match=f"config key '{rule.key}'"):
                jk.check(jk.from_config(bad))
        assert carriers or rule.key in fc.PLAN_ONLY_RULES, f"no job checks cross rule {rule.key}"
    # rule keys with a rule whose keys no job carries (checked at plan time only)
    sampler_keys = {
        f"{section}.{key}"
        for section in ("train", "eval")
        for key in ("sampler", "sampler_widths", "sampler_fused", "sampler_compile_prefill")
    }
    # train.verl.engines: its pair is refused by the verl job's own settings reader (train/cli.verl_settings)
    # aggregate.aggregator / aggregate.dp_noise: DP-FedAvg's rules over the algorithm, pinning and the whole
    # run's rounds (fedagent.server.dp_fedavg), keys no aggregate job carries;
    # eval.clients with train.lora, model_dtype: keys no job carries (the aggregate/merge/verify jobs take --dtype)
    # train.micro_batch_tokens with train.backend: the local job has no backend key, the verl job no budget
    plan_only = {
        "model",
        "train.gpu_mem_gb",
        "eval.gpu_mem_gb",
        "train.verl.engines",
        "aggregate.aggregator",
        "aggregate.dp_noise",
        "eval.clients",
        "model_dtype",
        "train.micro_batch_tokens",
    }
    assert fc.PLAN_ONLY_RULES == plan_only | sampler_keys


def test_every_schema_constraint_is_refused_at_plan_time():
    """Also the keys only planning reads (keep.*, rounds, run, threads...)."""
    base = default_config()
    n = 0
    for key in fc.leaf_keys():
        for kw, value in bad_values(fc.subschema(key)):
            with pytest.raises(fc.ConfigError, match=f"config key '{key}'"):
                fc.prepare_config(with_overrides(base, {key: value}))
            n += 1
    assert n >= 60


def _games_args(v: dict, tmp: Path) -> argparse.Namespace:
    return argparse.Namespace(out=tmp / "games", jobs=1, quarantine=None, **v)


# The real job entry points, fed one job's parameters by name: each must refuse a bad value
# through its JobKeys before doing any work.
ENTRY_POINTS = {
    "train-client": lambda v, tmp: importlib.import_module("fedagent.train.local").TrainParams.from_dict(v),
    "eval": lambda v, tmp: importlib.import_module("fedagent.evaluate.validation").EvalParams.from_dict(v),
    "eval-backend": lambda v, tmp: importlib.import_module("fedagent.evaluate.validation").EVAL_BACKEND_KEYS.check(v),
    "train-client-verl": lambda v, tmp: importlib.import_module("fedagent.train.verl.backend").check_job_keys(v),
    "critic-init": lambda v, tmp: importlib.import_module("fedagent.model.critic").check_job_keys(v),
    "warm-start": lambda v, tmp: importlib.import_module("fedagent.train.warm_start").WarmStartParams.from_dict(v),
    "demo-pool": lambda v, tmp: importlib.import_module("fedagent.plan.demo_pool").check_job_keys(v),
    "val-set": lambda v, tmp: importlib.import_module("fedagent.plan.val_set").build_val_set(
        [f"v{i}" for i in range(v[importlib.import_module("fedagent.plan.val_set").pool_param(v["kind"])])],
        v["n"],
        kind=v["kind"],
    ),
    "select": lambda v, tmp: importlib.import_module("fedagent.plan.selection").select_clients(
        v["base_seed"], 1, v["total"], v["per_round"]
    ),
    "partition": lambda v, tmp: importlib.import_module("fedagent.partition").partition_tasks(
        [f"t{i}" for i in range(v["n_tasks"])], v["n_clients"], v["strategy"], v["min_tasks"]
    ),
    "games": lambda v, tmp: importlib.import_module("fedagent.envs.textworld.games").run(_games_args(v, tmp)),
    "merge": lambda v, tmp: importlib.import_module("fedagent.server.optimizers").make_optimizer(v.pop("name"), **v),
    "aggregate": lambda v, tmp: importlib.import_module("fedagent.server.aggregate").client_weights(
        [tmp / "c0"], v["weighting"]
    ),
    "update-transform": lambda v, tmp: importlib.import_module("fedagent.train.transformed_update").from_params(
        {"name": v.pop("transform"), **v}
    ),
}


def test_each_job_entry_point_refuses_through_its_checks(tmp_path):
    base = default_config()
    assert set(ENTRY_POINTS) == set(fc.JOB_KEYS), "a job without an entry-point case here"
    for job, jk in fc.JOB_KEYS.items():
        if job != "games":  # the good values pass (games would generate them)
            ENTRY_POINTS[job](jk.from_config(base), tmp_path)
        # a value-range (not type) case of this job, so the entry point can take it
        job_case = next(c for c in job_cases() if c[0] == job and c[3] != "type" and c[1] != "n_tasks")
        _, param, key, _, value = job_case
        values = {**jk.from_config(base), param: value}
        with pytest.raises(ValueError, match=f"config key '{key}'"):
            ENTRY_POINTS[job](values, tmp_path)
    assert not (tmp_path / "games").exists()


def test_schema_choices_match_the_code():
    """The enums the schema declares are the ones the code implements."""
    from fedagent.server.aggregate import WEIGHTINGS
    from fedagent.partition import STRATEGIES
    from fedagent.server.optimizers import OPTIMIZERS

    assert set(fc.subschema("server.optimizer")["enum"]) == set(OPTIMIZERS)
    assert set(fc.subschema("aggregate.weighting")["enum"]) == set(WEIGHTINGS)
    assert set(fc.subschema("partition.strategy")["enum"]) == set(STRATEGIES)


# --------------------------------------------------------------------------- fedagent config show
def _show(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedagent.cli", "config", "show", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=snakemake_env(),
    )


def _comments(out: str) -> dict[str, str]:
    """leaf key → '# source' comment of each annotated line."""
    found, stack = {}, []
    for line in out.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        key = line.strip().split(":")[0]
        stack = stack[:depth] + [key]
        if " # " in line:
            found[".".join(stack)] = line.split(" # ", 1)[1].strip()
    return found


def test_config_show_default_run():
    proc = _show("--base", "config/config.yaml")
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown == fc.load_config(REPO / "config" / "config.yaml")
    notes = _comments(proc.stdout)
    assert notes["train.max_turns"] == notes["train.threads"] == "config/config.yaml"
    assert "seed" not in notes and "server.optimizer" not in notes  # defaults carry no source


def test_config_show_preset_and_command_line(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text(
        "run: preset-a\nclients: {total: 8, per_round: 4}\ntrain: {lr: 3.0e-6}\n"
        "env: {train_games: 16, val_games: 30}\nserver: {optimizer: fedadam, lr: 0.01}\n"
    )
    proc = _show(
        "--base",
        "config/config.yaml",
        "--configfile",
        str(preset),
        "--set",
        "eval={n: 30, temperature: 0.1}",
        "--set",
        "keep.protect_models=true",
        "--set",
        "rounds=70",
    )
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown["run"] == "preset-a" and {k: shown["clients"][k] for k in ("total", "per_round")} == {
        "total": 8,
        "per_round": 4,
    }
    assert shown["train"]["lr"] == 3e-6 and shown["train"]["max_turns"] == 2  # preset over config.yaml
    assert shown["eval"]["n"] == 30 and shown["eval"]["temperature"] == 0.1 and shown["rounds"] == 70
    assert shown["keep"]["protect_models"] is True and shown["server"]["optimizer"] == "fedadam"
    notes = _comments(proc.stdout)
    assert notes["clients.total"] == str(preset) and notes["train.lr"] == str(preset)
    assert notes["train.max_turns"] == "config/config.yaml"
    assert notes["eval.n"] == notes["keep.protect_models"] == notes["rounds"] == "command line"
    bad = _show("--base", "config/config.yaml", "--configfile", str(preset), "--set", "eval={n: x}")
    assert bad.returncode != 0 and "'eval.n'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------- real snakemake -n


def _dry_run(work: Path, *args: str) -> subprocess.CompletedProcess:
    return snakemake_run(snakemake_cmd("-n", "-p", *args), work, snakemake_env(warm=False), 300)


@pytest.mark.workflow
@pytest.mark.slow
def test_snakemake_nested_overrides_take_effect_and_a_bad_string_is_named(tmp_path):
    work = make_workdir(tmp_path / "w")
    proc = _dry_run(
        work,
        "--config",
        "eval={n: 5}",
        "env={val_games: 5}",
        "train={lr: 2.5e-4}",
        "keep={client_updates: false, protect_models: true}",
        "rounds=1.0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "fedagent val-set" in out and " --n 5 " in out  # integer
    train = [
        json.loads(line.split("--params '")[1].split("'")[0])
        for line in out.splitlines()
        if "fedagent train-client" in line
    ]
    assert train and all(p["lr"] == 2.5e-4 for p in train)  # float
    assert "Would remove temporary output results/t/round_001/clients/0" in out  # boolean false
    assert "merge_protected" in out  # boolean true (every-k models protected)
    assert "round_001/eval.json" in out and "round_002" not in out  # rounds=1.0 (a float) is round 1
    bad = _dry_run(work, "--config", "eval={n: thirty}")
    assert bad.returncode != 0
    assert "config key 'eval.n'" in bad.stderr and "'thirty'" in bad.stderr
    assert "Traceback" not in bad.stderr and 'File "' not in bad.stderr and not (work / "results").exists()


# Snakemake's own command line (snakemake.cli.main, the `snakemake` executable's entry point) run
# once per config in ONE process: the start-up (≈1 s) is paid once, each plan then costs ≈0.1 s.
# Each run's stdout/stderr (file descriptors 1 and 2) is captured on its own.
DRY_RUN_MANY = """
import json, os, sys, tempfile
import yaml
from snakemake.cli import main

results = []
for overrides in json.loads(sys.argv[1]):
    with open("bad.yaml", "w") as f:
        yaml.safe_dump(overrides, f)
    out = tempfile.TemporaryFile(mode="w+")
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush(); sys.stderr.flush()
    os.dup2(out.fileno(), 1); os.dup2(out.fileno(), 2)
    try:
        main(["--profile", "profiles/local", "-n", "--configfile", "bad.yaml"])
        rc = 0
    except SystemExit as exc:
        rc = exc.code
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
    out.seek(0)
    results.append({"rc": rc, "out": out.read()})
with open("results.json", "w") as f:
    json.dump(results, f)
"""


def refusal_cases() -> list[tuple[str, dict]]:
    """(key named, overrides): every job-side check's bad values, the plan-only keys', every cross rule."""
    cases, seen = [], set()
    job_keys = set()
    for _, param, key, _, value in job_cases():
        job_keys.add(key)
        if param == "n_tasks":  # partition's catalogue size: the games job's env.train_games cases cover it
            continue
        if (key, repr(value)) not in seen:
            seen.add((key, repr(value)))
            cases.append((key, {key: value}))
    for key in fc.leaf_keys():  # keys only planning reads (keep.*, rounds, run, threads, ...)
        if key not in job_keys:
            cases += [(key, {key: value}) for _, value in bad_values(fc.subschema(key))]
    cases += [(rule.key, dict(rule.violation)) for rule in fc.CROSS_RULES]
    return cases


def _check_refused(key: str, rc, out: str) -> None:
    assert rc not in (0, None), f"{key}: snakemake -n accepted a bad value"
    assert f"fedagent: invalid config: config key '{key}'" in out, (key, out[-2000:])
    assert "Traceback" not in out and 'File "' not in out, (key, out[-2000:])


@pytest.mark.workflow
@pytest.mark.slow
def test_snakemake_refuses_every_job_constraint_before_any_job(tmp_path):
    """Every case through Snakemake's command line: refused naming the key, no traceback, no results/."""
    cases = refusal_cases()
    assert len(cases) >= 80
    work = make_workdir(tmp_path / "w")
    configs = [{}] + [nested(overrides) for _, overrides in cases]  # first: a good config (control)
    proc = subprocess.run(
        [sys.executable, "-c", DRY_RUN_MANY, json.dumps(configs)],
        cwd=work,
        env=snakemake_env(warm=False),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((work / "results.json").read_text())
    assert results[0]["rc"] in (0, None) and "Nothing to be done" not in results[0]["out"], results[0]["out"][-2000:]
    assert "rule train_client" in results[0]["out"]  # the control planned the run
    for (key, _), res in zip(cases, results[1:], strict=True):
        _check_refused(key, res["rc"], res["out"])
    assert not (work / "results").exists()

    # A few as a user runs them: one fresh `snakemake -n` process each.
    picks = [cases[0], next(c for c in cases if c[0].startswith("keep.")), cases[-2]]

    def fresh(i_case):
        i, (key, overrides) = i_case
        w = make_workdir(tmp_path / f"f{i}")
        (w / "bad.yaml").write_text(yaml.safe_dump(nested(overrides)))
        return key, _dry_run(w, "--configfile", "bad.yaml"), w

    with ThreadPoolExecutor(2) as pool:
        for key, p, w in pool.map(fresh, enumerate(picks)):
            _check_refused(key, p.returncode, p.stdout + p.stderr)
            assert f"config key '{key}'" in p.stderr and not (w / "results").exists()


# --------------------------------------------------------------------------- light imports
@pytest.mark.workflow
def test_parsing_the_workflow_imports_neither_torch_nor_transformers(tmp_path):
    work = make_workdir(tmp_path / "w")
    code = textwrap.dedent("""
        import sys
        from snakemake.cli import main
        try:
            main(["-n", "--quiet", "--cores", "1", "--config", "rounds=3"])
        except SystemExit as exc:
            print("RC=" + str(exc.code))
        print("PARSED=" + str("fedagent.server.optimizers" in sys.modules and "fedagent.plan.selection" in sys.modules))
        print("HEAVY=" + ",".join(m for m in ("torch", "transformers") if m in sys.modules))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=work,
        env=snakemake_env(warm=False),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "RC=0" in proc.stdout and "PARSED=True" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "HEAVY=\n" in proc.stdout, proc.stdout


def test_loading_the_config_imports_neither_pandas_nor_torch():
    """Every light command (select, partition, val-set, status, verify's parsing ...) and the Snakefile load
    the config, whose registries import each built-in's module: none needs pandas or torch there (seen
    failing while the trackers' record type imported pandas for an annotation: ~0.6 s of every such process)."""
    code = "import sys, fedagent.core.config\nprint(','.join(m for m in ('pandas', 'torch', 'transformers') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "", proc.stdout + proc.stderr[-2000:]


# --------------------------------------------------------------------------- eval.n and the validation pool
def test_eval_n_past_the_validation_pool_is_refused_naming_both_keys():
    """Index mode plays tasks[seed % pool]: eval.n past the pool would replay tasks as if independent
    (issue 31). Refused at plan time and by the val-set job, naming eval.n and the pool's key
    (seen failing before the rule: eval: {n: 500} with 2 validation games planned)."""
    from fedagent.plan.val_set import build_val_set

    with pytest.raises(
        fc.ConfigError,
        match=r"config key 'eval.n': 500 exceeds the validation pool "
        r"\(env.val_games=2\)",
    ):
        fc.load_config(REPO / "config" / "config.yaml", {"eval.n": 500})
    ws = {"env.kind": "webshop", "env.webshop.val_goals": 10, "eval.n": 11}
    with pytest.raises(fc.ConfigError, match=r"'eval.n': 11 exceeds .*env.webshop.val_goals=10"):
        fc.load_config(REPO / "config" / "config.yaml", ws)
    assert fc.load_config(REPO / "config" / "config.yaml", {**ws, "eval.n": 10})["eval"]["n"] == 10
    with pytest.raises(fc.ConfigError, match=r"'eval.n': 3 exceeds the validation pool \(env.val_games=2\)"):
        build_val_set(["v0", "v1"], 3)
    assert build_val_set(["v0", "v1"], 2)["task_of_seed"] == ["v0", "v1"]


@pytest.mark.workflow
def test_snakemake_dry_run_refuses_eval_n_past_the_pool(tmp_path):
    work = make_workdir(tmp_path / "w")
    bad = _dry_run(work, "--config", "eval={n: 500}")
    assert bad.returncode != 0 and not (work / "results").exists()
    assert (
        "fedagent: invalid config: config key 'eval.n': 500 exceeds the validation pool (env.val_games=2)" in bad.stderr
    ), bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr
    ok = _dry_run(work, "--config", "eval={n: 500}", "env={val_games: 500}")
    assert ok.returncode == 0, ok.stderr[-2000:]


@pytest.mark.workflow
def test_aggregate_jobs_carry_their_rounds_clients_weights(tmp_path):
    """aggregate.weighting weights: each aggregate job gets its round's selected clients' entries, in
    the order of its --clients (per-round params: only what that job reads); uniform runs' aggregate
    command is what it was."""
    import re

    from fedagent.plan.selection import select_clients

    work = make_workdir(tmp_path / "w")
    proc = _dry_run(
        work,
        "--config",
        "clients={total: 3, per_round: 2}",
        "env={train_games: 3}",
        "aggregate={weighting: weights, weights: [0.5, 0.3, 0.2]}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = default_config()
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "fedagent aggregate" in ln]
    assert len(lines) == cfg["rounds"]
    for line in lines:
        r = int(re.search(r"round_(\d{3})/aggregate", line).group(1))
        sel = select_clients(cfg["seed"], r, 3, 2)
        assert (
            f"--weighting weights --client-weights {' '.join(repr(w) for w in [[0.5, 0.3, 0.2][c] for c in sel])} "
            in line
        ), line
    plain = _dry_run(work)
    assert all(
        "--weighting uniform --min-clients" in ln
        for ln in (plain.stdout + plain.stderr).splitlines()
        if "fedagent aggregate" in ln
    )
