"""Env instances hosted in worker processes, for envs whose stepping holds the GIL.

TextWorld's per-step work is mostly Python (state tracking, admissible commands), so env
threads inside the service process compete with each other *and* with the event loop for
one GIL. With ``env_procs=K`` the service keeps only proxies: ``K`` worker processes each own
a share of the pool's envs and answer ``(env index, method, args)`` messages over a pipe.
A proxy call blocks its (executor) thread on the pipe, which releases the GIL.

A worker exits when its pipe closes, so workers never outlive the service (even a SIGKILLed
one: the kernel closes the service's end of the pipe).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any


def _worker(
    conn, task_source, max_turns: int, n_envs: int, close_fds: tuple[int, ...] = (), expert: bool = False
) -> None:
    for fd in close_fds:  # forked: the service's ends of every pipe so far (EOF must reach us)
        try:
            os.close(fd)
        except OSError:
            pass
    envs = [
        task_source.make_env(max_turns, policy_commands=True) if expert else task_source.make_env(max_turns)
        for _ in range(n_envs)
    ]
    conn.send(("ok", n_envs))  # ready
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        idx, method, args = msg
        try:
            out = ("ok", getattr(envs[idx], method)(*args))
        except Exception as exc:  # noqa: BLE001 - sent back, re-raised in the service
            out = ("err", f"{type(exc).__name__}: {exc}")
        conn.send(out)
    for env in envs:
        try:
            env.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class EnvWorker:
    """One worker process owning ``n_envs`` envs; calls are serialized per worker."""

    def __init__(
        self,
        ctx,
        task_source,
        max_turns: int,
        n_envs: int,
        siblings: tuple["EnvWorker", ...] = (),
        expert: bool = False,
    ):
        """Start the process (envs are built inside it; ``expert``: with their expert). Forked, it closes
        its copies of the service's pipe ends (its own and ``siblings``'), so it still sees EOF when the
        service dies."""
        self.conn, child = ctx.Pipe()
        close_fds = ()
        if ctx.get_start_method() == "fork":
            close_fds = tuple(w.conn.fileno() for w in siblings) + (self.conn.fileno(),)
        self.proc = ctx.Process(
            target=_worker, args=(child, task_source, max_turns, n_envs, close_fds, expert), daemon=True
        )
        self.proc.start()
        child.close()
        self.lock = threading.Lock()
        self.n_envs = n_envs

    def wait_ready(self, timeout: float) -> None:
        """Block until the worker built its envs."""
        if not self.conn.poll(timeout):
            raise RuntimeError(f"env worker {self.proc.pid} not ready after {timeout} s")
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"env worker failed to start: {out}")

    def call(self, idx: int, method: str, *args) -> Any:
        """Run ``envs[idx].method(*args)`` in the worker and return its result."""
        with self.lock:
            try:
                self.conn.send((idx, method, args))
                status, out = self.conn.recv()
            except (EOFError, OSError) as exc:
                raise RuntimeError(f"env worker {self.proc.pid} died (exit code {self.proc.exitcode})") from exc
        if status != "ok":
            raise RuntimeError(f"env worker: {out}")
        return out

    def shutdown(self) -> None:
        """Ask the worker to exit; terminate it if it does not."""
        with self.lock:
            try:
                self.conn.send(None)
            except (OSError, ValueError):
                pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        self.conn.close()


class RemoteEnv:
    """A :class:`fedagent.envs.base.TextEnv` proxy for env ``idx`` of a worker."""

    def __init__(self, worker: EnvWorker, idx: int):
        """Proxy of ``worker``'s env number ``idx``."""
        self.worker, self.idx = worker, idx

    def reset(self, task_id: str):
        """See TextEnv.reset."""
        return self.worker.call(self.idx, "reset", task_id)

    def step(self, action: str):
        """See TextEnv.step."""
        return self.worker.call(self.idx, "step", action)

    def expert_action(self):
        """See the env's ``expert_action`` (a worker started with ``expert=True``)."""
        return self.worker.call(self.idx, "expert_action")

    def close(self) -> None:
        """Nothing to do here: the worker closes its envs when it exits."""


def default_start_method() -> str:
    """``fork`` where it is safe and cheap, else ``spawn``.

    A forked worker starts at once with what this process imported (the warm server's
    preloaded TextWorld included); a spawned one is a fresh interpreter that imports it all
    again (≈ 0.3 s each, and its first game load pays TextWorld's first-use costs). Forking is
    safe only while this process runs a single thread (Linux: ``/proc/self/task``), as the
    service does while it builds its pool, before its server and executor threads start.
    """
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: no cheap, safe fork to rely on
        return "spawn"
    return "fork" if threads == 1 else "spawn"


def process_envs(
    task_source,
    max_turns: int,
    pool_size: int,
    n_procs: int,
    *,
    start_method: str | None = None,
    ready_timeout: float = 120.0,
    expert: bool = False,
):
    """``pool_size`` env proxies spread round-robin over ``n_procs`` workers; returns (envs, workers).

    ``start_method`` None: :func:`default_start_method`. ``expert``: envs made with their expert
    (``make_env(..., policy_commands=True)``; the proxies answer ``expert_action``): the warm start's
    ALFWorld demos, whose planner holds a process-wide lock, play in parallel only this way."""
    n_procs = max(1, min(int(n_procs), int(pool_size)))
    ctx = multiprocessing.get_context(start_method or default_start_method())
    counts = [pool_size // n_procs + (1 if k < pool_size % n_procs else 0) for k in range(n_procs)]
    workers: list[EnvWorker] = []
    for n in counts:
        workers.append(EnvWorker(ctx, task_source, max_turns, n, tuple(workers), expert=expert))
    try:
        for w in workers:
            w.wait_ready(ready_timeout)
    except BaseException:
        for w in workers:
            w.shutdown()
        raise
    envs = [RemoteEnv(w, i) for w in workers for i in range(w.n_envs)]
    # interleave so consecutive borrows land on different workers
    envs.sort(key=lambda e: (e.idx, workers.index(e.worker)))
    return envs, workers
