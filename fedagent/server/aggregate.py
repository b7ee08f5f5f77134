"""``fedagent aggregate``: the round's client deltas → one pseudo-gradient, fp32, streamed.

By default the weighted mean Δ̄ = Σ_i w_i Δ_i, accumulated in fp32 whatever the stored dtype;
``--aggregator`` picks another rule (fedagent.server.aggregators: median, trimmed mean, Multi-Krum,
DP-FedAvg). A client's delta Δ_i is what its update's format says (fedagent.server.update_format):
client_i − prev for a full update, (α/r)·B_i·A_i (float64 products) on each adapted weight and 0
elsewhere for a LoRA update; every rule sees the same dense fp32 deltas either way. One chunk at a
time: peak memory is a few chunks times M, never the model times M; a rule that needs whole-model
statistics first (Krum's distances, DP's norms) reads the updates twice. Output:
``delta.safetensors`` (dense: every tensor of prev; fp32, or bf16 with ``--dtype bfloat16``, a bf16
global model's: the config's ``model_dtype``) + ``aggregate.json`` + manifest; when prev carries a PPO
critic (``critic/``, fedagent.model.critic_dir), ``critic/delta.safetensors`` + ``critic/aggregate.json``
too, with the same client weights and rule. A client update that records a Byzantine transform
(fedagent.train.update_transform) is listed in aggregate.json (``byzantine``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import torch

from fedagent.core.atomic import ManifestError, atomic_dir, verifying
from fedagent.model.update_layout import FORMAT_RECORD
from fedagent.server.update_format import CRITIC, FULL_MODEL, StructureError, UpdateFormat, format_of
from fedagent.server.aggregators import (  # noqa: F401 - add_aggregator_arg, aggregator_from_args re-exported
    AGGREGATORS,
    CONTEXT_KEYS,
    DEFAULT_AGGREGATOR,
    Aggregator,
    RoundContext,
    RuleError,
    Span,
    add_aggregator_arg,
    aggregator_from_args,
    make_aggregator,
)
from fedagent.model.hf_dir import (
    DTYPES,
    ITEMSIZE,
    SafetensorsWriter,
    TensorInfo,
    TensorReader,
    STORE_CODES,
    chunks,
)

from fedagent.server.round_clients import (  # noqa: F401 - re-exported: the aggregate's public names
    AGGREGATE_KEYS,
    METRIC_OF,
    METRICS,
    WEIGHTINGS,
    AggregateError,
    byzantine_updates,
    client_weights,
    survivors,
)

DELTA_FILE = "delta.safetensors"
AGG_JSON = "aggregate.json"


def check_structure(
    prev_dir: Path, client_dirs: Sequence[Path], fmt: UpdateFormat | None = None
) -> tuple[dict[str, TensorInfo], list]:
    """Tensor index of prev and what each client's deltas are read from, by the updates' format
    (``fmt``, default :func:`fedagent.server.update_format.format_of` the clients); refuses any
    name/shape/dtype disagreement."""
    try:
        return (fmt or format_of(client_dirs)).check_structure(prev_dir, client_dirs)
    except StructureError as exc:
        raise AggregateError(str(exc)) from None


CHUNK_ELEMS = 1 << 20  # 4 MiB of fp32: prev, sum and one client chunk stay in the CPU cache


class ChunkScratch:
    """Buffers reused for every chunk of a stream: raw bytes and fp32 for prev and one
    client, plus the sum. Allocating them per chunk let glibc's heap grow with M (peak RSS
    +13 % at M=8 vs M=2, bench/aggregate.py); reused, memory is the same whatever M."""

    def __init__(self, chunk: int):
        """Room for ``chunk`` elements of the widest stored dtype."""
        width = max(ITEMSIZE.values())
        self.raw = [torch.empty(chunk * width, dtype=torch.uint8) for _ in range(2)]
        self.f32 = [torch.empty(chunk, dtype=torch.float32) for _ in range(2)]
        self.acc = torch.empty(chunk, dtype=torch.float32)

    def read_f32(self, reader: TensorReader, info: TensorInfo, begin: int, end: int, slot: int) -> torch.Tensor:
        """Elements ``[begin, end)`` as fp32 in buffer ``slot`` (0: prev, 1: a client); exact upcast."""
        t = reader.read_range(info, begin, end, out=self.raw[slot])
        if t.dtype == torch.float32:
            return t
        return self.f32[slot][: end - begin].copy_(t)


def _delta_chunk(
    span: Span,
    prev: TensorInfo,
    clients: Sequence,
    weights: Sequence[float],
    reader: TensorReader,
    client_dirs: Sequence[Path],
    scratch: ChunkScratch,
    aggregator: Aggregator,
    fmt: UpdateFormat,
) -> torch.Tensor:
    name, begin, end = span.name, span.begin, span.end
    p = scratch.read_f32(reader, prev, begin, end, 0)
    deltas = fmt.chunk_deltas(reader, scratch, name, prev, p, clients, begin, end)
    acc = aggregator.reduce(deltas, weights, scratch.acc[: end - begin], span)
    # A finite sum implies every element is finite (NaN/Inf propagate), and summing is ~50×
    # cheaper than torch.isfinite(...).all(); only on failure look for the culprit.
    if not math.isfinite(float(acc.sum())) and not bool(torch.isfinite(acc).all()):
        if not bool(torch.isfinite(p).all()):
            raise AggregateError(f"prev: tensor {name!r} contains NaN/Inf")
        culprit = fmt.nonfinite(reader, name, clients, client_dirs, begin, end)
        if culprit:
            raise AggregateError(culprit)
        raise AggregateError(f"tensor {name!r}: the weighted delta overflows fp32")
    return acc


def _stored(t: torch.Tensor, store: str) -> torch.Tensor:
    """``t`` (fp32) as the delta is stored (``store``: float32, or bfloat16 for a bf16 global model)."""
    want = DTYPES[STORE_CODES[store]]
    return t if t.dtype == want else t.to(want)


@contextlib.contextmanager
def one_thread():
    """Run torch with one intra-op thread inside the block (restored after).

    These elementwise ops are memory-bound, and on a busy 2-core machine OpenMP's barrier
    waits made them 5-20x slower with two threads than with one (measured).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def survey(
    prev: dict[str, TensorInfo],
    clients: Sequence,
    aggregator: Aggregator,
    *,
    chunk: int = CHUNK_ELEMS,
    fmt: UpdateFormat = FULL_MODEL,
) -> dict:
    """A surveying rule's first pass (fedagent.server.aggregators): every chunk of every client's fp32
    delta (by ``fmt``, the updates' format: the same deltas the reduce pass sees), stacked M × n, in the
    model's order; returns the rule's decision. A NaN/Inf here is left for the reduce pass to name."""
    scratch = ChunkScratch(chunk)
    with one_thread(), TensorReader() as reader:
        for n, info in prev.items():
            for begin, end in chunks(info.numel, chunk):
                p = scratch.read_f32(reader, info, begin, end, 0)
                deltas = fmt.chunk_deltas(reader, scratch, n, info, p, clients, begin, end)
                aggregator.survey(aggregator.stacked(deltas, end - begin))
    return aggregator.decide()


