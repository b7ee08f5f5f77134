"""Client selection: the M clients of round r, a pure function of (base_seed, r)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedagent.atomic import atomic_write_json
from fedagent.config import JobKeys
from fedagent.seeds import python_rng


def select_clients(base_seed: int, round: int, total: int, per_round: int) -> list[int]:
    """Sorted ids of the clients trained in ``round`` (all of them when M ≥ N)."""
    SELECT_KEYS.check({"base_seed": base_seed, "total": total, "per_round": per_round})
    if round < 1:
        raise ValueError(f"rounds start at 1 (round 0 is the base model), got {round}")
    if per_round >= total:
        return list(range(total))
    return sorted(python_rng(base_seed, "selection", round=round).sample(range(total), per_round))


SELECT_KEYS = JobKeys("select", {"base_seed": "seed", "total": "clients.total", "per_round": "clients.per_round"})


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent select``."""
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--round", type=int, required=True)
    parser.add_argument("--total", type=int, required=True)
    parser.add_argument("--per-round", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent select``: writes selection.json."""
    clients = select_clients(args.seed, args.round, args.total, args.per_round)
    atomic_write_json(args.out, {"round": args.round, "clients": clients, "total": args.total,
                                 "per_round": args.per_round, "seed": args.seed})
    return 0
