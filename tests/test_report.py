"""Report: one row per round in numeric order, round 0 = base; a curve that is a real PNG."""

import json
import os

import pytest

from fedagent.report.summary import plot_curves, summary_table


def _eval(path, r, sr):
    path.write_text(
        json.dumps(
            {"round": r, "n": 4, "success_rate": sr, "ci95": [0.0, 0.5], "score_mean": sr, "return_mean": 10 * sr}
        )
    )
    return path


def test_rows_in_numeric_round_order(tmp_path):
    files = [_eval(tmp_path / f"e{r}.json", r, r / 20) for r in (10, 4, 0, 2)]
    table = summary_table(files)
    assert list(table["round"]) == [0, 2, 4, 10]
    assert list(table["model"]) == ["base", "aggregated", "aggregated", "aggregated"]
    plot_curves(table, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_duplicate_rounds_are_refused(tmp_path):
    files = [_eval(tmp_path / "a.json", 1, 0.1), _eval(tmp_path / "b.json", 1, 0.2)]
    with pytest.raises(ValueError, match="duplicate"):
        summary_table(files)


def test_links_point_at_the_newest_round(tmp_path):
    from fedagent.report.summary import link_latest

    run = tmp_path / "run"
    for r in (2, 3):
        (run / f"round_00{r}").mkdir(parents=True)
        (run / f"round_00{r}" / "summary.csv").write_text(f"r{r}")
        (run / f"round_00{r}" / "curves.png").write_text(f"c{r}")
    assert link_latest(run, run / "round_003/summary.csv", run / "round_003/curves.png", 3)
    # Re-running round 2's report must not hide round 3.
    assert not link_latest(run, run / "round_002/summary.csv", run / "round_002/curves.png", 2)
    assert (run / "summary.csv").read_text() == "r3" and (run / "curves.png").read_text() == "c3"
    assert not (run / "summary.csv").resolve().is_relative_to(tmp_path / "elsewhere")
    assert os.readlink(run / "summary.csv") == "round_003/summary.csv"


def test_client_evals_become_rows_and_circles(tmp_path):
    import argparse

    from fedagent.report.summary import CLIENT_COLUMNS, run

    evals, clients = [], []
    for r in (0, 1):
        p = tmp_path / f"e{r}.json"
        p.write_text(json.dumps({"round": r, "n": 2, "success_rate": 0.5, "ci95": [0.1, 0.9]}))
        evals.append(p)
    for c, sr in ((3, 0.0), (1, 1.0)):
        p = tmp_path / f"c{c}.json"
        p.write_text(json.dumps({"round": 1, "client": c, "n": 2, "success_rate": sr, "ci95": [0, 1]}))
        clients.append(p)
    args = argparse.Namespace(
        evals=evals,
        client_evals=clients,
        summary=tmp_path / "summary.csv",
        curves=tmp_path / "curves.png",
        link_latest=None,
        client_summary=tmp_path / "client_summary.csv",
    )
    assert run(args) == 0
    rows = (tmp_path / "client_summary.csv").read_text().splitlines()
    assert rows[0].startswith("round,client") and [r.split(",")[:2] for r in rows[1:]] == [["1", "1"], ["1", "3"]]
    assert len((tmp_path / "summary.csv").read_text().splitlines()) == 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"round": 1, "n": 2, "success_rate": 0.5}))
    with pytest.raises(ValueError, match="client"):
        run(argparse.Namespace(**{**vars(args), "client_evals": [bad]}))
    # Round 0 of an eval.clients run: the declared file exists, header only.
    (tmp_path / "client_summary.csv").unlink()
    assert run(argparse.Namespace(**{**vars(args), "evals": evals[:1], "client_evals": []})) == 0
    assert (tmp_path / "client_summary.csv").read_text().splitlines() == [",".join(CLIENT_COLUMNS)]
    with pytest.raises(SystemExit, match="--client-summary"):
        run(argparse.Namespace(**{**vars(args), "client_summary": None}))


def test_round_timings_sum_the_jobs_and_skip_a_dropped_client(tmp_path):
    from fedagent.report.summary import round_timings, timings_table

    bench = tmp_path / "b"
    bench.mkdir()
    for name, s in (
        ("train_client_0", 30.0),
        ("train_client_1", 2.0),
        ("aggregate", 5.0),
        ("merge", 4.0),
        ("eval", 20.0),
    ):
        (bench / f"{name}.tsv").write_text(f"s\th:m:s\tmax_rss\n{s}\t0:00:{int(s):02d}\t100\n")
    c0, c1 = tmp_path / "clients" / "0", tmp_path / "clients" / "1"
    c0.mkdir(parents=True)
    c1.mkdir(parents=True)
    split = {"rollout_env": 3.0, "rollout_prompt": 1.0, "rollout_sample": 5.5}
    (c0 / "metrics.json").write_text(
        json.dumps({"timings": {"cold_start_s": 12.0, "phases": {"rollout": 10.0, "train": 6.0, **split}}})
    )
    (c1 / "dropped.json").write_text("{}")  # a dropped client: no metrics
    ev = tmp_path / "eval_timings.json"
    ev.write_text(json.dumps({"cold_start_s": 8.0, "phases": {"rollout": 9.0, "rollout_sample": 2.5}}))
    row = round_timings(1, ev, sorted(bench.iterdir()), [c0, c1])
    # the rollout loop's split: the train jobs' summed, the eval's; a phase the eval did not record is empty
    assert (row["generation_env_s"], row["generation_prompt_s"], row["generation_sample_s"]) == (3.0, 1.0, 5.5)
    assert (row["eval_env_s"], row["eval_sample_s"]) == (None, 2.5)
    assert row["train_jobs"] == 1 and row["train_job_s"] == 32.0 and row["cold_start_s"] == 12.0
    assert row["generation_s"] == 10.0 and row["training_s"] == 6.0
    assert (row["aggregate_s"], row["merge_s"], row["eval_s"], row["eval_cold_start_s"]) == (5.0, 4.0, 20.0, 8.0)
    assert row["round_wall_s"] is None  # files without the jobs' start times
    # The round's span: first train job's start → the eval's end (started_at + total_s).
    c1.joinpath("dropped.json").unlink()
    for c, start in ((c0, 1000.0), (c1, 1004.5)):
        (c / "metrics.json").write_text(
            json.dumps({"timings": {"cold_start_s": 1.0, "started_at": start, "phases": {}}})
        )
    ev.write_text(json.dumps({"cold_start_s": 8.0, "phases": {"rollout": 9.0}, "started_at": 1100.25, "total_s": 20.5}))
    assert round_timings(1, ev, sorted(bench.iterdir()), [c0, c1])["round_wall_s"] == 120.75
    prev = tmp_path / "t0.csv"
    timings_table({"round": 0, "eval_s": 19.0}, None).to_csv(prev, index=False)
    table = timings_table(row, prev)
    assert list(table["round"]) == [0, 1] and table["eval_s"].tolist() == [19.0, 20.0]
