"""The actor's update, shared by GRPO and PPO: log-probs per micro-batch, the clipped-ratio step,
one epoch of shuffled mini-batch steps, and the GPU-only forward tricks (bf16 autocast, the
compiled static-shape log-prob forward, mask-free causal attention).

GRPO's epoch is :func:`grpo_epoch`; PPO's (:mod:`fedagent.train.ppo`) is the same epoch with its
per-token GAE advantages and a critic step after each actor step. ``p`` is the job's
:class:`fedagent.train.local.TrainParams` (duck-typed here: this module sits below the job).
"""

from __future__ import annotations

import contextlib
import math

import torch

from fedagent.train import fedprox, grpo, micro_batches


def chunks(seq, n):
    return [seq[k : k + n] for k in range(0, len(seq), n)]


def micro_batch_tokens(p) -> int | None:
    """``train.micro_batch_tokens`` of the job's params (None: micro-batches by rows only)."""
    return getattr(p, "micro_batch_tokens", None)


def logprobs(model, batch, temperature: float, micro: int, with_entropy: bool = False):
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
        shape = grpo.static_pad_shape(len(batch), width, rows_to=micro, n_targets=sum(s.trained_count() for s in batch))
    return grpo.response_logprobs(
        model, batch, temperature=temperature, with_entropy=with_entropy, right_pad=True, pad_shape=shape
    )


@torch.no_grad()
def logprobs_nograd(model, samples, micro: int, temperature: float, tokens: int | None = None) -> torch.Tensor:
    """Every sample's response log-probs, flat in sample order, in micro-batches of at most ``micro`` rows
    (and ``tokens`` padded tokens: :mod:`fedagent.train.micro_batches`)."""
    cuts = micro_batches.split(range(len(samples)), samples, micro, tokens)
    parts = [logprobs(model, [samples[i] for i in cut], temperature, micro)[0] for cut in cuts]
    return torch.cat(parts) if parts else torch.zeros(0)


# ``mode="reduce-overhead"``: inductor's fused kernels in CUDA graphs. (Adding coordinate-descent
# tuning of the Triton kernels' launch configs was tried on the GPU: its first compile
# of the B64x512 step had not finished after 6 min, against about 57 s without it. A pre-grad
# pass making the linears that read one input (q/k/v, gate/up) one matmul over concatenated
# weights was measured there: MFU 0.287 against 0.299 without it, so it is not used.)
COMPILE_TRAIN_OPTIONS = {"triton.cudagraphs": True}


def compile_for_training(model, options: dict | None = None) -> None:
    """``train.compile_train``: the policy's log-prob forward (decoder, LM head on the trained
    positions, log-softmax: :func:`fedagent.train.grpo.forward_logprobs`) through torch.compile
    with static shapes and CUDA graphs (:data:`COMPILE_TRAIN_OPTIONS`; ``options`` replaces them):
    fused kernels and no per-kernel launch cost. Each shape bucket of :func:`logprobs` is compiled and captured once,
    at its first use. Attention runs as plain causal SDPA with no mask at all
    (:func:`causal_attention_without_mask`: the batches are right-padded)."""
    causal_attention_without_mask(model)
    model._fedagent_forward = torch.compile(
        grpo.forward_logprobs, dynamic=False, options=COMPILE_TRAIN_OPTIONS if options is None else options
    )


CAUSAL_SDPA = "fedagent_causal_sdpa"


