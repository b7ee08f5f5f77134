"""``fedagent clients-table``: a matrix's train jobs side by side (fedagent.report.clients_table).

The end-to-end check (the table of a tiny matrix run through Snakemake against each job's own
metrics.json) is in tests/test_matrix.py's tiny-matrix test."""

from __future__ import annotations

import argparse
import json

import pandas as pd
import pytest

from fedagent.report import clients_table
from fedagent.report.points import POINTS_COLUMNS


def _points(path, rows):
    """A points.csv of (round, key, value) rows (every key once a round, as the report writes them)."""
    pd.DataFrame([(r, k, v, 1.0) for r, k, v in rows], columns=POINTS_COLUMNS).to_csv(path, index=False)
    return str(path)


@pytest.fixture
def two_arms(tmp_path):
    """Two arms of one seed, rounds 1-2, clients (0, 12) then (12, 3); arm b lacks a metric and logs another."""
    a = _points(
        tmp_path / "a.csv",
        [
            (0, "eval/success_rate", 0.1),
            (1, "client/0/success_rate", 0.25),
            (1, "client/0/kl", 0.01),
            (1, "client/12/success_rate", 0.5),
            (1, "client/12/kl", 0.02),
            (1, "eval/success_rate", 0.2),
            (2, "client/12/success_rate", 0.125),
            (2, "client/12/kl", 0.03),
            (2, "client/3/success_rate", 0.0),
            (2, "client/3/kl", 0.04),
        ],
    )
    b = _points(
        tmp_path / "b.csv",
        [
            (1, "client/0/success_rate", 0.375),
            (1, "client/12/success_rate", 0.5),
            (1, "client/12/by_epoch.0.success_rate", 0.75),
            (2, "client/12/success_rate", 0.0),
            (2, "client/3/success_rate", 0.0625),
        ],
    )
    return [{"arm": "b_first", "seed": 42, "points": b}, {"arm": "a", "seed": 42, "points": a}]


def test_one_row_per_train_job_with_the_arms_of_one_draw_together(two_arms):
    """Seen failing with the rows ordered by arm first (each arm's rounds together, the arms of one draw
    apart) and with the client read as one digit (client 12's metrics filed under client 1)."""
    table = clients_table.build_table(two_arms)
    assert list(table.columns) == ["arm", "seed", "round", "client", "by_epoch.0.success_rate", "kl", "success_rate"]
    # ordered by (seed, round, client), then the runs' order
    assert [tuple(r) for r in table[["round", "client", "arm"]].itertuples(index=False)] == [
        (1, 0, "b_first"),
        (1, 0, "a"),
        (1, 12, "b_first"),
        (1, 12, "a"),
        (2, 3, "b_first"),
        (2, 3, "a"),
        (2, 12, "b_first"),
        (2, 12, "a"),
    ]
    row = table[(table["arm"] == "a") & (table["round"] == 2) & (table["client"] == 12)].iloc[0]
    assert (row["success_rate"], row["kl"]) == (0.125, 0.03) and pd.isna(row["by_epoch.0.success_rate"])
    assert (
        table.loc[
            (table["arm"] == "b_first") & (table["client"] == 12) & (table["round"] == 1), "by_epoch.0.success_rate"
        ].item()
        == 0.75
    )
    assert table["kl"][table["arm"] == "b_first"].isna().all()  # a metric a run never logged: empty
    assert not table["arm"].isin(["eval"]).any() and len(table) == 8  # eval/ keys are not train jobs


def test_the_markdown_puts_the_arms_side_by_side_and_the_cli_writes_both_files(two_arms, tmp_path):
    md = clients_table.markdown(clients_table.build_table(two_arms), "m")
    assert "| seed | round | client | b_first | a |" in md
    assert "| 42 | 1 | 0 | 0.3750 | 0.2500 |" in md
    assert "| 42 | 2 | 3 | 0.0000 | 0.0400 |" not in md  # kl has its own table
    assert md.index("## success_rate") < md.index("## kl")
    assert "| 42 | 2 | 3 |  | 0.0400 |" in md  # b_first has no kl
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps(two_arms))
    parser = argparse.ArgumentParser()
    clients_table.add_args(parser)
    out = [f"--csv={tmp_path / 'c.csv'}", f"--md={tmp_path / 'c.md'}", "--matrix=m"]
    assert clients_table.run(parser.parse_args([f"--runs=@{runs}", *out])) == 0
    first = (tmp_path / "c.csv").read_bytes()
    assert clients_table.run(parser.parse_args([f"--runs={json.dumps(two_arms)}", *out])) == 0
    assert (tmp_path / "c.csv").read_bytes() == first and (tmp_path / "c.md").read_text() == md


def test_a_bad_runs_argument_is_one_message_and_exit_2(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    clients_table.add_args(parser)
    out = [f"--csv={tmp_path / 'c.csv'}", f"--md={tmp_path / 'c.md'}", "--matrix=m"]
    assert clients_table.run(parser.parse_args(["--runs=[{", *out])) == 2
    assert clients_table.run(parser.parse_args([f"--runs=@{tmp_path / 'nope.json'}", *out])) == 2
    assert "nope.json" in capsys.readouterr().err
    missing = json.dumps([{"arm": "a", "seed": 1, "points": str(tmp_path / "none.csv")}])
    assert clients_table.run(parser.parse_args([f"--runs={missing}", *out])) == 2
    assert "none.csv" in capsys.readouterr().err
    assert clients_table.run(parser.parse_args(["--runs=[]", *out])) == 2
    assert not (tmp_path / "c.csv").exists() and not (tmp_path / "c.md").exists()
