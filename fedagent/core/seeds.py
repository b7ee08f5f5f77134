"""The only place where random seeds are derived.

Every random choice in fedagent (partitions, selection, validation sets, task draws,
sampling during rollouts, initialisation of tiny test models) takes its seed from
:func:`derive_seed`, a pure function of ``(base_seed, purpose, round, client, epoch,
index)``. Seeds are hashed (sha256), not added, so that nearby coordinates never alias
(the reference system's ``seed mod |shard|`` cancelled the round term).

No module may use a global RNG (``random.random``, ``np.random.*``, ``torch.manual_seed``):
build a local generator from one of the helpers below.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np

SEED_BITS = 63


def derive_seed(
    base_seed: int,
    purpose: str,
    *,
    round: int = 0,
    client: int = 0,
    epoch: int = 0,
    index: int = 0,
) -> int:
    """Return a 63-bit seed that depends only on its arguments.

    ``purpose`` names the stream (e.g. ``"selection"``, ``"task_draw"``, ``"sampling"``)
    so two consumers of the same coordinates never share a stream.
    """
    for name, value in (("round", round), ("client", client), ("epoch", epoch), ("index", index)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"seed coordinate {name!r} must be an int, got {value!r}")
    if not purpose or "|" in purpose:
        raise ValueError(f"seed purpose must be a non-empty name without '|': {purpose!r}")
    key = f"fedagent-seed-v1|{int(base_seed)}|{purpose}|{int(round)}|{int(client)}|{int(epoch)}|{int(index)}"
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << SEED_BITS) - 1)


def python_rng(base_seed: int, purpose: str, **coords: int) -> random.Random:
    """A local :class:`random.Random` seeded by :func:`derive_seed`."""
    return random.Random(derive_seed(base_seed, purpose, **coords))


def numpy_rng(base_seed: int, purpose: str, **coords: int) -> np.random.Generator:
    """A local numpy ``Generator`` seeded by :func:`derive_seed`."""
    return np.random.default_rng(derive_seed(base_seed, purpose, **coords))


def torch_generator(base_seed: int, purpose: str, device: str = "cpu", **coords: int):
    """A local ``torch.Generator`` seeded by :func:`derive_seed` (torch imported lazily)."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(base_seed, purpose, **coords))
    return gen


REQUEST_FIELD = 1 << 20  # sessions and turns of one group are packed into the index below this bound


def request_seed(base_seed: int, *, round: int, client: int, epoch: int, group: int, session: int, turn: int) -> int:
    """The sampling seed of one generation request of a verl rollout (31 bits, as vLLM's per-request
    ``SamplingParams.seed``): a pure function of the job's coordinates and the request's place in its
    epoch (task group, GRPO session, turn), so a job samples the same way whichever engine serves it.

    An engine's own seed is engine-wide: on a run-scoped engine set it would be the set's first job's,
    so which job a set served first (scheduling) would change what later jobs sample.
    """
    for name, value in (("group", group), ("session", session), ("turn", turn)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value < REQUEST_FIELD:
            raise ValueError(f"request seed coordinate {name!r} must be an int in [0, {REQUEST_FIELD}), got {value!r}")
    index = (int(group) * REQUEST_FIELD + int(session)) * REQUEST_FIELD + int(turn)
    return derive_seed(base_seed, "rollout_request", round=round, client=client, epoch=epoch, index=index) % 2**31
