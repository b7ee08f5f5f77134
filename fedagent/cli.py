"""The ``fedagent`` command line: what Snakemake rules call.

The commands and their modules are :mod:`fedagent.commands`; this file is the entry point only.

With ``FEDAGENT_WARM_SOCKET`` set, the heavy job commands (``train-client``, ``eval``,
``serve-env``, ``aggregate``, ``merge``, ``report``, ``tiny-model``) are not run here: this process stays a light client (no torch, no numpy) and
a node-local warm server (``fedagent warm-server``, :mod:`fedagent.warm`) forks the job from
a process that has the heavy modules imported already.

A job whose environment asks for GPUs (``FEDAGENT_JOB_GPUS`` ≥ 1, set by the GPU-capable rules) is
placed on a card first (:func:`fedagent.core.placement.place_job`): this process claims it and sets
``CUDA_VISIBLE_DEVICES`` before any command starts CUDA; a job handed to the warm server takes that
environment with it, and the claim lives as long as this process (the job's client) does.
"""

from __future__ import annotations

import os
import sys

from fedagent.core import placement
from fedagent.commands import COMMANDS, WARM_COMMANDS, build_parser, dispatch  # noqa: F401 - the CLI's names

WARM_SOCKET_ENV = "FEDAGENT_WARM_SOCKET"


def main(argv: list[str] | None = None) -> int:
    """Entry point: hand a heavy job to the warm server named by ``FEDAGENT_WARM_SOCKET``, else
    :func:`dispatch` it here. There is no silent fallback: a set socket nobody answers on is an error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get(placement.JOB_GPUS_ENV):
        try:
            placement.place_job(argv)
        except placement.PlacementError as err:
            print(f"fedagent: {err}", file=sys.stderr, flush=True)
            return 2
    socket_path = os.environ.get(WARM_SOCKET_ENV)
    if socket_path and argv and argv[0] in WARM_COMMANDS:
        from fedagent.warm.client import delegate

        return delegate(argv, socket_path)
    return dispatch(argv)


if __name__ == "__main__":
    sys.exit(main())
