# Config validation, run paths and per-job params. Client selection is computed here, at plan
# time, as a pure function of (seed, round): no checkpoint, so `-n` shows every job.
# Imports stay light (no torch, no transformers): every -n, re-run and status round parses this.
# Two seeds: `data_seed` drives everything under plan/ (catalogue, partition, validation set),
# `seed` everything after it (selection, task draws, sampling, training).
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, workflow.basedir)  # the package is importable even from a bare checkout

from snakemake.utils import validate

from fedagent.core.architectures import is_random_source
from fedagent.core.config import ConfigError, prepare_config
from fedagent.core.envs import spec as env_spec
from fedagent.core.progress import PROGRESS_ENV
from fedagent.core.provenance import config_sha256, register_run
from fedagent.model.determinism import CUBLAS_KEY, CUBLAS_VALUE, cublas_problem
from fedagent.partition import KNOBS as PARTITION_KNOB_NAMES
from fedagent.plan.selection import byzantine_clients, run_mode, select_clients
from fedagent.plan.matrix import CATALOGUE_DIR as MATRIX_CATALOGUE_DIR, START_DIR as MATRIX_START_DIR
from fedagent.report import disk_need
from fedagent.server.aggregators import rule_flags
from fedagent.server.optimizers import cli_flags
from fedagent.train.advantages import job_params as advantage_job_params, sections as advantage_sections
from fedagent.train.transformed_update import transform_params

# train.<estimator>: the registered advantage estimators' own subsections (their keys ride in advantage_params)
ADVANTAGE_SECTIONS = advantage_sections()

try:
    # Our checks first: nested --config strings coerced to the schema's types, then the schema
    # and the cross rules (the same definitions the jobs check their parameters with), one
    # short message naming the key and no traceback (Snakemake's own message dumps the schema).
    prepare_config(config, getattr(workflow.config_settings, "config", None))
except ConfigError as exc:
    print(f"fedagent: invalid config: {exc}", file=sys.stderr)
    sys.exit(1)
validate(config, "schemas/config.schema.yaml")  # Snakemake's own check (also fills defaults)

RUN = f"{config['results_dir']}/{config['run']}"
QUARANTINE = f"{RUN}/_failed"
# The task catalogue: the run's own plan/games, or one another run (a matrix's shared copy) builds.
GAMES = config["catalogue"] or f"{RUN}/plan/games"
# The catalogue's quarantine belongs to it (beside its plan/: the run's own _failed for its own catalogue),
# so that a run given another's catalogue (catalogue=<dir>) sees the games rule's params unchanged and
# Snakemake does not rebuild it.
GAMES_QUARANTINE = str(Path(GAMES).parent.parent / "_failed")
PARTITION = f"{RUN}/plan/partition.json"
VAL_SET = f"{RUN}/plan/val_set.json"
LABELS = f"{RUN}/plan/labels.json"
DATA_SEED = config["data_seed"]
MODE = run_mode(config["clients"]["total"], config["clients"]["pinned"])
# Every job's provenance.json records the hash of the whole validated config and the run's mode
# (fedagent.core.provenance); a matrix loads one such run per module, each registering its own.
register_run(RUN, config_sha256(config), MODE)
# report.progress_s: the train, eval and warm-start jobs' progress lines (fedagent.core.progress) come this
# often; the jobs inherit it, as they do the run's record above (a matrix's runs share one value, the last
# module's). Not in any rule's text or params: changing it re-runs nothing.
os.environ[PROGRESS_ENV] = str(config["report"]["progress_s"])
ROUNDS = range(0, config["rounds"] + 1)
# (run dir, validated config) of the runs this invocation runs: the Snakefile's onstart records each
# (fedagent.report.tracking.write_run_config); a matrix lists its runs instead (workflow/matrix.smk).
RUN_CONFIGS = [(RUN, config)]

wildcard_constraints:
    round=r"\d{3}",
    client=r"\d+",


def round_dir(r):
    """results/<run>/round_<rrr> (zero-padded, so numeric order = lexical order)."""
    return f"{RUN}/round_{int(r):03d}"


def model_dir(r):
    """The global model after round r (round 0: the base model, or its warm start)."""
    return f"{round_dir(r)}/model"


