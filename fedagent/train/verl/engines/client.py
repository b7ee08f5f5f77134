"""A ``train-client`` job's side of the run-scoped engines: a slot, the set's start if none runs, the request.

Slots live in one directory per run (``<results>/<run>/.verl-engines/slot-<i>/``); a job holds its slot's
file lock for its whole request, so a set serves one job at a time and two concurrent jobs use two sets.
A slot without a live set gets one: ``python -m fedagent.train.verl.engines.server`` with the job's own
overrides (the set's Ray temp dir, tag, agent-loop YAML and socket in place of the job's), in its own
session, its stdout the slot's ``server.log``. The set answers when the fit is over; the job copies its
byte range of ``server.log`` into its own log (a warm job's first: the set's start-up lines its checks
need) and goes on as after a trainer of its own. A job killed while waiting closes its connection: the
set stops itself (``serve.Watchdog``) and nothing of the job was committed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

from fedagent.core import procs
from fedagent.train.verl.engines import keys, serve

SERVER_MODULE = "fedagent.train.verl.engines.server"
SERVER_ENV = "FEDAGENT_VERL_ENGINES_SERVER"  # tests: another module in its place
SOCKET_ENV = "FEDAGENT_VERL_ENGINES_SOCKET"
KEY_ENV = "FEDAGENT_VERL_ENGINES_KEY"
IDLE_ENV = "FEDAGENT_VERL_ENGINES_IDLE_S"
# train.verl.engines_max_growth_gb: a set whose training workers hold this much more device memory after a
# job than after its first stops after that job (serve.serve; the next job starts a fresh set)
GROWTH_ENV = "FEDAGENT_VERL_ENGINES_MAX_GROWTH_GB"
NONCE_ENV = "FEDAGENT_VERL_ENGINES_NONCE"
SLOT_ENV = "FEDAGENT_VERL_ENGINES_SLOT"
SUN_PATH_MAX = 107


def socket_path(slot: Path) -> Path:
    """The set's socket: short (AF_UNIX holds 107 bytes), in /tmp (not ``$TMPDIR``: jobs may get their
    own, and every job of a slot must find the same socket), named by the slot's path."""
    h = hashlib.sha256(str(Path(slot).resolve()).encode()).hexdigest()[:16]
    path = Path("/tmp") / f"fa-eng-{h}.sock"
    if len(str(path)) > SUN_PATH_MAX:
        raise RuntimeError(f"engine-set socket {path} is over {SUN_PATH_MAX} bytes; set TMPDIR to a shorter path")
    return path


def _live_set_of(d: Path, key: str | None) -> bool:
    rec = _server_record(d)
    return (
        key is not None and rec is not None and rec.get("key") == key and procs.alive(int(rec["pid"]), rec.get("start"))
    )


@contextlib.contextmanager
def slot(sets_dir: Path, n_sets: int, preferred: int, key: str | None = None) -> Iterator[Path]:
    """A free slot of ``n_sets``, locked while the job uses it: first a free one whose live set has this
    ``key`` (jobs one after another reuse one set instead of warming one per slot), then any free one
    (``preferred`` first), else wait for ``preferred``."""
    sets_dir = Path(sets_dir)
    sets_dir.mkdir(parents=True, exist_ok=True)
    order = [(preferred + i) % n_sets for i in range(n_sets)]
    for phase in ("same key", "free", "wait"):
        for i in order if phase != "wait" else order[:1]:
            d = sets_dir / f"slot-{i}"
            d.mkdir(exist_ok=True)
            fh = open(d / "lock", "a+")
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | (0 if phase == "wait" else fcntl.LOCK_NB))
            except BlockingIOError:
                fh.close()
                continue
            if phase == "same key" and not _live_set_of(d, key):
                fcntl.flock(fh, fcntl.LOCK_UN)
                fh.close()
                continue
            try:
                yield d
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
                fh.close()
            return


@contextlib.contextmanager
def held(d: Path) -> Iterator[bool]:
    """The slot's lock if it is free now (True), else nothing (False: a job is using the set)."""
    fh = open(Path(d) / "lock", "a+")
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
    finally:
        fh.close()


def _connect(path: Path) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return s
    except OSError:
        s.close()
        return None


def _server_record(d: Path) -> dict | None:
    with contextlib.suppress(FileNotFoundError, ValueError):
        rec = json.loads((d / "server.json").read_text())
        if isinstance(rec, dict) and "pid" in rec:
            return rec
    return None


