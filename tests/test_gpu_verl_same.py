"""scripts/gpu/verl-same.py: a warm job's update dir against the same job's on fresh engines."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("verl_same", REPO / "scripts" / "gpu" / "verl-same.py")
verl_same = importlib.util.module_from_spec(spec)
spec.loader.exec_module(verl_same)


def _update(d: Path, texts: dict, seeds_off=False, w=None, critic=None, warm=None, reverse=False):
    d.mkdir(parents=True)
    with open(d / "samples.jsonl", "w") as fh:  # (episodes pair by their place, not the file's order)
        for (e, g, s), turns in sorted(texts.items(), reverse=reverse):
            fh.write(
                json.dumps(
                    {
                        "epoch": e,
                        "group": g,
                        "session": s,
                        "task_id": f"t{g}",
                        "turns": [
                            {"text": t, "sampling_seed": 1000 * g + 10 * s + k + (1 if seeds_off else 0)}
                            for k, t in enumerate(turns)
                        ],
                    }
                )
                + "\n"
            )
    (d / "metrics.json").write_text(
        json.dumps(
            {
                "round": 2,
                "client": 0,
                "kl": 0.01,
                "mean_return": 0.5,
                "verl": {"engine_set": {"warm": warm}} if warm is not None else {},
            }
        )
    )
    if w is not None:
        save_file({"a": w}, d / "model.safetensors")
    if critic is not None:
        (d / "critic").mkdir()
        save_file({"v": critic}, d / "critic" / "model.safetensors")
    return d


def test_turns_seeds_and_the_updates_relative_difference(tmp_path):
    start = torch.zeros(4)
    cold_w, warm_w = torch.tensor([1.0, 0, 0, 0]), torch.tensor([1.0, 0.1, 0, 0])
    texts = {(0, 0, 0): ["go", "take"], (0, 0, 1): ["look"], (0, 1, 0): ["go", "open"]}
    other = {**texts, (0, 1, 0): ["go", "close"]}  # one turn of four differs
    s = _update(tmp_path / "start", {}, w=start, critic=torch.zeros(2))
    cold = _update(tmp_path / "cold", texts, w=cold_w, critic=torch.tensor([2.0, 0]), reverse=True)
    warm = _update(tmp_path / "warm", other, w=warm_w, critic=torch.tensor([2.0, 0]), warm=True)
    r = verl_same.compare(warm, cold, s)
    assert (r["episodes"], r["turns"]) == (3, 5)
    assert r["task_ids_equal"] == 1.0 and r["seeds_equal"] == 1.0
    assert r["identical_turns"] == pytest.approx(4 / 5) and r["identical_episodes"] == pytest.approx(2 / 3)
    assert r["update_rel_diff"] == pytest.approx(0.1) and r["critic_rel_diff"] == 0.0
    assert r["steps"]["kl"] == [0.01, 0.01] and r["warm"] is True
    row = verl_same.row(r)
    assert row.startswith("| round 2, client 0 (warm vs cold) | 3 | 1.000 | 1.000 | 0.800 | 0.667 | 0.1 | 0 |")
    # an episode one turn longer in one of them (its texts differed): its seeds are still the same draws
    longer = _update(tmp_path / "longer", {**texts, (0, 0, 1): ["look", "go"]}, w=cold_w)
    r2 = verl_same.compare(longer, cold)
    assert r2["seeds_equal"] == 1.0 and r2["identical_turns"] == pytest.approx(5 / 6)
    assert r2["equal_lengths"] == pytest.approx(2 / 3)
    # another job's seeds (or none): not the same draws, and said so
    off = _update(tmp_path / "off", texts, seeds_off=True, w=cold_w)
    assert verl_same.compare(off, cold)["seeds_equal"] == 0.0
    # episodes that do not pair up are an error, not a partial comparison
    short = _update(tmp_path / "short", {(0, 0, 0): ["go", "take"]})
    with pytest.raises(ValueError, match="different episodes"):
        verl_same.compare(short, cold)


def test_the_script_prints_the_row_and_writes_the_numbers(tmp_path, capsys):
    texts = {(0, 0, 0): ["go"]}
    cold = _update(tmp_path / "cold", texts, w=torch.ones(2))
    warm = _update(tmp_path / "warm", texts, w=torch.ones(2), warm=True)
    s = _update(tmp_path / "start", {}, w=torch.zeros(2))
    assert verl_same.main([str(warm), str(cold), "--start", str(s), "--json", str(tmp_path / "o.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == verl_same.HEADER and out[1].count("|") == out[0].count("|")
    assert json.loads((tmp_path / "o.json").read_text())["update_rel_diff"] == 0.0
    assert not math.isnan(json.loads((tmp_path / "o.json").read_text())["identical_turns"])
