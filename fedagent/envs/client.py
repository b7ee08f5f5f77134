"""A synchronous httpx client of the environment service.

Retries transport errors only (connection refused/reset, timeouts, a response lost
mid-read), never an HTTP status: every endpoint is idempotent for a retry of the *same*
request (create waits for the first borrow, a re-sent step_id replays, close of a closed
session is ok), while a 4xx means the request itself is wrong and must not be repeated.
A retried ``/step_batch`` is safe for the same reason: every item carries its step_id.
Backoff: 0.3·2^k s capped at 4 s, plus up to 0.3 s jitter, at most 8 retries. The jitter
comes from a private RNG and only spreads retries in time; it never affects results.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import Any, Iterator, Sequence

import httpx

TOKEN_HEADER = "x-fedagent-token"   # the service imports it from here (keeps clients light)
MAX_BATCH_ITEMS = 256                # items per /step_batch (service limit; step_many splits)
MAX_RETRIES = 8
BACKOFF_BASE = 0.3
BACKOFF_CAP = 4.0
JITTER = 0.3


class EnvServiceError(RuntimeError):
    """The service answered with an HTTP error status (not retried)."""

    def __init__(self, status: int, path: str, detail: Any):
        """Keep status, endpoint and the service's detail message."""
        super().__init__(f"env service {path} -> HTTP {status}: {detail}")
        self.status, self.path, self.detail = status, path, detail


class EnvBatchError(EnvServiceError):
    """Some items of a /step_batch failed; names the first failed session, keeps them all.

    ``failures``: ``(index, session_id, status, detail)`` per failed item; ``results``: every
    item's result in order (a failed one is its ``{"error": ...}`` object). Sessions whose
    item succeeded have advanced their step_id.
    """

    def __init__(self, failures: list[tuple[int, str, int, str]], results: list[dict]):
        """Describe the first failure and how many more there were."""
        index, sid, status, detail = failures[0]
        more = f" (and {len(failures) - 1} more failed items)" if len(failures) > 1 else ""
        super().__init__(status, "/step_batch", f"item {index}, session {sid!r}: {detail}{more}")
        self.session_id, self.failures, self.results = sid, failures, results


