"""verl 0.9.1's own FSDP engines on the CPU (gloo, world size 1), reset as a run-scoped engine set resets them.

Run by tests/test_verl_refit.py in a fresh process (it sets verl's platform and a process group):
``python tests/verl_fsdp_reset.py WORKDIR``. It builds the actor's, the KL reference's and the PPO
critic's FSDP engines from the config our PPO launch composes (``build_overrides`` through verl's Hydra
``ppo_trainer``), as verl's ``ActorRolloutRefWorker.init_model`` and v1 trainer derive their configs
(the critic's loader armed by :mod:`fedagent.train.verl.critic_attn`, as our Ray hook arms it), takes two
optimizer steps on actor and critic, then calls our :func:`fedagent.train.verl.refit.reset_engines` on a
worker whose ``actor``/``ref`` are stand-ins for verl's ``TrainingWorker`` with verl's own
``TrainingWorker.reset`` (= ``engine.initialize()``), and ``set_model_path`` + ``release_model`` + ``reset``
on the critic's (as ``reset_trainer``), naming a later round's start model (and its critic) and another
reference. It writes ``result.json``:
whether the old module/optimizer were freed after what a fit also does to the engines (the weight sync's
read-out, a checkpoint save, an offload round trip; a leak would hold a second model's GPU memory per job),
whether the old models' weights went too — every old FSDP1 ``FlatParameter`` of the trained engines freed,
no byte left in any old one (the reference's included), none outside a live model in the process
(``memory.orphan_flat_params``): torch's FSDP1 keeps them in a cycle the garbage collector cannot see,
which :mod:`fedagent.train.verl.release` breaks —
the optimizer state and scheduler step after the reset, whether the weights the rollout sync reads
(``get_per_tensor_param``) and the reference's are the new dirs', and whether a step after the reset is
bit-equal to the same step on a fresh engine built from the new start model.

verl registers its FSDP engine for CUDA/NPU only; on the CPU two of its GPU-only helpers are neutralised
here (the module never leaves the CPU): FSDP1's ``sync_module_states`` device check,
``load_fsdp_model_to_gpu`` and pinning (the reference's CPU offload pins for a GPU). ``$FEDAGENT_TEST_RESET_VARIANT`` (tests only) names a broken reset to show
the checks fail: ``path-after`` (the start dir set after ``reset()``), ``no-reset``, ``no-release`` (the
old models not released before the rebuild: the reset as it was before the growth was found).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import sys
import weakref
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def cpu_platform():
    """A verl platform for the CPU (verl 0.9.1 ships CUDA, NPU and ROCm ones)."""
    from verl.plugin.platform.platform_base import PlatformBase

    class CPUModule:
        """``torch.cpu`` with the memory counters verl's cache clean-up reads (no cache on the CPU)."""

        def __getattr__(self, name):
            return getattr(torch.cpu, name)

        memory_reserved = memory_allocated = staticmethod(lambda *a: 0)
        mem_get_info = staticmethod(lambda *a: (0, 0))
        empty_cache = staticmethod(lambda: None)

    class PlatformCPU(PlatformBase):
        device_name = property(lambda s: "cpu")
        vendor_name = property(lambda s: "cpu")
        device_module = property(lambda s: CPUModule())

        def is_available(self):
            return True

        def current_device(self):
            return torch.device("cpu")

        def device_count(self):
            return 1

        def set_device(self, i):
            pass

        def synchronize(self, i=None):
            pass

        def manual_seed(self, s):
            torch.manual_seed(s)  # noqa: E704 - verl's API; not called here

        def manual_seed_all(self, s):
            torch.manual_seed(s)

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

        def nvtx_range(self, msg):
            return contextlib.nullcontext()

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    return PlatformCPU()


