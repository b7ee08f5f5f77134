"""fedagent.core.openmp: every job's entry module sets OMP_WAIT_POLICY before torch loads libgomp.

Each case runs in a fresh interpreter without the variable: a finder on ``sys.meta_path`` records its
value when ``torch`` is first looked up, the entry module is imported, then torch (as the job would).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fedagent.core import openmp

# The modules a job's process starts from (fedagent.core.openmp's list).
ENTRY_MODULES = (
    "fedagent.train.cli",
    "fedagent.train.warm_start",
    "fedagent.evaluate.validation",
    "fedagent.evaluate.labels",
    "fedagent.model.base_model_tiny",
)

PROBE = """
import json, os, sys
seen = {}
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "at_torch" not in seen:
            seen["at_torch"] = os.environ.get("OMP_WAIT_POLICY")
        return None
sys.meta_path.insert(0, Probe())
import %s
import torch
print(json.dumps(seen))
"""


@pytest.mark.parametrize("module", ENTRY_MODULES)
def test_the_policy_is_set_before_torch_loads(module):
    env = {k: v for k, v in os.environ.items() if k != openmp.KEY}
    out = subprocess.run(
        [sys.executable, "-c", PROBE % module], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.splitlines()[-1]) == {"at_torch": openmp.VALUE}, module


def test_a_value_set_by_the_caller_wins():
    env = {**os.environ, openmp.KEY: "ACTIVE"}
    code = "import os, fedagent.train.cli; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "ACTIVE"
