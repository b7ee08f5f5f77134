"""A fresh, checkout-like copy of the workflow in another directory (tests, bench).

The workflow tests and the benchmarks run Snakemake for real, each in its own directory holding
the workflow files of a checkout plus a config: :func:`copy_workflow` makes one. It takes the
checkout to copy from explicitly (this package never imports ``tests`` or ``bench``; they import
this), and nothing heavy is imported.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Sequence

# What a run needs from a checkout besides config/ (the package itself is installed).
WORKFLOW_PARTS = ("Snakefile", "rules", "workflow", "profiles", "envs")


def copy_workflow(repo: Path, dest: Path, config: Path, presets: Sequence[Path] = ()) -> Path:
    """Copy ``repo``'s :data:`WORKFLOW_PARTS` into ``dest`` (created if needed; no ``__pycache__``),
    ``config`` as ``dest/config/config.yaml`` and each of ``presets`` into ``dest/config/experiments/``."""
    repo, dest = Path(repo), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        src = repo / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / part)
    (dest / "config").mkdir(exist_ok=True)
    shutil.copy2(config, dest / "config" / "config.yaml")
    if presets:
        (dest / "config" / "experiments").mkdir(exist_ok=True)
        for preset in presets:
            shutil.copy2(preset, dest / "config" / "experiments" / Path(preset).name)
    return dest
