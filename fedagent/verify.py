"""``fedagent verify``: recompute a round in float64 from the client updates and compare.

Tolerance, per element: |stored − exact| ≤ (M + 3) · u · S with u = 2⁻²⁴ (fp32 unit
roundoff) and S = Σ_i w_i |c_i − p| + |Δ_exact|. Why: aggregate forms fl(c_i − p) (one
rounding), scales by an fp32-rounded weight (two more) and sums M terms recursively (M − 1
roundings); the standard bound for that is (M + 2)·u·Σ|terms| + O(u²), and one more u
covers the final fp32 store. Bounding by the magnitude of the *terms* (not of the result)
keeps it sound when client deltas cancel, and it is far tighter than a fixed 1e-4: any
tampering larger than a few fp32 ulps of the terms is caught. bf16/fp16 → fp32 is exact,
so stored dtype adds nothing. The merged FedAvg model adds two roundings (scale, add):
(M + 5) · u · (|p| + η S).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch

from fedagent.aggregate import AGG_JSON, DELTA_FILE, WEIGHTINGS, AggregateError, check_structure, client_weights
from fedagent.atomic import ManifestError, verify_manifest
from fedagent.hf_dir import FormatError, TensorReader, read_header, tensor_index

U32 = 2.0 ** -24


def _worst(name: str, diff: torch.Tensor, tol: torch.Tensor) -> str:
    ratio = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff / tol.clamp_min(1e-300))
    i = int(torch.argmax(ratio.reshape(-1)))
    bad = int((~(diff <= tol)).sum())
    return (f"tensor {name!r}: {bad} element(s) outside tolerance; worst flat index {i}: "
            f"|diff|={float(diff.reshape(-1)[i]):.3e} > tol={float(tol.reshape(-1)[i]):.3e}")


def verify_round(prev_dir: Path, client_dirs: Sequence[Path], weighting: str, agg_dir: Path, *,
                 model_dir: Path | None = None, server_opt: str = "fedavg", server_lr: float = 1.0) -> list[str]:
    """Return a list of failures (empty = the round verifies)."""
    prev_dir, agg_dir = Path(prev_dir), Path(agg_dir)
    client_dirs = [Path(d) for d in client_dirs]
    dirs = [prev_dir, *client_dirs, agg_dir] + ([Path(model_dir)] if model_dir else [])
    def manifest_problem(d: Path) -> str | None:
        try:
            verify_manifest(d)
        except ManifestError as exc:
            return f"manifest: {exc}"
        return None

    # Every directory (one run lists every manifest problem); two threads hash in parallel.
    with ThreadPoolExecutor(2) as pool:
        failures = [f for f in pool.map(manifest_problem, dirs) if f]
    if failures:
        return failures
    try:
        weights = client_weights(client_dirs, weighting)
        prev, clients = check_structure(prev_dir, client_dirs)
        delta = read_header(agg_dir / DELTA_FILE)
        summary = json.loads((agg_dir / AGG_JSON).read_text())
        model = tensor_index(Path(model_dir)) if model_dir else None
    except (AggregateError, FormatError, OSError, ValueError, KeyError) as exc:
        return [f"structure: {exc}"]
    # The recorded weights must be the recomputed ones, client by client.
    recorded = [(c.get("dir"), c.get("weight")) for c in summary.get("clients", [])]
    if summary.get("weighting") != weighting:
        failures.append(f"aggregate.json: weighting {summary.get('weighting')!r} != {weighting!r}")
    if [Path(d).name for d, _ in recorded] != [d.name for d in client_dirs]:
        failures.append(f"aggregate.json: clients {[d for d, _ in recorded]} != {[str(d) for d in client_dirs]}")
    else:
        for (d, w_rec), w in zip(recorded, weights):
            if not isinstance(w_rec, (int, float)) or abs(w_rec - w) > 1e-12 * max(1.0, abs(w)):
                failures.append(f"aggregate.json: client {d} weight {w_rec} != recomputed {w}")
    for label, idx in (("aggregate delta", delta), ("merged model", model)):
        if idx is None:
            continue
        if set(idx) != set(prev):
            failures.append(f"structure: {label} tensors differ from prev: {sorted(set(idx) ^ set(prev))[:5]}")
            return failures
        for n, info in idx.items():
            if info.shape != prev[n].shape or info.dtype != "F32":
                failures.append(f"structure: {label} tensor {n!r} is {info.dtype}{list(info.shape)}, "
                                f"expected F32{list(prev[n].shape)}")
    if failures:
        return failures
    M = len(client_dirs)
    with TensorReader() as reader:
        for n in prev:
            p = reader.read(prev[n]).to(torch.float64)
            exact = torch.zeros_like(p)
            mag = torch.zeros_like(p)
            for c, w in zip(clients, weights):
                d = reader.read(c[n]).to(torch.float64) - p
                exact.add_(d, alpha=w)
                mag.add_(d.abs(), alpha=w)
            mag.add_(exact.abs())
            got = reader.read(delta[n]).to(torch.float64)
            diff = (got - exact).abs()
            tol = (M + 3) * U32 * mag
            if not bool((diff <= tol).all()):
                failures.append(f"aggregate: {_worst(n, diff, tol)}")
            if model is not None and server_opt == "fedavg":
                want = p + server_lr * exact
                diff = (reader.read(model[n]).to(torch.float64) - want).abs()
                tol = (M + 5) * U32 * (p.abs() + server_lr * mag)
                if not bool((diff <= tol).all()):
                    failures.append(f"merged model: {_worst(n, diff, tol)}")
    return failures


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``fedagent verify``."""
    parser.add_argument("--prev", required=True, type=Path)
    parser.add_argument("--clients", required=True, nargs="+", type=Path)
    parser.add_argument("--weighting", default="uniform", choices=WEIGHTINGS)
    parser.add_argument("--aggregate", required=True, type=Path)
    parser.add_argument("--model", type=Path, default=None, help="merged model dir to check too")
    parser.add_argument("--server-opt", default="fedavg",
                        help="only fedavg merges are recomputed; others get a structure check")
    parser.add_argument("--server-lr", type=float, default=1.0)


def run(args: argparse.Namespace) -> int:
    """CLI entry: 0 if everything matches, 1 (printing every failure) otherwise."""
    failures = verify_round(args.prev, args.clients, args.weighting, args.aggregate, model_dir=args.model,
                            server_opt=args.server_opt, server_lr=args.server_lr)
    if failures:
        for f in failures:
            print(f"verify: FAIL {f}", file=sys.stderr)
        return 1
    extra = "" if args.model is None or args.server_opt == "fedavg" else f" (model: structure only for {args.server_opt})"
    print(f"verify: OK {args.aggregate} ({len(args.clients)} clients, weighting {args.weighting}){extra}")
    return 0
