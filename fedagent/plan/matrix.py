"""An experiment matrix: every arm × seed of one base preset, each its own run (``config/matrices/<name>.yaml``).

A matrix file::

    base: config/experiments/gpu-textworld.yaml   # the preset every arm overlays (itself over config/config.yaml)
    seeds: [42, 21, 84]                           # `seed` of each run (default: the reference's 42, 21, 84)
    reference: uniform                            # the arm every other is compared with (default: the first)
    common: {rounds: 10}                          # keys set for every arm (optional)
    arms:                                         # name → overlay (any config keys but run, results_dir, seed)
      uniform: {}
      hardness-xi1: {partition: {strategy: hardness, success_std: 1.0, labels_model: random}}

``snakemake --profile profiles/local --config matrix=<name>`` runs it (``workflow/matrix.smk``): each
(arm, seed) is the ordinary round graph, loaded as a Snakemake module with its own config, writing
``<results_dir>/<matrix>/<arm>/seed_<seed>/``, so caching, resume, ``-n`` and ``fedagent status`` work
per run, and a new seed or arm adds only its own jobs. A run's config is, dicts merged key by key
(Snakemake's rule): ``config/config.yaml`` < ``base`` < ``common`` < the arm < the command line's other
``--config`` keys (e.g. ``rounds=12`` for every run) < {seed, run, results_dir}.

Runs whose task catalogue is the same (same data_seed and the keys that make it) read one shared copy,
``<results_dir>/<matrix>/_catalogue/<key>/plan/games``, built once (its own module with only the
catalogue rule): ``data_seed`` (not ``seed``) drives plan/, so seeds and most arms share the tasks, the
validation set and, for a partition, its shards only where ``data_seed`` and the partition agree.

Nothing heavy is imported: the workflow calls this while parsing.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from fedagent.core import envs
from fedagent.core.config import ConfigError, load_file, merge_into, prepare_config
from fedagent.core.registry import ADVANTAGE_ESTIMATORS

MATRIX_DIR = Path("config") / "matrices"
DEFAULT_SEEDS = (42, 21, 84)  # the reference's three seeds (FACTS §9)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
RESERVED = ("run", "results_dir", "seed")  # set per run by the matrix, never by an arm
FILE_KEYS = ("base", "seeds", "reference", "common", "arms", "description")
CATALOGUE_DIR = "_catalogue"
START_DIR = "_start"
# Config keys that only the training rounds (1, 2, ...) read, as dotted paths: runs whose configs agree
# on everything else build the same round 0 (base model, warm start, validation set, round-0 evals) and
# share one (`start`), except the keys ROUND0_READS names inside these sections.
TRAINING_ONLY = (
    "rounds",
    "aggregate",
    "byzantine",
    "server",
    "keep",
    "clients.per_round",
    "clients.min_per_round",
    "clients.retries",
    "clients.pinned",
    "partition",
    "train",
)  # and each env's training_only_keys (fedagent.core.envs.EnvSpec: WebShop's arm knobs)
# ... read by round 0 all the same: the demo pool (clients.total is kept whole; the shards' minimum),
# the warm start (train's budgets, micro-batch and device), PPO's round-0 critic (algorithm, as the
# estimator whose round 0 it builds: round0_like; ppo).
ROUND0_READS = (
    "partition.min_tasks_per_client",
    "train.micro_batch_size",
    "train.max_turns",
    "train.max_prompt_tokens",
    "train.device",
    "train.threads",
    "train.algorithm",
    "train.ppo",
)


@dataclass(frozen=True)
class MatrixRun:
    """One (arm, seed) of a matrix: its validated config and where it writes."""

    arm: str
    seed: int
    config: dict = field(repr=False)

    @property
    def run_dir(self) -> str:
        return f"{self.config['results_dir']}/{self.config['run']}"

    @property
    def module(self) -> str:
        """A Python identifier naming the run's Snakemake module (and its rules' prefix)."""
        return f"{re.sub(r'[^A-Za-z0-9]', '_', self.arm)}__s{self.seed}"


@dataclass(frozen=True)
class Matrix:
    name: str
    path: Path
    out_dir: str  # <results_dir>/<matrix>
    reference: str
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    runs: tuple[MatrixRun, ...]
    catalogues: Mapping[str, dict]  # key → the config of the module that builds that catalogue
    starts: Mapping[str, dict] = field(default_factory=dict)  # key → the config of a shared round 0's module

    def last_round_summary(self, run: MatrixRun) -> str:
        return f"{run.run_dir}/round_{run.config['rounds']:03d}/summary.csv"

    def last_round_eval(self, run: MatrixRun) -> str:
        return f"{run.run_dir}/round_{run.config['rounds']:03d}/eval.json"

    def start_eval(self, run: MatrixRun) -> str:
        """Round 0's eval.json (the base model's, or the warm start's; a shared start's copy)."""
        return f"{run.run_dir}/round_000/eval.json"

    def last_round_points(self, run: MatrixRun) -> str:
        return f"{run.run_dir}/round_{run.config['rounds']:03d}/points.csv"

    def matrix_trackers(self) -> list[str]:
        """The runs' ``report.trackers`` that keep one store for the whole matrix (in the runs' order)."""
        from fedagent.core.registry import TRACKERS

        names = dict.fromkeys(t for r in self.runs for t in r.config["report"]["trackers"])
        return [t for t in names if TRACKERS[t].matrix]


def matrix_path(name: str, root: Path | str = ".") -> Path:
    """``config/matrices/<name>.yaml`` (or ``name`` itself when it is a path to a .yaml file)."""
    if name.endswith((".yaml", ".yml")):
        return Path(root) / name
    if not NAME.match(name):
        raise ConfigError(f"matrix: {name!r} is not a matrix name (letters, digits, '_', '.', '-')")
    return Path(root) / MATRIX_DIR / f"{name}.yaml"


def catalogue_settings(config: Mapping) -> dict:
    """The config keys that make a run's task catalogue (its games rule; the kind's spec says which), as a nested dict."""
    env = config["env"]
    kind = env["kind"]
    made_of = envs.spec(kind).catalogue_keys(env)
    return {"data_seed": config["data_seed"], "env": {"kind": kind, **made_of}}


def catalogue_key(config: Mapping) -> str:
    """The catalogue's settings hashed: runs with the same key read one shared catalogue."""
    settings = catalogue_settings(config)
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return f"{settings['env']['kind']}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def _get(config: Mapping, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def training_only() -> tuple[str, ...]:
    """:data:`TRAINING_ONLY` and every registered env's keys only training reads."""
    return TRAINING_ONLY + tuple(k for spec in envs.specs() for k in spec.training_only_keys)


