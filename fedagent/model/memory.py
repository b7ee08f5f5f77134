"""GPU memory: the sizes a job asks of the card (vLLM's KV cache) and what a GPU job will hold.

:func:`job_gpu_mib` is what a ``train_client`` / ``eval`` job declares to Snakemake as its
``gpu_mem_mb`` resource (MiB): the profile caps the sum over the jobs running at once at the card's
size, so a round's concurrent GPU jobs never OOM each other (docs/explanation/gpu-memory.md). Its
estimate is a conservative model of the local backend's job, from the model's shape
(:func:`model_shape`: a ``config.json`` dict, or :data:`SMOLLM2_135M` / :data:`TINY` for the
built-in sources) and the job's knobs — the terms are :func:`train_terms` / :func:`eval_terms`.
An explicit ``train.gpu_mem_gb`` / ``eval.gpu_mem_gb`` replaces it. :func:`oom_names_the_knobs`
turns a CUDA out-of-memory error of a job into one message naming the knobs.

Host memory: :func:`job_host_mib` is a job's ``mem_mb`` (Slurm ``--mem``), from :func:`host_terms`
(calibrated on the default CPU train job's measured peak RSS); ``fedagent.model.job_resources`` gives
both to the rules.

Plan-time code: stdlib only (the Snakefile imports it; torch is looked up only if already imported).
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Iterator, Mapping

from fedagent.model import verl_memory

# The shapes and the byte counts every estimate shares (re-exported: callers read them from here too).
from fedagent.model.shapes import (  # noqa: F401
    ACTIVATION_FACTOR,
    FIXED_BYTES,
    GIB,
    MARGIN,
    MIB,
    SMOLLM2_135M,
    TINY,
    ModelShape,
    _activations,
    kv_cache_bytes,
    kv_cache_size,
    model_shape,
    param_count,
    shape_of_source,
)

# The eval's prefill transient, likewise: TextWorld's and ALFWorld's eval jobs stayed within MARGIN
# (2 678 and 4 542 MiB reserved against 3 699 and 5 183 declared), but WebShop's, whose prompts reach
# 2 048 tokens in batches of 64, held 8 534 MiB + ≈ 0.5 GiB of context against 8 165 declared:
# covering it under MARGIN needs the prefill term × 1.38. 1.6 leaves ≈ 5 % over it.
PREFILL_FACTOR = 1.6


# The in × out features of each projection a LoRA adapter can target (train.lora.target_modules).
def _projection_features(s: ModelShape) -> dict[str, tuple[int, int]]:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {
        "q_proj": (s.hidden, q),
        "k_proj": (s.hidden, kv),
        "v_proj": (s.hidden, kv),
        "o_proj": (q, s.hidden),
        "gate_proj": (s.hidden, s.intermediate),
        "up_proj": (s.hidden, s.intermediate),
        "down_proj": (s.intermediate, s.hidden),
    }


def lora_param_count(s: ModelShape, rank: int, targets) -> int:
    """Parameters of LoRA adapters of rank ``rank`` on the ``targets`` projections of every layer:
    r·(in + out) each (A is r × in, B out × r)."""
    features = _projection_features(s)
    unknown = sorted(set(targets) - set(features))
    if unknown:
        raise ValueError(f"train.lora.target_modules: no projection {unknown} in a Llama-style decoder")
    return s.layers * sum(rank * sum(features[t]) for t in targets)


def lora_of(config: Mapping) -> tuple[int, int] | None:
    """``(rank, adapter parameters)`` of a config's LoRA clients (``train.lora``), None when off."""
    lo = config["train"].get("lora") or {}
    if not lo.get("enabled"):
        return None
    shape = shape_of_source(config["model"])
    return lo["rank"], lora_param_count(shape, lo["rank"], lo["target_modules"])


