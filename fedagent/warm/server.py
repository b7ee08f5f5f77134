"""The warm server's loop: one thread, one selector; every job is a fork in its own process group.

Why over 500 lines: it is one state machine (connections, jobs, standbys, stopping) in one class,
whose handlers share its tables; split, each part would reach into the others' state.

Never threads: the server forks, and a fork copies other threads' locks mid-use. Events:

- the listening socket: a new client connection;
- a client connection: its request (then ``{"pid"}`` is sent at once), or its end of stream
  before the job exited (the client was killed): SIGKILL to the job's process group at once;
- a job's pidfd (``os.pidfd_open``): the job exited; it is reaped and ``{"exit": code}`` sent;
- a wake-up socket written by SIGTERM/SIGINT/SIGHUP: stop, as ``--stop`` does;
- with ``--standby N`` (:mod:`fedagent.warm.standby`; N per card when the node's cards are known,
  each standby started with its card's ``CUDA_VISIBLE_DEVICES``), per standby: its socketpair (``{"ready"}``,
  or end of stream), its stdout/stderr pipe (logged line by line, prefixed ``standby[pid]``) and
  its pidfd (died before a job: reaped; replaced if it was ready, else no more standbys).

A ``run`` request for a standby command with a ready standby whose CUDA environment is the job's
(the server's, with ``CUDA_VISIBLE_DEVICES`` set to the standby's card: a job placed on card 1 by
:mod:`fedagent.core.placement` goes to a standby of card 1 only) goes to that standby (the request, the job's environment and the client's fds over its
socketpair); it becomes the job (its pid = its process group, as a fork's) and a replacement is
forked at once. Anything else is forked plainly, as without standbys (one line says why when a
standby was there but not used).

Stopping: no new connections; SIGKILL to every standby waiting for a job; SIGTERM to every
running job's process group, SIGKILL after :data:`STOP_GRACE_S`; each job's client still gets its
exit code; once all of them are reaped, the socket is removed.
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
import traceback

from fedagent.warm import protocol, standby
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


def _exited(pidfd: int) -> bool:
    """Whether the process has exited (not yet reaped): a pidfd reads ready once it has."""
    return bool(select.select([pidfd], [], [], 0)[0])


class Job:
    """One forked job: its pid (= its process group), pidfd and client connection (None once gone)."""

    def __init__(self, pid: int, pidfd: int, conn: "Conn", command: str):
        self.pid, self.pidfd, self.conn, self.command = pid, pidfd, conn, command

    def exited(self) -> bool:
        """Whether the job has exited (not yet reaped)."""
        return _exited(self.pidfd)


class Standby:
    """One standby child: pid (= its process group), pidfd, the server's end of its socketpair and
    the read end of its output pipe (None once closed)."""

    def __init__(self, pid: int, pidfd: int, sock: socket.socket, out: int, card: str | None = None):
        self.pid, self.pidfd, self.sock, self.out = pid, pidfd, sock, out
        self.card = card  # its CUDA_VISIBLE_DEVICES (None: the server's)
        self.state = "preparing"
        self.reader = protocol.Reader()
        self.partial = b""
        self.ready_at: float | None = None
        self.killed = False


class Conn:
    """One client connection."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.reader = protocol.Reader()
        self.handled = False
        self.job: Job | None = None


