"""Session-wide test settings: TextWorld games made once per session (tests/tw_make_cache.py), and one
shared 1-round reference run of the test config."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

_CACHE: list[str] = []


def pytest_configure(config):
    # Every fedagent games job of the session (in-process or under Snakemake, which inherits this
    # environment) runs tw-make through the cache: each distinct game is generated once for real.
    if "FEDAGENT_TW_MAKE" not in os.environ:
        _CACHE.append(tempfile.mkdtemp(prefix="fa-tw-make-cache-"))
        os.environ["FEDAGENT_TEST_TW_CACHE"] = _CACHE[0]
        os.environ["FEDAGENT_TW_MAKE"] = shlex.join([sys.executable, str(Path(__file__).parent / "tw_make_cache.py")])


def pytest_unconfigure(config):
    for d in _CACHE:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(seed)``: a tiny model dir (fake_env.build_tiny_model) made once per seed and session.
    Shared: tests read it and write elsewhere."""
    from fake_env import build_tiny_model

    made: dict[int, Path] = {}

    def get(seed: int) -> Path:
        if seed not in made:
            made[seed] = build_tiny_model(tmp_path_factory.mktemp(f"tiny{seed}") / "m", seed=seed)
        return made[seed]

    return get


@pytest.fixture(scope="session")
def tiny_dir(tiny_model) -> Path:
    """The tiny model of seed 4 the local training tests start from (with fake_env.TINY_TRAIN)."""
    return tiny_model(4)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """One uninterrupted run of the test config with ``rounds: 1`` (a finished work dir), made once
    per session: the reliability tests start from copies of it, test_slurm compares with it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "reliability"))
    from kill_driver import build_reference

    return build_reference(tmp_path_factory.mktemp("reliability"))
