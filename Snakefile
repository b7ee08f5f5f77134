# fedagent: federated RL of LLM agents. Every round is a cached graph of file-producing jobs:
#   select → train_client ×M → aggregate → merge → eval      (round 0: base_model [→ warm_start] → eval)
# Rules are wiring only; all logic lives in the `fedagent` package (called through its CLI).

configfile: "config/config.yaml"


include: "workflow/common.smk"
include: "rules/plan.smk"
include: "rules/warm_start.smk"
include: "rules/webshop.smk"
include: "rules/train.smk"
include: "rules/aggregate.smk"
include: "rules/merge.smk"
include: "rules/eval.smk"
include: "rules/report.smk"


# Bookkeeping that needs no compute node (each well under a second, no model): on a cluster
# executor these run on the submitting host instead of as a job each (profiles/slurm,
# docs/operations.md). The local executor runs every job on this host anyway: no change there.
localrules: all, select, partition, val_set, report


# Every round's report is a target, so a smaller `rounds` finds all its targets present.
rule all:
    input:
        [f"{round_dir(r)}/summary.csv" for r in ROUNDS],
        [f"{round_dir(r)}/curves.png" for r in ROUNDS],
    default_target: True
