"""The local backend: one client's GRPO round on CPU (or one GPU), written as an HF dir.

Per local epoch e: fresh task seeds ``derive_seed(base, "task_draw", round, client, epoch,
index=g)`` for g < groups_per_epoch, each played ``group_size`` times (a GRPO group = one
seed = one task), sampled with ``torch_generator(base, "rollout_sampling", round, client,
epoch)``; behaviour and reference log-probs are computed before the epoch's first update;
then one pass over the per-turn samples in mini-batches shuffled by their own derived seed.
Same inputs and thread count → byte-identical ``model.safetensors``.

``algorithm: ppo`` (fedagent.train.ppo): the critic in ``<start model>/critic`` gives per-token
GAE advantages instead of group advantages and takes one step beside each actor step; the
update dir then carries the trained critic in ``critic/``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedagent.config import JobKeys, dataclass_from_dict
from fedagent.seeds import derive_seed, python_rng, torch_generator
from fedagent.train import fedprox, grpo


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
    entropy_coef: float = 0.0
    mini_batch_size: int = 8
    micro_batch_size: int = 4
    max_prompt_tokens: int = 1024
    invalid_penalty: float = 0.1
    pool_size: int = 8
    env_procs: int = 0                    # env.procs: the env service's worker processes (0: its threads)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    answer_format: str = "think_action"   # rollout.answer_format: think_action | action
    rollout_mode: str = "windowed"        # rollout.mode: windowed | concat
    history: int = 2                      # rollout.history: windowed prompt's past steps
    fedprox_mu: float = 0.0               # train.fedprox_mu: μ of FedProx's μ·(w − w_round_start)
    device: str = "cpu"                   # cpu | cuda (fp32 master weights either way)
    sampler: str = "compile"              # cuda: the static-cache sampler's mode (compile | graph | eager)
    compile_train: bool = False           # cuda: torch.compile the policy's forward/backward for training
    residual_dtype: str = "float32"       # cuda: the training forward's residual stream (float32 | bfloat16)
    # --- PPO (train.algorithm: ppo; keys under train.ppo, fedagent.train.ppo) ---
    algorithm: str = "grpo"               # grpo | ppo
    gamma: float = 1.0                    # GAE discount (verl's default, the reference's)
    lam: float = 1.0                      # GAE λ
    critic_lr: float = 1e-5               # the critic's AdamW lr
    value_clip: float = 0.5               # clipped value loss: V within V_old ± value_clip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainParams":
        """Build from a dict; unknown keys and bad values are errors that name them.

        Values that come from the config are checked against the config schema and the cross
        rules (:data:`TRAIN_KEYS`: what planning checked); the rest are not config keys.
        """
        p = dataclass_from_dict(cls, d, "train")
        TRAIN_KEYS.check(dataclasses.asdict(p))
        if p.micro_batch_size < 1 or p.weight_decay < 0 or not p.grad_clip > 0:
            raise ValueError(f"bad train params (not config keys): micro_batch_size={p.micro_batch_size}, "
                             f"weight_decay={p.weight_decay}, grad_clip={p.grad_clip}")
        return p

    def recorded(self) -> dict[str, Any]:
        """The params as metrics.json / provenance.json record them (GRPO: without PPO's keys,
        so a GRPO update's files are what they were before PPO existed)."""
        d = dataclasses.asdict(self)
        if self.algorithm != "ppo":
            for k in PPO_FIELDS:
                d.pop(k)
        return d


PPO_FIELDS = ("algorithm", "gamma", "lam", "critic_lr", "value_clip")

# Which config key each TrainParams field comes from (workflow/common.smk's TRAIN_PARAMS).
TRAIN_KEYS = JobKeys.for_dataclass("train-client", TrainParams, "train",
                                   {"base_seed": "seed", "pool_size": "env.pool_size",
                                    "env_procs": "env.procs", "answer_format": "rollout.answer_format",
                                    "rollout_mode": "rollout.mode", "history": "rollout.history",
                                    **{k: f"train.ppo.{k}" for k in PPO_FIELDS[1:]}})


def epoch_task_seeds(p: TrainParams, round: int, client: int, epoch: int) -> list[int]:
    """The group seeds of one local epoch (fresh draws every epoch)."""
    return [derive_seed(p.base_seed, "task_draw", round=round, client=client, epoch=epoch, index=g)
            for g in range(p.groups_per_epoch)]


def same_weights(a: Path, b: Path) -> bool:
    """Whether two model dirs hold byte-identical ``model.safetensors`` (manifest sha256 or hash)."""
    from fedagent.atomic import MANIFEST, sha256_file

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


def _chunks(seq, n):
    return [seq[k:k + n] for k in range(0, len(seq), n)]


def _logprobs(model, batch, temperature: float, micro: int, with_entropy: bool = False):
    """:func:`fedagent.train.grpo.response_logprobs` as the job's device wants it.

    CPU: left padding with a mask (the bytes the CPU determinism tests pin). GPU: right padding
    with no mask (plain causal attention, one non-blocking copy of the batch); with
    ``train.compile_train`` each micro-batch is also padded to a static shape (``micro`` rows,
    width rounded up to 64), so the CUDA-graphed forward sees a few shapes, not one per batch.
    """
    if next(model.parameters()).device.type == "cpu":
        return grpo.response_logprobs(model, batch, temperature=temperature, with_entropy=with_entropy)
    shape = None
    if getattr(model, "_fedagent_forward", None) is not None:
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in batch)
        shape = grpo.static_pad_shape(len(batch), width, rows_to=micro,
                                      n_targets=sum(s.trained_count() for s in batch))
    return grpo.response_logprobs(model, batch, temperature=temperature, with_entropy=with_entropy,
                                  right_pad=True, pad_shape=shape)


