"""Benchmark: streamed aggregation vs the raw I/O floor, load-all, and Flower's helper.

    python bench/aggregate.py [--size-gb 1.0] [--ms 2 4 8] [--workdir DIR]

Builds one synthetic previous model and 8 clients of ``--size-gb`` fp32 each (a Llama-like
mix: one large embedding, per-layer attention/MLP matrices, norms), then for each M runs
every variant in a fresh subprocess (time measured inside it, peak RSS = its VmHWM;
with ``--reps N`` the minimum time and the maximum peak RSS of N runs):

- floor:   read prev + M client weight files + write and fsync one output of the model's
           size, with the same read sizes and write-back as stream; the I/O alone.
- stream:  fedagent.server.aggregate.stream_delta (what `fedagent aggregate` computes), no manifests.
- full:    fedagent.server.aggregate.aggregate = stream + sha256 of every input manifest + output
           manifest (what the CLI runs).
- loadall: load every client state dict (safetensors load_file), then average the deltas
           (one torch thread, like stream: on a shared 2-core machine two threads are slower).
- flwr:    Flower's flwr.server.strategy.aggregate.aggregate on numpy arrays (in its own venv
           because flwr pins older fastapi/starlette/uvicorn than the project's).

Inputs are read once untimed before every variant so that every one of them starts with
the same (hot) page cache; the floor is measured in the same run on the same files.
Variants whose projected memory would not fit in MemAvailable are skipped, not run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HIDDEN, INTER, VOCAB = 2048, 5632, 32000


def layout(size_gb: float) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a synthetic model of about ``size_gb`` GB fp32."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN
    n_layers = max(1, round((size_gb * 1e9 / 4 - VOCAB * HIDDEN) / per_layer))
    for i in range(n_layers):
        p = f"model.layers.{i}."
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{m}.weight"] = (HIDDEN, HIDDEN)
        shapes[p + "mlp.gate_proj.weight"] = (INTER, HIDDEN)
        shapes[p + "mlp.up_proj.weight"] = (INTER, HIDDEN)
        shapes[p + "mlp.down_proj.weight"] = (HIDDEN, INTER)
        shapes[p + "input_layernorm.weight"] = (HIDDEN,)
        shapes[p + "post_attention_layernorm.weight"] = (HIDDEN,)
    return shapes


def build_inputs(work: Path, size_gb: float, m_max: int) -> tuple[Path, list[Path]]:
    """prev + m_max client dirs; a client = prev + (i+1)·1e-3·noise (noise drawn once per tensor)."""
    import torch

    from fedagent.model.hf_dir import write_weights
    from fedagent.core.atomic import atomic_dir
    from fedagent.core.seeds import torch_generator

    shapes = layout(size_gb)
    specs = [(n, "F32", s) for n, s in sorted(shapes.items())]
    g = torch_generator(0, "bench-aggregate")

    def prev_tensor(name):
        return torch.randn(shapes[name], generator=g) * 0.02

    dirs = []
    prev_dir = work / "prev"
    with atomic_dir(prev_dir) as stage:
        (stage / "config.json").write_text("{}\n")
        write_weights(stage, specs, prev_tensor)
    from fedagent.model.hf_dir import TensorReader, tensor_index

    idx = tensor_index(prev_dir)
    for i in range(m_max):

        def client_tensor(name, i=i):
            with TensorReader() as r:
                p = r.read(idx[name])
            ng = torch_generator(0, "bench-aggregate-noise", client=i)
            return p.add_(torch.randn(p.shape, generator=ng), alpha=1e-3)

        d = work / f"client{i}"
        with atomic_dir(d) as stage:
            (stage / "config.json").write_text("{}\n")
            (stage / "metrics.json").write_text(json.dumps({"num_samples": 100 + i, "num_tokens": 10_000 + 37 * i}))
            write_weights(stage, specs, client_tensor)
        dirs.append(d)
        print(f"  built client {i}", file=sys.stderr, flush=True)
    return prev_dir, dirs


# ---------------------------------------------------------------- variants (run in children)


def _files(prev_dir: Path, client_dirs: list[Path]) -> list[Path]:
    from fedagent.model.hf_dir import weight_files

    return [f for d in [prev_dir, *client_dirs] for f in weight_files(d)]


def _fsync(path: Path) -> None:
    # Every variant makes its output durable like fedagent's writer does (a no-op in nosync mode).
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def v_floor(prev_dir, client_dirs, out):
    """Same I/O as stream_delta, no arithmetic: 4 MiB preads of every input, then the
    output written in the same pieces with the same early write-back, then fsync."""
    from fedagent.model.hf_dir import SafetensorsWriter

    buf = bytearray(4 << 20)
    mv = memoryview(buf)
    for f in _files(prev_dir, client_dirs):
        fd = os.open(f, os.O_RDONLY)
        off = 0
        while n := os.preadv(fd, [mv], off):
            off += n
        os.close(fd)
    size = sum(f.stat().st_size for f in _files(prev_dir, []))
    out.mkdir(parents=True, exist_ok=True)
    import torch

    n_elems = size // 4
    piece = torch.zeros(1 << 20, dtype=torch.float32)
    with SafetensorsWriter(out / "delta.safetensors", [("x", "F32", (n_elems,))]) as w:
        left = n_elems
        while left > 0:
            k = min(left, piece.numel())
            w.write_part("x", piece[:k])
            left -= k


def v_stream(prev_dir, client_dirs, out):
    from fedagent.server.aggregate import check_structure, client_weights, stream_delta

    out.mkdir(parents=True, exist_ok=True)
    prev, clients = check_structure(prev_dir, client_dirs)
    stream_delta(out / "delta.safetensors", prev, clients, client_weights(client_dirs, "samples"), client_dirs)


def v_full(prev_dir, client_dirs, out):
    from fedagent.server.aggregate import aggregate

    aggregate(prev_dir, client_dirs, out, weighting="samples")


def v_loadall(prev_dir, client_dirs, out):
    import torch
    from safetensors.torch import load_file, save_file

    from fedagent.server.aggregate import client_weights

    torch.set_num_threads(1)  # same as stream_delta, so the comparison is about the algorithm
    weights = client_weights(client_dirs, "samples")
    prev = {k: v for f in _files(prev_dir, []) for k, v in load_file(f).items()}
    states = [{k: v for f in _files(d, []) for k, v in load_file(f).items()} for d in client_dirs]
    delta = {n: sum(w * (s[n].float() - p.float()) for s, w in zip(states, weights)) for n, p in prev.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(delta, out / "delta.safetensors")
    _fsync(out / "delta.safetensors")


def v_flwr(prev_dir, client_dirs, out):
    from flwr.server.strategy.aggregate import aggregate as flwr_aggregate
    from safetensors.numpy import load_file, save_file

    names = None
    results = []
    for d in client_dirs:
        st = {k: v for f in sorted(d.glob("model*.safetensors")) for k, v in load_file(f).items()}
        names = names or sorted(st)
        n = json.loads((d / "metrics.json").read_text())["num_samples"]
        results.append(([st[k] for k in names], n))
    prev = {k: v for f in sorted(prev_dir.glob("model*.safetensors")) for k, v in load_file(f).items()}
    mean = flwr_aggregate(results)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: (a - prev[k]).astype("float32") for k, a in zip(names, mean)}, str(out / "delta.safetensors"))
    _fsync(out / "delta.safetensors")


VARIANTS = {"floor": v_floor, "stream": v_stream, "full": v_full, "loadall": v_loadall, "flwr": v_flwr}


def child(variant: str, mode: str, prev_dir: str, clients: list[str], out: str) -> None:
    if mode == "nosync":
        os.fsync = lambda fd: None  # every variant alike: compare CPU + memory work on a hot cache
    t0 = time.perf_counter()
    VARIANTS[variant](Path(prev_dir), [Path(c) for c in clients], Path(out))
    dt = time.perf_counter() - t0
    # VmHWM, not ru_maxrss: ru_maxrss survives exec and would report the parent's peak.
    status = Path("/proc/self/status").read_text()
    rss = int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024
    print(json.dumps({"seconds": dt, "peak_rss": rss}))


# ---------------------------------------------------------------- driver


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def warm(files: list[Path]) -> None:
    buf = memoryview(bytearray(64 << 20))
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def measure(variant, mode, python, prev_dir, clients, out) -> dict | None:
    shutil.rmtree(out, ignore_errors=True)
    warm(_files(prev_dir, clients))
    os.sync()  # no write-back left over from building inputs or an earlier variant competes
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [python, __file__, "--child", variant, mode, str(prev_dir), str(out), *map(str, clients)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    shutil.rmtree(out, ignore_errors=True)
    if res.returncode != 0:
        print(f"  {variant}: failed: {res.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="fp32 size of each model")
    ap.add_argument("--ms", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--workdir", type=Path, default=REPO.parent, help="parent of the temporary dir (disk under test)")
    ap.add_argument(
        "--flwr-python",
        default="/tmp/flwr-venv/bin/python",
        help="interpreter with flwr + safetensors installed ('' to skip)",
    )
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["durable", "nosync"],
        help="durable: outputs fsync'ed (as fedagent does); nosync: fsync disabled in every variant",
    )
    ap.add_argument("--reps", type=int, default=1, help="runs per cell: min time, max peak RSS")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic inputs")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        variant, mode, prev_dir, out, *clients = a.child
        child(variant, mode, prev_dir, clients, out)
        return 0

    import signal
    import tempfile

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` removes the inputs

    work = Path(tempfile.mkdtemp(prefix="fedagent-bench-aggregate-", dir=a.workdir))
    try:
        t0 = time.perf_counter()
        prev_dir, all_clients = build_inputs(work, a.size_gb, max(a.ms))
        size = sum(f.stat().st_size for f in _files(prev_dir, []))
        print(
            f"# synthetic model: {len(layout(a.size_gb))} tensors, {size / 1e9:.2f} GB fp32 per client "
            f"(built in {time.perf_counter() - t0:.0f} s); hot page cache; {os.cpu_count()} CPUs; "
            f"{a.reps} run(s) per cell; load average {os.getloadavg()[0]:.1f}"
        )
        flwr_ok = bool(a.flwr_python) and Path(a.flwr_python).exists()
        variants = [v for v in a.variants if v != "flwr" or flwr_ok]
        for mode in a.modes:
            rows = {}
            for m in a.ms:
                clients = all_clients[:m]
                for v in variants:
                    # load-all holds M+2 models; Flower's helper M weighted copies as well (2M+2).
                    need = {"loadall": (m + 3) * size, "flwr": (2 * m + 3) * size}.get(v, 0)
                    if need and need > 0.8 * mem_available():
                        print(
                            f"  {mode} M={m} {v}: skipped (needs ~{need / 1e9:.0f} GB, "
                            f"{mem_available() / 1e9:.0f} GB available)",
                            file=sys.stderr,
                        )
                        continue
                    python = a.flwr_python if v == "flwr" else sys.executable
                    runs = [measure(v, mode, python, prev_dir, clients, work / "out") for _ in range(a.reps)]
                    runs = [x for x in runs if x]
                    # min time (the machine may be shared: noise only ever adds), max peak RSS
                    r = (
                        {"seconds": min(x["seconds"] for x in runs), "peak_rss": max(x["peak_rss"] for x in runs)}
                        if runs
                        else None
                    )
                    if r:
                        rows[(m, v)] = r
                        print(
                            f"  {mode} M={m} {v}: {r['seconds']:.2f} s, peak RSS {r['peak_rss'] / 2**20:.0f} MiB",
                            file=sys.stderr,
                            flush=True,
                        )
            print(f"\n## mode: {mode}")
            print_table(rows, a.ms, variants)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def print_table(rows, ms, variants) -> None:
    def cell(m, v, key, fmt):
        r = rows.get((m, v))
        return fmt(r[key]) if r else "skipped"

    print(
        "\n| M | " + " | ".join(f"{v} s" for v in variants) + " | stream/floor | full/floor | loadall/stream "
        "| " + " | ".join(f"{v} RSS MiB" for v in variants) + " | loadall RSS/stream RSS |"
    )
    print("|" + "---|" * (2 * len(variants) + 5))
    for m in ms:

        def ratio(a, b, key):
            ra, rb = rows.get((m, a)), rows.get((m, b))
            return f"{ra[key] / rb[key]:.2f}×" if ra and rb else "–"

        print(
            f"| {m} | "
            + " | ".join(cell(m, v, "seconds", lambda x: f"{x:.2f}") for v in variants)
            + f" | {ratio('stream', 'floor', 'seconds')} | {ratio('full', 'floor', 'seconds')} "
            f"| {ratio('loadall', 'stream', 'seconds')} | "
            + " | ".join(cell(m, v, "peak_rss", lambda x: f"{x / 2**20:.0f}") for v in variants)
            + f" | {ratio('loadall', 'stream', 'peak_rss')} |"
        )
    lo, hi = rows.get((min(ms), "stream")), rows.get((max(ms), "stream"))
    if lo and hi:
        print(f"\nstream peak RSS M={max(ms)} vs M={min(ms)}: {hi['peak_rss'] / lo['peak_rss'] - 1:+.1%}")


if __name__ == "__main__":
    sys.exit(main())
