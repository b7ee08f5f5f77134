# One client's local training in one round: previous global model → client update dir.


rule train_client:
    input:
        model=lambda w: model_dir(int(w.round) - 1),
        ref=ref_model_dir,
        games=GAMES,
        partition=PARTITION,
    output:
        maybe_temp(directory(f"{RUN}/round_{{round}}/clients/{{client}}"), config["keep"]["client_updates"]),
    wildcard_constraints:
        round=r"(?!000)\d{3}",
    params:
        train=TRAIN_PARAMS,
        env=CLIENT_ENV_PARAMS,
        quarantine=QUARANTINE,
    threads: config["train"]["threads"]
    retries: config["clients"]["retries"]
    resources:
        # Not params: dropout settings change no update, so changing them re-runs nothing.
        attempt=lambda wildcards, attempt: attempt,
        drop_at_attempt=DROP_AT_ATTEMPT,
        # GPUs of one verl job (Slurm: --gpus; local: counted against --resources gpu=N if given).
        gpu=config["train"]["verl"]["gpus"] if config["train"]["backend"] == "verl" else 0,
        # GPU memory, MiB (train.gpu_mem_gb or fedagent.model.memory's estimate; 0 on the CPU): the
        # profile's --resources gpu_mem_mb=<card> keeps concurrent GPU jobs within the card.
        gpu_mem_mb=TRAIN_GPU_MEM_MIB,
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/round_{{round}}/train_client_{{client}}.log",
    benchmark:
        f"{RUN}/benchmarks/round_{{round}}/train_client_{{client}}.tsv"
    shell:
        "fedagent train-client --model {input.model} --ref-model {input.ref} --games {input.games}"
        " --partition {input.partition} --client {wildcards.client} --round {wildcards.round}"
        " --params '{params.train}' --env-params '{params.env}' --threads {threads} --out {output}"
        " --quarantine {params.quarantine} > {log} 2>&1"
        # A failure on the last attempt leaves a drop record when dropout is allowed (fedagent.server.dropout).
        " || fedagent drop-client --out {output} --round {wildcards.round} --client {wildcards.client}"
        " --exit-code $? --attempt {resources.attempt} --drop-at-attempt {resources.drop_at_attempt}"
        " --log {log} --quarantine {params.quarantine} >> {log} 2>&1"