# Expert warm start (rules/warm_start.smk): the base model lives in round_000/base/ and round 0's
# model is its fine-tune on the demo pool's expert demonstrations; else the base model is round 0's.
WARM_START = config["warm_start"]["enabled"]
DEMO_POOL = f"{RUN}/plan/demo_pool.json"
BASE_DIR = f"{round_dir(0)}/base" if WARM_START else model_dir(0)
# `start`: round 0 is another run's (a matrix's shared start per seed, fedagent.plan.matrix), copied
# into this run's round_000/ by rules/start.smk; this run's base_model, warm_start and eval_base
# rules are not defined then, and its round-0 eval is not made here (its demo_pool stays: plan/).
START = config["start"]
# the start run's round-0 files besides the model (paths under the run directory)
START_FILES = (["round_000/eval.json", "round_000/eval_timings.json", "benchmarks/round_000/eval.tsv"]
               + (["round_000/base_eval.json", "round_000/base_eval_timings.json"] if WARM_START else []))


def selected_clients(r):
    """The clients trained in round r (pure function of seed and r; the pinned client in local mode)."""
    return select_clients(config["seed"], int(r), config["clients"]["total"], config["clients"]["per_round"],
                          pinned=config["clients"]["pinned"])


def client_eval_files(wildcards):
    """Per-client eval files of rounds 1..r (eval.clients), else none."""
    if not config["eval"]["clients"]:
        return []
    return [f"{round_dir(r)}/client_evals/{c}.json" for r in range(1, int(wildcards.round) + 1)
            for c in selected_clients(r)]


def ref_model_dir(wildcards):
    """KL reference: the base model, or the model the round started from."""
    if config["train"]["ref_anchor"] == "base":
        return model_dir(0)
    return model_dir(int(wildcards.round) - 1)


def as_json(d):
    """Compact JSON for a shell argument (params values are compared as strings)."""
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def maybe_temp(path, keep):
    """temp() unless the config keeps this kind of output."""
    return path if keep else temp(path)


def model_keep_classes():
    """Rounds >= 1 by what happens to their global model: (protected, plain kept, all kept).

    Kept: every k-th round (keep.models_every) and the last. Of those, the every-k ones are
    protected() when keep.protect_models; the last round's is never, since extending the
    run can make it temporary. Every other round's model is temp(): Snakemake deletes it
    once the next round's jobs and its eval have used it.
    """
    every, last = config["keep"]["models_every"], config["rounds"]
    every_k = [r for r in range(1, last + 1) if every > 0 and r % every == 0]
    kept = sorted(set(every_k) | {last})
    protect = every_k if config["keep"]["protect_models"] else []
    return protect, [r for r in kept if r not in protect], kept


def rounds_regex(rounds):
    """A round wildcard regex matching exactly ``rounds`` (never matches if empty)."""
    return "(?:" + "|".join(f"{r:03d}" for r in rounds) + ")" if rounds else "(?!)"


def other_rounds_regex(rounds):
    """A round wildcard regex matching every round >= 1 not in ``rounds``."""
    # Each alternative is exactly three digits, so a lookahead at the start excludes it.
    return f"(?!{'|'.join(f'{r:03d}' for r in rounds)})(?!000)\\d{{3}}" if rounds else r"(?!000)\d{3}"


PROTECTED_MODEL_ROUNDS, PLAIN_MODEL_ROUNDS, KEPT_MODEL_ROUNDS = model_keep_classes()
# What this run still writes, for the disk check of the Snakefile's onstart (fedagent.report.disk_need).
# A matrix's modules: a shared catalogue's builds no model; a shared round 0's only round 0.
_MATRIX_ROLE = os.path.basename(config["results_dir"])
if _MATRIX_ROLE != MATRIX_CATALOGUE_DIR:
    disk_need.register(config, RUN, KEPT_MODEL_ROUNDS, rounds=0 if _MATRIX_ROLE == MATRIX_START_DIR else None)


