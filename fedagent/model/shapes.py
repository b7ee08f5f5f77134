"""A decoder's shape and the byte counts every GPU memory estimate shares: the model's parameters, a KV
cache, a training micro-batch's saved activations, and the margins calibrated on measured peaks.

:mod:`fedagent.model.memory` (the local backend's and the eval's jobs, host memory) and
:mod:`fedagent.model.verl_memory` (the verl backend's job) both build on these; ``memory`` re-exports them.

Plan-time code: stdlib only (the Snakefile imports it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

MIB = 2**20
GIB = 2**30
# CUDA context, cuBLAS/cuDNN workspaces, the caching allocator's slack, compiled graphs' memory pools
# and the sampler's CUDA graphs: a fixed part of every GPU job (a context alone is ≈ 0.5 GiB on a
# Hopper card; torch.compile's graphs and the allocator's rounding add the rest).
FIXED_BYTES = int(1.5 * GIB)
MARGIN = 1.25  # on the modelled terms: fragmentation, temporaries the model leaves out
# The training step's activations as the card holds them, per modelled byte: calibrated against measured
# peaks (docs/results/gpu-memory.md). Two presets whose prompts reach their max_prompt_tokens had train jobs
# peaking at 31 974 MiB (gpu-textworld-quest2) and 55 860 MiB (gpu-alfworld) reserved by the caching
# allocator, + ≈ 0.5 GiB of CUDA context, where the uncalibrated estimate declared 21 129 and 36 938:
# covering them under MARGIN needs the activation term × 1.74 and × 1.64 (autograd's saved tensors and
# the allocator's blocks for each step's shapes beside the rollout's). With × 1 six train jobs were
# admitted on the card where four fit, and one ran out of memory. 1.9 leaves 8–11 % over both peaks.
ACTIVATION_FACTOR = 1.9


def kv_cache_bytes(gb: float) -> int:
    """GiB → vLLM's ``kv_cache_memory_bytes`` (a positive whole number of bytes)."""
    if not gb > 0:
        raise ValueError(f"kv_cache_gb must be > 0, got {gb}")
    return int(float(gb) * 2**30)


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only (Llama-style) model's config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False  # Qwen2: biases on q/k/v


def model_shape(config: Mapping) -> ModelShape:
    """The shape of an HF ``config.json`` dict (Llama field names; GQA's ``num_key_value_heads``;
    q/k/v biases for Qwen2 or ``attention_bias``)."""
    try:
        hidden, layers, heads = (
            int(config["hidden_size"]),
            int(config["num_hidden_layers"]),
            int(config["num_attention_heads"]),
        )
        intermediate, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    except KeyError as exc:
        raise ValueError(
            f"model config has no {exc.args[0]!r}: cannot estimate its GPU memory "
            "(set train.gpu_mem_gb / eval.gpu_mem_gb)"
        ) from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    return ModelShape(
        hidden,
        layers,
        heads,
        kv_heads,
        head_dim,
        intermediate,
        vocab,
        bool(config.get("tie_word_embeddings", False)),
        bool(config.get("attention_bias") or config.get("model_type") == "qwen2"),
    )


# SmolLM2-135M(-Instruct)'s config.json (what base_model.smollm2_architecture writes; tests check it).
SMOLLM2_135M = model_shape(
    {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    }
)
# base_model_tiny.build_model's defaults (a vocabulary bound above its byte-level BPE's size).
TINY = model_shape(
    {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 4096,
        "tie_word_embeddings": False,
    }
)


def shape_of_source(source: str) -> ModelShape:
    """The shape of the config's ``model``: ``smollm2``, ``tiny``, ``random:<architecture>`` (its entry in
    :data:`fedagent.core.architectures.ARCHITECTURES`, or ``random:<dir>``'s config.json) or a local HF
    dir (its config.json)."""
    from fedagent.core.architectures import ARCHITECTURES, is_random_source, random_target

    if source == "smollm2":
        return SMOLLM2_135M
    if source == "tiny":
        return TINY
    if is_random_source(source):
        source = random_target(source)
        if source in ARCHITECTURES:
            return model_shape(ARCHITECTURES[source]["config"])
    path = Path(source) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model {source!r}: no config.json to estimate its GPU memory from (set train.gpu_mem_gb / eval.gpu_mem_gb)"
        )
    return model_shape(json.loads(path.read_text()))


def param_count(s: ModelShape) -> int:
    """Parameters of a Llama-style decoder (no biases): embedding, per layer q/k/v/o + gated MLP + 2
    norms, the final norm, and the LM head unless tied to the embedding."""
    attn = s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2
    if s.qkv_bias:
        attn += (s.heads + 2 * s.kv_heads) * s.head_dim
    per_layer = attn + 3 * s.hidden * s.intermediate + 2 * s.hidden
    return s.vocab * s.hidden * (1 if s.tied else 2) + s.layers * per_layer + s.hidden


def kv_cache_size(s: ModelShape, *, batch: int, tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes of a static KV cache: K and V, every layer, ``batch`` rows of ``tokens`` positions."""
    return 2 * s.layers * s.kv_heads * s.head_dim * tokens * batch * dtype_bytes


def _activations(
    s: ModelShape,
    rows: int,
    tokens: int,
    response_tokens: int,
    checkpointing: bool = False,
    token_budget: int | None = None,
) -> int:
    """Saved activations of a training forward (bf16 autocast): per token and layer the norms'
    outputs, q/k/v/o, the MLP's gate/up/act (bf16) and the fp32 residual stream; with
    ``checkpointing`` (``train.activation_checkpointing``) each layer's fp32 input only, plus one
    layer's full set while the backward pass recomputes it; plus, for the response tokens only
    (grpo.forward_logprobs runs the LM head on those), the logits (bf16, fp32 over the
    temperature), their log-softmax, its gradient and the entropy's exp. ``token_budget``
    (``train.micro_batch_tokens``): a micro-batch holds at most that many padded tokens, so the per-token
    terms count ``min(rows × tokens, token_budget)``; the logits still ``rows`` rows of response."""
    per_token_layer = 2 * (6 * s.hidden + 2 * s.kv_heads * s.head_dim + 4 * s.intermediate) + 4 * 2 * s.hidden
    per_token = s.layers * 4 * s.hidden + per_token_layer if checkpointing else s.layers * per_token_layer
    padded = rows * tokens if token_budget is None else min(rows * tokens, token_budget)
    return padded * per_token + rows * min(response_tokens, tokens) * s.vocab * (2 + 4 * 4)
