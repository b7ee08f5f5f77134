"""An engine set's request loop: one job at a time over a Unix socket, generic over its fitter.

Messages are one JSON object per line. A job sends :class:`Request`-shaped JSON; the set answers once,
when the fit is over: ``{"ok": true, ...}`` (:func:`serve`), ``{"restart": reason}`` (the job's engine
key is not the set's: the set stops, the job starts another) or ``{"error": text}`` (the fit raised: the
set stops). Everything the set's processes print goes to the set's log (the server's stdout); a job's
part of it is the byte range the answer names, which the job copies into its own log.

The set serves only while its job is connected: a watchdog polls the connection during the fit and, when
the job is gone (killed: its socket closes), calls ``stop`` (the server stops its whole process tree), so
a killed job never leaves a fit running that a rerun would race. With no request for ``idle_s`` the loop
returns and the set ends; so does a set whose training workers hold more than ``max_growth_gb`` more device
memory after a job than after its first (after answering that job: the next job starts a fresh set).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Protocol

from fedagent.core.atomic import atomic_write_text

# Keys of a job's request (all required).
REQUEST_KEYS = ("engine_key", "tag", "model_dir", "ref_dir", "critic_dir", "rows", "ckpt_dir", "job_file")
JOB_BEGINS = "fedagent: engine set job begins: "
JOB_ENDS = "fedagent: engine set job ends: "
# The lines of a set's start-up that a later job's checks need (the armed patches): copied into its log.
STARTUP_MARK = "fedagent: "
RETIRES = "fedagent: engine set retires: "


class Fitter(Protocol):
    """What :func:`serve` drives: the set's trainer."""

    def built_for(self, job: dict) -> bool:
        """Whether the engines were built from this job's own dirs and rows (its first fit needs no reset)."""

    def fit(self, job: dict, *, reset: bool) -> list[dict]:
        """Reset to the job's start (when ``reset``), fit, return verl's step records as its Tracking got them."""

    def memory_gb(self) -> float | None:
        """Device memory (GB) the set's training workers hold now, after a fit (None: not measurable here)."""

    # Optional: ``last_reset``, what the last fit's reset freed (``refit.reset_trainer``'s release records;
    # None without a reset), answered to the job as ``reset_release``.


def send(conn: socket.socket, obj: dict) -> None:
    conn.sendall((json.dumps(obj) + "\n").encode())


def recv(conn: socket.socket, timeout: float | None = None) -> dict | None:
    """One line's JSON object; None when the peer closed first."""
    conn.settimeout(timeout)
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            return None
        buf += chunk
    obj = json.loads(buf)
    if not isinstance(obj, dict):
        raise ValueError("an engine-set message must be a JSON object")
    return obj


def check_request(req: dict) -> None:
    missing = [k for k in REQUEST_KEYS if k not in req]
    if missing:
        raise ValueError(f"engine-set request lacks {missing}")


def _closed(conn: socket.socket) -> bool:
    """Whether the peer has closed (readable with nothing to read), without consuming data."""
    r, _, _ = select.select([conn], [], [], 0)
    if not r:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class Watchdog:
    """While a fit runs: if the job's connection closes, print why and call ``stop`` (once)."""

    def __init__(self, conn: socket.socket, stop: Callable[[], None], period_s: float = 0.5):
        self.conn, self.stop, self.period_s = conn, stop, period_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.wait(self.period_s):
            if _closed(self.conn):
                print(
                    "fedagent: engine set: the job's connection closed mid-fit (job killed); stopping the set",
                    flush=True,
                )
                self.stop()
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(5)


def startup_lines(log: Path, end: int) -> list[str]:
    """The set's own marked lines (:data:`STARTUP_MARK`: the armed patches' lines) of its start-up: its
    log's first ``end`` bytes up to the first job's begin line (no job's own lines, e.g. reset lines)."""
    with open(log, "rb") as fh:
        text = fh.read(end).decode(errors="replace")
    i = text.find(JOB_BEGINS)
    if i >= 0:
        text = text[: text.rfind("\n", 0, i) + 1]
    return [line for line in text.splitlines() if STARTUP_MARK in line]


def _wait_for_line(log: Path, start: int, line: str, limit_s: float) -> None:
    """Until ``line`` is in ``log`` after byte ``start`` (Ray forwards the TaskRunner's output to the set's
    stdout a moment after it is printed), at most ``limit_s``; a RuntimeError after that."""
    deadline = time.monotonic() + limit_s
    needle = line.encode()
    while True:
        with open(log, "rb") as fh:
            fh.seek(start)
            if needle in fh.read():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{log}: '{line}' did not arrive within {limit_s:.0f} s")
        time.sleep(0.1)