def stream_delta(
    path: Path,
    prev: dict[str, TensorInfo],
    clients: Sequence,
    weights: Sequence[float],
    client_dirs: Sequence[Path],
    *,
    chunk: int = CHUNK_ELEMS,
    aggregator: Aggregator | None = None,
    fmt: UpdateFormat = FULL_MODEL,
    store: str = "float32",
) -> None:
    """Write the aggregate of the clients' deltas (default: Σ w_i Δ_i; Δ_i by ``fmt``, the updates'
    format: client_i − prev for full updates) as one safetensors file, chunk by chunk: reduced in fp32,
    stored in ``store`` (the run's model_dtype: float32, or bfloat16 for a bf16 global model).
    ``clients``: what ``fmt.check_structure`` returned for them; ``aggregator``: started (and, a
    surveying rule, decided).

    Memory is a few chunks (times M for a rule that needs every client's chunk at once) whatever the
    tensor sizes; inputs are read once.
    """
    names = list(prev)
    if aggregator is None:
        aggregator = make_aggregator()
        aggregator.start(len(clients), weights)
    scratch = ChunkScratch(chunk)
    with (
        one_thread(),
        TensorReader() as reader,
        SafetensorsWriter(path, [(n, STORE_CODES[store], prev[n].shape) for n in names]) as writer,
    ):
        for index, n in enumerate(names):
            numel = prev[n].numel
            for begin, end in chunks(numel, chunk):
                # write_part copies the bytes out before the next chunk reuses the buffer; stored in
                # ``store``'s dtype (bfloat16: rounded once from the fp32 result)
                writer.write_part(
                    n,
                    _stored(
                        _delta_chunk(
                            Span(n, index, begin, end, numel),
                            prev[n],
                            clients,
                            weights,
                            reader,
                            client_dirs,
                            scratch,
                            aggregator,
                            fmt,
                        ),
                        store,
                    ),
                )


