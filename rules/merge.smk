# Server step: previous global model + aggregate → next global model (and server state).


rule merge:
    input:
        prev=lambda w: model_dir(int(w.round) - 1),
        aggregate=f"{RUN}/round_{{round}}/aggregate",
    output:
        directory(f"{RUN}/round_{{round}}/model"),
    wildcard_constraints:
        round=r"(?!000)\d{3}",
    params:
        server=config["server"],
        # The server optimizer's state lives in the previous global model dir (none before round 1).
        prev_state=lambda w: "none" if int(w.round) == 1 else model_dir(int(w.round) - 1),
        quarantine=QUARANTINE,
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/round_{{round}}/merge.log",
    shell:
        "fedagent merge --prev {input.prev} --aggregate {input.aggregate} --prev-server-state {params.prev_state}"
        " --server-opt {params.server[optimizer]} --server-lr {params.server[lr]}"
        " --momentum {params.server[momentum]} --beta1 {params.server[beta1]}"
        " --beta2 {params.server[beta2]} --tau {params.server[tau]}"
        " --round {wildcards.round} --out {output} --quarantine {params.quarantine} > {log} 2>&1"
