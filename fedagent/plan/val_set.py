"""The fixed validation set: seeds 0..n-1 mapped onto the validation tasks, same every round."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedagent.core.atomic import atomic_write_json
from fedagent.core import envs
from fedagent.core.config import JobKeys
from fedagent.core.config_rules import val_pool_key, val_pool_keys
from fedagent.plan.tasks import games_kind, load_games_index


def build_val_set(val_tasks: list[str], n: int, kind: str = envs.UNNAMED_CATALOGUE_KIND) -> dict:
    """Seeds 0..n-1 and the task each selects (index mode: tasks[seed % len]).

    ``n`` larger than the pool is refused (the cross rule on ``eval.n``, with the real pool size
    standing for the env kind's pool key): repeats would pass for independent draws."""
    VAL_SET_KEYS.check({"n": n, "kind": kind, **{name: len(val_tasks) for name in POOL_PARAMS}})
    seeds = list(range(n))
    return {"tasks": list(val_tasks), "seeds": seeds, "task_of_seed": [val_tasks[s % len(val_tasks)] for s in seeds]}


# The real pool size stands for every env's pool key (the rule reads the one of the env's kind).
POOL_PARAMS = {key.removeprefix("env.").replace(".", "_"): key for key in val_pool_keys()}


def pool_param(kind: str) -> str:
    """The val-set job's parameter that stands for ``kind``'s pool key."""
    return next(name for name, key in POOL_PARAMS.items() if key == val_pool_key(kind))


VAL_SET_KEYS = JobKeys("val-set", {"n": "eval.n", "kind": "env.kind", **POOL_PARAMS})


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
