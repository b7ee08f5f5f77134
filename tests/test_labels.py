"""`fedagent labels`: a reference policy plays every train task exactly once; the file feeds hardness."""

import json
import subprocess
import sys

import pytest

from env_fixtures import tw_games_dir
from fedagent.partition import load_labels


@pytest.mark.slow
def test_labels_cover_every_train_task_once_and_are_deterministic(tmp_path):
    games = tw_games_dir(n_train=3, n_val=1, seed=7)
    params = json.dumps({"base_seed": 42, "temperature": 1.0, "max_turns": 2, "max_new_tokens": 8,
                         "max_prompt_tokens": 256, "pool_size": 2})
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name / "labels.json"
        subprocess.run([sys.executable, "-m", "fedagent.cli", "labels", "--policy", "tiny", "--games", str(games),
                        "--params", params, "--out", str(out)], check=True, capture_output=True, text=True)
        outs.append(out)
    data = json.loads(outs[0].read_text())
    index = json.loads((games / "games.json").read_text())
    assert sorted(data["labels"]) == sorted(index["train"]) and data["n"] == 3
    assert data["easy"] == sum(data["labels"].values())
    assert outs[0].read_bytes() == outs[1].read_bytes()
    assert load_labels(outs[0]) == data["labels"]


def test_reference_trajectories_schema_last_wins(tmp_path):
    p = tmp_path / "traj.json"
    p.write_text(json.dumps({"trajectories": [
        {"task_info": {"task_id": "a"}, "traj_info": {"success": True}},
        {"task_info": {"task_id": "b"}, "traj_info": {"success": False}},
        {"task_info": {"task_id": "a"}, "traj_info": {"success": False}}]}))
    assert load_labels(p) == {"a": False, "b": False}
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError):
        load_labels(bad)


@pytest.mark.slow
def test_random_reference_policy_is_seeded_and_wins_some(tmp_path):
    from fedagent.envs.textworld_games import generate_games

    games = tmp_path / "games"     # the -small presets' games (quest length 1)
    generate_games(games, base_seed=42, n_train=8, n_val=1, jobs=2, world_size=1, nb_objects=2, quest_length=1)
    params = json.dumps({"base_seed": 42, "temperature": 1.0, "max_turns": 2, "max_new_tokens": 8,
                         "max_prompt_tokens": 256, "pool_size": 2})
    outs = []
    for name, hashseed in (("a", "1"), ("b", "2")):
        out = tmp_path / name / "labels.json"
        env = {**__import__("os").environ, "PYTHONHASHSEED": hashseed}
        subprocess.run([sys.executable, "-m", "fedagent.cli", "labels", "--policy", "random", "--games", str(games),
                        "--params", params, "--out", str(out)], check=True, capture_output=True, text=True, env=env)
        outs.append(out)
    data = json.loads(outs[0].read_text())
    assert outs[0].read_bytes() == outs[1].read_bytes()
    assert data["n"] == 8 and 1 <= data["easy"] < 8     # a random walker wins some of these in 2 turns
