"""A round's clients as the aggregate takes them: who finished (drop records), how each weighs
(``aggregate.weighting``) and which updates record a Byzantine transform; the aggregate job's keys and
its refusal. Split from fedagent.server.aggregate (which re-exports these names), which streams the
tensors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from fedagent.core.config import JobKeys
from fedagent.model.update_layout import METRICS_JSON as METRICS
from fedagent.server.aggregators import AGGREGATORS, CONTEXT_KEYS

WEIGHTINGS = ("uniform", "samples", "tokens", "episodes", "weights")
METRIC_OF = {"samples": "num_samples", "tokens": "num_tokens", "episodes": "num_episodes"}


class AggregateError(RuntimeError):
    """An input is refused; the message names the client directory and tensor."""


# The aggregate job's parameters: the weighting, the rule and every rule's job hyper-parameters, and
# the round context a rule may take (the run's seed and N, M). Checked as planning checked them.
AGGREGATE_KEYS = JobKeys(
    "aggregate",
    {
        "weighting": "aggregate.weighting",
        "aggregator": "aggregate.aggregator",
        **{n: f"aggregate.{n}" for n, h in AGGREGATORS.hparams().items() if not h.plan_only},
        **CONTEXT_KEYS,
    },
)


def client_weights(client_dirs: Sequence[Path], weighting: str, given: Sequence[float] | None = None) -> list[float]:
    """Normalised weights: uniform; proportional to metrics.json num_samples (per-turn samples: a
    client whose episodes run longer weighs more), num_tokens or num_episodes; or ``weights``: the
    ``given`` values (``aggregate.weights``' entries of these clients, in their order) rescaled to
    sum 1 — the whole list sums to 1 (checked at plan time), so a round of every client uses it as is."""
    AGGREGATE_KEYS.check({"weighting": weighting})
    if weighting not in WEIGHTINGS:
        raise AggregateError(f"unknown weighting {weighting!r} (choose from {WEIGHTINGS})")
    if not client_dirs:
        raise AggregateError("no clients to aggregate")
    if (given is not None) != (weighting == "weights"):
        raise AggregateError(
            f"weighting {weighting!r} "
            + ("needs the clients' weights (--client-weights)" if given is None else "takes no --client-weights")
        )
    if weighting == "weights":
        if len(given) != len(client_dirs):
            raise AggregateError(f"{len(given)} client weights for {len(client_dirs)} clients")
        if any(not math.isfinite(float(w)) or float(w) < 0 for w in given):
            raise AggregateError(f"client weights {list(given)} are not all finite and >= 0")
        total = math.fsum(float(w) for w in given)
        if total <= 0:
            raise AggregateError(f"client weights {list(given)} of {[str(d) for d in client_dirs]} sum to 0")
        return [float(w) / total for w in given]
    if weighting == "uniform":
        return [1.0 / len(client_dirs)] * len(client_dirs)
    key = METRIC_OF[weighting]
    raw = []
    for d in client_dirs:
        try:
            value = json.loads((Path(d) / METRICS).read_text())[key]
        except (OSError, ValueError, KeyError) as exc:
            raise AggregateError(f"client {d}: cannot read {key} from {METRICS} ({exc!r})") from exc
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise AggregateError(f"client {d}: {key}={value!r} is not a non-negative number")
        raw.append(float(value))
    total = math.fsum(raw)
    if total <= 0:
        raise AggregateError(f"weighting {weighting!r}: all clients report {key}=0")
    return [v / total for v in raw]


def survivors(client_dirs: Sequence[Path], min_clients: int | None) -> tuple[list[Path], list[dict]]:
    """Split client outputs into updates and drop records (``dropped.json``, see fedagent.server.dropout).

    ``min_clients`` None is strict: any drop record is refused. Otherwise at least that many
    updates must be there. Raises :class:`AggregateError` naming the dropped clients and why.
    """
    from fedagent.server.dropout import drop_reason, is_dropped

    kept = [Path(d) for d in client_dirs if not is_dropped(d)]
    dropped = [{"dir": str(d), "reason": drop_reason(d)} for d in client_dirs if is_dropped(d)]
    need = len(client_dirs) if min_clients is None else min_clients
    if len(kept) < need:
        names = "; ".join(f"{d['dir']}: {d['reason']}" for d in dropped)
        rule = "strict: clients.min_per_round unset" if min_clients is None else f"clients.min_per_round={min_clients}"
        raise AggregateError(f"only {len(kept)} of {len(client_dirs)} clients finished ({rule}); dropped: {names}")
    return kept, dropped


def byzantine_updates(client_dirs: Sequence[Path]) -> list[dict]:
    """The updates whose metrics.json records a Byzantine transform (fedagent.train.update_transform):
    ``{dir, client, transform}`` each, in client order."""
    from fedagent.core.registry import TRANSFORM_RECORD

    out = []
    for d in client_dirs:
        path = Path(d) / METRICS
        if not path.exists():  # a model dir given as an update (no job records): nothing transformed it
            continue
        try:
            metrics = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise AggregateError(f"client {d}: cannot read {METRICS} ({exc!r})") from exc
        rec = metrics.get(TRANSFORM_RECORD) if isinstance(metrics, dict) else None
        if rec:
            out.append({"dir": str(d), "client": metrics.get("client", Path(d).name), "transform": rec})
    return out
