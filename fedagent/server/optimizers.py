"""The server optimizers as the jobs and the workflow use them: by name, from the registry.

:data:`OPTIMIZERS` is the registry (fedagent.core.registry.SERVER_OPTIMIZERS): the built-ins of
fedagent.server.builtin_optimizers and any class an entry point of ``fedagent.server_optimizers``
names. From it come the ``fedagent merge``/``verify`` flags (:func:`add_server_args`: ``--server-opt``,
``--server-lr`` and one flag per declared hyper-parameter), the workflow's merge params
(:func:`cli_flags`: the chosen optimizer's own flags only) and the job's config check
(:data:`SERVER_KEYS`). What a server optimizer is: fedagent.server.optimizer_base.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedagent.core.config import ConfigError, JobKeys
from fedagent.server.builtin_optimizers import FedAdam, FedAvg, FedAvgM, FedYogi  # noqa: F401 - re-exported
from fedagent.server.optimizer_base import LR_FLAG, SERVER_OPTIMIZERS, ServerOptimizer

OPTIMIZERS = SERVER_OPTIMIZERS


def hparam_flags() -> dict[str, str]:
    """The command-line flag of each hyper-parameter of every registered optimizer (η: ``--server-lr``)."""
    return {"lr": LR_FLAG, **{name: h.cli_flag for name, h in OPTIMIZERS.hparams().items()}}


# The config key of each make_optimizer argument: every registered optimizer's hyper-parameters.
SERVER_KEYS = JobKeys(
    "merge",
    {"name": "server.optimizer", "lr": "server.lr", **{name: f"server.{name}" for name in OPTIMIZERS.hparams()}},
)


def make_optimizer(name: str, *, lr: float | None = None, **hparams: float) -> ServerOptimizer:
    """Build a server optimizer by name with the hyper-parameters it uses (checked as config keys).

    ``hparams`` may hold other optimizers' hyper-parameters (the config's server section does):
    checked, not passed. ``lr`` None: the optimizer's ``default_lr``; one without (FedAdam,
    FedYogi) refuses it (ConfigError naming ``server.lr``)."""
    unknown = sorted(set(hparams) - set(OPTIMIZERS.hparams()))
    if unknown:
        raise ConfigError(f"config key 'server.{unknown[0]}': not a hyper-parameter of any server optimizer")
    SERVER_KEYS.check({"name": name, "lr": lr, **hparams})
    cls = OPTIMIZERS[name]
    own = {h.name: hparams[h.name] for h in cls.HPARAMS if h.name in hparams}
    return cls(cls.default_lr if lr is None else lr, **own)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server-step flags shared by ``fedagent merge`` and ``fedagent verify``."""
    parser.add_argument(
        "--prev-server-state", default="none", help="previous round's merged model dir holding server state, or 'none'"
    )
    parser.add_argument("--server-opt", default="fedavg", choices=sorted(OPTIMIZERS))
    no_default = sorted(n for n, c in OPTIMIZERS.items() if c.default_lr is None)
    parser.add_argument(
        LR_FLAG,
        dest="server_lr",
        type=float,
        default=None,
        help=f"η (default: the optimizer's; {'/'.join(no_default)} need it)",
    )
    users: dict[str, list[str]] = {}
    for n, c in OPTIMIZERS.items():
        for h in c.HPARAMS:
            users.setdefault(h.name, []).append(n)
    for name, h in OPTIMIZERS.hparams().items():
        parser.add_argument(
            h.cli_flag, dest=f"hp_{name}", type=float, default=h.default, help=f"{h.help} ({'/'.join(users[name])})"
        )


def optimizer_from_args(args: argparse.Namespace) -> tuple[ServerOptimizer, Path | None]:
    """The optimizer and the previous state dir (None for 'none') named by :func:`add_server_args` flags."""
    hparams = {name: getattr(args, f"hp_{name}") for name in OPTIMIZERS.hparams()}
    opt = make_optimizer(args.server_opt, lr=args.server_lr, **hparams)
    state = None if str(args.prev_server_state).lower() in ("", "none") else Path(args.prev_server_state)
    return opt, state


def cli_flags(name: str, **knobs: float) -> str:
    """``--server-opt NAME`` plus the flags of that optimizer's own hyper-parameters only.

    The workflow's merge params: a knob of another optimizer is not in the string, so
    changing it re-runs nothing.
    """
    flags = hparam_flags()
    hparams = make_optimizer(name, **knobs).hparams()
    return " ".join([f"--server-opt {name}"] + [f"{flags[k]} {v!r}" for k, v in sorted(hparams.items())])
