"""``train.verl.warm_refit`` (fedagent.train.verl.refit), the probe of run-scoped engines (issue 30).

On CPU: the launch composes through the refit entry point (a misspelled key fails there too); the
worker method lands on verl's own ``ActorRolloutRefWorker`` as a ONE_TO_ALL method beside the KL
reference's patch of the same module; the reset rebuilds reference then actor and puts a fitted
trainer back where a fresh one starts, in verl's order; and a job whose trainer refits (fake trainer)
keeps only the second fit's steps and episodes, times the warm start, and fails closed without the
refit's or the reset's line; verl's own FSDP engines (actor, KL reference) on the CPU come back from
the reset as fresh engines of the new dirs (tests/verl_fsdp_reset.py). The H200 is where the reset
meets vLLM and CUDA memory (docs/results/verl.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is installed by scripts/setup.sh (envs/verl-cpu.txt)")

from fake_verl_trainer import FAKE_STEP_VALUES  # noqa: E402
from test_verl_isolation import _run_jobs, fake_trainer  # noqa: E402,F401 - the fixture is used by name
from test_verl_launch import REPO, workflow_train_params  # noqa: E402

from fake_env import build_tiny_model  # noqa: E402
from fedagent.train.local import TrainParams  # noqa: E402
from fedagent.train.verl import refit, release  # noqa: E402
from fedagent.train.verl.launch import VerlJob, trainer_command  # noqa: E402
from fedagent.train.verl.overrides import build_overrides  # noqa: E402
from fedagent.train.verl.settings import VerlSettings  # noqa: E402


def _overrides(tmp_path, **settings):
    p = workflow_train_params(REPO / "config" / "config.yaml")
    job = VerlJob(tag="fa-r001-c0-1-0123456789abcdef", workdir=tmp_path / "w", ray_tmp=Path("/tmp/fa-ray-x"))
    return build_overrides(
        p,
        VerlSettings(**settings),
        job=job,
        model_dir=tmp_path / "model",
        rows=tmp_path / "rows.parquet",
        agent_loop_yaml=tmp_path / "agent_loop.yaml",
        rollout_seed=123,
    )


def test_the_refit_launch_composes_through_its_own_entry_point(tmp_path, monkeypatch):
    """``python -m fedagent.train.verl.refit`` is verl's Hydra main: ``--cfg job`` prints the composed
    config (the refit env var reaches Ray's runtime env); a key verl does not have fails there."""
    monkeypatch.delenv("FEDAGENT_VERL_TRAINER", raising=False)
    ov = _overrides(tmp_path, warm_refit=True)
    cmd = trainer_command(ov, warm_refit=True)
    assert cmd[1:3] == ["-m", refit.MODULE] and trainer_command(ov)[1:3] == ["-m", "verl.trainer.main_ppo"]
    assert f"+ray_kwargs.ray_init.runtime_env.env_vars.{refit.REFIT_ENV}='1'" in ov
    assert not any(refit.REFIT_ENV in o for o in _overrides(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([*cmd, "--cfg", "job"], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (
        f"{refit.REFIT_ENV}: '1'" in out.stdout
        and "default_local_dir: " + str(tmp_path / "w" / "ckpt-fa-r001-c0-1-0123456789abcdef") in out.stdout
    )
    bad = subprocess.run(
        [*cmd, "trainer.save_frequency=1", "--cfg", "job"], capture_output=True, text=True, env=env, timeout=240
    )
    assert bad.returncode != 0 and "save_frequency" in bad.stderr


def test_the_reset_method_lands_on_verls_worker_beside_the_reference_patch(tmp_path):
    """In a fresh process (as a Ray worker): the refit's and the KL reference's patches of the same
    verl module both apply (one import finder runs every pending patch); the reset is a ONE_TO_ALL
    method, so verl's worker group binds it for the TaskRunner."""
    ref = build_tiny_model(tmp_path / "ref", seed=3)
    code = f"""
from fedagent.train.verl import refit, ref_model
refit.arm()
ref_model.arm({str(ref)!r})
import verl.workers.engine_workers as m
from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch
attrs = getattr(getattr(m.ActorRolloutRefWorker, refit.METHOD), MAGIC_ATTR)
assert attrs["dispatch_mode"] == Dispatch.ONE_TO_ALL and attrs["blocking"], attrs
attrs = getattr(getattr(m.TrainingWorker, refit.PATH_METHOD), MAGIC_ATTR)
assert attrs["dispatch_mode"] == Dispatch.ONE_TO_ALL, attrs
assert getattr(m.ActorRolloutRefWorker.ref_worker_cls, "_fedagent_ref_dir", None) == {str(ref)!r}
print("both patched")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0 and "both patched" in out.stdout, out.stderr[-2000:]


class _Engine:
    """verl's ``TrainingWorker`` as ``reset_engines`` uses it: an engine with a model and an optimizer; its
    ``reset`` records whether the engine still held its old model (it must have been released first)."""

    def __init__(self, calls, name, path):
        import torch

        self.calls, self.name = calls, name
        self.engine = type("E", (), {"model_config": type("M", (), {"local_path": path})()})()
        self.engine.module = torch.nn.Linear(4, 4)
        self.engine.optimizer = torch.optim.AdamW(self.engine.module.parameters())
        self.old_weight = self.engine.module.weight

    def reset(self):
        import torch

        held = "kept" if self.engine.module is not None else "released"
        self.calls.append(f"{self.name}.reset({held}, {self.old_weight.untyped_storage().nbytes()} B)")
        self.engine.module = torch.nn.Linear(4, 4)


def test_reset_engines_rebuilds_the_reference_then_the_actor(capsys):
    calls: list[str] = []
    worker = type("W", (), {})()
    worker.ref, worker.actor = _Engine(calls, "ref", "/m/ref"), _Engine(calls, "actor", "/m/start")
    done = refit.reset_engines(worker)
    assert done["path"] == "/m/start" and [r["role"] for r in done["released"]] == ["ref", "actor"]
    # each old model released (its storage freed) before its engine is rebuilt
    assert calls == ["ref.reset(released, 0 B)", "actor.reset(released, 0 B)"]
    out = capsys.readouterr().out
    assert f"{refit.RESET_LINE}/m/start" in out and refit.reset_paths(out, refit.REF_RESET_LINE) == ["/m/ref"]
    # a later job's start model and reference: each path changes before its reset
    assert refit.reset_engines(worker, "/m/next", "/m/next-ref")["path"] == "/m/next"
    assert worker.ref.engine.model_config.local_path == "/m/next-ref"
    out = capsys.readouterr().out
    assert refit.reset_paths(out) == ["/m/next"] and refit.reset_paths(out, refit.REF_RESET_LINE) == ["/m/next-ref"]
    critic = _Engine(calls, "critic", "/m/start/critic")
    assert refit.set_model_path(critic, "/m/next/critic") == "/m/next/critic"
    assert critic.engine.model_config.local_path == "/m/next/critic"
    rec = refit.release_model(critic)
    assert rec["role"] == "critic" and critic.engine.module is None and critic.engine.optimizer is None
    assert critic.old_weight.untyped_storage().nbytes() == 0
    worker.actor = None
    with pytest.raises(RuntimeError, match="no actor"):
        refit.reset_engines(worker)


class _FakeTrainer:
    """Records verl's trainer calls; state a first fit leaves behind."""

    def __init__(self, calls, use_critic):
        self.calls, self.use_critic = calls, use_critic
        self.global_steps, self.local_trigger_step, self._restored_tq_prompt_count = 7, 3, 5
        self.replay_buffer = "first fit's"
        rec = lambda name: lambda *a, **k: calls.append(name)  # noqa: E731
        self.logger = type("T", (), {"finish": lambda s, exit_code: calls.append(f"logger.finish({exit_code})")})()
        self.checkpoint_manager = type("C", (), {"sleep_replicas": lambda s: calls.append("sleep_replicas")})()
        # ONE_TO_ALL: one answer per rank (here one), each with its engines' release records
        self.actor_rollout_wg = type(
            "A",
            (),
            {
                refit.METHOD: lambda s, d, r: (
                    calls.append(f"reset_engines({d}, {r})")
                    or [{"path": d, "released": [{"role": "ref"}, {"role": "actor"}]}]
                )
            },
        )()
        self.critic_wg = type(
            "K",
            (),
            {
                "reset": lambda s: calls.append("critic.reset"),
                refit.PATH_METHOD: lambda s, d: calls.append(f"critic.path({d})"),
                refit.RELEASE_METHOD: lambda s: calls.append("critic.release") or [{"role": "critic"}],
            },
        )()
        self._init_dataloader, self._init_dump_executor = rec("dataloader"), rec("dump_executor")
        self.on_init_end = rec("on_init_end")

    def _build_replay_buffer(self):
        self.calls.append("replay_buffer")
        return "new"

    def _load_checkpoint(self):
        self.calls.append("load_checkpoint")
        self.global_steps = 0


def test_the_reset_rebuilds_verls_own_fsdp_engines_from_the_new_dirs_as_a_fresh_engine(tmp_path):
    """verl's real actor, KL-reference and PPO critic FSDP engines (the config our PPO launch composes,
    CPU/gloo), two optimizer steps, then our ``reset_engines`` / ``set_model_path`` with verl's own
    ``TrainingWorker.reset`` naming a later round's start model (and critic) and another reference: the
    old modules and optimizers are freed (no second model's memory held per job), and so are the old
    models' weights — torch FSDP1's FlatParameters, which a cycle the garbage collector cannot see kept
    alive after every reset until ``release`` frees them (the H200's ≈ 0.5 GB per trained engine per warm
    job; seen failing with ``FEDAGENT_TEST_RESET_VARIANT=no-release``), optimizers and
    scheduler start over, the weights the rollout sync reads are the new start model's, the reference's
    and critic's their dirs', and the next step is bit-equal to a fresh engine's (actor and critic)."""
    env = {k: v for k, v in os.environ.items() if k != "FEDAGENT_TEST_RESET_VARIANT"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "verl_fsdp_reset.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r == {
        "old_freed": [True] * 5,
        "trained_flat_params_freed": True,
        "old_flat_param_bytes": 0,
        "orphan_flat_param_bytes": 0,
        "optimizer_state": 0,
        "scheduler_step": 0,
        "actor_is_start": True,
        "ref_is_ref_dir": True,
        "ref_forward_only": True,
        "ref_offload": False,
        "critic_optimizer_state": 0,
        "critic_is_start": True,
        "step_as_fresh": True,
        "critic_step_as_fresh": True,
    }
    assert f"{refit.RESET_LINE}{tmp_path / 'round2'}" in proc.stdout
    released = [
        json.loads(line.split(release.RELEASED_LINE, 1)[1])
        for line in proc.stdout.splitlines()
        if release.RELEASED_LINE in line
    ]
    assert [r["role"] for r in released] == ["ref", "actor", "critic"]
    assert all(r["model_gb"] >= 0 and r["kept_gb"] == 0 for r in released)


@pytest.mark.parametrize("use_critic", [False, True])
def test_reset_for_refit_puts_the_trainer_where_a_fresh_job_starts(tmp_path, use_critic, monkeypatch, capsys):
    import transfer_queue as tq
    from omegaconf import OmegaConf

    store = {
        "train": {
            "uid-left": {"is_prompt": True, "status": "failure", "global_steps": 1},
            "uid-left_0": {"status": "finished"},
        }
    }
    monkeypatch.setattr(tq, "kv_list", lambda partition_id=None: {k: dict(v) for k, v in store.items()})
    monkeypatch.setattr(tq, "kv_clear", lambda keys, partition_id: [store[partition_id].pop(k) for k in keys])

    ckpt = tmp_path / "ckpt" / "global_step_1" / "actor"
    ckpt.mkdir(parents=True)
    record = tmp_path / "episodes.jsonl"
    record.write_text('{"first": "fit", "t_first_generation": 12.25}\n{"t_first_generation": 11.5}\n')
    yaml_path = tmp_path / "agent_loop.yaml"
    job_file = tmp_path / "job.json"  # the record file named through the agent loop's job file
    job_file.write_text(
        json.dumps({"env_uds": "/x.sock", "env_url": None, "env_token": None, "record_file": str(record)})
    )
    yaml_path.write_text(f"- name: x\n  job_file: {job_file}\n")
    config = OmegaConf.create(
        {
            "trainer": {"default_local_dir": str(tmp_path / "ckpt")},
            "critic": {"model": {"path": "/m/start/critic"}},
            "actor_rollout_ref": {
                "model": {"path": "/m/start"},
                "rollout": {"agent": {"agent_loop_config_path": str(yaml_path)}},
            },
        }
    )
    calls: list[str] = []
    tr = _FakeTrainer(calls, use_critic)
    refit.reset_for_refit(tr, config)
    assert calls == [
        "logger.finish(0)",
        "sleep_replicas",
        "reset_engines(/m/start, /m/start)",
        *(["critic.path(/m/start/critic)", "critic.release", "critic.reset"] if use_critic else []),
        "dataloader",
        "dump_executor",
        "replay_buffer",
        "load_checkpoint",
        "on_init_end",
    ]
    assert not (tmp_path / "ckpt").exists() and record.read_text() == ""
    out = capsys.readouterr().out
    assert store == {"train": {}} and f"{refit.CLEARED_PREFIX}2" in out and refit.first_fit_token_at(out) == 11.5
    assert (tr.global_steps, tr.local_trigger_step, tr._restored_tq_prompt_count, tr.replay_buffer) == (0, 0, 0, "new")
    # what the set answers its job: every engine's release record, critic last
    again = refit.reset_trainer(_FakeTrainer([], use_critic), model_dir="/m", ref_dir="/m", critic_dir="/m/critic")
    assert [r["role"] for r in again] == ["ref", "actor", *(["critic"] if use_critic else [])]


def test_refit_lines_are_read_from_the_last_refit_on():
    log = "a\nstep:1 - x:1\nfedagent: warm refit begins at 12.5\n(W pid=1) " + refit.RESET_LINE + "/m\nstep:1 - x:2\n"
    assert refit.started_at(log) == 12.5 and refit.started_at("no refit\n") is None
    assert refit.after_refit(log).startswith("(W pid=1)") and "x:1" not in refit.after_refit(log)
    assert refit.after_refit("no refit\n") == ""
    assert refit.first_fit_token_at(refit.FIRST_FIT_TOKEN_PREFIX + "none\n") is None
    assert refit.first_fit_token_at("x\n" + refit.FIRST_FIT_TOKEN_PREFIX + "9.5\n") == 9.5


P = dict(groups_per_epoch=2, group_size=2, max_turns=1, pool_size=4, mini_batch_size=2)


def test_a_refit_job_keeps_the_second_fits_steps_and_times_its_warm_start(fake_trainer, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VERL_HOLD_S", "0")
    model = build_tiny_model(tmp_path / "m", seed=1)
    round_dir = tmp_path / "clients"
    round_dir.mkdir()
    m = _run_jobs(model, round_dir, (0,), TrainParams(**P), VerlSettings(gpus=1, warm_refit=True))[0]
    assert isinstance(m, dict), m
    # the first fit logged 100 × these values: only the second fit's (1 ×) are the job's
    assert m["kl"] == pytest.approx(FAKE_STEP_VALUES["actor/kl_loss"])
    assert [s["step"] for s in m["steps"]] == [1] and m["verl"]["warm_refit"] is True
    t = m["timings_s"]
    # the cold start is the first fit's first token (before the refit), the warm one the second fit's
    assert 0 < t["launch_to_first_generation"] < t["launch_to_refit"] and t["refit_to_first_generation"] > 0
    assert m["refit_steps_match"] is True  # the recorded steps carry the console lines' values
    assert m["num_episodes"] == P["groups_per_epoch"] * P["group_size"] and (round_dir / "0" / "metrics.json").is_file()


@pytest.mark.parametrize(
    "env, value, messages",
    [
        ("FAKE_VERL_NO_RESET", "1", ["not reset"]),  # no worker reset line
        ("FAKE_VERL_RESET_FROM", "{tmp}/elsewhere", ["elsewhere", "not only from"]),  # actor from another dir
        ("FAKE_VERL_REF_RESET_FROM", "{tmp}/other-ref", ["KL reference was reset from"]),
    ],
)  # reference likewise
def test_a_refit_job_not_reset_from_its_own_dirs_leaves_no_update(
    fake_trainer, tmp_path, monkeypatch, env, value, messages
):
    monkeypatch.setenv("FAKE_VERL_HOLD_S", "0")
    monkeypatch.setenv(env, value.format(tmp=tmp_path))
    model = build_tiny_model(tmp_path / "m", seed=1)
    round_dir = tmp_path / "clients"
    round_dir.mkdir()
    err = _run_jobs(model, round_dir, (0,), TrainParams(**P), VerlSettings(gpus=1, warm_refit=True))[0]
    assert isinstance(err, RuntimeError) and all(m in str(err) for m in messages), err
    assert list(round_dir.iterdir()) == []


def test_the_refit_runner_fits_resets_and_fits_again_on_verls_composed_config(tmp_path, monkeypatch, capsys):
    """The TaskRunner's own sequence, run in this process (not as a Ray actor) on the config our launch
    composes with verl's: init → agent loop → fit → refit line → reset → fit, TransferQueue closed."""
    import transfer_queue as tq
    from verl.trainer.ppo import v1

    from verl_helpers import compose_ppo

    calls: list[str] = []

    class Trainer:
        def __init__(self, config):
            self.config = config

        def init(self):
            calls.append("init")

        def fit(self, manager):
            calls.append(f"fit({manager})")
            import verl.trainer.ppo.v1.trainer_base as tb  # as verl's fit builds its logger

            tb.Tracking(project_name="p", experiment_name="e", default_backend=[]).log(data={"n": len(calls)}, step=1)

    monkeypatch.setattr(v1, "get_trainer_cls", lambda mode: calls.append(f"trainer_cls({mode})") or Trainer)
    monkeypatch.setattr(tq, "init", lambda cfg: calls.append("tq.init"))
    monkeypatch.setattr(tq, "close", lambda: calls.append("tq.close"))
    monkeypatch.setattr(refit, "reset_for_refit", lambda trainer, config: calls.append("reset"))
    cls = refit.runner_class().__ray_actor_class__
    monkeypatch.setattr(cls, "init_agent_loop_manager", lambda self: setattr(self, "agent_loop_manager", "alm"))
    runner = cls()
    (tmp_path / "w").mkdir()
    plain = v1.trainer_base.Tracking
    runner.run(compose_ppo(_overrides(tmp_path, warm_refit=True)))
    assert calls == ["trainer_cls(sync)", "tq.init", "init", "fit(alm)", "reset", "fit(alm)", "tq.close"]
    assert refit.started_at(capsys.readouterr().out) is not None
    # only the second fit's logged steps are recorded, and verl's Tracking is itself again afterwards
    assert json.loads((tmp_path / "w" / refit.STEPS_FILE).read_text()) == [{"step": 1, "n": 6.0}]
    assert v1.trainer_base.Tracking is plain


def test_the_agent_loop_job_file_carries_the_env_address_and_nothing_else_does(tmp_path):
    """verl reads the agent-loop YAML once per worker: with a job file the YAML names, the env address
    and record file reach each episode from that file (rewritten atomically), never from both."""
    import yaml

    from fedagent.train.verl.agent_loop import read_job_file
    from fedagent.train.verl.job_files import write_agent_loop_yaml

    p = TrainParams(max_turns=2)
    path = write_agent_loop_yaml(
        tmp_path / "a.yaml",
        env_uds="/tmp/x.sock",
        env_url=None,
        env_token=None,
        p=p,
        record_file=tmp_path / "ep.jsonl",
        history_length=2,
        job_file=tmp_path / "job.json",
        model_dir=tmp_path / "m",
    )
    (entry,) = yaml.safe_load(path.read_text())
    assert entry["job_file"] == str(tmp_path / "job.json") and not {"env_uds", "record_file", "model_dir"} & set(entry)
    assert read_job_file(entry["job_file"]) == (
        "/tmp/x.sock",
        None,
        None,
        str(tmp_path / "ep.jsonl"),
        str(tmp_path / "m"),
    )
    with pytest.raises(ValueError, match="start model dir"):  # the loop's stop tokens need it
        write_agent_loop_yaml(
            tmp_path / "c.yaml",
            env_uds="/tmp/x.sock",
            env_url=None,
            env_token=None,
            p=p,
            record_file=tmp_path / "ep.jsonl",
            history_length=2,
            job_file=tmp_path / "job2.json",
        )
    with pytest.raises(ValueError, match="one or the other"):
        read_job_file(entry["job_file"], "/tmp/other.sock")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="missing"):
        read_job_file(str(tmp_path / "bad.json"))
    (plain,) = yaml.safe_load(
        write_agent_loop_yaml(
            tmp_path / "b.yaml",
            env_uds="/tmp/x.sock",
            env_url=None,
            env_token=None,
            p=p,
            record_file=tmp_path / "ep.jsonl",
            history_length=2,
        ).read_text()
    )
    assert plain["env_uds"] == "/tmp/x.sock" and "job_file" not in plain


def test_recorded_steps_are_checked_against_the_console_lines(tmp_path):
    from verl.utils.tracking import Tracking

    sink: list = []
    tracker = refit.recording_tracking(Tracking, sink)(project_name="p", experiment_name="e", default_backend=[])
    tracker.log(data={"actor/kl_loss": 0.25, "name": "text", "n": 3}, step=1)
    assert sink == [{"step": 1, "actor/kl_loss": 0.25, "n": 3.0}]
    path = tmp_path / refit.STEPS_FILE
    assert refit.steps_match(path, [{"step": 1, "actor/kl_loss": 0.25}]) is None
    path.write_text(json.dumps(sink))
    assert refit.steps_match(path, [{"step": 1, "actor/kl_loss": 0.25}]) is True
    assert refit.steps_match(path, [{"step": 1, "actor/kl_loss": 0.26}]) is False
    assert refit.steps_match(path, [{"step": 1, "actor/entropy": 1.0}]) is False
    assert refit.steps_match(path, [{"step": 2, "actor/kl_loss": 0.25}]) is False


def test_refit_started_fails_closed_on_every_missing_or_foreign_line():
    from fedagent.train.verl.backend import refit_started

    m, r = Path("/m/start"), Path("/m/base")
    ok = f"{refit.refit_line(5.0)}\n(W pid=1) {refit.RESET_LINE}{m}\n(W pid=1) {refit.REF_RESET_LINE}{r}\n"
    assert refit_started(ok, m, r) == 5.0
    no_ref_line = f"{refit.refit_line(5.0)}\n{refit.RESET_LINE}{m}\n"
    assert refit_started(no_ref_line, m, None, has_ref=False) == 5.0  # kl_coef 0: verl built no reference
    for log, ref, has_ref, match in [
        (f"{refit.RESET_LINE}{m}\n", r, True, "did not refit"),
        (f"{refit.refit_line(5.0)}\n", r, True, "not reset"),
        (ok.replace(str(m), "/m/other", 1), r, True, "not only from"),
        (ok, None, True, "KL reference was reset from"),  # the reference must be the start model
        (no_ref_line, None, True, "KL reference was reset from"),
    ]:  # a KL term and no reference reset
        with pytest.raises(RuntimeError, match=match):
            refit_started(log, m, ref, has_ref=has_ref)
