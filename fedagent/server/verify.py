"""``fedagent verify``: recompute a round in float64 from the client updates and compare.

Each client's delta is what its update's format says (fedagent.server.update_format): client − prev for a
full update, ΔW = (α/r)·B·A from a LoRA update's factors (0 on the weights it does not adapt), so a LoRA
round is recomputed from the clients' factors and the previous model, under any aggregation rule.
``--dtype bfloat16`` (a bf16 global model, the config's ``model_dtype``): the delta and the merged weights
must be bf16, and each tolerance (any rule's) adds the bf16 store's rounding, u·(|exact| + tol), u = 2⁻⁸.

A PPO critic (``critic/`` beside prev, in every client, the aggregate and the merged model:
fedagent.model.critic_dir) is recomputed the same way with the same weights and server flags; its
failures start with ``critic:``. Every value failure names the file it found. Every client's
critic folder is called ``critic``, so whose critic it is comes from its content
(fedagent.server.verify_critic: each file must have the sha256 that the client update's own
metrics.json recorded for its critic, and the critic's aggregate.json must list exactly the actor's
clients, each with ``/critic``).

Aggregate. Tolerance, per element: |stored − exact| ≤ (M + 3) · u · S with u = 2⁻²⁴ (fp32 unit roundoff) and S =
Σ_i w_i |c_i − p| + |Δ_exact|. Why: aggregate forms fl(c_i − p) (one rounding), scales by an fp32-rounded weight
(two more) and sums M terms recursively (M − 1 roundings); the standard bound for that is (M + 2)·u·Σ|terms| +
O(u²), and one more u covers the final fp32 store. Bounding by the magnitude of the *terms* (not of the result)
keeps it sound when client deltas cancel, and it is far tighter than a fixed 1e-4: any tampering larger than a
few fp32 ulps of the terms is caught. bf16/fp16 → fp32 is exact, so stored dtype adds nothing.

Server step (``--model``), for every registered server optimizer. The flags are the truth (what the
run's config asked for; same flags and defaults as ``fedagent merge``): the merged dir's
server.json must name the same optimizer and hyper-parameters, else verify fails (so a merge
run with other values is caught, and a server.json edited to match is still caught by the
values, which are recomputed from the flags); its step must be the previous state's step + 1
(1 without ``--prev-server-state``) and its round the previous round + 1. The new and the
previous ``server_state.safetensors`` must hold exactly the F32 tensors ``<slot>/<tensor>``
with the model's shapes.

The merged weights and state are recomputed in float64 by the optimizer's own
:meth:`~fedagent.server.optimizer_base.ServerOptimizer.bound` (the error analysis of the built-ins'
bounds is in fedagent.server.bounds), and the aggregate by the aggregator's
(fedagent.server.aggregators): the same classes ``fedagent merge`` and ``fedagent aggregate`` ran.
A rule other than the mean takes aggregate's flags (``--aggregator``, hyper-parameters, round context),
which aggregate.json's ``rule`` must record; a surveying rule's decision (Krum's selection, DP's norms,
noise seed and ε) is recomputed in float64 first, DP's noise drawn again bit for bit; ``byzantine``
and ``round_notes`` are checked too (fedagent.server.verify_rule).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from fedagent.server.aggregate import (
    AGG_JSON,
    DELTA_FILE,
    WEIGHTINGS,
    AggregateError,
    add_aggregator_arg,
    add_dtype_arg,
    aggregator_from_args,
    check_structure,
    client_weights,
    start_rule,
)
from fedagent.core.atomic import ManifestError, verify_manifest
from fedagent.model.update_layout import FORMAT_RECORD
from fedagent.server.update_format import CRITIC, FULL_MODEL, NonFiniteInput, UpdateFormat, format_of
from fedagent.model.hf_dir import (
    UNIT_ROUNDOFF,
    FormatError,
    TensorInfo,
    TensorReader,
    STORE_CODES,
    read_header,
    tensor_index,
)
from fedagent.server.dropout import is_dropped
from fedagent.server.verify_critic import critic_identity_failures
from fedagent.server.merge import SERVER_JSON, STATE_FILE
from fedagent.server.aggregators import DEFAULT_AGGREGATOR, Aggregator, RoundContext, Span
from fedagent.server.aggregators import recorded as recorded_aggregator
from fedagent.server.bounds import Bound
from fedagent.server import verify_rule as vr
from fedagent.server.optimizer_base import WEIGHT  # noqa: F401 - the model tensor's key among a bound's outputs
from fedagent.server.optimizers import FedAvg, ServerOptimizer, add_server_args, hparam_flags, optimizer_from_args


def _worst(name: str, diff: torch.Tensor, tol: torch.Tensor) -> str:
    ratio = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff / tol.clamp_min(1e-300))
    i = int(torch.argmax(ratio.reshape(-1)))
    bad = int((~(diff <= tol)).sum())
    return (
        f"tensor {name!r}: {bad} element(s) outside tolerance; worst flat index {i}: "
        f"|diff|={float(diff.reshape(-1)[i]):.3e} > tol={float(tol.reshape(-1)[i]):.3e}"
    )


# ---- the server step in float64: (value, error bound of fp32's result) per output --------


def recompute(
    opt: ServerOptimizer, p: torch.Tensor, d: torch.Tensor, old: dict[str, torch.Tensor], got: dict[str, torch.Tensor]
) -> dict[str, Bound]:
    """Float64 new weight and state of one tensor with fp32 error bounds.

    All tensors float64; ``old`` is the previous state, ``got`` the stored new state (Yogi's
    sign is resolved against it where rounding can flip it).
    """
    return opt.bound(p, d, old, got)


# ---- inputs and their structure -----------------------------------------------------------


@dataclass
class ServerStep:
    """Headers and server.json of the merged model dir and of the previous state (None: round 1)."""

    model: dict[str, TensorInfo]
    state: dict[str, TensorInfo]
    meta: dict
    prev_state: dict[str, TensorInfo] | None
    prev_meta: dict | None


def _load_server_step(model_dir: Path, prev_state_dir: Path | None) -> ServerStep:
    """Read the headers and server.json files (no tensor data)."""

    def meta(d: Path) -> dict:
        m = json.loads((d / SERVER_JSON).read_text())
        if not isinstance(m, dict):
            raise ValueError(f"{d / SERVER_JSON} is not a JSON object")
        return m

    prev_state = read_header(prev_state_dir / STATE_FILE) if prev_state_dir else None
    return ServerStep(
        tensor_index(model_dir),
        read_header(model_dir / STATE_FILE),
        meta(model_dir),
        prev_state,
        meta(prev_state_dir) if prev_state_dir else None,
    )


def _shape_failures(
    label: str, idx: dict[str, TensorInfo], want: dict[str, tuple[int, ...]], dtypes: dict[str, str] | None = None
) -> list[str]:
    """Names, dtype (``dtypes[name]``; default F32) and shapes of ``idx`` against ``want``."""
    if set(idx) != set(want):
        missing, extra = sorted(set(want) - set(idx)), sorted(set(idx) - set(want))
        return [f"structure: {label} tensors differ from the model's: missing {missing[:5]}, extra {extra[:5]}"]
    dtypes = dtypes or {}
    return [
        f"structure: {label} tensor {n!r} is {info.dtype}{list(info.shape)}, expected {dtypes.get(n, 'F32')}"
        f"{list(want[n])}"
        for n, info in idx.items()
        if info.shape != want[n] or info.dtype != dtypes.get(n, "F32")
    ]


def _structure_failures(
    prev: dict[str, TensorInfo],
    delta: dict[str, TensorInfo],
    server: ServerStep | None,
    opt: ServerOptimizer,
    store: str = "float32",
) -> list[str]:
    """Delta, merged weights and both server states against prev's names and shapes; the delta and the
    weights in ``store``'s dtype (the run's model_dtype), the server states in fp32."""
    shapes = {n: info.shape for n, info in prev.items()}
    stored = dict.fromkeys(prev, STORE_CODES[store])
    out = _shape_failures("aggregate delta", delta, shapes, stored)
    if server is None:
        return out
    slots = {f"{s}/{n}": shape for n, shape in shapes.items() for s in opt.slots}
    out += _shape_failures("merged model", server.model, shapes, stored)
    out += _shape_failures(f"server state ({opt.name})", server.state, slots)
    if server.prev_state is not None:
        out += _shape_failures(f"previous server state ({opt.name})", server.prev_state, slots)
    return out


def _client_name(d: Path | str) -> tuple[str, ...]:
    """How aggregate.json's client dirs are matched with verify's: the client folder's name, and
    for a critic (every one is called ``critic``) its client folder's name too."""
    d = Path(d)
    return (d.parent.name, d.name) if d.name == CRITIC.subdir else (d.name,)


