"""The config's cross-key checks: every constraint that reads two or more keys (:data:`CROSS_RULES`,
:class:`Requirement`), and the experiment-level checks the schema cannot express.

Part of :mod:`fedagent.core.config` (which re-exports these names); each message names its key.
The GPU path's rules are in :mod:`fedagent.core.gpu_rules`, each environment's in its spec
(:attr:`fedagent.core.envs.EnvSpec.cross_rules`, appended here, applied when ``env.kind`` is its own).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from fedagent.core import envs
from fedagent.core import gpu_rules  # noqa: F401 - registers the GPU path's rules
from fedagent.core import lora_rules  # noqa: F401 - registers LoRA clients' rules
from fedagent.core import micro_batch_rules  # noqa: F401 - registers token-budget micro-batches' rules
from fedagent.core.architectures import is_random_source, random_source_problem
from fedagent.core.registry import ADVANTAGE_ESTIMATORS
from fedagent.core.rules import CROSS_RULES, PLAN_ONLY_RULES, CrossRule, Requirement, cross_rule  # noqa: F401 - re-exported
from fedagent.core.schema import MODEL_KEYWORDS, ConfigError, get_path
from fedagent.core.weights import NO_HEAD_HINT, has_value_head  # no torch: safetensors headers only


@cross_rule(
    "clients.per_round", ["clients.per_round", "clients.total"], violation={"clients.total": 2, "clients.per_round": 3}
)
def _per_round_within_total(get):
    if get("clients.per_round") > get("clients.total"):
        return f"{get('clients.per_round')} exceeds clients.total={get('clients.total')}"
    return None


@cross_rule(
    "train.mini_batch_size",
    ["train.mini_batch_size", "train.group_size", "train.groups_per_epoch", "train.max_turns", "rollout.mode"],
    violation={"train.group_size": 2, "train.groups_per_epoch": 1, "train.max_turns": 2, "train.mini_batch_size": 5},
)
def _mini_batch_within_epoch(get):
    if get("rollout.mode") == "concat":  # one sample per episode
        most, how = get("train.group_size") * get("train.groups_per_epoch"), "group_size × groups_per_epoch, concat"
    else:  # one sample per turn
        most, how = (
            get("train.group_size") * get("train.groups_per_epoch") * get("train.max_turns"),
            "group_size × groups_per_epoch × max_turns",
        )
    if get("train.mini_batch_size") > most:
        return f"{get('train.mini_batch_size')} is larger than the {most} samples one epoch can produce ({how})"
    return None


@cross_rule(
    "train.mini_batch_size",
    ["train.backend", "train.mini_batch_size", "train.group_size", "train.groups_per_epoch"],
    violation={
        "train.backend": "verl",
        "train.ref_anchor": "round",
        "train.group_size": 2,
        "train.groups_per_epoch": 2,
        "train.mini_batch_size": 3,
    },
)
def _verl_mini_batch_is_whole_groups(get):
    # verl 0.9.1's v1 trainer updates on mini-batches of ppo_mini_batch_size × rollout.n rows and
    # wants ppo_mini_batch_size <= train_batch_size (prompts): only whole groups of one step's tasks
    # give it the row count the local backend would use (docs/explanation/architecture.md, train.verl).
    if get("train.backend") != "verl":
        return None
    m, n, g = get("train.mini_batch_size"), get("train.group_size"), get("train.groups_per_epoch")
    if m % n or m > n * g:
        return (
            f"{m} with train.backend=verl: verl's mini-batch is a whole number of groups (train.group_size="
            f"{n}) of one step's train.groups_per_epoch={g} tasks, so it must be a multiple of {n} and at most "
            f"{n * g}; otherwise verl would update on different mini-batches than train.mini_batch_size says"
        )
    return None


@cross_rule(
    "train.verl.engines",
    ["train.verl.engines", "train.verl.warm_refit"],
    violation={
        "train.backend": "verl",
        "train.ref_anchor": "round",
        "train.verl.engines": "run",
        "train.verl.warm_refit": True,
    },
)
def _engines_or_refit(get):
    # plan time here; the verl job refuses the pair itself when reading train.verl (train/cli.verl_settings)
    # the probe refits inside one job, the engine sets across jobs (fedagent.train.verl.engines)
    if get("train.verl.engines") == "run" and get("train.verl.warm_refit"):
        return "run and train.verl.warm_refit are both set: choose one (the probe, or the run-scoped engine sets)"
    return None


PLAN_ONLY_RULES.add("train.verl.engines")


@cross_rule(
    "env.pool_size", ["env.pool_size", "train.group_size"], violation={"train.group_size": 4, "env.pool_size": 3}
)
def _pool_holds_a_group(get):
    if get("env.pool_size") < get("train.group_size"):
        return (
            f"{get('env.pool_size')} is smaller than train.group_size={get('train.group_size')} "
            "(a GRPO group runs its sessions in lockstep)"
        )
    return None


@cross_rule("model", ["model"], violation={"model": "/nonexistent/model-dir"})
def _model_exists(get):
    model = get("model")
    if is_random_source(model):  # random:<architecture name or dir>: random weights
        return random_source_problem(model, lambda p: (Path(p) / "config.json").is_file())
    if model not in MODEL_KEYWORDS and not (Path(model) / "config.json").is_file():
        return (
            f"{model!r} is not one of {MODEL_KEYWORDS}, not random:<architecture> and not a local HF model "
            "directory (no config.json there)"
        )
    return None


@cross_rule(
    "train.group_size",
    ["train.algorithm", "train.group_size"],
    violation={"train.algorithm": "grpo", "train.group_size": 1},
)
def _estimator_needs_a_group(get):
    need = ADVANTAGE_ESTIMATORS[get("train.algorithm")].min_group_size
    if get("train.group_size") < need:
        return (
            f"{get('train.group_size')} with train.algorithm={get('train.algorithm')}: a group needs at least "
            f"{need} rollouts"
        )
    return None


def val_pool_key(kind: str) -> str:
    """The config key that sizes the validation pool of an env kind (its spec's)."""
    return envs.spec(kind).val_pool_key


def val_pool_keys() -> list[str]:
    """Every registered env's validation pool key, sorted (the keys the eval.n rule may read)."""
    return sorted({s.val_pool_key for s in envs.specs()})


@cross_rule("eval.n", ["eval.n", "env.kind", *val_pool_keys()], violation={"eval.n": 3})
def _eval_n_within_the_validation_pool(get):
    # Index mode plays tasks[seed % pool]: past the pool, seeds replay tasks, and the report's
    # interval would treat the repeats as independent draws.
    pool_key = val_pool_key(get("env.kind"))
    if get("eval.n") > get(pool_key):
        return (
            f"{get('eval.n')} exceeds the validation pool ({pool_key}={get(pool_key)}): seeds past it would "
            "replay the same tasks and the 95 % interval would count the repeats as independent draws; "
            f"lower eval.n or raise {pool_key}"
        )
    return None


# server.lr: the server optimizers' own rule (fedagent.server.optimizer_base, from each class's default_lr),
# registered when the schema's server section is filled from their registry (fedagent.core.registry).


DETERMINISTIC = "deterministic"  # the config key (fedagent.model.determinism)

# deterministic: the local backend's jobs pin their kernels (fedagent.model.determinism); vLLM and verl
# have no such mode (verl's maintainers: exact reproduction is not possible with its rollout). One row per
# setting the key needs, (key, its value, why, the rest of a violating config): every backend key of the
# schema must be local (tests/test_config.py checks that each has its row), a feature key false.
DETERMINISTIC_NEEDS: tuple[tuple[str, Any, str, dict[str, Any]], ...] = (
    (
        "train.backend",
        "local",
        "verl's vLLM rollout has no deterministic mode",
        {"train.backend": "verl", "train.ref_anchor": "round"},
    ),
    ("eval.backend", "local", "vLLM has no deterministic mode", {"eval.backend": "vllm"}),
    # The compiled training step records its backward into CUDA graphs; the deterministic index_put_
    # of the index backward checks its indices on the host, which a capture cannot hold.
    (
        "train.compile_train",
        False,
        "the CUDA-graphed training step cannot hold the deterministic index_put_ of its backward "
        "(a host-side index check)",
        {"train.compile_train": True, "train.device": "cuda"},
    ),
)


def deterministic_needs(need_key: str, need: Any, why: str, violation: dict[str, Any]) -> Requirement:
    """The :class:`Requirement` that ``deterministic: true`` needs ``need_key`` = ``need``: a backend
    (``need`` a name) "needs <key>=<need> (<why>; got ...)", a feature (``need`` False) "with <key>: <why>;
    set <key>: false"."""
    why = why.replace("{", "{{").replace("}", "}}")  # literal text in the Requirement's format string
    if need is False:
        message = f"{{value!r}} with {need_key}: {why}; set {need_key}: false"
    else:
        message = f"{{value!r}} needs {need_key}={need} ({why}; got {{got!r}})"
    return Requirement(DETERMINISTIC, DETERMINISTIC, bool, need_key, need, message, {DETERMINISTIC: True, **violation})


# Features implemented for one backend / rollout mode only (one cross rule each).
REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(
        "train.fedprox_mu",
        "train.fedprox_mu",
        lambda mu: mu > 0,
        "train.backend",
        "local",
        "FedProx is implemented for train.backend=local only (the verl backend would ignore it)",
        {"train.backend": "verl", "train.ref_anchor": "round", "train.fedprox_mu": 0.01},
    ),
    Requirement(
        "rollout.mode",
        "rollout.mode",
        lambda mode: mode != "windowed",
        "train.backend",
        "local",
        "{value!r} is implemented for train.backend=local only (verl trains windowed)",
        {"train.backend": "verl", "train.ref_anchor": "round", "rollout.mode": "concat"},
    ),
    Requirement(
        "train.clip_ratio_c",
        "train.clip_ratio_c",
        lambda c: c is None,
        "train.backend",
        "local",
        "null (no dual-clip) is implemented for train.backend=local only (verl's vanilla policy loss always "
        "caps at clip_ratio_c > 1; got {got!r})",
        {"train.backend": "verl", "train.ref_anchor": "round", "train.clip_ratio_c": None},
    ),
    Requirement(
        "train.residual_dtype",
        "train.residual_dtype",
        lambda dt: dt != "float32",
        "train.device",
        "cuda",
        "{value!r} trains on train.device=cuda only (the CPU path is fp32 and byte-deterministic; got {got!r})",
        {"train.residual_dtype": "bfloat16"},
    ),
    Requirement(
        "train.residual_dtype",
        "train.residual_dtype",
        lambda dt: dt != "float32",
        "train.backend",
        "local",
        "{value!r} is implemented for train.backend=local only (verl keeps its own mixed precision)",
        {
            "train.residual_dtype": "bfloat16",
            "train.device": "cuda",
            "train.backend": "verl",
            "train.ref_anchor": "round",
        },
    ),
    Requirement(
        "train.activation_checkpointing",
        "train.activation_checkpointing",
        lambda on: bool(on),
        "train.backend",
        "local",
        "{value!r} is implemented for train.backend=local only (the verl backend would ignore it; got {got!r})",
        {"train.activation_checkpointing": True, "train.backend": "verl", "train.ref_anchor": "round"},
    ),
    # Seen on the GPU (bench/gpu_throughput.py --train-modes compiled_ckpt at 1.7B; docs/results/scale-1p7b.md): the
    # CUDA-graphed forward with checkpointed layers fails on its first backward ("accessing tensor
    # output of CUDAGraphs that has been overwritten by a subsequent run"). Refused before any job.
    Requirement(
        "train.compile_train",
        "train.compile_train",
        lambda on: bool(on),
        "train.activation_checkpointing",
        False,
        "{value!r} with train.activation_checkpointing: the compiled, CUDA-graphed training step with "
        "checkpointed layers fails on its first backward on the GPU (docs/results/scale-1p7b.md); "
        "set one of them to false",
        {"train.compile_train": True, "train.activation_checkpointing": True, "train.device": "cuda"},
    ),
    Requirement(
        "rollout.mode",
        "train.algorithm",
        lambda algo: algo == "ppo",
        "rollout.mode",
        "windowed",
        "{value!r} with train.algorithm=ppo: PPO's GAE is per turn (windowed) only",
        {"train.algorithm": "ppo", "rollout.mode": "concat"},
    ),
    *(deterministic_needs(*row) for row in DETERMINISTIC_NEEDS),
    Requirement(
        "warm_start.enabled",
        "warm_start.enabled",
        lambda on: bool(on),
        "rollout.mode",
        "windowed",
        "the expert warm start plays its demonstrations windowed (got rollout.mode={got!r})",
        {"warm_start.enabled": True, "rollout.mode": "concat"},
    ),
)
for _req in REQUIREMENTS:
    cross_rule(_req.key, dict.fromkeys((_req.key, _req.when_key, _req.need_key)), _req.violation)(_req.check)


