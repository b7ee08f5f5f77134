# An experiment matrix (`--config matrix=<name>`): every arm × seed of config/matrices/<name>.yaml as its
# own run directory, <results_dir>/<matrix>/<arm>/seed_<seed>/, each the ordinary round graph (../Snakefile)
# loaded as a Snakemake module with that run's config, its rules prefixed <arm>__s<seed>__. Runs with the
# same task catalogue read one copy, built by a module that keeps only the catalogue rule; runs with the
# same round 0 (an arm's seed and round-0 settings) copy one, built under _start/<key>/. Then the
# table: results/<matrix>/table.csv, table.md and curves.png (fedagent matrix-table).
# The expansion and every check live in fedagent.plan.matrix; this file is wiring only.
import json
import os
import sys

sys.path.insert(0, workflow.basedir)  # the package is importable even from a bare checkout

from fedagent.core.config import ConfigError
from fedagent.plan.matrix import load_matrix

try:
    MATRIX = load_matrix(str(config["matrix"]), config, getattr(workflow.config_settings, "config", None))
except ConfigError as exc:
    print(f"fedagent: invalid matrix: {exc}", file=sys.stderr)
    sys.exit(1)


for _cat_key, _cat_config in MATRIX.catalogues.items():
    _module = f"catalogue_{_cat_key.replace('-', '_')}__"

    module:
        name: _module
        snakefile: "../Snakefile"
        config: _cat_config

    use rule games from _module as _module*


# One shared round 0 per start key (same seed and round-0 settings): a run of its own under _start/<key>/
# of which only round 0 is asked for; the arms' runs copy it (rules/start.smk), so every arm of a seed
# starts from the same model and the base model, warm start and round-0 evals are built once per seed.
for _start_key, _start_config in MATRIX.starts.items():
    _module = f"start_{_start_key.replace('-', '_')}__"

    module:
        name: _module
        snakefile: "../Snakefile"
        config: _start_config

    use rule * from _module exclude games, all as _module*


for _run in MATRIX.runs:
    _module = f"{_run.module}__"

    module:
        name: _module
        snakefile: "../Snakefile"
        config: _run.config

    use rule * from _module exclude games, all as _module*


# each run's last summary, and its last round's and round 0's eval.json (the table's paired columns)
MATRIX_RUNS = json.dumps([{"arm": r.arm, "seed": r.seed, "summary": MATRIX.last_round_summary(r),
                           "eval": MATRIX.last_round_eval(r), "start_eval": MATRIX.start_eval(r)} for r in MATRIX.runs],
                         sort_keys=True, separators=(",", ":"))


MATRIX_TARGETS = [f"{MATRIX.out_dir}/table.csv", f"{MATRIX.out_dir}/table.md", f"{MATRIX.out_dir}/curves.png",
                  f"{MATRIX.out_dir}/clients.csv", f"{MATRIX.out_dir}/clients.md"]
# each run's config, recorded by the Snakefile's onstart (the modules' own RUN_CONFIGS are not seen here)
RUN_CONFIGS = [(r.run_dir, r.config) for r in MATRIX.runs]
# the runs' report.trackers that keep a store of their own for the whole matrix (MLflow: one experiment, a
# run per arm × seed; fedagent.report.tracking)
MATRIX_TRACKERS = MATRIX.matrix_trackers()
if MATRIX_TRACKERS:
    MATRIX_TARGETS.append(f"{MATRIX.out_dir}/tracking.json")


# The comparison table over every run's summary.csv (its last round's, which has every round's row).
rule matrix_table:
    localrule: True
    input:
        [MATRIX.last_round_summary(r) for r in MATRIX.runs],
        [MATRIX.last_round_eval(r) for r in MATRIX.runs],
        [MATRIX.start_eval(r) for r in MATRIX.runs],
    output:
        csv=f"{MATRIX.out_dir}/table.csv",
        md=f"{MATRIX.out_dir}/table.md",
        curves=f"{MATRIX.out_dir}/curves.png",
    params:
        runs=MATRIX_RUNS,
        reference=MATRIX.reference,
        name=MATRIX.name,
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{MATRIX.out_dir}/logs/matrix_table.log",
    shell:
        "fedagent matrix-table --matrix {params.name} --runs '{params.runs}' --reference {params.reference}"
        " --csv {output.csv} --md {output.md} --curves {output.curves} > {log} 2>&1"




# Every train job of every run side by side (fedagent.report.clients_table), from each run's last points.csv:
# where arms share the partition and the selection, one (seed, round, client) drew the same tasks in every arm.
rule matrix_clients:
    localrule: True
    input:
        [MATRIX.last_round_points(r) for r in MATRIX.runs],
    output:
        csv=f"{MATRIX.out_dir}/clients.csv",
        md=f"{MATRIX.out_dir}/clients.md",
    params:
        runs=json.dumps([{"arm": r.arm, "seed": r.seed, "points": MATRIX.last_round_points(r)} for r in MATRIX.runs],
                        sort_keys=True, separators=(",", ":")),
        name=MATRIX.name,
    conda:
        "../envs/fedagent.yaml"
    log:
        f"{MATRIX.out_dir}/logs/matrix_clients.log",
    shell:
        "fedagent clients-table --matrix {params.name} --runs '{params.runs}' --csv {output.csv} --md {output.md}"
        " > {log} 2>&1"


# The matrix's own tracker stores (MLflow: <matrix>/mlruns, one experiment, a run per arm × seed), rebuilt
# whole from every run's last points.csv; tracking.json, written last, is the rule's output.
if MATRIX_TRACKERS:

    rule matrix_tracking:
        localrule: True
        input:
            [MATRIX.last_round_points(r) for r in MATRIX.runs],
        output:
            f"{MATRIX.out_dir}/tracking.json",
        params:
            runs=json.dumps([{"arm": r.arm, "seed": r.seed} for r in MATRIX.runs], sort_keys=True, separators=(",", ":")),
            name=MATRIX.name,
            out=lambda w, output: os.path.dirname(output[0]),  # the matrix's directory
            trackers=",".join(MATRIX_TRACKERS),
        conda:
            "../envs/fedagent.yaml"
        log:
            f"{MATRIX.out_dir}/logs/matrix_tracking.log",
        shell:
            "fedagent tracking --matrix {params.name} --out {params.out} --runs '{params.runs}' --points {input}"
            " --trackers {params.trackers} --done {output} > {log} 2>&1"
