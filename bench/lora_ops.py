"""Benchmark: operators a training micro-batch launches, the full fine-tune against a LoRA client.

    python bench/lora_ops.py [--layers 4] [--rows 8] [--seq 64] [--json OUT]

LoRA's step on the GPU is bound by the host (docs/results/lora.md, "Where LoRA's step time goes"): it
launches more kernels than the full fine-tune's, each costing the host tens of microseconds. This counts,
on the CPU, the leaf ATen operators (those that call no other ATen operator: on a GPU each is a kernel
launch) of one checkpointed forward + backward under bf16 autocast, of a random Llama-shaped model (the
count per layer does not depend on the width), for:

- full:        the fine-tune's micro-batch (fp32 weights cast by autocast, activation checkpointing);
- lora:        a LoRA client's (the base's linear weights bf16, fresh rank-16 adapters on every projection,
               as fedagent.train.lora_client.LoraClient makes them on a GPU);
- lora_nocast: the same with peft's input casting off (``peft.helpers.disable_input_dtype_casting``: peft
               casts each adapter's input to the factors' fp32 and autocast casts it back).

A count of operators, not a time: the host's cost per operator is measured on the GPU by
``bench/gpu_throughput.py --profile``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def leaf_ops(model, rows: int, seq: int, vocab: int) -> int:
    """Leaf ATen operators of one forward + backward of ``model`` on ``rows`` × ``seq`` tokens."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids, use_cache=False).logits
        logits.float().sum().backward()
    return sum(
        1
        for e in prof.events()
        if e.name.startswith("aten::") and not any(c.name.startswith("aten::") for c in e.cpu_children)
    )


def build(variant: str, layers: int):
    import torch

    from fedagent.model.base_model_tiny import build_model
    from fedagent.model.lora import LoraSettings, add_adapters
    from fedagent.train.actor import bf16_reference, checkpoint_activations

    vocab = 512
    model = build_model(vocab, seed=0, layers=layers)  # the tiny model's Llama shape, seeded weights
    if variant != "full":  # the GPU path's LoRA client: the base's linear weights bf16, then the adapters
        bf16_reference(model)
        add_adapters(model, LoraSettings(rank=16, alpha=32.0), torch.Generator().manual_seed(1))
    checkpoint_activations(model)
    model.train()
    return model, vocab


def count(variant: str, layers: int, rows: int, seq: int) -> int:
    import contextlib

    from peft.helpers import disable_input_dtype_casting

    model, vocab = build(variant, layers)
    ctx = disable_input_dtype_casting(model) if variant == "lora_nocast" else contextlib.nullcontext()
    with ctx:
        return leaf_ops(model, rows, seq, vocab)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    out = {"layers": args.layers, "rows": args.rows, "seq": args.seq, "leaf_ops": {}}
    for v in ("full", "lora", "lora_nocast"):
        out["leaf_ops"][v] = count(v, args.layers, args.rows, args.seq)
    ops = out["leaf_ops"]
    out["lora_over_full"] = round(ops["lora"] / ops["full"], 3)
    out["nocast_saves"] = round(1 - ops["lora_nocast"] / ops["lora"], 4)
    out["lora_extra_per_layer"] = (ops["lora"] - ops["full"]) / args.layers
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