def start_settings(config: Mapping) -> dict:
    """The run's config without what only the training rounds read (:data:`TRAINING_ONLY`, less
    :data:`ROUND0_READS`) and without its name and place: what its round 0 is made of."""
    settings = {k: copy.deepcopy(v) for k, v in config.items() if k not in ("run", "results_dir", "start")}
    for dotted in training_only():
        *parents, leaf = dotted.split(".")
        node = settings
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    for dotted in ROUND0_READS:
        value = _get(config, dotted)
        if value is not None:
            *parents, leaf = dotted.split(".")
            node = settings
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = copy.deepcopy(value)
    # train.micro_batch_tokens: the warm start's micro-batches too, so only where a warm start runs (the keys of
    # runs without it stay as they were, and arms that differ only in it share one round 0).
    if config.get("warm_start", {}).get("enabled") and _get(config, "train.micro_batch_tokens") is not None:
        settings.setdefault("train", {})["micro_batch_tokens"] = _get(config, "train.micro_batch_tokens")
    train = settings.get("train")
    if isinstance(train, dict) and "algorithm" in train:
        # What round 0 is built for, not the estimator's name: a GiGPO run's round 0 is a GRPO run's
        # (no critic), so arms of the two share one start (fedagent.train.advantages, round0_like).
        train["algorithm"] = ADVANTAGE_ESTIMATORS[train["algorithm"]].round0_like
    return settings


def start_key(config: Mapping) -> str:
    """Round 0's settings hashed (seed first): runs with the same key start from one shared round 0."""
    blob = json.dumps(start_settings(config), sort_keys=True, separators=(",", ":"), default=str)
    return f"seed{config['seed']}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def _check_overlay(where: str, overlay) -> dict:
    if overlay is None:
        return {}
    if not isinstance(overlay, dict):
        raise ConfigError(f"{where}: expected a mapping of config keys, got {type(overlay).__name__}")
    bad = [k for k in RESERVED if k in overlay]
    if bad:
        raise ConfigError(f"{where}: '{bad[0]}' is set per run by the matrix (arm and seed), not by an arm")
    return overlay


def _validated(where: str, config: dict, cli: Mapping) -> dict:
    try:
        prepare_config(config, cli)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return config


