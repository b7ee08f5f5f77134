"""Helpers for workflow tests: a copy of the workflow in a temp dir, run by real Snakemake."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fedagent.core.workflow_copy import copy_workflow

REPO = Path(__file__).resolve().parent.parent
TEST_CONFIG = Path(__file__).resolve().parent / "workflow_config.yaml"
RUN = "results/t"


def make_workdir(path: Path) -> Path:
    """A fresh checkout-like directory: the workflow files plus the test config as the default."""
    return copy_workflow(REPO, path, TEST_CONFIG)


def clone_workdir(src: Path, dst: Path) -> Path:
    """Copy a finished workdir keeping mtimes (cp -a), as a user would back one up."""
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def snakemake_cmd(*args: str) -> list[str]:
    """The user's command line: `snakemake --profile profiles/local ...` from this venv."""
    exe = Path(sys.executable).parent / "snakemake"
    return [str(exe), "--profile", "profiles/local", *args]


_WARM: dict[tuple, str] = {}
COLD_ENV = "FEDAGENT_TEST_COLD"


def warm_socket(env: dict) -> str | None:
    """A warm fork server (``fedagent warm-server``, every preload group) for jobs of environment
    ``env``: one per distinct set of the variables read at interpreter start-up (the server refuses a
    job whose differ: PYTHONPATH, TORCH_*, OMP_*, …), started on first use from ``env`` and stopped when
    this test process exits; None with ``FEDAGENT_TEST_COLD=1``.

    Workflow tests hand their jobs of fedagent.commands.WARM_COMMANDS (train-client, eval, serve-env,
    aggregate, merge, report, the plan's) to it, as the GPU node's runs do (scripts/gpu/warm.sh): each
    job then skips its imports (≈ 3-5 s for a torch job, ≈ 0.3 s for a selection). The
    jobs and their files are the same (tests/test_warm.py checks byte-identical outputs); the cold
    path stays covered by the runs given ``warm=False`` and by ``FEDAGENT_TEST_COLD=1``.
    """
    if os.environ.get(COLD_ENV) == "1":
        return None
    from fedagent.warm.preload import read_at_startup

    key = tuple(sorted((k, v) for k, v in env.items() if read_at_startup(k)))
    if key not in _WARM:
        import atexit
        import tempfile

        d = tempfile.mkdtemp(prefix="fa-tw-", dir="/tmp")
        sock = os.path.join(d, "s")
        exe = str(Path(sys.executable).parent / "fedagent")
        server_env = dict(env)  # snakemake_env dropped any FEDAGENT_WARM_SOCKET
        subprocess.run(
            [exe, "warm-server", "--socket", sock, "--preload", "train,eval,env,server", "--detach"],
            env=server_env,
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )

        def stop():
            import shutil

            subprocess.run(
                [exe, "warm-server", "--socket", sock, "--stop"], env=server_env, capture_output=True, timeout=120
            )
            shutil.rmtree(d, ignore_errors=True)

        atexit.register(stop)
        _WARM[key] = sock
    return _WARM[key]


def snakemake_env(warm: bool = True) -> dict:
    """Environment for Snakemake runs: the venv's bin first on PATH (rules call `fedagent`); heavy jobs
    through a warm server of this environment unless ``warm`` is False (:func:`warm_socket`)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHONHASHSEED", "0")
    env.pop("FEDAGENT_WARM_SOCKET", None)
    sock = warm_socket(env) if warm else None
    if sock:
        env["FEDAGENT_WARM_SOCKET"] = sock
    return env


_FORK: dict[tuple, subprocess.Popen] = {}
_FORK_MAX = 4  # servers kept per test process (the least recently used is stopped first)
_FORK_LOCK = threading.Lock()


def _fork_server(env: dict) -> subprocess.Popen | None:
    """The Snakemake fork server (tests/snakemake_fork.py) for ``env``, started on first use and stopped
    when this test process exits; None with ``FEDAGENT_TEST_COLD=1``. One per set of the variables a
    process reads as it starts (PYTHON*, OMP_*, ..., the locale): a forked run takes on the rest of its
    environment itself (pytest's PYTEST_CURRENT_TEST alone differs from test to test)."""
    if os.environ.get(COLD_ENV) == "1":
        return None
    from fedagent.warm.preload import read_at_startup

    key = tuple(sorted((k, v) for k, v in env.items() if read_at_startup(k) or k.startswith(("LANG", "LC_"))))
    server = _FORK.pop(key, None)
    if server is not None and server.poll() is not None:
        server = None
    if server is None:
        import atexit

        log = Path(tempfile.mkdtemp(prefix="fa-sm-")) / "server.log"
        with open(log, "wb") as fh:
            server = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve().parent / "snakemake_fork.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=fh,
                env=env,
                bufsize=0,
            )
        server.log = log
        atexit.register(_stop_fork_server, server)
        while len(_FORK) >= _FORK_MAX:
            _stop_fork_server(_FORK.pop(next(iter(_FORK))))
    _FORK[key] = server  # the newest last
    return server