def _summary(
    prev_dir: Path,
    client_dirs: Sequence[Path],
    weights: Sequence[float],
    weighting: str,
    prev: dict[str, TensorInfo],
    aggregator: str = DEFAULT_AGGREGATOR,
    fmt: UpdateFormat = FULL_MODEL,
    store: str = "float32",
) -> dict:
    """aggregate.json's content for one model (the actor, or its critic); the rule's record is added
    once it has run."""
    rule = {} if aggregator == DEFAULT_AGGREGATOR else {"aggregator": aggregator}  # the mean: as it was
    # the updates' format when not full models (a full round's aggregate.json stays as it was)
    form = {} if fmt is FULL_MODEL else {FORMAT_RECORD: fmt.name}
    return {
        **rule,
        **form,
        "format": "fedagent-aggregate-v1",
        "prev": str(prev_dir),
        "weighting": weighting,
        "clients": [{"dir": str(d), "weight": w} for d, w in zip(client_dirs, weights)],
        "num_tensors": len(prev),
        "num_elements": sum(i.numel for i in prev.values()),
        "dtype": STORE_CODES[store],
    }


def start_rule(
    name: str,
    hparams: dict,
    context: RoundContext,
    weighting: str,
    n_clients: int,
    weights: Sequence[float],
    critic: bool = False,
) -> Aggregator:
    """The rule for one model (the actor, or a critic), started on the round's M and weights; refusals
    (a weighting it does not take, a critic it does not privatize, an M it cannot run on) as
    :class:`AggregateError`."""
    try:
        rule = make_aggregator(name, context, **hparams)
        problem = rule.weighting_problem(weighting)
        if problem:
            raise RuleError(problem)
        if critic and not rule.critic:
            raise RuleError(f"aggregator {name}: {rule.critic_why}")
        rule.start(n_clients, weights)
    except RuleError as exc:
        raise AggregateError(str(exc)) from None
    return rule


def _run_rule(rule: Aggregator, prev, clients, summary: dict, fmt: UpdateFormat = FULL_MODEL) -> None:
    """The survey of a surveying rule; then the rule's record into ``summary`` (not for the mean)."""
    if rule.SURVEYS:
        survey(prev, clients, rule, fmt=fmt)
    if rule.name != DEFAULT_AGGREGATOR:
        summary["rule"] = rule.record()