def _summary_failures(
    summary: dict,
    weighting: str,
    client_dirs: Sequence[Path],
    weights: Sequence[float],
    agg_dir: Path,
    aggregator: Aggregator,
    fmt: UpdateFormat = FULL_MODEL,
) -> list[str]:
    """aggregate.json against this run: aggregator, the updates' format, weighting, clients and each
    recomputed weight."""
    out = []
    where = agg_dir / AGG_JSON
    if recorded_aggregator(summary) != aggregator.name:
        out.append(f"aggregate.json: aggregator {recorded_aggregator(summary)!r} != --aggregator {aggregator.name}")
    elif aggregator.name != DEFAULT_AGGREGATOR:
        rec = summary.get("rule") if isinstance(summary.get("rule"), dict) else {}
        for key, want in (("hparams", aggregator.hparams()), ("context", aggregator.context_record())):
            if rec.get(key) != want:
                out.append(f"aggregate.json: rule {key} {rec.get(key)!r} != the flags' {want!r} in {where}")
    if (recorded_format := summary.get(FORMAT_RECORD, FULL_MODEL.name)) != fmt.name:
        out.append(f"aggregate.json: {FORMAT_RECORD} {recorded_format!r} != the clients' {fmt.name!r} in {where}")
    recorded = [(c.get("dir"), c.get("weight")) for c in summary.get("clients", [])]
    if summary.get("weighting") != weighting:
        out.append(f"aggregate.json: weighting {summary.get('weighting')!r} != {weighting!r} in {where}")
    if [_client_name(d) for d, _ in recorded if isinstance(d, str)] != [_client_name(d) for d in client_dirs] or len(
        recorded
    ) != len(client_dirs):
        out.append(f"aggregate.json: clients {[d for d, _ in recorded]} != {[str(d) for d in client_dirs]} in {where}")
        return out
    for (d, w_rec), w in zip(recorded, weights):
        if not isinstance(w_rec, (int, float)) or abs(w_rec - w) > 1e-12 * max(1.0, abs(w)):
            out.append(f"aggregate.json: client {d} weight {w_rec} != recomputed {w}")
    return out