def reference_bytes(s: ModelShape) -> int:
    """The GPU path's KL reference (:func:`fedagent.train.actor.bf16_reference`): linear weights in bf16
    (2 B), the embedding and the norms in fp32 (4 B; a tied LM head is the embedding)."""
    fp32 = s.vocab * s.hidden + (2 * s.layers + 1) * s.hidden
    return 4 * fp32 + 2 * (param_count(s) - fp32)


def train_terms(
    s: ModelShape,
    *,
    micro_batch_size: int,
    pool_size: int,
    max_prompt_tokens: int,
    max_new_tokens: int,
    response_tokens: int | None = None,
    reference: bool = True,
    ppo: bool = False,
    checkpointing: bool = False,
    lora_params: int = 0,
    micro_batch_tokens: int | None = None,
) -> dict[str, int]:
    """Bytes of a local-backend ``train-client`` job on cuda, by term (before margin and fixed part):
    fp32 master weights + gradients + AdamW's two moments (16 B/param), the KL reference (its linear
    weights bf16: :func:`reference_bytes`), the bf16 rollout copy, the sampler's static KV cache
    (``pool_size`` rows of prompt + new tokens), one micro-batch's activations and response logits
    (``response_tokens`` per row: one turn's ``max_new_tokens`` windowed, every turn's in concat
    mode; ``checkpointing``: train.activation_checkpointing; ``micro_batch_tokens``: its padded tokens
    at most that; × :data:`ACTIVATION_FACTOR`, measured);
    PPO: its critic (16 B/param more). LoRA clients (``lora_params`` > 0, the adapters' parameters):
    the frozen base as the reference holds it (linear weights bf16) and 16 B per adapter parameter
    instead of the fp32 masters and their AdamW state; ``reference`` then means a second copy (a KL
    reference other than the start model: with the start model's weights it is the base, adapters off)."""
    p = param_count(s)
    tokens = max_prompt_tokens + max_new_tokens
    if lora_params:
        weights = {"frozen_base": reference_bytes(s), "adapters_and_adamw": 16 * int(lora_params)}
    else:
        weights = {"policy_and_adamw": 16 * p}
    return {
        **weights,
        "reference": reference_bytes(s) if reference else 0,
        "rollout_copy": 2 * p,
        "critic": 16 * p if ppo else 0,
        "kv_cache": kv_cache_size(s, batch=pool_size, tokens=tokens),
        "activations": int(
            ACTIVATION_FACTOR
            * _activations(
                s,
                micro_batch_size,
                tokens,
                max_new_tokens if response_tokens is None else response_tokens,
                checkpointing=checkpointing,
                token_budget=micro_batch_tokens,
            )
        ),
    }


def eval_terms(s: ModelShape, *, batch: int, max_prompt_tokens: int, max_new_tokens: int) -> dict[str, int]:
    """Bytes of a local-backend ``eval`` job on cuda: the weights (loaded fp32, then bf16), the static
    KV cache (``batch`` rows), the prefill's transient activations (one layer's hidden states, q/k/v
    and MLP, bf16) and its last-position logits (the sampler keeps one: bf16 + fp32), the latter two
    × :data:`PREFILL_FACTOR`, measured)."""
    p = param_count(s)
    tokens = max_prompt_tokens + max_new_tokens
    per_token = 2 * (4 * s.hidden + 2 * s.kv_heads * s.head_dim + 3 * s.intermediate)
    return {
        "weights": 4 * p,
        "kv_cache": kv_cache_size(s, batch=batch, tokens=tokens),
        "prefill": int(PREFILL_FACTOR * batch * (max_prompt_tokens * per_token + s.vocab * 6)),
    }


