"""TextWorld's :class:`~fedagent.core.envs.EnvSpec` (``env.kind: textworld``, the default).

Light on purpose: the registry imports this module at plan time; the source, the catalogue
command and the prompt are imported only when a job needs them.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from fedagent.core.envs import EnvSpec
from fedagent.core.rules import CrossRule

_KNOBS = ("world_size", "nb_objects", "quest_length")


def open_source(games: Path, split: str, *, tasks=None, env_params=None, client_id=None):
    """The games directory's tasks (``served``: the listed ids only, their files hashed)."""
    from fedagent.envs.textworld.games import TextWorldTaskSource

    return TextWorldTaskSource(games, served=tasks), split


def catalogue_args(config) -> str:
    """``fedagent games`` flags: only what changes the catalogue."""
    env = config["env"]
    return (
        f"games --seed {config['data_seed']} --n-train {env['train_games']} --n-val {env['val_games']}"
        f" --world-size {env['world_size']} --nb-objects {env['nb_objects']} --quest-length {env['quest_length']}"
    )


def _min_tasks_within_catalogue(get):
    # env.train_games is the generated catalogue's size (an env that builds its own count has none).
    if get("partition.min_tasks_per_client") > get("env.train_games"):
        return (
            f"{get('partition.min_tasks_per_client')} exceeds the {get('env.train_games')} train tasks "
            "(env.train_games)"
        )
    return None


SPEC = EnvSpec(
    kind="textworld",
    source="fedagent.envs.textworld.spec:open_source",
    catalogue="fedagent.envs.textworld.games",
    catalogue_args=catalogue_args,
    catalogue_jobs=True,
    catalogue_keys=lambda env: {k: env[k] for k in ("train_games", "val_games", *_KNOBS)},
    prompt_templates={"textworld": "fedagent.envs.textworld.prompt:TEMPLATE"},
    schema=yaml.safe_load((Path(__file__).parent / "schema.yaml").read_text()),
    cross_rules=(
        CrossRule(
            "partition.min_tasks_per_client",
            ("partition.min_tasks_per_client", "env.train_games", "env.kind"),
            _min_tasks_within_catalogue,
            {"env.train_games": 4, "partition.min_tasks_per_client": 5},
        ),
    ),
    single_task_type=True,
    preload=("fedagent.envs.textworld.games", "fedagent.envs.textworld.env", "textworld"),
    commands={"games": ("fedagent.envs.textworld.games", "generate the TextWorld train/val game pools")},
)
