# The summary table and learning curve after round r (rows / points for rounds 0..r).
# One report per round, whose inputs depend only on r: changing `rounds` never re-runs an
# existing report (a single report over rounds 0..R would re-run whenever R changed).
# Every round's report is built; each also points results/<run>/summary.csv and curves.png at the newest round's files.
# Its inputs (report_inputs) and the optional client table (CLIENT_SUMMARY) are in workflow/common.smk.
# points.csv holds every tracked number; the newest round's report rebuilds the run's TensorBoard / MLflow
# stores from it (report.trackers), whole, so re-running a round never duplicates its points.


rule report:
    priority: ROUND_RECORD_PRIORITY
    localrule: True   # bookkeeping, no model: on a cluster it runs on the submitting host
    input:
        unpack(report_inputs),
    output:
        *CLIENT_SUMMARY,
        summary=report(f"{RUN}/round_{{round}}/summary.csv", category="Summary", caption="../workflow/report/summary.rst",
                       labels={"round": "{round}", "file": "table (CSV)"}),
        curves=report(f"{RUN}/round_{{round}}/curves.png", category="Summary", caption="../workflow/report/curves.rst",
                      labels={"round": "{round}", "file": "curves"}),
        # the curve and the tables on one page (what the report opens on)
        html=report(f"{RUN}/round_{{round}}/summary.html", category="Summary", caption="../workflow/report/summary_html.rst",
                    labels={"round": "{round}", "file": "summary page"}),
        timings=f"{RUN}/round_{{round}}/timings.csv",
        # every number the trackers log, rounds 0..r (fedagent.report.points)
        points=f"{RUN}/round_{{round}}/points.csv",
    params:
        run_dir=lambda w, output: os.path.dirname(os.path.dirname(output.summary)),  # results/<run>
        clients=lambda w, input: " ".join(input.get("clients", [])) or "none",
        prev_timings=lambda w, input: input.get("prev_timings", "none"),
        prev_points=lambda w, input: input.get("prev_points", "none"),
        client_evals=lambda w, input: ("--client-evals " + " ".join(input.client_evals)) if input.get("client_evals") else "",
        client_summary=lambda w, output: f"--client-summary {output[0]}" if CLIENT_SUMMARY else "",
    resources:
        trackers=TRACKERS_ARG,  # the newest round's report regenerates the run's stores (fedagent.report.tracking)
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{RUN}/logs/round_{{round}}/report.log",
    shell:
        "fedagent report --evals {input.evals} {params.client_evals} {params.client_summary} --summary {output.summary} --curves {output.curves}"
        " --round {wildcards.round} --eval-timings {input.eval_timings} --benchmarks {input.benchmarks}"
        " --clients {params.clients} --prev-timings {params.prev_timings} --timings {output.timings}"
        " --html {output.html} --points {output.points} --prev-points {params.prev_points} --trackers {resources.trackers}"
        " --link-latest {params.run_dir} > {log} 2>&1"
