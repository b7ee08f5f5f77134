"""The warm server's loop: one thread, one selector; every job is a fork in its own process group.

Never threads: the server forks, and a fork copies other threads' locks mid-use. Events:

- the listening socket: a new client connection;
- a client connection: its request (then ``{"pid"}`` is sent at once), or its end of stream
  before the job exited (the client was killed): SIGKILL to the job's process group at once;
- a job's pidfd (``os.pidfd_open``): the job exited; it is reaped and ``{"exit": code}`` sent;
- a wake-up socket written by SIGTERM/SIGINT/SIGHUP: stop, as ``--stop`` does.

Stopping: no new connections; SIGTERM to every running job's process group, SIGKILL after
:data:`STOP_GRACE_S`; each job's client still gets its exit code; then the socket is removed.
"""

from __future__ import annotations

import os
import select
import selectors
import signal
import socket
import struct
import sys
import time

from fedagent.warm import protocol
from fedagent.warm.child import BLOCKED, run_job
from fedagent.warm.preload import Guard

STOP_GRACE_S = 5.0


def log(message: str) -> None:
    """One line into the server's log (its stderr)."""
    print(f"warm-server[{os.getpid()}] {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def _killpg(pgid: int, signum: int) -> None:
    """Signal a job's process group (the job itself if its group is somehow gone: it is our child)."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        try:
            os.kill(pgid, signum)
        except ProcessLookupError:
            pass
    except PermissionError:
        pass


class Job:
    """One forked job: its pid (= its process group), pidfd and client connection (None once gone)."""

    def __init__(self, pid: int, pidfd: int, conn: "Conn", command: str):
        self.pid, self.pidfd, self.conn, self.command = pid, pidfd, conn, command

    def exited(self) -> bool:
        """Whether the job has exited (not yet reaped)."""
        return bool(select.select([self.pidfd], [], [], 0)[0])      # a pidfd reads ready once it exited


class Conn:
    """One client connection."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.reader = protocol.Reader()
        self.handled = False
        self.job: Job | None = None


class WarmServer:
    """Serve on ``listener`` until stopped; :meth:`serve` returns the exit code."""

    def __init__(self, listener: socket.socket, guard: Guard, info: dict):
        self.listener, self.guard, self.info = listener, guard, info
        self.sel = selectors.DefaultSelector()
        self.conns: set[Conn] = set()
        self.jobs: dict[int, Job] = {}
        self.stop_waiters: list[Conn] = []
        self.stopping = False
        self.kill_at: float | None = None
        self.wake_r, self.wake_w = socket.socketpair()
        self.uid = os.getuid()

    # ------------------------------------------------------------------ loop
    def serve(self) -> int:
        """The loop; returns once stopped and every job is reaped."""
        for sock in (self.wake_r, self.wake_w, self.listener):
            sock.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda *_: None)        # the wake-up byte does the work
        self.sel.register(self.wake_r, selectors.EVENT_READ, self._on_wake)
        self.sel.register(self.listener, selectors.EVENT_READ, self._on_accept)
        while not (self.stopping and not self.jobs):
            timeout = None if self.kill_at is None else max(0.0, self.kill_at - time.monotonic())
            for key, _ in self.sel.select(timeout):
                key.data(key.fileobj)
            if self.kill_at is not None and time.monotonic() >= self.kill_at:
                for job in self.jobs.values():
                    log(f"pid {job.pid} still running {STOP_GRACE_S} s after SIGTERM: SIGKILL to its group")
                    _killpg(job.pid, signal.SIGKILL)
                self.kill_at = None
        for conn in self.stop_waiters:
            self._reply(conn, {"stopped": True})
        for conn in list(self.conns):
            self._close(conn)
        signal.set_wakeup_fd(-1)
        self.sel.close()
        log("stopped")
        return 0

    def _on_wake(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(64)
        except BlockingIOError:
            return
        if data:
            log(f"signal {data[0]} received: stopping")
            self._begin_stop()

    def _begin_stop(self) -> None:
        """No new connections; SIGTERM every job's process group; SIGKILL after the grace."""
        if self.stopping:
            return
        self.stopping = True
        self.sel.unregister(self.listener)
        self.listener.close()
        path = self.info["socket"]
        try:
            if os.stat(path).st_ino == self.info["inode"]:   # only our own socket file
                os.unlink(path)
        except FileNotFoundError:
            pass
        for job in self.jobs.values():
            log(f"stopping: SIGTERM to process group {job.pid} ({job.command})")
            _killpg(job.pid, signal.SIGTERM)
        self.kill_at = time.monotonic() + STOP_GRACE_S if self.jobs else None

    # ------------------------------------------------------------------ connections
    def _on_accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != self.uid:                        # mode 0600 already says so; root may still connect
            log(f"refused a connection from uid {uid}")
            sock.close()
            return
        sock.setblocking(False)
        conn = Conn(sock)
        self.conns.add(conn)
        self.sel.register(sock, selectors.EVENT_READ, lambda _s, c=conn: self._on_readable(c))

    def _on_readable(self, conn: Conn) -> None:
        try:
            alive = conn.reader.feed(conn.sock)
            msg = conn.reader.message() if alive and not conn.handled else None
        except BlockingIOError:
            return
        except (OSError, protocol.ProtocolError) as err:
            log(f"bad connection: {err}")
            alive, msg = False, None
        if not alive:
            self._client_gone(conn)
            return
        if conn.handled:
            conn.reader.buf.clear()                # nothing more is expected after a request
        elif msg is not None:
            conn.handled = True
            self._handle(conn, msg)

    def _client_gone(self, conn: Conn) -> None:
        """End of a client's stream: a job still running has lost its client and is killed."""
        job = conn.job
        self._close(conn)
        if job is not None:
            job.conn = None
            if job.pid in self.jobs and not job.exited():
                log(f"client of pid {job.pid} ({job.command}) went away: SIGKILL to its process group")
                _killpg(job.pid, signal.SIGKILL)

    def _close(self, conn: Conn) -> None:
        if conn in self.conns:
            self.conns.discard(conn)
            self.sel.unregister(conn.sock)
            conn.sock.close()
        for fd in conn.reader.take_fds():
            os.close(fd)

    def _reply(self, conn: Conn, obj: dict) -> None:
        try:
            conn.sock.sendall(protocol.encode(obj))
        except OSError:
            pass                                   # the client is gone; its end of stream follows

    # ------------------------------------------------------------------ requests
    def _handle(self, conn: Conn, msg: dict) -> None:
        op = msg.get("op")
        if op == "ping":
            self._reply(conn, {"pong": True, **self.info, "jobs": sorted(self.jobs)})
            self._close(conn)
        elif op == "stop":
            log("stop requested")
            self.stop_waiters.append(conn)
            self._begin_stop()
        elif op == "run":
            fds = conn.reader.take_fds()
            why = self._refusal(msg, fds)
            if why is not None:
                for fd in fds:
                    os.close(fd)
                log(f"refused `fedagent {' '.join(map(str, msg.get('argv', [])))[:200]}`: {why}")
                self._reply(conn, {"error": why})
                self._close(conn)
                return
            conn.job = self._fork(conn, msg, fds)
            self._reply(conn, {"pid": conn.job.pid})
        else:
            self._reply(conn, {"error": f"unknown request {op!r}"})
            self._close(conn)

    def _refusal(self, msg: dict, fds: list[int]) -> str | None:
        if self.stopping:
            return "the warm server is stopping"
        if len(fds) != 3:
            return f"expected the client's fds 0/1/2, got {len(fds)} fd(s)"
        if not isinstance(msg.get("argv"), list) or not msg["argv"]:
            return "a request needs a non-empty argv"
        return self.guard.refusal(msg)

    def _fork(self, conn: Conn, msg: dict, fds: list[int]) -> Job:
        """Fork the job (signals blocked across the fork, so none reaches the child's copy of the
        server's handlers); the parent makes it a process-group leader before anyone learns its pid."""
        env = self.guard.job_env(msg["env"])
        command = " ".join(map(str, msg["argv"]))[:200]
        sys.stdout.flush()
        sys.stderr.flush()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)
        pid = -1
        try:
            pid = os.fork()
            if pid == 0:
                self._close_in_child()
                run_job(msg, fds, env)             # never returns
        finally:
            if pid != 0:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
        try:
            os.setpgid(pid, pid)
        except (PermissionError, ProcessLookupError):
            pass                                   # the child did it first, or is gone already
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        job = Job(pid, pidfd, conn, command)
        self.jobs[pid] = job
        self.sel.register(pidfd, selectors.EVENT_READ, lambda _fd, j=job: self._on_exit(j))
        log(f"forked pid {pid} (process group {pid}) for client pid {msg.get('client_pid')}: fedagent {command}")
        return job

    def _close_in_child(self) -> None:
        """In the forked child: drop every fd of the server's (the job's own come from the request)."""
        os.setpgid(0, 0)
        for conn in self.conns:
            conn.sock.close()
            for fd in conn.reader.fds:
                os.close(fd)
        for job in self.jobs.values():
            os.close(job.pidfd)
        for sock in (self.listener, self.wake_r, self.wake_w):
            sock.close()
        self.sel.close()

    def _on_exit(self, job: Job) -> None:
        _, status = os.waitpid(job.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        self.sel.unregister(job.pidfd)
        os.close(job.pidfd)
        del self.jobs[job.pid]
        log(f"pid {job.pid} exited with {code}: fedagent {job.command}")
        if job.conn is not None:
            self._reply(job.conn, {"exit": code})
            self._close(job.conn)
