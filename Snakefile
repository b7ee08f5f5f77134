# fedagent: federated RL of LLM agents. Every round is a cached graph of file-producing jobs:
#   select → train_client ×M → aggregate → merge → eval      (round 0: base_model [→ warm_start] → eval)
# Rules are wiring only; all logic lives in the `fedagent` package (called through its CLI).
# `--config matrix=<name>`: every arm × seed of config/matrices/<name>.yaml, each this same round graph
# loaded as a Snakemake module with its own config (workflow/matrix.smk), plus the matrix's table.

configfile: "config/config.yaml"


import sys

from fedagent.core import placement as _placement

# The GPUs of this machine (fedagent.core.placement: nvidia-smi, or FEDAGENT_GPUS=index:MiB,... by hand,
# through CUDA_VISIBLE_DEVICES) give the scheduler's totals: `gpu` (cards) and `gpu_mem_mb` (their memory
# less placement.RESERVE_MIB each, for the driver and processes outside the run), unless the command line
# or a profile names them (`--resources gpu_mem_mb=N gpu=N` wins). No card: nothing registered (a CPU run
# needs none). Only where this Snakemake runs the jobs itself: not a cluster executor's submitting host.
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
    from fedagent.model.job_resources import gpu_fit_problem

    why = gpu_fit_problem(config, JOB_RESOURCES, GPU_CARDS)
    if why is not None:
        return (
            f"{why} (cards from {_placement.source()}); a GPU run needs its cards visible here: "
            f"nvidia-smi, or {_placement.GPUS_ENV}=index:MiB,... (docs/how-to/gpus.md)"
        )
    return None


# Before the first job (not for -n, not when there is nothing to do): do the run's model dirs fit the disk?
# And do its GPU jobs fit this machine's cards (gpu_problems)?
onstart:
    from fedagent.report import disk_need

    _short = gpu_problems() or disk_need.check_registered()
    if _short:
        print(f"fedagent: {_short}", file=sys.stderr)
        sys.exit(1)


# train.verl.engines: run — the run's verl engine sets outlive their jobs (train.verl.engines_idle_s);
# when Snakemake ends, the free ones stop (this run's; a matrix's: every run of the matrix).
onsuccess:
    from fedagent.train.verl.engines.stop import stop_sets_under

    stop_sets_under(globals()["MATRIX"].out_dir if "MATRIX" in globals() else globals()["RUN"])


onerror:
    from fedagent.train.verl.engines.stop import stop_sets_under

    stop_sets_under(globals()["MATRIX"].out_dir if "MATRIX" in globals() else globals()["RUN"])


if config.get("matrix"):

    include: "workflow/matrix.smk"

    # The matrix's table and picture (which need every run's last round).
    rule matrix:
        localrule: True
        input:
            MATRIX_TARGETS,
        default_target: True

else:

    include: "workflow/common.smk"
    include: "rules/plan.smk"
    include: "rules/warm_start.smk"
    include: "rules/start.smk"
    include: "rules/train.smk"
    include: "rules/aggregate.smk"
    include: "rules/merge.smk"
    include: "rules/eval.smk"
    include: "rules/report.smk"

    # Bookkeeping rules that need no compute node (select, partition, val_set, report: each well under a
    # second, no model) say `localrule: True`: on a cluster executor they run on the submitting host
    # (profiles/slurm, docs/how-to/slurm.md); the local executor runs every job here anyway.
    # Every round's report is a target, so a smaller `rounds` finds all its targets present.
    rule all:
        localrule: True
        input:
            [f"{round_dir(r)}/summary.csv" for r in ROUNDS],
            [f"{round_dir(r)}/curves.png" for r in ROUNDS],
        default_target: True
