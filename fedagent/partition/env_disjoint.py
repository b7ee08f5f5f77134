"""env_disjoint (ALFWorld, ``env_div``; single-scene ``fallback``): scene-disjoint shards (FACTS §2).

A task id ``alfworld_<type>-<obj>-<mrecep>-<recep>-<scene>_<trial>_game`` gives its spec
(``type-obj-mrecep-recep``), scene and trial. Holdout scenes are dropped. For every spec
(sorted), with its instances sorted by (scene, trial):

- ≥ 2 scenes: each client keeps the n_pc = min(n, max(1, ⌈n/N·(1+env_div)⌉)) scenes (of n)
  with the smallest e = (1−env_div)·u + env_div·v, where u (shared by all clients) and v (the
  client's own) are uniform draws from streams keyed by h = the first 4 bytes of
  sha256(spec) — never Python's process-randomised ``hash``. The client gets every trial of
  its scenes. env_div = 0: everyone keeps the same scenes; 1: independent per client.
- one scene: ``skip`` drops the spec, ``shared`` gives every client all its trials,
  ``trial-only`` applies the same top-k over trials instead of scenes.

L (``min_tasks_per_client``) is ignored, as in the reference.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from fedagent.partition.context import PartitionContext
from fedagent.core.seeds import numpy_rng

STRATEGY = "env_disjoint"
FALLBACKS = ("skip", "shared", "trial-only")


def spec_hash(spec: str) -> int:
    """First 4 bytes of sha256(spec), big-endian, masked to 31 bits (process-stable)."""
    return int.from_bytes(hashlib.sha256(spec.encode()).digest()[:4], "big") & 0x7FFFFFFF


def parse_task_id(task_id: str) -> tuple[str, str, str]:
    """(spec, scene, trial) of an ALFWorld task id."""
    if not (task_id.startswith("alfworld_") and task_id.endswith("_game") and "_trial_" in task_id):
        raise ValueError(f"env_disjoint: {task_id!r} is not an ALFWorld task id")
    taskdir, trial = task_id[len("alfworld_") : -len("_game")].split("_trial_", 1)
    parts = taskdir.split("-")
    if len(parts) < 5:
        raise ValueError(f"env_disjoint: cannot parse spec and scene from {taskdir!r}")
    return "-".join(parts[:4]), parts[4], "trial_" + trial


def _top_k(data_seed: int, spec: str, n_units: int, n_clients: int, env_div: float) -> list[list[int]]:
    """Per client, the unit indices with the n_pc smallest e (stable ties)."""
    h = spec_hash(spec)
    n_pc = min(n_units, max(1, math.ceil(n_units / n_clients * (1 + env_div))))
    u = numpy_rng(data_seed, "env_disjoint_shared", index=h).random(n_units)
    picks = []
    for c in range(n_clients):
        v = numpy_rng(data_seed, "env_disjoint_client", client=c, index=h & 0xFFFF).random(n_units)
        e = (1 - env_div) * u + env_div * v
        picks.append(sorted(np.argsort(e, kind="stable")[:n_pc].tolist()))
    return picks


def partition(ctx: PartitionContext) -> tuple[dict[str, list[str]], dict]:
    """Scene-disjoint shards; the knobs are recorded so a change is visible in the hash."""
    env_div = float(ctx.knobs.get("env_div", 0.7))
    fallback = str(ctx.knobs.get("fallback", "skip"))
    if not 0.0 <= env_div <= 1.0:
        raise ValueError(f"env_disjoint: env_div must be in [0, 1], got {env_div}")
    if fallback not in FALLBACKS:
        raise ValueError(f"env_disjoint: fallback must be one of {FALLBACKS}, got {fallback!r}")
    holdout = {str(s) for s in ctx.knobs.get("holdout_scenes") or ()}
    by_spec: dict[str, list[tuple[str, str, str]]] = {}
    for t in ctx.task_ids:
        spec, scene, trial = parse_task_id(t)
        if scene not in holdout:
            by_spec.setdefault(spec, []).append((scene, trial, t))
    shards: list[set[str]] = [set() for _ in range(ctx.n_clients)]
    skipped = []
    for spec in sorted(by_spec):
        inst = sorted(by_spec[spec])
        scenes = sorted({s for s, _, _ in inst})
        if len(scenes) >= 2:
            for c, keep in enumerate(_top_k(ctx.data_seed, spec, len(scenes), ctx.n_clients, env_div)):
                mine = {scenes[k] for k in keep}
                shards[c].update(t for s, _, t in inst if s in mine)
        elif fallback == "skip":
            skipped.append(spec)
        elif fallback == "shared":
            for sh in shards:
                sh.update(t for _, _, t in inst)
        else:  # trial-only
            for c, keep in enumerate(_top_k(ctx.data_seed, spec, len(inst), ctx.n_clients, env_div)):
                shards[c].update(inst[k][2] for k in keep)
    order = {t: i for i, t in enumerate(ctx.task_ids)}
    clients = {str(c): sorted(sh, key=order.__getitem__) for c, sh in enumerate(shards)}
    empty = [c for c, ts in clients.items() if not ts]
    if empty:
        raise ValueError(
            f"env_disjoint: clients {empty} got no task (too few multi-scene specs; "
            "try partition.fallback: shared or trial-only)"
        )
    return clients, {
        "env_div": env_div,
        "fallback": fallback,
        "holdout_scenes": sorted(holdout),
        "specs": len(by_spec),
        "skipped_specs": skipped,
    }
