"""Run configuration: one definition of every parameter constraint, used at plan time and in jobs.

The JSON schema ``workflow/schemas/config.schema.yaml`` declares each key's type, default and
single-key constraints (minimum, maximum, enum, ...); :data:`CROSS_RULES` declares every
constraint that reads two or more keys. Both are used in two places:

- plan time (``workflow/common.smk`` through :func:`prepare_config`; ``fedagent check-config``
  and ``fedagent config show`` through :func:`load_config`): the whole config;
- inside a job: each job's parameters declare the config key they come from (a
  :class:`JobKeys`) and are checked with :meth:`JobKeys.check` against the same schema entries
  and the cross rules whose keys they all carry.

So a job refuses nothing that planning let through, and a constraint added to the schema (or
to :data:`CROSS_RULES`) is checked in both places with no further code. Snakemake passes nested
``--config`` values as strings (YAML BaseLoader); :func:`coerce_cli_strings` converts those,
and only those, to the schema's type at their path first. Every error names the offending key.

This module imports nothing heavy (yaml; jsonschema on first use): the workflow imports it
while parsing.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import yaml

_PKG_SCHEMA = Path(__file__).resolve().parent / "config.schema.yaml"  # symlink into workflow/ (package data)
_REPO_SCHEMA = Path(__file__).resolve().parent.parent / "workflow" / "schemas" / "config.schema.yaml"
SCHEMA_PATH = _PKG_SCHEMA if _PKG_SCHEMA.is_file() else _REPO_SCHEMA
MODEL_KEYWORDS = ("smollm2", "tiny")


class ConfigError(ValueError):
    """An invalid configuration; the message names the key."""


def load_schema(path: Path = SCHEMA_PATH) -> dict:
    """The config JSON schema (YAML on disk)."""
    return yaml.safe_load(Path(path).read_text())


@functools.lru_cache(maxsize=None)
def _schema() -> dict:
    return load_schema()


def schema() -> dict:
    """The workflow's schema, parsed once per process (do not modify it)."""
    return _schema()


# --------------------------------------------------------------------------- schema navigation
def subschema(path: str, schema: dict | None = None) -> dict | None:
    """The schema entry of the dotted config key ``path`` (None if the schema has no such key)."""
    node = _schema() if schema is None else schema
    for part in path.split("."):
        props = node.get("properties") if isinstance(node, dict) else None
        if not props or part not in props:
            return None
        node = props[part]
    return node


def schema_types(sub: Mapping) -> set[str]:
    """The JSON types an entry allows (from ``type``, ``anyOf``/``oneOf`` or an ``enum``'s values)."""
    types: set[str] = set()
    t = sub.get("type")
    if isinstance(t, str):
        types.add(t)
    elif isinstance(t, list):
        types.update(t)
    for alt in list(sub.get("anyOf", [])) + list(sub.get("oneOf", [])):
        types |= schema_types(alt)
    if not types and "enum" in sub:
        for v in sub["enum"]:
            types.add({bool: "boolean", int: "integer", float: "number", str: "string",
                       type(None): "null"}.get(type(v), "string"))
    return types


