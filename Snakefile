# fedagent: federated RL of LLM agents. Every round is a cached graph of file-producing jobs:
#   select → train_client ×M → aggregate → merge → eval      (round 0: base_model → eval)
# Rules are wiring only; all logic lives in the `fedagent` package (called through its CLI).

configfile: "config/config.yaml"


include: "workflow/common.smk"
include: "rules/plan.smk"
include: "rules/train.smk"
include: "rules/aggregate.smk"
include: "rules/merge.smk"
include: "rules/eval.smk"
include: "rules/report.smk"


rule all:
    input:
        f"{round_dir(config['rounds'])}/summary.csv",
        f"{round_dir(config['rounds'])}/curves.png",
    default_target: True