def _config_failures(label: str, meta: dict, opt: ServerOptimizer) -> list[str]:
    """Optimizer and hyper-parameters recorded in a server.json against the flags."""
    if meta.get("optimizer") != opt.name:
        return [f"{label}: optimizer {meta.get('optimizer')!r} != --server-opt {opt.name}"]
    rec, want = meta.get("hparams"), opt.hparams()
    rec = rec if isinstance(rec, dict) else {}
    flags = hparam_flags()
    return [
        f"{label}: hparams {k}={rec.get(k)!r} != {flags.get(k, k)} {want.get(k)!r}"
        for k in sorted(set(rec) | set(want))
        if rec.get(k) != want.get(k)
    ]


def _meta_failures(server: ServerStep, opt: ServerOptimizer) -> list[str]:
    """server.json of the merged dir (and of the previous state) against the flags and each other."""
    out = _config_failures("server.json", server.meta, opt)
    if server.prev_meta is None:
        chain = [("step", 0)]  # fresh state: step 1, whatever the round number
    else:
        out += _config_failures("previous server.json", server.prev_meta, opt)
        chain = [(key, server.prev_meta.get(key)) for key in ("step", "round")]
    for key, prev_value in chain:
        got = server.meta.get(key)
        if not isinstance(prev_value, int) or got != prev_value + 1:
            out.append(f"server.json: {key} {got!r} != previous {key} {prev_value!r} + 1")
    return out


