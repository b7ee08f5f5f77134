"""Start Ray exactly as verl 0.9.1's run_ppo does, from a composed fedagent launch; report what workers see.

``python verl_ray_probe.py OVERRIDES_JSON OUT_JSON``: composes ``ppo_trainer`` with the
overrides, merges verl's default runtime env, ``ray.init``s with ``ray_kwargs.ray_init``
(our private temp dir, no dashboard, the worker setup hook and the job tag), runs one task
that asks for the job id as verl's rollout module would, and writes the answers.
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
    default_runtime_env = get_ppo_ray_runtime_env(config)          # as verl.trainer.main_ppo.run_ppo
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

    out = ray.get(probe.remote())
    node = ray._private.worker.global_worker.node
    out.update({"session_dir": node.get_session_dir_path(), "gcs": node.gcs_address})
    ray.shutdown()
    with open(out_path, "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
