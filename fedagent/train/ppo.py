"""PPO (GAE) on windowed samples: values, GAE, whitening, the clipped value loss, the critic step.

FACTS §5 / verl's ``gae`` estimator, as the reference runs it in windowed mode: every per-turn
sample is one row whose response tokens are the only positions; its token-level reward is the
turn's (penalized) episode return on the last response token and 0 elsewhere; GAE runs
backwards over those tokens (``δ_t = r_t + γ V_{t+1} − V_t``, ``A_t = δ_t + γλ A_{t+1}``,
``V`` past the last token = 0), returns = A + V, then the advantages are whitened over every
response token of the epoch's batch (mean 0, unbiased variance 1). The actor step is GRPO's
(clipped ratio, k3 KL, entropy; :func:`fedagent.train.actor.grpo_epoch`) with these per-token
advantages; beside each actor step the critic takes one step on the same mini-batch:

    loss = Σ_micro mean_tokens(max((V − R)², (clip(V, V_old ± value_clip) − R)²)) / n_micro

— the reference's ``legacy_exact`` critic loss (per-micro token mean ÷ M, coefficient 1, no
0.5: invariant 14), its own AdamW (``train.ppo.critic_lr``) and grad clip. Reference defaults:
γ = λ = 1 (verl's, not overridden), value clip 0.5, critic lr 1e-5; n = 1 rollout per task with
one mini-batch per epoch (mini_batch_size = the epoch's samples).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from fedagent.train import actor, grpo

WHITEN_EPS = 1e-8  # verl's masked_whiten


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over one sample's response tokens: ``(advantages, returns)``, 1-D, same length.

    ``rewards[t]`` is token t's reward, ``values[t]`` the critic's value of the state before
    token t; the value after the last token is 0 (the row ends there).
    """
    adv = torch.zeros_like(values, dtype=torch.float32)
    next_value, last = 0.0, 0.0
    for t in range(values.shape[0] - 1, -1, -1):
        delta = float(rewards[t]) + gamma * next_value - float(values[t])
        last = delta + gamma * lam * last
        adv[t] = last
        next_value = float(values[t])
    return adv, adv + values.float()


def whiten(x: torch.Tensor) -> torch.Tensor:
    """``(x − mean) / sqrt(var + 1e-8)`` with the unbiased variance (verl's masked_whiten)."""
    if x.numel() < 2:
        return x - x.mean() if x.numel() else x
    return (x - x.mean()) * torch.rsqrt(x.var(unbiased=True) + WHITEN_EPS)


def token_rewards(sample: grpo.Sample) -> torch.Tensor:
    """The sample's reward on its last response token, 0 before (windowed: one row per turn)."""
    r = torch.zeros(len(sample.response_ids), dtype=torch.float32)
    r[-1] = float(sample.reward)
    return r