class EnvClient:
    """Client of one env service, over a Unix socket (``uds``) or TCP (``base_url``)."""

    def __init__(
        self,
        uds: str | None = None,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        max_retries: int = MAX_RETRIES,
        transport: httpx.BaseTransport | None = None,
        sleep=time.sleep,
    ):
        """Connect lazily; exactly one of ``uds``/``base_url`` (or a test ``transport``)."""
        if transport is None:
            if (uds is None) == (base_url is None):
                raise ValueError("give exactly one of uds= or base_url=")
            transport = httpx.HTTPTransport(uds=uds) if uds is not None else httpx.HTTPTransport()
        headers = {TOKEN_HEADER: token} if token else {}
        self._http = httpx.Client(
            transport=transport, base_url=base_url or "http://envservice",
            headers=headers, timeout=timeout,
        )
        self.max_retries = int(max_retries)
        self._sleep = sleep
        self._rng = random.Random()          # jitter only; seeded from the OS on purpose
        self._step_ids: dict[str, int] = {}
        self._lock = threading.Lock()
        self.retries = 0                     # transport errors retried (for tests/logs)

    # ---------------------------------------------------------------- plumbing
    def _backoff(self, attempt: int) -> float:
        with self._lock:
            jitter = self._rng.uniform(0.0, JITTER)
        return min(BACKOFF_BASE * 2**attempt, BACKOFF_CAP) + jitter

    def _call(self, method: str, path: str, body: dict | None = None, *, timeout=httpx.USE_CLIENT_DEFAULT) -> dict:
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._sleep(self._backoff(attempt - 1))
            try:
                # `with` closes the response (and frees its connection) on every path.
                with self._http.stream(method, path, json=body, timeout=timeout) as resp:
                    resp.read()
            except httpx.TransportError as exc:
                last = exc
                with self._lock:
                    self.retries += 1
                continue
            if resp.status_code >= 400:
                try:
                    detail = resp.json().get("detail")
                except ValueError:
                    detail = resp.text[:500]
                raise EnvServiceError(resp.status_code, path, detail)
            return resp.json()
        raise ConnectionError(f"env service {path}: {self.max_retries} retries failed: {last!r}") from last

    # ---------------------------------------------------------------- endpoints
    def health(self) -> dict:
        """GET /health."""
        return self._call("GET", "/health")

    def create(self, session_id: str) -> dict:
        """POST /create; no read timeout because it legitimately blocks while the pool is empty."""
        timeout = httpx.Timeout(connect=10.0, read=None, write=10.0, pool=None)
        return self._call("POST", "/create", {"session_id": session_id}, timeout=timeout)

    def reset(self, session_id: str, seed: int) -> dict:
        """POST /reset; the session's next step_id becomes 0."""
        out = self._call("POST", "/reset", {"session_id": session_id, "seed": int(seed)})
        with self._lock:
            self._step_ids[session_id] = 0
        return out

    def step(self, session_id: str, text: str) -> dict:
        """POST /step with the session's next step_id, advanced only on success."""
        with self._lock:
            if session_id not in self._step_ids:
                raise RuntimeError(f"step of session {session_id!r} before reset (on this client)")
            step_id = self._step_ids[session_id]
        out = self._call("POST", "/step", {"session_id": session_id, "text": text, "step_id": step_id})
        with self._lock:
            self._step_ids[session_id] = step_id + 1
        return out

    def step_many(self, items: Sequence[tuple[str, str]]) -> list[dict]:
        """POST /step_batch: one step per ``(session_id, text)``, results in the same order.

        Each session's step_id advances only if its item succeeded; if any item failed,
        :class:`EnvBatchError` is raised after that bookkeeping (names the session).
        """
        items = [(str(sid), str(text)) for sid, text in items]
        sids = [sid for sid, _ in items]
        if len(set(sids)) != len(sids):
            raise ValueError("step_many: a session appears twice in one call (step it twice instead)")
        with self._lock:
            missing = [sid for sid in sids if sid not in self._step_ids]
            if missing:
                raise RuntimeError(f"step of session {missing[0]!r} before reset (on this client)")
            step_ids = [self._step_ids[sid] for sid in sids]
        results: list[dict] = []
        failures: list[tuple[int, str, int, str]] = []
        for k in range(0, len(items), MAX_BATCH_ITEMS):
            chunk = range(k, min(k + MAX_BATCH_ITEMS, len(items)))
            body = {"items": [{"session_id": sids[i], "text": items[i][1], "step_id": step_ids[i]}
                              for i in chunk]}
            out = self._call("POST", "/step_batch", body)["results"]
            if len(out) != len(chunk):
                raise EnvServiceError(200, "/step_batch", f"{len(out)} results for {len(chunk)} items")
            # Book each chunk at once: a later chunk's failure must not lose this one's steps.
            results.extend(self._book_batch(chunk, sids, step_ids, out, failures))
        if failures:
            raise EnvBatchError(failures, results)
        return results

    def _book_batch(self, chunk, sids, step_ids, out, failures) -> list[dict]:
        """Advance the step_id of every succeeded item; record the failed ones."""
        with self._lock:
            for i, r in zip(chunk, out):
                if "error" in r:
                    err = r["error"]
                    failures.append((i, sids[i], int(err.get("status", 0)), str(err.get("detail", ""))))
                else:
                    self._step_ids[sids[i]] = step_ids[i] + 1
        return out

    def close(self, session_id: str) -> dict:
        """POST /close (retried; idempotent on the service)."""
        with self._lock:
            self._step_ids.pop(session_id, None)
        return self._call("POST", "/close", {"session_id": session_id})

    @contextlib.contextmanager
    def session(self, session_id: str) -> Iterator[str]:
        """``create`` … ``close`` around a block; close runs even if create or the block failed."""
        try:
            self.create(session_id)
            yield session_id
        finally:
            self.close(session_id)

    # ---------------------------------------------------------------- lifetime
    def shutdown(self) -> None:
        """Close the HTTP connection pool (sockets)."""
        self._http.close()

    def __enter__(self) -> "EnvClient":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
