"""``fedagent catalogue --kind K ... -- <command> <flags>``: build a run's ``plan/games`` through the env registry.

The one ``games`` rule calls this for every env kind: the kind's spec names the CLI module that
builds its catalogue (:attr:`fedagent.core.envs.EnvSpec.catalogue`) and the flags
(:attr:`~fedagent.core.envs.EnvSpec.catalogue_args`, passed after ``--``: their first word is the
command's name, as ``fedagent <name>`` would take it); this adds ``--out`` and ``--quarantine``,
and ``--jobs`` when the kind's builder takes it.
"""

from __future__ import annotations

import argparse

from fedagent.core import envs


def add_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``fedagent catalogue``."""
    parser.add_argument("--kind", required=True, help="env.kind (a registered environment)")
    parser.add_argument("--out", required=True, help="catalogue folder to create (plan/games)")
    parser.add_argument("--jobs", type=int, default=1, help="processes building it (kinds whose builder takes --jobs)")
    parser.add_argument("--quarantine", default=None, help="where failed attempts go")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- <command> <flags> (the spec's catalogue_args)")


def builder_argv(spec: envs.EnvSpec, args: argparse.Namespace) -> list[str]:
    """The kind's builder's own argv: its flags, then --out/--quarantine (and --jobs when it takes it)."""
    rest = list(args.args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    argv = rest[1:] + ["--out", str(args.out)]  # rest[0]: the command's name (for a reader of the log)
    if args.quarantine is not None:
        argv += ["--quarantine", str(args.quarantine)]
    if spec.catalogue_jobs:
        argv += ["--jobs", str(args.jobs)]
    return argv


def run(args: argparse.Namespace) -> int:
    """Dispatch to the kind's catalogue builder."""
    spec = envs.spec(args.kind)
    module = envs.resolve(spec.catalogue)
    parser = argparse.ArgumentParser(prog=f"fedagent catalogue --kind {args.kind}")
    module.add_args(parser)
    return module.run(parser.parse_args(builder_argv(spec, args)))