def _stop_fork_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.stdin.close()  # its loop ends with its input
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    shutil.rmtree(server.log.parent, ignore_errors=True)


def _reply(server: subprocess.Popen, timeout: float | None) -> dict | None:
    """The server's next reply line, None if none came within ``timeout`` seconds."""
    fd, line, deadline = server.stdout.fileno(), b"", None if timeout is None else time.monotonic() + timeout
    while not line.endswith(b"\n"):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1)
        if not chunk:
            raise RuntimeError(
                f"the Snakemake fork server ended (rc {server.poll()}): {server.log.read_text()[-3000:]}"
            )
        line += chunk
    return json.loads(line)


def snakemake_run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`` for a
    :func:`snakemake_cmd` command line: the same run, forked from a server that has Snakemake imported
    (tests/snakemake_fork.py: ≈ 1.5 s of CPU less per run); a plain process with ``FEDAGENT_TEST_COLD=1``.
    On a timeout the run's whole process group (its jobs too) is killed."""
    with _FORK_LOCK:
        server = _fork_server(env) if cmd and cmd[0] == snakemake_cmd()[0] else None
        if server is None:
            return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        with tempfile.TemporaryDirectory(prefix="fa-sm-run-") as d:
            out, err = Path(d) / "stdout", Path(d) / "stderr"
            request = {"argv": cmd, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
            server.stdin.write(json.dumps(request).encode() + b"\n")
            pid = _reply(server, None)["pid"]
            done = _reply(server, timeout)
            if done is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                _reply(server, None)
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(cmd, done["rc"], out.read_text(), err.read_text())


def run_snakemake(
    workdir: Path, *args: str, check: bool = True, timeout: int = 900, warm: bool = True
) -> subprocess.CompletedProcess:
    """Run Snakemake in ``workdir``; on failure show its output and the failed job logs.

    Heavy jobs go through a warm server (``warm``, :func:`warm_socket`); a plan (``-n``), lint or
    unlock runs no job and starts none. Snakemake itself is forked from a server that imported it
    (:func:`snakemake_run`)."""
    warm = warm and not {"-n", "--dry-run", "--lint", "--unlock"} & set(args)
    proc = snakemake_run(snakemake_cmd(*args), workdir, snakemake_env(warm), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


_JOB = re.compile(r"^(?:local)?rule (\w+):\s*$")
_WILDCARDS = re.compile(r"^\s+wildcards: (.*)$")


def executed_jobs(proc: subprocess.CompletedProcess) -> list[tuple[str, str]]:
    """(rule, wildcards) of every job Snakemake started, from its output ('all' excluded), sorted."""
    return sorted(started_jobs(proc.stdout + "\n" + proc.stderr))


def started_jobs(log: str) -> list[tuple[str, str]]:
    """(rule, wildcards) of every job in the order Snakemake started them, from its output or log file
    ('all' excluded)."""
    jobs, current = [], None
    for line in log.splitlines():
        m = _JOB.match(line)
        if m:
            if current and current[0] != "all":
                jobs.append(tuple(current))
            current = [m.group(1), ""]
            continue
        w = _WILDCARDS.match(line)
        if w and current is not None:
            current[1] = w.group(1).strip()
    if current and current[0] != "all":
        jobs.append(tuple(current))
    return jobs


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under ``root`` — to prove nothing was touched."""
    return {
        p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
