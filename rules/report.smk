# The run's summary table and learning curve (one row / point per round, round 0 included).


rule report:
    input:
        [f"{round_dir(r)}/eval.json" for r in ROUNDS],
    output:
        summary=report(f"{RUN}/summary.csv", category="Summary", caption="../workflow/report/summary.rst"),
        curves=report(f"{RUN}/curves.png", category="Summary", caption="../workflow/report/curves.rst"),
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/report.log",
    shell:
        "fedagent report --evals {input} --summary {output.summary} --curves {output.curves} > {log} 2>&1"