@torch.no_grad()
def _logprobs_nograd(model, samples, micro: int, temperature: float) -> torch.Tensor:
    parts = [_logprobs(model, chunk, temperature, micro)[0] for chunk in _chunks(samples, micro)]
    return torch.cat(parts) if parts else torch.zeros(0)


# ``mode="reduce-overhead"``: inductor's fused kernels in CUDA graphs. (Adding coordinate-descent
# tuning of the Triton kernels' launch configs was tried on the H200, 2026-12-01: its first compile
# of the B64x512 step had not finished after 6 min, against about 57 s without it. A pre-grad
# pass making the linears that read one input (q/k/v, gate/up) one matmul over concatenated
# weights was measured there on 2026-12-02: MFU 0.287 against 0.299 without it, so it is not used.)
COMPILE_TRAIN_OPTIONS = {"triton.cudagraphs": True}


def compile_for_training(model, options: dict | None = None) -> None:
    """``train.compile_train``: the policy's log-prob forward (decoder, LM head on the trained
    positions, log-softmax: :func:`fedagent.train.grpo.forward_logprobs`) through torch.compile
    with static shapes and CUDA graphs (:data:`COMPILE_TRAIN_OPTIONS`; ``options`` replaces them):
    fused kernels and no per-kernel launch cost. Each shape bucket of :func:`_logprobs` is compiled and captured once,
    at its first use. Attention runs as plain causal SDPA with no mask at all
    (:func:`causal_attention_without_mask`: the batches are right-padded)."""
    causal_attention_without_mask(model)
    model._fedagent_forward = torch.compile(grpo.forward_logprobs, dynamic=False,
                                            options=COMPILE_TRAIN_OPTIONS if options is None else options)


CAUSAL_SDPA = "fedagent_causal_sdpa"


