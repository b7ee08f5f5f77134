# Expert warm start (warm_start.enabled): the base model moves to round_000/base/ and is scored
# there; the demo pool is set aside from the train catalogue; round 0's model is the base model
# fine-tuned on the expert's demonstrations (fedagent.train.warm_start).


# The demo pool is plan/ (data_seed): every run sets it aside from its shards, `start` or not.
rule demo_pool:
    input:
        GAMES,
    output:
        DEMO_POOL,
    params:
        n=config["warm_start"]["demos"],
        seed=DATA_SEED,
        clients=config["clients"]["total"],
        min_tasks=config["partition"]["min_tasks_per_client"],
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/demo_pool.log",
    shell:
        "fedagent demo-pool --games {input} --n {params.n} --seed {params.seed} --clients {params.clients}"
        " --min-tasks {params.min_tasks} --out {output} > {log} 2>&1"


# (not with `start`: round 0 is then copied from the start run, rules/start.smk)
if not START:

    rule warm_start:
        input:
            model=BASE_DIR,
            games=GAMES,
            demo_pool=DEMO_POOL,
        output:
            protected(directory(model_dir(0))) if config["keep"]["protect_models"] else directory(model_dir(0)),
        params:
            params=WARM_START_PARAMS,
            quarantine=QUARANTINE,
        threads: config["train"]["threads"]
        resources:
            # the local backend's train job on train.device (it samples nothing), whatever train.backend is
            gpu=JOB_RESOURCES["warm_start"]["gpu"],
            gpu_mem_mb=JOB_RESOURCES["warm_start"]["gpu_mem_mb"],
            mem_mb=JOB_RESOURCES["warm_start"]["mem_mb"],
        conda:
            "../envs/fedagent.yaml"
        log:
            f"{RUN}/logs/warm_start.log",
        benchmark:
            f"{RUN}/benchmarks/warm_start.tsv"
        shell:
            "FEDAGENT_JOB_GPUS={resources.gpu} FEDAGENT_JOB_GPU_MEM_MB={resources.gpu_mem_mb}"
            " fedagent warm-start --model {input.model} --games {input.games} --demo-pool {input.demo_pool}"
            " --params '{params.params}' --threads {threads} --out {output} --quarantine {params.quarantine}"
            " > {log} 2>&1"


    # The base model's score, kept beside the warm start's (round 0's eval.json).
    rule eval_base:
        input:
            model=BASE_DIR,
            games=GAMES,
            val_set=VAL_SET,
        output:
            eval=f"{RUN}/round_000/base_eval.json",
            timings=f"{RUN}/round_000/base_eval_timings.json",
        params:
            eval=EVAL_PARAMS_BASE,
        threads: config["eval"]["threads"]
        resources:
            gpu=JOB_RESOURCES["eval_base"]["gpu"],
            gpu_mem_mb=JOB_RESOURCES["eval_base"]["gpu_mem_mb"],
            mem_mb=JOB_RESOURCES["eval_base"]["mem_mb"],
        conda:
            "../envs/fedagent.yaml"
        log:
            f"{RUN}/logs/round_000/base_eval.log",
        benchmark:
            f"{RUN}/benchmarks/round_000/base_eval.tsv"
        shell:
            "FEDAGENT_JOB_GPUS={resources.gpu} FEDAGENT_JOB_GPU_MEM_MB={resources.gpu_mem_mb}"
            " fedagent eval --model {input.model} --games {input.games} --val-set {input.val_set}"
            " --params '{params.eval}' --round 000 --threads {threads}"
            " --out {output.eval} --timings {output.timings} > {log} 2>&1"
