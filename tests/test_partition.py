"""Partitions: uniform slices, and the control laws of preference / coverage / hardness /
task_disjoint / env_disjoint (FACTS §2), deterministic across processes."""

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from fedagent.partition import assignment_sha256, compute, partition_tasks
from fedagent.partition.context import PartitionContext
from fedagent.partition.env_disjoint import parse_task_id, spec_hash
from fedagent.partition.toolbox import beta_sizes, overlap_assign
from fedagent.partition.uniform import uniform_slices
from fedagent.core.seeds import numpy_rng

N, L = 100, 100


def test_reference_numbers_webshop_and_alfworld():
    # FACTS §2: WebShop 6410 train goals, N=100, L=100 → base 64 widened to 100.
    s = uniform_slices(6410, 100, 100)
    assert s[0] == (0, 100) and s[99] == (6310, 6410)
    assert all(b - a == 100 for a, b in s)
    s = uniform_slices(3553, 100, 100)  # ALFWorld base 35 → 100
    assert all(b - a == 100 for a, b in s) and all(0 <= a < b <= 3553 for a, b in s)


def test_disjoint_when_large_enough():
    s = uniform_slices(12, 3, 1)
    assert s == [(0, 4), (4, 8), (8, 12)]


def test_single_client_gets_everything():
    assert uniform_slices(7, 1, 5) == [(0, 7)]


def test_too_few_tasks_is_an_error():
    with pytest.raises(ValueError, match="min_tasks"):
        uniform_slices(3, 2, 4)


def test_partition_is_deterministic_and_hashed():
    tasks = [f"t{i:03d}" for i in range(10)]
    a = partition_tasks(tasks, 3, "uniform", 1)
    b = partition_tasks(list(tasks), 3, "uniform", 1)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert assignment_sha256(a) == assignment_sha256(b)
    assert a["0"] == ["t000", "t001", "t002"]
    with pytest.raises(ValueError):
        partition_tasks(tasks, 3, "no_such_strategy", 1)


def _labelled_pool(n, n_easy, seed=42):
    ids = [f"task-{i:05d}" for i in range(n)]
    easy = set(numpy_rng(seed, "bench_labels", index=n).choice(n, size=n_easy, replace=False).tolist())
    return ids, {t: i in easy for i, t in enumerate(ids)}


@pytest.fixture(scope="module")
def webshop_pool():
    return _labelled_pool(6410, 1782)  # 27.8 % easy, the reference's WebShop labels


@pytest.mark.parametrize("xi, var_lo, var_hi", [(1.0, 0.07, 0.16), (256.0, 0.0006, 0.0016)])
def test_hardness_control_laws_at_paper_scale(webshop_pool, xi, var_lo, var_hi):
    ids, labels = webshop_pool
    clients, st = compute(PartitionContext(ids, N, L, 42, {"success_std": xi}, {}, labels), "hardness")
    rho = np.array(st["rho"])
    assert all(len(ts) == L for ts in clients.values())
    assert rho.mean() == pytest.approx(0.5, abs=1e-12)  # (D3)
    assert var_lo < rho.var() < var_hi  # (D1) ≈ 0.25/(ξ′+1)
    # realised easy share = the quota: no hard task is an easy one and vice versa
    for c, ts in clients.items():
        assert sum(labels[t] for t in ts) == st["easy"][int(c)] == st["quota"][int(c)]
    easy_pool = {t for t in ids if labels[t]}
    assert set().union(*(set(ts) & easy_pool for ts in clients.values())) == easy_pool  # 100 % used
    fills = [set(f) for f in st["fills"]]
    q = st["quota"]
    pairs = [(i, j) for i, j in itertools.combinations(range(N), 2) if q[i] == q[j] and fills[i]]
    assert pairs, "the test needs equal-quota clients"
    assert max(len(fills[i] & fills[j]) / len(fills[i]) for i, j in pairs) < 0.5
    nonempty = [frozenset(f) for f in fills if f]
    assert len(set(nonempty)) == len(nonempty)
    assert len(set().union(*nonempty)) > 1.5 * max(len(f) for f in nonempty)


