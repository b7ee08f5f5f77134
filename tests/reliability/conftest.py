"""One uninterrupted reference run (test config, rounds: 1) shared by the reliability tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    from kill_driver import build_reference

    return build_reference(tmp_path_factory.mktemp("reliability"))