# ---- values -------------------------------------------------------------------------------


def _aggregate_failures(
    reader: TensorReader,
    span: Span,
    p: torch.Tensor,
    clients: Sequence,
    weights: Sequence[float],
    delta: TensorInfo,
    client_dirs: Sequence[Path],
    aggregator: Aggregator,
    fmt: UpdateFormat = FULL_MODEL,
) -> list[str]:
    """Stored delta of tensor ``span.name`` against the aggregator's float64 recomputation and tolerance,
    from each client's float64 delta as its format gives it (client − prev, or a LoRA update's (α/r)·B·A).

    A NaN/Inf in prev or in a client update is named as such (aggregate refuses those inputs).
    """
    n = span.name
    if not bool(torch.isfinite(p).all()):
        return [f"prev: tensor {n!r} contains NaN/Inf"]
    try:
        exact, tol = aggregator.exact(fmt.exact_deltas(reader, n, p, clients, client_dirs), weights, span)
    except NonFiniteInput as exc:
        return [str(exc)]
    tol = _stored_tol(exact, tol, delta.dtype)
    diff = (reader.read(delta).to(torch.float64) - exact).abs()
    return [] if bool((diff <= tol).all()) else [f"aggregate: {_worst(n, diff, tol)} in {delta.file}"]


def _stored_tol(exact: torch.Tensor, tol: torch.Tensor, code: str) -> torch.Tensor:
    """``tol`` of an fp32 result, plus its rounding when stored in bf16 (``code`` BF16: a bf16 global
    model's delta and weights): at most u_bf16·(|exact| + tol), u_bf16 = 2⁻⁸."""
    if code == "F32":
        return tol
    return tol + UNIT_ROUNDOFF[code] * (exact.abs() + tol)


def _server_step_failures(
    reader: TensorReader, n: str, p: torch.Tensor, delta: TensorInfo, server: ServerStep, opt: ServerOptimizer
) -> list[str]:
    """Stored new weight and state of tensor ``n`` against the float64 server step."""

    def read(info: TensorInfo) -> torch.Tensor:
        return reader.read(info).to(torch.float64)

    if server.prev_state is None:
        old = {s: t.to(torch.float64) for s, t in opt.init_state(p.to(torch.float32)).items()}
    else:
        old = {s: read(server.prev_state[f"{s}/{n}"]) for s in opt.slots}
    got = {WEIGHT: read(server.model[n]), **{s: read(server.state[f"{s}/{n}"]) for s in opt.slots}}
    out = []
    for key, (want, tol) in recompute(opt, p, read(delta), old, got).items():
        if key == WEIGHT:
            tol = _stored_tol(want, tol, server.model[n].dtype)
        diff = (got[key] - want).abs()
        if not bool((diff <= tol).all()):
            label, name, info = (
                ("merged model", n, server.model[n])
                if key == WEIGHT
                else ("server state", f"{key}/{n}", server.state[f"{key}/{n}"])
            )
            out.append(f"{label}: {_worst(name, diff, tol)} in {info.file}")
    return out


def _manifest_failures(dirs: Sequence[Path]) -> list[str]:
    """Every directory's manifest (one run lists every problem); two threads hash in parallel."""

    def problem(d: Path) -> str | None:
        try:
            verify_manifest(d)
        except ManifestError as exc:
            return f"manifest: {exc}"
        return None

    unique: dict[Path, Path] = {}
    for d in dirs:  # the previous state dir is usually prev itself: hash it once
        unique.setdefault(d.resolve(), d)
    with ThreadPoolExecutor(2) as pool:
        return [f for f in pool.map(problem, unique.values()) if f]


