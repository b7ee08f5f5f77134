"""A job-scoped environment service: start, health-gate, yield a client, always stop.

Each train/eval job starts its own ``fedagent serve-env`` child on a Unix socket inside
the job's ``workdir`` (or loopback TCP on an OS-assigned port with a random token), so two
jobs on one machine never share or squat an address. The child runs with no visible accelerator
(:data:`fedagent.envs.serve.NO_ACCELERATOR_ENV`), whether spawned or forked by a warm server. The child's log goes to
``workdir/env-<tag>.log`` and its tail is quoted in any startup error.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

from fedagent.core import envs, tempdirs
from fedagent.core.atomic import atomic_write_json, atomic_write_text
from fedagent.envs.client import EnvClient
from fedagent.envs.serve import NO_ACCELERATOR_ENV, TOKEN_ENV

UDS_MAX = 100  # AF_UNIX sun_path is 108 bytes on Linux (104 on macOS); keep a margin
SHORT_PREFIX = "fa-"  # a socket dir under the temp root, for a workdir too deep for a socket path
STOP_GRACE_S = 5.0


class EnvServiceStartError(RuntimeError):
    """The service did not become healthy in time (message carries its log tail)."""


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(lines[-n:]) or "(empty log)"


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, wait, then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def games_source(games_dir: Path) -> str:
    """The env kind of a games directory: games.json's ``source`` (``textworld`` if absent)."""
    index = Path(games_dir) / "games.json"
    if index.is_file():
        data = json.loads(index.read_text())
        return str(data.get("source") or data.get("kind") or envs.UNNAMED_CATALOGUE_KIND)
    return envs.UNNAMED_CATALOGUE_KIND


@contextlib.contextmanager
def env_service(
    games_dir: Path,
    split: str,
    task_ids: Sequence[str],
    workdir: Path,
    *,
    mode: str,
    pool_size: int,
    max_turns: int,
    client_id: str | None = None,
    tcp: bool = False,
    token: str | None = None,
    startup_timeout: float = 60.0,
    create_timeout: float | None = None,
    env_threads: bool = True,
    env_procs: int = 0,
    source: str | None = None,
    answer_format: str = "think_action",
    projection: str = "reference",
    env_params: dict | None = None,
    wait: bool = True,
    expert: bool = False,
) -> Iterator[EnvClient]:
    """Run a service for ``task_ids`` of ``games_dir`` while the block runs; yield its client.

    ``source`` None: the catalogue's own (``games.json`` ``source``; TextWorld if absent).
    ``wait`` False: yield a :class:`PendingEnv` at once (its ``ready()`` gives the client), so
    the caller's own start-up overlaps the service's. ``expert``: the service's envs carry their
    expert (``/expert_batch``, the warm start's demonstrations).
    """
    if source is None:
        source = games_source(games_dir)
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    tag = f"{split}-{os.getpid()}-{secrets.token_hex(3)}"  # unique per call, not per result
    tasks_file = workdir / f"env-{tag}-tasks.json"
    ready_file = workdir / f"env-{tag}-ready.json"
    log_path = workdir / f"env-{tag}.log"
    atomic_write_json(tasks_file, {"tasks": list(task_ids)})
    short_dir = None
    uds = None
    cmd = [
        sys.executable,
        "-m",
        "fedagent.cli",
        "serve-env",
        "--games",
        str(Path(games_dir).resolve()),
        "--source",
        source,
        "--split",
        split,
        "--tasks-file",
        str(tasks_file),
        "--mode",
        mode,
        "--pool-size",
        str(pool_size),
        "--max-turns",
        str(max_turns),
        "--ready-file",
        str(ready_file),
    ]
    cmd += [
        "--env-threads",
        "1" if env_threads else "0",
        "--env-procs",
        str(env_procs),
        "--answer-format",
        answer_format,
        "--projection",
        projection,
    ]
    if client_id is not None:
        cmd += ["--client-id", str(client_id)]
    if expert:
        cmd += ["--expert"]
    if env_params:
        cmd += ["--env-params", json.dumps(env_params, sort_keys=True)]
    if create_timeout is not None:
        cmd += ["--create-timeout", str(create_timeout)]
    # No accelerator for the service, from its first instruction (and, through the warm client, in
    # the job's environment a warm server forks it with): serve.NO_ACCELERATOR_ENV.
    env = {**os.environ, **NO_ACCELERATOR_ENV}
    if tcp:
        token = token or secrets.token_hex(16)  # loopback is shared by every local user
        cmd += ["--host", "127.0.0.1", "--port", "0"]
    else:
        uds = workdir / f"env-{tag}.sock"
        if len(str(uds)) > UDS_MAX:
            short_dir = Path(tempfile.mkdtemp(prefix=SHORT_PREFIX))
            uds = short_dir / "env.sock"
            # recorded in the workdir: a SIGKILLed job's next attempt removes it (job_env_service)
            atomic_write_text(workdir / f"env-{tag}.short", str(short_dir))
        cmd += ["--uds", str(uds)]
    if token:
        env[TOKEN_ENV] = token  # not on argv: argv is world-readable
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    pending = PendingEnv(proc, ready_file, log_path, token, startup_timeout)
    try:
        yield pending if not wait else pending.ready()
    finally:
        if pending.client is not None:
            pending.client.shutdown()
        _stop(proc)
        for path in (tasks_file, ready_file) + ((uds,) if uds is not None else ()):
            path.unlink(missing_ok=True)
        if short_dir is not None:
            shutil.rmtree(short_dir, ignore_errors=True)
            (workdir / f"env-{tag}.short").unlink(missing_ok=True)