def test_hardness_missing_labels_counted_and_too_many_refused():
    ids, labels = _labelled_pool(400, 150)
    some = {t: v for k, (t, v) in enumerate(labels.items()) if k % 4}  # 25 % missing
    _, st = compute(PartitionContext(ids, 4, 50, 42, {"success_std": 4.0}, {}, some), "hardness")
    assert st["labels_missing"] == 100
    few = {t: v for k, (t, v) in enumerate(labels.items()) if k % 3 == 0}  # 67 % missing
    with pytest.raises(ValueError, match="no label"):
        compute(PartitionContext(ids, 4, 50, 42, {"success_std": 4.0}, {}, few), "hardness")


@pytest.mark.parametrize("xi", [1.0, 256.0])
def test_coverage_sizes_sum_to_target_within_bounds(xi):
    ids = [f"task-{i:05d}" for i in range(6410)]
    clients, st = compute(PartitionContext(ids, N, L, 42, {"coverage_std": xi}, {}, None), "coverage")
    sizes = np.array([len(ts) for ts in clients.values()])
    assert sizes.sum() == N * 500 == st["target"]
    assert sizes.min() >= L and sizes.max() <= 1000
    assert list(sizes) == st["quota"]
    assert len(set().union(*map(set, clients.values()))) == 6410


def test_preference_realises_the_marginal_in_expectation():
    comp = (790, 308, 650, 459, 533, 813)
    types, i = {}, 0
    for t, k in zip(("pick", "look", "clean", "heat", "cool", "pick_two"), comp):
        for _ in range(k):
            types[f"task-{i:05d}"] = t
            i += 1
    ids = list(types)
    _, flat = compute(PartitionContext(ids, N, L, 42, {"omega": 0.01}, types, None), "preference")
    clients, skew = compute(PartitionContext(ids, N, L, 42, {"omega": 0.99}, types, None), "preference")
    pi = np.array(flat["pi"])
    assert pi.sum() == pytest.approx(1.0)
    assert np.abs(np.array(flat["q"]).mean(axis=0) - pi).max() < 0.02  # E[q] = π
    assert np.abs(np.array(skew["q"]).mean(axis=0) - pi).max() < 0.08
    cats = skew["categories"]
    share = [max(sum(types[t] == c for t in ts) for c in cats) / len(ts) for ts in clients.values()]
    assert np.mean(share) > 0.9  # ω → 1: nearly one category per client
    assert all(len(ts) == L for ts in clients.values())


def test_task_disjoint_disjoint_mode_is_pairwise_disjoint_and_covers_the_pool():
    ids = [f"t{i:03d}" for i in range(103)]
    clients = partition_tasks(ids, 10, "task_disjoint", 50, knobs={"task_disjoint_slices": "disjoint"})
    seen = [t for ts in clients.values() for t in ts]
    assert sorted(seen) == ids and len(set(seen)) == len(seen)
    assert sorted(len(ts) for ts in clients.values()) == [10] * 7 + [11] * 3
    with pytest.raises(ValueError):
        partition_tasks(ids[:5], 10, "task_disjoint", 1)
    with pytest.raises(ValueError, match="task_disjoint_slices"):
        partition_tasks(ids, 10, "task_disjoint", 1, knobs={"task_disjoint_slices": "bogus"})


def test_task_disjoint_honours_L_as_the_reference_by_default():
    """The reference's arm serves catalog_split's goal slice, the uniform one widened to L (FACTS
    §2): WebShop's 6410 train goals, N = 100, L = 100 give 100-goal slices (client 0 = [0, 100),
    client 99 = [6310, 6410)), not the 64/65 of disjoint slices (seen failing on the old arm)."""
    ids = [f"g{i:04d}" for i in range(6410)]
    clients, st = compute(PartitionContext(ids, 100, 100, 42, {}, {}, None), "task_disjoint")
    assert {len(ts) for ts in clients.values()} == {100}
    assert clients["0"] == ids[0:100] and clients["99"] == ids[6310:6410]
    assert clients == partition_tasks(ids, 100, "uniform", 100)  # the same slices as uniform
    assert st["min_tasks_applied"] is True and st["slices"][1] == [46, 146]
    alf = [f"a{i:04d}" for i in range(3553)]  # ALFWorld: base 35 → 100
    assert {len(ts) for ts in partition_tasks(alf, 100, "task_disjoint", 100).values()} == {100}
    # L below the base: disjoint base-sized slices (the remainder n mod N is nobody's, as in uniform)
    small = partition_tasks(ids[:103], 10, "task_disjoint", 5)
    assert [len(ts) for ts in small.values()] == [10] * 10 and len({t for ts in small.values() for t in ts}) == 100