def train_config_terms(config: Mapping, shape: ModelShape) -> dict[str, int]:
    """:func:`train_terms` with a validated config's knobs (``fedagent gpu-mem`` prints these)."""
    sec = config["train"]
    lora = lora_of(config)
    # LoRA: the KL reference is the start model (adapters off, no copy) in round 1 and with ref_anchor round
    second_reference = not lora or (sec.get("ref_anchor") == "base" and config.get("rounds", 1) > 1)
    return train_terms(
        shape,
        micro_batch_size=sec["micro_batch_size"],
        pool_size=config["env"]["pool_size"],
        max_prompt_tokens=sec["max_prompt_tokens"],
        max_new_tokens=sec["max_new_tokens"],
        response_tokens=sec["max_new_tokens"] * (sec["max_turns"] if config["rollout"]["mode"] == "concat" else 1),
        reference=bool(sec["kl_coef"]) and second_reference,
        ppo=sec["algorithm"] == "ppo",
        checkpointing=bool(sec.get("activation_checkpointing")),
        lora_params=lora[1] if lora else 0,
        micro_batch_tokens=sec.get("micro_batch_tokens"),
    )


def estimate_bytes(terms: Mapping[str, int], extra: int = 0) -> int:
    """The declared size: margin × the modelled terms + ``extra`` (a vLLM engine's fixed share) + the fixed part."""
    return int(MARGIN * sum(terms.values())) + int(extra) + FIXED_BYTES


def _vllm_share(section: Mapping, card_mib: int | None) -> int:
    """Bytes the eval's vLLM engine holds beyond what the terms model: its fixed KV cache (``kv_cache_gb``),
    else its ``gpu_memory_utilization`` share of the card (0 when no card size is known: no cap,
    nothing to count against)."""
    if section.get("kv_cache_gb"):
        return kv_cache_bytes(section["kv_cache_gb"])
    return int(float(section["gpu_memory_utilization"]) * card_mib * MIB) if card_mib else 0


def job_gpu_mib(config: Mapping, job: str, card_mib: int | None = None) -> int:
    """``gpu_mem_mb`` of a ``train`` or ``eval`` job of a validated config (0 for a CPU job).

    ``train.gpu_mem_gb`` / ``eval.gpu_mem_gb`` when set; else the estimate (:func:`train_terms` /
    :func:`eval_terms`, plus the vLLM engine's share for eval.backend=vllm). train.backend=verl: the
    verl job's own plan (:func:`fedagent.model.verl_memory.config_plan`: its memory settings sized to the
    card's share, or to train.gpu_mem_gb, which it must fit; refused naming the key when nothing fits).
    ``card_mib``: the card's usable size where known (the cap).
    """
    if job not in ("train", "eval"):
        raise ValueError(f"job {job!r}: expected train or eval")
    sec = config[job]
    backend = sec["backend"]
    on_gpu = sec["device"] == "cuda" or backend in ("verl", "vllm")
    if not on_gpu:
        return 0
    if job == "train" and backend == "verl":
        declared = verl_memory.config_plan(config, card_mib, job_gpu_mib(config, "eval", card_mib)).declared_mib
        if sec.get("gpu_mem_gb") is None:
            return declared
    if sec.get("gpu_mem_gb") is not None:
        return int(math.ceil(float(sec["gpu_mem_gb"]) * GIB / MIB))
    shape = shape_of_source(config["model"])
    if job == "train":
        terms, extra = train_config_terms(config, shape), 0
    else:
        terms = eval_terms(
            shape,
            batch=min(sec["batch"], config["env"]["pool_size"]),
            max_prompt_tokens=sec["max_prompt_tokens"],
            max_new_tokens=sec["max_new_tokens"],
        )
        extra = _vllm_share(sec["vllm"], card_mib) if backend == "vllm" else 0
    return int(math.ceil(estimate_bytes(terms, extra) / MIB))


KNOBS = {
    "train-client": (
        "train.gpu_mem_gb (the memory this job declares, so fewer jobs share the card)",
        "train.micro_batch_size or train.micro_batch_tokens, env.pool_size (the sampler's batch) or "
        "train.max_prompt_tokens",
    ),
    "eval": (
        "eval.gpu_mem_gb (the memory this job declares, so fewer jobs share the card)",
        "eval.batch, env.pool_size or eval.max_prompt_tokens",
    ),
    "warm-start": (
        "train.gpu_mem_gb (the warm start declares the train job's memory)",
        "train.micro_batch_size or train.micro_batch_tokens, or train.max_prompt_tokens",
    ),
}


