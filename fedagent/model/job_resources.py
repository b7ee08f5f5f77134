"""What each model-running job asks its scheduler for: GPUs, GPU memory and host memory.

The one place the workflow decides a job's ``gpu`` resource: :func:`job_resources` is what
``workflow/common.smk`` gives every rule that runs a model (train_client, warm_start, eval,
eval_client, eval_base, labels). Snakemake's ``gpu`` resource becomes the Slurm executor plugin's
``--gpus`` (``gpu_model`` beside it: ``--gpus=<model>:<n>``) and counts against a local
``--resources gpu=N``; ``gpu_mem_mb`` is :func:`fedagent.model.memory.job_gpu_mib`'s figure and
``mem_mb`` (Slurm ``--mem``) :func:`fedagent.model.memory.job_host_mib`'s. A CPU job asks ``gpu: 0``.

:func:`check_gpus_fit` refuses, before any job, a config whose job asks more GPUs than the machine
shows, where that can be known cheaply (no torch): ``CUDA_VISIBLE_DEVICES`` or the NVIDIA driver's
``/proc/driver/nvidia/gpus``. The job placement code can call it with the cards it sees.

Plan-time code: stdlib only (the Snakefile imports it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from fedagent.core.errors import ConfigError
from fedagent.model.memory import job_gpu_mib, job_host_mib

# Rule → the config section whose device and backend its job runs with. `warm_start` fine-tunes with the
# local backend's code on train.device whatever train.backend is; `labels` plays the train tasks with a
# reference policy on the CPU (`fedagent labels` takes no device), so it asks for no GPU and its host
# memory is a CPU eval job's.
RULE_JOBS = {
    "train_client": "train",
    "warm_start": "train",
    "eval": "eval",
    "eval_client": "eval",
    "eval_base": "eval",
    "labels": "eval",
}
LOCAL_BACKEND_RULES = frozenset({"warm_start"})
CPU_ONLY_RULES = frozenset({"labels"})


def gpu_ask(config: Mapping, job: str) -> tuple[int, str]:
    """(GPUs a ``train`` or ``eval`` job of a validated config runs on, the config key deciding it):
    train.backend verl → ``train.verl.gpus``; eval.backend vllm → 1 (one engine on one GPU);
    else 1 when the section's ``device`` is cuda, 0 on the CPU."""
    if job not in ("train", "eval"):
        raise ValueError(f"job {job!r}: expected train or eval")
    sec = config[job]
    if job == "train" and sec["backend"] == "verl":
        return int(sec["verl"]["gpus"]), "train.verl.gpus"
    if job == "eval" and sec["backend"] == "vllm":
        return 1, "eval.backend"
    return (1 if sec["device"] == "cuda" else 0), f"{job}.device"


def job_resources(config: Mapping, rule: str, card_mib: int | None = None) -> dict[str, int]:
    """``{gpu, gpu_mem_mb, mem_mb}`` of a rule's job (``card_mib``: the profile's GPU memory cap, for a
    vLLM share given as a fraction of the card). ``gpu_mem_mb`` is 0 whenever ``gpu`` is."""
    job = RULE_JOBS[rule]
    if rule in CPU_ONLY_RULES:
        config = {**config, job: {**config[job], "device": "cpu", "backend": "local"}}
    elif rule in LOCAL_BACKEND_RULES:
        config = {**config, job: {**config[job], "backend": "local"}}
    gpus, _ = gpu_ask(config, job)
    return {
        "gpu": gpus,
        "gpu_mem_mb": job_gpu_mib(config, job, card_mib=card_mib) if gpus else 0,
        "mem_mb": job_host_mib(config, job),
    }


def visible_gpus(
    environ: Mapping[str, str] | None = None, driver: Path = Path("/proc/driver/nvidia/gpus")
) -> int | None:
    """The GPUs this process would see, or None where that is not known without CUDA: the entries of
    ``CUDA_VISIBLE_DEVICES`` when set (up to the first invalid one, as CUDA reads it), else the NVIDIA
    driver's cards (one directory each under ``/proc/driver/nvidia/gpus``); None without a driver."""
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        n = 0
        for item in value.split(","):
            item = item.strip()
            if not item or item.startswith("-") or not (item.isdigit() or item.startswith(("GPU-", "MIG-"))):
                break
            n += 1
        return n
    if driver.is_dir():
        return sum(1 for p in driver.iterdir() if p.is_dir())
    return None


def check_gpus_fit(config: Mapping, visible: int | None = None) -> None:
    """Raise :class:`ConfigError` naming the key when a train or eval job asks more GPUs than ``visible``
    (default: :func:`visible_gpus`); nothing when the count is unknown (no driver, CUDA_VISIBLE_DEVICES
    unset) or every ask fits."""
    if visible is None:
        visible = visible_gpus()
    if visible is None:
        return
    for job in ("train", "eval"):
        gpus, key = gpu_ask(config, job)
        if gpus > visible:
            raise ConfigError(
                f"{key}: a {job} job asks for {gpus} GPU(s) but this machine shows {visible} "
                f"(CUDA_VISIBLE_DEVICES or the NVIDIA driver); lower it or run where the cards are"
            )
