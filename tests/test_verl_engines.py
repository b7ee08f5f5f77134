"""Run-scoped verl engines (``train.verl.engines: run``, fedagent.train.verl.engines; issue 30).

On CPU: which overrides shape a set (two jobs of other rounds and clients share a key; a recipe change
does not); the set's overrides compose through its own entry point with every Ray env var a string; the
set's TaskRunner fitter resets verl's trainer to each later job's dirs and rows; and real
``train_client_verl`` jobs on a fake engine set (tests/fake_verl_engines.py, the real request loop and
client): the first job of a slot starts the set, the next reuses it after a reset, a recipe change
starts another, a reset from a foreign dir leaves no update, and a job killed mid-fit stops its set and
leaves nothing, after which the rerun commits; and in real Ray workers started from a set's overrides,
verl's colocated worker class carries our reset methods. The H200 is where a set meets real engines
(docs/results/verl.md).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is installed by scripts/setup.sh (envs/verl-cpu.txt)")

from fake_env import build_tiny_model  # noqa: E402
from fake_verl_trainer import FAKE_STEP_VALUES  # noqa: E402
from test_verl_isolation import _job  # noqa: E402
from test_verl_launch import REPO, assert_ray_env_vars_are_strings, ppo_train_params, workflow_train_params  # noqa: E402

from fedagent.train.local import TrainParams  # noqa: E402
from fedagent.train.verl import refit  # noqa: E402
from fedagent.core import procs  # noqa: E402
from fedagent.train.verl import leftovers, memory  # noqa: E402
from fedagent.train.verl.engines import client, keys, serve  # noqa: E402
from fedagent.train.verl.launch import VerlJob  # noqa: E402
from fedagent.train.verl.overrides import build_overrides  # noqa: E402
from fedagent.train.verl.settings import VerlSettings  # noqa: E402

TESTS = Path(__file__).resolve().parent
P = dict(groups_per_epoch=2, group_size=2, max_turns=1, pool_size=4, mini_batch_size=2)


def _overrides(tmp_path, round=1, client_=0, model="model", ppo=False, **settings):
    p = ppo_train_params() if ppo else workflow_train_params(REPO / "config" / "config.yaml")
    tag = f"fa-r{round:03d}-c{client_}-1-0123456789abcdef"
    w = tmp_path / f"r{round}c{client_}"
    job = VerlJob(tag=tag, workdir=w, ray_tmp=Path(f"/tmp/fa-ray-{round}{client_}"))
    return build_overrides(
        p,
        VerlSettings(**settings),
        job=job,
        model_dir=tmp_path / model,
        rows=w / "rows.parquet",
        agent_loop_yaml=w / "agent_loop.yaml",
        rollout_seed=100 * round + client_,
    )


@pytest.mark.parametrize("ppo", [False, True])
def test_jobs_of_other_rounds_and_clients_share_a_key_and_a_recipe_change_does_not(tmp_path, ppo):
    a = _overrides(tmp_path, 1, 0, "round_000/model", ppo=ppo)
    b = _overrides(tmp_path, 3, 1, "round_002/model", ppo=ppo)
    assert a != b and keys.engine_key(a) == keys.engine_key(b)
    # every per-job key is one a real launch writes (the list is not stale) …
    written = {o.partition("=")[0] for o in a}
    assert {k for k in keys.PER_JOB if not k.startswith("critic.") or ppo} <= written
    # … and anything else shapes the engines
    assert keys.engine_key(_overrides(tmp_path, enforce_eager=True, ppo=ppo)) != keys.engine_key(a)
    assert keys.engine_key(_overrides(tmp_path, kv_cache_gb=2.0, ppo=ppo)) != keys.engine_key(a)
    p2 = [o.replace("actor.optim.lr=1e-05", "actor.optim.lr=2e-05") for o in a]
    assert p2 != a and keys.engine_key(p2) != keys.engine_key(a)


def test_the_sets_overrides_compose_through_its_entry_point_with_string_ray_env_vars(tmp_path, monkeypatch):
    from verl_helpers import compose_ppo

    d = tmp_path / "slot-0"
    d.mkdir()
    ov = client.set_overrides(
        _overrides(tmp_path),
        d,
        ray_tmp=Path("/tmp/fa-ray-set"),
        tag="fa-eng-slot-0-1-ab",
        idle_s=30,
        key="k" * 64,
        nonce="0123456789abcdef",
    )
    cfg = compose_ppo(ov)
    assert_ray_env_vars_are_strings(cfg)
    env = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    assert env[client.SOCKET_ENV] == str(client.socket_path(d)) and env[client.IDLE_ENV] == "30.0"
    assert (
        env[client.KEY_ENV] == "k" * 64 and env[refit.REFIT_ENV] == "1" and env[client.NONCE_ENV] == "0123456789abcdef"
    )
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path == str(d / "agent_loop.yaml")
    assert cfg.ray_kwargs.ray_init._temp_dir == "/tmp/fa-ray-set"
    out = subprocess.run(
        [sys.executable, "-m", client.SERVER_MODULE, *ov, "--cfg", "job"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{client.KEY_ENV}: {'k' * 64}" in out.stdout


@pytest.mark.slow
def test_a_sets_ray_workers_bind_the_reset_methods_in_verls_colocated_worker_group(tmp_path):
    """Real Ray 2.60 on CPU, started as verl's run_ppo does from a PPO set's overrides: the hook arms our
    patches in the worker, and verl's own ``create_colocated_worker_cls`` (the v1 trainer's WorkerDict of
    the actor-rollout-ref worker and the critic's TrainingWorker) then carries the reset and the critic's
    path method as ONE_TO_ALL methods under each role's prefix — what ``spawn`` rebinds for the trainer."""
    from fedagent.train.verl.launch import isolated_job, job_environ

    pytest.importorskip("ray")
    d = tmp_path / "slot-0"
    d.mkdir()
    with isolated_job(tmp_path / ".verl-0", round=1, client=0) as j:
        ov = client.set_overrides(
            _overrides(tmp_path, ppo=True),
            d,
            ray_tmp=j.ray_tmp,
            tag=j.tag,
            idle_s=30,
            key="k" * 64,
            nonce="0123456789abcdef",
        )
        (j.workdir / "ov.json").write_text(json.dumps(ov))
        env = {
            **job_environ(j),
            "FEDAGENT_PROBE_COLOCATED": "1",
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.run(
            [
                sys.executable,
                str(TESTS / "verl_ray_probe.py"),
                str(j.workdir / "ov.json"),
                str(j.workdir / "probe.json"),
            ],
            env=env,
            cwd=j.workdir,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        got = json.loads((j.workdir / "probe.json").read_text())["colocated"]
    assert got == {
        f"actor_rollout_{refit.METHOD}": "ONE_TO_ALL",
        f"critic_{refit.PATH_METHOD}": "ONE_TO_ALL",
        f"critic_{refit.RELEASE_METHOD}": "ONE_TO_ALL",
        **{
            f"{role}_{m}": "ONE_TO_ALL"
            for role in ("actor_rollout", "critic")
            for m in (memory.MEMORY_METHOD, memory.CENSUS_METHOD)
        },
    }, got


def test_the_sets_fitter_resets_verls_trainer_to_a_later_jobs_dirs(tmp_path, monkeypatch):
    """VerlFitter on the config our launch composes: the set's own first job fits as built; a later job's
    rows, checkpoint dir and start dirs go into verl's config, then refit.reset_trainer with its dirs; the
    steps come back as verl's Tracking got them, and the fit's Tracking is finished."""
    import verl.trainer.ppo.v1.trainer_base as tb

    from verl_helpers import compose_ppo

    from fedagent.train.verl.engines.server import VerlFitter

    calls = []

    class Trainer:
        use_critic = False

        def fit(self, manager):
            calls.append(("fit", manager, str(cfg.data.train_files), str(cfg.trainer.default_local_dir)))
            self.logger = tb.Tracking(project_name="p", experiment_name="e", default_backend=[])
            self.logger.log(data={"actor/kl_loss": 0.5}, step=1)

    released = [{"role": "ref"}, {"role": "actor"}]  # what reset_trainer returns: the engines' release records
    monkeypatch.setattr(refit, "reset_trainer", lambda trainer, **kw: calls.append(("reset", kw)) or released)
    cfg = compose_ppo(_overrides(tmp_path))
    f = VerlFitter(Trainer(), cfg, "alm")
    first = {
        "tag": "a",
        "model_dir": str(tmp_path / "model"),
        "ref_dir": None,
        "critic_dir": None,
        "rows": str(tmp_path / "r1c0" / "rows.parquet"),
        "ckpt_dir": str(cfg.trainer.default_local_dir),
    }
    assert f.built_for(first) and not f.built_for({**first, "rows": "/elsewhere"})
    assert f.fit(first, reset=False) == [{"step": 1, "actor/kl_loss": 0.5}]
    assert f.last_reset is None  # no reset, no release records
    later = {
        **first,
        "tag": "b",
        "model_dir": "/runs/round_001/model",
        "rows": "/w/b/rows.parquet",
        "ckpt_dir": "/w/b/ckpt",
    }
    f.fit(later, reset=True)
    assert calls[0] == ("fit", "alm", first["rows"], first["ckpt_dir"])
    assert calls[1] == (
        "reset",
        {"model_dir": "/runs/round_001/model", "ref_dir": "/runs/round_001/model", "critic_dir": None},
    )
    assert calls[2] == ("fit", "alm", "/w/b/rows.parquet", "/w/b/ckpt")
    assert f.last_reset == released  # answered to the job as reset_release
    assert str(cfg.actor_rollout_ref.model.path) == "/runs/round_001/model" and cfg.trainer.experiment_name == "b"


def test_the_sets_memory_reading_is_its_fullest_training_worker(tmp_path):
    """``VerlFitter.memory_gb``: every rank of the actor-rollout-ref group and (PPO) the critic group answer
    ``refit.allocated_gb``; the set compares the largest. Without a device the workers answer None, and so
    does the set (it never retires for memory)."""
    from types import SimpleNamespace

    from fedagent.train.verl.engines.server import VerlFitter

    def group(*values):
        return SimpleNamespace(**{memory.MEMORY_METHOD: lambda: list(values)})

    f = VerlFitter.__new__(VerlFitter)
    f.trainer = SimpleNamespace(use_critic=True, actor_rollout_wg=group(1.5, 2.0), critic_wg=group(2.5))
    assert f.memory_gb() == 2.5
    f.trainer = SimpleNamespace(use_critic=False, actor_rollout_wg=group(1.5, 2.0), critic_wg=group(9.0))
    assert f.memory_gb() == 2.0
    f.trainer = SimpleNamespace(use_critic=False, actor_rollout_wg=group(None))
    assert f.memory_gb() is None
    assert memory.allocated_gb(None) is None  # this machine has no device: the worker method says so


def test_the_census_switch_reaches_the_sets_ray_env_as_a_string(tmp_path):
    """``scripts/gpu/verl-round.sh``'s ``CENSUS=true``: one ``train.verl.extra_overrides`` entry, composed
    through the set's overrides into Ray's runtime env as the string the set's fitter reads."""
    from verl_helpers import compose_ppo

    extra = (f"+ray_kwargs.ray_init.runtime_env.env_vars.{memory.CENSUS_ENV}='1'",)
    ov = client.set_overrides(
        _overrides(tmp_path, extra_overrides=extra),
        tmp_path / "slot-0",
        ray_tmp=Path("/tmp/fa-ray-x"),
        tag="t",
        idle_s=30,
        key="k" * 64,
        nonce="n",
        max_growth_gb=4.0,
    )
    cfg = compose_ppo(ov)
    assert_ray_env_vars_are_strings(cfg)
    env = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    assert env[memory.CENSUS_ENV] == "1" and env[client.GROWTH_ENV] == "4.0"


def test_the_memory_census_names_the_largest_storages_and_what_holds_them():
    """``memory.census`` (the worker's ``fedagent_device_tensors`` over the garbage collector's objects): views
    of one storage count once, the largest first, each with the types that hold it."""
    import torch

    class Keeper:  # e.g. a leftover optimizer state or a closure's cell
        def __init__(self, t):
            self.t = t

    big, small = torch.zeros(1000), torch.zeros(10)
    keeper = Keeper(big)
    rows = memory.census(
        [big, big[:5], small, torch.zeros(3, dtype=torch.int8)], lambda t: t.dtype == torch.float32, top=5
    )
    assert [(r["bytes"], r["tensors"], r["shape"]) for r in rows] == [(4000, 2, [1000]), (40, 1, [10])]
    assert "dict" in rows[0]["held_by"] or "Keeper" in rows[0]["held_by"]
    assert keeper.t is big


# ---- jobs on a fake engine set -------------------------------------------------------------------------


@pytest.fixture
def fake_engines(monkeypatch, tmp_path):
    rec = tmp_path / "records"
    rec.mkdir()
    monkeypatch.setenv(client.SERVER_ENV, "fake_verl_engines")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_VERL_RECORD", str(rec))
    monkeypatch.setenv("FAKE_VERL_HOLD_S", "0")
    monkeypatch.setenv("FEDAGENT_GPUS", "0:81559")  # runs through Snakemake stand for a one-card node
    yield rec
    from fedagent.train.verl.engines.stop import stop_sets_under

    stop_sets_under(tmp_path)  # whatever a test left running (a failed one's set)


SETTINGS = VerlSettings(gpus=1, engines="run", engine_sets=1, engines_idle_s=60)


def _records(rec: Path) -> dict:
    return {json.loads(p.read_text())["tag"].split("-")[2]: json.loads(p.read_text()) for p in rec.glob("job-*.json")}


def _set_pid(tmp_path) -> int | None:
    rec = client._server_record(tmp_path / ".verl-engines" / "slot-0")
    return None if rec is None else int(rec["pid"])


def test_the_first_job_starts_a_set_the_next_reuses_it_and_a_recipe_change_starts_another(fake_engines, tmp_path):
    model = build_tiny_model(tmp_path / "m", seed=1)
    rd = tmp_path / "round_001" / "clients"
    m0 = _job(model, rd, 0, TrainParams(**P), SETTINGS)
    pid0 = _set_pid(tmp_path)
    m1 = _job(model, rd, 1, TrainParams(**P), SETTINGS)
    assert _set_pid(tmp_path) == pid0 and procs.alive(pid0)  # the same set served both
    assert m0["verl"]["engine_set"]["warm"] is False and m1["verl"]["engine_set"]["warm"] is True
    assert m1["verl"]["engine_set"]["jobs_before"] == 1
    for m in (m0, m1):  # verl's values as the set returned them, and they agree with the job's log lines
        assert m["kl"] == pytest.approx(FAKE_STEP_VALUES["actor/kl_loss"]) and m["engine_steps_match"] is True
        assert m["num_episodes"] == P["groups_per_epoch"] * P["group_size"]
    # a warm job times its reset → first token; its launch → first token is the request's
    assert m1["timings_s"]["refit_to_first_generation"] > 0 and "refit_to_first_generation" not in m0["timings_s"]
    assert 0 < m1["timings_s"]["launch_to_first_generation"] < m0["timings_s"]["launch_to_first_generation"] + 60
    recs = _records(fake_engines)
    assert recs["c0"]["reset"] is False and recs["c1"]["reset"] is True
    assert (rd / "0" / "metrics.json").is_file() and (rd / "1" / "metrics.json").is_file()
    # another recipe (the learning rate shapes the engines): the set restarts for it
    p2 = TrainParams(**{**P, "lr": 2e-5})
    rd2 = tmp_path / "round_002" / "clients"
    m2 = _job(model, rd2, 0, p2, SETTINGS)
    assert m2["verl"]["engine_set"]["warm"] is False and _set_pid(tmp_path) != pid0 and not procs.alive(pid0)


def test_a_set_past_its_memory_limit_stops_and_the_next_job_starts_a_fresh_one(fake_engines, tmp_path):
    """The fitter's memory grows 0.5 GB a job (as a trained engine's did on the H200); with a 0.4 GB limit the
    set serves its second job, records the growth in that job's metrics.json, stops, and the next job
    starts a fresh set (cold, its own memory baseline)."""
    import dataclasses

    (fake_engines / "memory_step").write_text("0.5")
    s = dataclasses.replace(SETTINGS, engines_max_growth_gb=0.4)
    model = build_tiny_model(tmp_path / "m", seed=1)
    rd = tmp_path / "round_001" / "clients"
    m0 = _job(model, rd, 0, TrainParams(**P), s)
    pid0 = _set_pid(tmp_path)
    m1 = _job(model, rd, 1, TrainParams(**P), s)
    e0, e1 = m0["verl"]["engine_set"], m1["verl"]["engine_set"]
    assert (e0["memory_gb"], e0["memory_growth_gb"]) == (1.0, 0.0)
    assert (e1["memory_gb"], e1["memory_growth_gb"], e1["warm"]) == (1.5, 0.5, True)
    # what the warm job's reset freed reaches its metrics.json (a cold job's: none)
    assert e0["reset_release"] is None and [r["role"] for r in e1["reset_release"]] == ["ref", "actor"]
    assert "engine set retires" in (tmp_path / ".verl-engines" / "slot-0" / "server.log").read_text()
    deadline = time.monotonic() + 30
    while procs.alive(pid0):
        assert time.monotonic() < deadline, "the retired set did not stop"
        time.sleep(0.1)
    m2 = _job(model, tmp_path / "round_002" / "clients", 0, TrainParams(**P), s)
    e2 = m2["verl"]["engine_set"]
    assert e2["warm"] is False and e2["set"] != e0["set"] and e2["memory_growth_gb"] == 0.0
    assert _set_pid(tmp_path) != pid0


@pytest.mark.slow
def test_in_real_ray_each_jobs_forwarded_lines_reach_its_log_range(fake_engines, tmp_path, monkeypatch):
    """The request loop in a Ray actor and the reset lines from another, on a real local Ray cluster (CPU):
    every line reaches the set's log only through Ray's forwarding. A cold and a warm job commit (the warm
    job's reset lines for its own start model were in its log range: the backend checks them), the lines
    came through Ray (its actor prefixes), and stopping the set leaves no process of it."""
    from fedagent.train.verl.engines.stop import stop_sets_under

    monkeypatch.setenv("FAKE_VERL_ENGINES_RAY", "1")
    model = build_tiny_model(tmp_path / "m", seed=1)
    rd = tmp_path / "round_001" / "clients"
    m0 = _job(model, rd, 0, TrainParams(**P), SETTINGS)
    m1 = _job(model, rd, 1, TrainParams(**P), SETTINGS)
    assert (m0["verl"]["engine_set"]["warm"], m1["verl"]["engine_set"]["warm"]) == (False, True)
    assert m1["engine_steps_match"] is True and m1["timings_s"]["refit_to_first_generation"] > 0
    log = (tmp_path / ".verl-engines" / "slot-0" / "server.log").read_text()
    assert "(TaskRunner pid=" in log and "(WorkerDict pid=" in log
    assert f"{refit.RESET_LINE}{model.resolve()}" in log
    pid = _set_pid(tmp_path)
    stop_sets_under(tmp_path)
    assert not procs.alive(pid)
    assert not list((tmp_path / ".verl-engines" / "slot-0").glob("*.sock"))


def test_a_warm_job_reset_from_a_foreign_dir_leaves_no_update(fake_engines, tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / "m", seed=1)
    rd = tmp_path / "round_001" / "clients"
    _job(model, rd, 0, TrainParams(**P), SETTINGS)
    (fake_engines / "reset_from").write_text(str(tmp_path / "elsewhere"))
    with pytest.raises(RuntimeError, match="not only from"):
        _job(model, rd, 1, TrainParams(**P), SETTINGS)
    assert sorted(p.name for p in rd.iterdir()) == ["0"]


def _killable_job(model, rd, client_, q):
    try:
        _job(model, rd, client_, TrainParams(**P), SETTINGS)
        q.put("done")
    except Exception as exc:  # noqa: BLE001
        q.put(repr(exc))


def test_a_job_killed_mid_fit_stops_its_set_and_the_rerun_commits(fake_engines, tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / "m", seed=1)
    rd = tmp_path / "round_001" / "clients"
    monkeypatch.setenv("FAKE_VERL_HOLD_S", "60")
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_killable_job, args=(model, rd, 0, q))
    proc.start()
    deadline = time.monotonic() + 120
    while not list(fake_engines.glob("job-*.json")):  # the fit has begun (its episodes are played)
        assert time.monotonic() < deadline and proc.is_alive()
        time.sleep(0.2)
    pid = _set_pid(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    deadline = time.monotonic() + 30
    while procs.alive(pid):  # the set's watchdog saw the connection close
        assert time.monotonic() < deadline, "the set outlived its killed job"
        time.sleep(0.2)
    assert not (rd / "0").exists()
    log = (tmp_path / ".verl-engines" / "slot-0" / "server.log").read_text()
    assert "connection closed mid-fit" in log
    left = json.loads((rd / ".verl-0" / leftovers.LEFTOVERS).read_text())  # what the SIGKILL left
    assert Path(left["ray_tmp"]).is_dir()
    monkeypatch.setenv("FAKE_VERL_HOLD_S", "0")
    m = _job(model, rd, 0, TrainParams(**P), SETTINGS)
    assert m["verl"]["engine_set"]["warm"] is False and (rd / "0" / "metrics.json").is_file()
    assert not Path(left["ray_tmp"]).exists()  # the rerun removed it


def test_two_jobs_at_once_take_two_slots(tmp_path):
    seen = []
    with client.slot(tmp_path, 2, 1) as a:
        with client.slot(tmp_path, 2, 1) as b:
            seen = [a.name, b.name]
    assert seen == ["slot-1", "slot-0"]


def test_the_key_holds_the_agent_loop_entry_but_not_its_job_file(tmp_path):
    """verl reads the agent-loop YAML once per worker: its turns, budgets and format are the set's for good,
    so they are part of the key (the job file, rewritten per job, is not)."""
    ov = _overrides(tmp_path)
    entry = {"name": "fedagent_windowed", "max_turns": 3, "answer_format": "think_action", "job_file": "/a/job.json"}
    k = keys.engine_key(ov, entry)
    assert keys.engine_key(ov, {**entry, "job_file": "/b/job.json"}) == k
    assert keys.engine_key(ov, {**entry, "max_turns": 4}) != k and keys.engine_key(ov) != k


class _Recorder:
    def __init__(self, memory=()):
        self.resets = []
        self.memory = list(memory)  # memory_gb after each fit (None: not measurable, as on a CPU)

    def built_for(self, job):
        return True  # the paths match: only the nonce tells the starting job apart

    def fit(self, job, *, reset):
        self.resets.append(reset)
        return []

    def memory_gb(self):
        return self.memory[len(self.resets) - 1] if self.memory else None


def _serve_in_thread(tmp_path, fitter, **kw):
    import threading

    sock = client.socket_path(tmp_path)
    log = tmp_path / "server.log"
    log.write_text("")
    out = {}
    t = threading.Thread(
        target=lambda: out.setdefault(
            "why",
            serve.serve(
                sock,
                fitter=fitter,
                log=log,
                job_file=tmp_path / "job.json",
                stop=lambda: None,
                settle_s=0,
                forward_limit_s=5,
                say=lambda line: log.open("a").write(line + "\n"),
                **{"key": "k1", "idle_s": 30, **kw},
            ),
        )
    )
    t.start()
    deadline = time.monotonic() + 10
    while not sock.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return sock, t, out


def _ask(sock, **req):
    import socket

    with socket.socket(socket.AF_UNIX) as c:
        c.connect(str(sock))
        serve.send(c, {k: None for k in serve.REQUEST_KEYS} | {"engine_key": "k1", "tag": "t", "job_file": {}} | req)
        return serve.recv(c)


@pytest.mark.parametrize(
    "first_nonce, resets",
    [
        ("n1", [False, True]),  # the starting job: as built
        (None, [True, True]),  # another job got there first
        ("n2", [True, True]),
    ],
)
def test_only_the_starting_jobs_nonce_skips_the_reset(tmp_path, first_nonce, resets):
    f = _Recorder()
    sock, t, out = _serve_in_thread(tmp_path, f, nonce="n1")
    assert _ask(sock, **({"nonce": first_nonce} if first_nonce else {}))["ok"]
    assert _ask(sock, nonce="n1")["warm"] is True  # a set's second job is always reset
    assert "restart" in _ask(sock, engine_key="k2")
    t.join(10)
    assert f.resets == resets and out["why"] == "restart"


def test_a_set_whose_memory_grows_past_its_limit_answers_the_job_then_stops(tmp_path):
    """On the H200 each warm job left ≈ 0.5 GB per trained engine allocated (docs/results/verl.md): a set
    compares its workers' memory after each job with that after its first, answers the job that crossed
    ``max_growth_gb`` (its update is sound) and then stops, so the next job starts a fresh set."""
    f = _Recorder(memory=[1.0, 1.5, 2.5])
    sock, t, out = _serve_in_thread(tmp_path, f, nonce="n1", max_growth_gb=1.0)
    answers = [_ask(sock, nonce="n1") for _ in range(3)]
    assert [a["ok"] for a in answers] == [True, True, True]
    assert [a["memory_gb"] for a in answers] == [1.0, 1.5, 2.5]
    assert [a["memory_growth_gb"] for a in answers] == [0.0, 0.5, 1.5]
    t.join(10)
    assert out["why"] == "memory" and not sock.exists()
    assert (
        "fedagent: engine set retires: its training workers hold 1.50 GB more" in (tmp_path / "server.log").read_text()
    )


def test_without_a_memory_reading_a_set_never_retires_for_memory(tmp_path):
    sock, t, out = _serve_in_thread(tmp_path, _Recorder(), nonce="n1", max_growth_gb=0.001, idle_s=1)
    assert [_ask(sock, nonce="n1")["memory_growth_gb"] for _ in range(3)] == [None, None, None]
    t.join(10)
    assert out["why"] == "idle"


def test_a_failing_memory_reading_never_fails_the_job(tmp_path):
    """The reading comes after the job's fit (sound): if the workers cannot answer it, the job still gets
    its answer, without a reading, and the log says why."""

    class Broken(_Recorder):
        def memory_gb(self):
            raise RuntimeError("worker group gone")

    sock, t, out = _serve_in_thread(tmp_path, Broken(), nonce="n1", max_growth_gb=1.0, idle_s=1)
    a = _ask(sock, nonce="n1")
    assert a["ok"] and a["memory_gb"] is None
    t.join(10)
    assert out["why"] == "idle" and "worker group gone" in (tmp_path / "server.log").read_text()


def test_a_sets_socket_appears_only_once_it_listens(tmp_path, monkeypatch):
    """A job that finds the socket's path can connect: with a slow ``listen`` (a loaded machine; seen as a
    ConnectionRefusedError in this file's tests) the path must not exist before it."""
    import socket

    class SlowListen(socket.socket):
        def listen(self, *a):
            time.sleep(0.5)
            return super().listen(*a)

    monkeypatch.setattr(serve.socket, "socket", SlowListen)
    sock, t, out = _serve_in_thread(tmp_path, _Recorder(), nonce="n1", idle_s=1)
    assert _ask(sock, nonce="n1")["ok"]
    t.join(10)


def test_an_idle_set_unlinks_its_socket_and_stops(tmp_path):
    sock, t, out = _serve_in_thread(tmp_path, _Recorder(), nonce="n1", idle_s=0.3)
    t.join(10)
    assert out["why"] == "idle" and not sock.exists()


def test_stop_set_never_signals_a_reused_pid(tmp_path):
    """server.json names the set by pid and start time: a live process with that pid but another start
    time is not the set (the pid was reused) and is left alone."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        (tmp_path / "server.json").write_text(json.dumps({"pid": proc.pid, "start": "1"}))
        client.stop_set(tmp_path, grace_s=1)
        assert proc.poll() is None
        (tmp_path / "server.json").write_text(json.dumps({"pid": proc.pid, "start": procs.proc_start(proc.pid)}))
        client.socket_path(tmp_path).write_text("")  # a killed set's socket file, left behind
        client.stop_set(tmp_path, grace_s=5)
        assert proc.wait(5) is not None and not client.socket_path(tmp_path).exists()
    finally:
        proc.kill()


def test_the_job_refuses_engine_sets_beside_the_refit_probe():
    """Planning refuses the pair (a cross rule); so does the verl job reading its train.verl settings."""
    from fedagent.train.cli import verl_settings

    assert verl_settings(json.dumps({"engines": "run"})).engines == "run"
    with pytest.raises(ValueError, match="choose one"):
        verl_settings(json.dumps({"engines": "run", "warm_refit": True}))
    with pytest.raises(ValueError, match="bad train.verl"):
        verl_settings(json.dumps({"engines": "always"}))


def test_snakemakes_end_stops_every_set_under_the_results_dir(tmp_path):
    """The Snakefile's onsuccess/onerror: every slot's set below the results dir (a matrix's runs too)."""
    from fedagent.train.verl.engines.stop import stop_sets_under

    sets = []
    for run in ("a", "matrix/b/seed1"):
        d = tmp_path / run / ".verl-engines" / "slot-0"
        d.mkdir(parents=True)
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        (d / "server.json").write_text(json.dumps({"pid": p.pid, "start": procs.proc_start(p.pid)}))
        sets.append(p)
    try:
        assert len(stop_sets_under(tmp_path)) == 2
        assert all(p.wait(5) is not None for p in sets)
        assert stop_sets_under(tmp_path / "nothing-here") == []
    finally:
        for p in sets:
            p.kill()


def test_two_rounds_through_snakemake_on_one_engine_set_verify_and_the_set_stops(fake_engines, tmp_path, monkeypatch):
    """train.verl.engines: run end to end (fake set): round 1's first job starts the set, every later job
    (round 1's other client, round 2's two) is served warm by it; every round's `fedagent verify` passes
    (the updates are the jobs' own start models + 1/1024, exactly), and Snakemake's end stops the set."""
    from safetensors.torch import load_file
    from workflow_helpers import RUN, make_workdir, run_snakemake

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    work = make_workdir(tmp_path / "w")
    (work / "verl.yaml").write_text(
        "rounds: 2\ntrain: {backend: verl, ref_anchor: round, verl: {gpus: 1, "
        "engines: run, engine_sets: 1, engines_idle_s: 120}}\n"
    )
    run_snakemake(work, "--configfile", "verl.yaml")
    runs = work / RUN
    warm = {}
    for r in (1, 2):
        rd = runs / f"round_{r:03d}"
        for c in ("0", "1"):
            m = json.loads((rd / "clients" / c / "metrics.json").read_text())
            warm[(r, c)] = m["verl"]["engine_set"]["warm"]
            start = load_file(runs / f"round_{r - 1:03d}" / "model" / "model.safetensors")
            got = load_file(rd / "clients" / c / "model.safetensors")
            assert all(bool((got[k] == start[k] + 2.0**-10).all()) for k in start)  # its own start model's
        prev = runs / f"round_{r - 1:03d}" / "model"
        state = ["--prev-server-state", str(prev)] if r > 1 else []
        v = subprocess.run(
            [
                sys.executable,
                "-m",
                "fedagent.cli",
                "verify",
                "--prev",
                str(prev),
                "--clients",
                str(rd / "clients" / "0"),
                str(rd / "clients" / "1"),
                "--aggregate",
                str(rd / "aggregate"),
                "--model",
                str(rd / "model"),
                *state,
            ],
            capture_output=True,
            text=True,
            cwd=work,
        )
        assert v.returncode == 0, v.stdout + v.stderr
    assert sorted(warm.values()) == [False, True, True, True]
    sets = {json.loads(p.read_text())["set_pid"] for p in fake_engines.glob("job-*.json")}
    assert len(sets) == 1 and not procs.alive(sets.pop())  # one set served all four; it is gone


def test_jobs_one_after_another_reuse_the_live_set_of_their_key_whatever_their_slot(tmp_path):
    """Clients 0 and 1 prefer slots 0 and 1; run one after another, the second still takes the free slot
    whose live set has its key (one warm set, not one cold set per slot); another key takes its own slot."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        (tmp_path / "slot-0").mkdir()
        client.record_set(tmp_path / "slot-0", live.pid, tag="t", ray_tmp="", key="K")
        with client.slot(tmp_path, 2, 1, "K") as d:
            assert d.name == "slot-0"
        with client.slot(tmp_path, 2, 1, "other") as d:
            assert d.name == "slot-1"
        with client.slot(tmp_path, 2, 1, "K") as a, client.slot(tmp_path, 2, 1, "K") as b:
            assert (a.name, b.name) == ("slot-0", "slot-1")  # busy: the next free one
    finally:
        live.kill()


def test_snakemakes_end_leaves_a_busy_slots_set_alone(tmp_path):
    """A set serving a job (its slot locked: maybe another Snakemake's) is not stopped by a run's end."""
    import fcntl

    from fedagent.train.verl.engines.stop import stop_sets_under

    d = tmp_path / "run" / ".verl-engines" / "slot-0"
    d.mkdir(parents=True)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        client.record_set(d, p.pid, tag="t", ray_tmp="", key="K")
        with open(d / "lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            assert stop_sets_under(tmp_path) == [] and p.poll() is None
        assert stop_sets_under(tmp_path) == [d] and p.wait(5) is not None
    finally:
        p.kill()


def test_returned_steps_that_disagree_with_the_log_leave_no_update(fake_engines, tmp_path):
    model = build_tiny_model(tmp_path / "m", seed=1)
    rd = tmp_path / "round_001" / "clients"
    (fake_engines / "steps_off").write_text("1")
    with pytest.raises(RuntimeError, match="disagree"):
        _job(model, rd, 0, TrainParams(**P), SETTINGS)
    assert not rd.exists() or list(rd.iterdir()) == []


def test_a_set_that_dies_under_a_later_job_is_replaced_and_the_job_commits(fake_engines, tmp_path):
    """A job that found a live set (not its starter) and lost it before an answer — the set was stopping, or
    crashed — stops what is left, clears what it may have begun, and runs on a new set once."""
    model = build_tiny_model(tmp_path / "m", seed=1)
    rd = tmp_path / "round_001" / "clients"
    _job(model, rd, 0, TrainParams(**P), SETTINGS)
    first = _set_pid(tmp_path)
    (fake_engines / "die_once").write_text("1")
    m = _job(model, rd, 1, TrainParams(**P), SETTINGS)
    assert _set_pid(tmp_path) != first and m["verl"]["engine_set"]["warm"] is False
    assert m["num_episodes"] == P["groups_per_epoch"] * P["group_size"]


def test_the_sets_and_the_probes_main_prepare_verls_config_as_verls_main_does(tmp_path):
    """refit.prepare_verl_config (both entry points' first step): verl's own validate_config passes on the
    set's composed overrides, and a config without verl's v1 trainer is refused before any engine starts."""
    from verl_helpers import compose_ppo

    from fedagent.train.verl.refit import prepare_verl_config

    d = tmp_path / "slot-0"
    d.mkdir()
    ov = client.set_overrides(
        _overrides(tmp_path), d, ray_tmp=Path("/tmp/fa-ray-set"), tag="t", idle_s=30, key="k", nonce="n"
    )
    prepare_verl_config(compose_ppo(ov), "train.verl.engines: run")
    with pytest.raises(ValueError, match="engines: run needs verl's v1 trainer"):
        prepare_verl_config(compose_ppo(ov + ["trainer.use_v1=False"]), "train.verl.engines: run")
