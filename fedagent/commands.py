"""The commands of ``fedagent``: name → module, and running one in this process.

Each command lives in its own module as ``add_args(parser)`` + ``run(args) -> int``; this table
maps command names to modules, imported lazily so ``fedagent --help`` and light commands stay fast.
:func:`dispatch` runs a command here: what :mod:`fedagent.cli` does without a warm server, and
what a warm server's forked job does (:mod:`fedagent.warm.child`).
"""

from __future__ import annotations

import argparse
import importlib

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "check-config": ("fedagent.core.config", "validate a config file (schema + cross-field checks)"),
    "config": ("fedagent.report.config_show", "config show: the effective config as YAML, with each value's source"),
    "base-model": ("fedagent.model.base_model", "build the round-0 model directory (GGUF → fp32 HF dir)"),
    "tiny-model": ("fedagent.model.base_model_tiny", "build a tiny randomly initialised model (tests)"),
    "catalogue": ("fedagent.envs.catalogue", "a run's task catalogue (plan/games) through the env registry"),
    "labels": ("fedagent.evaluate.labels", "hardness labels: a reference policy plays every train task once"),
    "demo-pool": ("fedagent.plan.demo_pool", "set aside the warm start's demo tasks (train tasks no client owns)"),
    "warm-start": ("fedagent.train.warm_start", "fine-tune the base model on expert demonstrations (round 0's model)"),
    "start-copy": (
        "fedagent.plan.start_copy",
        "round 0 taken from another run (config start): model and evals copied, manifests checked",
    ),
    "partition": ("fedagent.partition", "assign train tasks to clients"),
    "val-set": ("fedagent.plan.val_set", "fix the validation tasks"),
    "select": ("fedagent.plan.selection", "choose the clients of one round"),
    "train-client": ("fedagent.train.cli", "train one client for one round"),
    "drop-client": ("fedagent.server.dropout", "record a client that failed after its retries (clients.min_per_round)"),
    "aggregate": ("fedagent.server.aggregate", "weighted mean of client updates (fp32, streamed)"),
    "merge": ("fedagent.server.merge", "server step: next global model"),
    "verify": ("fedagent.server.verify", "recompute a round's aggregate in float64 and compare"),
    "eval": ("fedagent.evaluate.validation", "score a model on the fixed validation set"),
    "report": ("fedagent.report.summary", "summary.csv and curves.png"),
    "tracking": ("fedagent.report.tracking", "a matrix's tracker stores (MLflow: a run per arm × seed) from its runs"),
    "matrix-table": ("fedagent.report.matrix_table", "a matrix's comparison table and curves from its runs' summaries"),
    "clients-table": (
        "fedagent.report.clients_table",
        "a matrix's train jobs side by side, one row per arm, seed, round and client",
    ),
    "status": ("fedagent.report.status", "where a run stands, read from its output files only"),
    "run-hashes": (
        "fedagent.report.run_hashes",
        "sha256 of a run's reproducible outputs (models, updates, evals), or --compare two such lists",
    ),
    "gpu-mem": (
        "fedagent.report.gpu_mem",
        "the GPU jobs' declared memory (gpu_mem_mb) term by term, and what fits the card",
    ),
    "serve-env": ("fedagent.envs.serve", "run one environment service by hand"),
    "warm-server": ("fedagent.warm.cli", "node-local warm fork server: jobs skip the heavy imports"),
}


def commands() -> dict[str, tuple[str, str]]:
    """:data:`COMMANDS` and every registered environment's own (:attr:`fedagent.core.envs.EnvSpec.commands`)."""
    from fedagent.core import envs

    table = dict(COMMANDS)
    for spec in envs.specs():
        table.update({name: tuple(entry) for name, entry in spec.commands.items() if name not in COMMANDS})
    return table


# The commands worth forking from pre-imported modules (seconds of torch/transformers imports each;
# pandas/matplotlib for a round's report; torch/transformers for the tiny round-0 model of test runs), and
# the plan's own jobs: the catalogue (its env kind's modules, ≈ 1 s fresh), the partition, the validation
# set and each round's selection (the config module and its schema, ≈ 0.4 s fresh each).
WARM_COMMANDS = (
    "train-client",
    "eval",
    "serve-env",
    "aggregate",
    "merge",
    "report",
    "tiny-model",
    "catalogue",
    "partition",
    "val-set",
    "select",
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per command (modules imported lazily)."""
    parser = argparse.ArgumentParser(
        prog="fedagent", description="The ``fedagent`` command line: what Snakemake rules call."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in commands().items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def dispatch(argv: list[str]) -> int:
    """Run ``fedagent <command> ...`` in this process (also what a warm server's forked job calls)."""
    argv = list(argv)
    table = COMMANDS if argv and argv[0] in COMMANDS else commands()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in table:
        parser = build_parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}")
        parser.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    from fedagent.core import timing

    timing.mark_command_start()
    module = importlib.import_module(table[name][0])
    parser = argparse.ArgumentParser(prog=f"fedagent {name}", description=table[name][1])
    module.add_args(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)
