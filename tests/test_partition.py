"""Uniform partition: contiguous slices, widened to L, deterministic."""

import json

import pytest

from fedagent.partition import assignment_sha256, partition_tasks
from fedagent.partition.uniform import uniform_slices


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
        partition_tasks(tasks, 3, "preference", 1)