def stop_set(d: Path, grace_s: float = 20.0) -> None:
    """Stop the slot's set, if it still runs (the recorded pid with its recorded start time, so a reused pid
    is never signalled): SIGTERM its process group, SIGKILL after ``grace_s``, and return only when the group
    is gone; then remove its socket file, Ray temp dir and IPC sockets."""
    import shutil

    from fedagent.train.verl.leftovers import remove_ipc_sockets

    rec = _server_record(Path(d))
    if rec is None:
        return
    pid = int(rec["pid"])
    since = rec.get("start")
    # the set's group: its leader, or (the leader gone, or a zombie) Ray and vLLM processes started since;
    # a live process under that pid with another start time is not the set (pid reused)
    now = procs.proc_start(pid)
    if not (now is not None and since is not None and now != since) and (now is not None or since is not None):
        procs.stop_group(pid, since, grace_s)
    with contextlib.suppress(OSError):  # a killed set leaves its socket file behind
        socket_path(Path(d)).unlink()
    if rec.get("tag"):
        remove_ipc_sockets(rec["tag"])
    if rec.get("ray_tmp") and Path(rec["ray_tmp"]).name.startswith("fa-ray-"):
        shutil.rmtree(rec["ray_tmp"], ignore_errors=True)


def stop_set_detached(d: Path) -> None:
    """:func:`stop_set` from a process of its own session (the set's watchdog is inside the group it stops,
    so the escalation to SIGKILL must not die with it)."""
    subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from fedagent.train.verl.engines.client import "
            "stop_set; stop_set(pathlib.Path(sys.argv[1]))",
            str(d),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def set_overrides(
    overrides: Sequence[str],
    d: Path,
    *,
    ray_tmp: Path,
    tag: str,
    idle_s: float,
    key: str,
    nonce: str,
    max_growth_gb: float | None = None,
) -> list[str]:
    """The job's overrides as the set's: its Ray temp dir, tag and agent-loop YAML in the slot, and the
    socket, key, start nonce, idle time, memory-growth limit and slot for the set's TaskRunner (Ray's env
    vars are strings: quoted), and the refit's worker methods armed (the reset)."""
    from fedagent.train.verl.refit import REFIT_ENV

    out = keys.replace(
        overrides,
        {
            "+ray_kwargs.ray_init._temp_dir": str(ray_tmp),
            f"+ray_kwargs.ray_init.runtime_env.env_vars.{keys.TAG_ENV}": tag,
            "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(d / "agent_loop.yaml"),
        },
    )
    prefix = "+ray_kwargs.ray_init.runtime_env.env_vars."
    if not any(o.startswith(f"{prefix}{REFIT_ENV}=") for o in out):
        out.append(f"{prefix}{REFIT_ENV}='1'")
    return (
        out
        + [
            f"{prefix}{SOCKET_ENV}='{socket_path(d)}'",
            f"{prefix}{KEY_ENV}='{key}'",
            f"{prefix}{NONCE_ENV}='{nonce}'",
            f"{prefix}{IDLE_ENV}='{float(idle_s)}'",
            f"{prefix}{SLOT_ENV}='{d}'",
        ]
        + ([] if max_growth_gb is None else [f"{prefix}{GROWTH_ENV}='{float(max_growth_gb)}'"])
    )


def _short_tmp() -> Path:
    """A fresh Ray temp dir short enough for Ray's Unix sockets (launch.RAY_TMP_MAX)."""
    from fedagent.train.verl.launch import RAY_TMP_MAX

    base = tempfile.gettempdir()
    path = Path(tempfile.mkdtemp(prefix="fa-ray-", dir=base if len(base) <= 16 else "/tmp"))
    if len(str(path)) > RAY_TMP_MAX:
        raise RuntimeError(f"engine set: Ray temp dir {path} is over {RAY_TMP_MAX} characters")
    return path


