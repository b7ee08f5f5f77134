"""``fedagent alfworld-pool``: the ALFWorld task catalogue of a run (its ``plan/games``).

Generated games (default): :func:`.generate.generate_games` from the floor plans the
``alfworld`` package ships, seeded by ``data_seed``, written inside the catalogue folder.
Real data (``--data``, optionally ``--manifests``): the folder is referenced, not copied;
the per-split manifests (sha256 of the sorted game list) pin the game set.

Either way the catalogue's ``games.json`` uses the same contract as TextWorld's, so
``partition``, ``val-set``, ``train-client`` and ``eval`` read it unchanged::

    {"format": "fedagent-alfworld-games-v1", "source": "alfworld", "root": "alfworld" | abs path,
     "manifests": null | abs path, "splits": {"train": "train", "val": "valid_seen"},
     "train": [ids: the first n_train of the canonical order], "val": [first n_val of the val split],
     "task_types": {id: pick|look|clean|heat|cool|pick_two}, "files": {id: split-relative path},
     "manifest_sha256": {split: sha256 of its full game list}, "knobs": {...}, "sha256": ...}

The canonical order is :func:`.data.canonical_order` seeded by ``data_seed`` (the reference
uses ``Random(42)``: the default data_seed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedagent.core.atomic import atomic_dir
from fedagent.envs.alfworld import data
from fedagent.envs.textworld.games import GAMES_JSON, id_list_sha256

FORMAT = "fedagent-alfworld-games-v1"
GENERATED_ROOT = "alfworld"


def build_catalogue(
    out: Path,
    *,
    data_seed: int,
    n_train: int,
    n_val: int,
    val_split: str = "valid_seen",
    real_data: Path | None = None,
    manifests: Path | None = None,
    quarantine_root: Path | None = None,
    jobs: int = 1,
) -> dict:
    """Write the catalogue folder ``out`` atomically; return its games.json (``jobs``: processes
    generating games at once; the same catalogue for any value)."""
    from fedagent.envs.alfworld.source import AlfworldTaskSource, resolve_data_root

    with atomic_dir(Path(out), quarantine_root) as staging:
        if real_data is None:
            from fedagent.envs.alfworld.generate import generate_games

            root_rel = GENERATED_ROOT
            root = staging / root_rel
            generate_games(root, base_seed=data_seed, splits={"train": n_train, val_split: n_val}, jobs=jobs)
            manifest_dir = None
        else:
            root = resolve_data_root(real_data)
            root_rel = str(Path(root).resolve())
            manifest_dir = Path(manifests).resolve() if manifests else None
        source = AlfworldTaskSource(root, splits=("train", val_split), base_seed=data_seed, manifest_dir=manifest_dir)
        train, val = source.task_ids("train"), source.task_ids(val_split)
        if len(train) < n_train or len(val) < n_val:
            raise ValueError(
                f"ALFWorld has {len(train)} train / {len(val)} {val_split} games, asked for {n_train} / {n_val}"
            )
        train, val = train[:n_train], val[:n_val]
        mdir = manifest_dir or Path(root) / data.MANIFEST_DIR
        msha = {}
        for split in ("train", val_split):
            mfile = mdir / f"{split}.json"
            msha[split] = data.read_manifest(mfile, split)["sha256"] if mfile.is_file() else None
        games = {
            "format": FORMAT,
            "source": "alfworld",
            "root": root_rel,
            "manifests": str(manifest_dir) if manifest_dir else None,
            "splits": {"train": "train", "val": val_split},
            "train": train,
            "val": val,
            "task_types": {t: source.task_type(t) for t in train + val},
            "files": {t: str(source.game_path(t).relative_to(root)) for t in train + val},
            "manifest_sha256": msha,
            "knobs": {
                "data_seed": int(data_seed),
                "n_train": n_train,
                "n_val": n_val,
                "val_split": val_split,
                "generated": real_data is None,
            },
            "sha256": id_list_sha256(train, val),
        }
        (staging / GAMES_JSON).write_text(json.dumps(games, indent=1, sort_keys=True) + "\n")
    return games


def source_from_catalogue(games_dir: Path, split: str):
    """(AlfworldTaskSource over the catalogue's root, the real split name) for ``train``/``val``."""
    from fedagent.envs.alfworld.source import AlfworldTaskSource

    games_dir = Path(games_dir)
    index = json.loads((games_dir / GAMES_JSON).read_text())
    real_split = index["splits"].get(split, split)
    root = Path(index["root"])
    root = root if root.is_absolute() else games_dir / root
    return AlfworldTaskSource(
        root, splits=[real_split], base_seed=index["knobs"]["data_seed"], manifest_dir=index.get("manifests")
    ), real_split


def add_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``fedagent alfworld-pool``."""
    parser.add_argument("--out", required=True, type=Path, help="catalogue folder (plan/games)")
    parser.add_argument("--seed", required=True, type=int, help="data_seed")
    parser.add_argument("--n-train", required=True, type=int)
    parser.add_argument("--n-val", required=True, type=int)
    parser.add_argument("--val-split", default="valid_seen", choices=["valid_seen", "valid_unseen"])
    parser.add_argument("--data", type=Path, default=None, help="real ALFWorld data (else: generate games)")
    parser.add_argument("--manifests", type=Path, default=None, help="manifest folder for real data")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="processes generating games at once (the planner is serial in each; same games)",
    )
    parser.add_argument("--quarantine", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    """Build the catalogue; print a one-line summary."""
    games = build_catalogue(
        args.out,
        data_seed=args.seed,
        n_train=args.n_train,
        n_val=args.n_val,
        val_split=args.val_split,
        real_data=args.data,
        manifests=args.manifests,
        quarantine_root=args.quarantine,
        jobs=args.jobs,
    )
    types = sorted(set(games["task_types"].values()))
    print(
        f"alfworld catalogue: {len(games['train'])} train + {len(games['val'])} {args.val_split} "
        f"({'generated' if args.data is None else args.data}; types {types}; sha256 {games['sha256'][:12]})"
    )
    return 0
