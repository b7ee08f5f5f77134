"""The config's cross-key rules of the GPU path: the static-cache sampler's keys, declared GPU memory,
the compiled training step. Registered in :data:`fedagent.core.rules.CROSS_RULES` on import (by
:mod:`fedagent.core.config_rules`, which holds the others); each message names its key.
"""

from __future__ import annotations

from fedagent.core.rules import PLAN_ONLY_RULES, cross_rule
from fedagent.core.schema import subschema


def _sampler_key_unused(key: str, engine: str, default):
    def check(get):
        section = key.split(".")[0]
        if get(f"{section}.backend") == engine and get(key) != default:
            return (
                f"{get(key)!r} sets the local GPU path's static-cache sampler, which {section}.backend {engine} "
                f"does not use ({engine} runs its own engine): leave it at {default!r} or use {section}.backend local"
            )
        return None

    return check


# The static-cache sampler's keys with a backend that runs its own engine (verl's vLLM for training,
# vLLM for the eval) would be silently unused: refused at plan time (no job carries {section}.backend).
for _section, _engine in (("train", "verl"), ("eval", "vllm")):
    for _key, _bad in (
        ("sampler", "graph"),
        ("sampler_widths", [64]),
        ("sampler_fused", True),
        ("sampler_compile_prefill", True),
    ):
        _default = subschema(f"{_section}.{_key}")["default"]  # the schema's, never restated here
        PLAN_ONLY_RULES.add(f"{_section}.{_key}")  # this rule: plan time only
        cross_rule(
            f"{_section}.{_key}",
            [f"{_section}.{_key}", f"{_section}.backend"],
            violation={
                f"{_section}.{_key}": _bad,
                f"{_section}.device": "cuda",
                f"{_section}.backend": _engine,
                f"{_section}.max_prompt_tokens": 512,
                **({"train.ref_anchor": "round"} if _section == "train" else {}),
            },
        )(_sampler_key_unused(f"{_section}.{_key}", _engine, _default))


# Seen on the GPU (bench/gpu_throughput.py --train-modes compiled --train-micro 32 at 1.7B, docs/results/scale-1p7b.md;
# 64 rows): the CUDA-graphed training step with its rows in two micro-batches fails in the second
# ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run"; one micro-batch
# of all 64 rows ran). Refused before any job until a fix is measured on the GPU.
@cross_rule(
    "train.compile_train",
    ["train.compile_train", "train.micro_batch_size", "train.mini_batch_size"],
    violation={
        "train.compile_train": True,
        "train.device": "cuda",
        "train.micro_batch_size": 2,
        "train.mini_batch_size": 4,
    },
)
def _compiled_step_takes_one_micro_batch(get):
    if get("train.compile_train") and get("train.micro_batch_size") < get("train.mini_batch_size"):
        return (
            f"true with train.micro_batch_size={get('train.micro_batch_size')} < train.mini_batch_size="
            f"{get('train.mini_batch_size')}: the compiled, CUDA-graphed training step fails on its second "
            "micro-batch on the GPU (docs/results/scale-1p7b.md); set micro_batch_size to mini_batch_size or "
            "compile_train to false"
        )
    return None


def _gpu_mem_on_cpu(section: str, gpu_backend: str):
    def check(get):
        if (
            get(f"{section}.gpu_mem_gb") is not None
            and get(f"{section}.device") == "cpu"
            and get(f"{section}.backend") != gpu_backend
        ):
            return (
                f"{get(f'{section}.gpu_mem_gb')} GiB for a job on the CPU ({section}.device cpu, "
                f"{section}.backend {get(f'{section}.backend')}): set {section}.device cuda, or leave it null"
            )
        return None

    return check


# GPU memory is declared by GPU jobs only (fedagent.model.memory.job_gpu_mib).
for _section, _gpu_backend in (("train", "verl"), ("eval", "vllm")):
    PLAN_ONLY_RULES.add(f"{_section}.gpu_mem_gb")
    cross_rule(
        f"{_section}.gpu_mem_gb",
        [f"{_section}.gpu_mem_gb", f"{_section}.device", f"{_section}.backend"],
        violation={f"{_section}.gpu_mem_gb": 8},
    )(_gpu_mem_on_cpu(_section, _gpu_backend))


def _sampler_widths(section: str):
    def check(get):
        widths = get(f"{section}.sampler_widths")
        if not widths:
            return None
        if get(f"{section}.device") != "cuda":
            return (
                f"{widths} is for the GPU path's static-cache sampler ({section}.device cuda; "
                f"got {get(f'{section}.device')!r})"
            )
        top = get(f"{section}.max_prompt_tokens")
        over = [w for w in widths if w >= top]
        if over:
            return f"{over}: each width must be below {section}.max_prompt_tokens={top} (the widest width)"
        return None

    return check


# Width buckets of the static-cache sampler (fedagent.model.static_sampler): the GPU path (like
# {train,eval}.sampler, not read by the verl / vLLM backends, which run their own engines).
for _section in ("train", "eval"):
    cross_rule(
        f"{_section}.sampler_widths",
        [f"{_section}.sampler_widths", f"{_section}.device", f"{_section}.max_prompt_tokens"],
        violation={f"{_section}.sampler_widths": [64]},
    )(_sampler_widths(_section))


def _gpu_sampler_switch(key: str):
    def check(get):
        section = key.split(".")[0]
        if get(key) and get(f"{section}.device") != "cuda":
            return (
                f"true is for the GPU path's static-cache sampler ({section}.device cuda; "
                f"got {get(f'{section}.device')!r})"
            )
        return None

    return check


# Merged projections (fedagent.model.fused_projections) and the compiled prefill of the static-cache
# sampler: the GPU path only, never silently unused on the CPU.
for _section in ("train", "eval"):
    for _switch in ("sampler_fused", "sampler_compile_prefill"):
        cross_rule(
            f"{_section}.{_switch}",
            [f"{_section}.{_switch}", f"{_section}.device"],
            violation={f"{_section}.{_switch}": True},
        )(_gpu_sampler_switch(f"{_section}.{_switch}"))
