"""The local backend: one client's GRPO round on CPU (or one GPU), written as an HF dir.

Per local epoch e: fresh task seeds ``derive_seed(base, "task_draw", round, client, epoch,
index=g)`` for g < groups_per_epoch, each played ``group_size`` times (a GRPO group = one
seed = one task), sampled with ``torch_generator(base, "rollout_sampling", round, client,
epoch)``; behaviour and reference log-probs are computed before the epoch's first update;
then one pass over the per-turn samples in mini-batches shuffled by their own derived seed.
Same inputs and thread count → byte-identical ``model.safetensors``.

The advantages come from the estimator ``algorithm`` names (fedagent.train.advantages: ``grpo``,
``gigpo``, ...), once per epoch over the epoch's samples. ``algorithm: ppo`` (fedagent.train.ppo):
the critic in ``<start model>/critic`` gives per-token GAE advantages instead and takes one step
beside each actor step; the update dir then carries the trained critic in ``critic/``.

``train.lora`` (fedagent.model.lora): the start model is frozen (its linear weights bf16 on a GPU),
fresh adapters drawn from the round's seed are trained with their own lr, the KL reference is the
base with the adapters off when it is the start model, the GPU rollout copy samples from the merged
weights, and the update is the adapters' factors only.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any

import torch

from fedagent.core import placement
from fedagent.core.seeds import python_rng, torch_generator
from fedagent.model import determinism
from fedagent.model.lora import AdaptersOff
from fedagent.train import advantages, fedprox, grpo
from fedagent.train.lora_client import LoraClient
from fedagent.train.actor import bf16_reference, checkpoint_activations, compile_for_training, grpo_epoch
from fedagent.train.epilogue import ModelUpdate, require_start_critic, seconds, write_client_update
from fedagent.train.update_transform import UpdateTransform

# The job's params live in fedagent.train.params; these names stay importable from here.
from fedagent.train.params import (  # noqa: F401
    LORA_FIELDS,
    PPO_FIELDS,
    RECORDED_WHEN_SET,
    TRAIN_KEYS,
    TrainParams,
    epoch_task_seeds,
    same_weights,
)


def train_client(model_dir: Path, ref_model_dir: Path | None, env, *, client: int, params: TrainParams, **job) -> dict:
    """:func:`_train_client` with the job's progress line (:mod:`fedagent.core.progress`): episodes
    played of ``epochs × groups_per_epoch × group_size``, from the job's start to its saved update.

    ``job`` is the rest of :func:`_train_client`'s keywords (``round``, ``threads``, ``out_dir``,
    ``quarantine``, ``verify``, ``transform``), forwarded as they come: one signature, the job's, so a
    keyword added there cannot be left out here (an unknown one is its TypeError). ``client`` and
    ``params`` (the progress line's) are required keywords of the job too: dropping one is an error.
    """
    from fedagent.core.progress import Progress

    total = params.epochs * params.groups_per_epoch * params.group_size
    with Progress(f"train_client/{client}", "episodes", total) as progress:
        return _train_client(
            model_dir, ref_model_dir, env, client=client, params=params, on_done=progress.advance, **job
        )


def _train_client(
    model_dir: Path,
    ref_model_dir: Path | None,
    env,
    *,
    round: int,
    client: int,
    params: TrainParams,
    threads: int,
    out_dir: Path,
    quarantine: Path | None = None,
    verify: bool = True,
    on_done=None,
    transform: UpdateTransform | None = None,
) -> dict:
    """Run one client's local GRPO round against ``env``; write the update dir atomically.

    Output (via the job epilogue, :func:`fedagent.train.epilogue.write_client_update`): fp32 HF dir
    (+ PPO's ``critic/``) + ``metrics.json`` + ``samples.jsonl`` + ``provenance.json``. Returns the
    metrics dict. ``ref_model_dir`` None (or kl_coef 0)
    disables the KL term. On ``device: cuda`` the fp32 master weights train under bf16
    autocast and rollouts come from a bf16 copy (synced before every epoch) through the
    compiled static-cache sampler; the update written is the fp32 master (a LoRA client's: its
    adapters), or a Byzantine client's ``transform`` of it (fedagent.train.update_transform).
    """
    from fedagent.model.policy import load_policy, save_policy
    from fedagent.rollout.episode import run_episodes_batched
    from fedagent.core.timing import PhaseClock

    clock = PhaseClock()
    # Process start → here: the interpreter and the torch/transformers imports. ``env`` may be a
    # :class:`fedagent.envs.lifecycle.PendingEnv`: its service comes up while the model loads.
    clock.mark("job_ready")
    t0 = time.time()
    p = params
    # deterministic: the kernels pinned before any model is loaded (the flags set go to metrics.json)
    det_flags = determinism.enable(p.device) if p.deterministic else None
    ref_state = None
    if ref_model_dir is not None and p.kl_coef and not same_weights(model_dir, ref_model_dir):
        # Another model (rounds ≥ 2: the base model): its tensors are read (and its manifest
        # checked) in a thread while the policy loads; it becomes a copy of the policy module
        # filled with them.
        ref_state = _read_tensors_async(Path(ref_model_dir), verify)
    if hasattr(env, "ready"):
        # The first rollout batch is known now: its sessions are created and reset (game files
        # loaded) by the service while this thread loads the model and warms the sampler.
        from fedagent.rollout.episode import first_batch
        from fedagent.rollout.prefetch import PrefetchedEnv

        seeds0 = [s for s in epoch_task_seeds(p, round, client, 0) for _ in range(p.group_size)]
        env = PrefetchedEnv(env, *first_batch(seeds0, p.pool_size, _session_prefix(round, client, 0)))
    model, tok = load_policy(model_dir, threads, verify=verify, device=p.device)
    clock.mark("weights_loaded")
    ref_model = None
    same_ref = False
    lora = LoraClient.of(p, round, client)  # train.lora (fedagent.train.lora_client); None: a full fine-tune
    if lora is not None:
        lora.freeze_base(model)
    if ref_model_dir is not None and p.kl_coef and lora is not None and ref_state is None:
        # The reference has the start model's weights: the trained model with its adapters off, no copy.
        same_ref = True
        ref_model = lora.reference(model)
    elif ref_model_dir is not None and p.kl_coef:
        same_ref = ref_state is None
        # Same weights (round 1, or ref_anchor=round): a copy in memory instead of a reload.
        ref_model = copy.deepcopy(model)
        if ref_state is not None:
            _fill(ref_model, ref_state.result(), Path(ref_model_dir))
        ref_model.requires_grad_(False)
        if p.device == "cuda":
            # Never trained, scored under bf16 autocast: its linear weights in bf16 give the same
            # log-probs at half their memory (the CPU path keeps its fp32 reference and its bytes).
            bf16_reference(ref_model)
    rollout_model, sampler = model, None
    if p.device == "cuda":
        from fedagent.model.static_sampler import StaticSampler

        rollout_model = copy.deepcopy(model).to(torch.bfloat16)
        rollout_model.requires_grad_(False)
        sampler = StaticSampler(
            rollout_model,
            tok,
            batch_size=p.pool_size,
            max_prompt_tokens=p.max_prompt_tokens,
            max_new_tokens=p.max_new_tokens,
            mode=p.sampler,
            widths=p.sampler_widths,
            fused=p.sampler_fused,
            compile_prefill=p.sampler_compile_prefill,
            deterministic=p.deterministic,
        )
    if lora is not None:  # after the copies above: fresh adapters on the frozen start model
        lora.add_adapters(model)
    # FedProx's w_t: the round's start model, before any step (μ = 0: no snapshot at all); with LoRA the
    # same μ/2·‖w − w_t‖² on the adapted weights.
    if not p.fedprox_mu:
        prox_anchor = None
    else:
        prox_anchor = fedprox.snapshot(model) if lora is None else lora.prox_anchor(model)
    estimator = advantages.estimator(p.algorithm, p.advantage_params)
    critic = critic_optimizer = None
    if estimator.critic:  # PPO: the value model starts from the critic/ beside the start model
        from fedagent.model.critic import load_critic, save_critic

        critic = load_critic(require_start_critic(model_dir), device=p.device)
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=p.critic_lr, weight_decay=p.weight_decay)
    clock.mark("model_loaded")
    if sampler is not None and p.sampler != "eager":
        sampler.warmup(p.temperature)  # compile + CUDA graphs now, not at the first rollout
        clock.mark("sampler_warm")
    if p.residual_dtype != "float32":
        # The policy's and the reference's log-prob forwards (the rollout copy is bf16 already).
        for m in (model, ref_model):
            if m is not None and not isinstance(m, AdaptersOff):  # adapters off: the model itself
                grpo.set_residual_dtype(m, p.residual_dtype)
    if p.activation_checkpointing:
        # After the copies above: only the trained policy recomputes its activations.
        checkpoint_activations(model)
    if p.device == "cuda" and p.compile_train:
        # Fused kernels and CUDA graphs for the training forward/backward (compiled lazily, one
        # static shape bucket at a time). After the copies above: the reference and the rollout
        # model stay plain modules.
        compile_for_training(model)
    if hasattr(env, "ready"):
        prefetch = env
        env = env.ready()
        # Where the env's start went: its service answered, then the first batch was reset.
        for name, when in (
            ("env_service_up", getattr(prefetch, "service_up_at", None)),
            ("first_batch_reset", getattr(prefetch, "reset_at", None)),
        ):
            if when is not None:
                clock.mark(name, when)
    clock.mark("env_ready")
    # On a GPU the fused AdamW kernel (one launch for all tensors); the CPU keeps the default
    # implementation, whose bytes the CPU path's determinism tests pin.
    optimizer = torch.optim.AdamW(
        [q for q in model.parameters() if q.requires_grad],  # LoRA: the adapters only
        lr=p.lr if lora is None else lora.lr,
        weight_decay=p.weight_decay,
        **({"fused": True} if p.device == "cuda" else {}),
    )
    ppo_stats = []
    steps, records, seeds_used = [], [], []
    n_samples = n_tokens = n_prompt_tokens = 0
    returns, wins = [], []
    groups_total = groups_signal = samples_rewarded = 0
    # The groups by how many of their group_size rollouts won (metrics' group_wins): all lost (0) and all won
    # (group_size) carry no episode-level signal; the mixed ones show whether wins or losses dominate them.
    group_wins = [0] * (p.group_size + 1)
    # Each epoch's own success, return and update statistics (metrics' by_epoch): whether a job's
    # rollouts get better or worse as its own updates land, apart from what the round started from.
    by_epoch: dict[str, dict[str, float]] = {}
    estimator_stats: dict[str, Any] = {}  # the estimator's own epoch metrics, summed (GiGPO's step groups)
    for epoch in range(p.epochs):
        seeds = epoch_task_seeds(p, round, client, epoch)
        seeds_used.append(seeds)
        rollout_seeds = [s for s in seeds for _ in range(p.group_size)]
        groups = [g for g in range(len(seeds)) for _ in range(p.group_size)]
        gen = torch_generator(p.base_seed, "rollout_sampling", round=round, client=client, epoch=epoch)
        model.eval()
        if rollout_model is not model and lora is not None:
            lora.refresh_rollout(rollout_model, model)
        elif rollout_model is not model:
            with torch.no_grad():
                for dst, src in zip(rollout_model.parameters(), model.parameters()):
                    dst.copy_(src)
        with clock.phase("rollout"):
            trajs = run_episodes_batched(
                rollout_model,
                tok,
                env,
                rollout_seeds,
                batch_size=p.pool_size,
                session_prefix=_session_prefix(round, client, epoch),
                max_turns=p.max_turns,
                max_new_tokens=p.max_new_tokens,
                temperature=p.temperature,
                generator=gen,
                max_prompt_tokens=p.max_prompt_tokens,
                answer_format=p.answer_format,
                sampler=sampler,
                rollout_mode=p.rollout_mode,
                history_length=p.history,
                on_done=on_done,
                clock=clock,
            )
        make_samples = grpo.episode_samples if p.rollout_mode == "concat" else grpo.turn_samples
        samples = make_samples(trajs, groups, p.invalid_penalty)
        if critic is None:  # the estimator's advantages (PPO's come from its critic in ppo_epoch)
            for k, v in estimator.assign(samples).items():
                estimator_stats[k] = estimator_stats.get(k, 0) + v
        if critic is None:  # a group carries signal iff one of its samples' advantages is not 0
            by_group: dict[int, bool] = {}
            for s in samples:
                by_group[s.group] = by_group.get(s.group, False) or s.advantage != 0.0
            groups_total += len(by_group)
            groups_signal += sum(by_group.values())
        else:  # PPO: no groups; the samples that carry a reward at all
            samples_rewarded += sum(1 for s in samples if s.reward != 0.0)
        shuffle_rng = python_rng(p.base_seed, "minibatch_shuffle", round=round, client=client, epoch=epoch)
        if samples and critic is not None:
            from fedagent.train.ppo import ppo_epoch

            with clock.phase("train"):
                epoch_steps, stats = ppo_epoch(
                    model,
                    critic,
                    ref_model,
                    optimizer,
                    critic_optimizer,
                    samples,
                    p,
                    shuffle_rng,
                    epoch,
                    ref_is_policy=same_ref and epoch == 0,
                    prox_anchor=prox_anchor,
                )
            steps.extend(epoch_steps)
            ppo_stats.append({"epoch": epoch, **stats})
        elif samples:
            with clock.phase("train"):
                steps.extend(
                    grpo_epoch(
                        model,
                        ref_model,
                        optimizer,
                        samples,
                        p,
                        shuffle_rng,
                        epoch,
                        ref_is_policy=same_ref and epoch == 0,
                        prox_anchor=prox_anchor,
                    )
                )
        n_samples += len(samples)
        n_tokens += sum(s.trained_count() for s in samples)
        n_prompt_tokens += sum(len(s.prompt_ids) for s in samples)
        wins_of: dict[int, int] = {}
        for tr, g in zip(trajs, groups):
            wins_of[g] = wins_of.get(g, 0) + int(bool(tr.won))
            returns.append(tr.episode_return)
            wins.append(tr.won)
            records.append({"epoch": epoch, "group": g, **tr.summary()})
        for k in wins_of.values():
            group_wins[k] += 1
        by_epoch[str(epoch)] = _epoch_summary(trajs, [st for st in steps if st["epoch"] == epoch])
    if sampler is not None and sampler.first_token_time is not None:
        clock.set("first_token", sampler.first_token_time)
    metrics = {
        "round": round,
        "client": client,
        "num_samples": n_samples,
        "num_tokens": n_tokens,
        "num_prompt_tokens": n_prompt_tokens,
        "num_episodes": len(returns),
        "mean_return": (math.fsum(returns) / len(returns)) if returns else 0.0,
        "success_rate": (sum(wins) / len(wins)) if wins else 0.0,
        "invalid_rate": _invalid_rate(records),
        "kl": (math.fsum(s["kl"] for s in steps) / len(steps)) if steps else 0.0,
        "steps": steps,
        "task_seeds": seeds_used,
        "params": p.recorded(),
        "threads": threads,
        "device": p.device,
        "wall_time_s": seconds(time.time() - t0),
    }
    if det_flags is not None:
        metrics["deterministic"] = det_flags
    # The card the job was placed on (fedagent.core.placement; nothing when none was placed).
    metrics.update(placement.recorded())
    if p.device == "cuda":
        # The job's peak GPU memory (recorded per job, beside its declared gpu_mem_mb).
        from fedagent.model.memory import gpu_peak_mib

        metrics.update(gpu_peak_mib(p.device))
        if sampler is not None:  # the static shapes against the prompts' real lengths
            metrics["sampler"] = sampler.stats()
    metrics["by_epoch"] = by_epoch
    if critic is None:
        # GRPO learns only from groups whose samples differ: the share that carried signal.
        metrics.update(groups=groups_total, groups_nonzero_advantage=groups_signal)
        metrics["group_wins"] = {str(k): n for k, n in enumerate(group_wins)}
        if estimator_stats:
            metrics[estimator.name] = estimator_stats
    else:
        # PPO has no groups (its whitened GAE advantages are almost never 0): the samples whose
        # reward (the turn's penalized episode return) is non-zero, out of num_samples; with none,
        # the advantages only chase the critic's own values.
        metrics.update(ppo=ppo_stats, samples_nonzero_reward=samples_rewarded)
    return write_client_update(
        out_dir,
        ModelUpdate(
            write_policy=None if lora is not None else lambda d: save_policy(model, tok, d),
            write_adapter=None if lora is None else lora.writer(model, model_dir),
            write_critic=None if critic is None else lambda d: save_critic(critic, d),
        ),
        metrics=lambda _: metrics,
        samples=records,
        clock=clock,
        provenance={
            "job": "train_client",
            "params": {**p.recorded(), "threads": threads},
            "seeds": {"base_seed": p.base_seed, "round": round, "client": client, "task_seeds": seeds_used},
            "backend": "local",
            **({"extra": {"start_critic": str(Path(model_dir) / "critic")}} if critic is not None else {}),
        },
        quarantine=quarantine,
        transform=transform,
        start=Path(model_dir),
    )


def _read_tensors_async(model_dir: Path, verify: bool):
    """A future of ``model_dir``'s weights as CPU tensors (safetensors), manifest checked first."""
    from concurrent.futures import ThreadPoolExecutor

    def read():
        from safetensors.torch import load_file

        from fedagent.model.hf_dir import weight_files

        if verify:
            from fedagent.core.atomic import verify_manifest

            verify_manifest(model_dir)
        state = {}
        for f in weight_files(model_dir):  # the model's own files (not a merge's server_state)
            state.update(load_file(str(f)))
        return state

    pool = ThreadPoolExecutor(1, thread_name_prefix="ref-load")
    future = pool.submit(read)
    pool.shutdown(wait=False)
    return future


def _fill(model, state: dict, source: Path) -> None:
    """Load ``state`` into ``model`` (same architecture); every parameter must come from it,
    except weights tied to one that does (the LM head to the embedding)."""
    result = model.load_state_dict(state, strict=False)
    tied = {k for k in result.missing_keys if k == "lm_head.weight" and model.config.tie_word_embeddings}
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{source}: reference weights do not fit the policy (missing {missing[:3]}, "
            f"unexpected {sorted(result.unexpected_keys)[:3]})"
        )
    if tied and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise ValueError(f"{source}: the policy copy lost its tied LM head; cannot fill it from the embedding")


def _epoch_summary(trajs, epoch_steps) -> dict[str, float]:
    """One epoch's rollouts (success rate, mean return; sampled before its updates) and the mean of
    its optimizer steps' entropy and KL per token (during them)."""
    out = {
        "success_rate": (sum(bool(t.won) for t in trajs) / len(trajs)) if trajs else 0.0,
        "mean_return": (math.fsum(t.episode_return for t in trajs) / len(trajs)) if trajs else 0.0,
    }
    for key in ("entropy", "kl"):
        xs = [st[key] for st in epoch_steps if key in st]
        if xs:
            out[key] = math.fsum(xs) / len(xs)
    return out


def _session_prefix(round: int, client: int, epoch: int) -> str:
    """The env session ids' prefix of one local epoch's rollout."""
    return f"r{round}-c{client}-e{epoch}"


def _invalid_rate(records: list[dict]) -> float:
    """Share of turns whose answer broke the format (a no-op turn for the env)."""
    turns = [t for r in records for t in r["turns"]]
    return (sum(1 for t in turns if not t["valid"]) / len(turns)) if turns else 0.0
