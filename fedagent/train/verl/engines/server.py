"""``python -m fedagent.train.verl.engines.server <overrides>``: one run-scoped verl engine set.

verl 0.9.1's Hydra main (as ``verl.trainer.main_ppo``; ``--cfg job`` prints the composed config) with
:func:`runner_class` as its TaskRunner: it builds the trainer, its engines and the agent-loop manager from
the first job's overrides (rewritten by :func:`fedagent.train.verl.engines.client.set_overrides`), then
serves jobs (:func:`fedagent.train.verl.engines.serve.serve`) with :class:`VerlFitter`: a job built from
the set's own dirs fits as it is, any other first resets the engines to its start
(:func:`fedagent.train.verl.refit.reset_trainer`, the warm refit's reset) and fits. The set's socket,
key, idle time and slot reach the TaskRunner as Ray env vars. SIGTERM (the client's ``stop_set``, or the
watchdog when a job's connection closes mid-fit) ends the driver, which shuts Ray down.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(f"engine set: {name} is not in this process's environment (the set's Ray env vars)")
    return value


class VerlFitter:
    """verl's v1 trainer as :class:`fedagent.train.verl.engines.serve.Fitter`."""

    def __init__(self, trainer, config, agent_loop_manager):
        from fedagent.train.verl.ref_model import REF_MODEL_ENV

        self.trainer, self.config, self.manager = trainer, config, agent_loop_manager
        self.last_reset = None  # the last fit's release records (refit.reset_trainer); None: no reset
        self.start = {
            "model_dir": str(config.actor_rollout_ref.model.path),
            "rows": str(config.data.train_files),
            "critic_dir": str(config.critic.model.path) if trainer.use_critic else None,
            "ref_dir": os.environ.get(REF_MODEL_ENV) or None,
            "ckpt_dir": str(config.trainer.default_local_dir),
        }

    def built_for(self, job: dict) -> bool:
        return all(job.get(k) == v for k, v in self.start.items())

    def fit(self, job: dict, *, reset: bool) -> list[dict]:
        from fedagent.train.verl import refit

        cfg = self.config
        self.last_reset = None
        cfg.trainer.default_local_dir = job["ckpt_dir"]
        cfg.trainer.experiment_name = job["tag"]
        if reset:
            print(refit.refit_line(time.time()), flush=True)
            cfg.data.train_files = job["rows"]
            cfg.data.val_files = job["rows"]
            cfg.actor_rollout_ref.model.path = job["model_dir"]
            if self.trainer.use_critic:
                cfg.critic.model.path = job["critic_dir"]
            self.last_reset = refit.reset_trainer(
                self.trainer,
                model_dir=job["model_dir"],
                ref_dir=job["ref_dir"] or job["model_dir"],
                critic_dir=job["critic_dir"],
            )
        try:
            return refit.fit_recorded(self.trainer, self.manager)
        finally:
            tracking = getattr(self.trainer, "logger", None)
            if tracking is not None:
                tracking.finish(exit_code=0)

    def memory_gb(self) -> float | None:
        """The most device memory any training worker (actor + reference; the critic's, in PPO) holds now."""
        from fedagent.train.verl import memory

        groups = [self.trainer.actor_rollout_wg] + ([self.trainer.critic_wg] if self.trainer.use_critic else [])
        if os.environ.get(memory.CENSUS_ENV) == "1":  # the largest live device tensors into the set's log
            getattr(self.trainer.actor_rollout_wg, memory.CENSUS_METHOD)()  # (colocated: one process for all roles)
        got = [g for wg in groups for g in getattr(wg, memory.MEMORY_METHOD)() if g is not None]
        return max(got) if got else None


def max_growth_gb() -> float | None:
    """The set's ``train.verl.engines_max_growth_gb`` (its Ray env var; None when the job set none)."""
    from fedagent.train.verl.engines.client import GROWTH_ENV

    value = os.environ.get(GROWTH_ENV)
    return None if value is None else float(value)


def stop_own_set() -> None:
    """From inside the set (the watchdog): stop the whole set as its client would, from a process of its
    own session (this one is in the group being stopped)."""
    from fedagent.train.verl.engines.client import SLOT_ENV, stop_set_detached

    stop_set_detached(Path(_env(SLOT_ENV)))


