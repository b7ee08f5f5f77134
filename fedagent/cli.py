"""The ``fedagent`` command line: what Snakemake rules call.

Each command lives in its own module as ``add_args(parser)`` + ``run(args) -> int``;
this file only maps command names to modules, imported lazily so ``fedagent --help``
and light commands stay fast.

With ``FEDAGENT_WARM_SOCKET`` set, the heavy job commands (``train-client``, ``eval``,
``serve-env``, ``aggregate``, ``merge``) are not run here: this process stays a light client (no torch, no numpy) and
a node-local warm server (``fedagent warm-server``, :mod:`fedagent.warm`) forks the job from
a process that has the heavy modules imported already.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "check-config": ("fedagent.config", "validate a config file (schema + cross-field checks)"),
    "config": ("fedagent.config_show", "config show: the effective config as YAML, with each value's source"),
    "base-model": ("fedagent.base_model", "build the round-0 model directory (GGUF → fp32 HF dir)"),
    "tiny-model": ("fedagent.base_model_tiny", "build a tiny randomly initialised model (tests)"),
    "games": ("fedagent.envs.textworld_games", "generate the TextWorld train/val game pools"),
    "webshop-catalog": ("fedagent.envs.webshop.build", "build the WebShop task directory (standard data or synthetic)"),
    "alfworld-games": ("fedagent.envs.alfworld.generate", "generate solvable ALFWorld games offline"),
    "alfworld-pool": ("fedagent.envs.alfworld.catalogue", "the ALFWorld task catalogue of a run (plan/games)"),
    "labels": ("fedagent.labels", "hardness labels: a reference policy plays every train task once"),
    "partition": ("fedagent.partition", "assign train tasks to clients"),
    "val-set": ("fedagent.val_set", "fix the validation tasks"),
    "select": ("fedagent.selection", "choose the clients of one round"),
    "train-client": ("fedagent.train.cli", "train one client for one round"),
    "drop-client": ("fedagent.dropout", "record a client that failed after its retries (clients.min_per_round)"),
    "aggregate": ("fedagent.aggregate", "weighted mean of client updates (fp32, streamed)"),
    "merge": ("fedagent.merge", "server step: next global model"),
    "verify": ("fedagent.verify", "recompute a round's aggregate in float64 and compare"),
    "eval": ("fedagent.evaluate", "score a model on the fixed validation set"),
    "report": ("fedagent.report", "summary.csv and curves.png"),
    "status": ("fedagent.status", "where a run stands, read from its output files only"),
    "serve-env": ("fedagent.envs.serve", "run one environment service by hand"),
    "warm-server": ("fedagent.warm.cli", "node-local warm fork server: jobs skip the heavy imports"),
}

WARM_SOCKET_ENV = "FEDAGENT_WARM_SOCKET"
# The commands worth forking from pre-imported modules (seconds of torch/transformers imports each).
WARM_COMMANDS = ("train-client", "eval", "serve-env", "aggregate", "merge")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per command (modules imported lazily)."""
    parser = argparse.ArgumentParser(prog="fedagent", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: hand a heavy job to the warm server named by ``FEDAGENT_WARM_SOCKET``, else
    :func:`dispatch` it here. There is no silent fallback: a set socket nobody answers on is an error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    socket_path = os.environ.get(WARM_SOCKET_ENV)
    if socket_path and argv and argv[0] in WARM_COMMANDS:
        from fedagent.warm.client import delegate

        return delegate(argv, socket_path)
    return dispatch(argv)


def dispatch(argv: list[str]) -> int:
    """Run ``fedagent <command> ...`` in this process (also what a warm server's forked job calls)."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = build_parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}")
        parser.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    from fedagent import timing

    timing.mark_command_start()
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"fedagent {name}", description=COMMANDS[name][1])
    module.add_args(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