def causal_attention_without_mask(model) -> None:
    """Make ``model`` attend with SDPA's ``is_causal`` and no mask tensor, also under torch.compile.

    transformers drops the all-ones mask of an unpadded batch only when it is not tracing; under
    torch.compile it always builds a 4-D mask, and SDPA with an explicit mask takes kernels
    about twice as slow (measured: 416 µs vs 216 µs per backward call, docs/results/throughput.md). Our training
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


def checkpoint_activations(model) -> None:
    """``train.activation_checkpointing``: every decoder layer of ``model`` keeps only its input for
    the backward pass and recomputes its activations there (``torch.utils.checkpoint``, non-reentrant),
    so a micro-batch's saved activations are one layer's plus each layer's input instead of every
    layer's (:func:`fedagent.model.memory.train_terms`). Only forwards that record a graph
    (the update's) are checkpointed; the no-grad behaviour/reference passes run as before.

    transformers' own ``gradient_checkpointing_enable`` does nothing here: it checkpoints only in
    ``train()`` mode, and the actor runs the model in ``eval()`` mode. The layers draw no random
    numbers (no dropout in eval mode), so the recomputation is the same computation: the gradients
    are those without checkpointing (tests/test_scale.py checks it on the CPU). Call it after the
    job's copies of the policy are made: the reference and the rollout copy are never trained."""
    import types

    for layer in decoder_layers(model):
        if "forward" not in layer.__dict__:
            # A bound method in the instance's dict: a deepcopy of the model rebinds it to the copy.
            layer.forward = types.MethodType(_checkpointed_forward, layer)


def _checkpointed_forward(self, *args, **kwargs):
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, self, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def decoder_layers(model) -> list:
    """The decoder layers of a transformers causal LM (Llama, Qwen2: ``model.model.layers``)."""
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__}: no decoder layers at model.base_model.layers "
            "(train.activation_checkpointing needs a Llama-style model)"
        )
    return list(layers)


def bf16_reference(model) -> None:
    """The KL reference on the GPU path, held in bf16 where the forward computes in bf16 anyway.

    The reference is never trained and its log-probs are computed under bf16 autocast, which casts
    every linear layer's fp32 weight to bf16 (round to nearest even) at each call; holding those
    weights in bf16 already is the same cast done once, so the log-probs are the same bits and the
    reference takes 2 bytes per linear weight instead of 4. The embedding (a lookup autocast does
    not cast), the norms and a tied LM head (it is the embedding) stay fp32, as autocast reads them.
    """
    tied = model.get_input_embeddings().weight
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight is not tied:
            module.to(torch.bfloat16)


def autocast(model):
    """bf16 autocast for forward passes on a GPU (fp32 master weights, fp32 log-softmax);
    nothing on the CPU, whose path stays byte-identical to before."""
    import contextlib

    device = next(model.parameters()).device
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def token_slices(samples) -> list[slice]:
    """Each sample's trained tokens in the flat sample-order tensors."""
    out, k = [], 0
    for s in samples:
        out.append(slice(k, k + s.trained_count()))
        k += s.trained_count()
    return out


def token_index(slices, micro, device) -> torch.Tensor:
    """The flat indices of ``micro``'s trained tokens, in its order (one non-blocking copy)."""
    idx = torch.cat([torch.arange(slices[i].start, slices[i].stop) for i in micro])
    if device.type == "cpu":
        return idx
    return idx.pin_memory().to(device, non_blocking=True)


def record_steps(pending: list, steps: list, epoch: int) -> None:
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
            loss, pg, kl, ent, clipped = flat[k : k + 5]
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
            raise FloatingPointError(
                f"non-finite gradient norm ({grad_norm}) in epoch {epoch}, "
                f"optimizer step {len(steps)} (loss {acc['loss']:.6g})"
            )
        steps.append(
            {
                "epoch": epoch,
                "samples": n_samples,
                "tokens": n_tok,
                "grad_norm": grad_norm,
                **{name: round(v, 8) for name, v in acc.items()},
            }
        )
    pending.clear()


def deferred_steps(optimizer) -> bool:
    """Whether ``optimizer`` can skip a non-finite step on the device (a fused one: GradScaler's
    ``found_inf``), so that :func:`update_step` never waits for the host."""
    return bool(getattr(optimizer, "defaults", {}).get("fused"))


