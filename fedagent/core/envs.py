"""The environment registry: env kind → its :class:`EnvSpec`, resolved lazily by name.

An environment is one package, ``fedagent/envs/<name>/``, whose ``spec`` module holds one
:class:`EnvSpec`. The built-ins are listed in :data:`BUILTIN` (one line each); any other
distribution adds one with an entry point in the group :data:`ENTRY_POINT_GROUP`::

    [fedagent.envs]
    toy = toyenv.spec:SPEC

The registry lives in ``core`` because the layers below ``envs`` (config checks, plan, rollout)
ask it what an env kind needs; it imports a spec by its ``"module:attr"`` string only when asked
(importlib), so no lower layer imports ``fedagent.envs`` statically (docs/how-to/add-an-environment.md).
Entry points are read from the installed distributions on ``sys.path`` each time the known kinds
are listed, so a ``*.dist-info`` directory on ``PYTHONPATH`` registers an env for the Snakemake
jobs too; a spec and a prompt family, once found, are kept for the process.

Not a :class:`fedagent.core.registry.Registry`, whose pattern it shares: a Registry holds classes keyed
by their ``name``, imports its home module and every entry point on first read and keeps them, and
names an unknown one in a KeyError. Here the values are :class:`EnvSpec` objects keyed by ``kind``;
listing the kinds (the schema's enum, ``serve-env --source``) imports no spec, :func:`spec` imports only
the kind asked for (a broken plugin fails only where its kind is used), the entry points are read anew
at each listing, a built-in shadows a plugin of its name, and every refusal is a ConfigError naming
``env.kind``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable, Mapping

from fedagent.core.errors import ConfigError

ENTRY_POINT_GROUP = "fedagent.envs"
# The built-in environments: kind → "module:attr" of its EnvSpec.
BUILTIN: dict[str, str] = {
    "textworld": "fedagent.envs.textworld.spec:SPEC",
    "alfworld": "fedagent.envs.alfworld.spec:SPEC",
    "webshop": "fedagent.envs.webshop.spec:SPEC",
}
# The kind of a task directory whose games.json names none (TextWorld's catalogues predate the key).
UNNAMED_CATALOGUE_KIND = "textworld"


def no_env_params(config: Mapping) -> None:
    """An env without per-client knobs (the default :attr:`EnvSpec.client_env_params`)."""
    return None


@dataclass(frozen=True)
class EnvSpec:
    """Everything the rest of fedagent needs to know about one environment kind.

    Parameters
    ----------
    kind
        The ``env.kind`` value that selects it.
    source
        ``"module:attr"`` of ``open_source(games, split, *, tasks, env_params, client_id)`` →
        ``(TaskSource, split)``: the tasks an env service serves from a catalogue directory, and
        the split name those tasks carry in that source (``--all``).
    catalogue
        ``"module"`` of the CLI (``add_args``/``run``) that builds ``plan/games``; the one
        ``games`` rule calls it through ``fedagent catalogue --kind <kind>``.
    catalogue_args
        config → the catalogue command's flags (everything but ``--out``, ``--jobs``,
        ``--quarantine``): only what changes the catalogue, so the rule re-runs on nothing else.
    catalogue_jobs
        whether the catalogue command takes ``--jobs`` (the rule's threads).
    catalogue_keys
        env config → the part of ``env`` that makes the catalogue (a matrix shares one copy
        between runs whose parts are equal).
    prompt_templates
        prompt family name → ``"module:attr"`` of its template object (``windowed``,
        ``concat_turn``, ``fallback_chars``); a source names its family in ``prompt_template``.
    schema
        JSON-schema properties the env adds under ``env`` (merged at validation time).
    cross_rules
        :class:`fedagent.core.config_rules.CrossRule` objects over the env's keys (every job
        carrying their keys applies them, as the core rules).
    check
        config → None, the env's checks the schema cannot express (ConfigError naming the key).
    val_pool_key, train_games_sized
        the config key sizing the validation / train pool (``train_pool_key`` None: the catalogue
        decides it, the demo pool checks against the built catalogue).
    single_task_type, scene_ids, labels_expert
        what the partition strategies need: one task type only (no ``preference``), scene ids
        (``env_disjoint``), a noisy expert for hardness labels (``"module:attr"`` of
        ``labels(games, tasks, p, max_turns, base_seed)``).
    client_env_params
        config → one training client's env knobs (JSON object for ``--env-params``) or None.
    training_only_keys
        the env's keys only training reads (a matrix's arms may differ in them and share round 0).
    preload
        modules a warm fork server imports for this env's services.
    commands
        the env's own ``fedagent`` commands: name → (module, one-line help).
    """

    kind: str
    source: str
    catalogue: str
    catalogue_args: Callable[[Mapping], str]
    catalogue_keys: Callable[[Mapping], dict]
    catalogue_jobs: bool = False
    prompt_templates: Mapping[str, str] = field(default_factory=dict)
    schema: Mapping[str, Any] = field(default_factory=dict)
    cross_rules: tuple = ()
    check: Callable[[dict], None] | None = None
    val_pool_key: str = "env.val_games"
    train_games_sized: bool = True
    single_task_type: bool = False
    scene_ids: bool = False
    labels_expert: str | None = None
    client_env_params: Callable[[Mapping], dict | None] = no_env_params
    training_only_keys: tuple[str, ...] = ()
    preload: tuple[str, ...] = ()
    commands: Mapping[str, tuple[str, str]] = field(default_factory=dict)


def takes_env_params(spec: EnvSpec) -> bool:
    """Whether a kind's services take per-client env knobs (``--env-params``)."""
    return spec.client_env_params is not no_env_params


