"""Stop every engine set of a results dir (the Snakefile's onsuccess/onerror: sets outlive their jobs).

Kept apart from :mod:`.client` so that Snakemake's hook imports nothing heavy when no set exists.
"""

from __future__ import annotations

import glob
from pathlib import Path


def stop_sets_under(results_dir) -> list[Path]:
    """Stop the set of every ``.verl-engines/slot-*`` below ``results_dir`` (a matrix's runs too); the slots."""
    slots = [Path(d) for d in sorted(glob.glob(f"{results_dir}/**/.verl-engines/slot-*", recursive=True))]
    if slots:
        from fedagent.train.verl.engines.client import stop_set

        for d in slots:
            stop_set(d)
    return slots
