"""The light client: ``fedagent <cmd>`` with ``FEDAGENT_WARM_SOCKET`` set hands its job to the warm server.

It sends argv, cwd, the whole environment, its own process start and its fds 0/1/2, forwards
SIGTERM/SIGINT/SIGHUP to the job's process group and returns the job's exit code (a signal death
as 128 + signum, as a shell reports it). It stays a process for as long as the job runs, so
Snakemake, ``lifecycle._stop`` and a SIGKILL of the caller's process tree all still reach the job:
if this client dies, the server sees its connection close and SIGKILLs the job's process group.

Stdlib only: importing ``fedagent.cli`` and this module must not import torch or numpy.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import fedagent
from fedagent.core.timing import proc_start_time
from fedagent.warm import protocol

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def connect(path: str, timeout: float | None = None) -> socket.socket:
    """A connected socket to the server at ``path`` (raises OSError when nobody answers)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def ask(path: str, request: dict, timeout: float | None = 10.0) -> dict | None:
    """One request, one reply (``ping``/``stop``); None when the server closed without answering."""
    with connect(path, timeout) as sock:
        protocol.send(sock, request)
        return protocol.recv(sock)


def _std_fds() -> tuple[list[int], list[int]]:
    """This process's fds 0/1/2 to pass on, /dev/null for any that is closed (and which were opened)."""
    fds, opened = [], []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            fds.append(null)
            opened.append(null)
    return fds, opened


class _Forwarder:
    """SIGTERM/SIGINT/SIGHUP to the job's process group; those that arrive before its pid is known wait."""

    def __init__(self):
        self.pgid: int | None = None
        self.pending: list[int] = []
        self.saved: dict[int, object] = {}

    def __enter__(self):
        for signum in FORWARDED:
            self.saved[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum, _frame):
        if self.pgid is None:
            self.pending.append(signum)
        else:
            _killpg(self.pgid, signum)

    def attach(self, pid: int) -> None:
        """The job is running as the leader of process group ``pid``: deliver what waited."""
        self.pgid = pid
        while self.pending:
            _killpg(pid, self.pending.pop(0))


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _request(argv: list[str]) -> dict:
    """What the server needs to run ``argv`` as this process would have."""
    return {
        "op": "run",
        "argv": list(argv),
        "argv0": sys.argv[0] if sys.argv else "fedagent",
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "start": proc_start_time(),
        "executable": sys.executable,
        "package": os.path.dirname(os.path.abspath(fedagent.__file__)),
        "path0": sys.path[0] if sys.path else "",
        "client_pid": os.getpid(),
        "sent": time.time(),
    }


def _say(message: str) -> int:
    print(f"fedagent: {message}", file=sys.stderr, flush=True)
    return 2


def delegate(argv: list[str], path: str) -> int:
    """Run ``fedagent <argv>`` as a job forked by the warm server at ``path``; its exit code."""
    request = _request(argv)  # the start time first: nothing below is the job's
    try:
        sock = connect(path)
    except OSError as err:
        return _say(
            f"FEDAGENT_WARM_SOCKET={path}: no warm server answers there ({err.strerror or err}); "
            f"start one with `fedagent warm-server --socket {path} --detach`, or unset "
            "FEDAGENT_WARM_SOCKET to run jobs without it"
        )
    fds, opened = _std_fds()
    with sock, _Forwarder() as forward:
        try:
            protocol.send(sock, request, fds)
            for fd in opened:
                os.close(fd)
            reply = protocol.recv(sock)
            if reply is not None and "error" in reply:
                return _say(f"warm server at {path} refused the job: {reply['error']}")
            if reply is None or "pid" not in reply:
                return _say(f"warm server at {path} closed the connection before starting the job")
            forward.attach(int(reply["pid"]))
            reply = protocol.recv(sock)
        except (OSError, protocol.ProtocolError) as err:
            reply, why = None, f"failed ({err})"
        else:
            why = "closed the connection"
        if reply is None or "exit" not in reply:
            if forward.pgid is None:
                return _say(f"warm server at {path} {why} before starting the job")
            _killpg(forward.pgid, signal.SIGKILL)  # nothing may run on unsupervised
            return _say(f"warm server at {path} {why} while job pid {forward.pgid} ran; its process group was killed")
    code = int(reply["exit"])
    return 128 - code if code < 0 else code