def causal_attention_without_mask(model) -> None:
    """Make ``model`` attend with SDPA's ``is_causal`` and no mask tensor, also under torch.compile.

    transformers drops the all-ones mask of an unpadded batch only when it is not tracing; under
    torch.compile it always builds a 4-D mask, and SDPA with an explicit mask takes kernels
    about twice as slow (measured on the H200: 416 µs vs 216 µs per backward call). Our training
    batches are right-padded with no padding mask (a real token never sees a pad after it), so
    causal attention is exact: registered under transformers' attention and mask interfaces,
    the mask function returns None and the attention is transformers' own SDPA forward, which
    then passes ``is_causal=True``. Only for full-sequence forwards without a KV cache.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, _no_mask)
    model.config._attn_implementation = CAUSAL_SDPA


def _no_mask(*args, **kwargs):
    return None


def _autocast(model):
    """bf16 autocast for forward passes on a GPU (fp32 master weights, fp32 log-softmax);
    nothing on the CPU, whose path stays byte-identical to before."""
    import contextlib

    device = next(model.parameters()).device
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _token_slices(samples) -> list[slice]:
    """Each sample's trained tokens in the flat sample-order tensors."""
    out, k = [], 0
    for s in samples:
        out.append(slice(k, k + s.trained_count()))
        k += s.trained_count()
    return out


def _token_index(slices, micro, device) -> torch.Tensor:
    """The flat indices of ``micro``'s trained tokens, in its order (one non-blocking copy)."""
    idx = torch.cat([torch.arange(slices[i].start, slices[i].stop) for i in micro])
    if device.type == "cpu":
        return idx
    return idx.pin_memory().to(device, non_blocking=True)


def _record_steps(pending: list, steps: list, epoch: int) -> None:
    """Bring the pending optimizer steps' stats to the host (one copy), append their records to
    ``steps`` and empty ``pending``; a non-finite gradient norm raises, naming the first such
    step. The sums are the host's, in micro-batch order, as if each value had been read at once."""
    if not pending:
        return
    flat = torch.cat([t for *_, st, norm in pending for t in (norm.reshape(1), st.reshape(-1))]).double().tolist()
    k = 0
    for n_samples, n_tok, st, _norm in pending:
        grad_norm, k = flat[k], k + 1
        acc = {"loss": 0.0, "pg": 0.0, "kl": 0.0, "entropy": 0.0, "clipfrac": 0.0}
        for _ in range(st.shape[0]):
            loss, pg, kl, ent, clipped = flat[k:k + 5]
            k += 5
            acc["loss"] += loss
            acc["pg"] += pg / n_tok
            acc["kl"] += kl / n_tok
            acc["entropy"] += ent / n_tok
            acc["clipfrac"] += clipped / n_tok
        if not math.isfinite(grad_norm):
            # clip_grad_norm_ turns an inf norm into NaN updates (inf * 0): stop, naming the step,
            # instead of writing NaN weights that the next rollout or aggregate trips over.
            pending.clear()
            raise FloatingPointError(f"non-finite gradient norm ({grad_norm}) in epoch {epoch}, "
                                     f"optimizer step {len(steps)} (loss {acc['loss']:.6g})")
        steps.append({"epoch": epoch, "samples": n_samples, "tokens": n_tok, "grad_norm": grad_norm,
                      **{name: round(v, 8) for name, v in acc.items()}})
    pending.clear()


def deferred_steps(optimizer) -> bool:
    """Whether ``optimizer`` can skip a non-finite step on the device (a fused one: GradScaler's
    ``found_inf``), so that :func:`update_step` never waits for the host."""
    return bool(getattr(optimizer, "defaults", {}).get("fused"))


