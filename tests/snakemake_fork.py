"""A fork server for the tests' Snakemake invocations (tests only; workflow_helpers.snakemake_run uses it).

A fresh ``snakemake`` process spends ≈ 1.5 s of CPU importing Snakemake and collecting its plugins
(executor, storage, logger, report, scheduler registries) before it reads the Snakefile: half of a
plan's cost, and the workflow tests start a few hundred such processes. This server, one per test
process and start-up environment (as workflow_helpers.warm_socket), does that once. Each request is
a fork that becomes the run: its own session (so a timeout kills it and its jobs as one group),
stdin from /dev/null, stdout and stderr on the request's files, the request's cwd, environment and
argv, then ``sys.exit(main())`` exactly as the ``snakemake`` console script does. The fedagent modules
the workflow's files import at their top (Snakefile, workflow/*.smk, rules/*.smk: ≈ 0.25 s a run) are
imported before the fork too, nothing else of fedagent: none reads the environment or the directory
as it is imported, and the server is one per start-up environment (a plugin's PYTHONPATH gets its own),
so a child finds the modules a fresh process would import, from the same files.

    python tests/snakemake_fork.py      # reads requests, one JSON object a line, on stdin

A request is ``{"argv": [snakemake, ...], "cwd": ..., "env": {...}, "stdout": path, "stderr": path}``; the
replies are ``{"pid": N}`` once the child exists and ``{"rc": exit code}`` when it has ended (a
signal death as ``-signum``, as subprocess reports it).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import re
import sys
from pathlib import Path


def _preload() -> None:
    """Snakemake's CLI and every plugin registry (each a singleton that imports its plugins once), and
    the modules every run of Snakemake imports on its way (≈ 0.15 s a run): the source cache's
    smart_open (with requests), the profile lookup's platformdirs, the plugins' argparse_dataclass, the
    DAG's graphlib, the config validation's jsonschema. None of them is fedagent's."""
    import argparse_dataclass  # noqa: F401
    import graphlib  # noqa: F401
    import jsonschema  # noqa: F401
    import platformdirs  # noqa: F401
    import smart_open  # noqa: F401
    import snakemake.cli  # noqa: F401
    from snakemake_interface_executor_plugins.registry import ExecutorPluginRegistry
    from snakemake_interface_logger_plugins.registry import LoggerPluginRegistry
    from snakemake_interface_report_plugins.registry import ReportPluginRegistry
    from snakemake_interface_scheduler_plugins.registry import SchedulerPluginRegistry
    from snakemake_interface_storage_plugins.registry import StoragePluginRegistry

    for registry in (
        ExecutorPluginRegistry,
        StoragePluginRegistry,
        ReportPluginRegistry,
        LoggerPluginRegistry,
        SchedulerPluginRegistry,
    ):
        registry()
    for name in workflow_imports():
        importlib.import_module(name)


_TOP_IMPORT = re.compile(r"^from (fedagent[\w.]*) import ([\w, ]+)$|^import (fedagent[\w.]*)", re.MULTILINE)


def workflow_imports(repo: Path = Path(__file__).resolve().parent.parent) -> list[str]:
    """The fedagent modules imported at the top of the workflow's files (not inside a function or
    handler: those import when the run gets there), each ``from P import a, b`` as P and any of P.a, P.b
    that is a module."""
    import importlib.util

    names: list[str] = []
    files = [repo / "Snakefile", *sorted((repo / "workflow").glob("*.smk")), *sorted((repo / "rules").glob("*.smk"))]
    for f in files:
        for m in _TOP_IMPORT.finditer(f.read_text()):
            if m.group(3):
                names.append(m.group(3))
                continue
            names.append(m.group(1))
            for part in m.group(2).split(","):
                sub = f"{m.group(1)}.{part.split()[0]}"  # `a as b`: a
                if importlib.util.find_spec(m.group(1)).submodule_search_locations and importlib.util.find_spec(sub):
                    names.append(sub)
    return list(dict.fromkeys(names))


def _become(request: dict) -> None:
    """Make this forked child the run of ``request``: session, fds, cwd, environment, argv."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "tempfile" in sys.modules:  # TMPDIR is the request's (a fresh process looks it up on first use)
        sys.modules["tempfile"].tempdir = None
    # Snakemake keeps the cwd of its import as a class attribute (its log's "Run directory"): a fresh
    # process imports it in the run's cwd.
    sys.modules["snakemake.workflow"].Workflow._rundir = os.getcwd()
    sys.argv = list(request["argv"])  # the command line, argv[0] the `snakemake` script's path
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # a script's own directory, not this file's


def serve() -> None:
    _preload()
    sys.stdout.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        # The server's objects (Snakemake and its plugins, imported once) go to the collector's
        # permanent generation for the fork: the child's collections then never walk them, which
        # would write to every page holding one (copy-on-write: ≈ 0.4 s of a small plan's 0.9 s, most
        # of it as the child's interpreter shut down). The child computes the same; only cyclic
        # garbage made of the server's own objects goes uncollected there, as none is made.
        gc.freeze()
        pid = os.fork()
        if pid != 0:
            gc.unfreeze()  # the server's own collections as before
        if pid == 0:
            # The child leaves this loop by SystemExit (or an uncaught exception, traceback on its
            # stderr): the interpreter then ends it as it ends a fresh `snakemake` process.
            _become(request)
            from snakemake.cli import main

            sys.exit(main())
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
