"""Job-scoped services: health-gated start, clean stop, no collisions between jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from env_fixtures import tw_games_dir
from fedagent.envs.client import EnvClient, EnvServiceError
from fedagent.envs.lifecycle import EnvServiceStartError, env_service, job_env_service

pytestmark = pytest.mark.slow
GOOD = "<think>t</think><action>{}</action>"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_two_concurrent_jobs_never_collide(tmp_path):
    """Issue 3 must-show 3: two jobs (same workdir even) get separate services and pools."""
    d = tw_games_dir()
    shared_workdir = tmp_path / "job"  # worst case: both jobs use one directory
    seen = {}
    errors = []
    barrier = threading.Barrier(2)

    def job(name, split, tasks, client_id):
        try:
            with env_service(
                d, split, tasks, shared_workdir, mode="index", pool_size=2, max_turns=8, client_id=client_id
            ) as c:
                barrier.wait(60)  # both services up at the same time
                h = c.health()
                ids = []
                for seed in range(4):
                    sid = f"{name}-{seed}"
                    with c.session(sid):
                        ids.append(c.reset(sid, seed)["task_id"])
                        c.step(sid, GOOD.format("look"))
                seen[name] = (h, ids, c.health())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    a = threading.Thread(target=job, args=("a", "train", ["tw-train-0000", "tw-train-0001"], "0"))
    b = threading.Thread(target=job, args=("b", "val", ["tw-val-0000"], "1"))
    a.start(), b.start()
    a.join(180), b.join(180)
    assert not errors, errors
    (ha, ids_a, enda), (hb, ids_b, endb) = seen["a"], seen["b"]
    assert (ha["split"], ha["client_id"], ha["num_tasks"]) == ("train", "0", 2)
    assert (hb["split"], hb["client_id"], hb["num_tasks"]) == ("val", "1", 1)
    assert ids_a == ["tw-train-0000", "tw-train-0001"] * 2 and ids_b == ["tw-val-0000"] * 4
    assert enda["counters"]["creates"] == endb["counters"]["creates"] == 4  # nobody else's traffic
    assert enda["pool_free"] == endb["pool_free"] == 2
    assert not list(shared_workdir.glob("*.sock"))  # sockets removed


def test_service_stops_in_finally_and_reports_tcp_port(tmp_path):
    d = tw_games_dir()
    with pytest.raises(RuntimeError, match="boom"):
        with env_service(d, "val", ["tw-val-0000"], tmp_path, mode="index", pool_size=1, max_turns=5, tcp=True) as c:
            url = str(c._http.base_url)
            assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
            assert c.health()["ok"]
            # a client without the random token is refused
            with EnvClient(base_url=url, max_retries=0) as anon:
                with pytest.raises(EnvServiceError) as err:
                    anon.health()
                assert err.value.status == 401
            pid = int(
                next(tmp_path.glob("*-ready.json")).read_text()
                and json.loads(next(tmp_path.glob("*-ready.json")).read_text())["pid"]
            )
            raise RuntimeError("boom")
    deadline = time.monotonic() + 10
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pid_alive(pid)
    with EnvClient(base_url=url, max_retries=0) as late:
        with pytest.raises(ConnectionError):
            late.health()


def test_long_workdir_falls_back_to_short_socket(tmp_path):
    d = tw_games_dir()
    deep = tmp_path / ("x" * 60) / ("y" * 60)
    with env_service(d, "val", ["tw-val-0000"], deep, mode="index", pool_size=1, max_turns=5) as c:
        assert c.health()["ok"]
        assert (deep / next(p.name for p in deep.glob("*.log"))).exists()


def test_a_killed_attempts_short_socket_dir_goes_with_its_workdir(tmp_path):
    """A workdir too deep for a socket path gets a socket dir under the temp root, recorded in the workdir;
    a SIGKILLed attempt leaves both, and the job's next attempt removes the dir its record names (only a
    dir directly under the temp root), then its own goes when it ends."""
    import tempfile

    d = tw_games_dir()
    out = tmp_path / ("x" * 60) / ("y" * 60) / "clients" / "0"
    workdir = out.parent / f".env-{out.name}"
    workdir.mkdir(parents=True)
    left = Path(tempfile.mkdtemp(prefix="fa-"))
    (left / "env.sock").write_text("")
    (workdir / "env-train-1-abc.short").write_text(str(left))
    elsewhere = tmp_path / "fa-keep"
    elsewhere.mkdir()
    (workdir / "env-train-2-abc.short").write_text(str(elsewhere))  # not under the temp root
    with job_env_service(d, "val", ["tw-val-0000"], out, mode="index", pool_size=1, max_turns=5) as c:
        assert c.health()["ok"]
        mine = [Path(p.read_text()) for p in workdir.glob("env-*.short")]
        assert len(mine) == 1 and mine[0].is_dir() and mine[0].parent.resolve() == Path(tempfile.gettempdir()).resolve()
    assert not left.exists() and elsewhere.exists() and not mine[0].exists() and not workdir.exists()


def test_startup_failure_is_clear(tmp_path):
    d = tw_games_dir()
    with pytest.raises(EnvServiceStartError) as err:
        with env_service(
            d, "train", ["no-such-task"], tmp_path, mode="index", pool_size=1, max_turns=5, startup_timeout=60
        ):
            pass
    msg = str(err.value)
    assert "exited with code" in msg and "no-such-task" in msg  # the log tail names the cause


def test_orphaned_service_exits(tmp_path):
    """A service whose parent is SIGKILLed (e.g. a killed Snakemake job) shuts itself down."""
    d = tw_games_dir()
    ready = tmp_path / "ready.json"
    sock = tmp_path / "s.sock"
    script = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'fedagent.cli', 'serve-env', '--games', {str(d)!r},"
        f" '--split', 'val', '--all', '--uds', {str(sock)!r}, '--ready-file', {str(ready)!r}])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists()
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 15
    while _pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pid_alive(child)


def test_deferred_wait_overlaps_start_up_and_gates_health(tmp_path):
    """``wait=False``: the block runs at once (the job loads its model meanwhile); ``ready()``
    health-gates the service (idempotent), a failing one raises there, and it is stopped after."""
    from fedagent.envs.lifecycle import PendingEnv

    d = tw_games_dir()
    with env_service(
        d, "val", ["tw-val-0000"], tmp_path / "a", mode="index", pool_size=1, max_turns=5, wait=False
    ) as pending:
        # Entered without a health check: no client yet (wait=True would have made one).
        assert isinstance(pending, PendingEnv) and pending.client is None
        pid = pending.proc.pid
        c = pending.ready()
        assert c.health()["ok"] and pending.client is c and pending.ready() is c
    assert not _pid_alive(pid)
    with pytest.raises(EnvServiceStartError, match="exited with code"):
        with env_service(
            d, "train", ["no-such-task"], tmp_path / "b", mode="index", pool_size=1, max_turns=5, wait=False
        ) as pending:
            pending.ready()


def test_an_env_service_refuses_a_jax_imported_for_the_gpu(monkeypatch):
    """A warm server that preloaded jax: jax read JAX_PLATFORMS at its import, under the server's
    environment, so the job's JAX_PLATFORMS=cpu (from lifecycle) would come too late."""
    import types

    from fedagent.envs.serve import NO_ACCELERATOR_ENV, AcceleratorEnvError, hide_accelerators

    for key in NO_ACCELERATOR_ENV:
        monkeypatch.delenv(key, raising=False)
    fake = types.ModuleType("jax")
    fake.config = types.SimpleNamespace(jax_platforms=None)  # imported with no JAX_PLATFORMS: the GPU
    monkeypatch.setitem(sys.modules, "jax", fake)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the job's environment says cpu: too late
    with pytest.raises(AcceleratorEnvError, match="jax was imported before"):
        hide_accelerators()
    fake.config.jax_platforms = "cpu"  # imported under JAX_PLATFORMS=cpu: fine
    assert hide_accelerators() == NO_ACCELERATOR_ENV
    monkeypatch.delitem(sys.modules, "jax")
    assert hide_accelerators() == NO_ACCELERATOR_ENV


def test_projection_reaches_the_service(tmp_path):
    """rollout.projection through serve-env: reference executes a <think>-less answer's action on a
    real TextWorld game (and survives tagless empty and NUL-carrying answers: seen failing, the service
    died, before engine_text), noop leaves the state as it was."""
    d = tw_games_dir()
    seen = {}
    for projection in ("reference", "noop"):
        with env_service(
            d,
            "val",
            ["tw-val-0000"],
            tmp_path / projection,
            mode="index",
            pool_size=1,
            max_turns=5,
            projection=projection,
        ) as c:
            c.create("s")
            obs0 = c.reset("s", 0)["observation"]
            r = c.step("s", "<action>inventory</action>")
            empty = c.step("s", "")
            nul = c.step("s", "\x00 junk")  # a NUL used to end the Z-machine (and the service) under reference
            assert r["is_action_valid"] is False and empty["is_action_valid"] is False and not nul["is_action_valid"]
            seen[projection] = (obs0, r["observation"], nul["turns"])
    assert seen["reference"][1] != seen["reference"][0] and "carrying" in seen["reference"][1].lower()
    assert seen["noop"][1] == seen["noop"][0] and seen["reference"][2] == seen["noop"][2] == 3
