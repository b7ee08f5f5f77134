"""ALFWorld game lists without the alfworld package: manifests, ids, types, canonical order."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fedagent.envs.alfworld import data
from fedagent.envs.alfworld.source import AlfworldTaskSource, resolve_data_root

GAMES = [
    "pick_and_place_simple-Book-None-SideTable-329/trial_T20190908_050633_745514/game.tw-pddl",
    "look_at_obj_in_light-CD-None-DeskLamp-308/trial_T20190908_222917_366542/game.tw-pddl",
    "pick_clean_then_place_in_recep-Apple-None-Fridge-1/trial_T20190906_185223_511218/game.tw-pddl",
    "pick_heat_then_place_in_recep-Egg-None-CounterTop-2/trial_T20190907_000036_612543/game.tw-pddl",
    "pick_cool_then_place_in_recep-Mug-None-Cabinet-5/trial_T20190909_115104_137391/game.tw-pddl",
    "pick_two_obj_and_place-Pen-None-Desk-310/trial_T20190907_231239_540278/game.tw-pddl",
    "pick_and_place_simple-Cup-None-Shelf-7/trial_T20190908_114348_913117/game.tw-pddl",
    "pick_and_place_simple-Cup-None-Shelf-7/trial_T20190908_114401_143210/game.tw-pddl",
]


def _tree(root: Path, games, split="train", reverse=False, manifest=True):
    """Write placeholder games (creation order reversible) and optionally a manifest."""
    for rel in sorted(games, reverse=reverse):
        p = root / split / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"rel": rel}))
    if manifest:
        data.write_manifest(root / data.MANIFEST_DIR / f"{split}.json", split, games)
    return root


def test_task_ids_and_types():
    assert data.task_id_for(GAMES[0]) == (
        "alfworld_pick_and_place_simple-Book-None-SideTable-329_trial_T20190908_050633_745514_game"
    )
    assert [data.task_type_for(g) for g in GAMES[:6]] == ["pick", "look", "clean", "heat", "cool", "pick_two"]
    with pytest.raises(ValueError):
        data.task_type_for("pick_and_place_with_movable_recep-X-Y-Z-1/trial_1/game.tw-pddl")


def test_manifest_missing_game_is_an_error_naming_count_and_paths(tmp_path):
    root = _tree(tmp_path, GAMES)
    gone = [GAMES[2], GAMES[5]]
    for rel in gone:
        (root / "train" / rel).unlink()
    with pytest.raises(data.MissingGamesError) as err:
        data.split_games(root, "train")
    assert err.value.missing == sorted(gone)
    msg = str(err.value)
    assert "2 game(s)" in msg and all(rel in msg for rel in gone)
    with pytest.raises(data.MissingGamesError):
        AlfworldTaskSource(root, splits=("train",))


def test_manifest_ignores_extra_games_on_disk(tmp_path):
    root = _tree(tmp_path, GAMES[:5])
    expected = AlfworldTaskSource(root, splits=("train",)).task_ids("train")
    _tree(tmp_path, GAMES[5:], manifest=False)  # extras, not in the manifest
    assert data.split_games(root, "train") == sorted(GAMES[:5])
    assert AlfworldTaskSource(root, splits=("train",)).task_ids("train") == expected
    # Without the manifest the walk sees them all.
    assert data.split_games(root, "train", use_manifest=False) == sorted(GAMES)


def test_manifest_tampering_is_detected(tmp_path):
    root = _tree(tmp_path, GAMES)
    path = root / data.MANIFEST_DIR / "train.json"
    m = json.loads(path.read_text())
    m["games"] = m["games"][1:]
    path.write_text(json.dumps(m))
    with pytest.raises(data.ManifestError, match="sha256"):
        data.split_games(root, "train")


@pytest.mark.parametrize("with_manifest", [True, False])
def test_order_and_val_set_independent_of_walk_order(tmp_path, monkeypatch, with_manifest):
    a = _tree(tmp_path / "a", GAMES, manifest=with_manifest)
    b = _tree(tmp_path / "b", GAMES, reverse=True, manifest=with_manifest)  # files created in reverse
    src_a = AlfworldTaskSource(a, splits=("train",), base_seed=3)
    order = src_a.task_ids("train")

    real_walk, real_listdir = os.walk, os.listdir

    def reversed_walk(top, *args, **kwargs):
        for dirpath, dirnames, filenames in real_walk(top, *args, **kwargs):
            dirnames.reverse()
            yield dirpath, dirnames, list(reversed(filenames))

    monkeypatch.setattr(os, "walk", reversed_walk)
    monkeypatch.setattr(os, "listdir", lambda p=".": list(reversed(real_listdir(p))))
    src_b = AlfworldTaskSource(b, splits=("train",), base_seed=3)
    assert src_b.task_ids("train") == order
    assert src_b.validation_set("train", 5) == src_a.validation_set("train", 5) == order[:5]
    # The order is a seeded shuffle of the sorted list, not the sorted list itself.
    assert sorted(order) == sorted(data.task_id_for(g) for g in GAMES)
    assert order == [data.task_id_for(g) for g in data.canonical_order(GAMES, 3)]
    assert AlfworldTaskSource(a, splits=("train",), base_seed=4).task_ids("train") != order


def test_data_root_from_env(tmp_path, monkeypatch):
    (tmp_path / "json_2.1.1" / "train").mkdir(parents=True)
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    assert resolve_data_root() == tmp_path / "json_2.1.1"
    monkeypatch.delenv("ALFWORLD_DATA")
    assert resolve_data_root() is None