def update_step(
    model,
    optimizer,
    samples,
    mb,
    old,
    ref,
    token_adv,
    slices,
    p,
    params,
    prox_anchor=None,
    deferred: bool = False,
    check=None,
) -> tuple:
    """One optimizer step on the mini-batch ``mb`` (sample indices), its micro-batches' gradients
    accumulated: the token-mean dual-clipped ratio loss (+ KL, − entropy), FedProx's term, clipping,
    the step. ``old``/``ref``/``token_adv``: flat per-token tensors in sample order (``slices``:
    :func:`token_slices`). Returns the step's pending record ``(samples, tokens, stats, norm)``
    with the stats still on the device. ``deferred``: the optimizer skips a non-finite step
    itself (:func:`deferred_steps`); else ``check(record)`` runs before the step (it reads the
    norm on the host and raises on a non-finite one)."""
    n_tok = sum(samples[i].trained_count() for i in mb)
    if getattr(model, "_fedagent_forward", None) is not None:
        # train.compile_train: CUDA-graph trees hand the backward's gradients out of their memory
        # pool, and a parameter's first gradient of a step would be kept as its .grad, then overwritten
        # by the next micro-batch's replay (the suspected cause of "accessing tensor output of
        # CUDAGraphs that has been overwritten" at micro 32 of 64 on the GPU). With every
        # .grad allocated and zeroed in place, each micro-batch's gradient is added into it at once.
        # Not yet measured on the GPU: the config still refuses compile_train with micro-batches.
        for q in params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        optimizer.zero_grad(set_to_none=False)
    else:
        optimizer.zero_grad(set_to_none=True)
    stats = []
    for micro in micro_batches.split(mb, samples, p.micro_batch_size, micro_batch_tokens(p)):
        batch = [samples[i] for i in micro]
        with autocast(model):
            logp, ent = logprobs(model, batch, p.temperature, p.micro_batch_size, with_entropy=True)
        idx = token_index(slices, micro, logp.device)
        terms, st = grpo.grpo_token_terms(
            logp,
            old[idx],
            ref[idx] if ref is not None else None,
            token_adv[idx],
            clip=p.clip,
            kl_coef=p.kl_coef,
            entropy_coef=p.entropy_coef,
            entropy=ent if p.entropy_coef else ent.detach(),
            clip_ratio_c=p.clip_ratio_c,
        )
        # Sum over tokens / mini-batch token count = token-mean over the whole mini-batch.
        loss = terms.sum() / n_tok
        loss.backward()
        stats.append(
            torch.stack([loss.detach(), st["pg"].sum(), st["kl"].sum(), st["entropy"].sum(), st["clipped"].sum()])
        )
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


def grpo_epoch(
    model,
    ref_model,
    optimizer,
    samples,
    p,
    shuffle_rng,
    epoch: int,
    ref_is_policy: bool = False,
    prox_anchor: dict | None = None,
    token_adv: torch.Tensor | None = None,
    after_step=None,
) -> list[dict]:
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
    model.eval()  # no dropout in Llama; eval() keeps sampling and scoring numerics identical
    amp = autocast(model)
    with amp:
        old = logprobs_nograd(model, samples, p.micro_batch_size, p.temperature, micro_batch_tokens(p))
    if ref_model is None:
        ref = None
    elif ref_is_policy:
        ref = old
    else:
        # A reference with ``scoring()`` is the policy itself under a switch (LoRA: adapters off,
        # fedagent.model.lora.AdaptersOff): scored with the switch on, no second model.
        scoring = getattr(ref_model, "scoring", None)
        with scoring() if scoring is not None else contextlib.nullcontext(ref_model) as ref_net, autocast(model):
            ref = logprobs_nograd(ref_net, samples, p.micro_batch_size, p.temperature, micro_batch_tokens(p))
    # Per trained token, its index in the flat (sample-order) behaviour/reference/advantage
    # tensors: a micro-batch gathers its rows with one index instead of a cat of many slices.
    slices = token_slices(samples)
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
    for mb in chunks(order, p.mini_batch_size):
        record = update_step(
            model,
            optimizer,
            samples,
            mb,
            old,
            ref,
            token_adv,
            slices,
            p,
            params,
            prox_anchor,
            deferred,
            check=lambda r: record_steps([r], steps, epoch),
        )
        if deferred:
            pending.append(record)
        if after_step is not None:
            record_steps(pending, steps, epoch)
            steps[-1].update(after_step(mb))
    record_steps(pending, steps, epoch)
    return steps