def leaf_keys(schema: dict | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of a scalar (non-object) entry of the schema, in schema order."""
    node = _schema() if schema is None else schema
    keys = []
    for name, sub in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        if "properties" in sub:
            keys += leaf_keys(sub, path + ".")
        else:
            keys.append(path)
    return keys


def get_path(config: Mapping, path: str, default: Any = KeyError) -> Any:
    """``config[a][b]`` for ``path`` ``"a.b"``; ``default`` (or KeyError) when absent."""
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is KeyError:
                raise KeyError(path)
            return default
        node = node[part]
    return node


def set_path(config: dict, path: str, value: Any) -> None:
    """Set ``config[a][b] = value`` for ``path`` ``"a.b"``, creating the dicts on the way."""
    *parents, leaf = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


# --------------------------------------------------------------------------- command-line strings
_BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}
_NULL_WORDS = {"null", "~", "none", ""}


def coerce_scalar(key: str, text: str, types: set[str]) -> Any:
    """``text`` as the first of the schema's ``types`` it spells; ConfigError naming ``key`` if none."""
    if not types or "string" in types:
        return text
    s = text.strip()
    low = s.lower()
    if "null" in types and low in _NULL_WORDS:
        return None
    if "boolean" in types and low in _BOOL_WORDS:
        return _BOOL_WORDS[low]
    if "integer" in types or "number" in types:
        try:
            return int(s)
        except ValueError:
            pass
    if "integer" in types and "number" not in types:
        try:
            value = float(s)
        except ValueError:
            value = None
        if value is not None and math.isfinite(value) and value.is_integer():
            return int(value)  # "2.0", "1e3": integral, as JSON Schema's integer allows
    if "number" in types:
        try:
            value = float(s)
        except ValueError:
            value = None
        if value is not None:
            if not math.isfinite(value):
                raise ConfigError(f"config key '{key}': {text!r} is not a finite number")
            return value
    want = " or ".join({"integer": "an integer", "number": "a number", "boolean": "a boolean (true/false)",
                        "null": "null", "object": 'a mapping (--config "key={a: 1}")',
                        "array": "a list"}.get(t, t) for t in sorted(types))
    raise ConfigError(f"config key '{key}': {text!r} (from the command line) is not {want}")


def coerce_cli_strings(config: dict, cli: Mapping, schema: dict | None = None, prefix: str = "") -> dict:
    """Convert, in ``config``, the string scalars that the command line (``cli``) set.

    ``cli`` is what ``--config`` gave (Snakemake parses nested values with YAML's BaseLoader:
    every nested scalar is a string); each string at a key the schema declares as integer,
    number, boolean or null is converted to that type, in place. Values from config files,
    and keys the schema does not know (validation names them), are left alone.
    """
    for name, value in cli.items():
        path = f"{prefix}{name}"
        sub = subschema(path, schema)
        if sub is None or not isinstance(config, dict) or name not in config:
            continue
        if isinstance(value, Mapping) and isinstance(config[name], dict):
            coerce_cli_strings(config[name], value, schema, path + ".")
        elif isinstance(value, str) and isinstance(config[name], str):
            config[name] = coerce_scalar(path, config[name], schema_types(sub))
        elif isinstance(value, list) and isinstance(config[name], list) and isinstance(sub.get("items"), dict):
            types = schema_types(sub["items"])
            config[name] = [coerce_scalar(f"{path}[{i}]", v, types) if isinstance(v, str) else v
                            for i, v in enumerate(config[name])]
    return config


# --------------------------------------------------------------------------- single-key checks
def _with_defaults(validator_cls):
    # jsonschema's documented recipe: fill defaults while validating (Snakemake does the same).
    from jsonschema import validators

    validate_props = validator_cls.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_props(validator, properties, instance, schema)

    return validators.extend(validator_cls, {"properties": set_defaults})


def _error_message(err) -> str:
    path = [str(p) for p in err.absolute_path]
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        allowed = set(err.schema.get("properties", {}))
        unknown = sorted(k for k in err.instance if k not in allowed)
        key = ".".join(path + [unknown[0]]) if unknown else ".".join(path)
        return f"config key '{key}': unknown key (allowed here: {sorted(allowed)})"
    key = ".".join(path) or "<top level>"
    return f"config key '{key}': {err.message}"


def validate_schema(config: dict, schema: dict | None = None) -> dict:
    """Validate ``config`` against the schema, filling defaults in place; return it."""
    from jsonschema import Draft202012Validator

    schema = schema or _schema()
    validator = _with_defaults(Draft202012Validator)(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        raise ConfigError(_error_message(errors[0]))
    return config


def check_value(path: str, value: Any) -> None:
    """Check one value against the schema entry of ``path``; ConfigError naming the key."""
    from jsonschema import Draft202012Validator

    sub = subschema(path)
    if sub is None:
        raise ConfigError(f"config key '{path}': not a key of the config schema")
    err = next(iter(Draft202012Validator(sub).iter_errors(value)), None)
    if err is not None:
        raise ConfigError(f"config key '{path}': {err.message}")


# --------------------------------------------------------------------------- cross-key checks
@dataclass(frozen=True)
class CrossRule:
    """A constraint over several keys: ``check(get)`` returns what is wrong, or None.

    ``key`` is the key the message names; ``needs`` every key ``check`` reads (``key``
    included); ``violation`` a set of overrides (dotted keys) of the default config that breaks
    the rule and nothing else (the tests derive their bad configs from it).
    """

    key: str
    needs: tuple[str, ...]
    check: Callable[[Callable[[str], Any]], str | None]
    violation: Mapping[str, Any]


CROSS_RULES: list[CrossRule] = []


def cross_rule(key: str, needs: Iterable[str], violation: Mapping[str, Any]):
    """Register a :class:`CrossRule` (decorator over its ``check``)."""
    def register(check):
        CROSS_RULES.append(CrossRule(key, tuple(needs), check, dict(violation)))
        return check
    return register


@cross_rule("clients.per_round", ["clients.per_round", "clients.total"],
            violation={"clients.total": 2, "clients.per_round": 3})
def _per_round_within_total(get):
    if get("clients.per_round") > get("clients.total"):
        return f"{get('clients.per_round')} exceeds clients.total={get('clients.total')}"
    return None


@cross_rule("partition.min_tasks_per_client", ["partition.min_tasks_per_client", "env.train_games", "env.kind"],
            violation={"env.train_games": 4, "partition.min_tasks_per_client": 5})
def _min_tasks_within_catalogue(get):
    # TextWorld only: env.train_games is its catalogue size (WebShop's is built from its own keys).
    if get("env.kind") == "textworld" and get("partition.min_tasks_per_client") > get("env.train_games"):
        return (f"{get('partition.min_tasks_per_client')} exceeds the {get('env.train_games')} train tasks "
                "(env.train_games)")
    return None


@cross_rule("train.mini_batch_size",
            ["train.mini_batch_size", "train.group_size", "train.groups_per_epoch", "train.max_turns", "rollout.mode"],
            violation={"train.group_size": 2, "train.groups_per_epoch": 1, "train.max_turns": 2,
                       "train.mini_batch_size": 5})
def _mini_batch_within_epoch(get):
    if get("rollout.mode") == "concat":   # one sample per episode
        most, how = get("train.group_size") * get("train.groups_per_epoch"), "group_size × groups_per_epoch, concat"
    else:                                 # one sample per turn
        most, how = (get("train.group_size") * get("train.groups_per_epoch") * get("train.max_turns"),
                     "group_size × groups_per_epoch × max_turns")
    if get("train.mini_batch_size") > most:
        return f"{get('train.mini_batch_size')} is larger than the {most} samples one epoch can produce ({how})"
    return None


@cross_rule("train.mini_batch_size",
            ["train.backend", "train.mini_batch_size", "train.group_size", "train.groups_per_epoch"],
            violation={"train.backend": "verl", "train.ref_anchor": "round", "train.group_size": 2,
                       "train.groups_per_epoch": 2, "train.mini_batch_size": 3})
def _verl_mini_batch_is_whole_groups(get):
    # verl 0.9.1's v1 trainer updates on mini-batches of ppo_mini_batch_size × rollout.n rows and
    # wants ppo_mini_batch_size <= train_batch_size (prompts): only whole groups of one step's tasks
    # give it the row count the local backend would use (docs/architecture.md, train.verl).
    if get("train.backend") != "verl":
        return None
    m, n, g = get("train.mini_batch_size"), get("train.group_size"), get("train.groups_per_epoch")
    if m % n or m > n * g:
        return (f"{m} with train.backend=verl: verl's mini-batch is a whole number of groups (train.group_size="
                f"{n}) of one step's train.groups_per_epoch={g} tasks, so it must be a multiple of {n} and at most "
                f"{n * g}; otherwise verl would update on different mini-batches than train.mini_batch_size says")
    return None


@cross_rule("env.pool_size", ["env.pool_size", "train.group_size"],
            violation={"train.group_size": 4, "env.pool_size": 3})
def _pool_holds_a_group(get):
    if get("env.pool_size") < get("train.group_size"):
        return (f"{get('env.pool_size')} is smaller than train.group_size={get('train.group_size')} "
                "(a GRPO group runs its sessions in lockstep)")
    return None


@cross_rule("model", ["model"], violation={"model": "/nonexistent/model-dir"})
def _model_exists(get):
    model = get("model")
    if model not in MODEL_KEYWORDS and not (Path(model) / "config.json").is_file():
        return (f"{model!r} is not one of {MODEL_KEYWORDS} and not a local HF model directory "
                "(no config.json there)")
    return None


@cross_rule("train.ref_anchor", ["train.ref_anchor", "train.backend", "train.kl_coef"],
            violation={"train.backend": "verl", "train.ref_anchor": "base", "train.kl_coef": 0.01})
def _verl_reference_is_the_start_model(get):
    # verl's KL reference is the model a job starts from (its actor's initial weights).
    if get("train.backend") == "verl" and get("train.ref_anchor") != "round" and get("train.kl_coef") > 0:
        return (f"{get('train.ref_anchor')!r} with train.backend=verl: verl's KL reference is the model a job "
                "starts from; use train.ref_anchor: round (or train.kl_coef: 0)")
    return None


@cross_rule("train.group_size", ["train.algorithm", "train.group_size"],
            violation={"train.algorithm": "grpo", "train.group_size": 1})
def _grpo_needs_a_group(get):
    if get("train.algorithm") == "grpo" and get("train.group_size") < 2:
        return f"{get('train.group_size')} with train.algorithm=grpo: a group needs at least 2 rollouts"
    return None


@dataclass(frozen=True)
class Requirement:
    """A feature needs a setting: when ``when_key``'s value passes ``when``, ``need_key`` must be ``need``.

    ``key`` is the key the message names; ``message`` is formatted with ``value`` (``key``'s value)
    and ``got`` (``need_key``'s value); ``violation`` as in :class:`CrossRule`.
    """

    key: str
    when_key: str
    when: Callable[[Any], bool]
    need_key: str
    need: Any
    message: str
    violation: Mapping[str, Any]

    def check(self, get: Callable[[str], Any]) -> str | None:
        """The message when the feature is on and the setting is not what it needs, else None."""
        if self.when(get(self.when_key)) and get(self.need_key) != self.need:
            return self.message.format(value=get(self.key), got=get(self.need_key))
        return None


# Features implemented for one backend / rollout mode only (one cross rule each).
REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement("train.fedprox_mu", "train.fedprox_mu", lambda mu: mu > 0, "train.backend", "local",
                "FedProx is implemented for train.backend=local only (the verl backend would ignore it)",
                {"train.backend": "verl", "train.ref_anchor": "round", "train.fedprox_mu": 0.01}),
    Requirement("rollout.mode", "rollout.mode", lambda mode: mode != "windowed", "train.backend", "local",
                "{value!r} is implemented for train.backend=local only (verl trains windowed)",
                {"train.backend": "verl", "train.ref_anchor": "round", "rollout.mode": "concat"}),
    Requirement("train.algorithm", "train.algorithm", lambda algo: algo == "ppo", "train.backend", "local",
                "ppo runs on train.backend=local only (got {got!r})",
                {"train.algorithm": "ppo", "train.backend": "verl", "train.ref_anchor": "round"}),
    Requirement("train.residual_dtype", "train.residual_dtype", lambda dt: dt != "float32", "train.device", "cuda",
                "{value!r} trains on train.device=cuda only (the CPU path is fp32 and byte-deterministic; got {got!r})",
                {"train.residual_dtype": "bfloat16"}),
    Requirement("train.residual_dtype", "train.residual_dtype", lambda dt: dt != "float32", "train.backend", "local",
                "{value!r} is implemented for train.backend=local only (verl keeps its own mixed precision)",
                {"train.residual_dtype": "bfloat16", "train.device": "cuda", "train.backend": "verl",
                 "train.ref_anchor": "round"}),
    Requirement("rollout.mode", "train.algorithm", lambda algo: algo == "ppo", "rollout.mode", "windowed",
                "{value!r} with train.algorithm=ppo: PPO's GAE is per turn (windowed) only",
                {"train.algorithm": "ppo", "rollout.mode": "concat"}),
)
for _req in REQUIREMENTS:
    cross_rule(_req.key, dict.fromkeys((_req.key, _req.when_key, _req.need_key)), _req.violation)(_req.check)


@cross_rule("train.ppo.critic_path", ["train.algorithm", "train.ppo.critic_path"],
            violation={"train.algorithm": "ppo", "train.ppo.critic_path": "/nonexistent/critic"})
def _critic_path_has_a_value_head(get):
    path = get("train.ppo.critic_path")
    if get("train.algorithm") != "ppo" or path is None:
        return None
    from fedagent.train.critic import NO_HEAD_HINT, has_value_head   # no torch: safetensors headers only

    if not Path(path).is_dir():
        return f"{path!r} is not a directory"
    if has_value_head(Path(path)) is not True:
        return f"{path!r} holds no value head ({NO_HEAD_HINT}); omit the key to start a fresh head"
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
    if get_path(config, "env.kind", None) == "webshop":
        _check_webshop(config["env"]["webshop"])
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
            raise ConfigError("config key 'clients.per_round': must be 1 with clients.pinned (the pinned-local "
                              f"baseline trains one client), got {clients['per_round']}")
    strategy = part["strategy"]
    if strategy == "hardness" and not (part.get("labels") or part.get("labels_model")):
        raise ConfigError("config key 'partition.labels': strategy hardness needs a labels file "
                          "(partition.labels) or a reference policy to build one (partition.labels_model)")
    if (strategy == "hardness" and not part.get("labels") and part.get("labels_model") == "expert"
            and env["kind"] != "alfworld"):
        raise ConfigError("config key 'partition.labels_model': 'expert' plays the ALFWorld PDDL planner "
                          f"(env.kind alfworld), not {env['kind']}")
    if part.get("labels") and not Path(part["labels"]).is_file():
        raise ConfigError(f"config key 'partition.labels': {part['labels']} is not a file")
    if strategy == "env_disjoint" and env["kind"] != "alfworld":
        raise ConfigError("config key 'partition.strategy': env_disjoint partitions ALFWorld scenes "
                          f"(env.kind alfworld), not {env['kind']}")
    if strategy == "preference" and env["kind"] == "textworld":
        raise ConfigError("config key 'partition.strategy': preference mixes task types, and TextWorld "
                          "games have one type (use env.kind alfworld)")
    if strategy == "task_disjoint" and env["train_games"] < clients["total"]:
        raise ConfigError(f"config key 'env.train_games': task_disjoint needs at least one task per client "
                          f"({clients['total']}), got {env['train_games']}")
    alf = env.get("alfworld") or {}
    if alf.get("data") and env["kind"] != "alfworld":
        raise ConfigError("config key 'env.alfworld.data': set, but env.kind is not alfworld")
    if alf.get("data") and not Path(alf["data"]).is_dir():
        raise ConfigError(f"config key 'env.alfworld.data': {alf['data']} is not a directory")
    return config


def _check_webshop(ws: dict) -> None:
    """Cross-field checks of ``env.webshop`` (the arm pools' sizes live in envs.webshop.arms)."""
    if ws["goals"] == "human" and ws["data"] is None:
        raise ConfigError("config key 'env.webshop.goals': human goals need the standard files (env.webshop.data)")
    if ws["arm"] == "lookalike" and (ws["goals"] == "human" or ws["max_products"] is not None):
        raise ConfigError("config key 'env.webshop.arm': lookalike cannot be combined with human goals or max_products")
    if ws["data"] is None and ws["n_products"] * ws["goals_per_product"] <= ws["val_goals"]:
        raise ConfigError(
            f"config key 'env.webshop.val_goals': {ws['val_goals']} leaves no training goal out of at most "
            f"{ws['n_products'] * ws['goals_per_product']} (n_products × goals_per_product)")
    pools = {"bm25_field_subset": 8, "bm25_reweight": 8, "lookalike": 4, "rank_wrapper": 4}
    if ws["arm"] in pools and ws["variant_n"] > pools[ws["arm"]]:
        raise ConfigError(f"config key 'env.webshop.variant_n': {ws['arm']} has {pools[ws['arm']]} variants")
    if ws["variant"] is not None and ws["variant"] >= ws["variant_n"]:
        raise ConfigError(f"config key 'env.webshop.variant': must be below variant_n={ws['variant_n']}")




def integral_floats_to_int(config: dict, schema: dict | None = None) -> dict:
    """``3.0`` → ``3`` at integer keys, in place (JSON Schema's integer accepts 3.0; ``range`` does not)."""
    for key in leaf_keys(schema):
        value = get_path(config, key, None)
        types = schema_types(subschema(key, schema))
        if isinstance(value, float) and value.is_integer() and "integer" in types and "number" not in types:
            set_path(config, key, int(value))
    return config


def prepare_config(config: dict, cli: Mapping | None = None) -> dict:
    """The plan-time check, in place: command-line strings coerced, schema (defaults filled), cross rules."""
    if cli:
        coerce_cli_strings(config, cli)
    validate_schema(config)
    integral_floats_to_int(config)
    return check_cross_fields(config)


# --------------------------------------------------------------------------- job-side checks
JOB_KEYS: dict[str, "JobKeys"] = {}
# The modules that define a JobKeys (importing them fills JOB_KEYS; the tests do).
JOB_MODULES = ("fedagent.train.critic", "fedagent.envs.textworld_games", "fedagent.partition", "fedagent.val_set", "fedagent.selection",
               "fedagent.train.local", "fedagent.aggregate", "fedagent.server_opt", "fedagent.evaluate",
               "fedagent.train.verl.backend")


@dataclass(frozen=True)
class JobKeys:
    """The config key behind each parameter of one job: the job checks its values with these.

    ``keys`` maps the job's own parameter name to a dotted config key. :meth:`check` applies
    the schema entry of each key and every cross rule whose keys the job carries — exactly
    what planning applied to the same keys, so a job refuses nothing a plan let through.
    Instances register themselves in :data:`JOB_KEYS` by ``job`` (the tests enumerate them).
    """

    job: str
    keys: Mapping[str, str]

    def __post_init__(self):
        unknown = [k for k in self.keys.values() if subschema(k) is None]
        if unknown:
            raise ValueError(f"job {self.job}: not config keys: {unknown}")
        JOB_KEYS[self.job] = self

    @classmethod
    def for_dataclass(cls, job: str, dc, section: str, renamed: Mapping[str, str] | None = None) -> "JobKeys":
        """The fields of ``dc`` that are config keys: ``renamed[f]``, else ``<section>.<f>`` if the schema has it."""
        renamed = dict(renamed or {})
        keys = {}
        for f in dataclasses.fields(dc):
            path = renamed.get(f.name, f"{section}.{f.name}")
            if subschema(path) is not None:
                keys[f.name] = path
        return cls(job, keys)

    def check(self, values: Mapping[str, Any]) -> None:
        """Check ``values`` (by parameter name; names without a config key are ignored)."""
        by_key = {self.keys[n]: v for n, v in values.items() if n in self.keys}
        for path, value in by_key.items():
            check_value(path, value)
        run_cross_rules(by_key.__getitem__, by_key.__contains__)

    def from_config(self, config: Mapping) -> dict[str, Any]:
        """This job's parameter values in ``config`` (a validated config)."""
        return {name: get_path(config, path) for name, path in self.keys.items()}


def load_config(path: Path, overrides: dict | None = None) -> dict:
    """Load a YAML config, apply ``overrides`` (dotted keys), validate, return it."""
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML ({exc})") from exc
    for dotted, value in (overrides or {}).items():
        set_path(config, dotted, value)
    return prepare_config(config)


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent check-config``."""
    parser.add_argument("config", type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key (YAML value), e.g. --set rounds=70")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent check-config``: prints the resolved config or the error."""
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"--set {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        overrides[key] = yaml.safe_load(value)
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"fedagent: invalid config: {exc}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(config, sort_keys=True), end="")
    return 0


def dataclass_from_dict(cls, d: dict[str, Any], what: str):
    """``cls(**d)`` for a params dataclass; unknown keys are a ValueError naming them.

    A typo'd key must not silently fall back to a default (that would change the science).
    """
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown {what} params: {unknown} (known: {sorted(known)})")
    return cls(**d)
