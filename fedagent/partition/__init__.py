"""Task-data partitions: which train tasks each client owns (deterministic, recomputable).

One module per strategy (``uniform``, ``preference``, ``coverage``, ``hardness``,
``task_disjoint``, ``env_disjoint``) over one toolbox (:mod:`.toolbox`: Beta sizing, overlap
assignment). A strategy is one global computation whose randomness comes from
``derive_seed(data_seed, "partition_<strategy>", ...)`` only, so the plan never depends on
the run's ``seed``, a process or a machine.

``partition.json`` = {strategy, n_clients, min_tasks_per_client, data_seed, knobs (the
strategy's own), games_sha256, catalogue_sha256 (sha256 of games.json: the game contents),
sizes, stats, clients: {"<id>": [task ids]}, sha256}; ``sha256`` covers the canonical JSON of
the assignment, so two runs can be compared at a glance.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import sys
from pathlib import Path

from fedagent.core import envs
from fedagent.core.atomic import atomic_write_json
from fedagent.core.config import JobKeys
from fedagent.partition.context import PartitionContext
from fedagent.partition.uniform import uniform_slices  # noqa: F401 - re-exported
from fedagent.plan.tasks import GAMES_INDEX, games_kind, load_games_index

STRATEGIES = ("uniform", "preference", "coverage", "hardness", "task_disjoint", "env_disjoint")
# The partition-config knobs each strategy reads (only these reach its job's params).
KNOBS = {
    "uniform": (),
    "task_disjoint": ("task_disjoint_slices",),
    "preference": ("omega", "fashion_ratio"),
    "coverage": ("coverage_std", "coverage_center", "coverage_high"),
    "hardness": ("success_std",),
    "env_disjoint": ("env_div", "fallback", "holdout_scenes"),
}


def assignment_sha256(clients: dict[str, list[str]]) -> str:
    """Hash of the canonical JSON of a client → tasks assignment."""
    return hashlib.sha256(json.dumps(clients, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def compute(
    ctx: PartitionContext, strategy: str, kind: str = envs.UNNAMED_CATALOGUE_KIND
) -> tuple[dict[str, list[str]], dict]:
    """(clients, stats) of ``strategy`` over ``ctx`` (``kind``: the env's, for its own rules on the catalogue size)."""
    PARTITION_KEYS.check(
        {
            "n_clients": ctx.n_clients,
            "strategy": strategy,
            "min_tasks": ctx.min_tasks,
            "n_tasks": len(ctx.task_ids),
            "kind": kind,
        }
    )
    if strategy not in STRATEGIES:
        raise ValueError(f"partition.strategy {strategy!r} is not one of {STRATEGIES}")
    module = importlib.import_module(f"fedagent.partition.{strategy}")
    return module.partition(ctx)


def partition_tasks(
    task_ids: list[str],
    n_clients: int,
    strategy: str,
    min_tasks: int,
    *,
    data_seed: int = 42,
    knobs: dict | None = None,
    task_types: dict | None = None,
    labels: dict | None = None,
    kind: str = envs.UNNAMED_CATALOGUE_KIND,
) -> dict[str, list[str]]:
    """Assign the canonical train task list to ``n_clients`` clients."""
    ctx = PartitionContext(list(task_ids), n_clients, min_tasks, data_seed, knobs or {}, task_types or {}, labels)
    return compute(ctx, strategy, kind)[0]


def load_labels(path: Path) -> dict[str, bool]:
    """task id → success from ``{"labels": {id: bool}}`` or the reference's trajectories schema.

    Reference schema: ``trajectories[*].task_info.task_id → traj_info.success`` (last wins).
    """
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and isinstance(data.get("labels"), dict):
        return {str(k): bool(v) for k, v in data["labels"].items()}
    if isinstance(data, dict) and isinstance(data.get("trajectories"), list):
        out = {}
        for tr in data["trajectories"]:
            tid = (tr.get("task_info") or {}).get("task_id")
            if tid is not None:
                out[str(tid)] = bool((tr.get("traj_info") or {}).get("success", False))
        return out
    raise ValueError(f"{path}: expected {{'labels': {{task id: bool}}}} or {{'trajectories': [...]}}")


def task_types_of(games_dir: Path, index: dict) -> dict[str, str]:
    """task id → type from games.json (``task_types`` map, else the pool's single ``task_type``)."""
    if isinstance(index.get("task_types"), dict):
        return dict(index["task_types"])
    return {t: str(index.get("task_type", "task")) for t in index["train"]}


# The catalogue's real size stands for env.train_games: the cross rules then check against it.
PARTITION_KEYS = JobKeys(
    "partition",
    {
        "n_clients": "clients.total",
        "strategy": "partition.strategy",
        "min_tasks": "partition.min_tasks_per_client",
        "n_tasks": "env.train_games",
        "kind": "env.kind",
    },
)


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent partition``."""
    parser.add_argument("--games", type=Path, required=True)
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--strategy", default="uniform", choices=STRATEGIES)
    parser.add_argument("--min-tasks", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42, help="data_seed (never the run's seed)")
    parser.add_argument("--knobs", default="{}", help="JSON object of the strategy's knobs")
    parser.add_argument("--labels", type=Path, default=None, help="hardness labels file")
    parser.add_argument(
        "--exclude",
        type=Path,
        default=None,
        help="demo_pool.json: train tasks kept out of every shard (the warm start's demos)",
    )
    parser.add_argument("--out", type=Path, required=True)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent partition``: writes partition.json."""
    index = load_games_index(args.games)
    knobs = json.loads(args.knobs)
    unknown = sorted(set(knobs) - set(KNOBS[args.strategy]))
    if unknown:
        print(f"fedagent partition: knobs {unknown} do not belong to strategy {args.strategy!r}", file=sys.stderr)
        return 2
    labels = None
    if args.strategy == "hardness":
        if args.labels is None:
            print("fedagent partition: strategy hardness needs --labels", file=sys.stderr)
            return 2
        labels = load_labels(args.labels)
    train = list(index["train"])
    excluded = None
    if args.exclude is not None:
        from fedagent.plan.demo_pool import load_demo_tasks

        excluded = set(load_demo_tasks(args.exclude))
        train = [t for t in train if t not in excluded]
    ctx = PartitionContext(
        train, args.clients, args.min_tasks, args.seed, knobs, task_types_of(args.games, index), labels
    )
    clients, stats = compute(ctx, args.strategy, kind=games_kind(args.games))
    if labels is not None:
        missing = stats.get("labels_missing", 0)
        if missing:  # counted and warned unconditionally (> 50 % is an error in the strategy)
            print(
                f"fedagent partition: WARNING {missing} of {len(ctx.task_ids)} train tasks have no "
                "label; counted as hard",
                file=sys.stderr,
            )
    atomic_write_json(
        args.out,
        {
            "strategy": args.strategy,
            "n_clients": args.clients,
            "min_tasks_per_client": args.min_tasks,
            "data_seed": args.seed,
            "knobs": knobs,
            "games_sha256": index["sha256"],
            "catalogue_sha256": hashlib.sha256((Path(args.games) / GAMES_INDEX).read_bytes()).hexdigest(),
            "labels_sha256": hashlib.sha256(args.labels.read_bytes()).hexdigest() if labels is not None else None,
            **({"excluded": sorted(excluded)} if excluded is not None else {}),
            "sizes": {c: len(ts) for c, ts in clients.items()},
            "stats": stats,
            "clients": clients,
            "sha256": assignment_sha256(clients),
        },
    )
    return 0
