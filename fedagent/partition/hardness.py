"""hardness (ξ′ = ``success_std`` + a labels file): shards of L tasks with a Beta-sized easy share.

FACTS §2, post-fix algorithm (the reference's two defects are not reproduced):

1. One global stream. Easy quotas |Y_i| by Beta sizing: low 0, center ⌊L/2⌋, high
   max(L, ⌊n/N⌋), target N·⌊L/2⌋, concentration ξ′ — so ρ̄ = 0.5 and Var ρ ≈ 0.25/(ξ′+1).
2. Labels True → easy pool Y (canonical order); False or missing → hard pool U.
3. Easy tasks placed by overlap assignment over Y with r_easy = Σquota/|Y| (coverage on
   the success pool): every easy task is used when r_easy ≥ 1.
4. Fill: for i = 0..N−1 in order, F_i is drawn from the **full** U without replacement,
   size L − |Y_i| (realised), all from the one stream — so equal quotas get different fills
   (the reference drew F_i as a function of its size only, and once drew the easy quota a
   second time from U, flooring every client at the global easy rate).
5. X_i = Y_i ∪ F_i, |X_i| = L, ρ_i = |Y_i| / L.
"""

from __future__ import annotations

from fedagent.partition.context import PartitionContext, as_clients
from fedagent.partition.toolbox import beta_sizes, overlap_assign

STRATEGY = "hardness"


def split_pools(task_ids, labels) -> tuple[list[int], list[int], int]:
    """(easy indices, hard indices, number of tasks without a label)."""
    easy, hard, missing = [], [], 0
    for i, t in enumerate(task_ids):
        lab = labels.get(t)
        if lab is None:
            missing += 1
        (easy if lab is True else hard).append(i)
    return easy, hard, missing


def partition(ctx: PartitionContext) -> tuple[dict[str, list[str]], dict]:
    """Easy sets by coverage over Y, hard fills from the full U, one global stream."""
    if ctx.labels is None:
        raise ValueError("hardness needs a labels file (partition.labels)")
    n, c, L = len(ctx.task_ids), ctx.n_clients, ctx.min_tasks
    easy, hard, missing = split_pools(ctx.task_ids, ctx.labels)
    if missing * 2 > n:
        raise ValueError(
            f"hardness: {missing} of {n} train tasks have no label (> 50 %): the labels "
            "file does not match this task pool"
        )
    if not easy:
        raise ValueError(
            "hardness: no train task is labelled a success (the easy pool is empty): the reference "
            "policy is too weak for this pool; give a trained partition.labels_model or a labels file"
        )
    rng = ctx.global_rng(STRATEGY)
    center, high = L // 2, max(L, n // c)
    quota = beta_sizes(
        rng,
        c,
        target=c * center,
        low=0,
        center=center,
        high=high,
        dispersion=float(ctx.knobs.get("success_std", 256.0)),
    )
    r_easy = float(quota.sum()) / len(easy)
    easy_sets = [[easy[j] for j in s] for s in overlap_assign(rng, len(easy), quota, r_easy)]
    fills = []
    for i in range(c):
        need = max(0, L - len(easy_sets[i]))
        take = min(need, len(hard))
        fill = [hard[j] for j in rng.choice(len(hard), size=take, replace=False)] if take else []
        if take < need:  # safety top-up (|U| < L − |Y_i|): any task not yet in the shard
            have = set(easy_sets[i]) | set(fill)
            rest = [k for k in range(n) if k not in have]
            fill += [rest[j] for j in rng.choice(len(rest), size=min(need - take, len(rest)), replace=False)]
        fills.append(sorted(fill))
    shards = [sorted(set(e) | set(f)) for e, f in zip(easy_sets, fills)]
    return as_clients(ctx.task_ids, shards), {
        "easy_pool": len(easy),
        "hard_pool": len(hard),
        "labels_missing": missing,
        "quota": [int(q) for q in quota],
        "r_easy": r_easy,
        "easy": [len(e) for e in easy_sets],
        "rho": [len(e) / L for e in easy_sets],
        "fills": [[ctx.task_ids[k] for k in f] for f in fills],
    }
