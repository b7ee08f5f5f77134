"""ALFWorld games (real data or generated) as a :class:`fedagent.envs.base.TaskSource`.

Real data: ``AlfworldTaskSource.from_env()`` reads ``$ALFWORLD_DATA`` (the folder holding
``json_2.1.1/<split>/...``, or the split parent itself). Generated games: point ``root`` at
the output of :func:`fedagent.envs.alfworld.generate.generate_games`. Both go through the same
manifest check and canonical order (:mod:`.data`) and the same env (:mod:`.env`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from fedagent.envs.alfworld import data

REAL_SUBDIR = "json_2.1.1"
REAL_SPLITS = ("train", "valid_seen", "valid_unseen")


def resolve_data_root(path: str | os.PathLike | None = None) -> Path | None:
    """The games root from ``path`` or ``$ALFWORLD_DATA`` (descending into ``json_2.1.1``); None if unset."""
    raw = path if path is not None else os.environ.get("ALFWORLD_DATA")
    if not raw:
        return None
    root = Path(raw).expanduser()
    return root / REAL_SUBDIR if (root / REAL_SUBDIR).is_dir() else root


class AlfworldTaskSource:
    """The games of some splits under ``root``, in canonical order, checked against manifests."""

    prompt_template = "alfworld"  # the reference's ALFWorld prompt (fedagent.rollout.prompts)

    def __init__(
        self,
        root: str | os.PathLike,
        splits: Iterable[str] = ("train", "valid_seen"),
        *,
        base_seed: int = data.DEFAULT_ORDER_SEED,
        manifest_dir: str | os.PathLike | None = None,
        use_manifest: bool = True,
    ):
        """Load each split's game list (manifest or sorted walk) and fix its canonical order.

        ``manifest_dir`` holds ``<split>.json`` manifests kept outside the data folder (e.g.
        checked into the repository for real ALFWorld data); default ``<root>/manifests``.
        """
        self.root = Path(root)
        self.base_seed = int(base_seed)
        self._order: dict[str, list[str]] = {}
        self._paths: dict[str, Path] = {}
        self._types: dict[str, str] = {}
        for split in splits:
            manifest = Path(manifest_dir) / f"{split}.json" if manifest_dir is not None else None
            rels = data.split_games(self.root, split, manifest, use_manifest=use_manifest)
            ids = []
            for rel in data.canonical_order(rels, self.base_seed):
                tid = data.task_id_for(rel)
                if tid in self._paths:
                    raise ValueError(f"task id {tid} appears twice (splits overlap?)")
                self._paths[tid] = self.root / split / rel
                self._types[tid] = data.task_type_for(rel)
                ids.append(tid)
            self._order[split] = ids

    @classmethod
    def from_env(cls, path: str | os.PathLike | None = None, **kwargs) -> "AlfworldTaskSource":
        """Real ALFWorld data from ``path`` or ``$ALFWORLD_DATA``; raises if neither is set."""
        root = resolve_data_root(path)
        if root is None:
            raise FileNotFoundError("ALFWORLD_DATA is not set and no data path was given")
        return cls(root, **kwargs)

    def task_ids(self, split: str) -> list[str]:
        """Canonical task order of ``split``."""
        if split not in self._order:
            raise ValueError(f"split {split!r} not loaded (have {sorted(self._order)})")
        return list(self._order[split])

    def task_type(self, task_id: str) -> str:
        """pick / look / clean / heat / cool / pick_two; KeyError for an unknown id."""
        return self._types[task_id]

    def game_path(self, task_id: str) -> Path:
        """The task's ``game.tw-pddl`` file."""
        return self._paths[task_id]

    def validation_set(self, split: str, n: int) -> list[str]:
        """The first ``n`` tasks of ``split``'s canonical order."""
        return data.validation_set(self.task_ids(split), n)

    def make_env(self, max_turns: int = 50, *, policy_commands: bool = False):
        """A fresh :class:`AlfworldEnv` able to play every loaded task."""
        from fedagent.envs.alfworld.env import AlfworldEnv

        return AlfworldEnv(self._paths, self._types, max_turns=max_turns, policy_commands=policy_commands)
