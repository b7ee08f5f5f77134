"""Standby processes of the warm server (``--standby N``, fedagent.warm.standby), with the CPU kinds.

Kind "touch" writes ``$FEDAGENT_STANDBY_TOUCH_DIR/standby-<pid>.json`` ({"pid", "prepared"}) at the
end of its prepare (after sleeping for the seconds in ``DIR/sleep`` if that file exists), so a test
can tell which process was prepared when; kind "fail" raises. The servers run on short socket paths
under /tmp and are stopped in a finalizer (tests/test_warm.py's ``warm_server``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from env_fixtures import tw_games_dir
from fedagent.warm import client as warm_client
from fedagent.warm.standby import TOUCH_DIR_ENV
from test_warm import job_inputs  # noqa: F401 - the module-scoped fixture, shared with test_warm.py
from test_warm import (
    FEDAGENT,
    SNAKEMAKE_THREADS,
    SOCKET_ENV,
    _alive,
    _env,
    _metrics_without_clock,
    _ppid,
    _sha,
    _start_service,
    _train_cmd,
    _wait_for,
    warm_server,
)

pytestmark = pytest.mark.slow
TOUCH = ("--standby-kind", "touch")


def _ping(sock: str) -> dict:
    return warm_client.ask(sock, {"op": "ping"})


def _ready(sock: str, n: int = 1, besides: tuple[int, ...] = ()) -> list[int]:
    """Once at least ``n`` standbys other than ``besides`` are ready: their pids."""

    def pids():
        got = [s["pid"] for s in _ping(sock)["standbys"] if s["state"] == "ready" and s["pid"] not in besides]
        return got if len(got) >= n else None

    return _wait_for(pids, 30, f"{n} ready standby(s)")


def _touch_server(marks: Path, *extra: str, preload: str = ""):
    marks.mkdir(exist_ok=True)
    return warm_server(preload, *TOUCH, *extra, env=_env(**{TOUCH_DIR_ENV: str(marks)}))


def test_a_standby_command_runs_in_the_standby_prepared_before_it_and_a_replacement_follows(tmp_path):
    marks = tmp_path / "marks"
    # serve-env as a standby command (tests only): it writes its own pid to its ready file.
    with _touch_server(marks, "--standby", "1", "--standby-commands", "serve-env,eval") as (sock, log, server_pid):
        [first] = _ready(sock)
        mark = json.loads((marks / f"standby-{first}.json").read_text())
        asked = time.time()  # the client (the request) starts after this
        client, pid = _start_service(sock, tw_games_dir(), tmp_path)
        assert pid == first == mark["pid"]  # the job ran in the standby's process ...
        assert mark["prepared"] < asked  # ... prepared before the request
        assert _ppid(pid) == server_pid and os.getpgid(pid) == pid != os.getpgid(client.pid)
        [second] = _ready(sock, besides=(first,))  # a replacement, prepared in its own process
        assert second != first and (marks / f"standby-{second}.json").exists()
        assert f"standby pid {first} (process group {first}, ready " in log.read_text()
        client.kill()  # a killed client still takes its job down
        client.wait()
        _wait_for(lambda: not _alive(pid), 5, f"the orphaned standby job {pid} to be killed")
        assert f"client of pid {pid} " in log.read_text()
        assert [s["pid"] for s in _ping(sock)["standbys"]] == [second]


def test_other_commands_and_other_cuda_environments_fork_plainly(tmp_path):
    marks = tmp_path / "marks"
    with _touch_server(marks, "--standby", "1") as (sock, log, _pid):
        [idle] = _ready(sock)
        plain = [
            (["serve-env", "--help"], {}, "serve-env is not a standby command"),
            (["eval", "--help"], {"CUDA_VISIBLE_DEVICES": "0"}, "environment variable CUDA_VISIBLE_DEVICES"),
            (
                ["eval", "--help"],
                {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
                "environment variable CUBLAS_WORKSPACE_CONFIG",
            ),
        ]
        for argv, extra, why in plain:
            res = subprocess.run(
                [*FEDAGENT, *argv],
                env=_env(**{SOCKET_ENV: sock}, **extra),
                cwd=tmp_path,
                capture_output=True,
                text=True,
            )
            assert res.returncode == 0 and res.stdout.startswith("usage: fedagent"), res.stderr
            assert why in log.read_text()
        forks = [line for line in log.read_text().splitlines() if " forked pid " in line]
        assert len(forks) == 3, forks
        assert [s["pid"] for s in _ping(sock)["standbys"]] == [idle]  # untouched, still waiting
        # eval through the standby: what a fresh process prints and returns
        for argv in (["eval", "--help"], ["eval", "--bogus"]):
            fresh = subprocess.run([*FEDAGENT, *argv], env=_env(), cwd=tmp_path, capture_output=True, text=True)
            warm = subprocess.run(
                [*FEDAGENT, *argv], env=_env(**{SOCKET_ENV: sock}), cwd=tmp_path, capture_output=True, text=True
            )
            assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
            assert f"standby pid {idle} " in log.read_text()
            [idle] = _ready(sock, besides=(idle,))
        assert len([line for line in log.read_text().splitlines() if " forked pid " in line]) == 3


def test_train_client_through_a_standby_is_byte_identical_to_a_plain_fork(job_inputs, tmp_path):
    """The touch kind runs the standby's warm-up (bf16 + fp32 matmuls) on the CPU before the job."""
    marks = tmp_path / "marks"
    job_env = _env(**SNAKEMAKE_THREADS)
    with _touch_server(marks, "--standby", "1", preload="train,env") as (sock, log, _pid):
        [sb] = _ready(sock)
        (marks / "sleep").write_text("60")  # the replacement prepares for 60 s: not ready for job 2
        outs = {}
        for name in ("standby", "plain"):
            t0 = time.monotonic()
            res = subprocess.run(
                _train_cmd(job_inputs, tmp_path / name / "u"),
                env={**job_env, SOCKET_ENV: sock},
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert res.returncode == 0, res.stderr + log.read_text()
            outs[name] = (tmp_path / name / "u", res.stdout, time.monotonic() - t0)
        text = log.read_text()
        assert any(
            f"standby pid {sb} (process group {sb}, ready " in line and "fedagent train-client" in line
            for line in text.splitlines()
        ), text
        assert "no standby is ready (pid " in text and "preparing)" in text  # not waited for: a plain fork
        assert outs["plain"][2] < 50, outs["plain"][2]
        forks = [line for line in text.splitlines() if " forked pid " in line and "fedagent train-client" in line]
        assert len(forks) == 1, forks
    (a, out_a, _), (b, out_b, _) = outs["standby"], outs["plain"]
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors")
    assert _metrics_without_clock(a) == _metrics_without_clock(b)
    assert json.loads(out_a.splitlines()[0]) == json.loads(out_b.splitlines()[0])  # env_info line


def test_stop_kills_waiting_and_preparing_standbys_and_stops_standby_jobs(tmp_path):
    marks = tmp_path / "marks"
    with _touch_server(marks, "--standby", "2", "--standby-commands", "serve-env") as (sock, log, _pid):
        ready = _ready(sock, 2)
        (marks / "sleep").write_text("60")
        client, job = _start_service(sock, tw_games_dir(), tmp_path)
        assert job in ready
        preparing = _wait_for(
            lambda: [s["pid"] for s in _ping(sock)["standbys"] if s["state"] == "preparing"],
            10,
            "the replacement standby",
        )
        pids = [*ready, *preparing]
        assert all(_alive(p) for p in pids)
        stop = subprocess.run(
            [*FEDAGENT, "warm-server", "--socket", sock, "--stop"],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stop.returncode == 0 and json.loads(stop.stdout) == {"stopped": True}
        assert [p for p in pids if _alive(p)] == []  # no standby left, none still preparing, no job
        client.communicate(timeout=30)
        assert client.returncode == 128 + signal.SIGTERM  # the standby job was stopped as a job is
        assert f"stopping: SIGTERM to process group {job} " in log.read_text()


def test_an_idle_standby_exits_when_its_server_is_killed(tmp_path):
    with _touch_server(tmp_path / "marks", "--standby", "1") as (sock, _log, server_pid):
        [sb] = _ready(sock)
        os.kill(server_pid, signal.SIGKILL)
        _wait_for(lambda: not _alive(sb), 5, f"standby {sb} of the killed server to exit")


def test_a_standby_killed_while_waiting_is_replaced(tmp_path):
    with _touch_server(tmp_path / "marks", "--standby", "1") as (sock, log, _pid):
        [sb] = _ready(sock)
        os.kill(sb, signal.SIGTERM)  # an idle standby dies by it (nothing to lose)
        [new] = _ready(sock, besides=(sb,))
        assert not _alive(sb) and [s["pid"] for s in _ping(sock)["standbys"]] == [new]
        assert f"standby pid {sb} (ready) ended before a job, exit -{int(signal.SIGTERM)}" in log.read_text()


def test_a_failing_prepare_is_logged_once_and_jobs_fork_plainly(tmp_path):
    with warm_server("", "--standby", "1", "--standby-kind", "fail") as (sock, log, _pid):
        _wait_for(lambda: _ping(sock)["standby"] == 0, 10, "the server to give up its standbys")
        time.sleep(1.0)  # a loop of replacements would show by now
        assert _ping(sock)["standbys"] == []
        res = subprocess.run(
            [*FEDAGENT, "eval", "--help"], env=_env(**{SOCKET_ENV: sock}), capture_output=True, text=True
        )
        assert res.returncode == 0 and res.stdout.startswith("usage: fedagent eval")
        text = log.read_text()
        assert text.count("forked: preparing") == 1 and text.count("failed while preparing") == 1, text
        assert "RuntimeError: standby kind 'fail' (tests): prepare fails on purpose" in text  # its traceback
        assert "no more standbys" in text
        assert len([line for line in text.splitlines() if " forked pid " in line and "fedagent eval" in line]) == 1


def test_cuda_standbys_without_a_gpu_fail_at_start_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    sock = Path(f"/tmp/fa-w{os.getpid()}.s")
    res = subprocess.run(
        [
            *FEDAGENT,
            "warm-server",
            "--socket",
            str(sock),
            "--preload",
            "",
            "--standby",
            "1",
            "--ready-file",
            str(tmp_path / "ready.json"),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 1 and res.stdout == ""
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "--standby 1" in res.stderr and "CUDA device" in res.stderr
    assert not sock.exists() and not (tmp_path / "ready.json").exists()


def test_a_standby_config_warms_the_runs_calls_once_its_model_exists(tmp_path):
    # --standby-config: the standby waits (still preparing: jobs fork plainly) until the run's base
    # model dir is complete, then runs the warm-up (kind touch: the same calls on the CPU) and only
    # then reports ready.
    import yaml

    from fedagent.model.base_model_tiny import write_tiny_model

    results = tmp_path / "results"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "run": "sb",
                "results_dir": str(results),
                "model": "tiny",
                "env": {"pool_size": 4},
                "train": {
                    "device": "cuda",
                    "sampler": "eager",
                    "max_prompt_tokens": 64,
                    "max_new_tokens": 4,
                    "mini_batch_size": 2,
                    "micro_batch_size": 2,
                },
                "eval": {
                    "device": "cuda",
                    "sampler": "eager",
                    "batch": 4,
                    "max_prompt_tokens": 64,
                    "max_new_tokens": 4,
                },
            }
        )
    )
    marks = tmp_path / "marks"
    with _touch_server(marks, "--standby", "1", "--standby-config", str(cfg)) as (sock, log, _pid):
        time.sleep(2.0)
        [sb] = _ping(sock)["standbys"]
        assert sb["state"] == "preparing" and not list(marks.glob("standby-*.json"))
        write_tiny_model(results / "sb" / "round_000" / "model", seed=3)
        _ready(sock)
        text = log.read_text()
        assert f"standby warm-up on a 1-layer model of {results / 'sb' / 'round_000' / 'model'}: model " in text
        assert "train " in text and "eval " in text, text


def test_a_standby_warms_from_the_runs_model_source_before_round_0_exists(tmp_path):
    # model: an HF dir. Its architecture is known before the base model is built, so the standby
    # warms up at once (on the round-1 jobs' critical path, round 0's model appears only ~1 min
    # into a run, when those jobs are already asking).
    import yaml

    from fedagent.model.base_model_tiny import write_tiny_model

    source = tmp_path / "hf"
    write_tiny_model(source, seed=5)
    results = tmp_path / "results"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "run": "sb",
                "results_dir": str(results),
                "model": str(source),
                "env": {"pool_size": 4},
                "train": {
                    "device": "cuda",
                    "sampler": "eager",
                    "max_prompt_tokens": 64,
                    "max_new_tokens": 4,
                    "mini_batch_size": 2,
                    "micro_batch_size": 2,
                },
            }
        )
    )
    with _touch_server(tmp_path / "marks", "--standby", "1", "--standby-config", str(cfg)) as (sock, log, _pid):
        _ready(sock)
        assert not (results / "sb" / "round_000" / "model").exists()
        text = log.read_text()
        assert f"standby warm-up on a 1-layer model of {source} (" in text and "train " in text, text


