"""Shared partition primitives (FACTS §2): Beta sizing, overlap assignment, ``default_r``.

Every strategy module builds on these. Randomness comes only from the numpy ``Generator``
passed in (built by :func:`fedagent.core.seeds.numpy_rng` from ``data_seed``), and every global
step is one computation over all clients in id order, so any process recomputing the
partition gets the same bytes.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def default_r(n_clients: int, n_items: int, low: float, center: float, high: float) -> float:
    """Overlap coefficient r = C·center/Ntot, clipped to [C·low/Ntot, C·high/Ntot]."""
    if n_items < 1:
        raise ValueError("default_r needs at least one item")
    raw = n_clients * center / n_items
    return float(min(max(raw, n_clients * low / n_items), n_clients * high / n_items))


def beta_sizes(
    rng: np.random.Generator, n_clients: int, *, target: float, low: int, center: float, high: int, dispersion: float
) -> np.ndarray:
    """Per-client integer sizes in [low, high] summing to ``target`` (clamped to [C·low, C·high]).

    x ~ Beta(m·s, (1−m)·s) with m = (center−low)/(high−low) (clipped to [1e-6, 1−1e-6]) and
    s = max(dispersion, 2e-3); sizes = low + x·(high−low), rescaled to the target sum and
    clipped; floors plus the deficit by largest remainder; the residual fixed one unit at a
    time in index order, then round-robin. Var(x) = m(1−m)/(s+1): the control law.
    """
    if not low <= center <= high:
        raise ValueError(f"need low <= center <= high, got {low}, {center}, {high}")
    if n_clients < 1:
        raise ValueError("need at least one client")
    target = int(round(min(max(target, n_clients * low), n_clients * high)))
    if high > low:
        m = min(max((center - low) / (high - low), 1e-6), 1 - 1e-6)
        s = max(float(dispersion), 2e-3)
        x = rng.beta(m * s, (1 - m) * s, size=n_clients)
    else:
        x = np.full(n_clients, 0.5)
    cont = low + x * (high - low)
    total = cont.sum()
    cont = cont * (target / total) if total > 0 else np.full(n_clients, target / n_clients)
    cont = np.clip(cont, low, high)
    sizes = np.floor(cont).astype(np.int64)
    need = target - int(sizes.sum())
    order = np.argsort(-(cont - sizes), kind="stable")  # largest remainder first
    if need > 0:
        sizes[order[:need]] += 1
    elif need < 0:
        sizes[order[::-1][:-need]] -= 1
    sizes = np.clip(sizes, low, high)
    # Residual after clipping: one unit at a time in index order, cycling (round-robin).
    diff = target - int(sizes.sum())
    while diff != 0:
        moved = False
        for i in range(n_clients):
            if diff > 0 and sizes[i] < high:
                sizes[i] += 1
                diff -= 1
                moved = True
            elif diff < 0 and sizes[i] > low:
                sizes[i] -= 1
                diff += 1
                moved = True
            if diff == 0:
                break
        if not moved:
            break
    return sizes


def overlap_assign(rng: np.random.Generator, n_items: int, sizes: Sequence[int], r: float) -> list[list[int]]:
    """Deal ``n_items`` items to clients of the given sizes, each item to ~r distinct clients.

    1. Every item gets ⌊r⌋ copies and (Σsizes − ⌊r⌋·Ntot) items, drawn without replacement,
       get ⌈r⌉ (floor/ceil of Σ/Ntot when that count is outside [0, Ntot]).
    2. Items in id order hand their copies to distinct clients with capacity left, with
       probability ∝ remaining capacity.
    3. A shortfall is topped up with random (item, client-with-capacity) pairs.
    Returns each client's sorted item indices.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    if n_items < 1:
        return [[] for _ in sizes]
    lo = int(math.floor(r))
    n_high = total - lo * n_items
    if not 0 <= n_high <= n_items:
        lo = total // n_items
        n_high = total - lo * n_items
    copies = np.full(n_items, lo, dtype=np.int64)
    if n_high > 0:
        copies[rng.choice(n_items, size=n_high, replace=False)] += 1
    remaining = sizes.copy()
    sets: list[set[int]] = [set() for _ in sizes]
    for item in range(n_items):
        avail = np.flatnonzero(remaining > 0)
        k = min(int(copies[item]), len(avail))
        if k == 0:
            continue
        p = remaining[avail] / remaining[avail].sum()
        for c in rng.choice(avail, size=k, replace=False, p=p):
            sets[c].add(item)
            remaining[c] -= 1
    # Top-up: random (item, client) pairs for clients that still have capacity.
    for c in np.flatnonzero(remaining > 0):
        free = np.setdiff1d(np.arange(n_items), np.fromiter(sets[c], dtype=np.int64), assume_unique=True)
        take = min(int(remaining[c]), len(free))
        if take:
            sets[c].update(int(i) for i in rng.choice(free, size=take, replace=False))
            remaining[c] -= take
    return [sorted(int(i) for i in s) for s in sets]
