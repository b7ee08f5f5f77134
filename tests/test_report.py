"""Report: one row per round in numeric order, round 0 = base; a curve that is a real PNG."""

import json

import pytest

from fedagent.report import plot_curves, summary_table


def _eval(path, r, sr):
    path.write_text(json.dumps({"round": r, "n": 4, "success_rate": sr, "ci95": [0.0, 0.5],
                                "score_mean": sr, "return_mean": 10 * sr}))
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
