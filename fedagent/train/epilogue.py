"""The job epilogue both training backends end with: the client update dir, written here, once.

A train-client job, the local backend's (:func:`fedagent.train.local.train_client`) or verl's
(:func:`fedagent.train.verl.backend.train_client_verl`), ends by handing :func:`write_client_update`
what it trained (a :class:`ModelUpdate`: writers of the model's files) and what it measured. The
update dir is written through :func:`fedagent.core.atomic.atomic_dir` (staged privately, the manifest
written last, renamed into place) and holds:

- the model update (:func:`write_model_update`, the one place that decides which model files make an
  update), in one of two formats: the fp32 HF dir of the policy at the top (a full fine-tune) or, for a
  LoRA client (``train.lora``), only its adapters' factors (:mod:`fedagent.model.lora`: PEFT's
  ``adapter_config.json`` + ``adapter_model.safetensors``); when the job trained a value model (PPO), its
  fp32 HF dir in ``critic/``, recorded by digest in the metrics (``critic_sha256``: verify compares it).
  The metrics record what the update's files weigh (``upload_bytes``: what the client sends);
- ``metrics.json``: the job's metrics, built once the model files are written (verl records the
  conversion's world size and seconds), plus ``timings`` (the job's clock, marked ``saved``) and, for a
  Byzantine client, ``update_transform`` (its model files were rewritten: fedagent.train.update_transform);
- ``samples.jsonl``: one episode record a line, in the job's order;
- ``provenance.json``, where the job records one (the local backend; verl's updates carry none);
- ``manifest.json``, last.

Every JSON file is written with sorted keys: a dict's insertion order never reaches the bytes, so the
same job writes the same files whichever backend built its dicts in whichever order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from fedagent.model.update_layout import FORMAT_RECORD, LORA, METRICS_JSON, SAMPLES_JSONL, UPLOAD_BYTES

if TYPE_CHECKING:
    from fedagent.core.atomic import Verifying
    from fedagent.core.timing import PhaseClock
    from fedagent.train.update_transform import UpdateTransform as Transform


@dataclass(frozen=True)
class ModelUpdate:
    """The trained model as a backend hands it over: the writers of its files.

    ``write_policy(dir)`` writes the policy's fp32 HF dir into ``dir`` and returns what the job's metrics
    record of the writing (verl: the checkpoint's ``world_size``; the local backend: nothing).
    ``write_adapter(dir)`` (LoRA) writes the adapters' factors instead (:func:`fedagent.model.lora.write_adapter`)
    and returns what the metrics record of them under ``lora``; exactly one of the two is given.
    ``write_critic(dir)`` (PPO) writes the trained value model's fp32 HF dir into ``dir``.
    """

    write_policy: Callable[[Path], dict | None] | None = None
    write_critic: Callable[[Path], None] | None = None
    write_adapter: Callable[[Path], dict] | None = None


@dataclass(frozen=True)
class UpdateWritten:
    """What :func:`write_model_update` wrote: the policy writer's answer and the entries the update's
    metrics record of its files (``critic_sha256`` with a critic)."""

    policy: dict
    record: dict


def write_model_update(
    staging: Path, update: ModelUpdate, transform: Transform | None = None, start: Path | None = None
) -> UpdateWritten:
    """Write the model update into ``staging``: the one function that lays out the update's model files.

    A full update is the policy's HF dir at the top; a LoRA update its adapters' files at the top
    (``update_format: lora`` and the writer's record under ``lora`` in the metrics); a trained critic's
    HF dir in ``critic/``. The jobs hand over what they trained and never write model files themselves.
    ``transform`` (a Byzantine client, fedagent.train.update_transform) rewrites the written files
    against the ``start`` model (a LoRA update: its B factors, fedagent.train.transformed_update) before
    anything records their digests. ``upload_bytes``: every file written here, the bytes a client sends.
    """
    from fedagent.train.transformed_update import apply

    if (update.write_policy is None) == (update.write_adapter is None):
        raise ValueError("a model update is either the policy's full weights or its adapters: give exactly one writer")
    record = {}
    if update.write_adapter is not None:
        policy = {}
        record[FORMAT_RECORD] = LORA
        record[LORA] = update.write_adapter(staging)
    else:
        policy = update.write_policy(staging) or {}
    if update.write_critic is not None:
        from fedagent.model.critic_dir import critic_of

        update.write_critic(critic_of(staging))
    if transform is not None:
        record.update(apply(transform, staging, start))
    if update.write_critic is not None:
        from fedagent.model.critic_dir import CRITIC_RECORD, critic_digests

        # whose critic this is: verify compares it with the files found in critic/ (critic_dir)
        record[CRITIC_RECORD] = critic_digests(staging)
    record[UPLOAD_BYTES] = sum(f.stat().st_size for f in Path(staging).rglob("*") if f.is_file())
    return UpdateWritten(policy=policy, record=record)


def write_client_update(
    out_dir: Path,
    update: ModelUpdate,
    *,
    metrics: Callable[[dict], dict],
    samples: Iterable[dict],
    clock: PhaseClock,
    provenance: dict | None = None,
    quarantine: Path | None = None,
    inputs: Verifying | None = None,
    transform: Transform | None = None,
    start: Path | None = None,
) -> dict:
    """Write one client update dir atomically (see the module docstring); return its metrics.

    ``metrics(policy)``: the job's metrics, called once the model files are written with what the policy's
    writer returned. ``clock``: the job's :class:`fedagent.core.timing.PhaseClock`. ``provenance``: the
    keyword arguments of :func:`fedagent.core.provenance.write_provenance` (None: no provenance.json).
    ``inputs``: the job's input checks still running (:func:`fedagent.core.atomic.verifying`), waited for
    before anything is written, so nothing derived from an unverified input reaches the final path.
    ``transform``: a Byzantine client's (:func:`write_model_update`), against the round's ``start`` model.
    """
    from fedagent.core.atomic import atomic_dir

    with atomic_dir(Path(out_dir), quarantine) as staging:
        if inputs is not None:
            inputs.wait()
        written = write_model_update(staging, update, transform, start)
        result = metrics(written.policy)
        result.update(written.record)
        write_job_records(staging, result, clock, samples, SAMPLES_JSONL, provenance)
    return result


def write_job_records(
    staging: Path,
    metrics: dict,
    clock: PhaseClock,
    records: Iterable[dict],
    records_name: str,
    provenance: dict | None = None,
) -> None:
    """A job's records beside its model files in ``staging``: ``metrics.json`` with the clock's
    ``timings`` (marked ``saved``: the model files are written), one JSON line per record in
    ``records_name``, and ``provenance.json`` (``provenance``: :func:`write_provenance`'s keyword
    arguments; None: none)."""
    clock.mark("saved")
    metrics["timings"] = clock.summary()
    (Path(staging) / METRICS_JSON).write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n")
    with open(Path(staging) / records_name, "w") as fh:
        for rec in records:
            fh.write(json.dumps(rec, sort_keys=True) + "\n")
    if provenance is not None:
        from fedagent.core.provenance import write_provenance

        write_provenance(staging, **provenance)


def seconds(x: float) -> float:
    """Seconds to 3 decimals (wall times are informational only)."""
    return float(f"{x:.3f}")


def require_start_critic(model_dir: Path) -> Path:
    """The start model's ``critic/`` a PPO job trains from (ValueError naming the model without one)."""
    from fedagent.model.critic_dir import critic_of

    critic = critic_of(model_dir)
    if not critic.is_dir():
        raise ValueError(f"train.algorithm ppo: the start model {model_dir} has no critic/ (value model)")
    return critic