# Per-job params: only what changes that job's result, so a change re-runs only what it touches.
def job_params(section, drop):
    """A train/eval section's job knobs: ``sampler``/``compile_train`` only matter (and only count) on cuda,
    ``sampler_widths`` only when set, ``sampler_fused`` / ``sampler_compile_prefill`` only when true;
    ``residual_dtype`` counts only when not float32 (bfloat16 needs cuda: a config error otherwise),
    ``activation_checkpointing`` only when true."""
    d = {k: v for k, v in config[section].items() if k not in drop}
    if d.get("device", "cpu") == "cpu":
        d.pop("sampler", None)
        d.pop("compile_train", None)
    # sampler_widths only when set (a config error on the CPU; a default run's params stay as they were)
    if not d.get("sampler_widths"):
        d.pop("sampler_widths", None)
    # sampler_fused / sampler_compile_prefill only when on (likewise)
    for key in ("sampler_fused", "sampler_compile_prefill"):
        if not d.get(key):
            d.pop(key, None)
    # train.residual_dtype only when not the default (a default run's params and cached jobs stay as they were)
    if d.get("residual_dtype") == "float32":
        d.pop("residual_dtype")
    # train.activation_checkpointing only when on (likewise)
    if d.get("activation_checkpointing") is False:
        d.pop("activation_checkpointing")
    # train.micro_batch_tokens only when set (likewise)
    if "micro_batch_tokens" in d and d["micro_batch_tokens"] is None:
        d.pop("micro_batch_tokens")
    return d


def rollout_params():
    """rollout.mode / rollout.history as job params, only when not the defaults (windowed, 2):
    a default run's params, and so its cached jobs, stay exactly as before the keys existed."""
    r = config["rollout"]
    return {**({"rollout_mode": r["mode"]} if r["mode"] != "windowed" else {}),
            **({"history": r["history"]} if r["history"] != 2 else {})}


# deterministic: the model-running jobs pin their kernels (fedagent.model.determinism); in their params only
# when on (a default run's params, and so its cached jobs, stay as they were). cuBLAS reads its workspace
# setting when CUDA starts, so it is exported here, to every job of this Snakemake process (and checked).
DETERMINISTIC_PARAMS = {"deterministic": True} if config["deterministic"] else {}
if config["deterministic"]:
    _cublas = cublas_problem()
    if _cublas:
        print(f"fedagent: invalid config: config key 'deterministic': {_cublas}", file=sys.stderr)
        sys.exit(1)
    os.environ.setdefault(CUBLAS_KEY, CUBLAS_VALUE)


TRAIN_PARAMS_DICT = {
    "base_seed": config["seed"],
    **job_params("train", ("threads", "backend", "ref_anchor", "algorithm", "ppo", "verl", "fedprox_mu", "gpu_mem_gb",
                           *ADVANTAGE_SECTIONS, "lora")),
    # The advantage estimator and its own keys, only for one that has keys (GiGPO's train.gigpo.*: a GRPO
    # run's params stay as they were; fedagent.train.advantages.job_params).
    **advantage_job_params(config["train"]),
    # LoRA clients only when on (a full fine-tune's params, and so its cached jobs, stay as they were).
    **({"lora": True, **{f"lora_{k}": v for k, v in config["train"]["lora"].items() if k != "enabled"}}
       if config["train"]["lora"]["enabled"] else {}),
    # PPO rides in the same JSON only when chosen (a GRPO run's params stay as they were);
    # critic_path is round 0's business (base_model), not a client's.
    **({"algorithm": "ppo", **{k: v for k, v in config["train"]["ppo"].items() if k != "critic_path"}}
       if config["train"]["algorithm"] == "ppo" else {}),
    "pool_size": config["env"]["pool_size"],
    # env.procs only when set (an execution knob: a default run's params and cached jobs stay as they were)
    **({"env_procs": config["env"]["procs"]} if config["env"]["procs"] else {}),
    "answer_format": config["rollout"]["answer_format"],
    "projection": config["rollout"]["projection"],   # the env's semantics of an invalid answer
    **rollout_params(),
    # FedProx only when armed (μ = 0 is plain FedAvg: same params, same cached updates).
    **({"fedprox_mu": config["train"]["fedprox_mu"]} if config["train"]["fedprox_mu"] else {}),
    # The verl backend rides in the same JSON (only when chosen: a local run's params, and so
    # its cached jobs, stay exactly as before).
    **({"backend": "verl", "verl": config["train"]["verl"], "ref_anchor": config["train"]["ref_anchor"]}
       if config["train"]["backend"] == "verl" else {}),
    **DETERMINISTIC_PARAMS,
}
TRAIN_PARAMS = as_json(TRAIN_PARAMS_DICT)
# The Byzantine-client arm (byzantine.clients, drawn once per run from `seed`): those clients' params
# carry their update transform (fedagent.train.update_transform); every other client's stay TRAIN_PARAMS.
BYZANTINE = byzantine_clients(config["seed"], config["clients"]["total"], config["byzantine"]["clients"])
BYZANTINE_TRAIN_PARAMS = as_json({**TRAIN_PARAMS_DICT, "update_transform": transform_params(config)})


