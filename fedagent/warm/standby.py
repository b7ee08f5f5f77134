"""Standby processes: job children forked before their job, which start CUDA while no job waits.

A GPU job forked by the warm server still pays CUDA's start on its own clock: context creation,
the cuBLAS handle, lazy kernel loading (``docs/results/cold-start.md``). With ``fedagent warm-server
--standby N`` the server keeps N children forked exactly as a job's child would be (its fds
closed, own process group, signals blocked across the fork) that run :func:`prepare` at once and
then wait on a private socketpair. A ``train-client`` or ``eval`` request (:data:`STANDBY_COMMANDS`)
is handed to a ready one — the request, the job's environment and the client's fds 0/1/2 — and it
runs the job through the same :func:`fedagent.warm.child.run_job` as a fresh fork, so the job is
set up exactly as one (fds, cwd, environment, thread counts, argv, ``FEDAGENT_JOB_START``,
``atexit``, ``tempfile``, numpy's seed, signals). The job's clock still starts at its client's
start; the CUDA start a standby paid before the request is simply not on it.

A standby's life (:func:`live`): prepare; send ``{"ready": seconds}``; wait for ``{"request",
"env"}`` + 3 fds. End of stream instead (the server stopped or died, even by SIGKILL) → exit 0, so
no orphan holds a GPU context. SIGTERM/SIGINT/SIGHUP while idle → die by that signal (the server
replaces it); one that arrives once the job is there is kept for the job, as a fresh fork's
blocked signal is. Its stdout/stderr until the job are a pipe the server logs line by line.

What :func:`prepare` may do is bounded by one rule: the job must compute exactly what a fresh fork
computes. No RNG draw, no global flag (TF32, matmul precision, default dtype, deterministic
algorithms), nothing left allocated but what the job would allocate itself (the cuBLAS handle and
its workspace), memory statistics reset. The server never runs it: even
``torch.cuda.is_available()`` starts the CUDA driver, and a child forked after that cannot use CUDA
(:func:`probe` asks in a forked child).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
import traceback

from fedagent.warm import protocol

# The GPU jobs: the only commands a standby runs (the env service, aggregate and merge fork plainly).
STANDBY_COMMANDS = frozenset({"train-client", "eval"})
# "cuda": the real one. "touch" and "fail": CPU-only kinds for the tests (hidden flag): "touch" runs
# the same warm-up on the CPU when torch is imported, sleeps for the seconds in $DIR/sleep if that
# file exists, then writes $DIR/standby-<pid>.json ({"pid", "prepared": epoch s, "card": its
# CUDA_VISIBLE_DEVICES}), DIR =
# $FEDAGENT_STANDBY_TOUCH_DIR (nothing written without it); "fail" raises.
KINDS = ("cuda", "touch", "fail")
TOUCH_DIR_ENV = "FEDAGENT_STANDBY_TOUCH_DIR"
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Unavailable(RuntimeError):
    """The kind cannot prepare on this machine (one line, no traceback)."""


def prepare(kind: str, warmup=None, give_up=lambda: False) -> None:
    """The work a standby does before its job arrives (in the standby; never in the server).

    ``warmup`` (kind cuda; ``warm-server --standby-config``): a
    :class:`fedagent.warm.gpu_warmup.Shapes`; once its model dir exists, the run's GPU train and
    eval calls run once on a 1-layer model of its architecture (:func:`fedagent.warm.gpu_warmup.warm_up`:
    random weights drawn inside ``torch.random.fork_rng``, so the RNG states are as before, and
    everything freed). ``give_up()`` true while waiting for that dir: stop preparing (exit 0)."""
    if kind == "cuda":
        import torch

        why = _cuda_missing(torch)
        if why is not None:
            raise Unavailable(why)
        torch.cuda.init()  # the context
        device = torch.device("cuda", torch.cuda.current_device())
        _warm_up(torch, device)
        if warmup is not None:
            _run_warmup(warmup, give_up, "cuda")
            _reset_memory_stats(torch, device)
    elif kind == "touch":
        if warmup is not None:  # tests: the same wait and calls, on the CPU
            _run_warmup(warmup, give_up, "cpu")
        _touch()
    elif kind == "fail":
        raise RuntimeError("standby kind 'fail' (tests): prepare fails on purpose")
    else:
        raise ValueError(f"unknown standby kind {kind!r} (known: {', '.join(KINDS)})")


def _run_warmup(warmup, give_up, device: str) -> None:
    """The run's architecture (:func:`fedagent.warm.gpu_warmup.architecture_dir`: from its model
    source, or waiting for its model dir), then :func:`fedagent.warm.gpu_warmup.warm_up` (logged)."""
    from fedagent.warm import gpu_warmup

    with gpu_warmup.architecture_dir(warmup, give_up) as arch:
        if arch is None:
            _flush()
            os._exit(0)  # the server is gone (or a signal came): nothing to run
        parts = gpu_warmup.warm_up(warmup, device=device, arch_dir=arch)
    where = warmup.model_dir if arch == warmup.model_dir else f"{warmup.source} ({arch}, before {warmup.model_dir})"
    print(
        f"standby warm-up on a 1-layer model of {where}: " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()),
        file=sys.stderr,
    )


def _warm_up(torch, device) -> None:
    """The device work a standby does for its job: the one place to extend (e.g. a warm-up forward
    of a small model). Within the rule of the module docstring: ``ones`` (no RNG), no flag touched,
    everything freed. On CUDA a bf16 and an fp32 matmul create the cuBLAS handle (and its workspace,
    which the job's first matmul would allocate itself) and load those kernels."""
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.ones(64, 64, device=device, dtype=dtype)
        y = x @ x
        del x, y
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        _reset_memory_stats(torch, device)


def _reset_memory_stats(torch, device) -> None:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.reset_accumulated_memory_stats(device)


def _cuda_missing(torch) -> str | None:
    if not torch.cuda.is_available():
        return (
            "kind cuda needs a CUDA device and torch sees none (torch.cuda.is_available() is False, "
            f"torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    return None


def _touch() -> None:
    d = os.environ.get(TOUCH_DIR_ENV)
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        _warm_up(torch, torch.device("cpu"))
    if not d:
        return
    try:
        with open(os.path.join(d, "sleep")) as fh:
            time.sleep(float(fh.read()))
    except FileNotFoundError:
        pass
    mark = os.path.join(d, f"standby-{os.getpid()}.json")
    with open(mark + ".tmp", "w") as fh:
        json.dump({"pid": os.getpid(), "prepared": time.time(), "card": os.environ.get("CUDA_VISIBLE_DEVICES")}, fh)
    os.replace(mark + ".tmp", mark)


def check(kind: str) -> str | None:
    """Why standbys of ``kind`` cannot prepare here, or None (call it in a forked child: :func:`probe`)."""
    if kind == "cuda":
        import torch

        return _cuda_missing(torch)
    return None


def probe(kind: str, close_fds: tuple[int, ...] = ()) -> str | None:
    """:func:`check` in a forked child (its answer through a pipe), so this process starts no CUDA."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            for fd in close_fds:
                os.close(fd)
            answer = check(kind)
        except BaseException as err:  # noqa: BLE001 - the answer is the error
            answer = f"checking for kind {kind} failed: {type(err).__name__}: {err}"
        try:
            os.write(w, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        return f"the check for kind {kind} died (exit {os.waitstatus_to_exitcode(status)})"
    return json.loads(b"".join(chunks))


# ---------------------------------------------------------------------------- the standby's life
def _noted(signum, frame):
    """SIGTERM/SIGINT/SIGHUP in a standby: the wake-up byte (set_wakeup_fd) records it."""


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def _signals(fd: int) -> list[int]:
    """The signal numbers the wake-up pipe holds."""
    got = b""
    while True:
        try:
            chunk = os.read(fd, 64)
        except BlockingIOError:
            break
        if not chunk:
            break
        got += chunk
    return list(got)


def _die_by(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)


def _wait(sock: socket.socket, wake: int) -> tuple[dict, list[int], list[int]]:
    """Block until the job arrives: (message, its fds, signals that came with it). Signals blocked
    on return. End of stream → exit 0; a signal while idle → die by it."""
    reader = protocol.Reader()
    noted: list[int] = []
    while True:
        ready, _, _ = select.select([sock, wake], [], [])
        if wake in ready:
            noted += _signals(wake)
        if sock in ready:
            if not reader.feed(sock):
                os._exit(0)  # the server stopped or died: nothing to run
            msg = reader.message()
            if msg is not None:
                from fedagent.warm.child import BLOCKED

                signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)
                return msg, reader.take_fds(), noted + _signals(wake)
        if noted and not reader.buf:
            _die_by(noted[0])


def live(kind: str, sock: socket.socket, out_fd: int, warmup=None) -> None:
    """The standby's whole life, in the child the server forked (its fds already closed, its
    signals still blocked); ``out_fd`` becomes fds 1 and 2 until the job. Never returns."""
    try:
        from fedagent.warm.child import BLOCKED, run_job

        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        wake_r, wake_w = os.pipe()
        for fd in (wake_r, wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(wake_w)  # before any unblock: the inherited one is the server's
        for signum in _SIGNALS:
            signal.signal(signum, _noted)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED)
        t0 = time.monotonic()
        try:
            prepare(kind, warmup, give_up=lambda: bool(select.select([sock, wake_r], [], [], 0)[0]))
        except Unavailable as err:
            print(f"standby ({kind}): {err}", file=sys.stderr)
            _flush()
            os._exit(1)
        _flush()
        protocol.send(sock, {"ready": round(time.monotonic() - t0, 3)})
        msg, fds, noted = _wait(sock, wake_r)
        for signum in noted:  # pending (blocked) until the job's own handlers
            os.kill(os.getpid(), signum)
        signal.set_wakeup_fd(-1)
        os.close(wake_r)
        os.close(wake_w)
        sock.close()
        request, env = msg["request"], msg["env"]
        if len(fds) != 3:
            raise RuntimeError(f"the job came with {len(fds)} fd(s), not 3")
        _flush()  # nothing of the standby's may reach the job's stdout
    except BaseException:  # noqa: BLE001 - into the server's log; the standby ends
        try:
            traceback.print_exc()
            _flush()
        finally:
            os._exit(1)
    run_job(request, fds, env)  # never returns
