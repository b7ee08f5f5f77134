"""Deterministic TextWorld game pools (train + disjoint val) generated offline with ``tw-make``.

Layout of a games directory (written atomically, ``manifest.json`` last)::

    games.json             {"train": [ids], "val": [ids], "files": {id: "games/<id>.z8"},
                            "game_sha256": {id: sha256 of the .z8}, "seeds": {id: tw-make seed},
                            "knobs": {...}, "sha256": sha256 of the canonical id list}
    games/<id>.z8          the compiled game
    games/<id>.json        TextWorld's game description (needed for admissible commands, won/lost)

Determinism: a game's ``tw-make`` seed is ``derive_seed(base_seed, "tw_game", index=i) % 2**31``
(train: i = 0..n_train-1; val: i = VAL_INDEX_OFFSET + j, so the pools never share a seed).
``tw-make`` output is byte-identical for the same seed except for the Z-machine header's
serial number, which Inform stamps with the compile date (YYMMDD); we overwrite it with a
fixed value (the header is outside the Z-machine checksum) so files do not depend on the day.
Two seeds can, for tiny worlds, produce the same game; a game whose content equals an
earlier one (canonical order: train, then val) is regenerated with ``epoch=attempt``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from fedagent.core.atomic import atomic_dir, verify_manifest
from fedagent.core.config import JobKeys
from fedagent.core.seeds import derive_seed

TASK_TYPE = "textworld"
GAMES_JSON = "games.json"
VAL_INDEX_OFFSET = 1_000_000  # val seeds come from a far-away index range
MAX_ATTEMPTS = 20  # duplicate-content regenerations per game
_SERIAL = slice(0x12, 0x18)  # Z-machine header: 6 ASCII digits of the compile date
FIXED_SERIAL = b"000000"
DEFAULT_KNOBS = {"world_size": 2, "nb_objects": 4, "quest_length": 2}


def task_id(split: str, i: int) -> str:
    """Canonical id of the ``i``-th game of ``split`` (``tw-train-0000``)."""
    return f"tw-{split}-{i:04d}"


def game_seed(base_seed: int, index: int, attempt: int = 0) -> int:
    """The ``tw-make`` seed of game ``index`` (31 bits: what tw-make/numpy accept)."""
    return derive_seed(base_seed, "tw_game", index=index, epoch=attempt) % (2**31)


def id_list_sha256(train: Sequence[str], val: Sequence[str]) -> str:
    """sha256 of the canonical id list: sorted train ids, then sorted val ids, one per line."""
    text = "\n".join(["train:" + t for t in sorted(train)] + ["val:" + v for v in sorted(val)])
    return hashlib.sha256(text.encode()).hexdigest()


def _tw_make() -> list[str]:
    # FEDAGENT_TW_MAKE (a command line) replaces tw-make: the test suite points it at
    # tests/tw_make_cache.py, which runs the real tw-make once per argument list and session.
    override = os.environ.get("FEDAGENT_TW_MAKE")
    if override:
        return shlex.split(override)
    # Prefer the tw-make next to this interpreter (the venv's), so PATH does not matter.
    local = Path(sys.executable).parent / "tw-make"
    if local.exists():
        return [str(local)]
    found = shutil.which("tw-make")
    if found is None:
        raise RuntimeError("tw-make not found (is the textworld package installed?)")
    return [found]


def fix_serial(z8_path: Path) -> None:
    """Overwrite the date-stamped serial number in a Z-machine header with a fixed value."""
    with open(z8_path, "r+b") as fh:
        header = fh.read(0x40)
        if len(header) < 0x40 or not header[_SERIAL].isdigit():
            raise RuntimeError(f"{z8_path}: not a Z-machine story file with a serial number")
        fh.seek(_SERIAL.start)
        fh.write(FIXED_SERIAL)


def content_key(game_json: Path) -> str:
    """A hash of a game's content without its seed-derived uuid (detects duplicate games)."""
    data = json.loads(Path(game_json).read_text())
    data.pop("metadata", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def make_one(out_dir: Path, gid: str, seed: int, knobs: dict) -> Path:
    """Run ``tw-make custom`` for one game into ``out_dir/<gid>.z8``; return the .z8 path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    z8 = out_dir / f"{gid}.z8"
    for suffix in (".z8", ".json", ".ni"):
        z8.with_suffix(suffix).unlink(missing_ok=True)
    cmd = _tw_make() + [
        "custom",
        "--world-size",
        str(knobs["world_size"]),
        "--nb-objects",
        str(knobs["nb_objects"]),
        "--quest-length",
        str(knobs["quest_length"]),
        "--seed",
        str(seed),
        "--output",
        str(z8),
        "--silent",
        "-f",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not z8.is_file():
        raise RuntimeError(f"tw-make failed for {gid} (seed {seed}): {proc.stderr[-2000:]}")
    # The Inform 7 source is an intermediate; the .z8 + .json are what the env needs.
    z8.with_suffix(".ni").unlink(missing_ok=True)
    fix_serial(z8)
    return z8


def generate_games(
    out_dir: Path,
    *,
    base_seed: int,
    n_train: int,
    n_val: int,
    jobs: int = 1,
    quarantine_root: Path | None = None,
    **game_knobs: int,
) -> dict:
    """Generate the train and val pools into ``out_dir`` (atomically); return games.json."""
    knobs = {**DEFAULT_KNOBS, **game_knobs}
    unknown = set(knobs) - set(DEFAULT_KNOBS)
    if unknown:
        raise ValueError(f"unknown game knobs: {sorted(unknown)}")
    if n_train < 0 or n_val < 0 or n_train + n_val == 0:
        raise ValueError("need n_train >= 0, n_val >= 0 and at least one game")
    specs = [(task_id("train", i), i) for i in range(n_train)]
    specs += [(task_id("val", j), VAL_INDEX_OFFSET + j) for j in range(n_val)]
    with atomic_dir(Path(out_dir), quarantine_root) as staging:
        gdir = staging / "games"
        seeds = {gid: game_seed(base_seed, idx) for gid, idx in specs}
        with ThreadPoolExecutor(max_workers=max(1, int(jobs))) as pool:
            # Threads only wait on tw-make subprocesses, so `jobs` bounds the processes.
            list(pool.map(lambda s: make_one(gdir, s[0], seeds[s[0]], knobs), specs))
        # Duplicate content (possible for tiny worlds) is resolved in canonical order.
        seen: dict[str, str] = {}
        attempts = {}
        for gid, idx in specs:
            attempt = 0
            key = content_key(gdir / f"{gid}.json")
            while key in seen:
                attempt += 1
                if attempt > MAX_ATTEMPTS:
                    raise RuntimeError(
                        f"{gid}: still a duplicate of {seen[key]} after {MAX_ATTEMPTS} attempts; "
                        "increase world size / objects / quest length"
                    )
                seeds[gid] = game_seed(base_seed, idx, attempt)
                make_one(gdir, gid, seeds[gid], knobs)
                key = content_key(gdir / f"{gid}.json")
            seen[key] = gid
            if attempt:
                attempts[gid] = attempt
        train = sorted(g for g, _ in specs if g.startswith("tw-train-"))
        val = sorted(g for g, _ in specs if g.startswith("tw-val-"))
        games = {
            "format": "fedagent-tw-games-v1",
            "train": train,
            "val": val,
            "task_type": TASK_TYPE,
            "files": {gid: f"games/{gid}.z8" for gid, _ in specs},
            "game_sha256": {gid: _sha256(gdir / f"{gid}.z8") for gid, _ in specs},
            "seeds": seeds,
            "regenerated": attempts,
            "knobs": {**knobs, "base_seed": int(base_seed)},
            "sha256": id_list_sha256(train, val),
        }
        (staging / GAMES_JSON).write_text(json.dumps(games, indent=1, sort_keys=True) + "\n")
    return games


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class TextWorldTaskSource:
    """A verified games directory as a :class:`fedagent.envs.base.TaskSource`."""

    prompt_template = "textworld"  # the generic text-game prompt (fedagent.rollout.prompts)

    def __init__(self, games_dir: Path, *, check_hashes: bool = True, served=None):
        """Verify ``games_dir``'s manifest and load its games.json.

        ``served`` (task ids; None: all): the only games whose files (``games/<id>.*``) are
        hashed, with every file outside ``games/`` (games.json); the others' sizes are still
        checked. An env service plays its shard only, and hashing all of a 384-game catalogue
        (132 MB) took 0.3-0.5 s of each train job's env start.
        """
        self.games_dir = Path(games_dir)
        hash_only = None
        if served is not None:
            stems = {str(t) for t in served}

            def hash_only(rel: str) -> bool:  # a game's files are games/<id>.* (generate_games)
                return not rel.startswith("games/") or Path(rel).name.split(".", 1)[0] in stems

        verify_manifest(self.games_dir, check_hashes=check_hashes, hash_only=hash_only)
        self.games = json.loads((self.games_dir / GAMES_JSON).read_text())
        if self.games.get("sha256") != id_list_sha256(self.games["train"], self.games["val"]):
            raise ValueError(f"{self.games_dir}/{GAMES_JSON}: id-list sha256 does not match its lists")

    def task_ids(self, split: str) -> list[str]:
        """Sorted task ids of ``split`` (``train`` or ``val``)."""
        if split not in ("train", "val"):
            raise ValueError(f"unknown split {split!r} (train or val)")
        return list(self.games[split])

    def task_type(self, task_id: str) -> str:
        """Always ``textworld``; raises KeyError for an unknown id."""
        self.game_path(task_id)
        return TASK_TYPE

    def game_path(self, task_id: str) -> Path:
        """Absolute path of the task's .z8 file."""
        return self.games_dir / self.games["files"][task_id]

    def make_env(self, max_turns: int, *, policy_commands: bool = False):
        """A fresh :class:`TextWorldEnv` able to play every game of this directory (``policy_commands``:
        with the walkthrough expert, :meth:`TextWorldEnv.expert_action`)."""
        from fedagent.envs.textworld.env import TextWorldEnv

        paths = {gid: self.games_dir / rel for gid, rel in self.games["files"].items()}
        return TextWorldEnv(paths, max_turns=max_turns, policy_commands=policy_commands)


# The `fedagent games` job's flags and the config keys they come from (rules/plan.smk).
GAMES_KEYS = JobKeys(
    "games",
    {
        "seed": "seed",
        "n_train": "env.train_games",
        "n_val": "env.val_games",
        "world_size": "env.world_size",
        "nb_objects": "env.nb_objects",
        "quest_length": "env.quest_length",
    },
)


def add_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``fedagent games``."""
    parser.add_argument("--out", required=True, type=Path, help="games directory to create")
    parser.add_argument("--seed", required=True, type=int, help="base seed")
    parser.add_argument("--n-train", required=True, type=int)
    parser.add_argument("--n-val", required=True, type=int)
    parser.add_argument("--world-size", type=int, default=DEFAULT_KNOBS["world_size"])
    parser.add_argument("--nb-objects", type=int, default=DEFAULT_KNOBS["nb_objects"])
    parser.add_argument("--quest-length", type=int, default=DEFAULT_KNOBS["quest_length"])
    parser.add_argument("--jobs", type=int, default=1, help="tw-make processes at once")
    parser.add_argument("--quarantine", type=Path, default=None, help="where failed attempts go")


def run(args: argparse.Namespace) -> int:
    """Generate the pools; print a one-line summary."""
    GAMES_KEYS.check({name: getattr(args, name) for name in GAMES_KEYS.keys})
    games = generate_games(
        args.out,
        base_seed=args.seed,
        n_train=args.n_train,
        n_val=args.n_val,
        jobs=args.jobs,
        quarantine_root=args.quarantine,
        world_size=args.world_size,
        nb_objects=args.nb_objects,
        quest_length=args.quest_length,
    )
    print(
        f"games: {len(games['train'])} train + {len(games['val'])} val in {args.out} "
        f"(sha256 {games['sha256'][:12]}, regenerated {len(games['regenerated'])})"
    )
    return 0
