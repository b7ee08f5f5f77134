"""``fedagent gpu-mem``: what a run's GPU jobs declare as ``gpu_mem_mb``, term by term, and what fits.

    fedagent gpu-mem [--configfile F ...] [--set KEY=VALUE ...] [--card-mib MIB] [--train-jobs N]

The config is layered as ``fedagent config show`` (and Snakemake) layers it; the estimate is the
one the workflow declares (:func:`fedagent.model.memory.job_gpu_mib`). It prints each GPU job's
terms, the sum of ``--train-jobs`` train jobs (default ``clients.per_round``: a round's clients) and
one eval against this machine's cards (:func:`fedagent.core.placement.node_cards`: nvidia-smi or
``FEDAGENT_GPUS``, their usable memory summed, each job also within the largest card; or
``--card-mib``, which it asks for when no card is found), and, with the other knobs
as they are, the largest ``train.micro_batch_size`` and ``env.pool_size`` (a multiple of
``train.group_size``) for which that sum still fits: how to size a run for a model (e.g.
``model: random:smollm2-1.7b``, docs/how-to/scale.md) before it reaches the card. Exit 1 when the
configured run does not fit.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

from fedagent.core import placement
from fedagent.core.config import ConfigError
from fedagent.model import memory, verl_memory


def round_mib(config: dict, train_jobs: int, card_mib: int | None = None) -> tuple[int, int, int]:
    """(train job, eval job, ``train_jobs`` train jobs + one eval) in MiB (``card_mib``: one card, which a
    verl job's memory plan shares out)."""
    t, e = memory.job_gpu_mib(config, "train", card_mib), memory.job_gpu_mib(config, "eval", card_mib)
    return t, e, train_jobs * t + e


def largest_fitting(config: dict, key: str, candidates, card_mib: int, train_jobs: int) -> int | None:
    """The largest value of ``key`` ("train.micro_batch_size" or "env.pool_size") among ``candidates``
    for which ``train_jobs`` train jobs and an eval fit ``card_mib`` (None: none does)."""
    best = None
    section, name = key.split(".")
    for value in candidates:
        trial = copy.deepcopy(config)
        trial[section][name] = value
        if round_mib(trial, train_jobs)[2] <= card_mib:
            best = value
    return best


def report(config: dict, card_mib: int, train_jobs: int | None = None, cards=None) -> tuple[str, bool]:
    """The text ``fedagent gpu-mem`` prints, and whether the configured run fits (``card_mib`` in all;
    ``cards``: this machine's, on which the round's jobs must also be placed at once)."""
    train_jobs = config["clients"]["per_round"] if train_jobs is None else int(train_jobs)
    card = max(c.usable_mib() for c in cards) if cards else card_mib  # one card: what a verl job's plan shares
    t, e, total = round_mib(config, train_jobs, card)
    shape = memory.shape_of_source(config["model"]) if (t or e) else None
    lines = [f"model {config['model']}" + (f": {memory.param_count(shape):,} parameters" if shape else "")]
    tr, ev = config["train"], config["eval"]
    if t and tr["backend"] == "local" and tr.get("gpu_mem_gb") is None:
        terms = memory.train_config_terms(config, shape)
        lines.append(f"train_client {t:>7} MiB = {memory.MARGIN} x (" + _terms(terms) + ") + fixed")
    elif t and tr["backend"] == "verl":
        eval_mib = memory.job_gpu_mib(config, "eval", card)
        verl_plan = verl_memory.config_plan(config, card, eval_mib)
        lines.append(f"train_client {t:>7} MiB = verl memory plan on one {card} MiB card: {_plan(verl_plan)}")
        train_jobs = min(train_jobs, max(1, card // t))  # the plan's declaration admits no more at once
        total = train_jobs * t + e
        if total > card_mib and train_jobs * t <= card_mib and e <= card:
            # the plan was sized for the eval to wait while these train: both fit, one after the other
            lines.append(f"{train_jobs} train ({train_jobs * t} MiB), the eval ({e} MiB) when one ends: fits")
            return "\n".join(lines) + "\n", True
    else:
        lines.append(f"train_client {t:>7} MiB" + ("" if t else " (CPU)"))
    if e and ev["backend"] == "local" and ev.get("gpu_mem_gb") is None:
        terms = memory.eval_terms(
            shape,
            batch=min(ev["batch"], config["env"]["pool_size"]),
            max_prompt_tokens=ev["max_prompt_tokens"],
            max_new_tokens=ev["max_new_tokens"],
        )
        lines.append(f"eval         {e:>7} MiB = {memory.MARGIN} x (" + _terms(terms) + ") + fixed")
    else:
        lines.append(f"eval         {e:>7} MiB" + ("" if e else " (CPU)"))
    fits = total <= card_mib
    if fits and cards and len(cards) > 1 and not placement.packs(cards, [t] * train_jobs + [e]):
        fits = False
        lines.append(f"the sum fits but {train_jobs} train + 1 eval cannot be placed on the cards at once:")
    elif cards and max(t, e) > max(c.usable_mib() for c in cards):
        fits = False
        lines.append(f"a job of {max(t, e)} MiB is larger than the largest card:")
    lines.append(f"{train_jobs} train + 1 eval = {total} MiB of {card_mib}: " + ("fits" if fits else "DOES NOT FIT"))
    if t and tr["backend"] == "local" and tr.get("gpu_mem_gb") is None:
        micro = largest_fitting(
            config, "train.micro_batch_size", range(1, tr["mini_batch_size"] + 1), card_mib, train_jobs
        )
        group = tr["group_size"]
        pool = largest_fitting(config, "env.pool_size", range(group, 257, group), card_mib, train_jobs)
        lines.append(
            f"largest train.micro_batch_size that fits (up to mini_batch_size {tr['mini_batch_size']}): {micro}"
        )
        lines.append(f"largest env.pool_size that fits (multiples of group_size {group}, up to 256): {pool}")
    return "\n".join(lines) + "\n", fits


def _plan(p) -> str:
    """A verl memory plan in one line: its choices, each phase's peak and what an idle engine set keeps."""
    s = p.summary()
    kv = f"{s['kv_cache_bytes'] / memory.GIB:.1f} GiB" if s["kv_cache_bytes"] else "vLLM's own"
    return (
        f"param_offload {s['param_offload']}, optimizer_offload {s['optimizer_offload']}, gradient_checkpointing "
        f"{s['gradient_checkpointing']}, micro-batch {s['micro_batch_size']}, KV cache {kv}"
        + (f" ({s['kv_rows']} rows)" if s["kv_rows"] else "")
        + "; phases "
        + ", ".join(f"{k} {v:.1f}" for k, v in s["phases_gib"].items())
        + f" GiB before margin; idle set {s['idle_mib']} MiB"
    )


def _terms(terms: dict) -> str:
    return ", ".join(f"{k} {v / memory.GIB:.2f}" for k, v in terms.items() if v) + " GiB"


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent gpu-mem``."""
    parser.add_argument(
        "--configfile",
        type=Path,
        action="append",
        default=[],
        metavar="F",
        help="a config file layered over the workflow's (as snakemake --configfile); repeatable",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a command-line value (as snakemake --config; dotted keys too)",
    )
    parser.add_argument(
        "--base",
        type=Path,
        default=None,
        help="the workflow's own config file (default: ./config/config.yaml if present); 'none'",
    )
    parser.add_argument(
        "--card-mib",
        type=int,
        default=None,
        help="the cap of all GPU jobs' gpu_mem_mb, MiB (default: the usable memory of this machine's "
        "cards, from nvidia-smi or FEDAGENT_GPUS=index:MiB,..., as the Snakefile registers it)",
    )
    parser.add_argument(
        "--train-jobs", type=int, default=None, help="train jobs running beside one eval (default: clients.per_round)"
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent gpu-mem``."""
    from fedagent.report.config_show import effective_config, resolve_base

    cards, head = None, ""
    if args.card_mib is None:
        try:
            cards = placement.node_cards()
        except placement.PlacementError as err:
            print(f"fedagent: {err}", file=sys.stderr)
            return 2
        if not cards:
            print(
                f"fedagent: no GPU found ({placement.source()}): give the card's memory with --card-mib MIB "
                f"(e.g. 138000 for a 141 GB card less the driver's share) or {placement.GPUS_ENV}=index:MiB,...",
                file=sys.stderr,
            )
            return 2
        args.card_mib = placement.capacity(cards)["gpu_mem_mb"]
        head = "cards: " + ", ".join(c.describe() for c in cards) + "\n"
    try:
        config, _source = effective_config(resolve_base(args.base), args.configfile, args.set)
        text, fits = report(config, args.card_mib, args.train_jobs, cards)
        text = head + text
    except (ConfigError, ValueError) as exc:
        print(f"fedagent: invalid config: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0 if fits else 1