# What each advantage estimator needs, from its class (fedagent.train.advantages): a new estimator
# states its facts there and these rules apply them; none names an estimator.
@cross_rule(
    "train.algorithm",
    ["train.algorithm", "train.backend"],
    violation={"train.algorithm": "gigpo", "train.backend": "verl", "train.ref_anchor": "round"},
)
def _estimator_has_the_backend(get):
    cls = ADVANTAGE_ESTIMATORS[get("train.algorithm")]
    if get("train.backend") not in cls.backends:
        return (
            f"{cls.name!r} is implemented for train.backend={'/'.join(cls.backends)} only "
            f"(got {get('train.backend')!r}: its trainer computes other advantages)"
        )
    return None


@cross_rule(
    "train.algorithm",
    ["train.algorithm", "rollout.mode"],
    violation={"train.algorithm": "gigpo", "rollout.mode": "concat"},
)
def _estimator_gets_its_turns(get):
    cls = ADVANTAGE_ESTIMATORS[get("train.algorithm")]
    if cls.per_turn and get("rollout.mode") != "windowed":
        return (
            f"{cls.name!r} needs one sample per turn with the turn's observation: rollout.mode=windowed "
            f"(got {get('rollout.mode')!r})"
        )
    return None


@cross_rule(
    "warm_start.demos",
    [
        "warm_start.enabled",
        "warm_start.demos",
        "env.kind",
        "env.train_games",
        "clients.total",
        "partition.min_tasks_per_client",
    ],
    violation={"warm_start.enabled": True, "warm_start.demos": 4},
)
def _demos_leave_the_clients_their_tasks(get):
    # Catalogues sized by env.train_games (an env whose catalogue decides its own count, as WebShop's
    # goals, has train_games_sized false: the demo-pool job checks against the built catalogue, passing
    # its size as env.train_games); the demo pool is taken out before the partition.
    if not get("warm_start.enabled") or not envs.spec(get("env.kind")).train_games_sized:
        return None
    need = get("clients.total") * get("partition.min_tasks_per_client")
    if get("warm_start.demos") + need > get("env.train_games"):
        return (
            f"{get('warm_start.demos')} demo tasks leave {get('env.train_games') - get('warm_start.demos')} of "
            f"env.train_games={get('env.train_games')} for {get('clients.total')} clients × "
            f"partition.min_tasks_per_client={get('partition.min_tasks_per_client')}"
        )
    return None


