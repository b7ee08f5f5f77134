"""Start Ray exactly as verl 0.9.1's run_ppo does, from a composed fedagent launch; report what workers see.

``python verl_ray_probe.py OVERRIDES_JSON OUT_JSON``: composes ``ppo_trainer`` with the
overrides, merges verl's default runtime env, ``ray.init``s with ``ray_kwargs.ray_init``
(our private temp dir, no dashboard, the worker setup hook and the job tag), runs one task
that asks for the job id as verl's rollout module would, and writes the answers
(``$FEDAGENT_PROBE_COLOCATED``: also the fedagent methods of verl's colocated worker class as a
hooked worker builds it).
"""

from __future__ import annotations

import json
import os
import sys


def main(ov_path: str, out_path: str) -> None:
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
    from verl_helpers import compose_ppo

    config = compose_ppo(json.loads(open(ov_path).read()))
    default_runtime_env = get_ppo_ray_runtime_env(config)  # as verl.trainer.main_ppo.run_ppo
    ray_init_kwargs = config.ray_kwargs.get("ray_init", {})
    runtime_env = OmegaConf.merge(default_runtime_env, ray_init_kwargs.get("runtime_env", {}))
    ray_init_kwargs = OmegaConf.create({**ray_init_kwargs, "runtime_env": runtime_env})
    kwargs = OmegaConf.to_container(ray_init_kwargs)
    kwargs["num_cpus"] = 1
    ray.init(**kwargs)

    @ray.remote
    def probe():
        import ray as r

        ctx = r.get_runtime_context()
        salted = eval("ctx.get_job_id()", {"__name__": "verl.workers.rollout.vllm_rollout.vllm_rollout", "ctx": ctx})
        return {"salted": salted, "plain": ctx.get_job_id(), "worker_pid": os.getpid()}

    @ray.remote
    def colocated():
        """What verl's TaskRunner (a hooked Ray worker) binds: the v1 trainer's colocated WorkerDict of the
        actor-rollout-ref worker and the critic's TrainingWorker, built with verl's own
        ``create_colocated_worker_cls`` after the hook armed our patches; each fedagent method as the
        WorkerDict and the spawned worker group see it (name, dispatch mode)."""
        import ray as r
        from verl.single_controller.base.decorator import MAGIC_ATTR
        from verl.single_controller.ray.base import RayClassWithInitArgs, create_colocated_worker_cls
        from verl.trainer.ppo.utils import Role
        from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

        keys = {str(Role.ActorRollout): ActorRolloutRefWorker, str(Role.Critic): TrainingWorker}
        wd = create_colocated_worker_cls({k: RayClassWithInitArgs(cls=r.remote(c)) for k, c in keys.items()})
        cls = wd.cls.__ray_actor_class__
        return {
            name: getattr(getattr(cls, name), MAGIC_ATTR)["dispatch_mode"].name
            for name in dir(cls)
            if "fedagent" in name
        }

    out = ray.get(probe.remote())
    if os.environ.get("FEDAGENT_PROBE_COLOCATED"):
        out["colocated"] = ray.get(colocated.remote())
    node = ray._private.worker.global_worker.node
    out.update({"session_dir": node.get_session_dir_path(), "gcs": node.gcs_address})
    ray.shutdown()
    with open(out_path, "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