def aggregate(
    prev_dir: Path,
    client_dirs: Sequence[Path],
    out_dir: Path,
    *,
    weighting: str = "uniform",
    quarantine: Path | None = None,
    check_manifests: bool = True,
    min_clients: int | None = None,
    weights: Sequence[float] | None = None,
    aggregator: str = DEFAULT_AGGREGATOR,
    hparams: dict | None = None,
    context: RoundContext | None = None,
    store: str = "float32",
) -> dict:
    """Write the round's pseudo-gradient (default: Δ̄ = Σ w_i Δ_i; Δ_i by the updates' format:
    client_i − prev, or a LoRA update's ΔW_i) to ``out_dir`` atomically; return aggregate.json's content.

    ``aggregator``: the rule (fedagent.server.aggregators; the weighted mean by default) with its
    ``hparams`` and round ``context``; recorded in aggregate.json (``aggregator``, ``rule``) and
    provenance.json when it is not the mean. The rule's :meth:`~Aggregator.notes` and the round's
    Byzantine clients go into aggregate.json's ``round_notes`` (the report's columns). ``store``: the
    delta's dtype, the run's ``model_dtype`` (float32; bfloat16 for a bf16 global model), recorded in
    aggregate.json.

    Client directories holding a drop record are left out if at least ``min_clients`` updates
    remain (None: strict, none may be dropped); aggregate.json and provenance.json list them.
    ``weights`` (weighting ``weights`` only): one per entry of ``client_dirs``; the survivors'
    are rescaled to sum 1.
    """
    from fedagent.core.provenance import write_provenance

    prev_dir, out_dir = Path(prev_dir), Path(out_dir)
    client_dirs = [Path(d) for d in client_dirs]
    hparams = {k: v for k, v in (hparams or {}).items() if v is not None}
    context = context or RoundContext()
    AGGREGATE_KEYS.check(
        {
            "weighting": weighting,
            "aggregator": aggregator,
            **hparams,
            **{k: v for k, v in dataclasses.asdict(context).items() if k in CONTEXT_KEYS and v is not None},
        }
    )
    if len(set(map(str, client_dirs))) != len(client_dirs):
        raise AggregateError(f"a client directory is listed twice: {[str(d) for d in client_dirs]}")
    # The inputs' hashes run in threads beside the reads and the arithmetic; the output is committed
    # only once they all matched (a mismatch raises inside atomic_dir: nothing reaches out_dir).
    with verifying([prev_dir, *client_dirs], enabled=check_manifests) as checked:
        given = None
        if weights is not None:
            if len(weights) != len(client_dirs):
                raise AggregateError(f"{len(weights)} client weights for {len(client_dirs)} clients")
            given = dict(zip(map(str, client_dirs), map(float, weights)))
        client_dirs, dropped = survivors(client_dirs, min_clients)
        weights = client_weights(
            client_dirs, weighting, None if given is None else [given[str(d)] for d in client_dirs]
        )
        fmt = format_of(client_dirs)
        prev, clients = check_structure(prev_dir, client_dirs, fmt)
        if store not in STORE_CODES:
            raise AggregateError(f"--dtype {store!r}: one of {sorted(STORE_CODES)}")
        rule = start_rule(aggregator, hparams, context, weighting, len(client_dirs), weights)
        summary = _summary(prev_dir, client_dirs, weights, weighting, prev, aggregator, fmt, store)
        if dropped:  # only then: an undropped round's aggregate.json stays as it was
            summary["dropped"] = dropped
        byzantine = byzantine_updates(client_dirs)
        if byzantine:  # only then: an honest round's aggregate.json stays as it was
            summary["byzantine"] = byzantine
        # PPO (fedagent.model.critic_dir): a critic/ beside prev is aggregated the same way, same weights.
        critic = CRITIC.pairs(prev_dir, client_dirs)
        if critic is not None:
            critic_prev, critic_clients = check_structure(*critic)
            critic_rule = start_rule(aggregator, hparams, context, weighting, len(client_dirs), weights, critic=True)
            critic_summary = _summary(critic[0], critic[1], weights, weighting, critic_prev, aggregator, store=store)
            summary["critic"] = {"dir": CRITIC.subdir, "num_tensors": len(critic_prev)}
        with atomic_dir(out_dir, quarantine) as stage:
            _run_rule(rule, prev, clients, summary, fmt)
            notes = {
                **rule.notes(),
                **({"byzantine_clients": " ".join(str(b["client"]) for b in byzantine)} if byzantine else {}),
            }
            if notes:  # only then: a mean, honest round's aggregate.json stays as it was
                summary["round_notes"] = notes
            stream_delta(stage / DELTA_FILE, prev, clients, weights, client_dirs, aggregator=rule, fmt=fmt, store=store)
            (stage / AGG_JSON).write_text(json.dumps(summary, indent=2) + "\n")
            if critic is not None:
                (stage / CRITIC.subdir).mkdir()
                _run_rule(critic_rule, critic_prev, critic_clients, critic_summary)
                stream_delta(
                    stage / CRITIC.subdir / DELTA_FILE,
                    critic_prev,
                    critic_clients,
                    weights,
                    critic[1],
                    aggregator=critic_rule,
                    store=store,
                )
                (stage / CRITIC.subdir / AGG_JSON).write_text(json.dumps(critic_summary, indent=2) + "\n")
            params = {"weighting": weighting, "min_clients": min_clients}
            if given is not None:  # only then: other weightings' provenance stays as it was
                params["client_weights"] = given
            if aggregator != DEFAULT_AGGREGATOR:  # only then: a mean round's provenance stays as it was
                params["aggregator"] = aggregator
                params["rule"] = {"hparams": rule.hparams(), "context": rule.context_record()}
            if store != "float32":  # likewise: an fp32 round's provenance stays as it was
                params["dtype"] = store
            write_provenance(
                stage,
                job="aggregate",
                params=params,
                extra={"clients": [str(d) for d in client_dirs], "dropped": dropped},
            )
            checked.wait()  # every input's sha256 matched its manifest: only then the commit
    return summary


