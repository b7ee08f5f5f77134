"""Removing a temp dir one of our processes made, named by a record that a killed attempt left behind.

A record is only a file: whatever it says, only a real directory (not a link) whose name has our prefix and
which sits directly under the expected temp root is removed. Used by a verl job's clean-up of a killed
attempt (``fedagent.train.verl.leftovers``: its Ray temp dir) and by the env services
(``fedagent.envs.lifecycle``: a short socket dir).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def remove_own(path: str | Path, prefix: str, root: str | Path | None = None) -> bool:
    """Remove ``path`` if it is a real dir named ``prefix*`` directly under ``root`` (default: this
    process's temp root); True if it was removed."""
    d = Path(str(path))
    root = Path(root or tempfile.gettempdir()).resolve()
    if (
        d.is_absolute()
        and d.name.startswith(prefix)
        and not d.is_symlink()
        and d.is_dir()
        and d.parent.resolve() == root
    ):
        shutil.rmtree(d, ignore_errors=True)
        return True
    return False
