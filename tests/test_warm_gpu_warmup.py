"""The standby's GPU warm-up (fedagent.warm.gpu_warmup), run on the CPU: what it warms and that a job
after it starts from the RNG state a freshly forked process has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedagent.model.base_model_tiny import write_tiny_model
from fedagent.report.config_show import effective_config
from fedagent.warm.gpu_warmup import Shapes, architecture_dir, shapes_from_config, warm_up

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "m"
    write_tiny_model(out, seed=4)
    return out


def test_the_gpu_preset_warms_its_train_and_eval_shapes():
    config, _ = effective_config(
        REPO / "config" / "config.yaml", [REPO / "config" / "experiments" / "gpu-textworld.yaml"], []
    )
    s = shapes_from_config(config)
    assert s.model_dir == Path("results") / "gpu-textworld" / "round_000" / "model"
    assert s.train == {"pool": 64, "width": 512, "new_tokens": 16, "micro": 32, "sampler": "graph"}
    assert s.eval == {"batch": 64, "width": 512, "new_tokens": 16, "sampler": "graph"}
    assert s.source == "smollm2"


def test_smollm2_architecture_comes_from_the_gguf_without_the_model(tmp_path, gguf_reads):
    # What a standby warms before round 0's model exists: SmolLM2-135M's shapes, no quantization
    # record (as the base model's config.json), and its chat tokenizer; the GGUF read once (its
    # config and its tokenizer's two loads share one read: smollm2_gguf.gguf_read_once).
    from fedagent.model.policy import load_tokenizer

    reads = gguf_reads
    s = Shapes(tmp_path / "not-yet" / "model", None, None, source="smollm2")
    with architecture_dir(s, give_up=lambda: True) as arch:
        assert arch is not None and arch != s.model_dir
        assert len(reads) == 1, reads
        cfg = json.loads((arch / "config.json").read_text())
        assert {
            k: cfg[k]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "vocab_size",
                "tie_word_embeddings",
            )
        } == {
            "hidden_size": 576,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
        }
        assert "quantization_config" not in cfg
        assert load_tokenizer(arch).chat_template
    assert not arch.exists()  # a temporary dir, removed after the warm-up


def test_without_a_source_the_architecture_is_round_0s_model(tiny_dir, tmp_path):
    s = Shapes(tmp_path / "m", None, None, source=None)
    with architecture_dir(s, give_up=lambda: True) as arch:
        assert arch is None  # not there, and the server is gone
    s = Shapes(Path(tiny_dir), None, None, source="smollm2")
    with architecture_dir(s, give_up=lambda: True) as arch:
        assert arch == Path(tiny_dir)  # the model itself once it exists


def test_a_cpu_run_warms_nothing_on_cuda():
    config, _ = effective_config(REPO / "config" / "config.yaml", [], [])
    s = shapes_from_config(config)
    assert s.train is None and s.eval is None


def test_the_warm_up_leaves_the_rng_state_as_it_found_it(tiny_dir):
    # Its 1-layer model is initialized from torch's global generator: a job forked after it must
    # see the same global RNG state as one forked without it.
    torch.manual_seed(123)
    before = torch.get_rng_state()
    parts = warm_up(
        Shapes(
            Path(tiny_dir),
            {"pool": 4, "width": 24, "new_tokens": 3, "micro": 2, "sampler": "eager"},
            {"batch": 4, "width": 24, "new_tokens": 3, "sampler": "eager"},
        ),
        device="cpu",
    )
    assert set(parts) == {"model", "train", "eval"}
    assert torch.equal(torch.get_rng_state(), before)
