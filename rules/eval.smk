# Score a global model (round 0: the base model) on the fixed validation set.


rule eval:
    priority: ROUND_RECORD_PRIORITY   # workflow/common.smk
    input:
        model=lambda w: model_dir(w.round),
        games=GAMES,
        val_set=VAL_SET,
    output:
        eval=report(f"{RUN}/round_{{round}}/eval.json", category="Evaluation", caption="../workflow/report/eval.rst",
                    labels={"round": "{round}"}),
        # Phase timings (wall clock) beside eval.json, which stays byte-identical across re-runs.
        timings=f"{RUN}/round_{{round}}/eval_timings.json",
    wildcard_constraints:
        round=r"(?!000)\d{3}" if START else r"\d{3}",   # `start`: round 0's eval is copied (rules/start.smk)
    params:
        # warm_start.enabled: round 0's eval.json is labelled as the warm start's (inside the params, so
        # the shell command and every other run's params stay as they were)
        eval=lambda w: EVAL_PARAMS_WARM_START if WARM_START and int(w.round) == 0 else EVAL_PARAMS,
    threads: config["eval"]["threads"]
    resources:
        # as train_client's (eval.device cuda or eval.backend vllm: 1 GPU; eval.gpu_mem_gb or the estimate)
        gpu=JOB_RESOURCES["eval"]["gpu"],
        gpu_mem_mb=JOB_RESOURCES["eval"]["gpu_mem_mb"],
        mem_mb=JOB_RESOURCES["eval"]["mem_mb"],
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/round_{{round}}/eval.log",
    benchmark:
        f"{RUN}/benchmarks/round_{{round}}/eval.tsv"
    shell:
        "FEDAGENT_JOB_GPUS={resources.gpu} FEDAGENT_JOB_GPU_MEM_MB={resources.gpu_mem_mb}"
        " fedagent eval --model {input.model} --games {input.games} --val-set {input.val_set}"
        " --params '{params.eval}' --round {wildcards.round} --threads {threads}"
        " --out {output.eval} --timings {output.timings} > {log} 2>&1"


# eval.clients: every client update scored on the same fixed validation set, as its own job.
rule eval_client:
    priority: ROUND_RECORD_PRIORITY   # workflow/common.smk
    input:
        model=f"{RUN}/round_{{round}}/clients/{{client}}",
        games=GAMES,
        val_set=VAL_SET,
    output:
        f"{RUN}/round_{{round}}/client_evals/{{client}}.json",
    wildcard_constraints:
        round=r"(?!000)\d{3}",
    params:
        eval=EVAL_PARAMS,
    threads: config["eval"]["threads"]
    resources:
        gpu=JOB_RESOURCES["eval_client"]["gpu"],
        gpu_mem_mb=JOB_RESOURCES["eval_client"]["gpu_mem_mb"],
        mem_mb=JOB_RESOURCES["eval_client"]["mem_mb"],
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/round_{{round}}/eval_client_{{client}}.log",
    shell:
        "FEDAGENT_JOB_GPUS={resources.gpu} FEDAGENT_JOB_GPU_MEM_MB={resources.gpu_mem_mb}"
        " fedagent eval --model {input.model} --games {input.games} --val-set {input.val_set}"
        " --params '{params.eval}' --round {wildcards.round} --client {wildcards.client}"
        " --threads {threads} --out {output} > {log} 2>&1"
