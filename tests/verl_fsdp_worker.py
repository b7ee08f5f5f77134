"""One rank of a tiny FSDP training run on CPU (gloo) that saves with verl's own checkpoint manager.

Run by tests/test_verl_convert.py via torch.multiprocessing (world size 2, file rendezvous:
no port). Wraps the tiny model as verl's FSDP engine does (FSDP1 with a device mesh, fp32
params) or with FSDP2's fully_shard, takes two AdamW steps on rank-dependent data so the
weights leave their initial values, saves with verl's FSDPCheckpointManager, and writes the
full fp32 state dict (gathered) as the reference on rank 0.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def run(rank: int, world: int, model_dir: str, out: str, strategy: str) -> None:
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from fedagent.model.policy import load_tokenizer

    dist.init_process_group("gloo", init_method=f"file://{out}/rdzv", rank=rank, world_size=world)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        model = FSDP(
            model,
            device_mesh=mesh,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            sync_module_states=False,
            use_orig_params=False,
            device_id=torch.device("cpu"),
        )
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):
        ids = torch.randint(0, 50, (2, 12), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    cfg = OmegaConf.create({"save_contents": ["model"], "load_contents": ["model"]})
    mgr = FSDPCheckpointManager(
        model, optimizer=None, processing_class=load_tokenizer(model_dir), checkpoint_config=cfg
    )
    mgr.save_checkpoint(f"{out}/global_step_2/actor", global_step=2)

    if strategy == "fsdp":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(
            model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        ):
            full = model.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, f"{out}/reference.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
