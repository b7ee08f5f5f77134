"""verl's FSDP checkpoint → the fp32 HF client-update dir, without a bf16 round trip.

verl 0.9.1 saves one ``model_world_size_<W>_rank_<r>.pt`` per rank (the sharded state dict
of the fp32 master weights: DTensors sharded on one mesh dim, plain tensors replicated)
plus ``fsdp_config.json`` and ``huggingface/`` (config + tokenizer). Its own merger
(``verl.model_merger``) casts every shard to bf16 before merging (FACTS §6: ≈0.4 % relative
ULP lost per round); this one concatenates the shards as they are and refuses anything
that is not float32, so the update holds exactly the trained masters. The tensors are
loaded into the start model's architecture (``load_state_dict(strict=True)``: every key,
every shape) and written by :func:`fedagent.model.policy.save_policy`, the local backend's
writer, so both backends produce the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FSDP_CONFIG = "fsdp_config.json"


class CheckpointError(RuntimeError):
    """A verl checkpoint that cannot be converted exactly (message names file and key)."""


def checkpoint_world_size(actor_dir: Path) -> int:
    """The save-time world size from ``fsdp_config.json``; every rank file must be present."""
    cfg_path = Path(actor_dir) / FSDP_CONFIG
    try:
        ws = int(json.loads(cfg_path.read_text())["world_size"])
    except (OSError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{cfg_path}: unreadable or without world_size ({exc})") from exc
    missing = [r for r in range(ws) if not (Path(actor_dir) / f"model_world_size_{ws}_rank_{r}.pt").is_file()]
    if missing:
        raise CheckpointError(f"{actor_dir}: world size {ws} but rank files {missing} are missing")
    return ws


def _local(key: str, value):
    """(local tensor, shard dim or None) of one state-dict entry."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        shard_dims = [p.dim for p in value.placements if p.is_shard()]
        if any(p.is_partial() for p in value.placements) or len(shard_dims) > 1:
            raise CheckpointError(f"{key}: unsupported placements {value.placements}")
        return value.to_local(), (shard_dims[0] if shard_dims else None)
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise CheckpointError(f"{key}: unsupported tensor type {type(value).__name__} (a ShardedTensor?)")
        return value, None
    raise CheckpointError(f"{key}: not a tensor ({type(value).__name__})")


def merge_fsdp_shards(
    actor_dir: Path, dtype_key: str = "actor_rollout_ref.actor.fsdp_config.model_dtype"
) -> dict[str, torch.Tensor]:
    """The full fp32 state dict from every rank's shard file (exact: concatenation only).

    ``dtype_key``: the override that makes the saved masters fp32 (named when they are not)."""
    actor_dir = Path(actor_dir)
    ws = checkpoint_world_size(actor_dir)
    import torch.distributed.tensor  # noqa: F401 - registers DTensor for weights_only loading

    # weights_only: tensors, DTensors and their placements load; any other pickled object is refused.
    shards = [
        torch.load(actor_dir / f"model_world_size_{ws}_rank_{r}.pt", map_location="cpu", weights_only=True)
        for r in range(ws)
    ]
    keys = list(shards[0])
    for r, sd in enumerate(shards[1:], start=1):
        if set(sd) != set(keys):
            raise CheckpointError(
                f"{actor_dir}: rank {r} has different keys than rank 0: {sorted(set(sd) ^ set(keys))[:5]}"
            )
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = [_local(key, sd[key]) for sd in shards]
        dims = {d for _, d in parts}
        if len(dims) != 1:
            raise CheckpointError(f"{key}: ranks disagree on the shard dim ({dims})")
        dim = dims.pop()
        tensors = [t.detach().to("cpu") for t, _ in parts]
        for t in tensors:
            if t.dtype != torch.float32:
                raise CheckpointError(
                    f"{actor_dir}: {key} is {t.dtype}, not float32; the saved masters must be fp32 ({dtype_key}=fp32)"
                )
        if dim is None:
            for r, t in enumerate(tensors[1:], start=1):
                if t.shape != tensors[0].shape or not torch.equal(t, tensors[0]):
                    raise CheckpointError(f"{key}: replicated entry differs between rank 0 and rank {r}")
            full = tensors[0]
        else:
            full = torch.cat(tensors, dim=dim)
        out[key] = full.contiguous().clone()
    return out


def write_update(actor_dir: Path, start_model_dir: Path, staging: Path) -> dict:
    """Write the converted weights as an HF dir into ``staging`` (the caller's atomic dir).

    The architecture, generation config and tokenizer come from ``start_model_dir`` (the
    round's global model the job started from). Returns ``{"world_size", "tensors"}``.
    """
    from transformers import AutoModelForCausalLM

    from fedagent.model.policy import load_tokenizer, save_policy

    state = merge_fsdp_shards(actor_dir)
    model = AutoModelForCausalLM.from_pretrained(str(start_model_dir), dtype=torch.float32, use_safetensors=True)
    _load_exactly(model, state, actor_dir)
    save_policy(model, load_tokenizer(start_model_dir), staging)
    return {"world_size": checkpoint_world_size(actor_dir), "tensors": len(state)}


def write_critic_update(critic_ckpt: Path, start_critic_dir: Path, out_dir: Path) -> None:
    """verl's critic checkpoint → the update's ``critic/`` (fp32 HF dir, as the local backend writes it):
    the tensors loaded exactly into the start critic's token classifier, written by
    :func:`fedagent.model.critic.save_critic`."""
    from fedagent.model.critic import load_critic, save_critic

    critic = load_critic(Path(start_critic_dir))
    _load_exactly(critic, merge_fsdp_shards(critic_ckpt, dtype_key="critic.fsdp.model_dtype"), critic_ckpt)
    save_critic(critic, out_dir)


def _load_exactly(model, state: dict[str, torch.Tensor], ckpt: Path) -> None:
    """Load ``state`` into ``model``: every key but tied aliases, no extra key, every shape (else CheckpointError)."""
    expected = model.state_dict()
    missing = {k for k in expected if k not in state} - _tied_keys(model)
    if missing:
        raise CheckpointError(f"{ckpt}: missing tensors {sorted(missing)[:5]}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise CheckpointError(f"{ckpt}: tensors the start model does not have: {extra[:5]}")
    for k, t in state.items():
        if tuple(t.shape) != tuple(expected[k].shape):
            raise CheckpointError(
                f"{k}: shape {tuple(t.shape)} in the checkpoint, {tuple(expected[k].shape)} in the model"
            )
    model.load_state_dict(state, strict=False)


def _tied_keys(model) -> set[str]:
    """State-dict keys that alias another parameter (e.g. a tied ``lm_head.weight``)."""
    seen: dict[int, str] = {}
    tied = set()
    for k, v in model.state_dict(keep_vars=True).items():
        ptr = v.data_ptr()
        if ptr in seen:
            tied.add(k)
        else:
            seen[ptr] = k
    return tied