class WarmServer:
    """Serve on ``listener`` until stopped; :meth:`serve` returns the exit code."""

    def __init__(
        self,
        listener: socket.socket,
        guard: Guard,
        info: dict,
        standbys: int = 0,
        standby_kind: str = "cuda",
        standby_commands=standby.STANDBY_COMMANDS,
        standby_warmup=None,
        standby_refill_delay: float = 0.0,
        standby_cards=(None,),
    ):
        self.listener, self.guard, self.info = listener, guard, info
        self.sel = selectors.DefaultSelector()
        self.conns: set[Conn] = set()
        self.jobs: dict[int, Job] = {}
        self.standby_n, self.standby_kind = int(standbys), standby_kind
        self.standby_warmup = standby_warmup  # fedagent.warm.gpu_warmup.Shapes, or None
        self.standby_commands = frozenset(standby_commands)
        # N standbys per card (None: one set under the server's own CUDA_VISIBLE_DEVICES)
        self.standby_cards = list(standby_cards) or [None]
        self.standbys: list[Standby] = []
        self.handed_off: list[Standby] = []  # standbys now jobs whose output pipe is still open
        self.stop_waiters: list[Conn] = []
        self.stopping = False
        self.kill_at: float | None = None
        # --standby-refill-delay: replacements for handed-over standbys are forked this long after
        # the last hand-over (their start then does not compete with the jobs' own start).
        self.refill_delay = float(standby_refill_delay)
        self.refill_at: float | None = None
        self.wake_r, self.wake_w = socket.socketpair()
        self.uid = os.getuid()

    # ------------------------------------------------------------------ loop
    def serve(self) -> int:
        """The loop; returns once stopped and every job is reaped."""
        for sock in (self.wake_r, self.wake_w, self.listener):
            sock.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda *_: None)  # the wake-up byte does the work
        self.sel.register(self.wake_r, selectors.EVENT_READ, self._on_wake)
        self.sel.register(self.listener, selectors.EVENT_READ, self._on_accept)
        self._top_up()
        while not (self.stopping and not self.jobs and not self.standbys):
            due = [t for t in (self.kill_at, self.refill_at) if t is not None]
            timeout = None if not due else max(0.0, min(due) - time.monotonic())
            for key, _ in self.sel.select(timeout):
                key.data(key.fileobj)
            if self.refill_at is not None and time.monotonic() >= self.refill_at:
                self.refill_at = None
                self._top_up()
            if self.kill_at is not None and time.monotonic() >= self.kill_at:
                for job in self.jobs.values():
                    log(f"pid {job.pid} still running {STOP_GRACE_S} s after SIGTERM: SIGKILL to its group")
                    _killpg(job.pid, signal.SIGKILL)
                self.kill_at = None
        for conn in self.stop_waiters:
            self._reply(conn, {"stopped": True})
        for conn in list(self.conns):
            self._close(conn)
        for sb in list(self.handed_off):
            self._drain(sb, close=True)
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
            if os.stat(path).st_ino == self.info["inode"]:  # only our own socket file
                os.unlink(path)
        except FileNotFoundError:
            pass
        for sb in self.standbys:
            log(f"stopping: SIGKILL to standby pid {sb.pid} ({sb.state})")
            self._kill_standby(sb)
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
        if uid != self.uid:  # mode 0600 already says so; root may still connect
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
            conn.reader.buf.clear()  # nothing more is expected after a request
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
            pass  # the client is gone; its end of stream follows

    # ------------------------------------------------------------------ requests
    def _handle(self, conn: Conn, msg: dict) -> None:
        op = msg.get("op")
        if op == "ping":
            self._reply(
                conn,
                {
                    "pong": True,
                    **self.info,
                    "jobs": sorted(self.jobs),
                    "standby": self.standby_n,
                    "standbys": [
                        {"pid": sb.pid, "state": sb.state, **({} if sb.card is None else {"card": sb.card})}
                        for sb in self.standbys
                    ],
                },
            )
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
            env = self.guard.job_env(msg["env"])
            sb, why = self._pick_standby(msg)
            job = None
            if sb is not None:
                job, why = self._handoff(sb, conn, msg, fds, env)
            if job is None:
                if why is not None:
                    log(f"no standby for `fedagent {_command(msg)}`: {why}; a plain fork")
                job = self._fork(conn, msg, fds, env)
            conn.job = job
            self._reply(conn, {"pid": job.pid})
            if sb is not None and self.refill_delay > 0 and job.pid == sb.pid:
                self.refill_at = time.monotonic() + self.refill_delay  # after the burst of job starts
            elif self.refill_at is None:
                self._top_up()  # after the client's fds are closed here
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

    def _fork_child(self, target) -> int:
        """Fork a child that closes the server's fds and runs ``target()`` (which never returns);
        signals are blocked across the fork, so none reaches the child's copy of the server's
        handlers, and the parent makes it a process-group leader before anyone learns its pid."""
        sys.stdout.flush()
        sys.stderr.flush()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)
        pid = -1
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    self._close_in_child()
                    target()
                except BaseException:  # noqa: BLE001 - never back into the server's loop
                    traceback.print_exc()
                finally:
                    os._exit(1)
        finally:
            if pid != 0:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
        try:
            os.setpgid(pid, pid)
        except (PermissionError, ProcessLookupError):
            pass  # the child did it first, or is gone already
        return pid

    def _fork(self, conn: Conn, msg: dict, fds: list[int], env: dict[str, str]) -> Job:
        """Fork the job (:func:`fedagent.warm.child.run_job` in the child)."""
        command = _command(msg)
        pid = self._fork_child(lambda: run_job(msg, fds, env))
        for fd in fds:
            os.close(fd)
        job = self._add_job(pid, os.pidfd_open(pid), conn, command)
        log(f"forked pid {pid} (process group {pid}) for client pid {msg.get('client_pid')}: fedagent {command}")
        return job

    def _add_job(self, pid: int, pidfd: int, conn: Conn, command: str) -> Job:
        job = Job(pid, pidfd, conn, command)
        self.jobs[pid] = job
        self.sel.register(pidfd, selectors.EVENT_READ, lambda _fd, j=job: self._on_exit(j))
        return job

    # ------------------------------------------------------------------ standbys
    def _top_up(self) -> None:
        """Fork standbys until each card has ``standby_n`` (none while stopping)."""
        for card in self.standby_cards:
            while not self.stopping and sum(sb.card == card for sb in self.standbys) < self.standby_n:
                self._spawn_standby(card)

    def _spawn_standby(self, card: str | None = None) -> None:
        ours, theirs = socket.socketpair()
        r, w = os.pipe()

        def become():
            ours.close()
            os.close(r)
            if card is not None:  # before its CUDA starts: the standby sees its card only
                os.environ["CUDA_VISIBLE_DEVICES"] = card
            standby.live(self.standby_kind, theirs, w, self.standby_warmup)

        pid = self._fork_child(become)
        theirs.close()
        os.close(w)
        ours.setblocking(False)
        os.set_blocking(r, False)
        sb = Standby(pid, os.pidfd_open(pid), ours, r, card)
        self.standbys.append(sb)
        self.sel.register(ours, selectors.EVENT_READ, lambda _s, b=sb: self._on_standby_message(b))
        self.sel.register(r, selectors.EVENT_READ, lambda _fd, b=sb: self._on_standby_output(b))
        self.sel.register(sb.pidfd, selectors.EVENT_READ, lambda _fd, b=sb: self._on_standby_exit(b))
        on = "" if card is None else f", GPU {card}"
        log(f"standby pid {pid} (process group {pid}) forked: preparing ({self.standby_kind}{on})")

    def _pick_standby(self, msg: dict) -> tuple[Standby | None, str | None]:
        """The standby to run this request, or (None, why not) — why is None when none is kept."""
        if not self.standbys:
            return None, None
        command = msg["argv"][0]
        if command not in self.standby_commands:
            return None, f"{command} is not a standby command ({', '.join(sorted(self.standby_commands))})"
        env = msg.get("env") or {}
        mismatch = {card: self.guard.standby_mismatch(env, card) for card in self.standby_cards}
        if all(why is not None for why in mismatch.values()):
            return None, mismatch[self.standby_cards[0]]
        for sb in self.standbys:
            if mismatch.get(sb.card) is None and sb.state == "ready" and sb.sock is not None and not _exited(sb.pidfd):
                return sb, None
        mine = [sb for sb in self.standbys if mismatch.get(sb.card) is None]
        return None, "no standby is ready (" + ", ".join(f"pid {sb.pid} {sb.state}" for sb in mine) + ")"

    def _handoff(
        self, sb: Standby, conn: Conn, msg: dict, fds: list[int], env: dict[str, str]
    ) -> tuple[Job | None, str | None]:
        """Send the job to a ready standby, which becomes it; (None, why) if that failed."""
        self._drain(sb)
        try:
            sb.sock.settimeout(5.0)
            protocol.send(sb.sock, {"request": msg, "env": env}, fds)
        except OSError as err:
            self._kill_standby(sb)
            return None, f"handing it to standby pid {sb.pid} failed ({err}); that standby is killed"
        self.standbys.remove(sb)
        self._close_sock(sb)
        self.sel.unregister(sb.pidfd)
        if sb.out is not None:
            self.handed_off.append(sb)  # its output pipe is read until the job's dup2 ends it
        for fd in fds:
            os.close(fd)
        command = _command(msg)
        job = self._add_job(sb.pid, sb.pidfd, conn, command)
        log(
            f"standby pid {sb.pid} (process group {sb.pid}, ready {time.monotonic() - sb.ready_at:.1f} s "
            f"before the request) runs the job of client pid {msg.get('client_pid')}: fedagent {command}"
        )
        return job, None

    def _kill_standby(self, sb: Standby) -> None:
        """SIGKILL to a standby's group and close its socketpair; its pidfd reaps it."""
        sb.killed = True
        _killpg(sb.pid, signal.SIGKILL)
        self._close_sock(sb)

    def _close_sock(self, sb: Standby) -> None:
        if sb.sock is not None:
            self.sel.unregister(sb.sock)
            sb.sock.close()
            sb.sock = None

    def _on_standby_message(self, sb: Standby) -> None:
        try:
            alive = sb.reader.feed(sb.sock)
            msg = sb.reader.message() if alive else None
        except BlockingIOError:
            return
        except (OSError, protocol.ProtocolError) as err:
            log(f"standby pid {sb.pid}: bad message ({err})")
            alive, msg = False, None
        for fd in sb.reader.take_fds():
            os.close(fd)
        if not alive:  # it is ending; its pidfd says when
            self._close_sock(sb)
        elif msg is not None and "ready" in msg and sb.state == "preparing":
            sb.state, sb.ready_at = "ready", time.monotonic()
            log(f"standby pid {sb.pid} ready: prepared ({self.standby_kind}) in {msg['ready']} s")

    def _on_standby_output(self, sb: Standby) -> None:
        self._drain(sb)

    def _drain(self, sb: Standby, close: bool = False) -> None:
        """Log what the standby wrote so far, line by line; at its end (or with ``close``) close the pipe."""
        eof = False
        while sb.out is not None:
            try:
                data = os.read(sb.out, 65536)
            except BlockingIOError:
                break
            if not data:
                eof = True
                break
            *lines, sb.partial = (sb.partial + data).split(b"\n")
            for line in lines:
                log(f"standby[{sb.pid}] {line.decode(errors='replace')}")
        if (eof or close) and sb.out is not None:
            if sb.partial:
                log(f"standby[{sb.pid}] {sb.partial.decode(errors='replace')}")
                sb.partial = b""
            self.sel.unregister(sb.out)
            os.close(sb.out)
            sb.out = None
            if sb in self.handed_off:
                self.handed_off.remove(sb)

    def _on_standby_exit(self, sb: Standby) -> None:
        """A standby ended before any job: reap it; replace it if it had been ready, else keep no more."""
        _, status = os.waitpid(sb.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if sb.sock is not None and sb.state == "preparing":
            self._on_standby_message(sb)  # a "ready" it sent just before dying, not yet read
        self.sel.unregister(sb.pidfd)
        os.close(sb.pidfd)
        self.standbys.remove(sb)
        self._close_sock(sb)
        self._drain(sb, close=True)  # it has exited: what is in the pipe is all there is
        if sb.killed or sb.state == "ready":
            log(
                f"standby pid {sb.pid} ({sb.state}) ended before a job, exit {code}{' (SIGKILLed)' if sb.killed else ''}"
                + ("" if self.stopping or not self.standby_n else ": forking a replacement")
            )
            self._top_up()
        elif self.standby_n:
            self.standby_n = 0
            log(
                f"standby pid {sb.pid} failed while preparing (exit {code}; its output above): no more standbys "
                f"(--standby is 0 from now on); {', '.join(sorted(self.standby_commands))} jobs fork plainly"
            )
            for other in self.standbys:
                if other.state == "preparing":
                    log(f"SIGKILL to standby pid {other.pid}, still preparing")
                    self._kill_standby(other)
        else:
            log(f"standby pid {sb.pid} ended while preparing (exit {code})")

    def _close_in_child(self) -> None:
        """In the forked child: drop every fd of the server's (the job's own come from the request)."""
        os.setpgid(0, 0)
        for conn in self.conns:
            conn.sock.close()
            for fd in conn.reader.fds:
                os.close(fd)
        for job in self.jobs.values():
            os.close(job.pidfd)
        for sb in self.standbys:
            os.close(sb.pidfd)
            if sb.sock is not None:
                sb.sock.close()
        for sb in (*self.standbys, *self.handed_off):
            if sb.out is not None:
                os.close(sb.out)
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


def _command(msg: dict) -> str:
    """The job's command line as the log shows it."""
    return " ".join(map(str, msg["argv"]))[:200]
