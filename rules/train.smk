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
