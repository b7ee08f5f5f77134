"""The privacy accountant of client-level DP (fedagent.server.dp_fedavg): ε of a run, from Google's
``dp-accounting`` library (its RDP accountant), never by hand.

What is accounted is the mechanism the run executes. Each round the server takes a uniformly random
fixed-size set of M of the N clients (fedagent.plan.selection: sampling without replacement, fresh
every round), clips each update to L2 norm C, averages them and adds Gaussian noise of standard
deviation σ·C·max_i w_i (σ·C/M with uniform weights). The protected unit is a client (its whole
local data set), and the neighbouring relation is replace-one client: with fixed-size sampling the
number of clients is public, so add/remove-one does not apply. Replacing one client's update moves
the clipped weighted sum by at most 2·C·max_i w_i, so the Gaussian mechanism's noise multiplier
relative to its sensitivity is σ/2. Per round that is dp-accounting's
``SampledWithoutReplacementDpEvent(N, M, GaussianDpEvent(σ/2))`` (Wang, Balle & Kasiviswanathan,
AISTATS 2019), composed over the rounds by ``RdpAccountant(REPLACE_ONE)``; ε is the accountant's
(ε, δ) conversion at the configured δ. Every release is covered: each round's global model, not
only the last one.

:func:`poisson_epsilon` is the common DP-SGD statement (Poisson sampling at rate q, add/remove-one,
the same library): the form papers and TF Privacy report numbers in, kept to compare with them and
to check this module against the library's published examples. It is not the run's guarantee.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

ACCOUNTANT = (
    "dp-accounting RdpAccountant (REPLACE_ONE): per round SampledWithoutReplacementDpEvent(N, M, "
    "GaussianDpEvent(noise/2)), composed over the rounds"
)


def _lib():
    import dp_accounting  # the accounting library (pyproject: dp-accounting)

    return dp_accounting


def library_version() -> str:
    """dp-accounting's version, recorded beside every ε."""
    from importlib.metadata import version

    return version("dp-accounting")


@functools.lru_cache(maxsize=1024)
def epsilon(noise: float, clients_total: int, clients_per_round: int, rounds: int, delta: float) -> float:
    """ε after ``rounds`` rounds of DP-FedAvg with noise multiplier ``noise`` (σ: noise std / C), M of
    N clients a round (M ≥ N: every client), at ``delta``. ``inf`` without noise; 0 after no round.

    Kept per process (a pure function of its arguments): a matrix's plan checks the same DP arm once per
    seed and again in its run's module, and the library's RDP orders cost ≈ 0.2 s a call."""
    if rounds < 0 or clients_total < 1 or clients_per_round < 1 or not 0 < delta < 1 or noise < 0:
        raise ValueError(
            f"accountant: rounds={rounds}, N={clients_total}, M={clients_per_round}, δ={delta}, σ={noise} out of range"
        )
    if rounds == 0:
        return 0.0
    if noise == 0:
        return math.inf
    dp = _lib()
    from dp_accounting import privacy_accountant
    from dp_accounting.rdp import RdpAccountant

    m = min(clients_per_round, clients_total)
    event = dp.SampledWithoutReplacementDpEvent(clients_total, m, dp.GaussianDpEvent(noise / 2))
    acc = RdpAccountant(neighboring_relation=privacy_accountant.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp.SelfComposedDpEvent(event, rounds))
    return float(acc.get_epsilon(delta))


def min_noise(target: float, clients_total: int, clients_per_round: int, rounds: int, delta: float) -> float:
    """The smallest noise multiplier (to 3 significant digits, rounded up) whose ε over ``rounds`` is at
    most ``target``: what the error message of a too-small σ suggests."""
    lo, hi = 0.0, 1.0
    while epsilon(hi, clients_total, clients_per_round, rounds, delta) > target:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            return math.inf
    while hi - lo > 5e-4 * hi:  # ε falls as σ grows: bisect to 0.05 %, then round hi up
        mid = (lo + hi) / 2
        if epsilon(mid, clients_total, clients_per_round, rounds, delta) > target:
            lo = mid
        else:
            hi = mid
    digits = 2 - int(math.floor(math.log10(hi)))
    return math.ceil(hi * 10**digits) / 10**digits


def poisson_epsilon(
    noise: float, q: float, steps: int, delta: float, orders: Sequence[float] | None = None
) -> tuple[float, float]:
    """(ε, optimal RDP order) of ``steps`` Poisson-sampled Gaussian mechanisms (rate ``q``, noise
    multiplier ``noise``) under add/remove-one: the DP-SGD statement, through the same library."""
    dp = _lib()
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant(list(orders)) if orders is not None else RdpAccountant()
    acc.compose(dp.SelfComposedDpEvent(dp.PoissonSampledDpEvent(q, dp.GaussianDpEvent(noise)), steps))
    eps, order = acc.get_epsilon_and_optimal_order(delta)
    return float(eps), float(order)
