"""Free the model a run-scoped verl engine is about to rebuild (``train.verl.engines: run``, the warm refit).

Why: verl 0.9.1's FSDP engines wrap the model with torch's FSDP1 (``strategy: fsdp``, verl's default and
ours). FSDP1 keeps on every ``FlatParameter`` its ``_param_infos`` / ``_shared_param_infos`` (named tuples
holding the wrapped submodules) and a ``_modules`` set, and those submodules hold their weights as views of
that same ``FlatParameter``. A view's link to its base lives in C++ autograd metadata, which Python's cyclic
garbage collector cannot see, so the cycle FlatParameter → submodule → view → FlatParameter is never
collected (torch 2.13's ``torch/distributed/fsdp/_flat_param.py``; pytorch/pytorch pull request 183211
describes the same cycle). verl's ``TrainingWorker.reset()`` (``engine.initialize()``) replaces
``engine.module``: the old root wrapper and the old optimizer are freed (neither is in the cycle), every old
``FlatParameter`` — the whole model's fp32 weights — stays. That was the run-scoped engine sets' growth on
the GPU: one trained model per trained engine (the actor; the critic too in PPO) per warm job in device
memory, and the KL reference's, which verl offloads to the CPU, in host memory (docs/results/verl.md).

:func:`release_engine`, called before the engine is rebuilt, frees the storage of the old module's
parameters (each ``FlatParameter`` with the tensors it keeps: its local shard, mixed-precision and padded
copies, the offload's gradient buffer) and of the old optimizer's state, so the memory goes whatever still
refers to the tensor objects; then it drops the links that close the cycle and the engine's own references
(module, optimizer, LR scheduler, checkpoint manager) and collects. Freeing first also means the reset never
holds two models at once. The engine is unusable until its ``initialize()`` builds the new module, which
reads only its configs. Its record (printed as :data:`RELEASED_LINE`, returned to the set's job) says what was
freed, how many old parameters outlived the collection and the device memory before and after.
"""

from __future__ import annotations

import gc
import json
import weakref

# FlatParameter attributes that refer to the wrapped modules or to views of the FlatParameter (the cycle)
CYCLE_LINKS = ("_param_infos", "_shared_param_infos", "_modules", "_params", "_shared_params", "_tensors")
# what a verl FSDP engine holds of its model (FSDPEngine.initialize sets them)
ENGINE_REFS = ("module", "optimizer", "lr_scheduler", "checkpoint_manager")
RELEASED_LINE = "fedagent: engine released: "
GB = 2**30


def flat_params(module) -> list:
    """FSDP1's ``FlatParameter``s in ``module`` (one per wrapped unit), each once, in module order."""
    seen: set[int] = set()
    out = []
    for m in module.modules():
        fp = getattr(getattr(m, "_handle", None), "flat_param", None)
        if fp is not None and id(fp) not in seen:
            seen.add(id(fp))
            out.append(fp)
    return out


def _storage(t):
    """The storage under ``t`` (a DTensor's local shard's), or None where it has none to free."""
    t = t.to_local() if hasattr(t, "to_local") else t
    if t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
        return None


def free_storage(tensors) -> dict:
    """Resize every distinct storage under ``tensors`` to nothing: ``{"gb", "device_gb"}`` freed (all devices;
    accelerators only) and ``"kept_gb"``, the bytes of storages that cannot be resized (not allocated by
    torch, e.g. a memory-mapped file's)."""
    seen: set[tuple] = set()
    freed = device = kept = 0
    for t in tensors:
        s = _storage(t)
        if s is None or s.nbytes() == 0:
            continue
        key = (str(s.device), s.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        n = s.nbytes()
        try:
            s.resize_(0)
        except RuntimeError:
            kept += n
            continue
        freed += n
        if s.device.type != "cpu":
            device += n
    return {"gb": round(freed / GB, 3), "device_gb": round(device / GB, 3), "kept_gb": round(kept / GB, 3)}


def model_tensors(module) -> list:
    """The tensors holding ``module``'s weights: its parameters and, for FSDP1, each ``FlatParameter`` with
    every tensor in its attributes."""
    import torch

    out = []
    for fp in flat_params(module):
        out.append(fp)
        out += [v for v in vars(fp).values() if isinstance(v, torch.Tensor)]
    return out + list(module.parameters())


def optimizer_tensors(optimizer) -> list:
    import torch

    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def break_cycle(module) -> None:
    """Drop the attributes by which FSDP1's FlatParameters refer to the wrapped modules and their views
    (:data:`CYCLE_LINKS`): the cycle the garbage collector cannot see (the module doc)."""
    for fp in flat_params(module):
        for link in CYCLE_LINKS:
            vars(fp).pop(link, None)


def _allocated_gb() -> float | None:
    """This process's allocated device memory (GB), None without a device (verl's device module)."""
    from verl.utils.device import get_torch_device

    device = get_torch_device()
    if not device.is_available():
        return None
    device.synchronize()
    return round(device.memory_allocated() / GB, 3)


def release_engine(engine, role: str) -> dict:
    """Free ``engine``'s model and optimizer before it is rebuilt (the module doc) and drop its references to
    them; returns (and prints) the record. An engine without a module (not built yet) releases nothing."""
    before = _allocated_gb()
    module = getattr(engine, "module", None)
    rec = {
        "role": role,
        "model_gb": 0.0,
        "model_device_gb": 0.0,
        "optimizer_gb": 0.0,
        "kept_gb": 0.0,
        "params_outlived_gc": 0,
    }
    if module is not None:
        optimizer = getattr(engine, "optimizer", None)
        params = flat_params(module) or list(module.parameters())
        alive = [weakref.ref(p) for p in params]
        model = free_storage(model_tensors(module))
        optim = free_storage(optimizer_tensors(optimizer))
        break_cycle(module)
        for name in ENGINE_REFS:
            if hasattr(engine, name):
                setattr(engine, name, None)
        del module, optimizer, params
        gc.collect()
        rec.update(
            model_gb=model["gb"],
            model_device_gb=model["device_gb"],
            optimizer_gb=optim["gb"],
            kept_gb=round(model["kept_gb"] + optim["kept_gb"], 3),
            # FSDP1's cycle left unbroken: every old FlatParameter (now empty) would still be alive here
            params_outlived_gc=sum(r() is not None for r in alive),
        )
    rec.update(allocated_before_gb=before, allocated_after_gb=_allocated_gb())
    print(f"{RELEASED_LINE}{json.dumps(rec, sort_keys=True)}", flush=True)
    return rec
