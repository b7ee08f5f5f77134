"""The KL reference of a verl job loaded from another model directory (``train.ref_anchor: base``).

verl 0.9.1 has no config key for the reference's weights: ``ActorRolloutRefWorker.init_model``
(``verl/workers/engine_workers.py``) gives the reference ``deepcopy(model_config)`` of the actor's
``actor_rollout_ref.model`` and builds it with ``self.ref_worker_cls`` (a class attribute:
``TrainingWorker``), whose FSDP engine reads the weights in ``reset()`` from that config's
``local_path`` (``FSDPEngine._build_module``: ``from_pretrained(local_path, config=hf_config)``).
So the reference is always the model the job starts from (the round's global model).

:func:`arm` makes ``ActorRolloutRefWorker.ref_worker_cls`` a subclass of verl's
(:func:`anchored_ref_worker`) that gives the reference its own copy of that model config with
``local_path`` at the reference directory (verl's ``copy_to_local`` of it, as verl sets
``local_path`` from ``path``) — the HF config, tokenizer and architecture stay the start model's,
as the local backend fills a copy of the policy with the reference's tensors — and, once
``reset()`` has loaded the weights, prints :func:`loaded_line` with the path the engine read.
:mod:`fedagent.train.verl.ray_hook` arms it in every Ray worker when the job's runtime env
carries :data:`REF_MODEL_ENV`; the backend refuses a job whose log lacks the line for its
reference directory (fail closed: an unpatched reference would have been the start model).
Nothing here imports verl before a worker needs it.
"""

from __future__ import annotations

from pathlib import Path

REF_MODEL_ENV = "FEDAGENT_VERL_REF_MODEL"
TARGET_MODULE = "verl.workers.engine_workers"
TARGET_CLASS = "ActorRolloutRefWorker"
LOADED_PREFIX = "fedagent: KL reference weights loaded from "
_MARK = "_fedagent_ref_dir"
_ORIGINAL = "_fedagent_original_ref_worker_cls"
# config.json keys that do not describe the network (who wrote it, its storage dtype).
_NOT_ARCHITECTURE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash")


def loaded_line(path) -> str:
    """The line a reference worker prints after loading its weights from ``path``."""
    return f"{LOADED_PREFIX}{path}"


def loaded_paths(log_text: str) -> list[str]:
    """The paths of every :func:`loaded_line` in a job's log (Ray prefixes worker lines)."""
    from fedagent.train.verl.steplog import marked

    return marked(log_text, LOADED_PREFIX)


def check_loaded(log: Path, ref_dir: Path) -> None:
    """Fail closed: the job's log must say its reference was loaded from ``ref_dir``, and from nothing else."""
    paths = loaded_paths(Path(log).read_text(errors="replace"))
    want = str(ref_dir)
    if not paths:
        raise RuntimeError(
            f"{log}: no '{LOADED_PREFIX}{want}' line: the KL reference was not loaded from {want} "
            "(fedagent.train.verl.ref_model not armed in verl's reference worker, whose reference is "
            "then the start model); refusing the update"
        )
    other = sorted({p for p in paths if p != want})
    if other:
        raise RuntimeError(
            f"{log}: the KL reference was loaded from {other}, not only from {want}; refusing the update"
        )


def architecture(model_dir: Path) -> dict:
    """A model dir's ``config.json`` as transformers reads it, less the keys that do not describe the network."""
    from transformers import AutoConfig

    d = AutoConfig.from_pretrained(str(model_dir)).to_dict()
    return {k: v for k, v in d.items() if k not in _NOT_ARCHITECTURE}


def same_architecture(a: Path, b: Path) -> bool:
    """Whether the reference's weights fit the start model's HF config (which the reference is built with)."""
    return architecture(a) == architecture(b)


def anchored_ref_worker(base_cls, ref_dir: str):
    """A subclass of verl's reference worker class ``base_cls`` whose weights come from ``ref_dir``."""
    import copy
    import dataclasses
    import functools

    from verl.utils.fs import copy_to_local

    class BaseAnchoredRefWorker(base_cls):
        def __init__(self, config, *args, **kwargs):
            # Its own copy whatever verl passes (0.9.1 passes a deep copy), so the actor's stays as it was.
            own = copy.deepcopy(config.model_config)
            own.local_path = copy_to_local(ref_dir, use_shm=own.use_shm)  # verl's own path → local_path step
            super().__init__(dataclasses.replace(config, model_config=own), *args, **kwargs)

        @functools.wraps(base_cls.reset)  # keeps verl's dispatch attributes
        def reset(self, *args, **kwargs):
            out = super().reset(*args, **kwargs)
            print(loaded_line(self.engine.model_config.local_path), flush=True)
            return out

    setattr(BaseAnchoredRefWorker, _MARK, ref_dir)
    setattr(BaseAnchoredRefWorker, _ORIGINAL, base_cls)
    return BaseAnchoredRefWorker


def _patcher(ref_dir: str):
    def patch(module) -> None:
        owner = getattr(module, TARGET_CLASS, None)
        current = getattr(owner, "ref_worker_cls", None)
        if current is None:
            raise RuntimeError(
                f"{TARGET_MODULE}.{TARGET_CLASS}.ref_worker_cls is missing: cannot load the KL reference from {ref_dir}"
            )
        if getattr(current, _MARK, None) == ref_dir:
            return
        owner.ref_worker_cls = anchored_ref_worker(getattr(current, _ORIGINAL, current), ref_dir)

    return patch


def arm(ref_dir: str) -> None:
    """Make verl's reference workers in this process load ``ref_dir`` (now or when verl's module is imported)."""
    from fedagent.train.verl.post_import import patch_on_import

    if not ref_dir or not (Path(ref_dir) / "config.json").is_file():
        raise RuntimeError(f"{REF_MODEL_ENV}={ref_dir!r} is not a model directory: cannot load the KL reference")
    patch_on_import(TARGET_MODULE, _patcher(str(ref_dir)), f"load the KL reference from {ref_dir}")
