"""ALFWorld game lists: per-split manifests, task ids, task types and the canonical order.

A games root holds one folder per split, each with ``<taskdir>/<trialdir>/game.tw-pddl``
(the layout of ``$ALFWORLD_DATA/json_2.1.1`` and of :mod:`.generate`'s output). A split's
**manifest** is ``{"format", "split", "games": [sorted split-relative game paths],
"sha256": sha256 of the list}``. Loading a split:

- with a manifest: every listed game must exist (else :class:`MissingGamesError`, naming how
  many and which); games on disk that the manifest does not list are ignored;
- without one: a sorted walk (movable/sliced trials skipped, as ALFWorld does).

The **canonical order** is the sorted list, then a shuffle by a local RNG seeded from
``(base_seed, "alfworld_order")``: it depends on neither the filesystem walk order nor any
global RNG, so every node and every process sees the same tasks at the same indices.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

from fedagent.core.seeds import python_rng

GAME_FILE = "game.tw-pddl"
MANIFEST_FORMAT = "fedagent-alfworld-manifest-v1"
MANIFEST_DIR = "manifests"  # <root>/manifests/<split>.json unless a path is given
ORDER_PURPOSE = "alfworld_order"
DEFAULT_ORDER_SEED = 42  # FACTS §2: the reference shuffles with Random(42)

# ALFRED task-type folder prefix -> short task type (FACTS §4 order: 1 Pick ... 6 Pick2).
TASK_TYPES = {
    "pick_and_place_simple": "pick",
    "look_at_obj_in_light": "look",
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_two_obj_and_place": "pick_two",
}
# ALFWorld itself skips these trials (no movable receptacles / slicing in the TextWorld port).
_SKIPPED_MARKERS = ("movable", "Sliced")


class ManifestError(ValueError):
    """A manifest is malformed or its sha256 does not match its list."""


class MissingGamesError(FileNotFoundError):
    """Games listed in a manifest are missing on disk."""

    def __init__(self, split: str, root: Path, missing: Sequence[str]):
        """Keep the missing paths; the message names how many and which."""
        self.split, self.root, self.missing = split, Path(root), list(missing)
        shown = ", ".join(self.missing[:20]) + (" ..." if len(self.missing) > 20 else "")
        super().__init__(
            f"ALFWorld split {split!r}: {len(self.missing)} game(s) listed in the manifest are "
            f"missing under {self.root / split}: {shown}"
        )


def list_sha256(games: Iterable[str]) -> str:
    """sha256 of a game list: one split-relative path per line, in the given order."""
    return hashlib.sha256("\n".join(games).encode()).hexdigest()


def make_manifest(split: str, games: Iterable[str]) -> dict:
    """A manifest for ``games`` (split-relative ``game.tw-pddl`` paths; sorted here)."""
    listed = sorted(set(games))
    for rel in listed:
        _check_relpath(rel)
    return {"format": MANIFEST_FORMAT, "split": split, "games": listed, "sha256": list_sha256(listed)}


def write_manifest(path: Path, split: str, games: Iterable[str]) -> dict:
    """Write :func:`make_manifest` to ``path`` (via a temp file + rename); return it."""
    manifest = make_manifest(split, games)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, path)
    return manifest


def read_manifest(path: Path, split: str | None = None) -> dict:
    """Load and check a manifest: format, split, sorted unique list, sha256 of the list."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: unreadable manifest ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{path}: not a {MANIFEST_FORMAT} manifest")
    games = data.get("games")
    if not isinstance(games, list) or not all(isinstance(g, str) for g in games):
        raise ManifestError(f"{path}: 'games' must be a list of paths")
    if games != sorted(set(games)):
        raise ManifestError(f"{path}: 'games' must be sorted and without duplicates")
    if data.get("sha256") != list_sha256(games):
        raise ManifestError(f"{path}: sha256 of the game list does not match (edited by hand?)")
    if split is not None and data.get("split") != split:
        raise ManifestError(f"{path}: manifest is for split {data.get('split')!r}, not {split!r}")
    for rel in games:
        _check_relpath(rel)
    return data


def _check_relpath(rel: str) -> None:
    parts = Path(rel).parts
    if Path(rel).is_absolute() or ".." in parts or len(parts) != 3 or parts[-1] != GAME_FILE:
        raise ManifestError(f"bad game path {rel!r}: want <taskdir>/<trialdir>/{GAME_FILE}")


def walk_games(split_dir: Path) -> list[str]:
    """Sorted split-relative paths of every playable ``game.tw-pddl`` under ``split_dir``."""
    split_dir = Path(split_dir)
    found = []
    for dirpath, _dirnames, filenames in os.walk(split_dir):
        if GAME_FILE not in filenames:
            continue
        rel = Path(dirpath, GAME_FILE).relative_to(split_dir)
        if len(rel.parts) != 3 or any(m in str(rel) for m in _SKIPPED_MARKERS):
            continue
        found.append(rel.as_posix())
    # Sorting here is what makes the result independent of the walk order.
    return sorted(found)


def split_games(root: Path, split: str, manifest: Path | None = None, *, use_manifest: bool = True) -> list[str]:
    """Sorted split-relative game paths of ``split``: the manifest's list, else a sorted walk.

    ``manifest`` defaults to ``<root>/manifests/<split>.json``; an explicitly given manifest
    must exist. Raises :class:`MissingGamesError` if a listed game is not on disk.
    """
    root = Path(root)
    split_dir = root / split
    path = Path(manifest) if manifest is not None else root / MANIFEST_DIR / f"{split}.json"
    if use_manifest and (manifest is not None or path.is_file()):
        games = read_manifest(path, split)["games"]
        missing = [rel for rel in games if not (split_dir / rel).is_file()]
        if missing:
            raise MissingGamesError(split, root, missing)
        return list(games)
    if not split_dir.is_dir():
        raise FileNotFoundError(f"ALFWorld split folder not found: {split_dir}")
    return walk_games(split_dir)


def canonical_order(games: Sequence[str], base_seed: int = DEFAULT_ORDER_SEED) -> list[str]:
    """Sorted ``games``, then shuffled by a local RNG seeded from ``(base_seed, "alfworld_order")``."""
    ordered = sorted(games)
    python_rng(base_seed, ORDER_PURPOSE).shuffle(ordered)
    return ordered


def task_id_for(rel: str) -> str:
    """Task id of a split-relative game path: ``alfworld_<taskdir>_<trialdir>_game``."""
    taskdir, trialdir, _ = Path(rel).parts
    return f"alfworld_{taskdir}_{trialdir}_game"


def task_type_for(rel: str) -> str:
    """Short task type (pick/look/clean/heat/cool/pick_two) from the task folder's prefix."""
    prefix = Path(rel).parts[0].split("-", 1)[0]
    try:
        return TASK_TYPES[prefix]
    except KeyError:
        raise ValueError(f"{rel}: unknown ALFWorld task type {prefix!r}") from None


def validation_set(task_ids: Sequence[str], n: int) -> list[str]:
    """The first ``n`` tasks of a canonical order (seed i -> task i, as the service's index mode)."""
    if n < 0:
        raise ValueError("n must be >= 0")
    return list(task_ids[:n])
