"""The reliability tests import kill_driver and workflow_helpers; their shared reference run
(test config, rounds: 1) is tests/conftest.py's ``reference_run`` (test_slurm uses it too)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
