"""The warm fork server (fedagent.warm): a forked job is the job a fresh process would have run.

One module-scoped server (preload train,env) serves the job tests; the stale-code and stop tests
start their own. Every server runs on a short socket path under /tmp and is stopped in a finalizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from env_fixtures import tw_games_dir
from fedagent.envs.client import EnvClient, EnvServiceError
from fedagent.core.timing import JOB_START_ENV, process_start_time

pytestmark = pytest.mark.slow
SOCKET_ENV = "FEDAGENT_WARM_SOCKET"
FEDAGENT = [sys.executable, "-m", "fedagent.cli"]
# What Snakemake's shell puts into every job's environment for `threads: 1` (snakemake/shell.py).
SNAKEMAKE_THREADS = {
    k: "1"
    for k in (
        "OMP_NUM_THREADS",
        "GOTO_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
        "VECLIB_MAXIMUM_THREADS",
        "NUMEXPR_NUM_THREADS",
    )
}
TRAIN = {
    "base_seed": 7,
    "epochs": 1,
    "groups_per_epoch": 1,
    "group_size": 2,
    "max_turns": 2,
    "max_new_tokens": 8,
    "max_prompt_tokens": 256,
    "mini_batch_size": 2,
    "lr": 1.0e-3,
    "pool_size": 2,
}


def _env(**extra) -> dict:
    """The environment of every server and job here (Snakemake's PYTHONHASHSEED, as the workflow tests)."""
    env = {k: v for k, v in os.environ.items() if k not in (SOCKET_ENV, JOB_START_ENV)}
    env["PYTHONHASHSEED"] = "0"
    env.update(extra)
    return env


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return value


@contextlib.contextmanager
def warm_server(preload: str, *extra: str, env: dict | None = None):
    """A foreground `fedagent warm-server` subprocess; yields (socket, log path, its pid); always stopped."""
    d = Path(tempfile.mkdtemp(prefix="fa-w"))
    sock, ready, log = d / "s", d / "ready.json", d / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [*FEDAGENT, "warm-server", "--socket", str(sock), "--preload", preload, "--ready-file", str(ready), *extra],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env or _env(),
            cwd=d,
            stdin=subprocess.DEVNULL,
        )
    try:
        _wait_for(lambda: ready.exists() or proc.poll() is not None, 120, "the warm server")
        assert ready.exists(), log.read_text()
        yield str(sock), log, proc.pid
    finally:
        try:
            subprocess.run(
                [*FEDAGENT, "warm-server", "--socket", str(sock), "--stop"], env=_env(), capture_output=True, timeout=60
            )
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def server():
    with warm_server("train,env") as s:
        yield s


