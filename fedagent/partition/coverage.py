"""coverage (ξ = ``coverage_std``): Beta-sized shards with controlled overlap (FACTS §2).

Sizes by Beta sizing with low = L, center = ``coverage_center`` (500), high =
``coverage_high`` (1000) — both capped at the pool size — and concentration ξ (256 near
uniform, 1 extreme); target Σ = C·center. Tasks are dealt by overlap assignment with
r = default_r(C, Ntot, low, center, high), so each task lands in ⌊r⌋ or ⌈r⌉ clients.
"""

from __future__ import annotations

from fedagent.partition.context import PartitionContext, as_clients
from fedagent.partition.toolbox import beta_sizes, default_r, overlap_assign

STRATEGY = "coverage"


def bounds(ctx: PartitionContext) -> tuple[int, float, int]:
    """(low, center, high) after capping at the pool size."""
    n = len(ctx.task_ids)
    high = min(int(ctx.knobs.get("coverage_high", 1000)), n)
    low = min(ctx.min_tasks, high)
    center = min(max(float(ctx.knobs.get("coverage_center", 500)), low), high)
    return low, center, high


def partition(ctx: PartitionContext) -> tuple[dict[str, list[str]], dict]:
    """One global computation from the strategy's stream."""
    n, c = len(ctx.task_ids), ctx.n_clients
    low, center, high = bounds(ctx)
    rng = ctx.global_rng(STRATEGY)
    sizes = beta_sizes(
        rng,
        c,
        target=c * center,
        low=low,
        center=center,
        high=high,
        dispersion=float(ctx.knobs.get("coverage_std", 256.0)),
    )
    r = default_r(c, n, low, center, high)
    sets = overlap_assign(rng, n, sizes, r)
    return as_clients(ctx.task_ids, sets), {
        "low": low,
        "center": center,
        "high": high,
        "r": r,
        "target": int(sizes.sum()),
        "quota": [int(s) for s in sizes],
    }