def runner_class():
    """verl 0.9.1's ``TaskRunnerV1`` whose ``run`` builds the engines once and serves jobs (a Ray actor)."""
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.main_ppo import TaskRunnerV1

    base = TaskRunnerV1.__ray_actor_class__

    class EngineSetRunner(base):
        def run(self, config):
            import transfer_queue as tq
            from verl.trainer.ppo.v1 import get_trainer_cls
            from verl.utils.logging_utils import configure_verl_logging

            from fedagent.train.verl import refit
            from fedagent.train.verl.engines import client, serve

            configure_verl_logging()
            refit.check_config(config, "train.verl.engines: run")
            trainer_cls = get_trainer_cls(config.trainer.v1.trainer_mode)
            config.transfer_queue.enable = True
            OmegaConf.resolve(config)
            self.config = config
            tq.init(config.transfer_queue)
            try:
                self.trainer = trainer_cls(config=config)
                self.trainer.init()
                self.init_agent_loop_manager()
                slot = Path(_env(client.SLOT_ENV))
                why = serve.serve(
                    Path(_env(client.SOCKET_ENV)),
                    key=_env(client.KEY_ENV),
                    fitter=VerlFitter(self.trainer, config, self.agent_loop_manager),
                    log=slot / "server.log",
                    job_file=slot / "job.json",
                    idle_s=float(_env(client.IDLE_ENV)),
                    stop=stop_own_set,
                    set_tag=os.environ.get("FEDAGENT_VERL_JOB_TAG", ""),
                    nonce=_env(client.NONCE_ENV),
                    max_growth_gb=max_growth_gb(),
                )
                print(f"fedagent: engine set stops: {why}", flush=True)
            finally:
                tq.close()

    return ray.remote(EngineSetRunner)


def _cleanup(config) -> None:
    from fedagent.train.verl.launch import TAG_ENV
    from fedagent.train.verl.leftovers import remove_ipc_sockets

    tag = os.environ.get(TAG_ENV)
    if tag:
        remove_ipc_sockets(tag)
    tmp = config.ray_kwargs.get("ray_init", {}).get("_temp_dir")
    if tmp and Path(str(tmp)).name.startswith("fa-ray-"):
        shutil.rmtree(str(tmp), ignore_errors=True)


def main() -> None:
    """verl's ``main_ppo.main`` with :func:`runner_class` (and the refit's worker methods armed: the set's
    Ray env carries ``FEDAGENT_VERL_WARM_REFIT``, see ``client.set_overrides``)."""
    import hydra

    @hydra.main(config_path="pkg://verl.trainer.config", config_name="ppo_trainer", version_base=None)
    def _main(config):
        from verl.trainer import main_ppo

        from fedagent.train.verl.engines import client
        from fedagent.train.verl.refit import REFIT_ENV, prepare_verl_config

        prepare_verl_config(config, "train.verl.engines: run")
        env_vars = config.ray_kwargs.ray_init.runtime_env.env_vars
        missing = [
            k
            for k in (client.SOCKET_ENV, client.KEY_ENV, client.IDLE_ENV, client.SLOT_ENV, client.NONCE_ENV, REFIT_ENV)
            if k not in env_vars
        ]
        if missing:
            raise ValueError(f"engine set: {missing} not in the Ray runtime env (client.set_overrides writes them)")

        # SIGTERM (client.stop_set) ends the driver: ray.init installs its own handler (sys.exit), ours is
        # the same for the time before it; once cleaning up, a second SIGTERM must not cut the shutdown short
        # (the client's SIGKILL follows after its grace).
        def _term(signum, frame):
            raise SystemExit(128 + signum)

        from fedagent.train.verl.launch import TAG_ENV

        # the set's own record (the starting job writes it too: a job killed right after the start still
        # leaves a set that stop_set finds)
        client.record_set(
            Path(str(env_vars[client.SLOT_ENV])),
            os.getpid(),
            tag=str(env_vars.get(TAG_ENV, "")),
            ray_tmp=config.ray_kwargs.ray_init.get("_temp_dir", ""),
            key=str(env_vars[client.KEY_ENV]),
        )

        signal.signal(signal.SIGTERM, _term)
        try:
            main_ppo.run_ppo(config, task_runner_class=runner_class())
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            import ray

            with contextlib.suppress(BaseException):
                ray.shutdown()
            _cleanup(config)

    _main()


if __name__ == "__main__":
    sys.exit(main())