def client_train_params(wildcards):
    """The train_client rule's --params: TRAIN_PARAMS, a Byzantine client's with its transform."""
    return BYZANTINE_TRAIN_PARAMS if int(wildcards.client) in BYZANTINE else TRAIN_PARAMS


EVAL_PARAMS = as_json({
    "base_seed": config["seed"],
    "pool_size": config["env"]["pool_size"],
    **({"env_procs": config["env"]["procs"]} if config["env"]["procs"] else {}),
    **job_params("eval", ("threads", "n", "clients", "backend", "vllm", "gpu_mem_gb")),
    "answer_format": config["rollout"]["answer_format"],
    "projection": config["rollout"]["projection"],   # the env's semantics of an invalid answer
    **rollout_params(),
    **({"backend": "vllm", "vllm": config["eval"]["vllm"]} if config["eval"]["backend"] == "vllm" else {}),
    # model: random:<architecture>: every eval.json says its weights are random (for speed and memory only);
    # only for such runs, so every other run's eval params stay as they were
    **({"random_weights": config["model"]} if is_random_source(config["model"]) else {}),
    **DETERMINISTIC_PARAMS,
})

# warm_start.enabled: round 0's two evals carry what they score (eval.json's "label").
EVAL_PARAMS_WARM_START = as_json({**json.loads(EVAL_PARAMS), "label": "warm_start"})
EVAL_PARAMS_BASE = as_json({**json.loads(EVAL_PARAMS), "label": "base"})

# The warm-start job: its own knobs, and the rollout's budgets and format (its demos are rollouts).
WARM_START_PARAMS = as_json({
    "base_seed": config["seed"],
    **{k: config["warm_start"][k] for k in ("epochs", "lr", "mini_batch_size", "only_won")},
    **{k: config["train"][k] for k in ("micro_batch_size", "max_turns", "max_prompt_tokens", "device")},
    # train.micro_batch_tokens only when set (a run without it keeps its warm start's params and cache)
    **({"micro_batch_tokens": config["train"]["micro_batch_tokens"]} if config["train"]["micro_batch_tokens"] else {}),
    "pool_size": config["env"]["pool_size"],
    # env.procs only when set: the expert service's worker processes (ALFWorld's planner holds a lock
    # per process, so its demos play one at a time without them)
    **({"env_procs": config["env"]["procs"]} if config["env"]["procs"] else {}),
    "answer_format": config["rollout"]["answer_format"],
    "history": config["rollout"]["history"],
    **DETERMINISTIC_PARAMS,
})

# What a model-running job asks its scheduler for, by rule: {gpu, gpu_mem_mb, mem_mb}, all decided in
# fedagent.model.job_resources (the one place): `gpu` 1 when its section's device is cuda
# (train.verl.gpus for verl, 1 for eval.backend vllm), 0 on the CPU; `gpu_mem_mb` (MiB)
# train.gpu_mem_gb / eval.gpu_mem_gb or fedagent.model.memory's estimate, 0 on the CPU: the profile
# caps the sum of the running jobs' at the cards' (the Snakefile registers them; --resources
# gpu_mem_mb=N), and one card is what a vLLM engine's gpu_memory_utilization share is taken of; `mem_mb`
# (Slurm --mem) the job's host memory estimate. Resources, not params: they re-run nothing.
def job_resources(rule):
    from fedagent.model.job_resources import job_resources as _job_resources

    cap = workflow.global_resources.get("gpu_mem_mb")
    cap = int(cap.value) if cap is not None and cap.value else None
    # A vLLM engine's share is of its one card: with several cards the cap is their sum, so the
    # largest card's usable memory (the Snakefile's GPU_CARDS) bounds it.
    card = max((c.usable_mib() for c in globals().get("GPU_CARDS", [])), default=None)
    card_mib = min(x for x in (cap, card) if x) if (cap or card) else None
    try:
        return _job_resources(config, rule, card_mib=card_mib)
    except ValueError as exc:
        print(f"fedagent: invalid config: {exc}", file=sys.stderr)
        sys.exit(1)