@cross_rule(
    "train.ppo.critic_path",
    ["train.algorithm", "train.ppo.critic_path"],
    violation={"train.algorithm": "ppo", "train.ppo.critic_path": "/nonexistent/critic"},
)
def _critic_path_has_a_value_head(get):
    path = get("train.ppo.critic_path")
    if get("train.algorithm") != "ppo" or path is None:
        return None
    if not Path(path).is_dir():
        return f"{path!r} is not a directory"
    if has_value_head(Path(path)) is not True:
        return f"{path!r} holds no value head ({NO_HEAD_HINT}); omit the key to start a fresh head"
    return None


# violation: more Byzantine clients than clients (tests/workflow_config.yaml: N = 2)
@cross_rule(
    "byzantine.clients",
    ["byzantine.clients", "clients.total"],
    violation={"byzantine.clients": 3},
)
def _byzantine_among_the_clients(get):
    if get("byzantine.clients") > get("clients.total"):
        return f"{get('byzantine.clients')} Byzantine clients of clients.total={get('clients.total')}"
    return None


def run_cross_rules(get: Callable[[str], Any], has: Callable[[str], bool]) -> None:
    """Apply every rule whose keys are all present (``has``); ConfigError naming the rule's key."""
    for rule in CROSS_RULES:
        if all(has(k) for k in rule.needs):
            problem = rule.check(get)
            if problem:
                raise ConfigError(f"config key '{rule.key}': {problem}")


