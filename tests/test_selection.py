"""Client selection: M of N per round, a pure function of (seed, round)."""

import pytest

from fedagent.plan.selection import select_clients


def test_pure_and_sorted():
    a = select_clients(42, 5, total=100, per_round=2)
    assert a == select_clients(42, 5, total=100, per_round=2)
    assert a == sorted(a) and len(set(a)) == 2 and all(0 <= c < 100 for c in a)


def test_rounds_differ_and_cover_clients():
    picks = [tuple(select_clients(42, r, total=10, per_round=3)) for r in range(1, 71)]
    assert len(set(picks)) > 30
    assert set(c for p in picks for c in p) == set(range(10))


def test_seed_changes_selection():
    assert [select_clients(42, r, 100, 2) for r in range(1, 11)] != [
        select_clients(21, r, 100, 2) for r in range(1, 11)
    ]


def test_all_when_m_at_least_n():
    assert select_clients(42, 1, total=3, per_round=3) == [0, 1, 2]


def test_round_zero_is_not_a_training_round():
    with pytest.raises(ValueError):
        select_clients(42, 0, 4, 2)


def test_pinned_local_mode_and_centralized_mode():
    from fedagent.plan.selection import run_mode

    assert all(select_clients(42, r, 100, 1, pinned=21) == [21] for r in range(1, 71))
    assert run_mode(100, 21) == "local" and run_mode(1) == "centralized" and run_mode(100) == "federated"
    with pytest.raises(ValueError):
        select_clients(42, 1, 4, 1, pinned=4)


def test_select_cli_records_the_mode(tmp_path):
    import argparse
    import json

    from fedagent.plan.selection import run

    out = tmp_path / "s.json"
    run(argparse.Namespace(seed=42, round=3, total=100, per_round=1, pinned=21, out=out))
    assert json.loads(out.read_text())["clients"] == [21] and json.loads(out.read_text())["mode"] == "local"
