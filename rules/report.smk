# The summary table and learning curve after round r (rows / points for rounds 0..r).
# One report per round, whose inputs depend only on r: changing `rounds` never re-runs an
# existing report (a single report over rounds 0..R would re-run whenever R changed).
# Every round's report is built; each also points results/<run>/summary.csv and curves.png at the newest round's files.


# eval.clients: the per-client table is a declared output too (header only in round 0).
CLIENT_SUMMARY = [f"{RUN}/round_{{round}}/client_summary.csv"] if config["eval"]["clients"] else []


def report_inputs(w):
    """Evals of rounds 0..r; this round's job timings (client metrics, eval timings, Snakemake
    benchmark files); the previous round's timings.csv (so the table has every round)."""
    r = int(w.round)
    d = {"evals": ([f"{round_dir(0)}/base_eval.json"] if WARM_START else [])
                  + [f"{round_dir(k)}/eval.json" for k in range(0, r + 1)],
         "eval_timings": f"{round_dir(r)}/eval_timings.json",
         "benchmarks": [f"{RUN}/benchmarks/round_{r:03d}/eval.tsv"]}
    if r >= 1:
        d["clients"] = [f"{round_dir(r)}/clients/{c}" for c in selected_clients(r)]
        d["benchmarks"] += [f"{RUN}/benchmarks/round_{r:03d}/{name}.tsv" for name in
                            ["aggregate", "merge"] + [f"train_client_{c}" for c in selected_clients(r)]]
        d["prev_timings"] = f"{round_dir(r - 1)}/timings.csv"
    client_evals = client_eval_files(w)
    if client_evals:
        d["client_evals"] = client_evals
    return d


rule report:
    input:
        unpack(report_inputs),
    output:
        *CLIENT_SUMMARY,
        summary=report(f"{RUN}/round_{{round}}/summary.csv", category="Summary", caption="../workflow/report/summary.rst"),
        curves=report(f"{RUN}/round_{{round}}/curves.png", category="Summary", caption="../workflow/report/curves.rst"),
        timings=f"{RUN}/round_{{round}}/timings.csv",
    params:
        run_dir=RUN,
        clients=lambda w, input: " ".join(input.get("clients", [])) or "none",
        prev_timings=lambda w, input: input.get("prev_timings", "none"),
        client_evals=lambda w, input: ("--client-evals " + " ".join(input.client_evals)) if input.get("client_evals") else "",
        client_summary=lambda w, output: f"--client-summary {output[0]}" if CLIENT_SUMMARY else "",
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/round_{{round}}/report.log",
    shell:
        "fedagent report --evals {input.evals} {params.client_evals} {params.client_summary} --summary {output.summary} --curves {output.curves}"
        " --round {wildcards.round} --eval-timings {input.eval_timings} --benchmarks {input.benchmarks}"
        " --clients {params.clients} --prev-timings {params.prev_timings} --timings {output.timings}"
        " --link-latest {params.run_dir} > {log} 2>&1"
