"""A fork server for the tests' Snakemake invocations (tests only; workflow_helpers.snakemake_run uses it).

A fresh ``snakemake`` process spends ≈ 1.5 s of CPU importing Snakemake and collecting its plugins
(executor, storage, logger, report, scheduler registries) before it reads the Snakefile: half of a
plan's cost, and the workflow tests start a few hundred such processes. This server, one per test
process and start-up environment (as workflow_helpers.warm_socket), does that once. Each request is
a fork that becomes the run: its own session (so a timeout kills it and its jobs as one group),
stdin from /dev/null, stdout and stderr on the request's files, the request's cwd, environment and
argv, then ``sys.exit(main())`` exactly as the ``snakemake`` console script does. Nothing of fedagent
is imported before the fork: the Snakefile's imports run in the child, as in a fresh process.

    python tests/snakemake_fork.py      # reads requests, one JSON object a line, on stdin

A request is ``{"argv": [snakemake, ...], "cwd": ..., "env": {...}, "stdout": path, "stderr": path}``; the
replies are ``{"pid": N}`` once the child exists and ``{"rc": exit code}`` when it has ended (a
signal death as ``-signum``, as subprocess reports it).
"""

from __future__ import annotations

import json
import os
import sys


def _preload() -> None:
    """Snakemake's CLI and every plugin registry (each a singleton that imports its plugins once)."""
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
        pid = os.fork()
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