JOB_RESOURCES = {rule: job_resources(rule) for rule in
                 ("train_client", "warm_start", "eval", "eval_client", "eval_base", "labels")}
# A round's record first: the rules that finish a round (aggregate, merge, its evals, its report) go
# before the next round's train jobs whenever both are ready and the cards (or cores) hold only some of
# them (Snakemake's scheduler ranks ready jobs by priority first). Without it a run stopped at a time
# limit has trained rounds it never scored: on one card, two train jobs fill it and every eval waits
# behind the next round's training. The next round does not wait for the eval (train reads the model),
# so at most one eval's time moves onto the critical path. Priority is no param: it re-runs nothing.
ROUND_RECORD_PRIORITY = 1
# Every rule that can ask a GPU starts its command with FEDAGENT_JOB_GPUS={resources.gpu}
# FEDAGENT_JOB_GPU_MEM_MB={resources.gpu_mem_mb}: the job's own process learns its ask (the fedagent
# CLI's placement of a job on its card(s) reads them); a CPU job's are 0 and change none of its outputs.

# Hardness labels: the reference policy plays the train tasks as training does (its
# temperature and budgets); the sampler is seeded from data_seed (labels are part of plan/).
LABELS_PARAMS = as_json({
    "base_seed": DATA_SEED,
    "pool_size": config["env"]["pool_size"],
    **{k: config["train"][k] for k in ("temperature", "max_turns", "max_new_tokens", "max_prompt_tokens")},
    **({"max_turns": config["partition"]["labels_max_turns"]} if config["partition"]["labels_max_turns"] else {}),
    **rollout_params(),
    "projection": config["rollout"]["projection"],
})


def base_model_command():
    """`fedagent <command> <flags>` of round 0; PPO adds round 1's critic (fedagent.model.critic)."""
    if config["model"] == "tiny":
        cmd = f"tiny-model --seed {config['seed']}"
    elif is_random_source(config["model"]):   # random weights: seeded by the run's seed
        cmd = f"base-model --source {config['model']} --seed {config['seed']}"
        if config["model_dtype"] != "float32":   # a bf16 global model (only then: fp32 runs' command as it was)
            cmd += f" --dtype {config['model_dtype']}"
    else:
        cmd = f"base-model --source {config['model']}"
    if config["train"]["algorithm"] == "ppo":
        cmd += f" --critic --critic-seed {config['seed']}"
        if config["train"]["ppo"]["critic_path"]:
            cmd += f" --critic-path {config['train']['ppo']['critic_path']}"
    return cmd


BASE_MODEL_COMMAND = base_model_command()


# The task catalogue's builder flags (only what changes it) and processes: the env kind's spec.
ENV_SPEC = env_spec(config["env"]["kind"])
CATALOGUE_COMMAND = ENV_SPEC.catalogue_args(config)
CATALOGUE_THREADS = 8 if ENV_SPEC.catalogue_jobs else 1

# The chosen partition strategy's own knobs only: another strategy's knob re-runs nothing.
PARTITION_KNOBS = as_json({k: config["partition"][k] for k in PARTITION_KNOB_NAMES[config["partition"]["strategy"]]})


def labels_input(wildcards=None):
    """The hardness labels file: the user's, or plan/labels.json built by the `labels` rule."""
    if config["partition"]["strategy"] != "hardness":
        return []
    return config["partition"]["labels"] or LABELS


