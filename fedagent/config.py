"""Run configuration: JSON-schema validation (with defaults) plus cross-field checks.

Snakemake validates ``config`` against ``workflow/schemas/config.schema.yaml`` and then
calls :func:`check_cross_fields`; ``fedagent check-config`` does both for a file. Every
error names the offending key.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "workflow" / "schemas" / "config.schema.yaml"
MODEL_KEYWORDS = ("smollm2", "tiny")


class ConfigError(ValueError):
    """An invalid configuration; the message names the key."""


def load_schema(path: Path = SCHEMA_PATH) -> dict:
    """The config JSON schema (YAML on disk)."""
    return yaml.safe_load(Path(path).read_text())


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


def validate_schema(config: dict, schema: dict | None = None) -> dict:
    """Validate ``config`` against the schema, filling defaults in place; return it."""
    from jsonschema import Draft202012Validator

    schema = schema or load_schema()
    validator = _with_defaults(Draft202012Validator)(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        path = [str(p) for p in err.absolute_path]
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            allowed = set(err.schema.get("properties", {}))
            unknown = sorted(k for k in err.instance if k not in allowed)
            key = ".".join(path + [unknown[0]]) if unknown else ".".join(path)
            raise ConfigError(f"config key '{key}': unknown key (allowed here: {sorted(allowed)})")
        key = ".".join(path) or "<top level>"
        raise ConfigError(f"config key '{key}': {err.message}")
    return config


def check_cross_fields(config: dict) -> dict:
    """Checks the schema cannot express; raises :class:`ConfigError` naming the key."""
    clients = config["clients"]
    if clients["per_round"] > clients["total"]:
        raise ConfigError(
            f"config key 'clients.per_round': {clients['per_round']} exceeds clients.total={clients['total']}"
        )
    min_tasks = config["partition"]["min_tasks_per_client"]
    if min_tasks > config["env"]["train_games"]:
        raise ConfigError(
            f"config key 'partition.min_tasks_per_client': {min_tasks} exceeds env.train_games="
            f"{config['env']['train_games']}"
        )
    model = config["model"]
    if model not in MODEL_KEYWORDS and not (Path(model) / "config.json").is_file():
        raise ConfigError(
            f"config key 'model': {model!r} is not one of {MODEL_KEYWORDS} and not a local HF model "
            "directory (no config.json there)"
        )
    if config["train"]["mini_batch_size"] > config["train"]["group_size"] * config["train"]["groups_per_epoch"] * config["train"]["max_turns"]:
        raise ConfigError(
            "config key 'train.mini_batch_size': larger than the most samples one epoch can produce "
            "(group_size × groups_per_epoch × max_turns)"
        )
    if config["env"]["pool_size"] < config["train"]["group_size"]:
        raise ConfigError(
            f"config key 'env.pool_size': {config['env']['pool_size']} is smaller than train.group_size="
            f"{config['train']['group_size']} (a GRPO group runs its sessions in lockstep)"
        )
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


def load_config(path: Path, overrides: dict | None = None) -> dict:
    """Load a YAML config, apply ``overrides`` (dotted keys), validate, return it."""
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML ({exc})") from exc
    for dotted, value in (overrides or {}).items():
        node = config
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    validate_schema(config)
    return check_cross_fields(config)


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
