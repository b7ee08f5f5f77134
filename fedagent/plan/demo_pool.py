"""The warm start's demo pool: train-catalogue tasks set aside for expert demonstrations.

``plan/demo_pool.json`` = {n, data_seed, games_sha256, tasks: [ids]}: ``n`` tasks of the
catalogue's train split, drawn with ``python_rng(data_seed, "demo_pool")`` (a function of the
catalogue and the data seed only, like everything under plan/). ``fedagent partition --exclude``
takes them out before any client gets a shard, and validation tasks are another split, so a
demonstration never shows the policy a task it is trained or scored on
(:mod:`fedagent.train.warm_start` plays them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedagent.core import envs
from fedagent.core.atomic import atomic_write_json
from fedagent.core.config import JobKeys
from fedagent.core.seeds import python_rng
from fedagent.plan.tasks import load_games_index

# The catalogue's real size stands for env.train_games (as in the partition job): the cross rule
# that keeps the clients their tasks is checked against it.
DEMO_POOL_KEYS = JobKeys(
    "demo-pool",
    {
        "n": "warm_start.demos",
        "enabled": "warm_start.enabled",
        "kind": "env.kind",
        "n_train": "env.train_games",
        "clients": "clients.total",
        "min_tasks": "partition.min_tasks_per_client",
    },
)


def check_job_keys(values: dict) -> None:
    """The demo-pool job's parameters checked as planning checked them (ConfigError naming the key)."""
    DEMO_POOL_KEYS.check(values)


def draw_demo_pool(
    train_tasks: list[str], n: int, data_seed: int, *, clients: int = 1, min_tasks: int = 1
) -> list[str]:
    """``n`` distinct tasks of ``train_tasks``, in catalogue order; the rest must still give
    ``clients`` clients ``min_tasks`` each (ConfigError naming warm_start.demos otherwise)."""
    check_job_keys(
        {
            "n": n,
            "enabled": True,
            "kind": envs.UNNAMED_CATALOGUE_KIND,  # a kind sized by env.train_games: the real count stands for it
            "n_train": len(train_tasks),
            "clients": clients,
            "min_tasks": min_tasks,
        }
    )
    if n >= len(train_tasks):
        raise ValueError(
            f"warm_start.demos={n} would take all {len(train_tasks)} train tasks of the catalogue "
            "(the clients need the rest)"
        )
    picked = set(python_rng(data_seed, "demo_pool").sample(range(len(train_tasks)), n))
    return [t for i, t in enumerate(train_tasks) if i in picked]


def load_demo_tasks(path: Path) -> list[str]:
    """The task ids of a ``demo_pool.json``."""
    return list(json.loads(Path(path).read_text())["tasks"])


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent demo-pool``."""
    parser.add_argument("--games", type=Path, required=True)
    parser.add_argument("--n", type=int, required=True, help="warm_start.demos")
    parser.add_argument("--seed", type=int, required=True, help="data_seed (never the run's seed)")
    parser.add_argument("--clients", type=int, default=1, help="clients.total (the rest must serve them all)")
    parser.add_argument("--min-tasks", type=int, default=1, help="partition.min_tasks_per_client")
    parser.add_argument("--out", type=Path, required=True)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent demo-pool``: writes demo_pool.json."""
    index = load_games_index(args.games)
    tasks = draw_demo_pool(list(index["train"]), args.n, args.seed, clients=args.clients, min_tasks=args.min_tasks)
    atomic_write_json(
        args.out, {"n": len(tasks), "data_seed": args.seed, "games_sha256": index["sha256"], "tasks": tasks}
    )
    return 0
