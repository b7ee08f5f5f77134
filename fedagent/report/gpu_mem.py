"""``fedagent gpu-mem``: what a run's GPU jobs declare as ``gpu_mem_mb``, term by term, and what fits.

    fedagent gpu-mem [--configfile F ...] [--set KEY=VALUE ...] [--card-mib 138000] [--train-jobs N]

The config is layered as ``fedagent config show`` (and Snakemake) layers it; the estimate is the
one the workflow declares (:func:`fedagent.model.memory.job_gpu_mib`). It prints each GPU job's
terms, the sum of ``--train-jobs`` train jobs (default ``clients.per_round``: a round's clients) and
one eval against the card (default ``profiles/local``'s cap, 138000 MiB), and, with the other knobs
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

from fedagent.core.config import ConfigError
from fedagent.model import memory

CARD_MIB = 138000  # profiles/local's gpu_mem_mb (a 141 GB card less ≈ 5.6 GiB)


def round_mib(config: dict, train_jobs: int) -> tuple[int, int, int]:
    """(train job, eval job, ``train_jobs`` train jobs + one eval) in MiB."""
    t, e = memory.job_gpu_mib(config, "train"), memory.job_gpu_mib(config, "eval")
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


def report(config: dict, card_mib: int = CARD_MIB, train_jobs: int | None = None) -> tuple[str, bool]:
    """The text ``fedagent gpu-mem`` prints, and whether the configured run fits."""
    train_jobs = config["clients"]["per_round"] if train_jobs is None else int(train_jobs)
    t, e, total = round_mib(config, train_jobs)
    shape = memory.shape_of_source(config["model"]) if (t or e) else None
    lines = [f"model {config['model']}" + (f": {memory.param_count(shape):,} parameters" if shape else "")]
    tr, ev = config["train"], config["eval"]
    if t and tr["backend"] == "local" and tr.get("gpu_mem_gb") is None:
        terms = memory.train_terms(
            shape,
            micro_batch_size=tr["micro_batch_size"],
            pool_size=config["env"]["pool_size"],
            max_prompt_tokens=tr["max_prompt_tokens"],
            max_new_tokens=tr["max_new_tokens"],
            response_tokens=tr["max_new_tokens"] * (tr["max_turns"] if config["rollout"]["mode"] == "concat" else 1),
            reference=bool(tr["kl_coef"]),
            ppo=tr["algorithm"] == "ppo",
            checkpointing=bool(tr.get("activation_checkpointing")),
        )
        lines.append(f"train_client {t:>7} MiB = {memory.MARGIN} x (" + _terms(terms) + ") + fixed")
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
        default=CARD_MIB,
        help=f"the cap of all GPU jobs' gpu_mem_mb (default {CARD_MIB}, profiles/local's)",
    )
    parser.add_argument(
        "--train-jobs", type=int, default=None, help="train jobs running beside one eval (default: clients.per_round)"
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent gpu-mem``."""
    from fedagent.report.config_show import effective_config, resolve_base

    try:
        config, _source = effective_config(resolve_base(args.base), args.configfile, args.set)
        text, fits = report(config, args.card_mib, args.train_jobs)
    except (ConfigError, ValueError) as exc:
        print(f"fedagent: invalid config: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0 if fits else 1