def check_cross_fields(config: dict) -> dict:
    """Checks the schema cannot express (:data:`CROSS_RULES`); raises :class:`ConfigError` naming the key."""
    missing = object()
    run_cross_rules(lambda k: get_path(config, k), lambda k: get_path(config, k, missing) is not missing)
    min_per_round = get_path(config, "clients.min_per_round", None)
    if min_per_round is not None and min_per_round > config["clients"]["per_round"]:
        raise ConfigError(
            f"config key 'clients.min_per_round': {min_per_round} exceeds clients.per_round={config['clients']['per_round']}"
        )
    for spec in envs.specs():  # each env's own checks (they know whether env.kind is theirs)
        if spec.check is not None:
            spec.check(config)
    _check_aggregate_weights(config)
    check_experiment_fields(config)
    return config


def check_experiment_fields(config: dict) -> dict:
    """Cross-field checks of the experiment matrix: env kind, partition strategy, baselines."""
    clients, part, env = config["clients"], config["partition"], config["env"]
    pinned = clients.get("pinned")
    if pinned is not None:
        if pinned >= clients["total"]:
            raise ConfigError(f"config key 'clients.pinned': {pinned} is not a client id (0..{clients['total'] - 1})")
        if clients["per_round"] != 1:
            raise ConfigError(
                "config key 'clients.per_round': must be 1 with clients.pinned (the pinned-local "
                f"baseline trains one client), got {clients['per_round']}"
            )
    strategy = part["strategy"]
    if strategy == "hardness" and not (part.get("labels") or part.get("labels_model")):
        raise ConfigError(
            "config key 'partition.labels': strategy hardness needs a labels file "
            "(partition.labels) or a reference policy to build one (partition.labels_model)"
        )
    if (
        strategy == "hardness"
        and not part.get("labels")
        and part.get("labels_model") == "expert"
        and not envs.spec(env["kind"]).labels_expert
    ):
        raise ConfigError(
            "config key 'partition.labels_model': 'expert' plays the ALFWorld PDDL planner "
            f"(env.kind alfworld), not {env['kind']}"
        )
    if part.get("labels") and not Path(part["labels"]).is_file():
        raise ConfigError(f"config key 'partition.labels': {part['labels']} is not a file")
    if strategy == "env_disjoint" and not envs.spec(env["kind"]).scene_ids:
        raise ConfigError(
            "config key 'partition.strategy': env_disjoint partitions ALFWorld scenes "
            f"(env.kind alfworld), not {env['kind']}"
        )
    if strategy == "preference" and envs.spec(env["kind"]).single_task_type:
        raise ConfigError(
            "config key 'partition.strategy': preference mixes task types, and TextWorld "
            "games have one type (use env.kind alfworld)"
        )
    if strategy == "task_disjoint" and env["train_games"] < clients["total"]:
        raise ConfigError(
            f"config key 'env.train_games': task_disjoint needs at least one task per client "
            f"({clients['total']}), got {env['train_games']}"
        )
    return config


