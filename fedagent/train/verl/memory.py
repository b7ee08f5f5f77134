"""Device memory of an engine set's training workers (``train.verl.engines: run``).

On the GPU (docs/results/verl.md) each warm job left ≈ 0.5 GB per trained 135M engine allocated in the
FSDP worker, although the CPU test sees the old modules and optimizers freed. Two worker methods, added to
verl's ``ActorRolloutRefWorker`` and ``TrainingWorker`` by :func:`fedagent.train.verl.refit.arm` (ONE_TO_ALL):

- :func:`allocated_gb`: what the set compares across its jobs (``train.verl.engines_max_growth_gb``);
- :func:`device_tensors`: with ``FEDAGENT_VERL_MEMORY_CENSUS=1`` among the set's Ray env vars (e.g.
  ``train.verl.extra_overrides: ["+ray_kwargs.ray_init.runtime_env.env_vars.FEDAGENT_VERL_MEMORY_CENSUS='1'"]``)
  the set asks for it after every job and each worker prints its largest live device tensors with what
  holds them (``fedagent: device tensor: ...`` lines in the set's ``server.log``): where the growth sits,
  and :func:`orphan_flat_params`, the FSDP1 ``FlatParameter``s no live model holds with the bytes they
  keep (the growth's cause, torch FSDP1's uncollectable cycle, :mod:`fedagent.train.verl.release`: 0 GB
  once each reset frees the old model).
"""

from __future__ import annotations

import gc
from typing import Callable, Iterable

CENSUS_ENV = "FEDAGENT_VERL_MEMORY_CENSUS"
MEMORY_METHOD = "fedagent_allocated_gb"  # the worker-method names of allocated_gb and device_tensors
CENSUS_METHOD = "fedagent_device_tensors"
CENSUS_LINE = "fedagent: device tensor: "
ORPHANS_PREFIX = "FSDP FlatParameters outside a live model: "


def allocated_gb(self) -> float | None:
    """The device memory this worker process's tensors hold after a garbage collection, in GB (None without
    a device)."""
    from verl.utils.device import get_torch_device

    gc.collect()
    device = get_torch_device()
    if not device.is_available():
        return None
    device.synchronize()
    return round(device.memory_allocated() / 2**30, 3)


def census(objects: Iterable, keep: Callable[[object], bool], top: int = 12) -> list[dict]:
    """The ``top`` largest storages among the tensors in ``objects`` that ``keep`` admits (views of one
    storage counted once), each with its size, one tensor's shape and dtype, how many live tensors share it
    and the type names of what refers to that tensor (a module's parameter dict, an optimizer state, a list)."""
    import torch

    objects = list(objects)
    by_storage: dict[int, dict] = {}
    for obj in objects:
        try:
            if not isinstance(obj, torch.Tensor) or not keep(obj):
                continue
            storage = obj.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except Exception:  # noqa: BLE001 - a tensor subclass or a freed storage: not countable
            continue
        row = by_storage.setdefault(
            ptr, {"bytes": nbytes, "shape": list(obj.shape), "dtype": str(obj.dtype), "tensors": 0, "tensor": obj}
        )
        row["tensors"] += 1
    rows = sorted(by_storage.values(), key=lambda r: -r["bytes"])[:top]
    for row in rows:
        t = row.pop("tensor")
        row["held_by"] = sorted(
            {
                type(r).__name__
                for r in gc.get_referrers(t)
                if r is not objects and r is not row and type(r).__name__ != "frame"
            }
        )
    return rows


def orphan_flat_params(objects: Iterable) -> dict:
    """Among ``objects``, FSDP1's ``FlatParameter``s that no live root wrapper holds, and the bytes their
    storages keep: ``{"count", "bytes"}``. A root is an FSDP1 module whose ``_is_root`` is not False (True once
    run, None before its first forward); an old model's wrapped units stay alive, as non-roots, only through
    FSDP1's cycle (:mod:`fedagent.train.verl.release`), and its root's FlatParameter with no wrapper at all."""
    import torch

    from fedagent.train.verl.release import flat_params

    objects = list(objects)
    flats, live = [], set()
    for obj in objects:
        if isinstance(obj, torch.nn.Parameter):
            if getattr(obj, "_is_flat_param", False):
                flats.append(obj)
        elif (
            isinstance(obj, torch.nn.Module) and hasattr(obj, "_handle") and getattr(obj, "_is_root", None) is not False
        ):
            live.update(id(fp) for fp in flat_params(obj))
    orphans = [fp for fp in flats if id(fp) not in live]
    held = {(str(fp.device), fp.untyped_storage().data_ptr()): fp.untyped_storage().nbytes() for fp in orphans}
    return {"count": len(orphans), "bytes": sum(held.values())}


def device_tensors(self, top: int = 12) -> list[dict]:
    """This worker's largest live device tensors (:func:`census` over the garbage collector's objects),
    printed as :data:`CENSUS_LINE` lines and returned (empty without a device), then one line with
    :func:`orphan_flat_params` (:data:`ORPHANS_PREFIX`)."""
    import json

    import torch

    gc.collect()
    objects = gc.get_objects()
    rows = census(objects, lambda t: t.device.type != "cpu" and not t.is_meta, top)
    total = sum(r["bytes"] for r in rows)
    for r in rows:
        print(f"{CENSUS_LINE}{json.dumps(r, sort_keys=True)}", flush=True)
    orphans = orphan_flat_params(objects)
    del objects
    print(
        f"{CENSUS_LINE}{ORPHANS_PREFIX}{orphans['count']} holding {orphans['bytes'] / 2**30:.3f} GB (device and host)",
        flush=True,
    )
    if torch.cuda.is_available():
        print(
            f"{CENSUS_LINE}top {len(rows)} storages {total / 2**30:.3f} GB of "
            f"{torch.cuda.memory_allocated() / 2**30:.3f} GB allocated",
            flush=True,
        )
    return rows