def serve(
    sock_path: Path,
    *,
    key: str,
    fitter: Fitter,
    log: Path,
    job_file: Path,
    idle_s: float,
    stop: Callable[[], None],
    settle_s: float = 1.0,
    set_tag: str = "",
    nonce: str = "",
    forward_limit_s: float = 60.0,
    say: Callable[[str], None] | None = None,
    max_growth_gb: float | None = None,
) -> str:
    """Answer jobs on ``sock_path`` until idle for ``idle_s``, a job of another key, a failed fit or a
    vanished job. ``job_file``: the set's agent-loop job file, rewritten (atomically) with each job's env
    address, record file and start model before its fit. ``nonce``: the one the starting job got; only a
    request carrying it may be the set's first fit without a reset (paths alone could name rewritten
    files). A job's log range ends once the fit's end line has reached the log (Ray forwards the
    TaskRunner's output a moment later; at most ``forward_limit_s``) plus ``settle_s`` for the workers'
    lines. ``say``: how the loop's own lines reach the set's log (default: this process's stdout, which
    is the log, or reaches it through Ray). ``max_growth_gb``: after each job the fitter's
    :meth:`Fitter.memory_gb` is compared with its value after the set's first job (both go into the answer);
    past this growth the set stops once it has answered (None: never). Returns why it stopped."""
    say = say or sys_print
    sock_path = Path(sock_path)
    _unlink(sock_path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # the socket appears at its path only once it listens: a job that finds it can connect
    fresh = sock_path.with_name(sock_path.name + ".new")
    _unlink(fresh)
    srv.bind(str(fresh))
    srv.listen(4)
    os.replace(fresh, sock_path)
    jobs = 0
    first_end = 0
    first_memory = None
    try:
        while True:
            srv.settimeout(idle_s)
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                _turn_away(srv, sock_path, "the set stopped for idleness")
                return "idle"
            with conn:
                try:
                    req = recv(conn, timeout=60)
                    if req is None:
                        continue
                    check_request(req)
                except (ValueError, OSError) as err:
                    with contextlib.suppress(OSError):
                        send(conn, {"error": f"bad request: {err}"})
                    continue
                if req["engine_key"] != key:
                    send(
                        conn, {"restart": f"the job's engine key {req['engine_key'][:12]} is not the set's {key[:12]}"}
                    )
                    return "restart"
                if _closed(conn):  # the job is gone already: no fit for it
                    continue
                atomic_write_text(Path(job_file), json.dumps(req["job_file"], sort_keys=True) + "\n")
                warm = jobs > 0 or req.get("nonce") != nonce or not nonce or not fitter.built_for(req)
                start = os.path.getsize(log) if jobs else 0  # a set's first job's log holds its start-up
                say(f"{JOB_BEGINS}{req['tag']} (job {jobs + 1} of set {set_tag}, warm={warm})")
                t0 = time.monotonic()
                try:
                    with Watchdog(conn, lambda: (_unlink(sock_path), stop())):  # no new job reaches it
                        steps = fitter.fit(req, reset=warm)
                    fit_s = time.monotonic() - t0
                    say(f"{JOB_ENDS}{req['tag']}")
                    _wait_for_line(log, start, f"{JOB_ENDS}{req['tag']}", forward_limit_s)
                except Exception:
                    say(traceback.format_exc())
                    time.sleep(settle_s)
                    with contextlib.suppress(OSError):
                        send(conn, {"error": traceback.format_exc(limit=8), "log_range": [start, os.path.getsize(log)]})
                    return "failed"
                time.sleep(settle_s)
                end = os.path.getsize(log)
                try:
                    memory = fitter.memory_gb()
                except Exception:  # noqa: BLE001 - a reading that fails never fails the job's sound fit
                    say(f"fedagent: engine set: no memory reading after {req['tag']}:\n{traceback.format_exc(limit=4)}")
                    memory = None
                if not jobs:
                    first_end, first_memory = end, memory
                growth = None if memory is None or first_memory is None else round(memory - first_memory, 3)
                reply = {
                    "ok": True,
                    "warm": warm,
                    "jobs_before": jobs,
                    "set": set_tag,
                    "fit_s": round(fit_s, 3),
                    "log_range": [start, end],
                    "steps": steps,
                    "memory_gb": memory,
                    "memory_growth_gb": growth,
                    "reset_release": getattr(fitter, "last_reset", None),
                    "startup_lines": startup_lines(log, first_end) if jobs else [],
                }
                jobs += 1
                try:
                    send(conn, reply)
                except OSError:  # the job vanished right after its fit: nothing of it is committed
                    return "job gone"
                if growth is not None and max_growth_gb is not None and growth > max_growth_gb:
                    why = (
                        f"its training workers hold {growth:.2f} GB more device memory than after its first job "
                        f"(train.verl.engines_max_growth_gb: {max_growth_gb:g})"
                    )
                    say(f"{RETIRES}{why}")
                    _turn_away(srv, sock_path, f"the set retired: {why}")
                    return "memory"
    finally:
        srv.close()
        _unlink(sock_path)


def _turn_away(srv: socket.socket, sock_path: Path, why: str) -> None:
    """A stopping set: no new connection can reach it (its socket goes); one already queued is told to
    start another set."""
    _unlink(sock_path)
    srv.settimeout(0.2)
    with contextlib.suppress(OSError):
        while True:
            late, _ = srv.accept()
            with late:
                send(late, {"restart": why})


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        Path(path).unlink()


def sys_print(text: str) -> None:
    print(text, flush=True)