def _webshop_pool(n_fashion=1000, n_other=100):
    cats = ("beauty", "electronics", "fashion", "food", "furniture")
    types = {}
    for c in cats:
        for k in range(n_fashion if c == "fashion" else n_other):
            types[f"{c}-{k:04d}"] = c
    return list(types), types


def test_preference_subsamples_fashion_per_client_as_the_reference():
    """WebShop's preference arm keeps max(1, ⌊0.2·|fashion|⌋) fashion goals per client before the
    Dirichlet draw (FACTS §2): π sees 200 of 1000, and no client gets more than its own 200 fashion
    goals from the category draw, whatever its q (seen failing on the old arm: up to L = 300)."""
    ids, types = _webshop_pool()
    ctx = PartitionContext(ids, 40, 300, 42, {"omega": 0.99}, types, None)
    clients, st = compute(ctx, "preference")
    assert st["fashion"] == {"pool": 1000, "kept_per_client": 200, "ratio": 0.2}
    cats = st["categories"]
    assert st["pi"][cats.index("fashion")] == pytest.approx((200 / 600 + 0.01) / 1.05)
    fashion = [[t for t in ts if types[t] == "fashion"] for ts in clients.values()]
    q = np.array(st["q"])[:, cats.index("fashion")]
    # the category draw gives ≤ 200; only the top-up (other categories full: 400 < L is not the case
    # here, 4 × 100 + 200 = 600 ≥ 300) could add more, so every client stays within its subsample
    assert max(len(f) for f in fashion) <= 200 and q.max() > 0.7
    assert all(len(ts) == 300 for ts in clients.values())
    assert len({frozenset(f) for f in fashion if f}) > 1  # each client its own subsample
    full, st_full = compute(
        PartitionContext(ids, 40, 300, 42, {"omega": 0.99, "fashion_ratio": 1.0}, types, None), "preference"
    )
    assert "fashion" not in st_full and max(sum(types[t] == "fashion" for t in ts) for ts in full.values()) > 200
    # A pool without 'fashion' (ALFWorld's types) is what it was: the golden hash below pins it.


def _alfworld_ids():
    ids = []
    for spec_i, (ttype, obj) in enumerate(
        [("pick_and_place_simple", "Mug"), ("look_at_obj_in_light", "Book"), ("pick_heat_then_place_in_recep", "Egg")]
    ):
        for scene in (1, 2, 3, 4, 5, 6)[: 6 - spec_i]:
            for trial in range(2):
                ids.append(f"alfworld_{ttype}-{obj}-None-Shelf-{300 + scene}_trial_T{spec_i}{scene}{trial}_game")
    ids.append("alfworld_pick_cool_then_place_in_recep-Apple-None-Fridge-7_trial_T9_game")  # one scene
    return ids


