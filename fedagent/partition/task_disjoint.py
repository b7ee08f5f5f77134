"""task_disjoint: the reference's WebShop arm (uniform slices honouring L), or strictly disjoint slices.

The reference's ``task_disjoint`` serves ``catalog_split``'s goal slice over the full catalogue
(FACTS §2: it isolates the catalogue effect), and that slice is the uniform one: base = ⌊n/N⌋,
client c from c·base, widened to L = ``min_tasks_per_client`` when shorter (so neighbouring
slices overlap when N·L > n: WebShop's 64-goal bases become 100-goal slices). That is the
default, knob ``task_disjoint_slices: reference``. ``disjoint``: what the name says, every task
in exactly one client's slice (``array_split``: the first n mod N clients get one more), L not
applied. ``partition.json`` records the realised sizes either way.
"""

from __future__ import annotations

from fedagent.partition.context import PartitionContext
from fedagent.partition.uniform import uniform_slices

MODES = ("reference", "disjoint")


def partition(ctx: PartitionContext) -> tuple[dict[str, list[str]], dict]:
    """The slices of the knob's mode; an error if there are fewer tasks than clients."""
    n, c = len(ctx.task_ids), ctx.n_clients
    mode = str(ctx.knobs.get("task_disjoint_slices", "reference"))
    if mode not in MODES:
        raise ValueError(f"partition.task_disjoint_slices {mode!r} is not one of {MODES}")
    if n < c:
        raise ValueError(f"task_disjoint: {n} train tasks cannot give each of {c} clients its own task")
    if mode == "reference":
        slices = uniform_slices(n, c, ctx.min_tasks)
        clients = {str(i): list(ctx.task_ids[a:b]) for i, (a, b) in enumerate(slices)}
        return clients, {"min_tasks_applied": True, "slices": [list(s) for s in slices]}
    base, extra = divmod(n, c)
    clients, start = {}, 0
    for i in range(c):
        size = base + (1 if i < extra else 0)
        clients[str(i)] = list(ctx.task_ids[start : start + size])
        start += size
    return clients, {"min_tasks_applied": False}
