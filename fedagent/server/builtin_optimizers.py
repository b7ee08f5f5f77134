"""The built-in server optimizers, applied tensor by tensor (one registration line each).

Following Reddi et al., "Adaptive Federated Optimization" (ICLR 2021), Algorithm 2, without bias
correction, on the aggregated delta Δ̄:

- FedAvg:  x ← x + η Δ̄
- FedAvgM: m ← β m + Δ̄;                 x ← x + η m          (Hsu et al. 2019)
- FedAdam: m ← β1 m + (1−β1) Δ̄;  v ← β2 v + (1−β2) Δ̄²;                 x ← x + η m / (√v + τ)
- FedYogi: m as FedAdam;          v ← v − (1−β2) Δ̄² sign(v − Δ̄²);     x ← x + η m / (√v + τ)

Adaptive state starts at m = 0, v = τ² (the paper's v₋₁ ≥ τ²). All arithmetic is fp32 and
elementwise, so a resumed run that reloads the state reproduces the same bytes. Against Flower
(docs/explanation/rl-objective.md): Flower starts v at 0 and its FedAdam scales η by a
bias correction; here neither, for either optimizer.

``server.lr`` (η) null means the class's ``default_lr`` (FedAvg, FedAvgM: 1.0, the mean update
itself); FedAdam and FedYogi have none and refuse to run without an explicit η (the ``server.lr``
rule of fedagent.server.optimizer_base, at plan time and in the job): their step moves every weight
by about η per round, so a default of 1.0 (or Flower's 0.1) would be a silent choice of the science.

Each class's :meth:`bound` is ``fedagent verify``'s recomputation of its step; the error analysis
of its terms is in fedagent.server.bounds.
"""

from __future__ import annotations

from fedagent.server.optimizer_base import SERVER_OPTIMIZERS, WEIGHT, Hparam, ServerOptimizer

_UNIT = {"minimum": 0.0, "maximum": 1.0}
NO_ADAPTIVE_DEFAULT_LR = (
    "its step m/(sqrt(v)+tau) moves every weight by about server.lr per round, so no default fits every "
    "model (Flower's: fedadam 0.1, fedyogi 0.01; docs/explanation/rl-objective.md)"
)


@SERVER_OPTIMIZERS.register
class FedAvg(ServerOptimizer):
    name = "fedavg"

    def step(self, w, delta, state):
        return w.add_(delta, alpha=self.lr)

    def bound(self, p, d, old, got):
        """w = p + ηd."""
        from fedagent.server.bounds import axpy

        return {WEIGHT: axpy(p, self.lr, d, 0.0)}


@SERVER_OPTIMIZERS.register
class FedAvgM(ServerOptimizer):
    name = "fedavgm"
    HPARAMS = (Hparam("momentum", 0.9, "FedAvgM's β", **_UNIT),)
    slots = ("m",)

    def step(self, w, delta, state):
        m = state["m"].mul_(self.momentum).add_(delta)
        return w.add_(m, alpha=self.lr)

    def bound(self, p, d, old, got):
        """m = βm₀ + d; w = p + ηm."""
        from fedagent.server.bounds import axpy, lin

        m = lin(self.momentum, old["m"], 1.0, d)
        return {WEIGHT: axpy(p, self.lr, *m), "m": m}


@SERVER_OPTIMIZERS.register
class FedAdam(ServerOptimizer):
    name = "fedadam"
    HPARAMS = (
        Hparam("beta1", 0.9, "FedAdam/FedYogi first-moment decay", **_UNIT),
        Hparam("beta2", 0.99, "FedAdam/FedYogi second-moment decay", **_UNIT),
        Hparam("tau", 1e-3, "FedAdam/FedYogi adaptivity", exclusive_minimum=0.0),
    )
    slots = ("m", "v")
    default_lr = None
    no_default_lr = NO_ADAPTIVE_DEFAULT_LR

    def __init__(self, lr: float = 1e-2, *values: float, **hparams: float) -> None:
        super().__init__(lr, *values, **hparams)

    def init_state(self, like):
        import torch

        return {
            "m": torch.zeros_like(like, dtype=torch.float32),
            "v": torch.full_like(like, self.tau**2, dtype=torch.float32),
        }

    def _second_moment(self, v, d2):
        return v.mul_(self.beta2).add_(d2, alpha=1 - self.beta2)

    def step(self, w, delta, state):
        m = state["m"].mul_(self.beta1).add_(delta, alpha=1 - self.beta1)
        v = self._second_moment(state["v"], delta * delta)
        return w.addcdiv_(m, v.sqrt().add_(self.tau), value=self.lr)

    def _second_moment_bound(self, v0, d2, got_v):
        from fedagent.server.bounds import adam_v

        return adam_v(v0, d2, self.beta2)

    def bound(self, p, d, old, got):
        """m, v, then w = p + ηm/(√v + τ)."""
        from fedagent.server.bounds import adaptive_w, lin

        m = lin(self.beta1, old["m"], 1 - self.beta1, d)
        v = self._second_moment_bound(old["v"], d * d, got["v"])  # d*d exact: 24-bit significands
        return {WEIGHT: adaptive_w(p, self.lr, m, v, self.tau), "m": m, "v": v}


@SERVER_OPTIMIZERS.register
class FedYogi(FedAdam):
    name = "fedyogi"

    def _second_moment(self, v, d2):
        import torch

        return v.sub_(d2 * torch.sign(v - d2), alpha=1 - self.beta2)

    def _second_moment_bound(self, v0, d2, got_v):
        from fedagent.server.bounds import yogi_v

        return yogi_v(v0, d2, self.beta2, got_v)