def gpu_peak_mib(device: str = "cuda") -> dict[str, int]:
    """The job's peak GPU memory so far (MiB; torch's caching allocator: what tensors held at most,
    and what the allocator had reserved from the card at most, the figure to compare with the
    declared ``gpu_mem_mb``; neither counts the CUDA context, ≈ 0.5 GiB). Empty off CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not str(device).startswith("cuda") or not torch.cuda.is_initialized():
        return {}
    return {
        "gpu_peak_allocated_mib": int(math.ceil(torch.cuda.max_memory_allocated() / MIB)),
        "gpu_peak_reserved_mib": int(math.ceil(torch.cuda.max_memory_reserved() / MIB)),
    }


class GpuOutOfMemory(SystemExit):
    """A job's CUDA out-of-memory error, as the one-line exit message naming the knobs."""


def is_cuda_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's CUDA out-of-memory error (torch looked up only if already imported)."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return (oom is not None and isinstance(exc, oom)) or (
        isinstance(exc, RuntimeError) and "CUDA out of memory" in str(exc)
    )


def oom_message(command: str, exc: BaseException) -> str:
    """One line: what ran out, torch's first line, and the knobs to turn."""
    declared, smaller = KNOBS[command]
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return (
        f"fedagent {command}: CUDA out of memory ({first}). Raise {declared}, or lower {smaller}; "
        f"the cap of all GPU jobs' gpu_mem_mb is read from the cards (less FEDAGENT_GPU_RESERVE_MIB each), or --resources gpu_mem_mb=<MiB> (docs/explanation/gpu-memory.md)"
    )


@contextlib.contextmanager
def oom_names_the_knobs(command: str) -> Iterator[None]:
    """Run a job's body; a CUDA out-of-memory error leaves as :class:`GpuOutOfMemory` (exit message)."""
    if command not in KNOBS:
        raise ValueError(f"no GPU memory knobs for {command!r}")
    try:
        yield
    except BaseException as exc:
        if is_cuda_oom(exc):
            raise GpuOutOfMemory(oom_message(command, exc)) from exc
        raise


# ---- host memory (RAM): what a job asks its scheduler as `mem_mb` (Slurm --mem)

# The process itself: the interpreter with torch, transformers and the tokenizer imported, the games'
# data and the episode loop. On cuda the CUDA runtime's host side (driver, cuBLAS/cuDNN images, pinned
# staging buffers) comes on top; a vLLM engine (eval.backend vllm) and verl's Ray workers more again.
HOST_FIXED_BYTES = {"cpu": int(1.0 * GIB), "cuda": int(3.0 * GIB), "vllm": int(8.0 * GIB), "verl": int(16.0 * GIB)}
# One env service process (its envs' state; a TextWorld game engine each): per worker process of env.procs.
HOST_ENV_PROC_BYTES = int(0.5 * GIB)
# The CPU training step's activations on the host, per modelled byte of :func:`_activations`: calibrated
# against the default run's train job (SmolLM2-135M on the CPU; docs/results/cpu.md and
# docs/how-to/slurm.md: 5.3-6.7 GB peak RSS across runs): with × 1 the estimate under HOST_MARGIN is
# 7.1 GiB (7.6 GB), ≈ 13 % over the highest peak; × 2 (fp32 against the bf16 the term counts) declared
# 9.1 GiB, 46 % over it. The default eval job (0.8-1.1 GB measured) gets 2.6 GiB: the fixed parts
# dominate a small model's, and they are sized for the train job.
HOST_ACTIVATION_FACTOR = 1.0
HOST_MARGIN = 1.25


