# Score a global model (round 0: the base model) on the fixed validation set.


rule eval:
    input:
        model=lambda w: model_dir(w.round),
        games=GAMES,
        val_set=VAL_SET,
    output:
        eval=report(f"{RUN}/round_{{round}}/eval.json", category="Evaluation", caption="../workflow/report/eval.rst"),
        # Phase timings (wall clock) beside eval.json, which stays byte-identical across re-runs.
        timings=f"{RUN}/round_{{round}}/eval_timings.json",
    params:
        eval=EVAL_PARAMS,
    threads: config["eval"]["threads"]
    resources:
        gpu=1 if config["eval"]["backend"] == "vllm" else 0,
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/round_{{round}}/eval.log",
    benchmark:
        f"{RUN}/benchmarks/round_{{round}}/eval.tsv"
    shell:
        "fedagent eval --model {input.model} --games {input.games} --val-set {input.val_set}"
        " --params '{params.eval}' --round {wildcards.round} --threads {threads}"
        " --out {output.eval} --timings {output.timings} > {log} 2>&1"
