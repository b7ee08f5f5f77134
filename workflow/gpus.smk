# This machine's GPUs, read once when the workflow is parsed (before workflow/common.smk, whose job
# resources take a vLLM share of one card), and the check of the run's GPU asks against them that the
# Snakefile's onstart runs before the first job. Included by the Snakefile for runs and matrices alike.

import sys

from fedagent.core import placement as _placement

# The GPUs of this machine (fedagent.core.placement: nvidia-smi, or FEDAGENT_GPUS=index:MiB,... by hand,
# through CUDA_VISIBLE_DEVICES) give the scheduler's total `gpu_mem_mb` (their memory less
# placement.RESERVE_MIB each, for the driver and processes outside the run), unless the command line or a
# profile names it. No `gpu` total: jobs that fit share a card, and a count of cards would run one GPU job
# per card at a time (`--resources gpu=N` of your own still caps them). No card: nothing registered (a
# CPU run needs none). Only where this Snakemake runs the jobs itself: not a cluster executor's submitting host.
GPU_CARDS = []
if workflow.is_main_process and workflow.local_exec:
    try:
        GPU_CARDS = _placement.node_cards()
    except _placement.PlacementError as _err:
        print(f"fedagent: {_err}", file=sys.stderr)
        sys.exit(1)
    if GPU_CARDS:
        for _name, _value in _placement.capacity(GPU_CARDS).items():
            if workflow.global_resources.get(_name).value is None:
                workflow.register_resource(_name, _value)


def gpu_problems():
    """Why the run's GPU jobs cannot run on this machine's cards (checked before the first job): no card
    at all, more GPUs per job than cards, a job's declared memory larger than the largest card."""
    if "JOB_RESOURCES" not in globals() or not (workflow.is_main_process and workflow.local_exec):
        return None  # a matrix (each run its own config) or a cluster executor: the jobs' own hosts decide
    from fedagent.model.job_resources import gpu_fit_problem, planned_rules

    # only the rules this run plans: a warm start it never runs must not refuse it
    why = gpu_fit_problem(config, {rule: JOB_RESOURCES[rule] for rule in planned_rules(config)}, GPU_CARDS)
    if why is not None:
        return (
            f"{why} (cards from {_placement.source()}); a GPU run needs its cards visible here: "
            f"nvidia-smi, or {_placement.GPUS_ENV}=index:MiB,... (docs/how-to/gpus.md)"
        )
    return None