def start_set(
    d: Path,
    overrides: Sequence[str],
    agent_loop_yaml: Path,
    env: dict,
    *,
    key: str,
    idle_s: float,
    max_growth_gb: float | None = None,
    python: str | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start a set in slot ``d`` for the job whose overrides and agent-loop YAML these are (its YAML's
    ``job_file`` becomes the slot's ``job.json``, rewritten per job by the set), after the slot's previous
    set, if any, is gone entirely. Returns the process and the start nonce only this job's request carries."""
    import yaml

    stop_set(d)
    entry = yaml.safe_load(Path(agent_loop_yaml).read_text())[0]
    if not entry.get("job_file"):
        raise ValueError(f"{agent_loop_yaml}: the run-scoped engines need an agent-loop job file")
    (d / "job.json").write_text(Path(entry["job_file"]).read_text())
    (d / "agent_loop.yaml").write_text(yaml.safe_dump([{**entry, "job_file": str(d / "job.json")}], sort_keys=True))
    ray_tmp = _short_tmp()
    (ray_tmp / "t").mkdir()
    tag = f"fa-eng-{d.name}-{os.getpid()}-{os.urandom(4).hex()}"
    nonce = os.urandom(8).hex()
    ov = set_overrides(
        overrides, d, ray_tmp=ray_tmp, tag=tag, idle_s=idle_s, key=key, nonce=nonce, max_growth_gb=max_growth_gb
    )
    env = {**env, "TMPDIR": str(ray_tmp / "t"), "RAY_TMPDIR": str(ray_tmp), keys.TAG_ENV: tag}
    module = os.environ.get(SERVER_ENV, SERVER_MODULE)
    with open(d / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [python or sys.executable, "-m", module, *ov],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            cwd=os.getcwd(),
        )
    record_set(d, proc.pid, tag=tag, ray_tmp=ray_tmp, key=key)
    return proc, nonce


def record_set(d: Path, pid: int, *, tag: str, ray_tmp, key: str) -> None:
    """The slot's ``server.json``: the set by pid and process start time (written by the starting job and
    again by the set itself at its start, so a job killed right after the start leaves a stoppable set)."""
    from fedagent.core.atomic import atomic_write_text

    atomic_write_text(
        Path(d) / "server.json",
        json.dumps(
            {"pid": int(pid), "start": procs.proc_start(int(pid)), "tag": tag, "ray_tmp": str(ray_tmp), "key": key}
        ),
    )


def _wait_listening(d: Path, proc: subprocess.Popen, timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    path = socket_path(d)
    while True:
        s = _connect(path)
        if s is not None:
            return s
        if proc.poll() is not None:
            raise RuntimeError(f"the engine set of {d} exited before serving:\n{_tail(d / 'server.log')}")
        if time.monotonic() > deadline:
            stop_set(d)
            raise RuntimeError(
                f"the engine set of {d} did not serve within {timeout_s:.0f} s:\n{_tail(d / 'server.log')}"
            )
        time.sleep(0.5)


def _tail(path: Path, n: int = 60) -> str:
    with contextlib.suppress(FileNotFoundError):
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    return ""


def copy_range(src: Path, start: int, end: int, dst: Path, header: Sequence[str] = ()) -> None:
    with open(src, "rb") as fh, open(dst, "ab") as out:
        for line in header:
            out.write((line + "\n").encode())
        fh.seek(start)
        out.write(fh.read(max(0, end - start)))


def _clear_attempt(request: dict) -> None:
    """What a set that went away may have begun writing for this job: its checkpoint dir and episodes."""
    import shutil

    shutil.rmtree(request["ckpt_dir"], ignore_errors=True)
    record = (request.get("job_file") or {}).get("record_file")
    if record:
        Path(record).write_text("")


def run_job(
    *,
    sets_dir: Path,
    n_sets: int,
    preferred: int,
    overrides: Sequence[str],
    agent_loop_yaml: Path,
    request: dict,
    log: Path,
    env: dict,
    idle_s: float,
    max_growth_gb: float | None = None,
    start_timeout_s: float = 1800.0,
) -> dict:
    """Run one job on a slot's engine set (started for it when none is live, or when the live one answers
    ``restart``: another key, or stopping for idleness); append its part of the set's log to ``log``; return
    the set's answer (``warm``, ``steps``, ``fit_s``, ``set``, ``memory_gb``, ``memory_growth_gb``, ``reset_release``, ``t_request``: when the request went, epoch
    seconds; ``t_slot``: when the job had its slot)."""
    import yaml

    entry = yaml.safe_load(Path(agent_loop_yaml).read_text())[0]
    key = keys.engine_key(overrides, entry)
    request = {**request, "engine_key": key}
    serve.check_request(request)
    with slot(sets_dir, n_sets, preferred, key) as d:
        t_slot = time.time()
        for attempt in (1, 2):
            t_request = time.time()
            conn = _connect(socket_path(d))
            nonce = None
            if conn is None:
                proc, nonce = start_set(
                    d, overrides, agent_loop_yaml, env, key=key, idle_s=idle_s, max_growth_gb=max_growth_gb
                )
                conn = _wait_listening(d, proc, start_timeout_s)
            try:
                with conn:
                    serve.send(conn, {**request, **({"nonce": nonce} if nonce else {})})
                    reply = serve.recv(conn)
            except OSError:
                reply = None
            if reply is None:
                stop_set(d)
                if nonce is None and attempt == 1:  # a set that was stopping (its job killed): start one
                    print(f"fedagent: engine set of {d} went away before answering; starting another", flush=True)
                    _clear_attempt(request)
                    continue
                raise RuntimeError(
                    f"the engine set of {d} closed the connection without an answer:\n{_tail(d / 'server.log')}"
                )
            if "restart" in reply and attempt == 1:
                print(f"fedagent: engine set of {d}: {reply['restart']}; starting another", flush=True)
                stop_set(d)
                continue
            rng = reply.get("log_range")
            if rng:
                copy_range(d / "server.log", rng[0], rng[1], log, header=reply.get("startup_lines") or ())
            if not reply.get("ok"):
                stop_set(d)
                raise RuntimeError(f"the engine set of {d} failed the job: {reply.get('error') or reply}")
            return {**reply, "t_request": t_request, "t_slot": t_slot}
    raise RuntimeError("unreachable")
