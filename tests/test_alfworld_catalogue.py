"""The run's ALFWorld catalogue (plan/games) over real-data layout: manifests, canonical order
from data_seed, split mapping for the services."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedagent.envs.alfworld import assets, data

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not assets.alfworld_available(), reason="alfworld not installed (scripts/install-alfworld.sh)"),
]


@pytest.fixture(scope="module")
def real_root(tmp_path_factory) -> Path:
    # Generated games have the real data's layout (+ manifests), so they stand in for it.
    from fedagent.envs.alfworld.generate import generate_games

    root = tmp_path_factory.mktemp("alfreal") / "json_2.1.1"
    generate_games(root, base_seed=5, splits={"train": 5, "valid_seen": 2}, n_distractors=(1, 2))
    return root.parent


def test_real_data_catalogue_by_reference(real_root, tmp_path):
    from fedagent.envs.alfworld.catalogue import build_catalogue, source_from_catalogue

    a = build_catalogue(tmp_path / "a", data_seed=42, n_train=4, n_val=2, real_data=real_root)
    b = build_catalogue(tmp_path / "b", data_seed=43, n_train=4, n_val=2, real_data=real_root)
    rels = json.loads((real_root / "json_2.1.1/manifests/train.json").read_text())["games"]
    order42 = [data.task_id_for(r) for r in data.canonical_order(rels, 42)]
    assert a["train"] == order42[:4] and a["root"] == str((real_root / "json_2.1.1").resolve())
    assert a["train"] != b["train"]  # data_seed orders the pool
    assert a["manifest_sha256"]["train"] == data.list_sha256(rels)
    assert set(a["task_types"].values()) <= set(data.TASK_TYPES.values())
    assert not (tmp_path / "a" / "alfworld").exists()  # referenced, not copied
    source, split = source_from_catalogue(tmp_path / "a", "val")
    assert split == "valid_seen" and set(a["val"]) <= set(source.task_ids("valid_seen"))
    with pytest.raises(ValueError, match="asked for"):
        build_catalogue(tmp_path / "c", data_seed=42, n_train=9, n_val=2, real_data=real_root)


def test_missing_listed_game_is_an_error(real_root, tmp_path):
    from fedagent.envs.alfworld.catalogue import build_catalogue

    copy = tmp_path / "copy"
    shutil.copytree(real_root, copy)
    first = json.loads((copy / "json_2.1.1/manifests/train.json").read_text())["games"][0]
    (copy / "json_2.1.1/train" / first).unlink()
    with pytest.raises(data.MissingGamesError, match="missing"):
        build_catalogue(tmp_path / "d", data_seed=42, n_train=2, n_val=1, real_data=copy)
