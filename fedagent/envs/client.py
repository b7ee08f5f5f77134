"""A synchronous httpx client of the environment service.

Retries transport errors only (connection refused/reset, timeouts, a response lost
mid-read), never an HTTP status: every endpoint is idempotent for a retry of the *same*
request (create waits for the first borrow, a re-sent step_id replays, close of a closed
session is ok), while a 4xx means the request itself is wrong and must not be repeated.
A retried ``/*_batch`` request is safe for the same reason: each item is a single
endpoint's body (a step item carries its step_id).
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

TOKEN_HEADER = "x-fedagent-token"  # the service imports it from here (keeps clients light)
MAX_BATCH_ITEMS = 256  # items per /*_batch request (service limit; *_many split)
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
    """Some items of a /*_batch request failed; names the first failed session, keeps them all.

    ``failures``: ``(index, session_id, status, detail)`` per failed item; ``results``: every
    item's result in order (a failed one is its ``{"error": ...}`` object). The client's
    bookkeeping (step ids) already reflects the items that succeeded.
    """

    def __init__(self, failures: list[tuple[int, str, int, str]], results: list[dict], path: str = "/step_batch"):
        """Describe the first failure and how many more there were."""
        index, sid, status, detail = failures[0]
        more = f" (and {len(failures) - 1} more failed items)" if len(failures) > 1 else ""
        super().__init__(status, path, f"item {index}, session {sid!r}: {detail}{more}")
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
            transport=transport,
            base_url=base_url or "http://envservice",
            headers=headers,
            timeout=timeout,
        )
        self.max_retries = int(max_retries)
        self._sleep = sleep
        self._rng = random.Random()  # jitter only; seeded from the OS on purpose
        self._step_ids: dict[str, int] = {}
        self._lock = threading.Lock()
        self.retries = 0  # transport errors retried (for tests/logs)

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
        sids = _distinct([sid for sid, _ in items], "step_many", "step it twice instead")
        with self._lock:
            missing = [sid for sid in sids if sid not in self._step_ids]
            if missing:
                raise RuntimeError(f"step of session {missing[0]!r} before reset (on this client)")
            step_ids = [self._step_ids[sid] for sid in sids]
        bodies = [
            {"session_id": sid, "text": text, "step_id": step_id} for (sid, text), step_id in zip(items, step_ids)
        ]

        def book(i: int, _result: dict) -> None:
            self._step_ids[sids[i]] = step_ids[i] + 1

        return self._batch("/step_batch", bodies, book)

    def create_many(self, session_ids: Sequence[str]) -> list[dict]:
        """POST /create_batch: create every session in one round trip (no read timeout, as create)."""
        sids = _distinct([str(s) for s in session_ids], "create_many")
        timeout = httpx.Timeout(connect=10.0, read=None, write=10.0, pool=None)
        return self._batch("/create_batch", [{"session_id": sid} for sid in sids], timeout=timeout)

    def reset_many(self, items: Sequence[tuple[str, int]]) -> list[dict]:
        """POST /reset_batch: one reset per ``(session_id, seed)``; each reset session's next step_id is 0."""
        bodies = [{"session_id": str(sid), "seed": int(seed)} for sid, seed in items]
        _distinct([b["session_id"] for b in bodies], "reset_many")

        def book(i: int, _result: dict) -> None:
            self._step_ids[bodies[i]["session_id"]] = 0

        return self._batch("/reset_batch", bodies, book)

    def expert_many(self, session_ids: Sequence[str]) -> list[str | None]:
        """POST /expert_batch: each session's expert action (None once its episode is over)."""
        sids = _distinct([str(s) for s in session_ids], "expert_many")
        return [r["action"] for r in self._batch("/expert_batch", [{"session_id": sid} for sid in sids])]

    def close_many(self, session_ids: Sequence[str]) -> list[dict]:
        """POST /close_batch (retried; idempotent on the service)."""
        sids = [str(s) for s in session_ids]
        with self._lock:
            for sid in sids:
                self._step_ids.pop(sid, None)
        return self._batch("/close_batch", [{"session_id": sid} for sid in sids])

    def _batch(self, path: str, bodies: list[dict], book=None, *, timeout=httpx.USE_CLIENT_DEFAULT) -> list[dict]:
        """POST ``bodies`` as items of ``path`` in chunks; ``book(i, result)`` per succeeded item.

        Raises :class:`EnvBatchError` naming the first failed item after every chunk ran and
        was booked: a later chunk's failure must not lose an earlier chunk's bookkeeping.
        """
        results: list[dict] = []
        failures: list[tuple[int, str, int, str]] = []
        for k in range(0, len(bodies), MAX_BATCH_ITEMS):
            chunk = bodies[k : k + MAX_BATCH_ITEMS]
            out = self._call("POST", path, {"items": chunk}, timeout=timeout)["results"]
            if len(out) != len(chunk):
                raise EnvServiceError(200, path, f"{len(out)} results for {len(chunk)} items")
            with self._lock:
                for i, r in enumerate(out, start=k):
                    if "error" in r:
                        err = r["error"]
                        failures.append(
                            (i, bodies[i]["session_id"], int(err.get("status", 0)), str(err.get("detail", "")))
                        )
                    elif book is not None:
                        book(i, r)
            results.extend(out)
        if failures:
            raise EnvBatchError(failures, results, path)
        return results

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


def _distinct(sids: list[str], what: str, hint: str = "one item per session") -> list[str]:
    """``sids`` unchanged if no session appears twice (a batch item per session), else ValueError."""
    if len(set(sids)) != len(sids):
        raise ValueError(f"{what}: a session appears twice in one call ({hint})")
    return sids
