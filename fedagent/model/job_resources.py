"""What each model-running job asks its scheduler for: GPUs, GPU memory and host memory.

The one place the workflow decides a job's ``gpu`` resource: :func:`job_resources` is what
``workflow/common.smk`` gives every rule that runs a model (train_client, warm_start, eval,
eval_client, eval_base, labels). Snakemake's ``gpu`` resource becomes the Slurm executor plugin's
``--gpus`` (``gpu_model`` beside it: ``--gpus=<model>:<n>``) and counts against a local
``--resources gpu=N``; ``gpu_mem_mb`` is :func:`fedagent.model.memory.job_gpu_mib`'s figure and
``mem_mb`` (Slurm ``--mem``) :func:`fedagent.model.memory.job_host_mib`'s. A CPU job asks ``gpu: 0``.

:func:`gpu_fit_problem` refuses, before any job, a run whose job can never run on this machine's cards
(:mod:`fedagent.core.placement`: more GPUs per job than cards, a job larger than every card), naming
the key that decided the ask.

Plan-time code: stdlib only (the Snakefile imports it).
"""

from __future__ import annotations

from typing import Mapping

from fedagent.core import placement
from fedagent.model.memory import job_gpu_mib, job_host_mib

# Rule → the config section whose device and backend its job runs with. `warm_start` fine-tunes with the
# local backend's code on train.device whatever train.backend is (the whole model, whatever train.lora is); `labels` plays the train tasks with a
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
    elif rule in LOCAL_BACKEND_RULES:  # the warm start is a full fine-tune, with or without LoRA clients
        config = {**config, job: {**config[job], "backend": "local", "lora": {"enabled": False}}}
    gpus, _ = gpu_ask(config, job)
    return {
        "gpu": gpus,
        "gpu_mem_mb": job_gpu_mib(config, job, card_mib=card_mib) if gpus else 0,
        "mem_mb": job_host_mib(config, job),
    }


def planned_rules(config: Mapping) -> tuple[str, ...]:
    """The model-running rules (of :data:`RULE_JOBS`) whose jobs a validated run config plans: the GPU fit
    check asks only theirs, so a rule the run never runs (a full fine-tune warm start, 201 GB at 7B, beside
    LoRA clients that fit one card) cannot refuse the run."""
    rules = ["train_client", "eval"]
    if config["warm_start"]["enabled"]:
        rules += ["warm_start", "eval_base"]
    if config["eval"]["clients"]:
        rules.append("eval_client")
    if config["partition"]["strategy"] == "hardness" and not config["partition"]["labels"]:
        rules.append("labels")
    return tuple(rules)


def gpu_fit_problem(config: Mapping, resources: Mapping[str, Mapping[str, int]], cards: list) -> str | None:
    """Why one of the run's GPU jobs can never run on ``cards`` (:mod:`fedagent.core.placement`'s, as this
    machine shows them), naming the config key that decided its ask; None when every ask fits.

    ``resources`` is rule → :func:`job_resources`: more GPUs per job than cards, no card at all, or a
    job's declared memory larger than every card."""
    for rule, res in resources.items():
        if not res["gpu"]:
            continue
        job = RULE_JOBS[rule]
        why = placement.fit_problem(cards, f"rule {rule}", res["gpu"], res["gpu_mem_mb"])
        if why is not None:
            return f"{gpu_ask(config, job)[1]}: {why}"
    return None
