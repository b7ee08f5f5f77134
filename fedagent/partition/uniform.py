"""Uniform partition: contiguous slices of the canonical train task list (FACTS §2)."""

from __future__ import annotations

from fedagent.partition.context import PartitionContext


def uniform_slices(n_tasks: int, n_clients: int, min_tasks: int) -> list[tuple[int, int]]:
    """Half-open ``[start, end)`` slice of every client.

    base = ⌊n/N⌋ and client c starts at c·base. A slice shorter than ``min_tasks`` (L) is
    widened to L: ⌊need/2⌋ to the left, the rest to the right, shifting what an edge
    cuts off to the other side (slices may then overlap, as in the reference system).
    One client gets the whole pool.
    """
    if n_clients < 1 or n_tasks < 1:
        raise ValueError(f"need ≥1 client and ≥1 task, got {n_clients} clients, {n_tasks} tasks")
    if min_tasks > n_tasks:
        raise ValueError(f"min_tasks={min_tasks} exceeds the {n_tasks} tasks available")
    if n_clients == 1:
        return [(0, n_tasks)]
    base = n_tasks // n_clients
    slices = []
    for c in range(n_clients):
        start, end = c * base, (c + 1) * base
        if end - start < min_tasks:
            need = min_tasks - (end - start)
            left, right = need // 2, need - need // 2
            start, end = start - left, end + right
            if start < 0:  # shift what the left edge cut off to the right
                end, start = end - start, 0
            if end > n_tasks:
                start, end = start - (end - n_tasks), n_tasks
            start = max(start, 0)
        slices.append((start, end))
    return slices


def partition(ctx: PartitionContext) -> tuple[dict[str, list[str]], dict]:
    """Uniform slices of ``ctx.task_ids``; no randomness."""
    slices = uniform_slices(len(ctx.task_ids), ctx.n_clients, ctx.min_tasks)
    return {str(c): list(ctx.task_ids[a:b]) for c, (a, b) in enumerate(slices)}, {}
