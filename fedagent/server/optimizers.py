"""Server optimizers: one small class each, applied tensor by tensor.

The pseudo-gradient is the aggregated delta Δ̄ (mean client − previous global, a descent
direction already), following Reddi et al., "Adaptive Federated Optimization" (ICLR 2021),
Algorithm 2, without bias correction:

- FedAvg:  x ← x + η Δ̄
- FedAvgM: m ← β m + Δ̄;                 x ← x + η m          (Hsu et al. 2019)
- FedAdam: m ← β1 m + (1−β1) Δ̄;  v ← β2 v + (1−β2) Δ̄²;                 x ← x + η m / (√v + τ)
- FedYogi: m as FedAdam;          v ← v − (1−β2) Δ̄² sign(v − Δ̄²);     x ← x + η m / (√v + τ)

Adaptive state starts at m = 0, v = τ² (the paper's v₋₁ ≥ τ²). All arithmetic is fp32 and
elementwise, so a resumed run that reloads the state reproduces the same bytes. Against Flower
(docs/explanation/rl-objective.md): Flower starts v at 0 and its FedAdam scales η by a
bias correction; here neither, for either optimizer.

``server.lr`` (η) null means :data:`DEFAULT_LR` for the optimizers that have one (FedAvg, FedAvgM:
1.0, the mean update itself); FedAdam and FedYogi have none and refuse to run without an explicit
η (a cross rule at plan time, :func:`make_optimizer` in the job): their step moves every weight by
about η per round, so a default of 1.0 (or Flower's 0.1) would be a silent choice of the science.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from fedagent.core.config import JobKeys
from fedagent.core.config_rules import SERVER_DEFAULT_LR as DEFAULT_LR  # server.lr null: these optimizers' η

if TYPE_CHECKING:  # torch is imported where tensors are touched: the workflow plans with this module
    import torch


class ServerOptimizer:
    """Base: ``slots`` names the per-tensor state; ``step`` updates state in place."""

    name = ""
    slots: tuple[str, ...] = ()

    def __init__(self, lr: float = 1.0) -> None:
        self.lr = float(lr)

    def hparams(self) -> dict:
        """Hyper-parameters recorded in server.json (a resume must use the same)."""
        return {"lr": self.lr}

    def init_state(self, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fresh fp32 state for one tensor."""
        import torch

        return {s: torch.zeros_like(like, dtype=torch.float32) for s in self.slots}

    def step(self, w: torch.Tensor, delta: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Return the new fp32 weight for one tensor (``w`` and ``delta`` fp32; may be modified)."""
        raise NotImplementedError


class FedAvg(ServerOptimizer):
    name = "fedavg"

    def step(self, w, delta, state):
        return w.add_(delta, alpha=self.lr)


class FedAvgM(ServerOptimizer):
    name = "fedavgm"
    slots = ("m",)

    def __init__(self, lr: float = 1.0, momentum: float = 0.9) -> None:
        super().__init__(lr)
        self.momentum = float(momentum)

    def hparams(self):
        return {"lr": self.lr, "momentum": self.momentum}

    def step(self, w, delta, state):
        m = state["m"].mul_(self.momentum).add_(delta)
        return w.add_(m, alpha=self.lr)


class FedAdam(ServerOptimizer):
    name = "fedadam"
    slots = ("m", "v")

    def __init__(self, lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3) -> None:
        super().__init__(lr)
        self.beta1, self.beta2, self.tau = float(beta1), float(beta2), float(tau)

    def hparams(self):
        return {"lr": self.lr, "beta1": self.beta1, "beta2": self.beta2, "tau": self.tau}

    def init_state(self, like):
        import torch

        return {
            "m": torch.zeros_like(like, dtype=torch.float32),
            "v": torch.full_like(like, self.tau**2, dtype=torch.float32),
        }

    def _second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        return v.mul_(self.beta2).add_(d2, alpha=1 - self.beta2)

    def step(self, w, delta, state):
        m = state["m"].mul_(self.beta1).add_(delta, alpha=1 - self.beta1)
        v = self._second_moment(state["v"], delta * delta)
        return w.addcdiv_(m, v.sqrt().add_(self.tau), value=self.lr)


class FedYogi(FedAdam):
    name = "fedyogi"

    def _second_moment(self, v, d2):
        import torch

        return v.sub_(d2 * torch.sign(v - d2), alpha=1 - self.beta2)


OPTIMIZERS: dict[str, type[ServerOptimizer]] = {c.name: c for c in (FedAvg, FedAvgM, FedAdam, FedYogi)}


# The config key of each make_optimizer argument (`fedagent merge`/`verify` flags come from these).
SERVER_KEYS = JobKeys(
    "merge",
    {
        "name": "server.optimizer",
        "lr": "server.lr",
        "momentum": "server.momentum",
        "beta1": "server.beta1",
        "beta2": "server.beta2",
        "tau": "server.tau",
    },
)


def make_optimizer(
    name: str,
    *,
    lr: float | None = None,
    momentum: float = 0.9,
    beta1: float = 0.9,
    beta2: float = 0.99,
    tau: float = 1e-3,
) -> ServerOptimizer:
    """Build a server optimizer by name with the hyper-parameters it uses (checked as config keys).

    ``lr`` None: the optimizer's :data:`DEFAULT_LR`; FedAdam/FedYogi refuse it (ConfigError naming
    ``server.lr``)."""
    SERVER_KEYS.check({"name": name, "lr": lr, "momentum": momentum, "beta1": beta1, "beta2": beta2, "tau": tau})
    if lr is None:
        lr = DEFAULT_LR[name]
    if name == "fedavg":
        return FedAvg(lr)
    if name == "fedavgm":
        return FedAvgM(lr, momentum)
    if name in ("fedadam", "fedyogi"):
        return OPTIMIZERS[name](lr, beta1, beta2, tau)
    raise ValueError(f"unknown server optimizer {name!r} (choose from {sorted(OPTIMIZERS)})")


# The command-line flag of each hyper-parameter: `fedagent merge` and `fedagent verify` take
# the same flags, and the workflow passes them (only the chosen optimizer's, see cli_flags).
HPARAM_FLAGS = {"lr": "--server-lr", "momentum": "--momentum", "beta1": "--beta1", "beta2": "--beta2", "tau": "--tau"}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server-step flags shared by ``fedagent merge`` and ``fedagent verify``."""
    parser.add_argument(
        "--prev-server-state", default="none", help="previous round's merged model dir holding server state, or 'none'"
    )
    parser.add_argument("--server-opt", default="fedavg", choices=sorted(OPTIMIZERS))
    parser.add_argument(
        "--server-lr", type=float, default=None, help="η (default: 1.0 for fedavg/fedavgm; fedadam/fedyogi need it)"
    )
    parser.add_argument("--momentum", type=float, default=0.9, help="FedAvgM")
    parser.add_argument("--beta1", type=float, default=0.9, help="FedAdam/FedYogi")
    parser.add_argument("--beta2", type=float, default=0.99, help="FedAdam/FedYogi")
    parser.add_argument("--tau", type=float, default=1e-3, help="FedAdam/FedYogi adaptivity")


def optimizer_from_args(args: argparse.Namespace) -> tuple[ServerOptimizer, Path | None]:
    """The optimizer and the previous state dir (None for 'none') named by :func:`add_server_args` flags."""
    opt = make_optimizer(
        args.server_opt, lr=args.server_lr, momentum=args.momentum, beta1=args.beta1, beta2=args.beta2, tau=args.tau
    )
    state = None if str(args.prev_server_state).lower() in ("", "none") else Path(args.prev_server_state)
    return opt, state


def cli_flags(name: str, **knobs: float) -> str:
    """``--server-opt NAME`` plus the flags of that optimizer's own hyper-parameters only.

    The workflow's merge params: a knob of another optimizer is not in the string, so
    changing it re-runs nothing.
    """
    hparams = make_optimizer(name, **knobs).hparams()
    return " ".join([f"--server-opt {name}"] + [f"{HPARAM_FLAGS[k]} {v!r}" for k, v in sorted(hparams.items())])
