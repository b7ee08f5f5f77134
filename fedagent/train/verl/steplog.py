"""verl's console log of one job, read back: its step lines as records and phase totals.

verl 0.9.1's console logger prints one ``step:N - key:value - ...`` line per training step with its
own metrics (the actor's loss terms, KL, entropy, clip fraction, rewards, the critic's value loss) and
phase timings (``timing_s/*``). The verl backend keeps them per job in ``metrics.json``: the raw lines
as ``verl_steps``, the local backend's names as ``steps`` (never a constant where verl logged nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


# verl's per-step timings (``timing_s/*``) that make our ``train`` phase; ``gen`` is ``rollout``.
TRAIN_TIMINGS = (
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
)


# verl's per-step metric names (verl 0.9.1's console logger: the actor's loss terms renamed under
# "actor/", the trainer's reward statistics under "critic/") → the local backend's step-record names.
STEP_METRICS = {
    "actor/pg_loss": "pg",
    "actor/kl_loss": "kl",
    "actor/entropy": "entropy",
    "actor/pg_clipfrac": "clipfrac",
    "actor/grad_norm": "grad_norm",
    "critic/rewards/mean": "reward_mean",
    "critic/score/mean": "score_mean",
    "critic/vf_loss": "vf_loss",
}


def marked(log_text: str, prefix: str) -> list[str]:
    """What follows ``prefix`` on every line that contains it, stripped, in order (Ray prefixes worker
    lines, so the prefix may sit anywhere in a line): the paths our armed/loaded/reset lines name."""
    out = []
    for line in log_text.splitlines():
        i = line.find(prefix)
        if i >= 0:
            out.append(line[i + len(prefix) :].strip())
    return out


def step_records(steps: Sequence[dict]) -> list[dict]:
    """verl's logged steps as the local backend's step records (``metrics.json``'s ``steps``): each
    step's number and the :data:`STEP_METRICS` verl logged for it (absent ones left out, never 0)."""
    return [
        {"step": int(s["step"]), **{ours: float(s[theirs]) for theirs, ours in STEP_METRICS.items() if theirs in s}}
        for s in steps
        if "step" in s
    ]


def mean_of(records: Sequence[dict], key: str):
    """The mean of ``key`` over the records that have it; None when none has (verl did not log it)."""
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else None


def phase_totals(steps: Sequence[dict]) -> dict:
    """Rollout and training seconds summed over verl's logged steps (the local backend's phase names)."""
    return {
        "rollout": sum(float(s.get("timing_s/gen", 0.0)) for s in steps),
        "train": sum(float(s.get(k, 0.0)) for s in steps for k in TRAIN_TIMINGS),
    }


def step_metrics(log: Path) -> list[dict]:
    """verl's console logger lines (``step:N - key:value - ...``) as dicts, in order.

    They carry verl's own phase timings (``timing_s/gen``, ``timing_s/update_actor``, …) and
    throughput (``perf/throughput``), which ``metrics.json`` keeps per job.
    """
    try:
        text = Path(log).read_text(errors="replace")
    except FileNotFoundError:
        return []
    return step_metrics_in(text)


def step_metrics_in(text: str) -> list[dict]:
    """:func:`step_metrics` of a log's text (e.g. the part after a warm refit began)."""
    out = []
    for line in text.splitlines():
        i = line.find("step:")
        if i < 0 or " - " not in line[i:]:
            continue
        rec = {}
        for part in line[i:].split(" - "):
            key, sep, val = part.partition(":")
            if not sep:
                continue
            try:
                rec[key.strip()] = float(val) if key.strip() != "step" else int(val)
            except ValueError:
                continue
        if "step" in rec and len(rec) > 1:
            out.append(rec)
    return out
