"""`fedagent labels`: a reference policy plays every train task exactly once; the file feeds hardness."""

import json
import subprocess
import sys

import pytest

from env_fixtures import tw_games_dir
from fedagent.partition import load_labels


@pytest.mark.slow
def test_labels_cover_every_train_task_once_and_are_deterministic(tmp_path):
    games = tw_games_dir()  # the env tests' games (2 train, 1 val), generated once per process
    params = json.dumps(
        {
            "base_seed": 42,
            "temperature": 1.0,
            "max_turns": 2,
            "max_new_tokens": 8,
            "max_prompt_tokens": 256,
            "pool_size": 2,
        }
    )
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name / "labels.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "fedagent.cli",
                "labels",
                "--policy",
                "tiny",
                "--games",
                str(games),
                "--params",
                params,
                "--out",
                str(out),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        outs.append(out)
    data = json.loads(outs[0].read_text())
    index = json.loads((games / "games.json").read_text())
    assert sorted(data["labels"]) == sorted(index["train"]) and data["n"] == 2
    assert data["easy"] == sum(data["labels"].values())
    assert outs[0].read_bytes() == outs[1].read_bytes()
    assert load_labels(outs[0]) == data["labels"]


def test_reference_trajectories_schema_last_wins(tmp_path):
    p = tmp_path / "traj.json"
    p.write_text(
        json.dumps(
            {
                "trajectories": [
                    {"task_info": {"task_id": "a"}, "traj_info": {"success": True}},
                    {"task_info": {"task_id": "b"}, "traj_info": {"success": False}},
                    {"task_info": {"task_id": "a"}, "traj_info": {"success": False}},
                ]
            }
        )
    )
    assert load_labels(p) == {"a": False, "b": False}
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError):
        load_labels(bad)


def _labels_in_two_processes(tmp_path, args: list[str]) -> list:
    """``fedagent labels ARGS`` in two processes with different hash seeds; their output paths."""
    import os

    outs = []
    for name, hashseed in (("a", "1"), ("b", "2")):
        out = tmp_path / name / "labels.json"
        subprocess.run(
            [sys.executable, "-m", "fedagent.cli", "labels", *args, "--out", str(out)],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": hashseed},
        )
        outs.append(out)
    return outs


@pytest.mark.slow
def test_random_reference_policy_is_seeded_and_wins_some(tmp_path):
    from fedagent.envs.textworld.games import generate_games

    # The -small presets' games (quest length 1), the first 3 of their pool: games are made (and
    # deduplicated) in index order, so these are the pool's first 3, and the walker wins 1 of them
    # (tw-train-0002; of the first 8 it wins 2). Each game is ~5 s of tw-make.
    games = tmp_path / "games"
    generate_games(games, base_seed=42, n_train=3, n_val=1, jobs=2, world_size=1, nb_objects=2, quest_length=1)
    params = json.dumps(
        {
            "base_seed": 42,
            "temperature": 1.0,
            "max_turns": 2,
            "max_new_tokens": 8,
            "max_prompt_tokens": 256,
            "pool_size": 2,
        }
    )
    outs = _labels_in_two_processes(tmp_path, ["--policy", "random", "--games", str(games), "--params", params])
    data = json.loads(outs[0].read_text())
    assert outs[0].read_bytes() == outs[1].read_bytes()
    assert data["n"] == 3 and 1 <= data["easy"] < 3  # a random walker wins some of these in 2 turns


@pytest.fixture(scope="module")
def alfworld_catalogue(tmp_path_factory):
    from fedagent.envs.alfworld.assets import alfworld_available
    from fedagent.envs.alfworld.catalogue import build_catalogue

    if not alfworld_available():
        pytest.skip("alfworld not installed (scripts/install-alfworld.sh)")
    out = tmp_path_factory.mktemp("alf") / "games"  # the first 6 of the ALFWorld -small presets' pool
    build_catalogue(out, data_seed=42, n_train=6, n_val=1)
    return out


@pytest.mark.slow
def test_noisy_expert_plays_the_plan_at_p1_and_loses_long_plans_under_noise(alfworld_catalogue):
    from fedagent.envs.alfworld.catalogue import source_from_catalogue
    from fedagent.envs.alfworld.expert import noisy_expert_labels

    source, _ = source_from_catalogue(alfworld_catalogue, "train")
    train = json.loads((alfworld_catalogue / "games.json").read_text())["train"]
    exact = noisy_expert_labels(source, train, 42, 1.0, 30)
    assert [s["task_id"] for s in exact] == train
    assert all(s["won"] and s["turns"] == s["plan_len"] == s["expert_moves"] for s in exact)
    noisy = noisy_expert_labels(source, train, 42, 0.7, 12)
    won = [s["won"] for s in noisy]
    assert 1 <= sum(won) < len(won)  # a real split: some easy, some hard
    assert all(s["turns"] == 12 for s in noisy if not s["won"])
    assert all(s["turns"] > s["plan_len"] for s in noisy if s["expert_moves"] < s["turns"] and s["won"])
    assert noisy_expert_labels(source, train, 42, 0.7, 12) == noisy  # seeded: replays exactly
    assert noisy_expert_labels(source, train, 43, 0.7, 12) != noisy


@pytest.mark.slow
def test_expert_labels_cli_is_deterministic_across_processes_and_says_what_it_is(alfworld_catalogue, tmp_path):
    params = json.dumps(
        {
            "base_seed": 42,
            "temperature": 1.0,
            "max_turns": 12,
            "max_new_tokens": 8,
            "max_prompt_tokens": 256,
            "pool_size": 1,
        }
    )
    outs = _labels_in_two_processes(
        tmp_path, ["--policy", "expert", "--expert-p", "0.7", "--games", str(alfworld_catalogue), "--params", params]
    )
    assert outs[0].read_bytes() == outs[1].read_bytes()
    data = json.loads(outs[0].read_text())
    assert data["policy"] == "expert" and data["expert_p"] == 0.7 and "noisy planner" in data["reference"]
    assert data["n"] == 6 and 1 <= data["easy"] < 6 and load_labels(outs[0]) == data["labels"]
    assert sorted(data["episodes"]) == sorted(data["labels"])
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedagent.cli",
            "labels",
            "--policy",
            "random",
            "--expert-p",
            "0.5",
            "--games",
            str(alfworld_catalogue),
            "--params",
            params,
            "--out",
            str(tmp_path / "x.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "--expert-p" in bad.stderr