def add_dtype_arg(parser: argparse.ArgumentParser) -> None:
    """``--dtype``, shared by ``fedagent aggregate``, ``merge`` and ``verify``: what the delta and the next
    global model's weights are stored in (the config's ``model_dtype``)."""
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(STORE_CODES),
        help="the global model's dtype (model_dtype): the aggregate delta and the merged weights are stored in it",
    )


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``fedagent aggregate``."""
    parser.add_argument("--prev", required=True, type=Path, help="previous global model dir")
    parser.add_argument("--clients", required=True, nargs="+", type=Path, help="client update dirs")
    parser.add_argument("--weighting", default="uniform", choices=WEIGHTINGS)
    add_aggregator_arg(parser)
    add_dtype_arg(parser)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--quarantine", type=Path, default=None, help="where failed attempts go")
    parser.add_argument(
        "--client-weights",
        type=float,
        nargs="+",
        default=None,
        help="weighting 'weights': one per --clients entry (aggregate.weights of these clients)",
    )
    parser.add_argument(
        "--min-clients",
        type=int,
        default=0,
        help="aggregate the survivors if at least this many clients finished (0: strict, all)",
    )


def run(args: argparse.Namespace) -> int:
    """CLI entry: 0 on success, 1 with a message naming the refused input."""
    try:
        name, hparams, context = aggregator_from_args(args)
        s = aggregate(
            args.prev,
            args.clients,
            args.out,
            weighting=args.weighting,
            quarantine=args.quarantine,
            min_clients=args.min_clients or None,
            weights=args.client_weights,
            aggregator=name,
            hparams=hparams,
            context=context,
            store=args.dtype,
        )
    except (AggregateError, ManifestError, OSError, ValueError) as exc:
        print(f"aggregate: refused: {exc}", file=sys.stderr)
        return 1
    dropped = f", {len(s['dropped'])} dropped" if s.get("dropped") else ""
    rule = f", rule {s['aggregator']}" if "aggregator" in s else ""
    notes = "".join(f", {k}={v}" for k, v in s.get("round_notes", {}).items())
    print(
        f"aggregate: {len(s['clients'])} clients{dropped}, {s['num_tensors']} tensors, weighting {s['weighting']}"
        f"{rule}{notes} -> {args.out}"
    )
    return 0
