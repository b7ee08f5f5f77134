"""What every partition strategy receives: the canonical train pool and the knobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from fedagent.core.seeds import numpy_rng


@dataclass(frozen=True)
class PartitionContext:
    """The canonical train task list plus everything a strategy may read.

    ``task_types``: task id → category (ALFWorld task type); ``labels``: task id → success
    of a reference policy (hardness). ``knobs``: the strategy's own knobs (partition config).
    """

    task_ids: Sequence[str]
    n_clients: int
    min_tasks: int
    data_seed: int
    knobs: Mapping[str, object] = field(default_factory=dict)
    task_types: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, bool] | None = None

    def global_rng(self, strategy: str) -> np.random.Generator:
        """The one global stream of a strategy (consumed identically by every recomputation)."""
        return numpy_rng(self.data_seed, f"partition_{strategy}")

    def client_rng(self, strategy: str, client: int) -> np.random.Generator:
        """A per-client stream (the reference's RandomState(42 + cid))."""
        return numpy_rng(self.data_seed, f"partition_{strategy}_client", client=client)


def as_clients(task_ids: Sequence[str], index_sets: Sequence[Sequence[int]]) -> dict[str, list[str]]:
    """{"<c>": [task ids in canonical order]} from per-client index lists."""
    return {str(c): [task_ids[i] for i in sorted(idx)] for c, idx in enumerate(index_sets)}
