"""What a job forked by the warm server does: become the job's process, run the command, exit.

Everything a fresh ``fedagent <cmd>`` process would have differently from the server's copy is
put back first: the job's own fds 0/1/2, cwd, environment, argv and ``sys.path[0]``; default
signal handlers; the job's thread counts (:mod:`fedagent.warm.threads`); no inherited ``atexit``
handlers (they are the server's: one that removed a directory the server's imports made would
break every later job); a fresh ``tempfile`` directory lookup (``TMPDIR`` is per job); a fresh
seed for numpy's legacy global RNG (fork copies it; Python's ``random`` reseeds itself).

At the end it does what interpreter shutdown would (join non-daemon threads, run the job's own
``atexit`` handlers, flush) and leaves with ``os._exit``. ``atexit._clear``/``_run_exitfuncs``
and ``threading._shutdown`` are CPython's own shutdown steps (private names, present in 3.11
and 3.12).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
import traceback

from fedagent.commands import dispatch
from fedagent.core.timing import JOB_MARKS_ENV, JOB_START_ENV
from fedagent.warm import threads

BLOCKED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD}


def _become_job(request: dict, fds: list[int], env: dict[str, str]) -> None:
    """Take on the job's identity (the server already made this the leader of its own group)."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    if sys.stdout is not None:
        sys.stdout.reconfigure(line_buffering=os.isatty(1))  # as a fresh interpreter would buffer
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()
    os.chdir(request["cwd"])
    server_env = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    threads.apply(env, server_env)
    os.environ[JOB_START_ENV] = repr(float(request["start"]))
    # Where the job's first moments went (timing.PhaseClock marks them): the client's request
    # sent, this process become the job.
    os.environ[JOB_MARKS_ENV] = json.dumps({"request_sent": request.get("sent"), "job_taken": time.time()})
    sys.argv = [request.get("argv0") or "fedagent", *request["argv"]]
    if request.get("path0") and sys.path:
        sys.path[0] = request["path0"]
    if "tempfile" in sys.modules:
        sys.modules["tempfile"].tempdir = None
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED)


def _run(argv: list[str]) -> int:
    """The command's exit code, with Python's own meaning of SystemExit and uncaught exceptions."""
    try:
        return int(dispatch(argv) or 0)
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return -signal.SIGINT
    except BaseException:  # noqa: BLE001 - the job's traceback, as Python prints it
        traceback.print_exc()
        return 1


def _shutdown() -> None:
    """What interpreter shutdown does before the process ends, for the job's own state: wake and
    join non-daemon threads (``threading._shutdown`` also stops idle ThreadPoolExecutor workers,
    which a bare join would wait on forever), then the job's ``atexit`` handlers."""
    threading._shutdown()
    atexit._run_exitfuncs()
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def run_job(request: dict, fds: list[int], env: dict[str, str]) -> None:
    """The forked child's whole life; never returns."""
    code = 1
    try:
        _become_job(request, fds, env)
        code = _run(request["argv"])
        _shutdown()
    except BaseException:  # noqa: BLE001 - setting up the job failed: say why, exit 1
        try:
            traceback.print_exc()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        if code == -signal.SIGINT:  # as CPython does on an uncaught KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)