WEIGHTS_SUM_TOLERANCE = 1e-6  # the reference's check on its weights list


def _check_aggregate_weights(config: dict) -> None:
    """``aggregate.weights``: set iff weighting is ``weights``, one per client, summing to 1 ± 1e-6.

    Plan time only: each aggregate job receives its round's clients' entries (and checks those)."""
    agg = config.get("aggregate") or {}
    weighting, weights = agg.get("weighting", "uniform"), agg.get("weights")
    if weighting == "weights" and weights is None:
        raise ConfigError(
            "config key 'aggregate.weights': aggregate.weighting is 'weights' but no list is given "
            "(one weight per client, summing to 1)"
        )
    if weights is None:
        return
    if weighting != "weights":
        raise ConfigError(
            f"config key 'aggregate.weights': set, but aggregate.weighting is {weighting!r} "
            "(use weighting: weights, or drop the list)"
        )
    total = config["clients"]["total"]
    if len(weights) != total:
        raise ConfigError(
            f"config key 'aggregate.weights': {len(weights)} weights for clients.total={total} (one per client)"
        )
    s = sum(float(w) for w in weights)
    if abs(s - 1.0) > WEIGHTS_SUM_TOLERANCE:
        raise ConfigError(
            f"config key 'aggregate.weights': the weights sum to {s!r}, not 1 (± {WEIGHTS_SUM_TOLERANCE})"
        )


def env_cross_rule(kind: str, rule: CrossRule) -> CrossRule:
    """An env's rule as a registered one: applied only when ``env.kind`` is ``kind``."""

    def check(get):
        return rule.check(get) if get("env.kind") == kind else None

    return CrossRule(rule.key, tuple(dict.fromkeys((*rule.needs, "env.kind"))), check, dict(rule.violation))


# The environments' own rules (fedagent.core.envs.EnvSpec.cross_rules), after the core's.
for _spec in envs.specs():
    for _rule in _spec.cross_rules:
        CROSS_RULES.append(env_cross_rule(_spec.kind, _rule))
