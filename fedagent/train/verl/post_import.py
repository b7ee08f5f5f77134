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
    """Finds ``target`` through the other finders and calls ``patch(module)`` right after it executes."""

    def __init__(self, target: str, patch: Callable, what: str):
        self.target, self.patch, self.what = target, patch, what

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"{self.target} not found: cannot {self.what}")
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def patch_on_import(target: str, patch: Callable, what: str) -> None:
    """``patch(module)`` now if ``target`` is imported, else when it is (a later call for the same
    target replaces the earlier pending one)."""
    if target in sys.modules:
        patch(sys.modules[target])
        return
    sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, PatchAfterImport) and f.target == target)]
    sys.meta_path.insert(0, PatchAfterImport(target, patch, what))
