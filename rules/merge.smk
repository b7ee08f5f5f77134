# Server step: previous global model + aggregate → next global model (and server state).
# One rule per disk policy of the output (keep.models_every / keep.protect_models): output
# flags are per rule, so the round wildcard decides which of the three builds a model.


rule merge:
    priority: ROUND_RECORD_PRIORITY   # workflow/common.smk
    input:
        prev=lambda w: model_dir(int(w.round) - 1),
        aggregate=f"{RUN}/round_{{round}}/aggregate",
    output:
        directory(f"{RUN}/round_{{round}}/model"),
    wildcard_constraints:
        round=rounds_regex(PLAIN_MODEL_ROUNDS),
    params:
        server=SERVER_FLAGS,
        # The server optimizer's state lives in the previous global model dir (none before round 1).
        prev_state=lambda w: "none" if int(w.round) == 1 else model_dir(int(w.round) - 1),
        quarantine=QUARANTINE,
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/round_{{round}}/merge.log",
    benchmark:
        f"{RUN}/benchmarks/round_{{round}}/merge.tsv"
    shell:
        "fedagent merge --prev {input.prev} --aggregate {input.aggregate} --prev-server-state {params.prev_state}"
        " {params.server}"
        " --round {wildcards.round} --out {output} --quarantine {params.quarantine} > {log} 2>&1"


use rule merge as merge_protected with:
    output:
        protected(directory(f"{RUN}/round_{{round}}/model")),
    wildcard_constraints:
        round=rounds_regex(PROTECTED_MODEL_ROUNDS),


use rule merge as merge_temporary with:
    output:
        temp(directory(f"{RUN}/round_{{round}}/model")),
    wildcard_constraints:
        round=other_rounds_regex(KEPT_MODEL_ROUNDS),
