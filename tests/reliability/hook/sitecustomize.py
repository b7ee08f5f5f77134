"""Kill-at-rename hook for the reliability suite (tests/reliability/kill_driver.py).

Python imports ``sitecustomize`` at start-up from PYTHONPATH, so every process of a trial
loads this file; it does nothing unless ``FEDAGENT_KILL_RENAME`` is set to
``<command>:<n>:<before|after>:<marker>``. Then, in the ``fedagent <command>`` process, the
n-th rename of a job output into place (``os.rename``/``os.replace`` onto a path that is no
staging, job-env or quarantine path) writes ``<marker>`` (JSON: pid, destination) just
before or just after that rename and waits there to be SIGKILLed by the driver.
"""

import os
import sys

# ``FEDAGENT_FAIL_TRAIN_CLIENT=<c>``: ``fedagent train-client --client <c>`` fails at start-up
# (exit 1), every attempt: a client that cannot train (tests/reliability/test_dropout_workflow.py).
_FAIL = os.environ.get("FEDAGENT_FAIL_TRAIN_CLIENT")
if (
    _FAIL is not None
    and len(sys.argv) > 2
    and os.path.basename(sys.argv[0]) == "fedagent"
    and sys.argv[1] == "train-client"
    and sys.argv[sys.argv.index("--client") + 1] == _FAIL
):
    print(f"injected failure: client {_FAIL} cannot train (FEDAGENT_FAIL_TRAIN_CLIENT)", file=sys.stderr, flush=True)
    os._exit(1)

# ``FEDAGENT_READ_AUDIT=<file>``: every ``fedagent`` process appends to <file> each file it opens
# for reading inside a staging (``.partial-*``) or quarantine (``_failed``) path, with its own
# ``--out``: the driver then checks that only a writer ever read its own staging (to hash it).
_AUDIT = os.environ.get("FEDAGENT_READ_AUDIT")
if _AUDIT and len(sys.argv) > 1 and os.path.basename(sys.argv[0]) == "fedagent":
    import json as _json

    _OUT = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv[:-1] else ""

    def _audit(event, args):
        if event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.fsdecode(args[0])
        if ".partial-" not in path and "_failed" not in path:
            return
        mode, flags = args[1], args[2]
        reading = (
            ("r" in mode and "+" not in mode)
            if isinstance(mode, str)
            else (isinstance(flags, int) and flags & os.O_ACCMODE == os.O_RDONLY)
        )
        if reading and not os.path.isdir(path):
            line = _json.dumps({"pid": os.getpid(), "command": sys.argv[1], "out": _OUT, "path": path})
            fd = os.open(_AUDIT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)

    sys.addaudithook(_audit)

_SPEC = os.environ.get("FEDAGENT_KILL_RENAME")

if _SPEC:
    import json
    import sys
    import time

    _COMMAND, _N, _WHEN, _MARKER = _SPEC.split(":", 3)
    _N = int(_N)
    _seen = [0]

    def _is_output(dst) -> bool:
        parts = os.path.abspath(os.fspath(dst)).split(os.sep)
        if "results" not in parts:
            return False
        return not any(p.startswith((".partial-", ".env-")) or p == "_failed" for p in parts)

    def _is_target() -> bool:
        argv = sys.argv
        return len(argv) >= 2 and os.path.basename(argv[0]) == "fedagent" and argv[1] == _COMMAND

    def _stop(dst) -> None:
        tmp = _MARKER + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"pid": os.getpid(), "dst": os.fspath(dst), "when": _WHEN}, fh)
        _real_replace(tmp, _MARKER)
        time.sleep(600)
        os._exit(3)  # never reached in a trial: the driver kills us first

    def _wrap(fn):
        def inner(src, dst, *args, **kwargs):
            fire = False
            if _is_target() and _is_output(dst) and not os.path.exists(_MARKER):
                _seen[0] += 1
                fire = _seen[0] == _N
            if fire and _WHEN == "before":
                _stop(dst)
            result = fn(src, dst, *args, **kwargs)
            if fire and _WHEN == "after":
                _stop(dst)
            return result

        return inner

    _real_replace = os.replace
    os.rename = _wrap(os.rename)
    os.replace = _wrap(_real_replace)