# A training client's env knobs (the kind's spec: WebShop's arm); validation never gets any.
_CLIENT_ENV_PARAMS = ENV_SPEC.client_env_params(config)
CLIENT_ENV_PARAMS = "{}" if _CLIENT_ENV_PARAMS is None else as_json(_CLIENT_ENV_PARAMS)
# Client dropout (clients.min_per_round): a train_client job's last attempt may leave a drop
# record (0: strict, never); aggregate needs at least MIN_CLIENTS updates (0: all of them).
_MIN = config["clients"].get("min_per_round")
MIN_CLIENTS = 0 if _MIN is None or _MIN >= config["clients"]["per_round"] else _MIN
DROP_AT_ATTEMPT = config["clients"]["retries"] + 1 if MIN_CLIENTS else 0


# `fedagent merge` flags of the chosen server optimizer only (its own hyper-parameters); a bf16 global
# model's --dtype rides with them (and with the aggregate's --weighting): an fp32 run's commands stay as they were.
DTYPE_FLAG = f" --dtype {config['model_dtype']}" if config["model_dtype"] != "float32" else ""
SERVER_FLAGS = cli_flags(config["server"]["optimizer"],
                         **{k: v for k, v in config["server"].items() if k != "optimizer"}) + DTYPE_FLAG


# ---- helpers of rules/report.smk, kept here so that `snakemake --lint` finds
# no file mixing functions with rules (tests/test_workflow_lint.py)


# eval.clients: the per-client table is a declared output too (header only in round 0).
CLIENT_SUMMARY = [f"{RUN}/round_{{round}}/client_summary.csv"] if config["eval"]["clients"] else []
# report.trackers: the report's --trackers, a resource, not a param: changing it re-runs nothing (no result
# changes; the next report writes the stores asked for).
TRACKERS_ARG = "+".join(config["report"]["trackers"]) or "none"  # "+": a resource value holds no comma


def report_inputs(w):
    """Evals of rounds 0..r; this round's job timings (client metrics, eval timings, Snakemake
    benchmark files); the previous round's timings.csv (so the table has every round)."""
    r = int(w.round)
    d = {"evals": ([f"{round_dir(0)}/base_eval.json"] if WARM_START else [])
                  + [f"{round_dir(k)}/eval.json" for k in range(0, r + 1)],
         "eval_timings": f"{round_dir(r)}/eval_timings.json",
         "benchmarks": [f"{RUN}/benchmarks/round_{r:03d}/eval.tsv"]}
    if r >= 1:
        d["clients"] = [f"{round_dir(r)}/clients/{c}" for c in selected_clients(r)]
        d["benchmarks"] += [f"{RUN}/benchmarks/round_{r:03d}/{name}.tsv" for name in
                            ["aggregate", "merge"] + [f"train_client_{c}" for c in selected_clients(r)]]
        d["prev_timings"] = f"{round_dir(r - 1)}/timings.csv"
        d["prev_points"] = f"{round_dir(r - 1)}/points.csv"
    client_evals = client_eval_files(w)
    if client_evals:
        d["client_evals"] = client_evals
    return d


def aggregate_weighting(wildcards):
    """The aggregate rule's --weighting value: the weighting's name, and for ``weights`` its round's
    clients' entries of aggregate.weights (``--client-weights``, in the order of its --clients); then,
    for a rule other than the mean, its flags (``--aggregator``, its hyper-parameters, the round context
    it needs: fedagent.server.aggregate.rule_flags). The round's params carry only those, and a mean
    round's (every other weighting's) params stay what they were."""
    weighting = config["aggregate"]["weighting"]
    extra = rule_flags(config["aggregate"]["aggregator"], config, int(wildcards.round))
    extra = f" {extra}" if extra else ""
    if weighting != "weights":
        return weighting + DTYPE_FLAG + extra
    ws = config["aggregate"]["weights"]
    return (f"weights --client-weights {' '.join(repr(float(ws[c])) for c in selected_clients(wildcards.round))}"
            + DTYPE_FLAG + extra)


def select_extra_flags():
    """The select rule's flags beyond seed, round, N and M: ``--pinned`` (local mode) and
    ``--byzantine k`` (the Byzantine-client arm), each only when set, so every other run's params stay."""
    flags = []
    if config["clients"]["pinned"] is not None:
        flags.append(f"--pinned {config['clients']['pinned']}")
    if config["byzantine"]["clients"]:
        flags.append(f"--byzantine {config['byzantine']['clients']}")
    return " ".join(flags)