def verify_round(
    prev_dir: Path,
    client_dirs: Sequence[Path],
    weighting: str,
    agg_dir: Path,
    *,
    model_dir: Path | None = None,
    opt: ServerOptimizer | None = None,
    prev_state_dir: Path | None = None,
    given_weights: Sequence[float] | None = None,
    aggregator: str = DEFAULT_AGGREGATOR,
    hparams: dict | None = None,
    context: RoundContext | None = None,
    store: str = "float32",
) -> list[str]:
    """Return a list of failures (empty = the round verifies).

    ``aggregator``: the rule aggregate ran, with its ``hparams`` and round ``context`` (as
    ``fedagent aggregate`` took them; aggregate.json must record the same). ``store``: the run's
    model_dtype, what the delta and the merged weights must be stored in (bfloat16: each value's
    tolerance adds its bf16 rounding).

    With ``model_dir``, also the server step ``opt`` (default FedAvg, lr 1) from
    ``prev_state_dir`` (None: fresh state, as in round 1). ``given_weights``: weighting
    ``weights``' per-client values, one per entry of ``client_dirs`` (as ``fedagent aggregate``).
    """
    opt = opt or FedAvg()
    rule = (aggregator, {k: v for k, v in (hparams or {}).items() if v is not None}, context or RoundContext())
    prev_dir, agg_dir = Path(prev_dir), Path(agg_dir)
    model_dir = Path(model_dir) if model_dir else None
    prev_state_dir = Path(prev_state_dir) if prev_state_dir else None
    client_dirs = [Path(d) for d in client_dirs]
    if prev_state_dir is not None and model_dir is None:
        return ["usage: --prev-server-state needs --model"]
    dirs = [prev_dir, *client_dirs, agg_dir] + [d for d in (model_dir, prev_state_dir) if d is not None]
    failures = _manifest_failures(dirs)
    if failures:
        return failures
    given = dict(zip(map(str, client_dirs), given_weights)) if given_weights is not None else None
    if given is not None and len(given_weights) != len(client_dirs):
        return [f"usage: {len(given_weights)} --client-weights for {len(client_dirs)} --clients"]
    client_dirs = [d for d in client_dirs if not is_dropped(d)]  # drop records: aggregate left them out
    try:
        weights = client_weights(
            client_dirs, weighting, None if given is None else [given[str(d)] for d in client_dirs]
        )
        critic = CRITIC.pairs(prev_dir, client_dirs)
    except (AggregateError, OSError, ValueError, KeyError) as exc:
        return [f"structure: {exc}"]
    if store not in STORE_CODES:
        return [f"usage: --dtype {store!r}: one of {sorted(STORE_CODES)}"]
    failures = vr.byzantine_failures(client_dirs, agg_dir)
    failures += _verify_model(
        prev_dir, client_dirs, weighting, weights, agg_dir, model_dir, opt, prev_state_dir, rule, store
    )
    if critic is not None:
        # PPO (fedagent.model.critic_dir): whose critic each is, then the critic's aggregate and server
        # step, same weights and flags.
        failures += [f"critic: {f}" for f in critic_identity_failures(client_dirs, agg_dir)]
        failures += [
            f"critic: {f}"
            for f in _verify_model(
                critic[0],
                critic[1],
                weighting,
                weights,
                CRITIC.of(agg_dir),
                model_dir and CRITIC.of(model_dir),
                opt,
                prev_state_dir and CRITIC.of(prev_state_dir),
                rule,
                store,
                critic=True,
            )
        ]
    elif CRITIC.present(agg_dir) or (model_dir is not None and CRITIC.present(model_dir)):
        failures.append(
            f"structure: {agg_dir if CRITIC.present(agg_dir) else model_dir} has a {CRITIC.subdir}/ "
            f"but prev {prev_dir} and the clients have none"
        )
    return failures


