"""The fixed validation set: seeds 0..n-1 mapped onto the validation tasks, same every round."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedagent.core.atomic import atomic_write_json
from fedagent.core.config import JobKeys
from fedagent.plan.tasks import games_kind, load_games_index


def build_val_set(val_tasks: list[str], n: int, kind: str = "textworld") -> dict:
    """Seeds 0..n-1 and the task each selects (index mode: tasks[seed % len]).

    ``n`` larger than the pool is refused (the cross rule on ``eval.n``, with the real pool size
    standing for the env kind's pool key): repeats would pass for independent draws."""
    VAL_SET_KEYS.check({"n": n, "kind": kind, "pool": len(val_tasks), "webshop_pool": len(val_tasks)})
    seeds = list(range(n))
    return {"tasks": list(val_tasks), "seeds": seeds, "task_of_seed": [val_tasks[s % len(val_tasks)] for s in seeds]}


# The real pool size stands for both pool keys (the rule reads the one of the env's kind).
VAL_SET_KEYS = JobKeys(
    "val-set", {"n": "eval.n", "kind": "env.kind", "pool": "env.val_games", "webshop_pool": "env.webshop.val_goals"}
)


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent val-set``."""
    parser.add_argument("--games", type=Path, required=True)
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent val-set``: writes val_set.json."""
    index = load_games_index(args.games)
    payload = build_val_set(index["val"], args.n, kind=games_kind(args.games))
    payload["games_sha256"] = index["sha256"]
    atomic_write_json(args.out, payload)
    return 0