def host_terms(config: Mapping, job: str) -> dict[str, int]:
    """Bytes of host memory a ``train`` (train_client, warm_start) or ``eval`` (eval, eval_client,
    eval_base, labels) job holds at its peak, by term (before margin):

    - ``runtime``: :data:`HOST_FIXED_BYTES` of the job's kind (cpu, cuda, vllm or verl);
    - ``env_service``: :data:`HOST_ENV_PROC_BYTES` per env worker process (``env.procs``, at least one);
    - on the CPU, train: fp32 weights + gradients + AdamW's moments (16 B/param), the fp32 KL reference
      (``train.kl_coef``), a PPO critic (16 B/param), the KV cache in fp32 and one micro-batch's
      activations (× :data:`HOST_ACTIVATION_FACTOR`); eval: fp32 weights and the KV cache in fp32;
    - on cuda: the fp32 state dict read from disk while the model loads and the fp32 update gathered
      on the host while it is saved (train: 2 × 4 B/param, PPO twice), eval 4 B/param; verl with its
      optimizer offloaded keeps fp32 weights and AdamW on the host (16 B/param).

    The GPU figures are a model, not a measurement: no host peak of a 1.7B GPU job is recorded in
    docs/results (scale-1p7b.md records 0.59 GB for writing its 6.8 GB base model, which streams).
    """
    if job not in ("train", "eval"):
        raise ValueError(f"job {job!r}: expected train or eval")
    sec = config[job]
    backend = sec.get("backend", "local")
    kind = {"verl": "verl", "vllm": "vllm"}.get(backend) or ("cuda" if sec.get("device") == "cuda" else "cpu")
    s = shape_of_source(config["model"])
    p = param_count(s)
    tokens = sec["max_prompt_tokens"] + sec["max_new_tokens"]
    terms = {
        "runtime": HOST_FIXED_BYTES[kind],
        "env_service": HOST_ENV_PROC_BYTES * max(1, int(config["env"].get("procs") or 0)),
    }
    lora = lora_of(config) if job == "train" else None
    if job == "train" and kind == "cpu":
        ppo = sec.get("algorithm") == "ppo"
        if lora:  # the frozen fp32 base and the adapters' weights, gradients and moments; the reference may be the base
            terms["frozen_base_and_adapters"] = 4 * p + 16 * lora[1]
            second = sec.get("ref_anchor") == "base" and config.get("rounds", 1) > 1
            terms["reference"] = 4 * p if sec.get("kl_coef") and second else 0
        else:
            terms["policy_and_adamw"] = 16 * p
            terms["reference"] = 4 * p if sec.get("kl_coef") else 0
        terms["critic"] = 16 * p if ppo else 0
        terms["kv_cache"] = kv_cache_size(s, batch=config["env"]["pool_size"], tokens=tokens, dtype_bytes=4)
        response = sec["max_new_tokens"] * (sec["max_turns"] if config["rollout"]["mode"] == "concat" else 1)
        act = _activations(
            s,
            sec["micro_batch_size"],
            tokens,
            response,
            bool(sec.get("activation_checkpointing")),
            token_budget=sec.get("micro_batch_tokens"),
        )
        terms["activations"] = int(HOST_ACTIVATION_FACTOR * act)
    elif job == "train" and lora:  # the fp32 state dict read while loading; the update saved is the adapters
        terms["load_and_save"] = 4 * p + 2 * 4 * lora[1]
    elif job == "train":
        terms["load_and_save"] = 2 * 4 * p * (2 if sec.get("algorithm") == "ppo" else 1)
        terms["offload"] = 16 * p if kind == "verl" else 0
    elif kind == "cpu":
        terms["weights"] = 4 * p
        batch = min(sec["batch"], config["env"]["pool_size"])
        terms["kv_cache"] = kv_cache_size(s, batch=batch, tokens=tokens, dtype_bytes=4)
    else:
        terms["load"] = 4 * p
    return terms


def job_host_mib(config: Mapping, job: str) -> int:
    """``mem_mb`` of a ``train`` or ``eval`` job (MiB: Slurm's --mem unit): :data:`HOST_MARGIN` × :func:`host_terms`."""
    return int(math.ceil(HOST_MARGIN * sum(host_terms(config, job).values()) / MIB))
