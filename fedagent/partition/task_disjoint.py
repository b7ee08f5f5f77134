"""task_disjoint: pairwise-disjoint contiguous slices of the canonical train list.

The reference's WebShop ``task_disjoint`` arm serves the uniform goal slice over the full
catalogue (it isolates the catalogue effect of ``catalog_split``). Without a catalogue here,
the arm is what its name says: every task belongs to exactly one client (``array_split``:
the first n mod N clients get one more). ``min_tasks_per_client`` (L) is not applied — the
slices never widen, so they never overlap; ``partition.json`` records the realised sizes.
"""

from __future__ import annotations

from fedagent.partition.context import PartitionContext


def partition(ctx: PartitionContext) -> tuple[dict[str, list[str]], dict]:
    """Disjoint slices; an error if there are fewer tasks than clients."""
    n, c = len(ctx.task_ids), ctx.n_clients
    if n < c:
        raise ValueError(f"task_disjoint: {n} train tasks cannot give each of {c} clients its own task")
    base, extra = divmod(n, c)
    clients, start = {}, 0
    for i in range(c):
        size = base + (1 if i < extra else 0)
        clients[str(i)] = list(ctx.task_ids[start:start + size])
        start += size
    return clients, {"min_tasks_applied": False}
