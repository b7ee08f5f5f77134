# The round's client deltas → one pseudo-gradient (aggregate.aggregator: the weighted mean by default),
# fp32, streamed tensor by tensor.


rule aggregate:
    priority: ROUND_RECORD_PRIORITY   # workflow/common.smk
    input:
        prev=lambda w: model_dir(int(w.round) - 1),
        selection=f"{RUN}/round_{{round}}/selection.json",
        clients=lambda w: [f"{round_dir(w.round)}/clients/{c}" for c in selected_clients(w.round)],
    output:
        maybe_temp(directory(f"{RUN}/round_{{round}}/aggregate"), config["keep"]["aggregates"]),
    wildcard_constraints:
        round=r"(?!000)\d{3}",
    params:
        # "uniform" … or "weights --client-weights w_c …", then a rule's flags beyond the mean
        # ("--aggregator median", …: workflow/common.smk)
        weighting=aggregate_weighting,
        quarantine=QUARANTINE,
    resources:
        min_clients=MIN_CLIENTS,  # not a param: changing clients.min_per_round re-runs nothing
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/round_{{round}}/aggregate.log",
    benchmark:
        f"{RUN}/benchmarks/round_{{round}}/aggregate.tsv"
    shell:
        "fedagent aggregate --prev {input.prev} --clients {input.clients}"
        " --weighting {params.weighting} --min-clients {resources.min_clients}"
        " --out {output} --quarantine {params.quarantine} > {log} 2>&1"
