"""Patch a verl module in this process right after it executes (the Ray worker hook's tool).

:func:`patch_on_import` patches a module already imported at once; otherwise it puts a
:class:`PatchAfterImport` first on ``sys.meta_path``: it finds the module through the ordinary
path finder and wraps its loader's ``exec_module``, so the patch runs after the module's body and
before any importer sees the module. Used by :mod:`fedagent.train.verl.critic_loss` and
:mod:`fedagent.train.verl.ref_model`, armed from :mod:`fedagent.train.verl.ray_hook`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Callable


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``target`` through the other finders and runs its patches right after it executes.

    One finder per target, holding every pending patch by key (in arming order): a second finder
    for the same module would never be asked, since the first already returned its spec."""

    def __init__(self, target: str):
        self.target = target
        self.patches: dict[str, tuple[Callable, str]] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            what = "; ".join(w for _, w in self.patches.values())
            raise RuntimeError(f"{self.target} not found: cannot {what}")
        run = spec.loader.exec_module
        patches = list(self.patches.values())

        def exec_module(module):
            run(module)
            for patch, _ in patches:
                patch(module)

        spec.loader.exec_module = exec_module
        return spec


def patch_on_import(target: str, patch: Callable, what: str, key: str | None = None) -> None:
    """``patch(module)`` now if ``target`` is imported, else when it is. A later call with the same
    ``key`` (default: the target) replaces the earlier pending patch; other keys' patches of the same
    target stay and run in arming order."""
    if target in sys.modules:
        patch(sys.modules[target])
        return
    finder = next((f for f in sys.meta_path if isinstance(f, PatchAfterImport) and f.target == target), None)
    if finder is None:
        finder = PatchAfterImport(target)
        sys.meta_path.insert(0, finder)
    finder.patches[key or target] = (patch, what)