def update_step(model, optimizer, samples, mb, old, ref, token_adv, slices, p: TrainParams, params,
                prox_anchor=None, deferred: bool = False, check=None) -> tuple:
    """One optimizer step on the mini-batch ``mb`` (sample indices), its micro-batches' gradients
    accumulated: the token-mean clipped-ratio loss (+ KL, − entropy), FedProx's term, clipping,
    the step. ``old``/``ref``/``token_adv``: flat per-token tensors in sample order (``slices``:
    :func:`_token_slices`). Returns the step's pending record ``(samples, tokens, stats, norm)``
    with the stats still on the device. ``deferred``: the optimizer skips a non-finite step
    itself (:func:`deferred_steps`); else ``check(record)`` runs before the step (it reads the
    norm on the host and raises on a non-finite one)."""
    n_tok = sum(samples[i].trained_count() for i in mb)
    optimizer.zero_grad(set_to_none=True)
    stats = []
    for micro in _chunks(mb, p.micro_batch_size):
        batch = [samples[i] for i in micro]
        with _autocast(model):
            logp, ent = _logprobs(model, batch, p.temperature, p.micro_batch_size, with_entropy=True)
        idx = _token_index(slices, micro, logp.device)
        terms, st = grpo.grpo_token_terms(
            logp, old[idx], ref[idx] if ref is not None else None, token_adv[idx], clip=p.clip,
            kl_coef=p.kl_coef, entropy_coef=p.entropy_coef, entropy=ent if p.entropy_coef else ent.detach())
        # Sum over tokens / mini-batch token count = token-mean over the whole mini-batch.
        loss = terms.sum() / n_tok
        loss.backward()
        stats.append(torch.stack([loss.detach(), st["pg"].sum(), st["kl"].sum(), st["entropy"].sum(),
                                  st["clipped"].sum()]))
    if prox_anchor is not None:
        fedprox.add_proximal_grad(model, prox_anchor, p.fedprox_mu)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, p.grad_clip)
    record = (len(mb), n_tok, torch.stack(stats), grad_norm)
    if deferred:
        optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    else:
        if check is not None:
            check(record)
        optimizer.step()
    return record


def grpo_epoch(model, ref_model, optimizer, samples, p: TrainParams, shuffle_rng, epoch: int,
               ref_is_policy: bool = False, prox_anchor: dict | None = None,
               token_adv: torch.Tensor | None = None, after_step=None) -> list[dict]:
    """Behaviour/ref log-probs first, then one shuffled pass of mini-batch updates.

    The actor's epoch of GRPO and of PPO. PPO (fedagent.train.ppo) passes ``token_adv``, flat
    per-token advantages in sample order (GRPO: each sample's ``advantage`` on all its tokens),
    and ``after_step(mb)``, its critic step on the same mini-batch, whose stats join the step's.

    ``ref_is_policy``: the reference has bit-identical weights to the current policy, so its
    log-probs are the behaviour log-probs (same deterministic computation) and one forward
    pass over the samples is saved. ``prox_anchor``: FedProx's round-start actor weights
    (:func:`fedagent.train.fedprox.snapshot`); ``p.fedprox_mu·(w − w_t)`` joins each step's
    gradient before clipping. None (μ = 0): plain FedAvg local training.
    """
    model.eval()   # no dropout in Llama; eval() keeps sampling and scoring numerics identical
    amp = _autocast(model)
    with amp:
        old = _logprobs_nograd(model, samples, p.micro_batch_size, p.temperature)
    if ref_model is None:
        ref = None
    elif ref_is_policy:
        ref = old
    else:
        with _autocast(model):
            ref = _logprobs_nograd(ref_model, samples, p.micro_batch_size, p.temperature)
    # Per trained token, its index in the flat (sample-order) behaviour/reference/advantage
    # tensors: a micro-batch gathers its rows with one index instead of a cat of many slices.
    slices = _token_slices(samples)
    device = next(model.parameters()).device
    if token_adv is None:
        token_adv = grpo.token_advantages(samples)
    token_adv = token_adv.to(device)
    order = list(range(len(samples)))
    shuffle_rng.shuffle(order)
    params = [q for q in model.parameters() if q.requires_grad]
    # A fused optimizer (the GPU path's AdamW) skips a non-finite step on the device
    # (``found_inf``, GradScaler's mechanism: weights and moments untouched), so no step has to
    # wait for its gradient norm on the host: the stats of the whole pass come back in one copy
    # at the end (or before PPO's critic step, which syncs anyway) and the first non-finite step
    # is named then. Other optimizers (the CPU path) check each step's norm before stepping.
    deferred = deferred_steps(optimizer)
    steps, pending = [], []
    for mb in _chunks(order, p.mini_batch_size):
        record = update_step(model, optimizer, samples, mb, old, ref, token_adv, slices, p, params, prox_anchor,
                             deferred, check=lambda r: _record_steps([r], steps, epoch))
        if deferred:
            pending.append(record)
        if after_step is not None:
            _record_steps(pending, steps, epoch)
            steps[-1].update(after_step(mb))
    _record_steps(pending, steps, epoch)
    return steps


