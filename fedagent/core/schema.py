"""The config's JSON schema and its single-key checks: navigation by dotted key, command-line
strings coerced to the schema's types, validation with defaults filled in (jsonschema).

Part of :mod:`fedagent.core.config` (which re-exports these names); nothing heavy is imported.
"""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path
from typing import Any, Mapping

import yaml

from fedagent.core import envs
from fedagent.core.errors import ConfigError

_PKG_SCHEMA = Path(__file__).resolve().parent / "config.schema.yaml"  # symlink into workflow/ (package data)
_REPO_SCHEMA = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"
SCHEMA_PATH = _PKG_SCHEMA if _PKG_SCHEMA.is_file() else _REPO_SCHEMA
MODEL_KEYWORDS = ("smollm2", "tiny")


def load_schema(path: Path = SCHEMA_PATH) -> dict:
    """The config JSON schema (YAML on disk). Parsed by libyaml where PyYAML was built with it (the same
    document, ~10x faster than the pure-Python parser: every process that loads the config reads it)."""
    text = Path(path).read_text()
    if hasattr(yaml, "CSafeLoader"):  # the safe loader, in C (tests/test_security.py's scan names the loader)
        return yaml.load(text, Loader=yaml.CSafeLoader)
    return yaml.safe_load(text)


def with_env_fragments(base: dict) -> dict:
    """``base`` with every registered environment's keys under ``env`` and ``env.kind`` limited to the known kinds.

    The file's ``env`` section holds the keys every environment shares; each env package adds its
    own (:attr:`fedagent.core.envs.EnvSpec.schema`), so a new env edits no file outside its package."""
    merged = copy.deepcopy(base)
    env = merged["properties"]["env"]
    for spec in envs.specs():
        clash = set(spec.schema) & set(env["properties"])
        if clash:
            raise ConfigError(f"config key 'env.{sorted(clash)[0]}': declared twice (env {spec.kind!r})")
        env["properties"].update(copy.deepcopy(dict(spec.schema)))
    env["properties"]["kind"]["enum"] = list(envs.kinds())
    env["additionalProperties"] = False
    return merged


@functools.lru_cache(maxsize=None)
def _schema() -> dict:
    from fedagent.core.registry import extend_schema  # the registered classes' keys (x-registry sections)

    return extend_schema(with_env_fragments(load_schema()))


def schema() -> dict:
    """The workflow's schema with the environments' keys, built once per process (do not modify it)."""
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
            types.add(
                {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}.get(
                    type(v), "string"
                )
            )
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
    want = " or ".join(
        {
            "integer": "an integer",
            "number": "a number",
            "boolean": "a boolean (true/false)",
            "null": "null",
            "object": 'a mapping (--config "key={a: 1}")',
            "array": "a list",
        }.get(t, t)
        for t in sorted(types)
    )
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
            config[name] = [
                coerce_scalar(f"{path}[{i}]", v, types) if isinstance(v, str) else v for i, v in enumerate(config[name])
            ]
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
