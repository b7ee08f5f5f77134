"""Two verl jobs on one machine at once never collide (ports, Ray temp dirs, sockets).

Both jobs run the real launcher (fedagent.train.verl.backend) with a fake trainer
(tests/fake_verl_trainer.py) that binds what verl/Ray/vLLM bind and holds it while the other
job runs; each job has its own env service, as train_client jobs do. Afterwards nothing of
either job is left: work dirs, Ray temp dirs, IPC sockets, child processes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from env_fixtures import FakeTaskSource, serve_in_thread, short_tmp
from fake_env import build_tiny_model
from fake_verl_trainer import FAKE_STEP_VALUES
import torch
from safetensors.torch import load_file

from fedagent.core.atomic import verify_manifest
from fedagent.envs.service import build_app
from fedagent.train.local import TrainParams
from fedagent.train.verl.backend import train_client_verl
from fedagent.core.procs import alive as _alive  # one /proc reading for the verl tests and the sets
from fedagent.train.verl.settings import VerlSettings
from fedagent.train.verl.leftovers import IPC_SOCKET_GLOB

TESTS = Path(__file__).resolve().parent
HOLD_S = 3.0


@pytest.fixture
def fake_trainer(monkeypatch, tmp_path):
    rec = tmp_path / "records"
    rec.mkdir()
    monkeypatch.setenv("FEDAGENT_VERL_TRAINER", "fake_verl_trainer")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_VERL_RECORD", str(rec))
    monkeypatch.setenv("FAKE_VERL_HOLD_S", str(HOLD_S))
    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")  # someone else's cluster: must not leak in
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # the job's allocation: passed through as is
    # Runs through Snakemake stand for a node with these two cards (no nvidia-smi here): the run's GPU
    # check and each job's placement read them (fedagent.core.placement).
    monkeypatch.setenv("FEDAGENT_GPUS", "3:81559,5:81559")
    return rec


def _job(model, round_dir, client, p=None, settings=None):
    """One train_client job's verl part, in its own process (as Snakemake runs jobs)."""
    p = p or TrainParams(groups_per_epoch=2, group_size=2, max_turns=1, pool_size=4, mini_batch_size=2)
    sock_dir = short_tmp()
    app = build_app(
        FakeTaskSource(n=6), "train", [f"fake-{i:03d}" for i in range(6)], mode="draw", pool_size=4, max_turns=1
    )
    with serve_in_thread(app, sock_dir / "env.sock") as uds:
        return train_client_verl(
            model,
            model,
            {"uds": str(uds)},
            round=1,
            client=client,
            params=p,
            settings=settings or VerlSettings(gpus=2),
            out_dir=round_dir / str(client),
        )