def resolve(target: str) -> Any:
    """The object a ``"module:attr"`` string names (the module imported now)."""
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def registered() -> dict[str, str]:
    """kind → ``"module:attr"`` of every known env: the built-ins, then the entry points by name."""
    plugins = _entry_points()
    return {**BUILTIN, **{k: plugins[k] for k in sorted(plugins) if k not in BUILTIN}}


def kinds() -> tuple[str, ...]:
    """The known env kinds (built-ins first)."""
    return tuple(registered())


_SPECS: dict[str, EnvSpec] = {}


def spec(kind: str) -> EnvSpec:
    """The :class:`EnvSpec` of ``kind``; a ConfigError naming ``env.kind`` and the known kinds if none."""
    if kind not in _SPECS:
        known = registered()
        if kind not in known:
            raise ConfigError(f"config key 'env.kind': {kind!r} is not a known environment (known: {list(known)})")
        found = resolve(known[kind])
        if not isinstance(found, EnvSpec) or found.kind != kind:
            raise ConfigError(f"config key 'env.kind': {known[kind]} is not the EnvSpec of {kind!r}")
        _SPECS[kind] = found
    return _SPECS[kind]


def specs() -> list[EnvSpec]:
    """Every known env's spec (each spec module imported)."""
    return [spec(k) for k in kinds()]


# A prompt family once found is kept for the process, as a spec is (:data:`_SPECS`): the rollout loop asks for
# its family at every prompt of every turn, and listing the kinds reads every installed distribution's entry
# points (≈ 6 ms on the 2-core machine: 0.43 of the 1.06 s between two 64-row generation calls of an ALFWorld
# rollout, bench/rollout_host.py). A name not found yet is still looked up anew, so a plugin added since is seen.
_TEMPLATES: dict[str, Any] = {}


def prompt_template(name: str) -> Any:
    """The template object of the prompt family ``name`` (any env may declare one); ValueError if none."""
    if name in _TEMPLATES:
        return _TEMPLATES[name]
    for s in specs():
        if name in s.prompt_templates:
            _TEMPLATES[name] = resolve(s.prompt_templates[name])
            return _TEMPLATES[name]
    raise ValueError(f"prompt_template must be one of {prompt_template_names()}, got {name!r}")


def prompt_template_names() -> tuple[str, ...]:
    """Every declared prompt family, in registry order."""
    return tuple(name for s in specs() for name in s.prompt_templates)
