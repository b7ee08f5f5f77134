"""How a training pass cuts its samples into micro-batches: at most ``train.micro_batch_size`` rows, and, with
``train.micro_batch_tokens``, at most that many padded tokens (rows × the longest row's prompt + response).

Rows alone size every micro-batch for the longest row the config allows (``max_prompt_tokens + max_new_tokens``):
the memory estimate has to, and a pass over short rows then runs many small micro-batches, each paying the
host's fixed cost per forward and backward (at 1.7B with LoRA ≈ 0.32 s a micro-batch whatever its rows,
docs/results/lora.md). A token budget bounds what a micro-batch holds by what it costs: short rows fill one
micro-batch with many of them, long rows take fewer. verl's actor does the same (``use_dynamic_bsz`` with
``ppo_max_token_len_per_gpu``); its balanced repartition is not used here: the samples keep their order
(the epoch's seeded shuffle), so the cut depends on the samples alone, never on timing.

The update does not depend on the cut: the loss is a sum over the mini-batch's tokens divided by its token
count (:func:`fedagent.train.actor.update_step`), so gradients accumulate to the same sum up to
floating-point order. Written here because the partition is a few lines over our own ``Sample`` and
PyTorch has none for it.
"""

from __future__ import annotations

from typing import Sequence


def row_tokens(sample) -> int:
    """The tokens one training row holds: its prompt and its response."""
    return len(sample.prompt_ids) + len(sample.response_ids)


def split(indices: Sequence[int], samples: Sequence, rows: int, tokens: int | None = None) -> list[list[int]]:
    """``indices`` (into ``samples``) in order, cut into micro-batches of at most ``rows`` rows and, when
    ``tokens`` is set, at most ``tokens`` padded tokens each (a micro-batch is as wide as its longest row).
    A row longer than ``tokens`` alone is a micro-batch of its own (a row is never cut)."""
    if rows < 1 or (tokens is not None and tokens < 1):
        raise ValueError(f"micro-batches of {rows} rows / {tokens} tokens: both must be >= 1")
    out: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in indices:
        w = row_tokens(samples[i]) if tokens is not None else 0
        wider = max(width, w)
        if current and (len(current) >= rows or (tokens is not None and (len(current) + 1) * wider > tokens)):
            out.append(current)
            current, wider = [], w
        current.append(i)
        width = wider
    if current:
        out.append(current)
    return out
