"""What a server optimizer is: one class carrying its step, hyper-parameters, default η, state slots
and verify's bound, registered in :data:`SERVER_OPTIMIZERS` by name.

The pseudo-gradient is the aggregated delta Δ̄ (mean client − previous global, a descent
direction already); a step maps (weight, Δ̄, state) to the new weight, tensor by tensor, in fp32.
The class is the single place an optimizer is described; everything that lists optimizers reads
the registry: the config schema (``server.optimizer``'s choices, one key ``server.<name>`` per
:class:`Hparam`), the ``fedagent merge``/``verify`` flags and the workflow's merge params
(fedagent.server.optimizers), the ``server.lr`` rule below, ``fedagent verify``'s recomputation
(:meth:`ServerOptimizer.bound`) and the disk estimate (``slots``).
docs/how-to/add-a-server-optimizer.md shows a new one end to end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from fedagent.core.rules import cross_rule
from fedagent.core.registry import SERVER_OPTIMIZERS, Hparam

if TYPE_CHECKING:  # torch is imported where tensors are touched: the workflow plans with this module
    import torch

    from fedagent.server.bounds import Bound

__all__ = ["SERVER_OPTIMIZERS", "Hparam", "ServerOptimizer", "WEIGHT", "LR_FLAG"]

WEIGHT = "weight"  # the model tensor's key among a bound's outputs (beside the state slots)
LR_FLAG = "--server-lr"  # η's flag; ``server.lr`` in the config, shared by every optimizer


class ServerOptimizer:
    """Base class. A subclass sets ``name``, declares ``HPARAMS`` (beyond η), ``slots`` (the per-tensor
    fp32 state), ``default_lr`` (η for ``server.lr: null``, or None with ``no_default_lr`` saying why),
    and implements :meth:`step` (the fp32 update) and :meth:`bound` (verify's float64 recomputation
    with the fp32 error bound of every output)."""

    name: ClassVar[str] = ""
    HPARAMS: ClassVar[tuple[Hparam, ...]] = ()
    slots: ClassVar[tuple[str, ...]] = ()
    default_lr: ClassVar[float | None] = 1.0
    no_default_lr: ClassVar[str] = ""

    def __init__(self, lr: float = 1.0, *values: float, **hparams: float) -> None:
        """η, then the hyper-parameters in ``HPARAMS`` order (positional or by name; omitted: default)."""
        if len(values) > len(self.HPARAMS):
            raise TypeError(f"server optimizer {self.name} takes {len(self.HPARAMS)} hyper-parameters besides lr")
        hparams = {**dict(zip((h.name for h in self.HPARAMS), values)), **hparams}
        unknown = sorted(set(hparams) - {h.name for h in self.HPARAMS})
        if unknown:
            raise TypeError(f"server optimizer {self.name} takes no {unknown}")
        self.lr = float(lr)
        for h in self.HPARAMS:
            setattr(self, h.name, float(hparams.get(h.name, h.default)))

    def hparams(self) -> dict:
        """Hyper-parameters recorded in server.json, η first (a resume must use the same)."""
        return {"lr": self.lr, **{h.name: getattr(self, h.name) for h in self.HPARAMS}}

    @classmethod
    def lr_problem(cls, lr: float | None) -> str | None:
        """Why ``server.lr`` = ``lr`` cannot run this optimizer, or None."""
        if lr is None and cls.default_lr is None:
            return f"server.optimizer {cls.name} needs an explicit server.lr: {cls.no_default_lr}"
        return None

    def init_state(self, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fresh fp32 state for one tensor (zeros)."""
        import torch

        return {s: torch.zeros_like(like, dtype=torch.float32) for s in self.slots}

    def step(self, w: torch.Tensor, delta: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Return the new fp32 weight for one tensor (``w`` and ``delta`` fp32; may be modified);
        update ``state``'s tensors in place."""
        raise NotImplementedError

    def bound(
        self, p: torch.Tensor, d: torch.Tensor, old: dict[str, torch.Tensor], got: dict[str, torch.Tensor]
    ) -> dict[str, Bound]:
        """verify: the exact (float64) new weight (key :data:`WEIGHT`) and state slots of one tensor,
        each with the bound on |fp32 result − exact| that :meth:`step`'s rounding allows.

        ``p`` prev, ``d`` the stored delta, ``old`` the previous state (all float64, exact inputs);
        ``got`` the stored results, for a step whose branch rounding may flip (FedYogi's sign).
        The building blocks and their error analysis are in fedagent.server.bounds."""
        raise NotImplementedError(f"server optimizer {self.name} defines no bound: fedagent verify cannot check it")


# violation: a built-in without a default η (the tests derive their bad config from it)
@cross_rule("server.lr", ["server.optimizer", "server.lr"], violation={"server.optimizer": "fedadam"})
def _server_lr_for_the_optimizer(get):
    # the registry knows the name (the schema's enum is checked first, at plan time and in the job)
    name = get("server.optimizer")
    return SERVER_OPTIMIZERS[name].lr_problem(get("server.lr")) if name in SERVER_OPTIMIZERS else None
