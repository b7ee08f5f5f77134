"""The verl backend's own knobs (``train.verl``): what the job runs on and how, beside the training
params (:class:`fedagent.train.local.TrainParams`, the same knobs as the local backend)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerlSettings:
    """Knobs of the verl backend that are not GRPO hyper-parameters (``train.verl``)."""

    gpus: int = 1
    # vLLM's share of the card (None: sized by the job's memory plan, fedagent.model.verl_memory)
    gpu_memory_utilization: float | None = None
    attn_implementation: str = "sdpa"  # no flash-attn in the GPU wheel set
    enforce_eager: bool = False
    # A fixed KV cache (GiB) instead of one sized by profiling: vLLM's profiling assumes no other
    # process changes its GPU memory meanwhile, so jobs starting together on one GPU can each
    # count the other's allocations as their own and find no memory left for the cache.
    kv_cache_gb: float | None = None
    # FSDP offload of the actor's (and a PPO critic's) weights / AdamW state, gradient checkpointing: pinned
    # by the config, or None: chosen by the job's memory plan to fit its declared memory.
    param_offload: bool | None = None
    optimizer_offload: bool | None = None
    gradient_checkpointing: bool | None = None
    # The batch sizes vLLM captures CUDA graphs for (None: vLLM's own list): a start-up lever.
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    # vLLM's executor inside each rollout server: "uni" (the worker runs inside the engine process:
    # one process start fewer, 10-20 s of a job's start, docs/results/verl.md) or "mp" (verl's own
    # choice: the engine process starts a worker process).
    vllm_executor: str = "uni"
    # Ray actors verl starts per job that a fedagent job never uses or barely uses (start-up levers;
    # verl's defaults are 8 each): reward-loop workers (our agent loop scores every turn, so
    # verl never calls them) and the v1 trainer's TransferQueue storage units (one in-memory sample
    # store, sharded). Each is a Ray worker process importing verl while the job starts.
    reward_workers: int = 1
    storage_units: int = 1
    # The probe of run-scoped engines (fedagent.train.verl.refit): the job fits, resets its live
    # engines to a fresh job's start and fits again; the second fit is the job's update.
    warm_refit: bool = False
    # Run-scoped engines (fedagent.train.verl.engines): "job" (each job starts its own verl process tree)
    # or "run" (a slot's engine set, started by its first job, serves the later ones after a reset).
    engines: str = "job"
    engine_sets: int = 2  # slots per run: concurrent verl jobs on warm engines
    engines_idle_s: float = 900.0  # a set with no job for this long stops
    # a set whose training workers hold this many GB more device memory after a job than after its first
    # stops after that job (the next starts a fresh set): each warm job has been seen to leave ≈ 0.5 GB per
    # trained 135M engine allocated (docs/results/verl.md)
    engines_max_growth_gb: float = 4.0
    extra_overrides: tuple[str, ...] = ()  # appended last, e.g. from the lead's GPU script