def test_env_disjoint_scenes_knobs_and_fallbacks():
    ids = _alfworld_ids()
    assert parse_task_id(ids[0]) == ("pick_and_place_simple-Mug-None-Shelf", "301", "trial_T010")

    def run(**knobs):
        return partition_tasks(ids, 4, "env_disjoint", 100, knobs=knobs, kind="alfworld")

    skip, shared = run(env_div=0.7, fallback="skip"), run(env_div=0.7, fallback="shared")
    single = ids[-1]
    assert all(single not in ts for ts in skip.values()) and all(single in ts for ts in shared.values())
    for ts in skip.values():  # whole scenes: both trials of a kept scene go together
        scenes = {parse_task_id(t)[:2] for t in ts}
        assert len(ts) == 2 * len(scenes)
    same = run(env_div=0.0)  # u only: every client keeps the same scenes
    assert len({tuple(ts) for ts in same.values()}) == 1
    assert run(env_div=0.3) != skip  # the knob reaches the shard
    assert run(env_div=1.0) != run(env_div=1.0, holdout_scenes=["301"])
    assert spec_hash("pick_and_place_simple-Mug-None-Shelf") == 0x7FFFFFFF & int.from_bytes(
        __import__("hashlib").sha256(b"pick_and_place_simple-Mug-None-Shelf").digest()[:4], "big"
    )


def test_beta_sizes_and_overlap_assign_primitives():
    rng = np.random.default_rng(0)
    s = beta_sizes(rng, 10, target=10_000, low=5, center=50, high=80, dispersion=1.0)  # clamped to C·high
    assert s.sum() == 800 and s.max() <= 80
    sets = overlap_assign(np.random.default_rng(1), 30, [10, 20, 15], 1.5)
    assert [len(x) for x in sets] == [10, 20, 15] and all(len(set(x)) == len(x) for x in sets)


# Golden values: a changed derivation (derive_seed's key, a stream's purpose name, the
# order in which a strategy consumes its stream) or a process-dependent seed changes these.
GOLDEN = {
    "uniform": "5f4c4f1eb6a2dc0bdc3d2907ec7cc43f4d5026ffb989c0c93ce5fffeac17f16c",
    "hardness": "48aba52f205596e28d9f34d1529f85b7e8b9bcee4d7a7003dfcb42a36c563b27",
    "coverage": "0596161e8865c328f8a92465475549921ec48236d9204daeb14b841ca69dde5c",
    "preference": "230c63baa9329bfb158984124ac6eace565d49c3ea8d13bb1cf4bcfd9dd998a7",
    "env_disjoint": "a9e2a61a0805fc7392aadd8a0ce81e1b95824bd6d246a833cdfed95894b544f0",
}
_GOLDEN_SCRIPT = """
import json, sys
from fedagent.partition import partition_tasks, assignment_sha256
ids = [f"t{i:04d}" for i in range(300)]
labels = {t: i % 3 == 0 for i, t in enumerate(ids)}
types = {t: "abc"[i % 3] for i, t in enumerate(ids)}
knobs = {"uniform": {}, "hardness": {"success_std": 1.0}, "preference": {"omega": 0.5},
         "coverage": {"coverage_std": 4.0, "coverage_center": 60, "coverage_high": 120}}
out = {s: assignment_sha256(partition_tasks(ids, 10, s, 20, data_seed=42, knobs=k,
        task_types=types, labels=labels)) for s, k in knobs.items()}
alf = [f"alfworld_{t}-Obj{o}-None-Shelf-{sc}_trial_T{o}{sc}{k}_game"
       for t in ("pick_and_place_simple", "look_at_obj_in_light") for o in range(3) for sc in range(1, 6) for k in range(2)]
out["env_disjoint"] = assignment_sha256(partition_tasks(alf, 4, "env_disjoint", 1, data_seed=42,
                                                        knobs={"env_div": 0.5}))
print(json.dumps(out))
"""


@pytest.mark.parametrize("hashseed", ["0", "12345"])
def test_partition_golden_hashes_in_fresh_processes(hashseed):
    env = {**__import__("os").environ, "PYTHONHASHSEED": hashseed}
    out = subprocess.run([sys.executable, "-c", _GOLDEN_SCRIPT], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == GOLDEN


def test_data_seed_changes_every_random_strategy():
    ids, labels = _labelled_pool(300, 100)
    for s, k in (("hardness", {"success_std": 1.0}), ("coverage", {"coverage_center": 60, "coverage_high": 120})):
        a = partition_tasks(ids, 10, s, 20, data_seed=42, knobs=k, labels=labels)
        b = partition_tasks(ids, 10, s, 20, data_seed=43, knobs=k, labels=labels)
        assert a != b