def load_matrix(name: str, defaults: Mapping, cli: Mapping | None = None, root: Path | str = ".") -> Matrix:
    """Expand matrix ``name`` into its runs' validated configs.

    ``defaults``: the workflow's config before any matrix (``config/config.yaml`` with the command line's
    keys merged, as Snakemake built it; its ``matrix`` key is dropped); ``cli``: the command line's
    ``--config`` keys (``matrix`` among them), layered over every run. Any problem → one ConfigError
    naming the matrix file and the arm or key.
    """
    path = matrix_path(name, root)
    spec = load_file(path) if path.is_file() else None
    if spec is None:
        raise ConfigError(f"matrix: {path} does not exist (config/matrices/<name>.yaml)")
    where = str(path)
    unknown = sorted(set(spec) - set(FILE_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}' (a matrix has {', '.join(FILE_KEYS)})")
    name = path.stem
    cli = {k: v for k, v in (cli or {}).items() if k != "matrix"}
    bad = [k for k in ("run", "seed") if k in cli]  # results_dir: where the whole matrix goes
    if bad:
        raise ConfigError(f"--config {bad[0]}=...: set per run by matrix {name} (its seeds and arms), not for all runs")

    base = {k: v for k, v in copy.deepcopy(dict(defaults)).items() if k != "matrix"}
    # The command line's keys were merged into `defaults` by Snakemake: they are re-applied last below.
    if spec.get("base") is not None:
        base_path = Path(root) / spec["base"]
        try:
            merge_into(base, load_file(base_path))
        except ConfigError as exc:
            raise ConfigError(f"{where}: base: {exc}") from None
    merge_into(base, _check_overlay(f"{where}: common", spec.get("common")))

    arms = spec.get("arms")
    if not isinstance(arms, dict) or not arms:
        raise ConfigError(f"{where}: arms: expected a non-empty mapping of arm name → config overlay")
    for arm in arms:
        # NAME's first character is a letter or digit, so an arm never collides with _catalogue/_start
        if not isinstance(arm, str) or not NAME.match(arm):
            raise ConfigError(
                f"{where}: arm {arm!r}: not a valid name (letters, digits, '_', '.', '-'; "
                "starting with a letter or digit)"
            )
    seeds = spec.get("seeds", list(DEFAULT_SEEDS))
    if (
        not isinstance(seeds, list)
        or not seeds
        or any(type(s) is not int or s < 0 for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise ConfigError(f"{where}: seeds: expected a list of distinct non-negative integers, got {seeds!r}")
    reference = spec.get("reference", next(iter(arms)))
    if reference not in arms:
        raise ConfigError(f"{where}: reference: {reference!r} is not one of the arms ({', '.join(arms)})")

    results_dir = base.get("results_dir", "results")
    out_dir = f"{results_dir}/{name}"
    runs, modules = [], set()
    for arm, overlay in arms.items():
        overlay = _check_overlay(f"{where}: arm {arm}", overlay)
        for seed in seeds:
            cfg = merge_into(copy.deepcopy(base), overlay)
            merge_into(cfg, cli)
            merge_into(cfg, {"seed": seed, "run": f"seed_{seed}", "results_dir": f"{out_dir}/{arm}"})
            run = MatrixRun(arm, seed, _validated(f"{where}: arm {arm}, seed {seed}", cfg, cli))
            if run.module in modules:
                raise ConfigError(f"{where}: arm {arm!r}: its name clashes with another arm's once made an identifier")
            modules.add(run.module)
            runs.append(run)

    # One shared catalogue per distinct catalogue key: its module's config is the base's (never an arm's,
    # so adding or reordering arms never changes its params) with the key's catalogue settings.
    catalogues: dict[str, dict] = {}
    for run in runs:
        key = catalogue_key(run.config)
        if key not in catalogues:
            cat = merge_into(copy.deepcopy(base), cli)
            merge_into(cat, catalogue_settings(run.config))
            merge_into(cat, {"seed": seeds[0], "run": key, "results_dir": f"{out_dir}/{CATALOGUE_DIR}"})
            # only the catalogue rule is used from this module: keep its other sections the base's (valid)
            catalogues[key] = _validated(f"{where}: catalogue of arm {run.arm}", cat, cli)
        run.config["catalogue"] = f"{out_dir}/{CATALOGUE_DIR}/{key}/plan/games"

    # One shared round 0 per distinct start key (the seed among its settings): its module's config is
    # the first run's with that key (the reference arm's when it has it), as a run of its own under
    # _start/<key>/ of which only round 0 is ever asked for; the runs copy it (rules/start.smk).
    starts: dict[str, dict] = {}
    ordered = sorted(runs, key=lambda r: r.arm != reference)  # stable: the reference arm's runs first
    for run in ordered:
        key = start_key(run.config)
        if key not in starts:
            st = copy.deepcopy(run.config)
            st.update(run=key, results_dir=f"{out_dir}/{START_DIR}")
            starts[key] = st
        run.config["start"] = f"{out_dir}/{START_DIR}/{key}"
    return Matrix(
        name=name,
        path=path,
        out_dir=out_dir,
        reference=reference,
        arms=tuple(arms),
        seeds=tuple(seeds),
        runs=tuple(runs),
        catalogues=catalogues,
        starts=starts,
    )
