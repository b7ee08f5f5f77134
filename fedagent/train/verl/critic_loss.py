"""The critic loss of a verl PPO job: the reference's ``legacy_exact``, as the local backend trains it.

verl 0.9.1's v1 trainer hands its critic workers ``partial(value_loss, config=critic_cfg)``
(``verl.trainer.ppo.v1.trainer_base.value_loss``, from ``verl.workers.utils.losses``):
``0.5 ×`` the clipped value loss averaged over every response token of the *global* mini-batch.
The local backend (``fedagent.train.ppo.critic_step``) and the reference (FACTS §5, invariant 14)
train ``legacy_exact``: each micro-batch's token mean ÷ the number of micro-batches, coefficient 1.
The two differ by the factor 0.5 always and, when micro-batches hold different token counts, in
how tokens are weighted — one config would train two critics.

:func:`legacy_exact_loss` is the arithmetic (pure torch: a micro-batch's share is its rows ÷ the
rank's mini-batch rows, i.e. ÷ the number of equal micro-batches verl cuts without dynamic
batching); :func:`value_loss` is a drop-in for verl's, armed in the trainer's Ray worker by
:func:`arm` (called from :mod:`fedagent.train.verl.ray_hook` when ``CRITIC_LOSS_ENV`` is
``legacy_exact``). Arming prints :data:`ARMED_LINE`; the backend refuses a PPO job whose log lacks
it (fail closed: an unarmed job would have trained verl's own critic loss).
"""

from __future__ import annotations

CRITIC_LOSS_ENV = "FEDAGENT_VERL_CRITIC_LOSS"
LEGACY_EXACT = "legacy_exact"
TARGET_MODULE = "verl.trainer.ppo.v1.trainer_base"
ARMED_LINE = f"fedagent: critic loss {LEGACY_EXACT} armed in {TARGET_MODULE}"


def legacy_exact_loss(
    vpreds, values, returns, mask, cliprange_value: float, micro_rows: int, dp_size: int, global_batch_size: int
):
    """``(loss, clipfrac)`` of one micro-batch: its masked token mean × micro_rows · dp_size / global rows.

    ``global_batch_size`` is the mini-batch's rows over all ranks, so ``global_batch_size / dp_size /
    micro_rows`` is the rank's number of micro-batches: the local backend's ``terms.mean() / n_micro``.
    """
    import torch

    from fedagent.train.ppo import value_loss_terms

    mask = mask.to(torch.bool)
    terms, clipped = value_loss_terms(vpreds, values, returns, float(cliprange_value))
    n = mask.sum().clamp(min=1)
    mean = (terms * mask).sum() / n
    clipfrac = (clipped * mask).sum() / n
    return mean * (float(micro_rows) * float(dp_size) / float(global_batch_size)), clipfrac


def value_loss(config, model_output, data, dp_group=None):
    """verl's ``value_loss(config, model_output, data, dp_group)`` with :func:`legacy_exact_loss` inside."""
    from verl.utils.metric import AggregationType, Metric
    from verl.utils.torch_functional import masked_mean
    from verl.workers.utils.padding import no_padding_2_padding

    vpreds = no_padding_2_padding(model_output["values"], data)  # (rows, response_length)
    dp_size, global_batch_size = data["dp_size"], data["global_batch_size"]
    if global_batch_size is None:
        raise RuntimeError("legacy_exact critic loss: verl gave no global_batch_size for the mini-batch")
    padded = data.select("values", "returns", "response_mask").to_padded_tensor()
    mask = padded["response_mask"].to(bool)
    loss, clipfrac = legacy_exact_loss(
        vpreds,
        padded["values"],
        padded["returns"],
        mask,
        config.cliprange_value,
        micro_rows=vpreds.shape[0],
        dp_size=dp_size,
        global_batch_size=global_batch_size,
    )
    metrics = {
        "critic/vf_loss": Metric(value=loss, aggregation=AggregationType.SUM),  # Σ micro = the mini-batch's loss
        "critic/vf_clipfrac": clipfrac.detach().item(),
        "critic/vpred_mean": masked_mean(vpreds, mask).detach().item(),
    }
    return loss, metrics


def _patch(module) -> None:
    if not callable(getattr(module, "value_loss", None)):
        raise RuntimeError(f"{TARGET_MODULE} has no value_loss: cannot arm the {LEGACY_EXACT} critic loss")
    module.value_loss = value_loss
    print(ARMED_LINE, flush=True)


def arm(mode: str) -> None:
    """Make ``verl.trainer.ppo.v1.trainer_base.value_loss`` ours in this process (now or on import)."""
    if mode != LEGACY_EXACT:
        raise RuntimeError(f"{CRITIC_LOSS_ENV}={mode!r}: only {LEGACY_EXACT!r} is known")
    from fedagent.train.verl.post_import import patch_on_import

    patch_on_import(TARGET_MODULE, _patch, f"arm the {LEGACY_EXACT} critic loss")
