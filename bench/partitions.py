"""Partition control laws at paper scale (FACTS §2, issue #10 Must show 1).

    PYTHONPATH=. python bench/partitions.py [--data-seed 42]

Synthetic pools with the reference's sizes: WebShop-like 6410 train tasks with 27.8 % easy
labels (1782) and ALFWorld-like 3553 with 59.4 % (2112), N = 100 clients, L = 100.
Prints, per ξ′: mean ρ, Var ρ against C_h/(ξ′+1) = 0.25/(ξ′+1), easy coverage, distinct
hard fills, equal-quota pairs and their largest fill overlap; coverage sizes (sum = target,
each in [L, 1000]) per ξ; preference's mean realised category mix against π per ω, and the
WebShop fashion subsample; task_disjoint's shard sizes in both modes (reference: the uniform slice
widened to L, the default; disjoint: every task once).
Everything is computed by the same code the workflow's partition job runs.
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np

from fedagent.partition import compute
from fedagent.partition.context import PartitionContext
from fedagent.core.seeds import numpy_rng

N, L = 100, 100
SWEEP = 20
TYPES = ("pick", "look", "clean", "heat", "cool", "pick_two")


def pool(n: int, n_easy: int, seed: int) -> tuple[list[str], dict[str, bool]]:
    """``n`` task ids, ``n_easy`` of them (chosen by a seeded draw) labelled a success."""
    ids = [f"task-{i:05d}" for i in range(n)]
    easy = set(numpy_rng(seed, "bench_labels", index=n).choice(n, size=n_easy, replace=False).tolist())
    return ids, {t: i in easy for i, t in enumerate(ids)}


def hardness_row(name: str, ids, labels, xi: float, data_seed: int) -> str:
    ctx = PartitionContext(ids, N, L, data_seed, {"success_std": xi}, {}, labels)
    t0 = time.perf_counter()
    clients, st = compute(ctx, "hardness")
    dt = time.perf_counter() - t0
    rho = np.array(st["rho"])
    easy_pool = {t for t in ids if labels[t]}
    used = set().union(*(set(ts) & easy_pool for ts in clients.values()))
    fills = [frozenset(f) for f in st["fills"]]
    nonempty = [f for f in fills if f]
    quota = st["quota"]
    pairs = [(i, j) for i, j in itertools.combinations(range(N), 2) if quota[i] == quota[j] and fills[i] and fills[j]]
    worst = max((len(fills[i] & fills[j]) / min(len(fills[i]), len(fills[j])) for i, j in pairs), default=0.0)
    same_quota = sum(1 for i in range(N) if sum(q == quota[i] for q in quota) > 1)
    sizes = {len(ts) for ts in clients.values()}
    return (
        f"{name:9s} {xi:5g} | {rho.mean():.4f} | {rho.var():.5f} | {0.25 / (xi + 1):.5f} | "
        f"{100 * len(used) / len(easy_pool):6.1f}% | {len(set(nonempty)):3d}/{len(nonempty):3d} | "
        f"{same_quota:3d} | {len(pairs):5d} | {100 * worst:5.1f}% | {sorted(sizes)} | {dt:.2f}s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-seed", type=int, default=42)
    args = ap.parse_args()
    ds = args.data_seed
    print(f"## hardness  (N={N}, L={L}, data_seed={ds}; Var ρ is the population variance over clients)")
    print(
        "pool       ξ′   | mean ρ | Var ρ   | 0.25/(ξ′+1) | easy used | distinct fills | "
        "clients sharing a quota | equal-quota pairs | max fill overlap | shard sizes | time"
    )
    for name, n, n_easy in (("ws-6410", 6410, 1782), ("alfw-3553", 3553, 2112)):
        ids, labels = pool(n, n_easy, ds)
        print(f"# {name}: {n_easy}/{n} easy = {100 * n_easy / n:.1f} %")
        for xi in (1.0, 256.0):
            print(hardness_row(name, ids, labels, xi, ds))
    print(
        f"# Var ρ over data_seed {ds}..{ds + SWEEP - 1} (ws-6410): the sampling spread of one"
        f" {N}-client draw, and the finite-L effect (sizes rescaled to Σ = N·L/2, clipped to [0, L], rounded)"
    )
    ids, labels = pool(6410, 1782, ds)
    for xi in (1.0, 256.0):
        v = np.array(
            [
                np.var(compute(PartitionContext(ids, N, L, s, {"success_std": xi}, {}, labels), "hardness")[1]["rho"])
                for s in range(ds, ds + SWEEP)
            ]
        )
        print(
            f"ξ′={xi:<4g} Var ρ mean {v.mean():.5f} ± sd {v.std():.5f} (min {v.min():.5f}, max {v.max():.5f})"
            f"  vs 0.25/(ξ′+1) = {0.25 / (xi + 1):.5f}"
        )

    print(f"\n## coverage  (6410 tasks, N={N}, L={L}, center 500, high 1000)")
    print("ξ    | sum sizes | target | min | max | all in [L, 1000] | r | tasks used")
    ids = [f"task-{i:05d}" for i in range(6410)]
    for xi in (1.0, 256.0):
        ctx = PartitionContext(ids, N, L, ds, {"coverage_std": xi}, {}, None)
        clients, st = compute(ctx, "coverage")
        sizes = np.array([len(ts) for ts in clients.values()])
        used = len(set().union(*map(set, clients.values())))
        print(
            f"{xi:5g} | {sizes.sum():9d} | {N * 500:6d} | {sizes.min():3d} | {sizes.max():4d} | "
            f"{bool(((sizes >= L) & (sizes <= 1000)).all())} | {st['r']:.3f} | {used}/6410"
        )

    print(f"\n## preference  (3553 tasks in 6 types with the ALFWorld train composition, N={N}, L={L})")
    comp = (790, 308, 650, 459, 533, 813)  # pick look clean heat cool pick_two
    types, i = {}, 0
    for t, k in zip(TYPES, comp):
        for _ in range(k):
            types[f"task-{i:05d}"] = t
            i += 1
    ids = list(types)
    for omega in (0.01, 0.5, 0.99):
        ctx = PartitionContext(ids, N, L, ds, {"omega": omega}, types, None)
        clients, st = compute(ctx, "preference")
        cats, pi = st["categories"], np.array(st["pi"])
        q = np.array(st["q"]).mean(axis=0)
        real = np.array([[sum(types[t] == c for t in ts) / len(ts) for c in cats] for ts in clients.values()])
        print(f"ω={omega:<4g} π      = " + " ".join(f"{c}:{p:.3f}" for c, p in zip(cats, pi)))
        print(
            "       E[q]   = "
            + " ".join(f"{c}:{p:.3f}" for c, p in zip(cats, q))
            + f"   max |E[q]−π| = {np.abs(q - pi).max():.3f}"
        )
        print(
            "       shards = "
            + " ".join(f"{c}:{p:.3f}" for c, p in zip(cats, real.mean(axis=0)))
            + f"   mean per-client max type share = {real.max(axis=1).mean():.3f}"
        )

    ids, types = webshop_like(ds)
    n_f = sum(1 for t in types.values() if t == "fashion")
    print(f"\n## preference, WebShop-like  ({len(ids)} goals, {n_f} fashion, N={N}, L={L}): fashion subsample")
    for ratio in (0.2, 1.0):
        ctx = PartitionContext(ids, N, L, ds, {"omega": 0.5, "fashion_ratio": ratio}, types, None)
        clients, st = compute(ctx, "preference")
        cats = st["categories"]
        got = [sum(types[t] == "fashion" for t in ts) for ts in clients.values()]
        print(
            f"fashion_ratio={ratio:<3g} π(fashion) = {st['pi'][cats.index('fashion')]:.3f}  kept per client "
            f"{st.get('fashion', {}).get('kept_per_client', n_f)}  fashion goals per shard: mean {np.mean(got):.1f}"
            f" max {max(got)}"
        )

    print(f"\n## task_disjoint  (N={N}, L={L}): shard sizes")
    print("pool       mode       | min | max | distinct sizes | tasks used | tasks in 2+ shards")
    for name, n in (("ws-6410", 6410), ("alfw-3553", 3553)):
        ids = [f"task-{i:05d}" for i in range(n)]
        for mode in ("reference", "disjoint"):
            clients, _ = compute(
                PartitionContext(ids, N, L, ds, {"task_disjoint_slices": mode}, {}, None), "task_disjoint"
            )
            sizes = [len(ts) for ts in clients.values()]
            count = {}
            for ts in clients.values():
                for t in ts:
                    count[t] = count.get(t, 0) + 1
            print(
                f"{name:10s} {mode:10s} | {min(sizes):3d} | {max(sizes):3d} | {sorted(set(sizes))} | "
                f"{len(count)}/{n} | {sum(1 for v in count.values() if v > 1)}"
            )


def webshop_like(seed: int) -> tuple[list[str], dict[str, str]]:
    """6410 goal ids over WebShop's five categories (fashion the largest, as in the real catalogue)."""
    shares = {"beauty": 0.14, "electronics": 0.13, "fashion": 0.44, "food": 0.14, "furniture": 0.15}
    rng = numpy_rng(seed, "bench_webshop_types")
    cats = sorted(shares)
    draw = rng.choice(len(cats), size=6410, p=[shares[c] for c in cats])
    types = {f"goal-{i:05d}": cats[k] for i, k in enumerate(draw)}
    return list(types), types


if __name__ == "__main__":
    main()