def test_a_standby_config_needs_standbys_and_a_gpu_job(tmp_path):
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text("run: x\n")
    for extra, why in (
        (["--standby-config", str(cpu)], "--standby-config needs --standby N"),
        (
            ["--standby", "1", "--standby-kind", "touch", "--standby-config", str(cpu)],
            "neither train nor eval runs on cuda",
        ),
        (
            ["--standby", "1", "--standby-kind", "touch", "--standby-config", str(tmp_path / "no.yaml")],
            "no.yaml does not exist",
        ),
    ):
        res = subprocess.run(
            [*FEDAGENT, "warm-server", "--socket", str(tmp_path / "s"), *extra],
            env=_env(),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 1 and why in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_refill_delay_forks_the_replacement_after_the_burst(tmp_path):
    # --standby-refill-delay: the standby that took a job is replaced only that long after the
    # hand-over (not against the job's own start); the replacement is then prepared as usual.
    marks = tmp_path / "marks"
    with _touch_server(
        marks, "--standby", "1", "--standby-refill-delay", "6", "--standby-commands", "serve-env,eval"
    ) as (sock, log, _pid):
        [first] = _ready(sock)
        client, pid = _start_service(sock, tw_games_dir(), tmp_path)
        t = time.monotonic()
        assert pid == first
        assert _ping(sock)["standbys"] == []  # nothing forked yet
        [second] = _ready(sock, besides=(first,))
        assert second != first and time.monotonic() - t > 1.0
        client.kill()
        client.wait()
    res = subprocess.run(
        [
            *FEDAGENT,
            "warm-server",
            "--socket",
            str(tmp_path / "s"),
            "--standby",
            "1",
            "--standby-kind",
            "touch",
            "--standby-refill-delay",
            "-1",
        ],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1 and "--standby-refill-delay -1.0: seconds, 0 or more" in res.stderr, res.stderr
