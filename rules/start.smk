# `start` (a matrix's shared start per seed, fedagent.plan.matrix): this run's round 0 — its model,
# eval and, with the warm start, the base model's eval — is the start run's, copied byte for byte
# (fedagent.plan.start_copy checks the model's manifest). Everything after round 0 is this run's own.
if START:

    rule start_copy:
        localrule: True   # a copy, no model run: on a cluster it runs on the submitting host
        input:
            model=f"{START}/round_000/model",
            files=[f"{START}/{name}" for name in START_FILES],
        output:
            model=protected(directory(model_dir(0))) if config["keep"]["protect_models"] else directory(model_dir(0)),
            files=[f"{RUN}/{name}" for name in START_FILES],
        params:
            pairs=" ".join(f"--file {START}/{name} {RUN}/{name}" for name in START_FILES),
            quarantine=QUARANTINE,
        conda:
            "../envs/fedagent.yaml"
        log:
            f"{RUN}/logs/start_copy.log",
        shell:
            "fedagent start-copy --model {input.model} {output.model} {params.pairs}"
            " --quarantine {params.quarantine} > {log} 2>&1"
