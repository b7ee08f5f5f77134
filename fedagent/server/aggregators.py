"""How the client deltas of a round become one pseudo-gradient: an :class:`Aggregator` per rule.

``fedagent aggregate`` streams every tensor chunk by chunk and hands each chunk's client deltas
(c_i − p, fp32) to the aggregator's :meth:`~Aggregator.reduce`; ``fedagent verify`` hands the same
deltas in float64 to its :meth:`~Aggregator.exact`, which returns the exact result and the
per-element tolerance of ``reduce``'s fp32 rounding. Both find the class by name in
:data:`AGGREGATORS` (built-ins here, registered by a decorator; others by an entry point of
``fedagent.aggregators``), so a robust rule (median, trimmed mean, Krum) or a wrapper (norm
clipping, DP noise with a recorded seed) is one class. The weighted mean is the only rule today;
aggregate.json and provenance.json record another rule's name (``aggregator``: absent means the
mean, so a mean round's files stay what they were), and verify checks it against ``--aggregator``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Iterable, Sequence

from fedagent.core.registry import Registry

if TYPE_CHECKING:
    import torch

AGGREGATORS = Registry("aggregator", "fedagent.aggregators", "fedagent.server.aggregators")
DEFAULT_AGGREGATOR = "mean"
U32 = 2.0**-24  # fp32 unit roundoff


class Aggregator:
    """Base: ``name``; ``reduce`` (fp32, streamed) and ``exact`` (float64, verify's recomputation)."""

    name: ClassVar[str] = ""

    def reduce(self, deltas: Iterable[torch.Tensor], weights: Sequence[float], out: torch.Tensor) -> torch.Tensor:
        """The aggregate of one chunk into ``out`` (fp32) from the clients' fp32 deltas c_i − p, in
        client order (each tensor is a reused buffer: valid until the next one is drawn)."""
        raise NotImplementedError

    def exact(self, deltas: Iterable[torch.Tensor], weights: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """verify: the exact (float64) aggregate of one tensor from its float64 deltas, and the bound
        on |fp32 result − exact| per element."""
        raise NotImplementedError(f"aggregator {self.name} defines no exact(): fedagent verify cannot check it")


@AGGREGATORS.register
class WeightedMean(Aggregator):
    """Δ̄ = Σ_i w_i (c_i − p), accumulated in fp32 in client order.

    Tolerance, per element: |stored − exact| ≤ (M + 3) · u · S with u = 2⁻²⁴ (fp32 unit roundoff)
    and S = Σ_i w_i |c_i − p| + |Δ_exact|. Why: aggregate forms fl(c_i − p) (one rounding), scales
    by an fp32-rounded weight (two more) and sums M terms recursively (M − 1 roundings); the
    standard bound for that is (M + 2)·u·Σ|terms| + O(u²), and one more u covers the final fp32
    store. Bounding by the magnitude of the *terms* (not of the result) keeps it sound when client
    deltas cancel, and it is far tighter than a fixed 1e-4: any tampering larger than a few fp32
    ulps of the terms is caught. bf16/fp16 → fp32 is exact, so stored dtype adds nothing.
    """

    name = "mean"

    def reduce(self, deltas, weights, out):
        import torch

        for i, (d, w) in enumerate(zip(deltas, weights)):
            if i == 0:
                torch.mul(d, w, out=out)
            else:
                out.add_(d, alpha=w)
        return out

    def exact(self, deltas, weights):
        exact = mag = None
        for d, w in zip(deltas, weights):
            if exact is None:
                exact, mag = d * w, d.abs() * w
            else:
                exact.add_(d, alpha=w)
                mag.add_(d.abs(), alpha=w)
        mag.add_(exact.abs())
        return exact, (len(weights) + 3) * U32 * mag


def make_aggregator(name: str = DEFAULT_AGGREGATOR) -> Aggregator:
    """The aggregator registered as ``name`` (ValueError naming the known ones)."""
    try:
        return AGGREGATORS[name]()
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None


def recorded(summary: dict) -> str:
    """The aggregator an aggregate.json names (none recorded: the mean)."""
    return summary.get("aggregator", DEFAULT_AGGREGATOR)
