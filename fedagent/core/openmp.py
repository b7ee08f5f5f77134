"""Imported for its effect, before torch: OpenMP's idle workers sleep (``OMP_WAIT_POLICY=PASSIVE``).

Why first: libgomp reads ``OMP_WAIT_POLICY`` once, when torch loads it, so the variable must be set
before the first ``import torch`` of the process; a module that sets it after one of its own imports
pulled torch in sets it too late. Each job's entry module (``fedagent.train.cli``,
``fedagent.train.warm_start``, ``fedagent.evaluate.validation``, ``fedagent.evaluate.labels``,
``fedagent.model.base_model_tiny``) imports this module before anything else of fedagent and before any
third-party import, and the warm server's preload imports those entry modules first
(:mod:`fedagent.warm.preload`). Idle OpenMP workers that spin (the default) make 2 threads ~30x slower
than 1 on a busy 2-core box; PASSIVE makes them sleep. A value set by the caller wins.

Stdlib only (its import must not load torch itself).
"""

from __future__ import annotations

import os

KEY = "OMP_WAIT_POLICY"
VALUE = "PASSIVE"

os.environ.setdefault(KEY, VALUE)
