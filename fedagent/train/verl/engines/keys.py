"""Which verl overrides of a job shape its engines (the engine set's key) and which are the job's own.

A job may run on a live engine set only if every override that shapes the engines is the set's: the
set's key is the sha256 of those overrides. The job's own ones (:data:`PER_JOB`: its rows, start model,
critic, checkpoint dir, names, seed) are applied per job by the reset, or are the set's own (the Ray temp
dir, the agent-loop YAML, the job tag: one per set).
"""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

from fedagent.train.verl.launch import TAG_ENV

# Override keys (as written, ``+`` included) that differ between the jobs of one set.
PER_JOB = (
    "data.train_files",
    "data.val_files",  # the job's rows (the reset's new dataloader)
    "actor_rollout_ref.model.path",  # the start model (reset_engines' model_dir)
    "critic.model.path",  # the round's critic (set_model_path + reset)
    "critic.model.tokenizer_path",  # the start model dir again (the tokenizer is the set's)
    "actor_rollout_ref.rollout.seed",  # vLLM's engine seed: the set's first job's (requests carry their own)
    "actor_rollout_ref.rollout.agent.agent_loop_config_path",  # the set's YAML (naming the set's job file)
    "trainer.experiment_name",
    "trainer.default_local_dir",
    "+ray_kwargs.ray_init._temp_dir",  # the set's own Ray temp dir
    f"+ray_kwargs.ray_init.runtime_env.env_vars.{TAG_ENV}",  # the set's tag (salts its IPC sockets)
)


def split(overrides: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(the engine-shaping overrides in order, {per-job key: value})."""
    shaping, own = [], {}
    for o in overrides:
        key, _, value = o.partition("=")
        if key in PER_JOB:
            own[key] = value
        else:
            shaping.append(o)
    return shaping, own


def engine_key(overrides: Sequence[str], agent_loop_entry: dict | None = None) -> str:
    """The sha256 of what a live set would otherwise keep from its first job: the engine-shaping overrides
    (their order kept: Hydra applies them in order), the agent-loop YAML entry minus its job file (verl
    reads it once per worker: turns, prompt budget, penalty, history, answer format), and the code that
    runs (:func:`code_digest`)."""
    shaping, _ = split(overrides)
    entry = {k: v for k, v in (agent_loop_entry or {}).items() if k != "job_file"}
    return hashlib.sha256(json.dumps([shaping, entry, code_digest()], sort_keys=True).encode()).hexdigest()


def code_digest() -> str:
    """fedagent's own source (every ``.py`` file of the package, by relative path) and the installed
    verl, vLLM, Ray and transformers versions: a set started by other code never serves a job."""
    from importlib import metadata
    from pathlib import Path

    import fedagent

    root = Path(fedagent.__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    for dist in ("verl", "vllm", "ray", "transformers"):
        try:
            h.update(f"{dist}=={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist} absent".encode())
    return h.hexdigest()


def replace(overrides: Sequence[str], values: dict[str, str]) -> list[str]:
    """``overrides`` with the value of each key in ``values`` replaced (every key must be present)."""
    out, seen = [], set()
    for o in overrides:
        key, _, _ = o.partition("=")
        if key in values:
            out.append(f"{key}={values[key]}")
            seen.add(key)
        else:
            out.append(o)
    missing = sorted(set(values) - seen)
    if missing:
        raise KeyError(f"overrides have no {missing}")
    return out
