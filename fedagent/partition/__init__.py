"""Task-data partitions: which train tasks each client owns (deterministic, recomputable).

``partition.json`` = {strategy, n_clients, clients: {"<id>": [task ids]}, sha256}; the
sha256 covers the canonical JSON of the assignment, so two runs can be compared at a glance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from fedagent.atomic import atomic_write_json
from fedagent.config import JobKeys
from fedagent.partition.uniform import uniform_slices
from fedagent.tasks import games_kind, load_games_index

STRATEGIES = ("uniform",)


def assignment_sha256(clients: dict[str, list[str]]) -> str:
    """Hash of the canonical JSON of a client → tasks assignment."""
    return hashlib.sha256(json.dumps(clients, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def partition_tasks(task_ids: list[str], n_clients: int, strategy: str, min_tasks: int,
                    kind: str = "textworld") -> dict[str, list[str]]:
    """Assign the canonical train task list to ``n_clients`` clients (``kind``: the env's)."""
    PARTITION_KEYS.check({"n_clients": n_clients, "strategy": strategy, "min_tasks": min_tasks,
                          "n_tasks": len(task_ids), "kind": kind})
    if strategy not in STRATEGIES:
        raise ValueError(f"partition.strategy {strategy!r} is not one of {STRATEGIES}")
    slices = uniform_slices(len(task_ids), n_clients, min_tasks)
    return {str(c): list(task_ids[a:b]) for c, (a, b) in enumerate(slices)}


# The catalogue's real size stands for env.train_games: the cross rules then check against it.
PARTITION_KEYS = JobKeys("partition", {"n_clients": "clients.total", "strategy": "partition.strategy",
                                       "min_tasks": "partition.min_tasks_per_client", "n_tasks": "env.train_games",
                                       "kind": "env.kind"})


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent partition``."""
    parser.add_argument("--games", type=Path, required=True)
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--strategy", default="uniform", choices=STRATEGIES)
    parser.add_argument("--min-tasks", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent partition``: writes partition.json."""
    index = load_games_index(args.games)
    clients = partition_tasks(index["train"], args.clients, args.strategy, args.min_tasks,
                              kind=games_kind(args.games))
    atomic_write_json(args.out, {
        "strategy": args.strategy,
        "n_clients": args.clients,
        "min_tasks_per_client": args.min_tasks,
        "games_sha256": index["sha256"],
        "clients": clients,
        "sha256": assignment_sha256(clients),
    })
    return 0