def _run_jobs(model, round_dir, clients, p=None, settings=None):
    """Start every job at once, each in a fresh process; {client: metrics or exception}."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(len(clients), mp_context=multiprocessing.get_context("spawn")) as pool:
        futs = {c: pool.submit(_job, model, round_dir, c, p, settings) for c in clients}
        out = {}
        for c, f in futs.items():
            try:
                out[c] = f.result(300)
            except Exception as exc:  # noqa: BLE001 - inspected by the tests
                out[c] = exc
    return out


@pytest.mark.slow
def test_two_jobs_at_once_share_nothing_and_leave_nothing(fake_trainer, tmp_path):
    model = build_tiny_model(tmp_path / "m")
    round_dir = tmp_path / "round_001" / "clients"
    round_dir.mkdir(parents=True)
    results = _run_jobs(model, round_dir, (0, 1))
    assert not [r for r in results.values() if isinstance(r, Exception)], results
    recs = [json.loads(p.read_text()) for p in sorted(fake_trainer.iterdir())]
    assert len(recs) == 2
    a, b = recs
    assert abs(a["t"] - b["t"]) < HOLD_S  # both held their resources at once
    assert a["tag"] != b["tag"] and a["ray_tmp"] != b["ray_tmp"] and a["ipc"] != b["ipc"]
    assert a["tcp_port"] != b["tcp_port"]
    for r in recs:
        assert r["tag"] in r["ipc"] and "01000000-" + r["tag"] in r["ipc"]  # salted, not verl's bare id
        assert len(r["raylet"]) < 107
        assert r["ray_address"] is None and r["cuda_visible_devices"] == "3,5"
        assert Path(r["tmpdir"]).is_relative_to(r["ray_tmp"]) and len(r["tmpdir"]) <= 40  # private, short
        assert not any("port" in o.split("=")[0] for o in r["argv"])  # no fixed port anywhere
        assert "trainer.n_gpus_per_node=2" in r["argv"]
        # Nothing left behind.
        assert not Path(r["workdir"]).exists() and not Path(r["ray_tmp"]).exists()
        assert not Path(r["ipc"]).exists() and not list(Path("/tmp").glob(IPC_SOCKET_GLOB.format(tag=r["tag"])[5:]))
        assert not _alive(r["child"]) and not _alive(r["pid"])
    start = load_file(model / "model.safetensors")
    for c in (0, 1):
        out = round_dir / str(c)
        verify_manifest(out)
        got = load_file(out / "model.safetensors")
        assert all(torch_equal(got[k], start[k] + 2.0**-10) for k in start)
        m = json.loads((out / "metrics.json").read_text())
        assert m["backend"] == "verl" and m["num_samples"] == 4 and m["num_episodes"] == 4
        assert m["verl"]["world_size"] == 1 and results[c]["num_samples"] == 4
        # verl's own step values, not constants (seen failing with the old "kl": 0.0, "steps": [])
        n = len(m["steps"])
        assert n == m["params"]["epochs"] and [s["step"] for s in m["steps"]] == list(range(1, n + 1))
        mean_k = (n + 1) / 2
        assert m["kl"] == pytest.approx(FAKE_STEP_VALUES["actor/kl_loss"] * mean_k)
        assert m["entropy"] == pytest.approx(FAKE_STEP_VALUES["actor/entropy"] * mean_k)
        assert m["clipfrac"] == pytest.approx(FAKE_STEP_VALUES["actor/pg_clipfrac"] * mean_k)
        assert m["steps"][0] == {
            "step": 1,
            "pg": -0.01,
            "kl": 0.003,
            "entropy": 1.25,
            "clipfrac": 0.02,
            "grad_norm": 0.5,
            "reward_mean": 0.25,
        }
        assert len((out / "samples.jsonl").read_text().splitlines()) == 4
    assert sorted(p.name for p in round_dir.iterdir()) == ["0", "1"]


def torch_equal(a, b):
    import torch

    return a.dtype == torch.float32 and torch.equal(a, b)


def _one_job(tmp_path, monkeypatch, **env):
    """Client 0's job alone with the fake trainer's knobs ``env``: (its result or exception, the round dir)."""
    for k, v in {"FAKE_VERL_HOLD_S": "0", **env}.items():
        monkeypatch.setenv(k, v)
    model = build_tiny_model(tmp_path / "m")
    round_dir = tmp_path / "clients"
    round_dir.mkdir()
    return _run_jobs(model, round_dir, (0,))[0], round_dir


@pytest.mark.slow
def test_a_failed_trainer_leaves_no_output_and_no_processes(fake_trainer, tmp_path, monkeypatch):
    err, round_dir = _one_job(tmp_path, monkeypatch, FAKE_VERL_FAIL="1")
    assert isinstance(err, RuntimeError) and "exited with code 3" in str(err)
    (r,) = [json.loads(p.read_text()) for p in fake_trainer.iterdir()]
    assert not (round_dir / "0").exists() and list(round_dir.iterdir()) == []
    assert not Path(r["ray_tmp"]).exists() and not Path(r["ipc"]).exists()
    time.sleep(0.2)
    assert not _alive(r["child"])


def test_a_job_whose_turns_were_not_sampled_with_their_own_seeds_leaves_no_update(fake_trainer, tmp_path, monkeypatch):
    """Every recorded turn must carry its own request seed: turns sampled with one engine-wide seed (a
    run-scoped set's first job's) are refused, and nothing reaches the final path."""
    err, round_dir = _one_job(tmp_path, monkeypatch, FAKE_VERL_ENGINE_SEED="1234")
    assert isinstance(err, RuntimeError) and "sampled with seed 1234, not its own" in str(err)
    assert not (round_dir / "0").exists()


@pytest.mark.slow
def test_a_corrupt_start_model_is_caught_beside_the_trainer_and_leaves_no_update(fake_trainer, tmp_path, monkeypatch):
    """The start model's files are hashed while verl runs (not before its launch): a file whose bytes
    differ from its manifest (same size) lets the trainer start, and the job then refuses to commit."""
    from fedagent.core.atomic import ManifestError

    monkeypatch.setenv("FAKE_VERL_HOLD_S", "0")
    model = build_tiny_model(tmp_path / "m")
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # one byte of the last tensor: the size is unchanged
    weights.write_bytes(bytes(data))
    round_dir = tmp_path / "clients"
    round_dir.mkdir()
    err = _run_jobs(model, round_dir, (0,))[0]
    assert isinstance(err, ManifestError) and "model.safetensors: sha256 differs from manifest" in str(err)
    assert len(list(fake_trainer.iterdir())) == 1  # the trainer ran beside the hashing
    assert not (round_dir / "0").exists()  # and no update reached its final path
    assert [q.name for q in round_dir.iterdir()] in ([], ["_failed"])  # (a staging kept for inspection)


@pytest.mark.workflow
@pytest.mark.slow
def test_a_verl_round_through_snakemake_aggregates_merges_and_verifies(fake_trainer, tmp_path, monkeypatch):
    """train.backend=verl end to end with the fake trainer: the updates go through the same
    aggregate/merge/eval as local ones, and `fedagent verify` passes on the round."""
    import subprocess
    import sys

    from workflow_helpers import RUN, executed_jobs, make_workdir, run_snakemake

    monkeypatch.setenv("FAKE_VERL_HOLD_S", "0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    work = make_workdir(tmp_path / "w")
    (work / "verl.yaml").write_text("rounds: 1\ntrain: {backend: verl, ref_anchor: round, verl: {gpus: 1}}\n")
    proc = run_snakemake(work, "--configfile", "verl.yaml")
    jobs = {r for r, _ in executed_jobs(proc)}
    assert {"train_client", "aggregate", "merge", "eval"} <= jobs
    rd = work / RUN / "round_001"
    for c in ("0", "1"):
        m = json.loads((rd / "clients" / c / "metrics.json").read_text())
        assert m["backend"] == "verl" and m["num_samples"] > 0
    start = load_file(work / RUN / "round_000" / "model" / "model.safetensors")
    got = load_file(rd / "clients" / "0" / "model.safetensors")
    assert all(torch_equal(got[k], start[k] + 2.0**-10) for k in start)  # the trainer's weights, exactly
    r0 = work / RUN / "round_000"
    v = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedagent.cli",
            "verify",
            "--prev",
            str(r0 / "model"),
            "--clients",
            str(rd / "clients" / "0"),
            str(rd / "clients" / "1"),
            "--aggregate",
            str(rd / "aggregate"),
            "--model",
            str(rd / "model"),
        ],
        capture_output=True,
        text=True,
        cwd=work,
    )
    assert v.returncode == 0, v.stdout + v.stderr
    assert not list((rd / "clients").glob(".verl-*")) and not list((rd / "clients").glob(".env-*"))


@pytest.mark.slow
def test_two_real_ray_clusters_from_our_launch_are_apart(tmp_path, monkeypatch):
    """Real Ray 2.60 on CPU, started exactly as verl's run_ppo does from two of our launches at
    once: separate temp dirs and GCS addresses, and verl's view of the job id carries each
    job's tag inside the workers (the bare ids are both 01000000)."""
    import subprocess
    import sys

    from fedagent.train.verl.launch import isolated_job, job_environ
    from fedagent.train.verl.overrides import build_overrides

    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    procs, jobs = [], []
    with (
        isolated_job(tmp_path / "a" / ".verl-0", round=1, client=0) as ja,
        isolated_job(tmp_path / "b" / ".verl-1", round=1, client=1) as jb,
    ):
        for j in (ja, jb):
            ov = build_overrides(
                TrainParams(),
                VerlSettings(),
                job=j,
                model_dir=tmp_path / "m",
                rows=tmp_path / "r",
                agent_loop_yaml=tmp_path / "a.yaml",
                rollout_seed=0,
            )
            (j.workdir / "ov.json").write_text(json.dumps(ov))
            env = job_environ(j)
            env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(TESTS / "verl_ray_probe.py"),
                        str(j.workdir / "ov.json"),
                        str(j.workdir / "probe.json"),
                    ],
                    env=env,
                    cwd=j.workdir,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
            jobs.append(j)
        outs = []
        for p, j in zip(procs, jobs):
            log, _ = p.communicate(timeout=240)
            assert p.returncode == 0, log[-3000:]
            outs.append(json.loads((j.workdir / "probe.json").read_text()))
        a, b = outs
        assert a["plain"] == b["plain"] == "01000000"  # why salting is needed
        assert a["salted"] == f"01000000-{ja.tag}" and b["salted"] == f"01000000-{jb.tag}"
        assert a["session_dir"].startswith(str(ja.ray_tmp)) and b["session_dir"].startswith(str(jb.ray_tmp))
        assert a["gcs"] != b["gcs"]
    assert not ja.ray_tmp.exists() and not jb.ray_tmp.exists()


