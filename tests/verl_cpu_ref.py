"""verl 0.9.1's KL reference worker, built for real on CPU in this process.

``ActorRolloutRefWorker(config.actor_rollout_ref, role="ref").init_model()``: verl's own code
from the composed Hydra config through ``TrainingWorker`` and the FSDP engine to
``FSDPEngine._build_module``'s ``from_pretrained(model_config.local_path)``, with three CPU
stand-ins that do not touch where the weights come from: a verl platform for the CPU (verl 0.9.1
knows only accelerators), the FSDP engine chosen as on CUDA (``VERL_ENGINE_DEVICE``), and FSDP's
wrapper left out (``_build_fsdp_module`` returns the loaded module: FSDP1's
``sync_module_states`` and the reference's CPU offload need a GPU). World size 1 (gloo, file
rendezvous). Used by tests/test_verl_ref_model.py (as a script) and tests/fake_verl_trainer_ref.py.

    python tests/verl_cpu_ref.py OUT.pt OVERRIDE...

sets the overrides' Ray runtime-env variables in this process and runs our Ray worker hook (as
Ray does in each worker), composes the overrides, builds the reference and saves its state dict.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import types

PLATFORM = "fedagent-test-cpu"
ENV_PREFIX = "+ray_kwargs.ray_init.runtime_env.env_vars."


def use_cpu_platform() -> None:
    """Before verl resolves its platform (its engine modules do on import): the CPU stand-ins."""
    os.environ["VERL_PLATFORM"] = PLATFORM
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    os.environ["VERL_ENGINE_VENDOR"] = "nvidia"
    import torch
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    class _Device(types.ModuleType):  # torch.cpu plus the memory queries verl logs
        def __getattr__(self, name):
            return getattr(torch.cpu, name)

        def memory_allocated(self, *a):
            return 0

        memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

        def mem_get_info(self, *a):
            return (1 << 30, 1 << 30)

        def empty_cache(self):
            pass

    @PlatformRegistry.register(platform=PLATFORM)
    class _CPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "none"
        device_module = _Device("fedagent_test_cpu")

        def is_available(self):
            return True

        def current_device(self):
            return torch.device("cpu")  # FSDP's device_id

        def device_count(self):
            return 1

        def set_device(self, i):
            pass

        def synchronize(self, i=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def set_allocator_settings(self, s):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, i=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "GPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    FSDPEngine._build_fsdp_module = lambda self, module: module


def build_reference(cfg):
    """verl's reference worker of ``cfg`` (a composed ``ppo_trainer`` config), initialized; returns the worker."""
    import torch.distributed as dist

    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        os.environ[key] = value
    if not dist.is_initialized():
        rdzv = tempfile.mkdtemp(prefix="fa-rdzv-")
        dist.init_process_group("gloo", init_method=f"file://{rdzv}/f", rank=0, world_size=1)
    from verl.workers.engine_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="ref")
    worker.init_model()
    return worker


def main(argv: list[str]) -> int:
    out, overrides = argv[0], argv[1:]
    for o in overrides:  # Ray's runtime_env env_vars, in every worker
        if o.startswith(ENV_PREFIX):
            key, _, value = o[len(ENV_PREFIX) :].partition("=")
            os.environ[key] = value
    from fedagent.train.verl import ray_hook

    ray_hook.setup()  # Ray's worker_process_setup_hook
    use_cpu_platform()
    import torch
    from verl_helpers import compose_ppo

    cfg = compose_ppo(overrides)
    worker = build_reference(cfg)
    torch.save({k: v.detach().clone() for k, v in worker.ref.engine.module.state_dict().items()}, out)
    print(f"actor model path: {cfg.actor_rollout_ref.model.path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
