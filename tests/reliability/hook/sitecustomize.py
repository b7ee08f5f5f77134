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
if _FAIL is not None and len(sys.argv) > 2 and os.path.basename(sys.argv[0]) == "fedagent" \
        and sys.argv[1] == "train-client" and sys.argv[sys.argv.index("--client") + 1] == _FAIL:
    print(f"injected failure: client {_FAIL} cannot train (FEDAGENT_FAIL_TRAIN_CLIENT)", file=sys.stderr, flush=True)
    os._exit(1)

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
