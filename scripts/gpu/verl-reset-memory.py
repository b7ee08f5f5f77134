"""verl's own FSDP engines reset again and again as a run-scoped engine set resets them: does the worker's
memory stay flat? The per-job growth's mechanism (``fedagent.train.verl.release``) measured on a GPU
without vLLM or Ray, in about a minute at 135M.

    python3 scripts/gpu/verl-reset-memory.py OUT [--model random:smollm2-135m] [--resets 4] [--ppo]
                                                 [--no-release] [--device cuda|cpu]

Builds verl 0.9.1's actor and KL-reference FSDP engines (and with ``--ppo`` the critic) from the config our
launch composes (``build_overrides`` through verl's Hydra ``ppo_trainer``: FSDP1, fp32 masters, the
reference CPU-offloaded) on a ``random:`` model written under OUT, then ``--resets`` times: one optimizer
step on each trained engine and a forward of the reference (what a fit does to them), then our
``refit.reset_engines`` (+ ``set_model_path``, ``release_model`` and verl's ``reset()`` for the critic,
as ``refit.reset_trainer``). After every step and every reset it records the device memory allocated
(``torch.cuda.memory_allocated`` after a garbage collection) and the bytes held by FSDP FlatParameters
outside a live model (``memory.orphan_flat_params``: the old models' weights). ``--no-release`` skips the
release (the reset as it was before the growth was found): expect + one fp32 model per trained engine
per reset on the device. Writes ``OUT/reset-memory.json`` (the rows, ``drift_gb``: last step's allocated
minus the first's) and prints one line per row.

``--device cpu`` (a check of this script: the suite runs it, tests/test_gpu_verl_reset_memory.py) uses the
CPU platform of tests/verl_fsdp_reset.py and a tiny model; only the FlatParameter bytes mean something there.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import sys
from argparse import Namespace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _setup(device: str, out: Path) -> None:
    import torch
    import torch.distributed as dist

    if device == "cpu":
        sys.path[:0] = [str(REPO / "tests")]
        from verl.plugin.platform import platform_manager
        from verl_fsdp_reset import cpu_platform

        platform_manager.set_platform(cpu_platform())
        import torch.distributed.fsdp._init_utils as fsdp_init
        from verl.workers.engine.fsdp import transformer_impl

        fsdp_init._check_module_states_for_sync_module_states = lambda states: None
        transformer_impl.load_fsdp_model_to_gpu = lambda module: None
        torch.Tensor.pin_memory = lambda self, *a, **k: self
        backend = "gloo"
    else:
        torch.cuda.set_device(0)
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"file://{out}/rdzv", rank=0, world_size=1)


def _model(source: str, out: Path, ppo: bool) -> Path:
    critic = Namespace(critic=True, critic_seed=2, critic_path=None) if ppo else None
    if source == "tiny":
        from fedagent.model.base_model_tiny import write_tiny_model

        return write_tiny_model(out / "model", 1, critic_args=critic)
    from fedagent.model.base_model_random import build_random_model

    build_random_model(source, out / "model", seed=1, critic_args=critic)
    return out / "model"


def _engines(model: Path, out: Path, ppo: bool):
    """verl's actor, reference (and critic) engines as verl's workers build them from our composed config."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig
    from verl.workers.engine.fsdp import transformer_impl

    sys.path[:0] = [str(REPO / "tests")]
    from verl_helpers import build_engine, compose_ppo, derive_ref_config

    from fedagent.train.local import TrainParams
    from fedagent.train.verl import critic_attn
    from fedagent.train.verl.launch import VerlJob
    from fedagent.train.verl.overrides import build_overrides
    from fedagent.train.verl.settings import VerlSettings

    p = TrainParams(
        max_prompt_tokens=64, max_new_tokens=16, group_size=2, kl_coef=0.01, algorithm="ppo" if ppo else "grpo"
    )
    cfg = compose_ppo(
        build_overrides(
            p,
            VerlSettings(),
            job=VerlJob(tag="t", workdir=out, ray_tmp=out),
            model_dir=model,
            rows=out / "r.parquet",
            agent_loop_yaml=out / "a.yaml",
            rollout_seed=0,
        )
    )
    mc = omega_conf_to_dataclass(cfg.actor_rollout_ref.model, dataclass_type=HFModelConfig)
    derive_ref_config(cfg)  # as verl's init_model derives the reference's config

    lm = transformer_impl.FSDPEngineWithLMHead
    actor = build_engine(lm, mc, omega_conf_to_dataclass(cfg.actor_rollout_ref.actor), model, "language_model")
    ref = build_engine(
        lm, copy.deepcopy(mc), omega_conf_to_dataclass(cfg.actor_rollout_ref.ref), model, "language_model"
    )
    critic = None
    if ppo:
        critic_attn.arm()  # as our Ray hook arms a PPO job's workers
        ccfg = omega_conf_to_dataclass(cfg.critic)
        critic = build_engine(
            transformer_impl.FSDPEngineWithValueHead, copy.deepcopy(ccfg.model), ccfg, model / "critic", "value_model"
        )
    return actor, ref, critic


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="random:smollm2-135m", help="a random: source, or 'tiny'")
    ap.add_argument("--resets", type=int, default=4)
    ap.add_argument("--ppo", action="store_true", help="the PPO critic too")
    ap.add_argument("--no-release", action="store_true", help="reset without releasing the old models")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    _setup(a.device, a.out.resolve())
    import torch
    from verl.workers.engine_workers import TrainingWorker

    from fedagent.train.verl import memory, refit, release

    if a.no_release:
        release.release_engine = lambda engine, role: {"role": role}
    model = _model(a.model, a.out, a.ppo)
    actor, ref, critic = _engines(model, a.out, a.ppo)

    class Training:  # verl's TrainingWorker as reset_engines uses it: .engine and verl's own reset()
        def __init__(self, e):
            self.engine = e

        def reset(self):
            TrainingWorker.reset(self)

    worker = type("ActorRolloutRefWorker", (), {})()
    worker.actor, worker.ref = Training(actor), Training(ref)
    critic_w = Training(critic) if critic is not None else None
    dev = torch.device("cuda" if a.device == "cuda" else "cpu")
    vocab, length = (100, 12) if a.model == "tiny" else (1000, 64)

    def fit(k: int) -> None:
        ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(k)).to(dev)
        with torch.no_grad():  # the reference's log-probs
            worker.ref.engine.module.eval()
            worker.ref.engine.module(input_ids=ids)
        for w in (worker.actor, critic_w):
            if w is None:
                continue
            e = w.engine
            e.module.train()
            e.optimizer_zero_grad()
            out = e.module(input_ids=ids, labels=ids) if e.model_config.model_type != "value_model" else None
            loss = out.loss if out is not None else e.module(input_ids=ids).logits.float().square().mean()
            loss.backward()
            e.optimizer_step()
            e.lr_scheduler_step()
            e.optimizer_zero_grad()  # verl's train mode zeroes the grads on exit

    def reading(what: str, k: int) -> dict:
        gc.collect()
        allocated = None
        if a.device == "cuda":
            torch.cuda.synchronize()
            allocated = round(torch.cuda.memory_allocated() / 2**30, 3)
        row = {
            "after": what,
            "job": k,
            "allocated_gb": allocated,
            "orphan_flat_param_bytes": memory.orphan_flat_params(gc.get_objects())["bytes"],
        }
        print(json.dumps(row), flush=True)
        return row

    rows = []
    for k in range(a.resets + 1):
        fit(k)
        rows.append(reading("step", k))
        if k == a.resets:
            break
        refit.reset_engines(worker, str(model), str(model))
        if critic_w is not None:  # as refit.reset_trainer: path, release, verl's reset
            refit.set_model_path(critic_w, str(model / "critic"))
            refit.release_model(critic_w)
            critic_w.reset()
        rows.append(reading("reset", k + 1))
    steps = [r for r in rows if r["after"] == "step"]
    drift = None if steps[0]["allocated_gb"] is None else round(steps[-1]["allocated_gb"] - steps[0]["allocated_gb"], 3)
    result = {
        "model": a.model,
        "ppo": a.ppo,
        "release": not a.no_release,
        "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": rows,
        "drift_gb": drift,
        "orphan_flat_param_bytes_last": steps[-1]["orphan_flat_param_bytes"],
    }
    (a.out / "reset-memory.json").write_text(json.dumps(result, indent=1))
    print(
        f"drift over {a.resets} resets: {drift} GB; FlatParameter bytes outside a live model: "
        f"{result['orphan_flat_param_bytes_last']}",
        flush=True,
    )
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
