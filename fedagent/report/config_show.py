"""``fedagent config show``: the effective config of a run, as YAML, with where each value came from.

    fedagent config show [--configfile F ...] [--set KEY=VALUE ...]

Layers exactly as ``snakemake [--configfile F ...] [--config KEY=VALUE ...]`` builds them:
the schema's defaults, then the workflow's ``config/config.yaml`` (its ``configfile:``), then
each ``--configfile`` in order, then the command line; dicts merge key by key, anything else
is replaced. ``--set`` takes what ``--config`` takes (``--set "train={lr: 1.0e-6}"``, parsed
the way Snakemake parses it and coerced to the schema's types the way the workflow does) and
also dotted keys (``--set train.lr=1.0e-6``). The result is checked like a plan (schema +
cross rules); every value that differs from the schema default carries a ``# <source>``
comment: the file it came from, or ``command line``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Mapping

import yaml

from fedagent.core.config import (
    ConfigError,
    load_file,
    merge_into,
    prepare_config,
    schema,  # noqa: F401 - re-exported
    set_path,
    subschema,
)

REPO = Path(__file__).resolve().parents[2]
WORKFLOW_CONFIG = Path("config") / "config.yaml"  # the Snakefile's `configfile:` (relative to the workdir)
COMMAND_LINE = "command line"


def _bool(value: str) -> bool:
    if value in ("True", "False"):
        return value == "True"
    raise ValueError(value)


def parse_cli_value(text: str) -> Any:
    """A ``--config`` value as Snakemake parses it: int, float, True/False, else YAML BaseLoader (strings)."""
    for parser in (int, float, _bool, lambda s: yaml.load(s, Loader=yaml.BaseLoader)):
        try:
            value = parser(text)
        except Exception:  # noqa: BLE001 - Snakemake tries each parser the same way
            continue
        if value is not None and not callable(value):
            return value
    return text


def parse_sets(items: list[str]) -> dict:
    """``KEY=VALUE`` items → the nested dict ``--config`` would give (dotted keys nested)."""
    cli: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        parsed = None if value == "" else parse_cli_value(value)
        if "." in key:
            nested: dict = {}
            set_path(nested, key, parsed)
            merge_into(cli, nested)
        else:
            merge_into(cli, {key: parsed})
    return cli


def _leaves(d: Mapping, prefix: str = "") -> list[str]:
    out = []
    for key, value in d.items():
        path = f"{prefix}{key}"
        out += _leaves(value, path + ".") if isinstance(value, Mapping) and value else [path]
    return out


def effective_config(base: Path | None, configfiles: list[Path], sets: list[str]) -> tuple[dict, dict[str, str]]:
    """The checked config and, for every key a layer set, the layer's name (last one wins)."""
    config: dict = {}
    source: dict[str, str] = {}
    layers = [(str(p), load_file(p)) for p in ([base] if base else []) + list(configfiles)]
    cli = parse_sets(sets)
    layers.append((COMMAND_LINE, cli))
    for name, data in layers:
        merge_into(config, data)
        for leaf in _leaves(data):
            source[leaf] = name
    prepare_config(config, cli)
    return config, source


def _scalar(value: Any) -> str:
    """One value as YAML flow text (round-trips through yaml.safe_load)."""
    text = yaml.safe_dump([value], default_flow_style=True, width=10**9).strip()
    return text[1:-1]


def _schema_default(path: str) -> Any:
    sub = subschema(path)
    return KeyError if sub is None else sub.get("default", KeyError)


def render(config: Mapping, source: Mapping[str, str]) -> str:
    """YAML of ``config`` in schema order; ``# <source>`` beside every value that is not the default."""
    lines: list[str] = []

    def origin(path: str) -> str | None:
        probe = path
        while probe:
            if probe in source:
                return source[probe]
            probe = probe.rpartition(".")[0]
        return None

    def emit(node: Mapping, prefix: str, indent: int, schema: Mapping) -> None:
        props = schema.get("properties", {})
        order = [k for k in props if k in node] + sorted(k for k in node if k not in props)
        for key in order:
            value, path = node[key], f"{prefix}{key}"
            pad = "  " * indent
            if isinstance(value, Mapping) and value:
                lines.append(f"{pad}{_scalar(key)}:")
                emit(value, path + ".", indent + 1, props.get(key, {}))
                continue
            text = f"{pad}{_scalar(key)}: {_scalar(value)}"
            default = _schema_default(path)
            if default is KeyError or default != value or type(default) is not type(value):
                text = f"{text:<40} # {origin(path) or 'no default'}"
            lines.append(text)

    emit(config, "", 0, schema())
    return "\n".join(lines) + "\n"


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent config``."""
    parser.add_argument("action", choices=["show"], help="show: print the effective config")
    parser.add_argument(
        "--configfile",
        type=Path,
        action="append",
        default=[],
        metavar="F",
        help="a config file layered over the workflow's (as snakemake --configfile); repeatable",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a command-line value (as snakemake --config; dotted keys too), e.g. "
        "--set 'train={lr: 1.0e-6}' or --set rounds=70",
    )
    parser.add_argument(
        "--base",
        type=Path,
        default=None,
        help=f"the workflow's own config file (default: ./{WORKFLOW_CONFIG} if present, "
        "else the installed workflow's); 'none' for defaults only",
    )


def resolve_base(base: Path | None) -> Path | None:
    """``--base``: the workflow's own config file (./config/config.yaml, else the installed workflow's;
    None if neither), a given file, or None for 'none' (schema defaults only)."""
    if base is None:
        found = WORKFLOW_CONFIG if WORKFLOW_CONFIG.is_file() else REPO / WORKFLOW_CONFIG
        return found if found.is_file() else None
    return None if str(base).lower() == "none" else base


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent config show``."""
    base = resolve_base(args.base)
    try:
        config, source = effective_config(base, args.configfile, args.set)
    except ConfigError as exc:
        print(f"fedagent: invalid config: {exc}", file=sys.stderr)
        return 2
    layers = " < ".join(
        ["schema defaults", *(str(p) for p in ([base] if base else []) + args.configfile), COMMAND_LINE]
    )
    sys.stdout.write(f"# effective config ({layers}); '# <source>' marks each value that is not the default\n")
    sys.stdout.write(render(config, source))
    return 0