@pytest.mark.slow
def test_a_port_collision_is_relaunched_once_and_steps_are_kept(fake_trainer, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VERL_HOLD_S", "0")
    monkeypatch.setenv("FAKE_VERL_PORTFAIL_ONCE", str(tmp_path / "lost-once"))
    model = build_tiny_model(tmp_path / "m")
    round_dir = tmp_path / "clients"
    round_dir.mkdir()
    m = _run_jobs(model, round_dir, (0,))[0]
    assert not isinstance(m, Exception), m
    assert m["trainer_attempts"] == 2 and m["num_samples"] == 4  # the relaunch's episodes only
    assert m["verl_steps"] == [
        {
            "step": 1,
            "timing_s/gen": 2.5,
            "timing_s/old_log_prob": 0.25,
            "timing_s/ref": 0.5,
            "timing_s/update_actor": 1.0,
            "perf/throughput": 1234.5,
            **FAKE_STEP_VALUES,
        }
    ]
    t = m["timings_s"]
    assert (
        0
        <= t["launch_to_ray_started"]
        <= t["launch_to_first_generation"]
        <= t["launch_to_first_step_logged"]
        <= t["trainer"]
    )
    assert (
        t["launch_to_ray_started"]
        <= t["launch_to_runner_ready"]
        <= t["launch_to_engines_initialized"]
        <= t["launch_to_rollout_server_up"]
        <= t["launch_to_ready_to_fit"]
        <= t["launch_to_first_generation"]
    )
    # The local backend's timings block, which the round's timings.csv sums: process start → first
    # token is the cold start; verl's gen is the rollout phase, its log-prob/ref/update timings training.
    tm = m["timings"]
    assert tm["phases"] == {"rollout": 2.5, "train": 1.75}
    mk = tm["marks"]
    assert 0 < mk["trainer_launch"] < mk["ray_started"] < mk["ready_to_fit"] <= mk["first_token"] < mk["saved"]
    assert tm["cold_start_s"] == mk["first_token"] and tm["total_s"] >= mk["saved"]
    assert not any(
        "t_first_generation" in json.loads(line)
        for line in (round_dir / "0" / "samples.jsonl").read_text().splitlines()
    )


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.workflow
@pytest.mark.slow
def test_a_killed_verl_job_leaves_no_final_path_and_the_rerun_redoes_only_it(fake_trainer, tmp_path, monkeypatch):
    """SIGKILL of Snakemake and everything under it (a crashed node) while the second client's verl job
    is mid-run (its fake trainer holding, as Ray's processes would): that client's update is absent,
    the first's is intact, and the documented recovery (the same command, `--unlock` first if asked)
    trains only the killed client. Seen failing with the update directory made at the job's start
    (out_dir.mkdir() before the trainer: the crash left clients/<c> behind)."""
    import signal
    import subprocess

    from workflow_helpers import RUN, make_workdir, run_snakemake, snakemake_cmd, snakemake_env

    monkeypatch.setenv("FAKE_VERL_HOLD_S", "120")  # the killed attempt would hold well past the rerun
    monkeypatch.setenv("FAKE_VERL_HOLD_ONLY_LATER", "1")  # the first client's job finishes at once
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    work = make_workdir(tmp_path / "w")
    (work / "verl.yaml").write_text("rounds: 1\ntrain: {backend: verl, ref_anchor: round, verl: {gpus: 1}}\n")
    clients = work / RUN / "round_001" / "clients"
    # The plan and round 0 first, warm (the kill comes in round 1's training; cold, each of their jobs
    # would pay its imports for nothing the test looks at).
    run_snakemake(work, "--configfile", "verl.yaml", "--omit-from", "train_client")
    assert (work / RUN / "round_000" / "eval.json").is_file() and not clients.exists()
    # cold jobs: the kill aims at the train job's own process tree under Snakemake
    proc = subprocess.Popen(
        snakemake_cmd("--configfile", "verl.yaml"),
        cwd=work,
        env=snakemake_env(warm=False),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    victim, orphans, deadline = None, [], time.time() + 600
    try:
        # train jobs run one at a time (the test config's threads = cores): kill once one update is
        # complete and the other client's trainer is running
        while victim is None and time.time() < deadline and proc.poll() is None:
            done = [c for c in ("0", "1") if (clients / c / "manifest.json").is_file()]
            for rec in sorted(fake_trainer.glob("*.json")):
                r = json.loads(rec.read_text())
                if len(done) == 1 and _alive(r["pid"]):
                    argv = Path(f"/proc/{_ppid(r['pid'])}/cmdline").read_bytes().split(b"\0")
                    client = argv[argv.index(b"--client") + 1].decode()
                    if client not in done:
                        os.killpg(proc.pid, signal.SIGKILL)
                        victim, orphans = client, [r["pid"], r["child"]]
                        break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        time.sleep(0.5)
    try:
        _rerun_after_the_kill(work, clients, victim, orphans, fake_trainer, monkeypatch)
    finally:
        for pid in orphans:  # never left running by the test, whatever failed
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _rerun_after_the_kill(work, clients, victim, orphans, fake_trainer, monkeypatch):
    from workflow_helpers import RUN, executed_jobs, run_snakemake

    assert victim is not None, "no moment with one update done and the other client's verl job running"
    # the killed attempt's trainer runs on in its own session (as Ray and vLLM would, holding the GPU)
    assert all(_alive(pid) for pid in orphans), orphans
    assert not (clients / victim).exists()
    (survivor,) = {"0", "1"} - {victim}
    verify_manifest(clients / survivor)
    monkeypatch.setenv("FAKE_VERL_HOLD_S", "0")  # the recovery's job need not hold
    again = run_snakemake(work, "--configfile", "verl.yaml", check=False, warm=False)
    if again.returncode != 0 and "unlock" in (again.stdout + again.stderr).lower():
        run_snakemake(work, "--configfile", "verl.yaml", "--unlock", warm=False)
        again = run_snakemake(work, "--configfile", "verl.yaml", warm=False)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    trained = [w for rule, w in executed_jobs(again) if rule == "train_client"]
    assert len(trained) == 1 and f"client={victim}" in trained[0], trained
    verify_manifest(clients / victim)
    # the rerun stopped the killed attempt's trainer group, and removed its Ray temp dir (outside its work
    # dir: the path is long)
    assert not [pid for pid in orphans if _alive(pid)], orphans
    killed = [json.loads(p.read_text()) for p in fake_trainer.glob("*.json")]
    assert killed and all(not Path(r["ray_tmp"]).exists() for r in killed), [r["ray_tmp"] for r in killed]
    assert (work / RUN / "round_001" / "summary.csv").is_file()


PPO = dict(algorithm="ppo", groups_per_epoch=2, group_size=1, max_turns=1, pool_size=4, mini_batch_size=2)


def _ppo_model(path):
    from argparse import Namespace

    from fedagent.model.base_model_tiny import write_tiny_model

    return write_tiny_model(path, 1, critic_args=Namespace(critic=True, critic_seed=2, critic_path=None))


@pytest.mark.slow
def test_a_ppo_job_trains_gae_with_the_rounds_critic_and_federates_it(fake_trainer, tmp_path, monkeypatch):
    """train.algorithm: ppo on the verl backend: GAE with <start model>/critic, the critic's fp32 masters
    converted into the update's critic/ (recorded by digest), verl's critic values in metrics.json, and
    the server averages and merges the critic like the actor's."""
    from fedagent.model.critic_dir import CRITIC_RECORD, critic_digests
    from fedagent.server.aggregate import aggregate
    from fedagent.server.merge import merge
    from fedagent.server.optimizers import make_optimizer

    monkeypatch.setenv("FAKE_VERL_HOLD_S", "0")
    model = _ppo_model(tmp_path / "m")
    round_dir = tmp_path / "round_001" / "clients"
    round_dir.mkdir(parents=True)
    results = _run_jobs(model, round_dir, (0, 1), TrainParams(**PPO))
    assert not [r for r in results.values() if isinstance(r, Exception)], results
    start = load_file(model / "critic" / "model.safetensors")
    for c in (0, 1):
        out = round_dir / str(c)
        verify_manifest(out)
        got = load_file(out / "critic" / "model.safetensors")
        assert set(got) == set(start) and "score.weight" in got
        assert all(torch_equal(got[k], start[k] + 2.0**-9) for k in start)
        m = json.loads((out / "metrics.json").read_text())
        assert m[CRITIC_RECORD] == critic_digests(out)
        n = len(m["steps"])
        assert m["vf_loss"] == pytest.approx(0.125 * (n + 1) / 2) and m["steps"][0]["vf_loss"] == 0.125
        argv = json.loads(
            next(
                p for p in fake_trainer.iterdir() if json.loads(p.read_text())["workdir"].endswith(f".verl-{c}")
            ).read_text()
        )["argv"]
        assert "algorithm.adv_estimator=gae" in argv and "algorithm.adv_estimator=grpo" not in argv
        assert f"critic.model.path={model / 'critic'}" in argv
    agg = tmp_path / "round_001" / "aggregate"
    aggregate(model, [round_dir / "0", round_dir / "1"], agg)
    merged = tmp_path / "round_001" / "model"
    merge(model, agg, merged, make_optimizer("fedavg"), round_=1)
    verify_manifest(merged)
    new = load_file(merged / "critic" / "model.safetensors")
    assert all(torch.allclose(new[k], start[k] + 2.0**-9, atol=1e-6) for k in start)


@pytest.mark.slow
@pytest.mark.parametrize(
    "env, message",
    [
        # no critic_loss armed line (verl's trainer never imported under the hook): the critic trained verl's own
        # 0.5 × global token-mean loss
        ("FAKE_VERL_SKIP_TRAINER_IMPORT", "legacy_exact"),
        # no critic_attn armed line (the critic loss was armed): verl loaded the critic its own way
        # (flash_attention_2 hard-coded in verl 0.9.1)
        ("FAKE_VERL_NO_CRITIC_ATTN", "critic's loader was not armed"),
    ],
)
def test_a_ppo_job_whose_critic_patches_were_not_armed_leaves_no_update(
    fake_trainer, tmp_path, monkeypatch, env, message
):
    """Fail closed: a PPO job without either armed line in its log errs and writes nothing."""
    monkeypatch.setenv("FAKE_VERL_HOLD_S", "0")
    monkeypatch.setenv(env, "1")
    model = _ppo_model(tmp_path / "m")
    round_dir = tmp_path / "clients"
    round_dir.mkdir()
    err = _run_jobs(model, round_dir, (0,), TrainParams(**PPO))[0]
    assert isinstance(err, RuntimeError) and message in str(err), err
    assert list(round_dir.iterdir()) == []
