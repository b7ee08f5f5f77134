"""Shared helpers for the env tests: a fast fake task source, an in-thread uvicorn, games.

Imported by tests/test_env_*.py (pytest puts tests/ on sys.path). Generated TextWorld games
are cached per process, because each game costs ~5 s of tw-make.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from fedagent.envs.base import ResetResult, StepResult

_GAMES_CACHE: dict[tuple, Path] = {}
_GAMES_ROOT: list[Path] = []
_GAMES_LOCK = threading.Lock()


def tw_games_dir(n_train: int = 2, n_val: int = 1, seed: int = 7) -> Path:
    """A generated TextWorld games directory (generated once per process per arguments)."""
    from fedagent.envs.textworld.games import generate_games

    key = (n_train, n_val, seed)
    with _GAMES_LOCK:
        if key not in _GAMES_CACHE:
            if not _GAMES_ROOT:
                _GAMES_ROOT.append(Path(tempfile.mkdtemp(prefix="fa-games-")))
            out = _GAMES_ROOT[0] / f"g-{seed}-{n_train}-{n_val}"
            generate_games(
                out, base_seed=seed, n_train=n_train, n_val=n_val, jobs=2, quarantine_root=_GAMES_ROOT[0] / "_failed"
            )
            _GAMES_CACHE[key] = out
        return _GAMES_CACHE[key]


class FakeEnv:
    """A tiny deterministic env: say 'win' to win; every other action echoes."""

    def __init__(self, max_turns: int, delay: float = 0.0):
        self.max_turns, self.delay = max_turns, delay
        self.task_id = None
        self.turns = 0
        self.closed = False
        self.steps = 0

    def reset(self, task_id: str) -> ResetResult:
        time.sleep(self.delay)
        self.task_id, self.turns = task_id, 0
        return ResetResult(f"start of {task_id}", f"win {task_id}", ["win", "look"], task_id, "fake")

    def step(self, action: str) -> StepResult:
        time.sleep(self.delay)
        self.turns += 1
        self.steps += 1
        won = action == "win"
        return StepResult(
            f"{self.task_id}: you said {action}",
            10.0 if won else 0.0,
            won or self.turns >= self.max_turns,
            won,
            ["win", "look"],
            1.0 if won else 0.0,
        )

    def close(self) -> None:
        self.closed = True


class FakeTaskSource:
    """``n`` fake tasks ``fake-000``…; envs built with an optional per-call delay."""

    prompt_template = "textworld"

    def __init__(self, n: int = 10, delay: float = 0.0):
        self.ids = [f"fake-{i:03d}" for i in range(n)]
        self.delay = delay
        self.envs: list[FakeEnv] = []

    def task_ids(self, split: str) -> list[str]:
        return list(self.ids)

    def task_type(self, task_id: str) -> str:
        if task_id not in self.ids:
            raise KeyError(task_id)
        return "fake"

    def make_env(self, max_turns: int) -> FakeEnv:
        env = FakeEnv(max_turns, self.delay)
        self.envs.append(env)
        return env


@contextlib.contextmanager
def serve_in_thread(app, uds: Path):
    """Run ``app`` with real uvicorn on a Unix socket in a background thread.

    ``log_config=None``: uvicorn leaves the test process's logging as it is. Its default config goes
    through logging.config.dictConfig, which closes every existing handler; absl's handler (imported
    with dp_accounting) then closes the stream it was made with, pytest's capture file when a test
    holding capsys runs this, and every later test of the worker errs with "I/O operation on closed
    file"."""
    config = uvicorn.Config(
        app,
        uds=str(uds),
        log_level="warning",
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield uds
    finally:
        server.should_exit = True
        thread.join(10)


_SHORT_TMPS: list[Path] = []


def _remove_short_tmps() -> None:
    import shutil

    for d in _SHORT_TMPS:
        shutil.rmtree(d, ignore_errors=True)


def short_tmp() -> Path:
    """A short temp dir for Unix sockets (pytest's tmp_path can exceed the 107-byte limit); removed when
    the test process ends (a suite run left ≈ 100 in /tmp before)."""
    if not _SHORT_TMPS:
        import atexit

        atexit.register(_remove_short_tmps)
    d = Path(tempfile.mkdtemp(prefix="fa-t-"))
    _SHORT_TMPS.append(d)
    return d


class FlakyTransport(httpx.BaseTransport):
    """Wraps a transport; injects failures on chosen paths from a seeded local RNG.

    ``before``: probability of a ConnectError before the request is sent (server never saw it);
    ``after``: probability of a ReadError after the server answered (response lost).
    """

    def __init__(self, inner: httpx.BaseTransport, rng, paths: set[str], before: float, after: float):
        self.inner, self.rng, self.paths = inner, rng, paths
        self.before, self.after = before, after
        self.lock = threading.Lock()
        self.injected = 0

    def _roll(self) -> float:
        with self.lock:
            return self.rng.random()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in self.paths:
            if self._roll() < self.before:
                with self.lock:
                    self.injected += 1
                raise httpx.ConnectError("injected: before send", request=request)
            if self._roll() < self.after:
                resp = self.inner.handle_request(request)
                resp.read()
                resp.close()
                with self.lock:
                    self.injected += 1
                raise httpx.ReadError("injected: response lost", request=request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def _child_serve(factory, uds: str) -> None:
    app = factory()
    config = uvicorn.Config(
        app, uds=uds, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=2
    )
    uvicorn.Server(config).run()


@contextlib.contextmanager
def serve_in_process(factory, uds: Path):
    """Run ``factory()``'s app with real uvicorn in a forked child (its own GIL)."""
    import multiprocessing
    import os
    import signal

    proc = multiprocessing.get_context("fork").Process(target=_child_serve, args=(factory, str(uds)), daemon=True)
    proc.start()
    deadline = time.monotonic() + 20
    try:
        while True:
            try:
                with httpx.Client(transport=httpx.HTTPTransport(uds=str(uds)), base_url="http://x") as c:
                    if c.get("/health").status_code == 200:
                        break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or not proc.is_alive():
                raise RuntimeError("service process did not start")
            time.sleep(0.05)
        yield uds
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