def main(workdir: Path) -> None:
    from verl.plugin.platform import platform_manager

    platform_manager.set_platform(cpu_platform())
    import torch.distributed.fsdp._init_utils as fsdp_init

    fsdp_init._check_module_states_for_sync_module_states = lambda states: None  # gloo broadcasts CPU tensors
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rdzv", rank=0, world_size=1)

    from argparse import Namespace

    from fedagent.model.base_model_tiny import write_tiny_model
    from fedagent.train.verl import critic_attn
    from safetensors.torch import load_file, save_file
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.engine_workers import TrainingWorker
    from verl_helpers import build_engine, compose_ppo, derive_ref_config

    from fedagent.train.local import TrainParams
    from fedagent.train.verl import memory, refit, release
    from fedagent.train.verl.launch import VerlJob
    from fedagent.train.verl.overrides import build_overrides
    from fedagent.train.verl.settings import VerlSettings

    transformer_impl.load_fsdp_model_to_gpu = lambda module: None  # the module never leaves the CPU
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # FSDP's CPU offload (the reference) pins for a GPU

    def shifted(src: Path, dst: Path, delta: float) -> Path:
        """A copy of ``src`` with every weight (and its critic's) + ``delta``: a later round's model."""
        import shutil

        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("manifest.json"))
        for f in dst.rglob("model.safetensors"):
            save_file({k: v + delta for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
        return dst

    first = write_tiny_model(workdir / "round1", 1, critic_args=Namespace(critic=True, critic_seed=2, critic_path=None))
    start, ref_dir = shifted(first, workdir / "round2", 0.01), shifted(first, workdir / "base", -0.02)
    p = TrainParams(max_prompt_tokens=64, max_new_tokens=16, group_size=2, kl_coef=0.01, algorithm="ppo")
    job = VerlJob(tag="t", workdir=workdir, ray_tmp=workdir)
    cfg = compose_ppo(
        build_overrides(
            p,
            VerlSettings(),
            job=job,
            model_dir=first,
            rows=workdir / "r.parquet",
            agent_loop_yaml=workdir / "a.yaml",
            rollout_seed=0,
        )
    )
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model, dataclass_type=HFModelConfig)
    actor_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    derive_ref_config(cfg)
    ref_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.ref)
    critic_cfg = omega_conf_to_dataclass(cfg.critic)  # as verl's v1 trainer builds the critic's worker
    critic_attn.arm()  # as our Ray hook arms a PPO job's workers

    def engine(cfg_, path, mc=None):
        return build_engine(
            transformer_impl.FSDPEngineWithLMHead,
            copy.deepcopy(model_config) if mc is None else mc,
            cfg_,
            path,
            "language_model",
        )

    class Training:
        """verl's ``TrainingWorker`` as ``reset_engines`` uses it: ``.engine`` and verl's own ``reset``."""

        def __init__(self, e):
            self.engine = e

        def reset(self):
            if variant != "no-reset":
                TrainingWorker.reset(self)

    def critic_engine(path):
        return build_engine(
            transformer_impl.FSDPEngineWithValueHead, copy.deepcopy(critic_cfg.model), critic_cfg, path, "value_model"
        )

    def step(e, seed):
        e.module.train()
        ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(seed))
        e.optimizer_zero_grad()
        if e.model_config.model_type == "value_model":  # the critic: a loss on its values
            loss = e.module(input_ids=ids).logits.float().square().mean()
        else:
            loss = e.module(input_ids=ids, labels=ids).loss
        loss.backward()
        return e.optimizer_step(), e.lr_scheduler_step()

    def weights(e):
        params, _peft = e.get_per_tensor_param()  # what verl's rollout sync sends to vLLM
        return {k: v.detach().float().clone() for k, v in params}

    def equal(got, path):
        want = load_file(Path(path) / "model.safetensors")
        return all(torch.equal(got[k], want[k].float()) for k in want)

    variant = os.environ.get("FEDAGENT_TEST_RESET_VARIANT", "")
    if variant == "no-release":
        release.release_engine = lambda engine, role: {"role": role}
    worker = type("ActorRolloutRefWorker", (), {})()
    worker.actor = Training(engine(actor_cfg, first, model_config))
    worker.ref = Training(engine(ref_cfg, first))
    critic = Training(critic_engine(first / "critic"))  # verl's critic TrainingWorker (its own group)
    for e in (worker.actor.engine, critic.engine):
        step(e, 1)
        step(e, 2)
    # what a fit does to the engines besides its steps, before the next job's reset (the H200 showed ≈ 0.5 GB
    # per trained engine still allocated after each warm job, docs/results/verl.md 2026-12-05): the weight sync's
    # read-out, the checkpoint save, an offload round trip — none may keep the old module alive
    with torch.no_grad():  # the reference's log-probs (its first forward: FSDP1's lazy init of its wrappers)
        worker.ref.engine.module.eval()
        worker.ref.engine.module(input_ids=torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(4)))
    for e in (worker.actor.engine, critic.engine):
        params, _peft = e.get_per_tensor_param()
        for _name, _tensor in params:
            pass
        e.save_checkpoint(local_path=str(workdir / f"ckpt-{e.model_config.model_type}"), global_step=1)
        e.to("cpu", model=True, optimizer=True, grad=True)
    # the old models' weights: FSDP1's FlatParameters (the trained engines' and the reference's)
    trained_flat = [
        weakref.ref(fp) for e in (worker.actor.engine, critic.engine) for fp in release.flat_params(e.module)
    ]
    all_flat = trained_flat + [weakref.ref(fp) for fp in release.flat_params(worker.ref.engine.module)]
    old = [
        weakref.ref(worker.actor.engine.module),
        weakref.ref(worker.actor.engine.optimizer),
        weakref.ref(worker.ref.engine.module),
        weakref.ref(critic.engine.module),
        weakref.ref(critic.engine.optimizer),
    ]
    if variant == "path-after":
        refit.reset_engines(worker)
        worker.actor.engine.model_config.local_path = str(start)
        worker.ref.engine.model_config.local_path = str(ref_dir)
        critic.reset()
        refit.set_model_path(critic, str(start / "critic"))
    else:
        refit.reset_engines(worker, str(start), str(ref_dir))
        refit.set_model_path(critic, str(start / "critic"))  # then release and critic_wg.reset(), as reset_trainer
        refit.release_model(critic)
        critic.reset()
    gc.collect()
    held = [r() for r in all_flat]
    old_flat_bytes = sum(t.untyped_storage().nbytes() for t in held if t is not None)
    del held
    actor = worker.actor.engine
    result = {
        "old_freed": [r() is None for r in old],
        "trained_flat_params_freed": all(r() is None for r in trained_flat),
        "old_flat_param_bytes": old_flat_bytes,
        "orphan_flat_param_bytes": memory.orphan_flat_params(gc.get_objects())["bytes"],
        "optimizer_state": len(actor.optimizer.state),
        "scheduler_step": actor.lr_scheduler.last_epoch,
        "actor_is_start": equal(weights(actor), start),
        "ref_is_ref_dir": equal(weights(worker.ref.engine), ref_dir),
        "ref_forward_only": bool(ref_cfg.engine.forward_only),
        "ref_offload": bool(ref_cfg.engine.param_offload),
    }
    result.update(
        {
            "critic_optimizer_state": len(critic.engine.optimizer.state),
            "critic_is_start": equal(weights(critic.engine), start / "critic"),
        }
    )

    def as_fresh(e, fresh):
        after = step(e, 3)
        return after == step(fresh, 3) and all(
            torch.equal(a, b) for a, b in zip(weights(e).values(), weights(fresh).values())
        )

    result["step_as_fresh"] = as_fresh(actor, engine(actor_cfg, start))
    result["critic_step_as_fresh"] = as_fresh(critic.engine, critic_engine(start / "critic"))
    (workdir / "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