class PendingEnv:
    """A started env service not yet known to be healthy (``env_service(..., wait=False)``).

    The job does independent start-up work (loading its model onto the GPU, compiling) while
    the service process imports and builds its pool; :meth:`ready` then health-gates it and
    returns the client (the same check, timeout and errors as ``wait=True``).
    """

    def __init__(
        self, proc: subprocess.Popen, ready_file: Path, log_path: Path, token: str | None, startup_timeout: float
    ):
        self.proc, self.ready_file, self.log_path, self.token = proc, ready_file, log_path, token
        self.deadline = time.monotonic() + startup_timeout
        self.startup_timeout = startup_timeout
        self.client: EnvClient | None = None

    def ready(self) -> EnvClient:
        """Wait until the service answers its health check; the client (idempotent)."""
        if self.client is not None:
            return self.client
        proc, ready_file, log_path, token = self.proc, self.ready_file, self.log_path, self.token
        while True:
            if proc.poll() is not None:
                raise EnvServiceStartError(
                    f"env service exited with code {proc.returncode} during startup; log {log_path}:\n"
                    + _log_tail(log_path)
                )
            if ready_file.exists():
                where = json.loads(ready_file.read_text())
                if "uds" in where:
                    client = EnvClient(uds=where["uds"], token=token, max_retries=2)
                else:
                    client = EnvClient(base_url=f"http://{where['host']}:{where['port']}", token=token, max_retries=2)
                try:
                    health = client.health()
                    if health.get("ok"):
                        break
                except ConnectionError:
                    pass
                client.shutdown()
            if time.monotonic() > self.deadline:
                raise EnvServiceStartError(
                    f"env service not healthy after {self.startup_timeout} s; log {log_path}:\n" + _log_tail(log_path)
                )
            time.sleep(0.01)  # a train job's first token may wait on this (the file check is cheap)
        client.max_retries = 8  # startup probing done: full retry budget
        # Where the service listens, for processes of the job that open their own client
        # (the verl backend's agent loops): {"uds": path} or {"base_url": url, "token": t}.
        client.address = (
            {"uds": where["uds"]}
            if "uds" in where
            else {"base_url": f"http://{where['host']}:{where['port']}", "token": token}
        )
        self.client = client
        return client


def remove_short_dirs(workdir: Path) -> None:
    """A killed attempt's socket dirs (:data:`SHORT_PREFIX` dirs its workdir's ``env-*.short`` records name):
    only a real dir directly under this machine's temp root is removed, whatever a record says."""
    for record in sorted(Path(workdir).glob("env-*.short")):
        with contextlib.suppress(OSError):
            tempdirs.remove_own(record.read_text().strip(), SHORT_PREFIX)


@contextlib.contextmanager
def job_env_service(games_dir: Path, split: str, task_ids: Sequence[str], out: Path, **kwargs) -> Iterator[EnvClient]:
    """:func:`env_service` in a fresh ``.env-<name>`` workdir beside a job's output ``out``.

    Beside, not inside: an output dir's manifest must list only its own files, and the same
    filesystem keeps the Unix-socket path short. A killed attempt's leftover is removed
    first; the workdir is removed afterwards whatever happens.
    """
    workdir = Path(out).parent / f".env-{Path(out).name}"
    if workdir.exists():
        remove_short_dirs(workdir)
        shutil.rmtree(workdir)
    try:
        with env_service(games_dir, split, task_ids, workdir, **kwargs) as env:
            yield env
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
