# WebShop (env.kind: webshop): the task directory, from the standard files or synthetic.
# Same output as `games` (plan/games: games.json with train/val goal ids), so partition,
# val_set, train_client and eval read it unchanged; rules/plan.smk defines `games` for the other kinds.
# Its source flags come from workflow/common.smk (webshop_source_flags).


if config["env"]["kind"] == "webshop":

    rule webshop_catalog:
        output:
            directory(GAMES),
        params:
            data_seed=DATA_SEED,
            ws=config["env"]["webshop"],
            source=webshop_source_flags(),
            quarantine=QUARANTINE,
        conda:
            "../envs/fedagent.yaml"
        log:
            f"{RUN}/logs/webshop_catalog.log",
        shell:
            "fedagent webshop-catalog --out {output} --data-seed {params.data_seed}"
            " --n-products {params.ws[n_products]} --goals-per-product {params.ws[goals_per_product]}"
            " --val-goals {params.ws[val_goals]} {params.source}"
            " --quarantine {params.quarantine} > {log} 2>&1"
