"""The verl job's memory settings, sized from its declared memory: what :func:`job_memory` hands to
:func:`fedagent.train.verl.overrides.build_overrides` as verl's keys.

The job declared ``gpu_mem_mb`` (the rule's ``FEDAGENT_JOB_GPU_MEM_MB``) from the plan-time memory plan
(:func:`fedagent.model.verl_memory.config_plan`); here the job runs the same :func:`~fedagent.model.verl_memory.plan`
with that declaration as its budget and so gets the same choices: the FSDP offload of the actor's (and a PPO
critic's) weights and AdamW state, gradient checkpointing, the micro-batch of every update and log-prob pass,
vLLM's fixed KV cache and its ``max_model_len``, and vLLM's ``gpu_memory_utilization`` as a share of the card
the job was placed on (:func:`fedagent.core.placement.node_cards` through the job's ``CUDA_VISIBLE_DEVICES``).
Keys the config pins (``train.verl.param_offload``, ``kv_cache_gb``, …) stay as pinned. The choices are
memory only: offload and checkpointing change where and when tensors live, the micro-batch how a mini-batch's
gradient is accumulated (token-mean over the mini-batch), the KV cache how many rollouts vLLM runs at once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from fedagent.core import placement
from fedagent.model.memory import kv_cache_bytes, model_shape
from fedagent.model.verl_memory import VerlJobKnobs, plan


@dataclass(frozen=True)
class SizedMemory:
    """The memory settings one verl job runs with (None: verl's own default, no override)."""

    micro_batch_size: int
    gradient_checkpointing: bool
    param_offload: bool | None = None
    optimizer_offload: bool | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    plan: dict | None = None  # the memory plan's summary (metrics.json's verl.memory), None when not sized

    @classmethod
    def unsized(cls, p, s) -> "SizedMemory":
        """The settings as the params and ``train.verl`` give them, nothing sized (verl's defaults for the rest)."""
        return cls(
            micro_batch_size=int(p.micro_batch_size),
            gradient_checkpointing=bool(s.gradient_checkpointing),
            param_offload=s.param_offload,
            optimizer_offload=s.optimizer_offload,
            kv_cache_bytes=kv_cache_bytes(s.kv_cache_gb) if s.kv_cache_gb is not None else None,
            gpu_memory_utilization=s.gpu_memory_utilization,
        )

    def overrides(self) -> list[str]:
        """verl's keys of the actor's offload and of vLLM's memory (the micro-batches and checkpointing
        are in the base list, :func:`fedagent.train.verl.overrides.build_overrides`)."""
        fsdp = "actor_rollout_ref.actor.fsdp_config"
        rollout = "actor_rollout_ref.rollout"
        ov = []
        if self.param_offload is not None:
            ov.append(f"{fsdp}.param_offload={bool(self.param_offload)}")
        if self.optimizer_offload is not None:
            ov.append(f"{fsdp}.optimizer_offload={bool(self.optimizer_offload)}")
        if self.gpu_memory_utilization is not None:
            ov.append(f"{rollout}.gpu_memory_utilization={float(self.gpu_memory_utilization)}")
        if self.kv_cache_bytes is not None:
            ov.append(f"+{rollout}.engine_kwargs.vllm.kv_cache_memory_bytes={int(self.kv_cache_bytes)}")
        if self.max_model_len is not None:
            ov.append(f"{rollout}.max_model_len={int(self.max_model_len)}")
        return ov

    def critic_overrides(self) -> list[str]:
        """The PPO critic's offload: the actor's."""
        ov = []
        if self.param_offload is not None:
            ov.append(f"critic.fsdp.param_offload={bool(self.param_offload)}")
        if self.optimizer_offload is not None:
            ov.append(f"critic.fsdp.optimizer_offload={bool(self.optimizer_offload)}")
        return ov

    def record(self) -> dict:
        """What metrics.json records (``verl.memory``)."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "gradient_checkpointing": self.gradient_checkpointing,
            "param_offload": self.param_offload,
            "optimizer_offload": self.optimizer_offload,
            "kv_cache_bytes": self.kv_cache_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_model_len": self.max_model_len,
            "plan": self.plan,
        }


def card_total_mib(env=None) -> int | None:
    """The smallest total MiB among the cards this job sees (placed: its own), None when none is visible."""
    try:
        cards = placement.node_cards(env)
    except placement.PlacementError:
        return None
    return min((c.total_mib for c in cards), default=None)


def job_memory(p, s, model_dir: Path, env=None) -> SizedMemory:
    """The memory settings of this job: the plan (:func:`fedagent.model.verl_memory.plan`) of its params
    ``p``, ``train.verl`` settings ``s`` and start model's shape, within its declared memory (none declared:
    the cheapest plan), vLLM's share taken of its card (none visible: ``s``'s, else verl's default). A plan
    that does not fit the declaration (a config the plan-time check would have refused) fails naming
    ``train.gpu_mem_gb``."""
    env = os.environ if env is None else env
    shape = model_shape(json.loads((Path(model_dir) / "config.json").read_text()))
    knobs = VerlJobKnobs.from_job(p, s)
    _, declared = placement.job_ask(env)
    card = card_total_mib(env)
    chosen = plan(shape, knobs, declared or None, key="train.gpu_mem_gb", card_mib=card)
    sized_kv = s.kv_cache_gb is None and s.gpu_memory_utilization is None
    # vLLM's share of the card; no card visible (a job run by hand, a CPU test's fake trainer): verl's default
    util = chosen.gpu_memory_utilization(card, pinned=s.gpu_memory_utilization) if card else s.gpu_memory_utilization
    return SizedMemory(
        micro_batch_size=chosen.micro_batch_size,
        gradient_checkpointing=chosen.gradient_checkpointing,
        param_offload=chosen.param_offload,
        optimizer_offload=chosen.optimizer_offload,
        kv_cache_bytes=chosen.kv_cache_bytes,
        gpu_memory_utilization=util,
        max_model_len=knobs.tokens if sized_kv else None,
        plan={**chosen.summary(), "budget_mib": declared or None, "card_mib": card},
    )
