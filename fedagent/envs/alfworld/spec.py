"""ALFWorld's :class:`~fedagent.core.envs.EnvSpec` (``env.kind: alfworld``): generated games or real data.

Light on purpose: the registry imports this module at plan time (nothing of ``alfworld`` or
``textworld`` is imported here).
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from fedagent.core.envs import EnvSpec
from fedagent.core.errors import ConfigError


def open_source(games: Path, split: str, *, tasks=None, env_params=None, client_id=None):
    """A run's catalogue (plan/games: its split names the real split) or an ALFWorld root (one split)."""
    from fedagent.envs.alfworld import AlfworldTaskSource

    if (Path(games) / "games.json").is_file():
        from fedagent.envs.alfworld.catalogue import source_from_catalogue

        return source_from_catalogue(games, split)
    return AlfworldTaskSource(games, splits=[split]), split


def catalogue_args(config) -> str:
    """``fedagent alfworld-pool`` flags: only what changes the catalogue."""
    env, alf = config["env"], config["env"]["alfworld"]
    cmd = (
        f"alfworld-pool --seed {config['data_seed']} --n-train {env['train_games']} --n-val {env['val_games']}"
        f" --val-split {alf['val_split']}"
    )
    if alf["data"]:
        cmd += f" --data {alf['data']}"
    if alf["manifests"]:
        cmd += f" --manifests {alf['manifests']}"
    return cmd


def check(config: dict) -> None:
    """``env.alfworld.data``: only with env.kind alfworld, and a directory."""
    env = config["env"]
    alf = env.get("alfworld") or {}
    if alf.get("data") and env["kind"] != "alfworld":
        raise ConfigError("config key 'env.alfworld.data': set, but env.kind is not alfworld")
    if alf.get("data") and not Path(alf["data"]).is_dir():
        raise ConfigError(f"config key 'env.alfworld.data': {alf['data']} is not a directory")


SPEC = EnvSpec(
    kind="alfworld",
    source="fedagent.envs.alfworld.spec:open_source",
    catalogue="fedagent.envs.alfworld.catalogue",
    catalogue_args=catalogue_args,
    catalogue_jobs=True,
    catalogue_keys=lambda env: {
        "train_games": env["train_games"],
        "val_games": env["val_games"],
        "alfworld": copy.deepcopy(env["alfworld"]),
    },
    prompt_templates={"alfworld": "fedagent.envs.alfworld.prompt:TEMPLATE"},
    schema=yaml.safe_load((Path(__file__).parent / "schema.yaml").read_text()),
    check=check,
    scene_ids=True,
    labels_expert="fedagent.envs.alfworld.expert:catalogue_labels",
    commands={
        "alfworld-games": ("fedagent.envs.alfworld.generate", "generate solvable ALFWorld games offline"),
        "alfworld-pool": ("fedagent.envs.alfworld.catalogue", "the ALFWorld task catalogue of a run (plan/games)"),
    },
)
