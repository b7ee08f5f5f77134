"""The kill suite's short form for CI: two seeded SIGKILLs, recovery, byte-identical results.

The full suite (K >= 20, run alone) is ``python tests/reliability/kill_driver.py --kills 20``;
README.md quotes its line. Here: one kill of Snakemake's whole tree during aggregation and one
of the merge job right after it renamed its output into place, both from the shared
reference run, each followed by the ``fedagent status`` check and the documented re-run.
"""

from __future__ import annotations

import pytest

from kill_driver import PHASES, run_trial

pytestmark = [pytest.mark.workflow, pytest.mark.slow]


@pytest.mark.parametrize("index", [1, 5])  # PHASES[1] = aggregate, PHASES[5] = rename (seeded)
def test_seeded_kill_then_rerun_is_byte_identical(reference_run, tmp_path, index):
    trial = run_trial(index, 13, reference_run, tmp_path, check_status=True)
    assert trial.phase == PHASES[index]
    assert trial.survived, trial.notes
    assert trial.identical, trial.notes
    assert trial.status_exact, trial.notes
