"""ALFWorld for fedagent: real data (``$ALFWORLD_DATA``) or games generated offline, one env.

- :mod:`.data`      manifests, task ids/types, canonical order (no filesystem-order dependence)
- :mod:`.generate`  PDDL games from the floor plans the ``alfworld`` package ships
- :mod:`.env`       the TextEnv over TextWorld's PddlEnv + ALFWorld's wrappers
- :mod:`.source`    the TaskSource over a games root
- :mod:`.assets`    side-effect-free access to the installed ``alfworld`` package

Nothing here imports ``alfworld``/``textworld`` at import time.
"""

from fedagent.envs.alfworld.assets import alfworld_available
from fedagent.envs.alfworld.data import (
    MissingGamesError,
    ManifestError,
    canonical_order,
    split_games,
    task_id_for,
    task_type_for,
)
from fedagent.envs.alfworld.source import AlfworldTaskSource, resolve_data_root

__all__ = [
    "AlfworldTaskSource",
    "ManifestError",
    "MissingGamesError",
    "alfworld_available",
    "canonical_order",
    "resolve_data_root",
    "split_games",
    "task_id_for",
    "task_type_for",
]
