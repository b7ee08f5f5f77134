"""Config checks of the experiment matrix: each bad combination is one ConfigError naming its key."""

import pytest

from fedagent.core.config import ConfigError, load_config

BASE = "config/config.yaml"


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"clients.pinned": 2}, "clients.pinned"),  # N = 2: ids 0..1
        ({"clients.pinned": 1}, "clients.per_round"),  # pinned needs M = 1
        ({"partition.strategy": "hardness"}, "partition.labels"),  # no labels source
        ({"partition.strategy": "hardness", "partition.labels": "/nonexistent.json"}, "partition.labels"),
        ({"partition.strategy": "env_disjoint"}, "partition.strategy"),  # TextWorld has no scenes
        ({"partition.strategy": "preference"}, "partition.strategy"),  # one task type
        ({"partition.strategy": "task_disjoint", "clients.total": 5, "clients.per_round": 1}, "env.train_games"),
        ({"env.alfworld": {"data": "/nonexistent"}}, "env.alfworld.data"),
        ({"env.kind": "minecraft"}, "env.kind"),
        (
            {"partition.strategy": "hardness", "partition.labels_model": "expert"},
            "partition.labels_model",
        ),  # no planner
        (
            {"partition.strategy": "hardness", "partition.labels_model": "expert", "partition.labels_expert_p": 1.5},
            "partition.labels_expert_p",
        ),
        ({"partition.fallback": "nope"}, "partition.fallback"),
    ],
)
def test_bad_combination_names_its_key(overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(BASE, overrides)


def test_good_combinations_and_defaults():
    cfg = load_config(BASE, {"clients.pinned": 1, "clients.per_round": 1})
    assert cfg["data_seed"] == 42 and cfg["seed"] == 42 and cfg["eval"]["clients"] is False
    cfg = load_config(BASE, {"env.kind": "alfworld", "partition.strategy": "env_disjoint"})
    assert cfg["partition"]["env_div"] == 0.7 and cfg["partition"]["fallback"] == "skip"
    cfg = load_config(BASE, {"partition.strategy": "hardness", "partition.labels_model": "tiny"})
    assert cfg["partition"]["success_std"] == 256
    cfg = load_config(
        BASE, {"env.kind": "alfworld", "partition.strategy": "hardness", "partition.labels_model": "expert"}
    )
    assert cfg["partition"]["labels_expert_p"] == 0.5
