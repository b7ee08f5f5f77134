"""Access to what the ``alfworld`` package ships: PDDL domain, grammar, floor plans, wrappers.

Importing ``alfworld`` has side effects: ``alfworld/info.py`` creates ``~/.cache/alfworld`` and
*sets* ``os.environ["ALFWORLD_DATA"]`` when it is unset. fedagent decides between real data
and generated games by looking at that variable, so every import of alfworld goes through
:func:`import_alfworld`, which restores the variable to what it was.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import threading
from pathlib import Path

_IMPORT_LOCK = threading.Lock()


class AlfworldMissingError(ImportError):
    """The ``alfworld`` package (or TextWorld's PDDL support) is not installed."""


def alfworld_available() -> bool:
    """True if ``alfworld`` and ``fast_downward`` (textworld[pddl]) can be imported."""
    return importlib.util.find_spec("alfworld") is not None and importlib.util.find_spec("fast_downward") is not None


def import_alfworld(module: str = "alfworld"):
    """Import ``module`` (an ``alfworld`` submodule) leaving ``ALFWORLD_DATA`` untouched."""
    if not alfworld_available():
        raise AlfworldMissingError("alfworld is not installed: run scripts/install-alfworld.sh")
    with _IMPORT_LOCK:
        before = os.environ.get("ALFWORLD_DATA")
        try:
            return importlib.import_module(module)
        finally:
            if before is None:
                os.environ.pop("ALFWORLD_DATA", None)
            else:
                os.environ["ALFWORLD_DATA"] = before


@functools.lru_cache(maxsize=None)
def package_dir() -> Path:
    """The installed ``alfworld`` package folder (found without importing it)."""
    spec = importlib.util.find_spec("alfworld")
    if spec is None or not spec.submodule_search_locations:
        raise AlfworldMissingError("alfworld is not installed: run scripts/install-alfworld.sh")
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=None)
def domain_text() -> str:
    """ALFWorld's PDDL domain (``alfworld/data/alfred.pddl``)."""
    return (package_dir() / "data" / "alfred.pddl").read_text()


@functools.lru_cache(maxsize=None)
def grammar_text() -> str:
    """ALFWorld's text grammar (``alfworld/data/alfred.twl2``); the goal is ``UNKNOWN GOAL``."""
    return (package_dir() / "data" / "alfred.twl2").read_text()


def layouts_dir() -> Path:
    """Folder of the 120 shipped floor plans (``FloorPlan<N>-{objects,openable}.json``)."""
    return package_dir() / "gen" / "layouts"


@functools.lru_cache(maxsize=None)
def floor_plans() -> tuple[str, ...]:
    """Names of the shipped floor plans (``FloorPlan1`` ...), sorted by number."""
    names = [p.name[: -len("-objects.json")] for p in layouts_dir().glob("FloorPlan*-objects.json")]
    return tuple(sorted(names, key=lambda n: int(n[len("FloorPlan") :])))


@functools.lru_cache(maxsize=None)
def floor_plan(name: str) -> tuple[tuple[str, ...], dict]:
    """``(object types present, {receptacle id: agent pose [x, z, rotation, horizon]})``."""
    objects = json.loads((layouts_dir() / f"{name}-objects.json").read_text())
    receptacles = json.loads((layouts_dir() / f"{name}-openable.json").read_text())
    return tuple(sorted(set(objects))), dict(sorted(receptacles.items()))


def constants():
    """``alfworld.gen.constants`` (object classes, what receptacles can hold, action sets)."""
    return import_alfworld("alfworld.gen.constants")


def goal_library():
    """``alfworld.gen.goal_library`` (PDDL goal + text templates per task type)."""
    return import_alfworld("alfworld.gen.goal_library")


def wrappers():
    """``(AlfredDemangler, AlfredInfos)``: ALFWorld's TextWorld wrappers."""
    mod = import_alfworld("alfworld.agents.environment.alfred_tw_env")
    return mod.AlfredDemangler, mod.AlfredInfos
