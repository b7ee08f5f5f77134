"""Stop every engine set of a results dir (the Snakefile's onsuccess/onerror: sets outlive their jobs).

Kept apart from :mod:`.client` so that Snakemake's hook imports nothing heavy when no set exists.
"""

from __future__ import annotations

import glob
from pathlib import Path


def stop_sets_under(results_dir) -> list[Path]:
    """Stop the set of every ``.verl-engines/slot-*`` below ``results_dir`` (a matrix's runs too) whose slot
    is free (a busy slot's set is serving a job: another Snakemake's, left alone); the slots stopped. A slot
    that cannot be stopped is reported, never an error (the run's own outcome stands)."""
    import sys

    slots = [Path(d) for d in sorted(glob.glob(f"{results_dir}/**/.verl-engines/slot-*", recursive=True))]
    stopped = []
    if slots:
        from fedagent.train.verl.engines.client import held, stop_set

        for d in slots:
            try:
                with held(d) as free:
                    if free:
                        stop_set(d)
                        stopped.append(d)
            except Exception as err:  # noqa: BLE001 - a hook's clean-up: report and go on
                print(f"fedagent: could not stop the engine set of {d}: {err}", file=sys.stderr)
    return stopped
