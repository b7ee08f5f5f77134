"""One GEMM for a decoder layer's q/k/v projections and one for its gate/up projections (the GPU sampler).

At the batch sizes a rollout decodes (tens of rows), a projection's GEMM is bound by reading its
weight, and the small ones run far below the card's bandwidth (a 2048 × 2048 projection reaches
about half the bandwidth of a 2048 × 8192 one; ``bench/gpu_throughput.py --profile``, docs/results/scale-1p7b.md). vLLM loads the same weights
as merged ``qkv_proj`` / ``gate_up_proj`` matrices; :func:`fuse_projections` does that to a loaded
transformers model in place, for inference copies only (the rollout copy and the eval's model):

- each layer's ``q_proj``/``k_proj``/``v_proj`` weights (and biases, Qwen2) are copied into one
  contiguous ``[q + k + v, hidden]`` tensor, and the three modules' parameters become **views** of
  it; the same for ``gate_proj``/``up_proj``. ``model.parameters()`` keeps its order, names, shapes
  and values, so writing new weights into the model (the train job's per-epoch ``copy_`` from the
  trained policy, ``load_state_dict``) writes into the merged tensors: there is no second copy to
  keep in step, and no extra memory;
- the attention and MLP modules' ``forward`` become the transformers forward with the two or three
  projections replaced by one ``F.linear`` and a split (the rotary embedding, the cache update and
  the attention kernel are the model's own functions, looked up in its modeling module).

The numbers are the same up to the GEMM kernels' floating-point order (the tests compare logits and
greedy tokens with the unfused model). A fused model is for sampling only and is never saved: its
projections' parameters share one storage, which a checkpoint writer would take for tied weights.
Supported: the Llama and Qwen2 families (SmolLM2, Qwen2.5); any other architecture is a clear error,
never a silent fallback.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_CLASSES = ("LlamaAttention", "Qwen2Attention")
MLP_CLASSES = ("LlamaMLP", "Qwen2MLP")


def _merge(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
    """Copy ``linears``' weights (and biases) into one tensor each; their parameters become views of it."""
    weight = torch.cat([m.weight.detach() for m in linears], dim=0)
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("fuse_projections: some of a layer's merged projections have a bias and some do not")
    bias = torch.cat([m.bias.detach() for m in linears], dim=0) if all(has_bias) else None
    sizes = tuple(m.weight.shape[0] for m in linears)
    start = 0
    for m, n in zip(linears, sizes):
        # nn.Parameter shares the view's storage: a later copy_ into the module's weight lands in the merged tensor.
        m.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return weight, bias, sizes


def _attention_forward(modeling):
    """The transformers attention forward of ``modeling`` (a Llama-family modeling module) with one q/k/v GEMM."""
    rotary, interfaces, eager = (
        modeling.apply_rotary_pos_emb,
        modeling.ALL_ATTENTION_FUNCTIONS,
        modeling.eager_attention_forward,
    )

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = F.linear(hidden_states, self._fused_qkv_weight, self._fused_qkv_bias).split(
            self._fused_qkv_sizes, dim=-1
        )
        q, k, v = (t.view(hidden_shape).transpose(1, 2) for t in (q, k, v))
        cos, sin = position_embeddings
        q, k = rotary(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention = interfaces.get_interface(self.config._attn_implementation, eager)
        if hasattr(self, "sliding_window"):  # Qwen2 passes its window (None when unused)
            kwargs["sliding_window"] = self.sliding_window
        out, weights = attention(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights

    return forward


def _mlp_forward(self, x):
    gate, up = F.linear(x, self._fused_gate_up_weight, self._fused_gate_up_bias).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def is_fused(model) -> bool:
    return bool(getattr(model, "_fused_projections", False))


def check_fused(model) -> None:
    """Raise if a fused model's parameters no longer view its merged tensors.

    ``model.to(...)`` (a dtype or device change) gives every parameter new storage and leaves the
    merged tensors as they were: the forward would then run on stale weights while the parameters
    take the updates. Fuse after the model's last ``.to``; this check (one pointer comparison per
    layer) makes the mistake an error instead of a silently stale policy."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (
            attn.q_proj.weight.data_ptr() != attn._fused_qkv_weight.data_ptr()
            or mlp.gate_proj.weight.data_ptr() != mlp._fused_gate_up_weight.data_ptr()
        ):
            raise RuntimeError(
                "fused projections: the model's parameters no longer view its merged q/k/v and "
                "gate/up weights (was the model moved or cast with .to() after fuse_projections?)"
            )


def fuse_projections(model) -> int:
    """Merge every decoder layer's q/k/v and gate/up projections of ``model`` in place; the layers fused.

    Idempotent (a fused model is left as it is). Raises ValueError, before changing anything, for a
    model whose layers are not of the supported classes."""
    if is_fused(model):
        return len(model.model.layers)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) == 0:
        raise ValueError(f"fuse_projections: {type(model).__name__} has no model.layers")
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(attn).__name__ not in ATTENTION_CLASSES or type(mlp).__name__ not in MLP_CLASSES:
            raise ValueError(
                f"fuse_projections: {type(attn).__name__} / {type(mlp).__name__} layers are not "
                f"supported (supported: {', '.join(ATTENTION_CLASSES)} with {', '.join(MLP_CLASSES)})"
            )
    with torch.no_grad():
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            modeling = sys.modules[type(attn).__module__]
            attn._fused_qkv_weight, attn._fused_qkv_bias, attn._fused_qkv_sizes = _merge(
                [attn.q_proj, attn.k_proj, attn.v_proj]
            )
            attn.forward = types.MethodType(_attention_forward(modeling), attn)
            mlp._fused_gate_up_weight, mlp._fused_gate_up_bias, _ = _merge([mlp.gate_proj, mlp.up_proj])
            mlp.forward = types.MethodType(_mlp_forward, mlp)
    model._fused_projections = True
    return len(layers)