def advantages_and_returns(
    samples: Sequence[grpo.Sample], values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat per-token advantages (whitened over the batch) and returns, in sample order."""
    advs, rets, k = [], [], 0
    for s in samples:
        n = len(s.response_ids)
        a, r = gae(token_rewards(s), values[k : k + n].detach().float().cpu(), gamma, lam)
        advs.append(a)
        rets.append(r)
        k += n
    if not advs:
        return torch.zeros(0), torch.zeros(0)
    return whiten(torch.cat(advs)), torch.cat(rets)


def response_values(critic, samples: Sequence[grpo.Sample]) -> torch.Tensor:
    """The critic's value of the state before each response token (flat, sample order).

    Same rows and positions as :func:`fedagent.train.grpo.response_logprobs`: the hidden state
    at j−1 (which predicts token j) goes through the value head.
    """
    from fedagent.model.policy import _left_pad

    device = next(critic.parameters()).device
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    ids, mask, pos = _left_pad(seqs, pad_id=0)
    width = ids.shape[1]
    rows, cols = [], []
    for i, s in enumerate(samples):
        for j in range(width - len(s.response_ids), width):
            rows.append(i)
            cols.append(j - 1)
    if device.type != "cpu":
        ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
    backbone = getattr(critic, critic.base_model_prefix)
    hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
    h = hidden[torch.tensor(rows, device=device), torch.tensor(cols, device=device)]
    return critic.score(h).float().squeeze(-1)


def value_loss_terms(
    vpred: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss ``max((V − R)², (clip(V, V_old ± clip) − R)²)`` and whether
    the clipped branch was taken (verl's compute_value_loss, before aggregation, without 0.5)."""
    clipped = old_values + torch.clamp(vpred - old_values, -clip, clip)
    l1 = (vpred - returns) ** 2
    l2 = (clipped - returns) ** 2
    return torch.maximum(l1, l2), (l2 > l1).float()


def critic_step(
    critic,
    optimizer,
    samples: Sequence[grpo.Sample],
    mb: Sequence[int],
    old_values: torch.Tensor,
    returns: torch.Tensor,
    slices: Sequence[slice],
    *,
    micro: int,
    clip: float,
    grad_clip: float,
    autocast: Callable,
) -> dict:
    """One critic optimizer step on mini-batch ``mb`` (indices into ``samples``); returns its stats.

    legacy_exact: each micro-batch's token-mean loss ÷ the number of micro-batches.
    """
    micros = [mb[k : k + micro] for k in range(0, len(mb), micro)]
    optimizer.zero_grad(set_to_none=True)
    acc = {"vf_loss": 0.0, "vf_clipfrac": 0.0, "vpred": 0.0}
    n_tok = sum(slices[i].stop - slices[i].start for i in mb)
    for m in micros:
        batch = [samples[i] for i in m]
        with autocast():
            vpred = response_values(critic, batch)
        old_b = torch.cat([old_values[slices[i]] for i in m]).to(vpred.device)
        ret_b = torch.cat([returns[slices[i]] for i in m]).to(vpred.device)
        terms, clipped = value_loss_terms(vpred, old_b, ret_b, clip)
        loss = terms.mean() / len(micros)
        loss.backward()
        acc["vf_loss"] += float(loss.detach())
        acc["vf_clipfrac"] += float(clipped.sum()) / n_tok
        acc["vpred"] += float(vpred.detach().sum()) / n_tok
    params = [q for q in critic.parameters() if q.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if not math.isfinite(float(grad_norm)):
        raise FloatingPointError(f"non-finite critic gradient norm ({float(grad_norm)}) (loss {acc['vf_loss']:.6g})")
    optimizer.step()
    return {"critic_grad_norm": float(grad_norm), **{k: round(v, 8) for k, v in acc.items()}}


@torch.no_grad()
def values_nograd(critic, samples: Sequence[grpo.Sample], micro: int, autocast: Callable) -> torch.Tensor:
    """:func:`response_values` of every sample in micro-batches, without a graph (CPU, fp32)."""
    parts = []
    for k in range(0, len(samples), micro):
        with autocast():
            parts.append(response_values(critic, samples[k : k + micro]).float().cpu())
    return torch.cat(parts) if parts else torch.zeros(0)


def ppo_epoch(
    model,
    critic,
    ref_model,
    optimizer,
    critic_optimizer,
    samples,
    p,
    shuffle_rng,
    epoch: int,
    ref_is_policy: bool = False,
    prox_anchor: dict | None = None,
) -> tuple[list[dict], dict]:
    """One PPO epoch: critic values → GAE → the actor's epoch with a critic step per mini-batch.

    Returns ``(steps, stats)``: the per-step records (actor and critic fields) and the epoch's
    advantage/return/value statistics. ``prox_anchor`` (FedProx) reaches the actor's steps only:
    the critic is a separate model with its own optimizer.
    """
    critic.eval()
    amp = lambda: actor.autocast(critic)  # noqa: E731
    old_values = values_nograd(critic, samples, p.micro_batch_size, amp)
    adv, returns = advantages_and_returns(samples, old_values, p.gamma, p.lam)
    slices = actor.token_slices(samples)

    def after_actor_step(mb: Sequence[int]) -> dict:
        return critic_step(
            critic,
            critic_optimizer,
            samples,
            mb,
            old_values,
            returns,
            slices,
            micro=p.micro_batch_size,
            clip=p.value_clip,
            grad_clip=p.grad_clip,
            autocast=amp,
        )

    steps = actor.grpo_epoch(
        model,
        ref_model,
        optimizer,
        samples,
        p,
        shuffle_rng,
        epoch,
        ref_is_policy=ref_is_policy,
        prox_anchor=prox_anchor,
        token_adv=adv,
        after_step=after_actor_step,
    )
    n = max(1, old_values.numel())
    stats = {
        "values_mean": float(old_values.sum()) / n,
        "returns_mean": float(returns.sum()) / n,
        "tokens": int(old_values.numel()),
    }
    return steps, stats
