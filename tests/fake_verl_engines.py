"""A fake run-scoped verl engine set for CPU tests (``FEDAGENT_VERL_ENGINES_SERVER=fake_verl_engines``).

``python -m fake_verl_engines <the set's overrides>`` does what ``fedagent.train.verl.engines.server``
does around verl: reads the set's Ray env vars from its overrides as Ray would hand them to the TaskRunner
(a non-string value fails as ``ray.init`` fails), arms what ``ray_hook.setup`` arms (a PPO set's critic
lines come from the real verl trainer module), prints verl's start-up lines, then runs the real request
loop (:func:`fedagent.train.verl.engines.serve.serve`) with :class:`FakeFitter` in verl's trainer's place:
a reset prints the refit line and the workers' reset lines for the job's dirs, a fit plays the job's
episodes through the job file's env address, saves a checkpoint of the job's start model + 1/1024 into
the job's checkpoint dir, prints verl's step lines and returns them as recorded.

Knobs: ``FAKE_VERL_RECORD`` (dir: one JSON per job with the set's pid), ``FAKE_VERL_HOLD_S`` (seconds
before the save, read at the set's start), ``$FAKE_VERL_RECORD/reset_from`` (a file, read per job: the reset
line names the dir it holds instead of the job's), ``$FAKE_VERL_RECORD/die_once`` (the set dies as the next
fit begins; the file goes), ``$FAKE_VERL_RECORD/steps_off`` (returned steps disagree with the printed lines),
``$FAKE_VERL_RECORD/memory_step`` (a file holding GB: the fitter's memory after its k-th fit is 1 + (k - 1) ×
that; without it, None as on a CPU), ``FAKE_VERL_ENGINES_RAY`` (the loop and the reset lines in real Ray
actors: :func:`in_ray`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from fake_verl_trainer import parse, play_episodes, print_steps, ray_env_str, save_checkpoint


# what the fake reset says it freed per engine (the shape of fedagent.train.verl.release's record)
FAKE_RELEASE_RECORD = {"model_gb": 0.5, "model_device_gb": 0.5, "optimizer_gb": 1.0, "params_outlived_gc": 0}


class FakeFitter:
    def __init__(self, ov: dict, yaml_path: Path, workers=None):
        from fedagent.train.verl.ref_model import REF_MODEL_ENV

        self.workers = workers  # Ray mode: the actor that prints the workers' reset lines
        self.fits = 0
        self.last_reset = None  # as VerlFitter: the reset's release records (FAKE_RELEASE_RECORD)

        self.ppo = "critic.model.path" in ov
        self.n = int(ov["actor_rollout_ref.rollout.n"])
        self.steps = int(ov["trainer.total_training_steps"])
        self.yaml_path = yaml_path
        self.start = {
            "model_dir": ov["actor_rollout_ref.model.path"],
            "rows": ov["data.train_files"],
            "critic_dir": ov.get("critic.model.path"),
            "ref_dir": os.environ.get(REF_MODEL_ENV) or None,
            "ckpt_dir": ov["trainer.default_local_dir"],
        }

    def built_for(self, job: dict) -> bool:
        return all(job.get(k) == v for k, v in self.start.items())

    def fit(self, job: dict, *, reset: bool) -> list[dict]:
        import yaml

        from fedagent.train.verl import refit

        rec = Path(os.environ["FAKE_VERL_RECORD"])
        if (rec / "die_once").is_file():  # the set dies under this job (a crash, a kill)
            (rec / "die_once").unlink()
            os._exit(3)
        self.last_reset = [dict(FAKE_RELEASE_RECORD, role=r) for r in ("ref", "actor")] if reset else None
        if reset:
            print(refit.refit_line(time.time()), flush=True)
            knob = Path(os.environ["FAKE_VERL_RECORD"]) / "reset_from"  # set while the set runs
            reset_from = knob.read_text() if knob.is_file() else job["model_dir"]
            if self.workers is not None:  # from another Ray process, forwarded by Ray as verl's are
                import ray

                ray.get(self.workers.reset.remote(job["ref_dir"] or job["model_dir"], reset_from))
            else:
                print(f"(WorkerDict pid=1) {refit.REF_RESET_LINE}{job['ref_dir'] or job['model_dir']}", flush=True)
                print(f"(WorkerDict pid=1) {refit.RESET_LINE}{reset_from}", flush=True)
        entry = yaml.safe_load(self.yaml_path.read_text())[0]
        play_episodes(entry, job["rows"], self.n, job["tag"])
        (rec / f"job-{job['tag']}.json").write_text(
            json.dumps({"tag": job["tag"], "set_pid": os.getpid(), "reset": reset, "t": time.time()})
        )
        time.sleep(float(os.environ.get("FAKE_VERL_HOLD_S", "0")))
        save_checkpoint(
            Path(job["model_dir"]), Path(job["ckpt_dir"]), self.steps, Path(job["critic_dir"]) if self.ppo else None
        )
        steps = print_steps(self.steps, self.ppo)
        if (rec / "steps_off").is_file():  # returned steps that are not what the log says
            steps = [{**r, "actor/kl_loss": r["actor/kl_loss"] + 1.0} for r in steps]
        self.fits += 1
        return steps

    def memory_gb(self) -> float | None:
        knob = Path(os.environ["FAKE_VERL_RECORD"]) / "memory_step"  # set while the set runs
        return round(1.0 + float(knob.read_text()) * (self.fits - 1), 3) if knob.is_file() else None


def main() -> int:
    from fedagent.train.verl import ray_hook
    from fedagent.train.verl.engines import client, serve
    from fedagent.train.verl.engines.server import max_growth_gb

    ov = parse(sys.argv[1:])
    prefix = "ray_kwargs.ray_init.runtime_env.env_vars."
    for key, value in ov.items():  # Ray's runtime env, as the TaskRunner would see it
        if key.startswith(prefix):
            os.environ[key[len(prefix) :]] = ray_env_str(value)
    ray_hook.setup()
    if "critic.model.path" in ov:
        import verl.trainer.ppo.v1.trainer_base  # noqa: F401 - the hook's patch runs on this import
    for line in (
        "2026-12-01 00:00:00,000\tINFO worker.py:2038 -- Started a local Ray instance.",
        "INFO:2026-12-01 00:00:03,000:all initialize finished, ready to fit",
    ):
        print(line, flush=True)
    slot = Path(os.environ[client.SLOT_ENV])
    client.record_set(
        slot,
        os.getpid(),
        tag=os.environ.get(ray_hook.TAG_ENV, ""),
        ray_tmp=ov["ray_kwargs.ray_init._temp_dir"],
        key=os.environ[client.KEY_ENV],
    )
    if os.environ.get("FAKE_VERL_ENGINES_RAY"):
        return in_ray(ov, slot)
    why = serve.serve(
        Path(os.environ[client.SOCKET_ENV]),
        key=os.environ[client.KEY_ENV],
        fitter=FakeFitter(ov, Path(ov["actor_rollout_ref.rollout.agent.agent_loop_config_path"])),
        log=slot / "server.log",
        job_file=slot / "job.json",
        idle_s=float(os.environ[client.IDLE_ENV]),
        stop=lambda: client.stop_set_detached(slot),
        settle_s=0.1,
        set_tag=os.environ.get(ray_hook.TAG_ENV, ""),
        nonce=os.environ[client.NONCE_ENV],
        max_growth_gb=max_growth_gb(),
    )
    print(f"fedagent: engine set stops: {why}", flush=True)
    return 0


def in_ray(ov: dict, slot: Path) -> int:
    """``$FAKE_VERL_ENGINES_RAY``: the request loop in a Ray actor (verl's TaskRunner's place) of a real
    local Ray cluster started as the set's driver, and the workers' reset lines printed by another actor
    (verl's WorkerDict's place): every line of a job reaches the set's log (this driver's stdout) only
    through Ray's log forwarding, as on the GPU."""
    import signal

    import ray

    from fedagent.train.verl import ray_hook
    from fedagent.train.verl.engines import client, serve

    prefix = "ray_kwargs.ray_init.runtime_env.env_vars."
    env_vars = {k[len(prefix) :]: ray_env_str(v) for k, v in ov.items() if k.startswith(prefix)}
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=ov["ray_kwargs.ray_init._temp_dir"],
        runtime_env={"env_vars": env_vars},
    )

    @ray.remote(num_cpus=0)
    class WorkerDict:
        def reset(self, ref_dir, model_dir):
            from fedagent.train.verl import refit

            print(f"{refit.REF_RESET_LINE}{ref_dir}", flush=True)
            print(f"{refit.RESET_LINE}{model_dir}", flush=True)

    @ray.remote(num_cpus=0)
    class TaskRunner:
        def run(self, workers):
            return serve.serve(
                Path(os.environ[client.SOCKET_ENV]),
                key=os.environ[client.KEY_ENV],
                fitter=FakeFitter(ov, Path(ov["actor_rollout_ref.rollout.agent.agent_loop_config_path"]), workers),
                log=slot / "server.log",
                job_file=slot / "job.json",
                idle_s=float(os.environ[client.IDLE_ENV]),
                stop=lambda: client.stop_set_detached(slot),
                settle_s=1.0,
                set_tag=os.environ.get(ray_hook.TAG_ENV, ""),
                nonce=os.environ[client.NONCE_ENV],
            )

    def _term(signum, frame):  # as the real set's driver: SIGTERM ends it, Ray shut down
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _term)
    try:
        why = ray.get(TaskRunner.remote().run.remote(WorkerDict.remote()))
        print(f"fedagent: engine set stops: {why}", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