def _verify_model(
    prev_dir: Path,
    client_dirs: Sequence[Path],
    weighting: str,
    weights: Sequence[float],
    agg_dir: Path,
    model_dir: Path | None,
    opt: ServerOptimizer,
    prev_state_dir: Path | None,
    rule: tuple[str, dict, RoundContext],
    store: str = "float32",
    critic: bool = False,
) -> list[str]:
    """One model's aggregate (and server step): the actor, or its critic (manifests checked already).
    ``rule``: the aggregator's name, hyper-parameters and context (a fresh instance per model)."""
    try:
        fmt = format_of(client_dirs)
        prev, clients = check_structure(prev_dir, client_dirs, fmt)
        delta = read_header(agg_dir / DELTA_FILE)
        summary = json.loads((agg_dir / AGG_JSON).read_text())
        server = _load_server_step(model_dir, prev_state_dir) if model_dir else None
        name, hparams, context = rule
        aggregator = start_rule(name, hparams, context, weighting, len(client_dirs), weights, critic=critic)
    except (AggregateError, FormatError, OSError, ValueError, KeyError) as exc:
        return [f"structure: {exc}"]
    failures = _summary_failures(summary, weighting, client_dirs, weights, agg_dir, aggregator, fmt)
    failures += _structure_failures(prev, delta, server, opt, store)
    if server is not None:
        failures += _meta_failures(server, opt)
    if failures:
        return failures
    with TensorReader() as reader:
        if aggregator.SURVEYS:
            failures += vr.survey_failures(reader, prev, clients, client_dirs, aggregator, summary, fmt)
            if failures:
                return failures
        if not critic:
            failures += vr.notes_failures(summary, aggregator, client_dirs, agg_dir)
        for index, n in enumerate(prev):
            p = reader.read(prev[n]).to(torch.float64)
            span = Span(n, index, 0, prev[n].numel, prev[n].numel)
            failures += _aggregate_failures(reader, span, p, clients, weights, delta[n], client_dirs, aggregator, fmt)
            if server is not None:
                failures += _server_step_failures(reader, n, p, delta[n], server, opt)
    return failures


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``fedagent verify`` (server-step flags and defaults as ``fedagent merge``)."""
    parser.add_argument("--prev", required=True, type=Path)
    parser.add_argument("--clients", required=True, nargs="+", type=Path)
    parser.add_argument("--weighting", default="uniform", choices=WEIGHTINGS)
    parser.add_argument(
        "--client-weights", type=float, nargs="+", default=None, help="weighting 'weights': one per --clients entry"
    )
    add_aggregator_arg(parser)
    parser.add_argument("--aggregate", required=True, type=Path)
    parser.add_argument("--model", type=Path, default=None, help="merged model dir: recompute the server step too")
    add_server_args(parser)
    add_dtype_arg(parser)


def run(args: argparse.Namespace) -> int:
    """CLI entry: 0 if everything matches, 1 (printing every failure) otherwise."""
    opt, state = optimizer_from_args(args)
    name, hparams, context = aggregator_from_args(args)
    failures = verify_round(
        args.prev,
        args.clients,
        args.weighting,
        args.aggregate,
        model_dir=args.model,
        opt=opt,
        prev_state_dir=state,
        given_weights=args.client_weights,
        aggregator=name,
        hparams=hparams,
        context=context,
        store=args.dtype,
    )
    if failures:
        for f in failures:
            print(f"verify: FAIL {f}", file=sys.stderr)
        return 1
    extra = ""
    if args.model is not None:
        hp = " ".join(f"{k}={v}" for k, v in opt.hparams().items())
        extra = f"; model {args.model}: {opt.name} {hp}, {'state from ' + str(state) if state else 'fresh state'}"
    if CRITIC.present(args.aggregate):  # PPO: the critic's aggregate (and server step) passed too
        extra += f"; {CRITIC.subdir}/ likewise"
    extra += vr.rule_summary(Path(args.aggregate))
    print(f"verify: OK {args.aggregate} ({len(args.clients)} clients, weighting {args.weighting}){extra}")
    return 0
