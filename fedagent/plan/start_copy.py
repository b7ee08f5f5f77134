"""``fedagent start-copy``: a run's round 0 taken from another run (config ``start``).

A matrix's arms that would build the same round 0 (the same base model, warm start, validation set and
eval settings and seed; only training-round settings differ: ``fedagent.plan.matrix.start_key``) start
from one shared run's round 0, built once, instead of each building its own. On the GPU this is also
what makes the arms' comparison paired: two warm starts from identical inputs do not give identical
weights there (docs/results/learning.md), so per-arm round-0 models would differ by chance.

The copy checks the start model directory's manifest (every file's sha256) and writes this run's
round_000/model through :func:`fedagent.core.atomic.atomic_dir` (staging, manifest last, rename), and
each file (eval.json, eval_timings.json, base_eval*.json, the eval's benchmark) atomically, so a killed
copy leaves no final path behind. The copies are byte-identical to the start run's files.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from fedagent.core.atomic import IGNORED_FILES, MANIFEST, ManifestError, atomic_dir, atomic_write_text, verify_manifest


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", nargs=2, metavar=("SRC", "DST"), required=True, help="the start run's round_000/model and this run's"
    )
    p.add_argument(
        "--file",
        nargs=2,
        action="append",
        default=[],
        metavar=("SRC", "DST"),
        help="a file of the start run's round 0 and its place in this run (repeatable)",
    )
    p.add_argument("--quarantine", default=None, help="where a failed copy's staging goes")


def copy_model(src: Path, dst: Path, quarantine: Path | None = None) -> None:
    """``src`` (a model directory with a valid manifest) → ``dst``, atomically, byte for byte."""
    verify_manifest(src)
    with atomic_dir(dst, quarantine) as staging:
        for path in sorted(
            p for p in src.rglob("*") if p.is_file() and p.name != MANIFEST and p.name not in IGNORED_FILES
        ):
            target = staging / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    # atomic_dir hashed what it copied into dst's manifest: the same bytes as src's, or the copy is not the start's
    if (dst / MANIFEST).read_bytes() != (src / MANIFEST).read_bytes():
        raise ManifestError(f"{dst}: the copy's manifest differs from {src / MANIFEST}")


def run(args: argparse.Namespace) -> int:
    src, dst = (Path(p) for p in args.model)
    missing = [s for s, _ in [args.model, *args.file] if not Path(s).exists()]
    if missing:
        print(
            f"fedagent start-copy: the start run has no {missing[0]} (config `start` names a run whose "
            "round 0 is not built)",
            file=sys.stderr,
        )
        return 2
    try:
        copy_model(src, dst, Path(args.quarantine) if args.quarantine else None)
    except ManifestError as exc:
        print(f"fedagent start-copy: the start model is not intact: {exc}", file=sys.stderr)
        return 1
    for s, d in args.file:
        atomic_write_text(Path(d), Path(s).read_text())
    return 0