def train_client(model_dir: Path, ref_model_dir: Path | None, env, *, round: int, client: int,
                 params: TrainParams, threads: int, out_dir: Path, quarantine: Path | None = None,
                 verify: bool = True) -> dict:
    """Run one client's local GRPO round against ``env``; write the update dir atomically.

    Output (via :func:`fedagent.atomic.atomic_dir`): fp32 HF dir + ``metrics.json`` +
    ``samples.jsonl``. Returns the metrics dict. ``ref_model_dir`` None (or kl_coef 0)
    disables the KL term. On ``device: cuda`` the fp32 master weights train under bf16
    autocast and rollouts come from a bf16 copy (synced before every epoch) through the
    compiled static-cache sampler; the update written is the fp32 master.
    """
    from fedagent.atomic import atomic_dir
    from fedagent.provenance import write_provenance
    from fedagent.policy import load_policy, save_policy
    from fedagent.rollout.episode import run_episodes_batched
    from fedagent.timing import PhaseClock

    clock = PhaseClock()
    # Process start → here: the interpreter and the torch/transformers imports. ``env`` may be a
    # :class:`fedagent.envs.lifecycle.PendingEnv`: its service comes up while the model loads.
    clock.mark("job_ready")
    t0 = time.time()
    p = params
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
    if ref_model_dir is not None and p.kl_coef:
        same_ref = ref_state is None
        # Same weights (round 1, or ref_anchor=round): a copy in memory instead of a reload.
        ref_model = copy.deepcopy(model)
        if ref_state is not None:
            _fill(ref_model, ref_state.result(), Path(ref_model_dir))
        ref_model.requires_grad_(False)
    rollout_model, sampler = model, None
    if p.device == "cuda":
        from fedagent.static_sampler import StaticSampler

        rollout_model = copy.deepcopy(model).to(torch.bfloat16)
        rollout_model.requires_grad_(False)
        sampler = StaticSampler(rollout_model, tok, batch_size=p.pool_size, max_prompt_tokens=p.max_prompt_tokens,
                                max_new_tokens=p.max_new_tokens, mode=p.sampler)
    # FedProx's w_t: the round's start model, before any step (μ = 0: no snapshot at all).
    prox_anchor = fedprox.snapshot(model) if p.fedprox_mu else None
    critic = critic_optimizer = None
    if p.algorithm == "ppo":   # the value model starts from the critic/ beside the start model
        from fedagent.critic_dir import critic_of
        from fedagent.train.critic import load_critic

        if not critic_of(model_dir).is_dir():
            raise ValueError(f"train.algorithm ppo: the start model {model_dir} has no critic/ (value model)")
        critic = load_critic(critic_of(model_dir), device=p.device)
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=p.critic_lr, weight_decay=p.weight_decay)
    clock.mark("model_loaded")
    if sampler is not None and p.sampler != "eager":
        sampler.warmup(p.temperature)   # compile + CUDA graphs now, not at the first rollout
        clock.mark("sampler_warm")
    if p.residual_dtype != "float32":
        # The policy's and the reference's log-prob forwards (the rollout copy is bf16 already).
        for m in (model, ref_model):
            if m is not None:
                grpo.set_residual_dtype(m, p.residual_dtype)
    if p.device == "cuda" and p.compile_train:
        # Fused kernels and CUDA graphs for the training forward/backward (compiled lazily, one
        # static shape bucket at a time). After the copies above: the reference and the rollout
        # model stay plain modules.
        compile_for_training(model)
    if hasattr(env, "ready"):
        prefetch = env
        env = env.ready()
        # Where the env's start went: its service answered, then the first batch was reset.
        for name, when in (("env_service_up", getattr(prefetch, "service_up_at", None)),
                           ("first_batch_reset", getattr(prefetch, "reset_at", None))):
            if when is not None:
                clock.mark(name, when)
    clock.mark("env_ready")
    # On a GPU the fused AdamW kernel (one launch for all tensors); the CPU keeps the default
    # implementation, whose bytes the CPU path's determinism tests pin.
    optimizer = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=p.weight_decay,
                                  **({"fused": True} if p.device == "cuda" else {}))
    ppo_stats = []
    steps, records, seeds_used = [], [], []
    n_samples = n_tokens = n_prompt_tokens = 0
    returns, wins = [], []
    groups_total = groups_signal = samples_rewarded = 0
    for epoch in range(p.epochs):
        seeds = epoch_task_seeds(p, round, client, epoch)
        seeds_used.append(seeds)
        rollout_seeds = [s for s in seeds for _ in range(p.group_size)]
        groups = [g for g in range(len(seeds)) for _ in range(p.group_size)]
        gen = torch_generator(p.base_seed, "rollout_sampling", round=round, client=client, epoch=epoch)
        model.eval()
        if rollout_model is not model:
            with torch.no_grad():
                for dst, src in zip(rollout_model.parameters(), model.parameters()):
                    dst.copy_(src)
        with clock.phase("rollout"):
            trajs = run_episodes_batched(
                rollout_model, tok, env, rollout_seeds, batch_size=p.pool_size,
                session_prefix=_session_prefix(round, client, epoch), max_turns=p.max_turns,
                max_new_tokens=p.max_new_tokens, temperature=p.temperature, generator=gen,
                max_prompt_tokens=p.max_prompt_tokens, answer_format=p.answer_format, sampler=sampler,
                rollout_mode=p.rollout_mode, history_length=p.history)
        make_samples = grpo.episode_samples if p.rollout_mode == "concat" else grpo.turn_samples
        samples = make_samples(trajs, groups, p.invalid_penalty)
        if critic is None:
            advs = grpo.group_advantages([s.reward for s in samples], [s.group for s in samples])
            for s, a in zip(samples, advs):
                s.advantage = a
        if critic is None:   # GRPO: a group carries signal iff its samples' rewards differ
            by_group: dict[int, bool] = {}
            for s in samples:
                by_group[s.group] = by_group.get(s.group, False) or s.advantage != 0.0
            groups_total += len(by_group)
            groups_signal += sum(by_group.values())
        else:                # PPO: no groups; the samples that carry a reward at all
            samples_rewarded += sum(1 for s in samples if s.reward != 0.0)
        shuffle_rng = python_rng(p.base_seed, "minibatch_shuffle", round=round, client=client, epoch=epoch)
        if samples and critic is not None:
            from fedagent.train.ppo import ppo_epoch

            with clock.phase("train"):
                epoch_steps, stats = ppo_epoch(model, critic, ref_model, optimizer, critic_optimizer, samples, p,
                                               shuffle_rng, epoch, ref_is_policy=same_ref and epoch == 0,
                                               prox_anchor=prox_anchor)
            steps.extend(epoch_steps)
            ppo_stats.append({"epoch": epoch, **stats})
        elif samples:
            with clock.phase("train"):
                steps.extend(grpo_epoch(model, ref_model, optimizer, samples, p, shuffle_rng, epoch,
                                        ref_is_policy=same_ref and epoch == 0, prox_anchor=prox_anchor))
        n_samples += len(samples)
        n_tokens += sum(s.trained_count() for s in samples)
        n_prompt_tokens += sum(len(s.prompt_ids) for s in samples)
        for tr, g in zip(trajs, groups):
            returns.append(tr.episode_return)
            wins.append(tr.won)
            records.append({"epoch": epoch, "group": g, **tr.summary()})
    if sampler is not None and sampler.first_token_time is not None:
        clock.set("first_token", sampler.first_token_time)
    metrics = {
        "round": round, "client": client, "num_samples": n_samples, "num_tokens": n_tokens,
        "num_prompt_tokens": n_prompt_tokens,
        "num_episodes": len(returns),
        "mean_return": (math.fsum(returns) / len(returns)) if returns else 0.0,
        "success_rate": (sum(wins) / len(wins)) if wins else 0.0,
        "invalid_rate": _invalid_rate(records),
        "kl": (math.fsum(s["kl"] for s in steps) / len(steps)) if steps else 0.0,
        "steps": steps, "task_seeds": seeds_used, "params": p.recorded(),
        "threads": threads, "device": p.device, "wall_time_s": round_(time.time() - t0),
    }
    if critic is None:
        # GRPO learns only from groups whose samples differ: the share that carried signal.
        metrics.update(groups=groups_total, groups_nonzero_advantage=groups_signal)
    else:
        # PPO has no groups (its whitened GAE advantages are almost never 0): the samples whose
        # reward (the turn's penalized episode return) is non-zero, out of num_samples; with none,
        # the advantages only chase the critic's own values.
        metrics.update(ppo=ppo_stats, samples_nonzero_reward=samples_rewarded)
    with atomic_dir(Path(out_dir), quarantine) as staging:
        save_policy(model, tok, staging)
        if critic is not None:
            from fedagent.critic_dir import CRITIC_RECORD, critic_digests, critic_of
            from fedagent.train.critic import save_critic

            save_critic(critic, critic_of(staging))
            # whose critic this is: verify compares it with the files found in critic/ (critic_dir)
            metrics[CRITIC_RECORD] = critic_digests(staging)
        clock.mark("saved")
        metrics["timings"] = clock.summary()
        (staging / "metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n")
        with open(staging / "samples.jsonl", "w") as fh:
            for rec in records:
                fh.write(json.dumps(rec, sort_keys=True) + "\n")
        write_provenance(staging, job="train_client", params={**p.recorded(), "threads": threads},
                         seeds={"base_seed": p.base_seed, "round": round, "client": client,
                                "task_seeds": seeds_used}, backend="local",
                         **({"extra": {"start_critic": str(Path(model_dir) / "critic")}} if critic is not None else {}))
    return metrics


