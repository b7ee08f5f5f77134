# Plan: the task catalogue, the partition, the validation set, the base model, the selections.


rule games:
    output:
        directory(GAMES),
    params:
        seed=config["seed"],
        env=config["env"],
        quarantine=QUARANTINE,
    threads: 8   # tw-make processes; Snakemake caps it at --cores (2 on a laptop run)
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/games.log",
    shell:
        "fedagent games --out {output} --seed {params.seed}"
        " --n-train {params.env[train_games]} --n-val {params.env[val_games]}"
        " --world-size {params.env[world_size]} --nb-objects {params.env[nb_objects]}"
        " --quest-length {params.env[quest_length]} --jobs {threads}"
        " --quarantine {params.quarantine} > {log} 2>&1"


rule partition:
    input:
        GAMES,
    output:
        PARTITION,
    params:
        clients=config["clients"]["total"],
        strategy=config["partition"]["strategy"],
        min_tasks=config["partition"]["min_tasks_per_client"],
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/partition.log",
    shell:
        "fedagent partition --games {input} --clients {params.clients} --strategy {params.strategy}"
        " --min-tasks {params.min_tasks} --out {output} > {log} 2>&1"


rule val_set:
    input:
        GAMES,
    output:
        VAL_SET,
    params:
        n=config["eval"]["n"],
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/val_set.log",
    shell:
        "fedagent val-set --games {input} --n {params.n} --out {output} > {log} 2>&1"


rule base_model:
    output:
        # every round's KL reference by default: kept always, protected() when asked
        protected(directory(model_dir(0))) if config["keep"]["protect_models"] else directory(model_dir(0)),
    params:
        command="tiny-model --seed {}".format(config["seed"]) if config["model"] == "tiny"
        else "base-model --source {}".format(config["model"]),
        quarantine=QUARANTINE,
    threads: 2
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/base_model.log",
    shell:
        "fedagent {params.command} --out {output} --quarantine {params.quarantine} > {log} 2>&1"


rule select:
    output:
        f"{RUN}/round_{{round}}/selection.json",
    wildcard_constraints:
        round=r"(?!000)\d{3}",
    params:
        seed=config["seed"],
        total=config["clients"]["total"],
        per_round=config["clients"]["per_round"],
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/round_{{round}}/select.log",
    shell:
        "fedagent select --seed {params.seed} --round {wildcards.round} --total {params.total}"
        " --per-round {params.per_round} --out {output} > {log} 2>&1"
