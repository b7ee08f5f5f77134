# The summary table and learning curve after round r (rows / points for rounds 0..r).
# One report per round, whose inputs depend only on r: changing `rounds` never re-runs an
# existing report (a single report over rounds 0..R would re-run whenever R changed).
# Every round's report is built; each also points results/<run>/summary.csv and curves.png at the newest round's files.


rule report:
    input:
        evals=lambda w: [f"{round_dir(r)}/eval.json" for r in range(0, int(w.round) + 1)],
        clients=client_eval_files,
    output:
        summary=report(f"{RUN}/round_{{round}}/summary.csv", category="Summary", caption="../workflow/report/summary.rst"),
        curves=report(f"{RUN}/round_{{round}}/curves.png", category="Summary", caption="../workflow/report/curves.rst"),
    params:
        run_dir=RUN,
        clients=lambda w, input: ("--client-evals " + " ".join(input.clients)) if input.clients else "",
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/round_{{round}}/report.log",
    shell:
        "fedagent report --evals {input.evals} {params.clients} --summary {output.summary} --curves {output.curves}"
        " --link-latest {params.run_dir} > {log} 2>&1"
