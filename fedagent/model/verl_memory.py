"""The verl backend's train job on its GPU(s): what it holds in each phase of a step, and the memory settings
(FSDP offload, gradient checkpointing, micro-batches, vLLM's KV cache and share) that make it fit a budget.

One verl job (``train.backend: verl``, :mod:`fedagent.train.verl.overrides`) runs, colocated on each of its
``train.verl.gpus`` cards, verl 0.9.1's FSDP1 actor (fp32 masters, ``fsdp_config.model_dtype=fp32``), its KL
reference (``forward_only``: verl wraps it in FSDP's ``CPUOffload(offload_params=True)``, so its weights live
in host memory and one wrapped unit at a time comes to the card: ``verl/workers/engine/fsdp/transformer_impl.py``),
a PPO critic (its own worker process) and one vLLM engine per card (bf16 weights, a KV cache). The phases of a
step, read from verl's sync trainer (``trainer/ppo/v1/trainer_sync.py``, ``workers/engine_workers.py``):

- ``rollout``: vLLM awake (weights, KV cache, its own runtime), the actor's fp32 weights and Adam state
  resident unless offloaded (``fsdp_config.param_offload`` / ``optimizer_offload``: ``BaseEngineCtx`` moves
  them to the host outside their train/eval contexts), the critic's likewise;
- ``weight_sync`` (``update_weights``): the actor's weights on the card (loaded even when offloaded), vLLM's
  weights resumed, the bf16 copy streamed in buckets (``checkpoint_engine.update_weights_bucket_megabytes``),
  before vLLM's KV cache is resumed;
- ``log_probs``: vLLM asleep (``free_cache_engine``: weights and KV released), the actor's weights, the
  forward of one micro-batch (no autograd) with its full-sequence logits, the reference's current unit;
- ``update_actor``: fp32 weights + gradients + AdamW's two moments (16 B/param) and one micro-batch's
  saved activations (:func:`fedagent.model.shapes._activations`, × its measured factor) with the logits
  and their gradient; PPO: ``update_critic`` likewise for the critic, the actor resident beside it.

After its last step verl wakes vLLM for the next weight version (``on_step_end``), so a run-scoped engine
set (``train.verl.engines: run``) that waits for its next job holds its ``idle`` memory: vLLM awake and
what stays resident.

:func:`plan` picks, among the choices the config leaves open (``train.verl.param_offload``,
``optimizer_offload``, ``gradient_checkpointing``: null = chosen here; ``train.micro_batch_size`` is the
largest micro-batch; ``kv_cache_gb`` / ``gpu_memory_utilization``: null = sized here), the cheapest whose
declared memory fits a budget (cost order: :data:`COSTS`), or refuses naming the key. The same function
runs at plan time (budget: the card, or ``train.gpu_mem_gb``; the job then declares the chosen plan's
memory as its ``gpu_mem_mb``) and in the job (budget: that declared memory, ``FEDAGENT_JOB_GPU_MEM_MB``):
both pick the same plan (:func:`plan` takes the cheapest that fits, and the plan-time choice fits its own
declaration). These terms are a model, not a measurement: no verl job at 1.7B has run; the first run's
per-step peaks (verl's ``actor/perf/max_memory_allocated_gb`` in each job's ``metrics.json``) calibrate it,
as :data:`fedagent.model.shapes.ACTIVATION_FACTOR` was for the local backend.

Plan-time code: stdlib only (the Snakefile imports it through :mod:`fedagent.model.memory`, whose
:func:`~fedagent.model.memory.job_gpu_mib` declares :func:`config_plan`'s memory for a verl train job).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Mapping

from fedagent.model.shapes import (
    ACTIVATION_FACTOR,
    FIXED_BYTES,
    GIB,
    MARGIN,
    MIB,
    ModelShape,
    _activations,
    kv_cache_bytes,
    kv_cache_size,
    param_count,
    shape_of_source,
)

# vLLM's own device memory beside its weights and KV cache: the profiling run's activations at verl's
# max_num_batched_tokens (8192), the sampler's buffers for max_num_seqs, CUDA graphs. Not measured at 1.7B.
VLLM_RUNTIME_BYTES = int(1.5 * GIB)
# A CUDA context per process on the card beyond the FSDP worker's (in FIXED_BYTES): the vLLM engine's, a
# PPO critic worker's.
CONTEXT_BYTES = int(0.5 * GIB)
# verl 0.9.1's rollout.checkpoint_engine.update_weights_bucket_megabytes (its default; not overridden).
SYNC_BUCKET_BYTES = 2048 * MIB
# The price of each choice, in the order a plan gives speed up for memory: the optimizer's state to the
# host between updates (one round trip per step), the weights too (several per step), gradient
# checkpointing (one more forward per update), each halving of the KV cache (vLLM queues the rollouts
# that do not fit: a slower rollout), each halving of the micro-batch (more, smaller passes).
COSTS = {"optimizer_offload": 1, "param_offload": 2, "gradient_checkpointing": 3, "kv_halving": 4, "micro_halving": 5}
UTILIZATION_STEP = 0.01  # vLLM's share, rounded up to this
# What more verl jobs at once on a card may cost per job beyond the cheapest plan of fewer: the two offloads
# (host-device copies) and gradient checkpointing (a third more compute in the update), the price of the
# local backend's two-job round at this shape (it checkpoints); more (halvings on top) and fewer jobs share it.
CONCURRENCY_ALLOWANCE = COSTS["optimizer_offload"] + COSTS["param_offload"] + COSTS["gradient_checkpointing"]


@dataclass(frozen=True)
class VerlJobKnobs:
    """What a verl train job's memory depends on, from the config (:meth:`from_config`) or the job's own
    params and settings (:meth:`from_job`): the same values both ways."""

    rows: int  # the rollouts of one step, all at once: groups_per_epoch × group_size
    group_size: int  # the smallest KV cache holds one group's rows
    prompt_tokens: int
    new_tokens: int
    micro_batch_size: int  # the largest micro-batch (train.micro_batch_size)
    critic: bool  # train.algorithm ppo
    gpus: int = 1
    # pinned by the config (None: the plan chooses)
    param_offload: bool | None = None
    optimizer_offload: bool | None = None
    gradient_checkpointing: bool | None = None
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float | None = None

    @classmethod
    def from_config(cls, config: Mapping) -> "VerlJobKnobs":
        tr = config["train"]
        return cls._of(tr, tr["verl"])

    @classmethod
    def from_job(cls, params, settings) -> "VerlJobKnobs":
        """From :class:`fedagent.train.local.TrainParams` and :class:`fedagent.train.verl.settings.VerlSettings`."""
        return cls._of(vars(params), asdict(settings))

    @classmethod
    def _of(cls, tr: Mapping, verl: Mapping) -> "VerlJobKnobs":
        return cls(
            rows=int(tr["groups_per_epoch"]) * int(tr["group_size"]),
            group_size=int(tr["group_size"]),
            prompt_tokens=int(tr["max_prompt_tokens"]),
            new_tokens=int(tr["max_new_tokens"]),
            micro_batch_size=int(tr["micro_batch_size"]),
            critic=tr.get("algorithm") == "ppo",
            gpus=int(verl.get("gpus") or 1),
            **{
                k: verl.get(k)
                for k in (
                    "param_offload",
                    "optimizer_offload",
                    "gradient_checkpointing",
                    "kv_cache_gb",
                    "gpu_memory_utilization",
                )
            },
        )

    @property
    def tokens(self) -> int:
        """A row's longest sequence: prompt + response (vLLM's max_model_len)."""
        return self.prompt_tokens + self.new_tokens


@dataclass(frozen=True)
class VerlMemoryPlan:
    """The memory settings of one verl job and what it holds with them (bytes per card, by phase and term)."""

    param_offload: bool
    optimizer_offload: bool
    gradient_checkpointing: bool
    micro_batch_size: int
    kv_cache_bytes: int | None  # None: vLLM sizes its cache inside its gpu_memory_utilization share
    kv_rows: int | None  # rows of `tokens` the KV cache holds at once (None: pinned or profiled)
    cost: int
    phases: dict = field(compare=False)
    declared_mib: int = 0  # all cards: the job's gpu_mem_mb
    idle_mib: int = 0  # all cards: what a run-scoped engine set holds between jobs

    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: sum(self.phases[k].values()))

    def gpu_memory_utilization(self, card_mib: int, pinned: float | None = None) -> float:
        """vLLM's ``gpu_memory_utilization`` on a card of ``card_mib`` MiB in all: its weights, KV cache and
        runtime as a share of the card, rounded up (``pinned``: the config's own)."""
        if pinned is not None:
            return float(pinned)
        need = sum(v for k, v in self.phases["rollout"].items() if k.startswith("vllm_"))
        share = math.ceil(need / (card_mib * MIB) / UTILIZATION_STEP) * UTILIZATION_STEP
        if share > 1:
            raise ValueError(
                f"config key 'train.verl.gpu_memory_utilization': vLLM's weights and KV cache "
                f"({need / GIB:.1f} GiB) exceed the {card_mib} MiB card"
            )
        return round(share, 2)

    def summary(self) -> dict:
        """What a job records of its plan (metrics.json) and ``fedagent gpu-mem`` prints."""
        return {
            "param_offload": self.param_offload,
            "optimizer_offload": self.optimizer_offload,
            "gradient_checkpointing": self.gradient_checkpointing,
            "micro_batch_size": self.micro_batch_size,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_rows": self.kv_rows,
            "declared_mib": self.declared_mib,
            "idle_mib": self.idle_mib,
            "peak_phase": self.peak_phase(),
            "phases_gib": {k: round(sum(v.values()) / GIB, 2) for k, v in self.phases.items()},
        }


def kv_bytes_per_token(s: ModelShape) -> int:
    return kv_cache_size(s, batch=1, tokens=1)


def critic_param_count(s: ModelShape) -> int:
    """The PPO critic: the policy's backbone (no LM head of its own when untied) and a [1, hidden] score + bias."""
    return param_count(s) - (0 if s.tied else s.vocab * s.hidden) + s.hidden + 1


def _forward_bytes(s: ModelShape, micro: int, tokens: int, response: int) -> int:
    """A log-prob forward of ``micro`` rows without autograd: one layer's transients (bf16: norms, q/k/v/o,
    the gated MLP; the fp32 residual), the full-sequence logits (bf16) and the response's fp32 log-softmax."""
    layer = 2 * (6 * s.hidden + 2 * s.kv_heads * s.head_dim + 4 * s.intermediate) + 8 * s.hidden
    return micro * (tokens * layer + tokens * s.vocab * 2 + response * s.vocab * 8)


def phases(s: ModelShape, k: VerlJobKnobs, *, param_offload: bool, optimizer_offload: bool,
           gradient_checkpointing: bool, micro: int, kv_bytes: int) -> dict[str, dict[str, int]]:  # fmt: skip
    """Bytes on each card in each phase of a step, by term (before margin and the fixed part)."""
    g = max(1, k.gpus)
    p, pc = param_count(s), critic_param_count(s) if k.critic else 0
    weights, adam = 4 * p // g, 8 * p // g
    resident = {"actor_weights": 0 if param_offload else weights, "actor_adam": 0 if optimizer_offload else adam}
    critic_resident = {
        "critic_weights": 0 if param_offload or not k.critic else 4 * pc // g,
        "critic_adam": 0 if optimizer_offload or not k.critic else 8 * pc // g,
    }
    vllm = {"vllm_weights": 2 * p, "vllm_kv_cache": kv_bytes, "vllm_runtime": VLLM_RUNTIME_BYTES}
    # the reference's largest unit in bf16, and the next one prefetched
    ref_unit = 2 * 2 * max(s.vocab * s.hidden, param_count(s) // max(1, s.layers))
    act = ACTIVATION_FACTOR * _activations(s, micro, k.tokens, k.new_tokens, checkpointing=gradient_checkpointing)
    out = {
        "rollout": {**vllm, **resident, **critic_resident},
        "weight_sync": {
            "vllm_weights": 2 * p,
            "actor_weights": weights,
            "sync_buckets": 2 * p // g + SYNC_BUCKET_BYTES,
            "actor_adam": resident["actor_adam"],
            **critic_resident,
        },
        "log_probs": {
            "actor_weights": weights,
            "actor_adam": resident["actor_adam"],
            "reference_unit": ref_unit,
            "forward": _forward_bytes(s, micro, k.tokens, k.new_tokens),
            **critic_resident,
        },
        "update_actor": {
            "actor_weights_grads_adam": 16 * p // g,
            "activations": int(act),
            "logits_and_grad": micro * k.tokens * s.vocab * 4,
            **critic_resident,
        },
    }
    if k.critic:
        critic_act = ACTIVATION_FACTOR * _activations(s, micro, k.tokens, 0, checkpointing=gradient_checkpointing)
        out["update_critic"] = {
            "critic_weights_grads_adam": 16 * pc // g,
            "activations": int(critic_act),
            **resident,
        }
    return out


def _declared_mib(terms: Mapping[str, int], k: VerlJobKnobs) -> int:
    """One card's phase as declared: margin × its terms + the fixed part + the other processes' contexts."""
    contexts = CONTEXT_BYTES * (1 + int(k.critic))
    return int(math.ceil((MARGIN * sum(terms.values()) + FIXED_BYTES + contexts) / MIB))


def _halvings(top: int, floor: int) -> list[int]:
    """``top``, ``top // 2``, … down to no less than ``floor`` (at least 1)."""
    out = [max(1, int(top))]
    while out[-1] // 2 >= max(1, floor):
        out.append(out[-1] // 2)
    return out


def candidates(s: ModelShape, k: VerlJobKnobs, card_mib: int | None = None) -> list[VerlMemoryPlan]:
    """Every plan the config leaves open, cheapest first (ties: fewer offloads, then larger KV and micro).

    ``card_mib``: one card's memory in all, for a vLLM share the config pins as ``gpu_memory_utilization``
    without a KV size (vLLM then sizes its cache inside that share of the card)."""
    choice = lambda pinned: [pinned] if pinned is not None else [False, True]  # noqa: E731
    per_token = kv_bytes_per_token(s)
    if k.kv_cache_gb is not None:
        kvs = [(kv_cache_bytes(k.kv_cache_gb), None, 0)]
    elif k.gpu_memory_utilization is not None:
        share = int(k.gpu_memory_utilization * card_mib * MIB) if card_mib else 0
        kvs = [(max(0, share - 2 * param_count(s) - VLLM_RUNTIME_BYTES), None, 0)]
    else:
        # each engine holds the rows of its card: verl spreads a step's rollouts over its replicas
        rows = math.ceil(k.rows / max(1, k.gpus))
        tops = _halvings(rows, min(rows, k.group_size))
        kvs = [(r * k.tokens * per_token, r, i) for i, r in enumerate(tops)]
    micros = _halvings(k.micro_batch_size, 1)
    out = []
    for po, oo, gc, (kv, kv_rows, kv_i), (mi, micro) in itertools.product(
        choice(k.param_offload),
        choice(k.optimizer_offload),
        choice(k.gradient_checkpointing),
        kvs,
        enumerate(micros),
    ):
        ph = phases(s, k, param_offload=po, optimizer_offload=oo, gradient_checkpointing=gc, micro=micro, kv_bytes=kv)
        cost = (
            COSTS["optimizer_offload"] * oo
            + COSTS["param_offload"] * po
            + COSTS["gradient_checkpointing"] * gc
            + COSTS["kv_halving"] * kv_i
            + COSTS["micro_halving"] * mi
        )
        g = max(1, k.gpus)
        declared = g * max(_declared_mib(t, k) for t in ph.values())
        idle = g * _declared_mib(ph["rollout"], k)
        fixed_kv = k.kv_cache_gb is not None or k.gpu_memory_utilization is None  # else vLLM profiles
        out.append(VerlMemoryPlan(po, oo, gc, micro, kv if fixed_kv else None, kv_rows, cost, ph, declared, idle))
    return sorted(
        out, key=lambda c: (c.cost, c.param_offload + c.optimizer_offload, -(c.kv_rows or 0), -c.micro_batch_size)
    )


OPEN_KEYS = (
    "train.verl.param_offload",
    "train.verl.optimizer_offload",
    "train.verl.gradient_checkpointing",
    "train.micro_batch_size",
    "train.verl.kv_cache_gb",
)


def plan(
    s: ModelShape,
    k: VerlJobKnobs,
    budget_mib: int | None,
    *,
    key: str,
    card_mib: int | None = None,
    options: list[VerlMemoryPlan] | None = None,
) -> VerlMemoryPlan:
    """The cheapest plan whose declared memory is within ``budget_mib`` (MiB, all of the job's cards; None: no
    budget known, the cheapest of all). Refused with one message naming ``key`` (the budget's source: the
    card, ``train.gpu_mem_gb``) and the smallest plan when none fits. ``options``: :func:`candidates`' list."""
    options = candidates(s, k, card_mib) if options is None else options
    if budget_mib is None:
        return options[0]
    for c in options:
        if c.declared_mib <= budget_mib:
            return c
    least = min(options, key=lambda c: c.declared_mib)
    open_keys = [key_ for key_ in OPEN_KEYS if _is_open(k, key_)]
    raise ValueError(
        f"config key '{key}': the verl train job needs at least {least.declared_mib} MiB "
        f"({least.peak_phase()}: {_describe(least)}), more than the {budget_mib} MiB it may use"
        + (f"; {', '.join(open_keys)} were already chosen to fit" if open_keys else "")
        + "; use more train.verl.gpus, a smaller train.max_prompt_tokens / max_new_tokens, or a larger card"
    )


def _is_open(k: VerlJobKnobs, key: str) -> bool:
    name = key.rsplit(".", 1)[1]
    if name == "micro_batch_size":
        return k.micro_batch_size > 1
    if name == "kv_cache_gb":
        return k.kv_cache_gb is None and k.gpu_memory_utilization is None
    return getattr(k, name) is None


def _describe(c: VerlMemoryPlan) -> str:
    bits = [
        "weights offloaded" if c.param_offload else "",
        "optimizer offloaded" if c.optimizer_offload else "",
        "gradient checkpointing" if c.gradient_checkpointing else "",
        f"micro-batch {c.micro_batch_size}",
        f"KV cache {c.kv_cache_bytes / GIB:.1f} GiB" if c.kv_cache_bytes else "",
    ]
    return ", ".join(b for b in bits if b)


def _fits(n: int, declared: float, idle: float, eval_mib: int, card: int) -> bool:
    """Whether n train jobs of one card (each ``declared``, ``idle`` once its engine set waits between jobs)
    fit it: all n at once, and — with the eval (``eval_mib``, 0 without engine sets) admitted beside the j
    that run whenever their declarations leave it room — the j running, the n - j idle sets and the eval."""
    if n * declared > card:
        return False
    return all(
        j * declared + (n - j) * idle + eval_mib <= card for j in range(n + 1) if j * declared + eval_mib <= card
    )


BUDGET_KEY = "train.verl.gpus"  # what to raise when a card cannot hold the job (gpu_rules names it too)
IDLE_KEY = "train.verl.engines"  # … when it could, but not beside the eval while engine sets idle


def config_plan(config: Mapping, card_mib: int | None, eval_mib: int = 0) -> VerlMemoryPlan:
    """The plan of a validated config's verl train job at plan time; its ``declared_mib`` is the job's ``gpu_mem_mb``.

    Budget: ``train.gpu_mem_gb`` when set; else one card (``card_mib``: its usable MiB) shared by the run's
    verl jobs that train at once — ``clients.per_round``, at most ``train.verl.engine_sets`` with
    ``engines: run`` — each with ``train.verl.gpus`` cards: the cheapest plan of which n fit the card, and
    with ``engines: run`` also with the eval (``eval_mib``) beside them whenever the scheduler admits it, the
    sets that wait between jobs keeping their rollout phase's memory (:func:`_fits`); fewer jobs at once when
    more would cost more than :data:`CONCURRENCY_ALLOWANCE` a job. When that many jobs cannot fit, fewer share the card, each declaring more than a
    (n + 1)-th of it so that the scheduler never admits another. In every case the job's own plan within
    its declaration (:func:`plan`, as :mod:`fedagent.train.verl.sizing` runs it) is this one. No card known
    (a cluster's submitting host): the cheapest plan, which the job's node then sizes the same way."""
    tr = config["train"]
    s, k = shape_of_source(config["model"]), VerlJobKnobs.from_config(config)
    if tr.get("gpu_mem_gb") is not None:
        budget = int(math.ceil(float(tr["gpu_mem_gb"]) * GIB / MIB))
        return plan(s, k, budget, key="train.gpu_mem_gb", card_mib=card_mib)
    if not card_mib:
        return plan(s, k, None, key=BUDGET_KEY)
    run_scoped = tr["verl"].get("engines") == "run"
    per_round = int(config["clients"]["per_round"])
    at_once = min(per_round, int(tr["verl"].get("engine_sets") or 1)) if run_scoped else per_round
    g, card, idle_beside = max(1, k.gpus), int(card_mib), int(eval_mib) if run_scoped else 0
    options = candidates(s, k, card_mib)
    best: dict[int, VerlMemoryPlan] = {}
    for n in range(max(1, at_once), 0, -1):
        # fewer than a round's clients at once: declare more than a (n + 1)-th of the card, so that the
        # scheduler never admits another one beside them
        floor = (card // (n + 1) + 1) * g if n < per_round else 0
        for c in options:
            declared = max(c.declared_mib, floor)
            if not _fits(n, declared / g, c.idle_mib / g, idle_beside, card):
                continue
            # the job plans within its declaration: it must come to this plan (no cheaper one fits there)
            if plan(s, k, declared, key=BUDGET_KEY, card_mib=card_mib, options=options) is c:
                best[n] = replace(c, declared_mib=declared)
                break
    if best:
        # more jobs at once, unless each would cost more than CONCURRENCY_ALLOWANCE above the cheapest
        cheapest = min(c.cost for c in best.values())
        return best[max(n for n, c in best.items() if c.cost <= cheapest + CONCURRENCY_ALLOWANCE)]
    least = min(candidates(s, k, card_mib), key=lambda c: c.declared_mib)
    if run_scoped and eval_mib and least.declared_mib <= int(card_mib) * g:
        raise ValueError(
            f"config key '{IDLE_KEY}': run: an idle engine set keeps its memory beside the eval's {eval_mib} MiB, "
            f"and the verl train job needs at least {least.declared_mib} MiB ({least.peak_phase()}: "
            f"{_describe(least)}) of the {card_mib} MiB card: lower eval.batch, or set train.verl.engines: job"
        )
    raise ValueError(
        f"config key '{BUDGET_KEY}': the verl train job needs at least {least.declared_mib} MiB "
        f"({least.peak_phase()}: {_describe(least)}), more than one card of {card_mib} MiB holds; use more "
        "train.verl.gpus, a smaller train.max_prompt_tokens / max_new_tokens, or a larger card"
    )
