"""Run one call in a process whose address space may grow by at most a budget, forked from a zygote.

Generating ALFWorld games asks the PDDL planner to solve each attempt, and some of its searches never
end (:func:`fedagent.envs.alfworld.generate.solve`): an attempt whose planner needs more than the
budget counts as unsolvable and the next attempt's game is drawn. For that verdict to be a function of
the game alone, the memory the call finds free when it starts must be the same every time. A child
forked from the generating process is not: it inherits that process's heap, whose free chunks depend on
every game it made before (and so on how games were spread over worker processes), and the planner and
the PDDL translation fill those chunks before the address space grows. Seen: one seed's 384 + 256-game
catalogue came out different with ``--jobs 1`` and ``--jobs 2`` on the same machine (three ``valid_seen``
attempts over the budget in one run and under it in the other).

So every bounded call is forked from a zygote: a fresh interpreter (``python -m`` this module), started
once per calling process, that imports what the calls need and then only forks. Its children all start
from the same state, whatever the caller did before; the budget counts from the child's size after it has
read its input. Why not :mod:`multiprocessing`'s ``forkserver`` (the same idea): its children re-import the
caller's ``__main__``, and the GPU node's ``fedagent`` script, like any script without a ``__main__``
guard, would start the whole job again in each one (``tests/test_alfworld_games.py``).

Protocol: the caller writes the call's input as JSON to a file and one JSON line
``{"func", "in", "out", "mem_mb"}`` to the zygote's stdin; the zygote forks, the child writes
``["ok", value] | ["memory", null] | ["error", text]`` to ``out`` and exits, and the zygote answers one
line ``{"status": wait status}``. A child that dies over the budget (the planner's ``bad_alloc`` is a
SIGABRT) writes nothing.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# The calls a zygote may run, by name: "module:function" imported in the zygote before any fork, so that
# each child starts with them loaded (an import in the child would cost its time on every attempt).
CALLS = {
    "solve": "fedagent.envs.alfworld.generate:solve_payload",
    "grow": "fedagent.envs.alfworld.bounded:grow",
}
# Imported by the zygote too: what the solve call imports lazily (TextWorld's PDDL env).
PRELOAD = ("fedagent.envs.alfworld.env",)


class Zygote:
    """One zygote process and the pipe to it; ``call`` runs one bounded call (one at a time)."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="fedagent-bounded-")
        self._proc = subprocess.Popen(
            # the folder is the zygote's too: it removes it when its stdin closes (a forked pool worker
            # ends with os._exit, without this process's atexit)
            [sys.executable, "-m", __name__, self._dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # the planner's own messages (and a child's traceback) go where the caller's go
            stderr=None,
        )
        self._lock = threading.Lock()
        self.pid = os.getpid()  # the process that started it (a fork of that process starts its own)

    def call(self, func: str, payload, mem_mb: int) -> tuple[str | None, object, int]:
        """``(kind, value, wait_status)``: kind "ok"/"memory"/"error", or None when the child wrote
        nothing (it died: over the budget, or killed)."""
        if func not in CALLS:
            raise ValueError(f"unknown bounded call {func!r} (known: {sorted(CALLS)})")
        with self._lock:
            src, out = Path(self._dir, "in.json"), Path(self._dir, "out.json")
            out.unlink(missing_ok=True)
            src.write_text(json.dumps(payload))
            line = json.dumps({"func": func, "in": str(src), "out": str(out), "mem_mb": int(mem_mb)})
            try:
                self._proc.stdin.write(line.encode() + b"\n")
                self._proc.stdin.flush()
                answer = self._proc.stdout.readline()
            except BrokenPipeError:
                answer = b""
            if not answer:
                raise RuntimeError(f"the bounded-call zygote (pid {self._proc.pid}) exited ({self._proc.poll()})")
            status = json.loads(answer)["status"]
            if not out.exists():
                return None, None, status
            kind, value = json.loads(out.read_text())
            return kind, value, status

    def close(self) -> None:
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - best effort at exit
            self._proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


_ZYGOTE: Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def zygote() -> Zygote:
    """This process's zygote, started on first use (a forked worker starts its own: the pipe it
    inherited belongs to its parent's calls)."""
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or _ZYGOTE.pid != os.getpid():
            _ZYGOTE = Zygote()
            atexit.register(_ZYGOTE.close)
        return _ZYGOTE


def run(func: str, payload, mem_mb: int) -> tuple[str | None, object, int]:
    """Run the named call (:data:`CALLS`) on ``payload`` in a fresh child of this process's zygote whose
    address space may grow by at most ``mem_mb`` MiB once it has read ``payload``."""
    return zygote().call(func, payload, mem_mb)


def limit_address_space(mem_mb: int) -> None:
    """Let this process's address space grow by ``mem_mb`` MiB at most (soft RLIMIT_AS)."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = vm_size() + int(mem_mb) * 2**20
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def vm_size() -> int:
    """This process's address-space size in bytes (``VmSize``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def grow(payload: dict) -> int:
    """Allocate ``payload["mib"]`` MiB in 1 000-byte objects (glibc's heap, as the planner's many small
    C++ allocations are) and return how far the address space grew, in bytes: the yardstick of
    ``tests/test_alfworld_games.py``'s check that a call's room does not depend on its caller's past."""
    before = vm_size()
    keep = [bytes(1000) for _ in range(int(payload["mib"]) * 2**20 // 1000)]
    grown = vm_size() - before
    del keep
    return grown


def _resolve(name: str):
    import importlib

    module, _, attr = CALLS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def _serve(workdir: str) -> int:
    """The zygote: import every call, then fork one child per request line until stdin closes; then
    remove ``workdir`` (the caller's input and output files)."""
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    calls = {name: _resolve(name) for name in CALLS}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        line = stdin.readline()
        if not line:
            shutil.rmtree(workdir, ignore_errors=True)
            return 0
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: read the input, bound the address space, call, write, exit at once
            status = 1
            try:
                os.dup2(2, 1)  # whatever the call prints goes to stderr, never into the zygote's answers
                payload = json.loads(Path(req["in"]).read_text())
                limit_address_space(req["mem_mb"])
                try:
                    out = ["ok", calls[req["func"]](payload)]
                except MemoryError:
                    out = ["memory", None]
                except BaseException as exc:  # noqa: BLE001 - reported to the caller
                    out = ["error", f"{type(exc).__name__}: {exc}"]
                Path(req["out"]).write_text(json.dumps(out))
                status = 0
            finally:
                os._exit(status)  # no atexit, no buffered stdout (the zygote's pipe)
        _, status = os.waitpid(pid, 0)
        stdout.write(json.dumps({"status": status}).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1]))
