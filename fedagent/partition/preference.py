"""preference (ω): per-client category mixes q ~ Dir(π(1−ω)/ω), so E[q] = π (FACTS §2).

Categories are the task types (ALFWorld's six; a single-type pool has one category and the
arm then draws uniform random shards). π = (p + 0.01)/(1 + 0.01·K), the smoothed global
category marginal. Per client, from its own stream: q ~ Dir(π(1−ω)/ω), counts ~ Mult(L, q),
each count capped at its category size with the overflow redistributed ∝ q over categories
with room; tasks sampled without replacement within each category; topped up to L from the
client's unused tasks. ω is clipped to [1e-3, 1−1e-3]; larger ω = more skew.

WebShop (FACTS §2): a ``fashion`` category is first subsampled, per client, to
max(1, ⌊fashion_ratio · |fashion|⌋) tasks (knob ``fashion_ratio``, the reference's 0.2) from the
client's own stream ``partition_preference_fashion`` (the reference's separate
RandomState(42 + cid)); π, the caps and the category draws then see the subsample, and the top-up
draws from the whole pool, as the reference's. Pools without a ``fashion`` category (ALFWorld's
task types) are untouched.
"""

from __future__ import annotations

import numpy as np

from fedagent.partition.context import PartitionContext, as_clients

STRATEGY = "preference"
FASHION = "fashion"
FASHION_RATIO = 0.2  # the reference's fashion_sample_ratio


def category_marginal(cats: list[str], by_cat: dict[str, list[int]]) -> np.ndarray:
    """π = (p + 0.01)/(1 + 0.01·K) over the sorted categories."""
    n = sum(len(v) for v in by_cat.values())
    p = np.array([len(by_cat[k]) / n for k in cats])
    return (p + 0.01) / (1 + 0.01 * len(cats))


def partition(ctx: PartitionContext) -> tuple[dict[str, list[str]], dict]:
    """Each client's shard from its own stream (the reference's RandomState(42 + cid))."""
    L = ctx.min_tasks
    full: dict[str, list[int]] = {}
    for i, t in enumerate(ctx.task_ids):
        full.setdefault(ctx.task_types.get(t, "task"), []).append(i)
    cats = sorted(full)
    omega = min(max(float(ctx.knobs.get("omega", 0.5)), 1e-3), 1 - 1e-3)
    ratio = float(ctx.knobs.get("fashion_ratio", FASHION_RATIO))
    shards, qs, fashion_kept = [], [], None
    for c in range(ctx.n_clients):
        by_cat = full
        if FASHION in full and ratio < 1.0:
            fashion = full[FASHION]
            fashion_kept = max(1, int(len(fashion) * ratio))
            pick = ctx.client_rng(f"{STRATEGY}_fashion", c).choice(len(fashion), size=fashion_kept, replace=False)
            by_cat = {**full, FASHION: sorted(fashion[j] for j in pick)}
        caps = np.array([len(by_cat[k]) for k in cats])
        pi = category_marginal(cats, by_cat)
        alpha = pi * (1 - omega) / omega
        rng = ctx.client_rng(STRATEGY, c)
        q = rng.dirichlet(alpha) if len(cats) > 1 else np.ones(1)
        want = rng.multinomial(L, q)
        counts = np.minimum(want, caps)
        over = int(want.sum() - counts.sum())
        while over > 0:
            room = caps - counts
            open_ = np.flatnonzero(room > 0)
            if len(open_) == 0:
                break
            w = q[open_] if q[open_].sum() > 0 else np.ones(len(open_))
            add = rng.multinomial(over, w / w.sum())
            add = np.minimum(add, room[open_])
            counts[open_] += add
            over -= int(add.sum())
        chosen: list[int] = []
        for k, cnt in zip(cats, counts):
            if cnt:
                pool = by_cat[k]
                chosen += [pool[j] for j in rng.choice(len(pool), size=int(cnt), replace=False)]
        if len(chosen) < L:  # top up from unused tasks
            used = set(chosen)
            rest = [i for i in range(len(ctx.task_ids)) if i not in used]
            chosen += [rest[j] for j in rng.choice(len(rest), size=min(L - len(chosen), len(rest)), replace=False)]
        shards.append(chosen)
        qs.append([float(x) for x in q])
    stats = {"categories": cats, "pi": [float(x) for x in pi], "omega": omega, "q": qs}
    if fashion_kept is not None:  # only then: other pools' partition.json stays as it was
        stats["fashion"] = {"pool": len(full[FASHION]), "kept_per_client": fashion_kept, "ratio": ratio}
    return as_clients(ctx.task_ids, shards), stats
