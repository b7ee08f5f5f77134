"""Reading the task catalogue (the games directory's games.json), verified."""

from __future__ import annotations

import json
from pathlib import Path

from fedagent.core import envs
from fedagent.core.atomic import verify_manifest

GAMES_INDEX = "games.json"


def load_games_index(games_dir: Path, check_hashes: bool = False) -> dict:
    """games.json of a verified games directory: {"train": [...], "val": [...], "sha256": ...}.

    Task lists are kept in their canonical (stored) order; nothing depends on a directory walk.
    """
    games_dir = Path(games_dir)
    verify_manifest(games_dir, check_hashes=check_hashes)
    index = json.loads((games_dir / GAMES_INDEX).read_text())
    for split in ("train", "val"):
        if not isinstance(index.get(split), list) or not index[split]:
            raise ValueError(f"{games_dir / GAMES_INDEX}: split {split!r} is missing or empty")
    return index


def games_kind(games_dir: Path) -> str:
    """The env source a task directory serves: its games.json ``kind`` (TextWorld dirs have none)."""
    index = json.loads((Path(games_dir) / GAMES_INDEX).read_text())
    return str(index.get("kind") or index.get("source") or envs.UNNAMED_CATALOGUE_KIND)