def _read_tensors_async(model_dir: Path, verify: bool):
    """A future of ``model_dir``'s weights as CPU tensors (safetensors), manifest checked first."""
    from concurrent.futures import ThreadPoolExecutor

    def read():
        from safetensors.torch import load_file

        from fedagent.hf_dir import weight_files

        if verify:
            from fedagent.atomic import verify_manifest

            verify_manifest(model_dir)
        state = {}
        for f in weight_files(model_dir):     # the model's own files (not a merge's server_state)
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
        raise ValueError(f"{source}: reference weights do not fit the policy (missing {missing[:3]}, "
                         f"unexpected {sorted(result.unexpected_keys)[:3]})")
    if tied and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise ValueError(f"{source}: the policy copy lost its tied LM head; cannot fill it from the embedding")


def _session_prefix(round: int, client: int, epoch: int) -> str:
    """The env session ids' prefix of one local epoch's rollout."""
    return f"r{round}-c{client}-e{epoch}"


def _invalid_rate(records: list[dict]) -> float:
    """Share of turns whose answer broke the format (a no-op turn for the env)."""
    turns = [t for r in records for t in r["turns"]]
    return (sum(1 for t in turns if not t["valid"]) / len(turns)) if turns else 0.0


def round_(x: float) -> float:
    """Seconds to 3 decimals (wall time is informational only)."""
    return float(f"{x:.3f}")
