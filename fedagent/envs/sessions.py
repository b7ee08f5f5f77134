"""The env service's in-process state: the pool of env instances, the sessions that borrow them,
and the bounded hand-off of blocking env calls to threads (:mod:`fedagent.envs.service` serves them)."""

from __future__ import annotations

import asyncio
import collections
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence


class EnvPool:
    """A fixed set of envs; ``borrow`` waits (async, FIFO) while none is free."""

    def __init__(self, envs: Sequence[Any]):
        """Own ``envs``; all start free."""
        self.total = len(envs)
        self._free = list(envs)
        self._waiters: list[asyncio.Future] = []

    @property
    def free(self) -> int:
        """Number of envs not lent out."""
        return len(self._free)

    async def borrow(self, timeout: float | None = None):
        """Take an env, waiting at most ``timeout`` seconds (None: forever)."""
        if self._free:
            return self._free.pop()
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            # wait on a shield so a timeout/cancel never loses an env handed to `fut`
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # handed over just as we gave up: give it back
            else:
                fut.cancel()
                if fut in self._waiters:
                    self._waiters.remove(fut)
            raise

    def release(self, env) -> None:
        """Return ``env``: hand it to the oldest live waiter, else put it back."""
        while self._waiters:
            fut = self._waiters.pop(0)
            if not fut.done():
                fut.set_result(env)
                return
        self._free.append(env)


@dataclass
class Session:
    """Server-side state of one session."""

    session_id: str
    ready: asyncio.Future  # resolves when the env is borrowed
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    env: Any = None
    closed: bool = False
    task_id: str | None = None
    task_type: str = ""
    next_step_id: int = 0
    turns: int = 0
    done: bool = False
    last_obs: str = ""
    last_admissible: list[str] = field(default_factory=list)
    last_score: float = 0.0
    last_won: bool = False
    replay: tuple[int, str, dict] | None = None  # (step_id, text, response) of the last step


class ThreadCalls:
    """Runs blocking env calls on an executor; results reach the loop one wake-up per burst.

    ``run_in_executor`` wakes the event loop once per finished call; a /step_batch of 64
    items finishes 64 calls at nearly the same time, and those wake-ups cost more than a
    fast env step. Here a finished call queues its result and only the first one of a burst
    schedules the drain.
    """

    def __init__(self, executor: ThreadPoolExecutor):
        """Use ``executor``'s threads."""
        self.executor = executor
        self._done: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._drain_pending = False

    def run(self, loop, fn, *args) -> asyncio.Future:
        """Start ``fn(*args)`` in a thread; the returned future resolves on ``loop``."""
        fut = loop.create_future()
        self.executor.submit(self._call, loop, fut, fn, args)
        return fut

    def _call(self, loop, fut, fn, args) -> None:
        try:
            self._done.append((fut, fn(*args), None))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            self._done.append((fut, None, exc))
        with self._lock:
            if self._drain_pending:
                return  # the pending drain will also take this result
            self._drain_pending = True
        try:
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # loop closed at shutdown: nobody is waiting
            pass

    def _drain(self) -> None:
        with self._lock:
            self._drain_pending = False  # before draining: a result queued from now on re-schedules
        while self._done:
            fut, out, exc = self._done.popleft()
            if fut.cancelled():
                continue
            if exc is None:
                fut.set_result(out)
            elif isinstance(exc, StopIteration):  # a future refuses StopIteration itself
                fut.set_exception(RuntimeError(f"env call raised {exc!r}"))
            else:
                fut.set_exception(exc)
