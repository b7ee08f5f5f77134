"""The params of one client's train job (``fedagent train-client --params``), shared by both backends.

:class:`TrainParams` is the job's knobs, checked against the config schema and cross rules
(:data:`TRAIN_KEYS`: which config key each field comes from, what planning checked) and recorded in
the update's metrics.json / provenance.json (:meth:`TrainParams.recorded`: keys added after older runs
only when set, so their files stay as they were); :func:`epoch_task_seeds` is a local epoch's group
seeds (the verl backend draws the same); :func:`same_weights` whether two model dirs hold the same weights.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedagent.core.config import JobKeys, check_value, dataclass_from_dict
from fedagent.core.seeds import derive_seed
from fedagent.model.lora import PROJECTIONS as LORA_PROJECTIONS
from fedagent.train import advantages


@dataclass(frozen=True)
class TrainParams:
    """Knobs of one client job (the ``--params`` JSON of ``fedagent train-client``)."""

    base_seed: int = 0
    epochs: int = 1
    groups_per_epoch: int = 1
    group_size: int = 4
    max_turns: int = 3
    max_new_tokens: int = 40
    temperature: float = 1.0
    lr: float = 1e-6
    kl_coef: float = 0.01
    clip: float = 0.2
    clip_ratio_c: float | None = 3.0  # dual-clip cap of the loss of A < 0 tokens (None: off), as verl
    entropy_coef: float = 0.0
    mini_batch_size: int = 8
    micro_batch_size: int = 4
    micro_batch_tokens: int | None = None  # padded tokens per micro-batch (None: rows only)
    max_prompt_tokens: int = 1024
    invalid_penalty: float = 0.1
    pool_size: int = 8
    env_procs: int = 0  # env.procs: the env service's worker processes (0: its threads)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    answer_format: str = "think_action"  # rollout.answer_format: think_action | action
    projection: str = "reference"  # rollout.projection: reference | noop (the env service's)
    rollout_mode: str = "windowed"  # rollout.mode: windowed | concat
    history: int = 2  # rollout.history: windowed prompt's past steps
    fedprox_mu: float = 0.0  # train.fedprox_mu: μ of FedProx's μ·(w − w_round_start)
    device: str = "cpu"  # cpu | cuda (fp32 master weights either way)
    sampler: str = "compile"  # cuda: the static-cache sampler's mode (compile | graph | eager)
    sampler_widths: list[int] = field(default_factory=list)  # cuda: the sampler's narrower widths (buckets)
    sampler_fused: bool = False  # cuda: the rollout copy's q/k/v and gate/up projections merged (one GEMM each)
    sampler_compile_prefill: bool = False  # cuda: the sampler's prefill through torch.compile too
    compile_train: bool = False  # cuda: torch.compile the policy's forward/backward for training
    residual_dtype: str = "float32"  # cuda: the training forward's residual stream (float32 | bfloat16)
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in the backward pass
    deterministic: bool = False  # deterministic: bit-reproducible kernels (fedagent.model.determinism)
    # --- the advantage estimator (train.algorithm: fedagent.train.advantages) ---
    algorithm: str = "grpo"  # a registered estimator: grpo | gigpo | ppo | ...
    # the estimator's own keys (train.<algorithm>.*; GiGPO: gamma, step_weight, mode); {} for one without
    advantage_params: dict[str, Any] = field(default_factory=dict)
    # --- PPO (train.algorithm: ppo; keys under train.ppo, fedagent.train.ppo) ---
    gamma: float = 1.0  # GAE discount (verl's default, the reference's)
    lam: float = 1.0  # GAE λ
    critic_lr: float = 1e-5  # the critic's AdamW lr
    value_clip: float = 0.5  # clipped value loss: V within V_old ± value_clip
    # --- LoRA (train.lora; fedagent.model.lora): adapters on the frozen start model, the update their factors ---
    lora: bool = False
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_PROJECTIONS))
    lora_lr: float = 1e-4

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainParams":
        """Build from a dict; unknown keys and bad values are errors that name them.

        Values that come from the config are checked against the config schema and the cross
        rules (:data:`TRAIN_KEYS`: what planning checked); the rest are not config keys.
        """
        p = dataclass_from_dict(cls, d, "train")
        TRAIN_KEYS.check(dataclasses.asdict(p))
        for k, v in p.advantage_params.items():  # train.<algorithm>.<k>: its schema entry (unknown: no key)
            check_value(f"train.{p.algorithm}.{k}", v)
        advantages.estimator(p.algorithm, p.advantage_params)  # every key known to the estimator
        if p.micro_batch_size < 1 or p.weight_decay < 0 or not p.grad_clip > 0:
            raise ValueError(
                f"bad train params (not config keys): micro_batch_size={p.micro_batch_size}, "
                f"weight_decay={p.weight_decay}, grad_clip={p.grad_clip}"
            )
        return p

    def recorded(self) -> dict[str, Any]:
        """The params as metrics.json / provenance.json record them (GRPO: without PPO's keys,
        so a GRPO update's files are what they were before PPO existed)."""
        d = dataclasses.asdict(self)
        if self.algorithm != "ppo":
            for k in PPO_FIELDS[1:]:
                d.pop(k)
        if self.algorithm == "grpo":
            d.pop("algorithm")
        if not d["advantage_params"]:
            d.pop("advantage_params")
        if not self.lora:  # LoRA's keys only when on (files of full fine-tunes as they were)
            for k in LORA_FIELDS:
                d.pop(k)
        for k in RECORDED_WHEN_SET:  # only when on / set (files of other runs as they were)
            if not d[k]:
                d.pop(k)
        return d


PPO_FIELDS = ("algorithm", "gamma", "lam", "critic_lr", "value_clip")
LORA_FIELDS = ("lora", "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_lr")
# Recorded only when true / non-empty: keys added after runs whose files must stay as they were.
RECORDED_WHEN_SET = (
    "activation_checkpointing",
    "micro_batch_tokens",
    "sampler_widths",
    "sampler_fused",
    "sampler_compile_prefill",
    "deterministic",
)

# Which config key each TrainParams field comes from (workflow/common.smk's TRAIN_PARAMS).
TRAIN_KEYS = JobKeys.for_dataclass(
    "train-client",
    TrainParams,
    "train",
    {
        "base_seed": "seed",
        "pool_size": "env.pool_size",
        "env_procs": "env.procs",
        "answer_format": "rollout.answer_format",
        "rollout_mode": "rollout.mode",
        "history": "rollout.history",
        "projection": "rollout.projection",
        "deterministic": "deterministic",
        **{k: f"train.ppo.{k}" for k in PPO_FIELDS[1:]},
        "lora": "train.lora.enabled",
        **{k: f"train.lora.{k.removeprefix('lora_')}" for k in LORA_FIELDS[1:]},
    },
)


def epoch_task_seeds(p: TrainParams, round: int, client: int, epoch: int) -> list[int]:
    """The group seeds of one local epoch (fresh draws every epoch)."""
    return [
        derive_seed(p.base_seed, "task_draw", round=round, client=client, epoch=epoch, index=g)
        for g in range(p.groups_per_epoch)
    ]


def same_weights(a: Path, b: Path) -> bool:
    """Whether two model dirs hold byte-identical ``model.safetensors`` (manifest sha256 or hash)."""
    from fedagent.core.atomic import MANIFEST, sha256_file

    def digest(d: Path) -> str:
        m = Path(d) / MANIFEST
        if m.is_file():
            entry = json.loads(m.read_text())["files"].get("model.safetensors")
            if entry:
                return entry["sha256"]
        return sha256_file(Path(d) / "model.safetensors")

    if Path(a).resolve() == Path(b).resolve():
        return True
    return digest(a) == digest(b)