@pytest.fixture(scope="module")
def job_inputs(tmp_path_factory):
    """A real train-client job's inputs: the tiny model, 2 TextWorld games, a 1-client partition."""
    d = tmp_path_factory.mktemp("warm-inputs")
    games = tw_games_dir()
    for args in (
        ["tiny-model", "--seed", "5", "--out", str(d / "model")],
        ["partition", "--games", str(games), "--clients", "1", "--out", str(d / "partition.json")],
    ):
        res = subprocess.run([*FEDAGENT, *args], env=_env(), capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
    return {"model": d / "model", "games": games, "partition": d / "partition.json"}


def _train_cmd(inputs: dict, out: Path) -> list[str]:
    return [
        *FEDAGENT,
        "train-client",
        "--model",
        str(inputs["model"]),
        "--ref-model",
        str(inputs["model"]),
        "--games",
        str(inputs["games"]),
        "--partition",
        str(inputs["partition"]),
        "--client",
        "0",
        "--round",
        "1",
        "--params",
        json.dumps(TRAIN),
        "--threads",
        "1",
        "--out",
        str(out),
    ]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _metrics_without_clock(out: Path) -> dict:
    m = json.loads((out / "metrics.json").read_text())
    m.pop("timings")
    m.pop("wall_time_s")
    return m


def test_train_client_through_the_warm_server_is_byte_identical(server, job_inputs, tmp_path):
    sock, log, server_pid = server
    job_env = _env(**SNAKEMAKE_THREADS)  # as a Snakemake job has it (the server has none of these)
    fresh = subprocess.run(
        _train_cmd(job_inputs, tmp_path / "fresh" / "u"),
        env=job_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert fresh.returncode == 0, fresh.stderr
    warm = subprocess.run(
        _train_cmd(job_inputs, tmp_path / "warm" / "u"),
        env={**job_env, SOCKET_ENV: sock},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert warm.returncode == 0, warm.stderr + log.read_text()
    a, b = tmp_path / "fresh" / "u", tmp_path / "warm" / "u"
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors")
    assert _metrics_without_clock(a) == _metrics_without_clock(b)
    assert json.loads(fresh.stdout.splitlines()[0]) == json.loads(warm.stdout.splitlines()[0])  # env_info line
    forks = [line for line in log.read_text().splitlines() if " forked pid " in line]
    assert any("fedagent train-client" in line for line in forks), forks
    assert any("fedagent serve-env" in line for line in forks), forks  # lifecycle's env service too
    marks = {
        name: json.loads((d / "metrics.json").read_text())["timings"]["marks"]
        for name, d in (("fresh", a), ("warm", b))
    }
    print("job_ready (imports done) after process start, s:", {k: m["job_ready"] for k, m in marks.items()})
    # Where a warm job's first moments went: client sent → job process took it → command → ready.
    w = marks["warm"]
    assert 0 <= w["request_sent"] <= w["job_taken"] <= w["command_start"] <= w["job_ready"], w
    assert w["job_ready"] <= w["env_service_up"] <= w["first_batch_reset"] <= w["env_ready"], w  # the env's start
    assert "request_sent" not in marks["fresh"] and marks["fresh"]["command_start"] <= marks["fresh"]["job_ready"]


def test_aggregate_merge_report_and_tiny_model_through_the_warm_server_are_byte_identical(tmp_path):
    """The server's side of a round forks too (preload group "server"): same delta, same model, the same
    report (summary.csv, curves.png) and the same tiny round-0 model as fresh processes write."""
    evals = []
    for r, rate in ((0, 0.25), (1, 0.5)):
        evals.append(tmp_path / f"eval{r}.json")
        evals[-1].write_text(json.dumps({"round": r, "n": 4, "success_rate": rate, "ci95": [0.0, 0.75]}))
    from fake_env import build_tiny_model

    # models[1] from a fresh `fedagent tiny-model` (what the warm one must equal); the clients' in-process
    res = subprocess.run(
        [*FEDAGENT, "tiny-model", "--seed", "1", "--out", str(tmp_path / "m1")],
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    models = {1: tmp_path / "m1", **{seed: build_tiny_model(tmp_path / f"m{seed}", seed) for seed in (2, 3)}}
    job_env = _env(**SNAKEMAKE_THREADS)
    outs = {}
    with warm_server("server") as (sock, log, _pid):
        for name, extra in (("fresh", {}), ("warm", {SOCKET_ENV: sock})):
            d = tmp_path / name
            for cmd in (
                [
                    "aggregate",
                    "--prev",
                    str(models[1]),
                    "--clients",
                    str(models[2]),
                    str(models[3]),
                    "--out",
                    str(d / "agg"),
                ],
                [
                    "merge",
                    "--prev",
                    str(models[1]),
                    "--aggregate",
                    str(d / "agg"),
                    "--prev-server-state",
                    "none",
                    "--round",
                    "1",
                    "--out",
                    str(d / "model"),
                ],
                ["report", "--evals", *map(str, evals), "--summary", str(d / "summary.csv")]
                + ["--curves", str(d / "curves.png")],
                # the fresh one is models[1]
                *([["tiny-model", "--seed", "1", "--out", str(d / "tiny")]] if name == "warm" else []),
            ):
                res = subprocess.run(
                    [*FEDAGENT, *cmd],
                    env={**job_env, **extra},
                    cwd=tmp_path,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert res.returncode == 0, res.stderr + log.read_text()
            outs[name] = d
        forks = [line for line in log.read_text().splitlines() if " forked pid " in line]
    for command in ("aggregate", "merge", "report", "tiny-model"):
        assert any(f"fedagent {command} " in line for line in forks), (command, forks)
    for rel in ("agg/delta.safetensors", "model/model.safetensors", "summary.csv", "curves.png"):
        assert _sha(outs["fresh"] / rel) == _sha(outs["warm"] / rel), rel
    for rel in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(outs["warm"] / "tiny" / rel) == _sha(models[1] / rel), rel


def test_the_plan_jobs_through_the_warm_server_are_byte_identical(server, tmp_path):
    """The plan's jobs fork too (fedagent.commands.WARM_COMMANDS): the catalogue, the partition, the
    validation set and a round's selection write, through the server, the files fresh processes write."""
    sock, log, _pid = server
    job_env = _env(**SNAKEMAKE_THREADS)
    tw = [
        "games",
        "--seed",
        "42",
        "--n-train",
        "2",
        "--n-val",
        "2",
        "--world-size",
        "1",
        "--nb-objects",
        "1",
        "--quest-length",
        "1",
    ]
    outs = {}
    for name, extra in (("fresh", {}), ("warm", {SOCKET_ENV: sock})):
        d = tmp_path / name
        d.mkdir()
        for cmd in (
            ["catalogue", "--kind", "textworld", "--out", "games", "--jobs", "2", "--quarantine", "q", "--", *tw],
            ["partition", "--games", "games", "--clients", "2", "--strategy", "uniform", "--min-tasks", "1"]
            + ["--seed", "42", "--knobs", "{}", "--out", "partition.json"],
            ["val-set", "--games", "games", "--n", "2", "--out", "val_set.json"],
            ["select", "--seed", "7", "--round", "2", "--total", "3", "--per-round", "2", "--out", "selection.json"],
        ):
            res = subprocess.run(
                [*FEDAGENT, *cmd], env={**job_env, **extra}, cwd=d, capture_output=True, text=True, timeout=300
            )
            assert res.returncode == 0, res.stderr + log.read_text()
        outs[name] = d
    forks = [line for line in log.read_text().splitlines() if " forked pid " in line]
    for command in ("catalogue", "partition", "val-set", "select"):
        assert any(f"fedagent {command} " in line for line in forks), (command, forks)
    files = sorted(p.relative_to(outs["fresh"]).as_posix() for p in outs["fresh"].rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(outs["warm"]).as_posix() for p in outs["warm"].rglob("*") if p.is_file())
    assert {"games/games.json", "partition.json", "val_set.json", "selection.json"} <= set(files), files
    for rel in files:
        assert _sha(outs["fresh"] / rel) == _sha(outs["warm"] / rel), rel


def test_exit_codes_and_output_are_those_of_a_fresh_process(server, tmp_path):
    sock, _log, _pid = server
    cases = (
        ["serve-env", "--help"],  # stdout, exit 0
        ["eval", "--bogus"],  # argparse: stderr, exit 2
        [
            "train-client",
            "--model",
            "m",
            "--ref-model",
            "m",
            "--games",
            "g",
            "--partition",
            str(tmp_path / "missing.json"),
            "--client",
            "0",
            "--round",
            "1",
            "--params",
            "{}",
            "--out",
            str(tmp_path / "o"),
        ],
    )  # a traceback, exit 1
    for argv in cases:
        fresh = subprocess.run([*FEDAGENT, *argv], env=_env(), cwd=tmp_path, capture_output=True, text=True)
        warm = subprocess.run(
            [*FEDAGENT, *argv], env=_env(**{SOCKET_ENV: sock}), cwd=tmp_path, capture_output=True, text=True
        )
        assert (warm.returncode, warm.stdout) == (fresh.returncode, fresh.stdout), argv
        assert warm.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:], (argv, warm.stderr)
        assert fresh.stdout or fresh.stderr


def _start_service(sock: str, games: Path, cwd: Path, **env) -> tuple[subprocess.Popen, int]:
    """`fedagent serve-env` through the warm client; its (client, forked service pid) once it is ready."""
    (cwd / "tasks.json").write_text(json.dumps(["tw-train-0000"]))
    client = subprocess.Popen(
        [
            *FEDAGENT,
            "serve-env",
            "--games",
            str(games),
            "--split",
            "train",
            "--tasks-file",
            "tasks.json",
            "--uds",
            str(cwd / "env.sock"),
            "--pool-size",
            "1",
            "--ready-file",
            "ready.json",
        ],
        env=_env(**{SOCKET_ENV: sock}, **env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    ready = cwd / "ready.json"  # relative to the job's cwd: the fork did chdir
    _wait_for(lambda: ready.exists() or client.poll() is not None, 60, "the env service")
    assert ready.exists(), client.communicate()[0]
    return client, json.loads(ready.read_text())["pid"]


def test_sigterm_to_the_client_reaches_the_job(server, tmp_path):
    sock, _log, server_pid = server
    client, pid = _start_service(sock, tw_games_dir(), tmp_path, FEDAGENT_ENV_TOKEN="t0k")
    assert _ppid(pid) == server_pid  # forked by the warm server, not started by the client
    assert os.getpgid(pid) == pid != os.getpgid(client.pid)  # the job leads its own process group
    env = EnvClient(uds=str(tmp_path / "env.sock"), token="t0k", max_retries=1)
    assert env.health()["ok"]  # the job's environment (its token), not the server's
    with pytest.raises(EnvServiceError):
        EnvClient(uds=str(tmp_path / "env.sock"), token="wrong", max_retries=0).health()
    env.shutdown()
    client.send_signal(signal.SIGTERM)  # what lifecycle._stop does
    out, _ = client.communicate(timeout=30)
    assert client.returncode == 128 + signal.SIGTERM, out  # serve-env's own exit on SIGTERM, passed back
    assert not _alive(pid)


# What a GPU job's environment may hold (Slurm's CUDA_VISIBLE_DEVICES, a user's JAX choice); the env
# service it starts must run without any of it (fedagent.envs.serve.NO_ACCELERATOR_ENV, issue 27).
GPU_JOB_ENV = {"CUDA_VISIBLE_DEVICES": "0", "JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}


@pytest.mark.parametrize("path", ["spawned", "warm"])
def test_env_services_see_no_accelerator_on_both_start_paths(server, tmp_path, monkeypatch, path):
    """lifecycle.env_service from a GPU job's environment: the service process (spawned by the job, or
    forked by the warm server through the light client) runs with no visible GPU and JAX on the CPU,
    as it reports in its ready file (written by the service process itself, from its os.environ)."""
    from fedagent.envs.lifecycle import env_service
    from fedagent.envs.serve import NO_ACCELERATOR_ENV

    sock, log, server_pid = server
    for key, value in {**_env(), **GPU_JOB_ENV}.items():
        monkeypatch.setenv(key, value)  # this process is the GPU job
    if path == "warm":
        monkeypatch.setenv(SOCKET_ENV, sock)
    else:
        monkeypatch.delenv(SOCKET_ENV, raising=False)
    workdir = tmp_path / "job"
    with env_service(
        tw_games_dir(), "train", ["tw-train-0000"], workdir, mode="index", pool_size=1, max_turns=2
    ) as client:
        assert client.health()["ok"]
        ready = json.loads(next(workdir.glob("env-*-ready.json")).read_text())
        parent = _ppid(ready["pid"])
    assert parent == (server_pid if path == "warm" else os.getpid()), (path, parent)  # warm: the guard let it fork
    assert (
        ready["accelerator_env"]
        == NO_ACCELERATOR_ENV
        == {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    )


def test_a_killed_client_takes_its_job_down(server, tmp_path):
    sock, log, _pid = server
    client, pid = _start_service(sock, tw_games_dir(), tmp_path)
    client.kill()  # SIGKILL: the client cannot forward anything
    client.wait()
    _wait_for(lambda: not _alive(pid), 5, f"the orphaned job {pid} to be killed")
    assert f"client of pid {pid} " in log.read_text()


def test_a_client_that_loses_its_server_kills_its_job(tmp_path):
    with warm_server("") as (sock, _log, server_pid):
        client, pid = _start_service(sock, tw_games_dir(), tmp_path)
        os.kill(server_pid, signal.SIGKILL)  # the job is now nobody's child but init's
        out, _ = client.communicate(timeout=30)
        assert client.returncode == 2 and f"while job pid {pid} ran" in out.decode()
        _wait_for(lambda: not _alive(pid), 5, f"job {pid} of the lost server to be killed")


def test_the_client_kills_the_job_when_its_server_vanishes_mid_job(tmp_path):
    """Against a stand-in server that names a job (a `sleep` leading its own group), then hangs up."""
    import socket
    import threading

    from fedagent.warm import protocol

    job = subprocess.Popen(["sleep", "60"], start_new_session=True)
    d = Path(tempfile.mkdtemp(prefix="fa-w"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(d / "s"))
    listener.listen(1)

    def serve_once():
        conn, _ = listener.accept()
        with conn:
            reader = protocol.Reader()
            while reader.message() is None:
                reader.feed(conn)
            for fd in reader.take_fds():
                os.close(fd)
            conn.sendall(protocol.encode({"pid": job.pid}))

    t = threading.Thread(target=serve_once, daemon=True)
    t.start()
    try:
        res = subprocess.run(
            [*FEDAGENT, "eval", "--help"],
            env=_env(**{SOCKET_ENV: str(d / "s")}),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert res.returncode == 2 and f"while job pid {job.pid} ran" in res.stderr
        assert job.wait(5) == -signal.SIGKILL
    finally:
        job.kill()
        listener.close()
        shutil.rmtree(d, ignore_errors=True)


def test_the_server_will_not_fork_with_a_second_python_thread():
    code = (
        "import threading, time; from fedagent.warm.preload import fork_problem; print(fork_problem()); "
        "threading.Thread(target=time.sleep, args=(5,), name='straggler', daemon=True).start(); "
        "print(fork_problem())"
    )
    res = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True)
    first, second = res.stdout.splitlines()
    assert first == "None" and "straggler" in second, res.stderr


def test_the_light_client_imports_neither_torch_nor_numpy(server):
    sock, _log, _pid = server
    code = (
        "import json, sys; import fedagent.cli as c; rc = c.main(['serve-env', '--help']); "
        "print(json.dumps([rc, 'torch' in sys.modules, 'numpy' in sys.modules, 'fedagent.warm.client' in sys.modules]))"
    )
    res = subprocess.run([sys.executable, "-c", code], env=_env(**{SOCKET_ENV: sock}), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "usage: fedagent serve-env" in res.stdout  # the forked job wrote to our stdout
    assert json.loads(res.stdout.splitlines()[-1]) == [0, False, False, True]


def test_no_server_at_the_socket_is_an_error_naming_it(tmp_path):
    path = str(tmp_path / "nobody.sock")
    res = subprocess.run([*FEDAGENT, "eval", "--help"], env=_env(**{SOCKET_ENV: path}), capture_output=True, text=True)
    assert res.returncode == 2 and res.stdout == ""
    assert path in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_stale_code_and_startup_environment_are_refused(tmp_path):
    watched = tmp_path / "module.py"
    watched.write_text("x = 1\n")
    with warm_server("", "--watch-extra", str(watched)) as (sock, log, _pid):
        ping = subprocess.run(
            [*FEDAGENT, "warm-server", "--socket", sock, "--ping"], env=_env(), capture_output=True, text=True
        )
        assert json.loads(ping.stdout)["watched_files"] > 10  # fedagent's own imported files
        ok = subprocess.run([*FEDAGENT, "eval", "--help"], env=_env(**{SOCKET_ENV: sock}), capture_output=True)
        assert ok.returncode == 0
        threads = subprocess.run(
            [*FEDAGENT, "eval", "--help"], env=_env(**{SOCKET_ENV: sock, "OMP_NUM_THREADS": "3"}), capture_output=True
        )
        assert threads.returncode == 0  # a thread count is applied, not refused
        startup = (("PYTHONHASHSEED", "1"), ("OMP_PROC_BIND", "true"), ("OMP_NUM_THREADS", "lots"))
        # MPLCONFIGDIR: the report's matplotlib (server group) reads its rc file there at import
        for key, value in (*startup, ("MPLCONFIGDIR", str(tmp_path / "mpl"))):
            res = subprocess.run(
                [*FEDAGENT, "eval", "--help"],
                env=_env(**{SOCKET_ENV: sock, key: value}),
                capture_output=True,
                text=True,
            )
            assert res.returncode == 2 and res.stdout == "", res.stdout
            assert f"environment variable {key}" in res.stderr and len(res.stderr.strip().splitlines()) == 1
        watched.write_text("x = 22\n")
        res = subprocess.run(
            [*FEDAGENT, "eval", "--help"], env=_env(**{SOCKET_ENV: sock}), capture_output=True, text=True
        )
        assert res.returncode == 2 and res.stdout == ""
        assert f"{watched} changed" in res.stderr and "restart the warm server" in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


def test_detach_then_stop_kills_running_jobs_and_removes_the_socket(tmp_path):
    d = Path(tempfile.mkdtemp(prefix="fa-w"))
    sock = str(d / "s")
    try:
        os.close(os.open(sock, os.O_CREAT))  # a regular file there is refused, not removed
        res = subprocess.run(
            [*FEDAGENT, "warm-server", "--socket", sock, "--detach"], env=_env(), capture_output=True, text=True
        )
        assert res.returncode == 1 and "is not a socket" in res.stderr and os.path.isfile(sock)
        os.unlink(sock)
        res = subprocess.run(
            [*FEDAGENT, "warm-server", "--socket", sock, "--preload", "", "--detach"],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0 and "warm-server ready" in res.stdout, res.stderr
        again = subprocess.run(
            [*FEDAGENT, "warm-server", "--socket", sock, "--detach"], env=_env(), capture_output=True, text=True
        )
        assert again.returncode == 1 and "already answers" in again.stderr
        client, pid = _start_service(sock, tw_games_dir(), tmp_path)
        stop = subprocess.run(
            [*FEDAGENT, "warm-server", "--socket", sock, "--stop"],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stop.returncode == 0 and json.loads(stop.stdout) == {"stopped": True}
        assert not _alive(pid) and not os.path.exists(sock)
        client.communicate(timeout=30)
        assert client.returncode == 128 + signal.SIGTERM  # the job's own code, passed back before the stop
    finally:
        subprocess.run([*FEDAGENT, "warm-server", "--socket", sock, "--stop"], env=_env(), capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


def test_a_forked_job_applies_its_own_thread_counts():
    """libgomp/MKL/OpenBLAS read their counts when loaded (in the server): the job sets them by call."""
    code = (
        "import json, numpy, torch; from fedagent.warm import threads; b = threads.openblas_threads(); "
        "threads.apply({'OMP_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1', 'OPENBLAS_NUM_THREADS': '1'}, "
        "{'OPENBLAS_NUM_THREADS': '2'}); print(json.dumps([b, threads.openblas_threads(), torch.get_num_threads()]))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=_env(OPENBLAS_NUM_THREADS="2"), capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    before, after, torch_threads = json.loads(res.stdout)
    assert before and set(before) == {2} and set(after) == {1} and torch_threads == 1


def test_a_job_ends_like_an_interpreter_even_with_an_idle_executor():
    """A job that leaves a ThreadPoolExecutor running must still exit (a bare join would wait forever)."""
    code = (
        "import concurrent.futures, os, time; from fedagent.warm.child import _shutdown; "
        "ex = concurrent.futures.ThreadPoolExecutor(2); ex.submit(time.sleep, 0.1); _shutdown(); print('done')"
    )
    res = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout == "done\n", res.stderr


def test_job_start_comes_from_the_environment_when_set(monkeypatch):
    monkeypatch.delenv(JOB_START_ENV, raising=False)
    own = process_start_time()
    assert abs(own - time.time()) < 3600 * 24 * 365
    monkeypatch.setenv(JOB_START_ENV, "1234.5")
    assert process_start_time() == 1234.5
