"""bench/gpu_throughput.py's training step on the CPU with a tiny model: the LoRA modes time a LoRA
client's step (adapters trained, the base frozen, no weight-gradient FLOPs of the base counted), the
others the full fine-tune's. The bench's figures are GPU figures; this checks what it times."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_throughput", REPO / "bench" / "gpu_throughput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.B = 4  # rows per step (the bench's --batch)
    return mod


def _step(bench, model_dir, mode):
    return bench.bench_train(model_dir, 1, 1.0, mode, seq=24, resp=8, micro=2, lora_rank=4, device="cpu")


def test_the_lora_modes_train_only_adapters_and_count_no_base_weight_gradients(bench, tiny_dir):
    full = _step(bench, tiny_dir, "eager_ckpt")
    lora = _step(bench, tiny_dir, "eager_ckpt_lora")
    assert full["trained_params"] == full["params"]
    assert lora["lora_rank"] == 4 and "lora_rank" not in full
    assert lora["params"] == full["params"], "the frozen base is the whole model"
    assert 0 < lora["trained_params"] < full["params"] / 10, lora["trained_params"]
    # 4 instead of 6 FLOPs per base weight and token; attention's are the same in both
    assert lora["flops_per_step"] < full["flops_per_step"]
    for row in (full, lora):
        assert row["step_s"] > 0 and row["micro_batch_rows"] == 2


def test_lora_ops_counts_the_adapters_operators_per_layer():
    """bench/lora_ops.py: a LoRA client's micro-batch runs more operators than the full fine-tune's, in
    proportion to the layers (the adapters' own products, casts and gradients), and peft's input casting
    off runs fewer again."""
    spec = importlib.util.spec_from_file_location("lora_ops", REPO / "bench" / "lora_ops.py")
    ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    one = {v: ops.count(v, 1, 2, 16) for v in ("full", "lora", "lora_nocast")}
    assert one["lora"] > one["full"] and one["lora_nocast"] < one["lora"], one
    # the extra operators grow by the same number with each layer (the adapters are per layer)
    extra = [ops.count("lora", n, 2, 16) - ops.count("full", n, 2, 16) for n in (1, 2, 3)]
    assert extra[0] > 0 and extra[2] - extra[1] == extra[1] - extra[0] > 0, extra
