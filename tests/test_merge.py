"""fedagent.server.merge: next global model dir (FedAvg = prev + Δ̄), sharding, aux files, refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fedagent.server.aggregate import aggregate
from fedagent.core.atomic import verify_manifest
from fedagent.model.hf_dir import TensorReader, save_model_dir, tensor_index
from fedagent.server.merge import MergeError, merge
from fedagent.server.optimizers import FedAdam, FedAvg, FedAvgM
from test_aggregate import make_round


def read_model(d) -> dict[str, torch.Tensor]:
    with TensorReader() as r:
        return {n: r.read(i).clone() for n, i in tensor_index(d).items()}


def test_fedavg_merge_is_prev_plus_delta_fp32(tmp_path):
    prev, prev_dir, clients, dirs = make_round(tmp_path, 3)
    (prev_dir / "tokenizer.json").write_text("{}")  # aux files must travel (manifest not rewritten: see below)
    from fedagent.core.atomic import write_manifest

    write_manifest(prev_dir)
    aggregate(prev_dir, dirs, tmp_path / "agg")
    meta = merge(prev_dir, tmp_path / "agg", tmp_path / "next", FedAvg(), round_=1)
    assert meta["step"] == 1 and meta["round"] == 1
    verify_manifest(tmp_path / "next")
    delta = load_file(tmp_path / "agg" / "delta.safetensors")
    new = read_model(tmp_path / "next")
    for n in prev:
        assert new[n].dtype == torch.float32
        assert torch.equal(new[n], prev[n].float() + delta[n]), n
    for f in ("config.json", "tokenizer.json", "server.json", "server_state.safetensors"):
        assert (tmp_path / "next" / f).is_file(), f


def test_merge_shards_above_size_with_index(tmp_path):
    prev, prev_dir, clients, dirs = make_round(tmp_path, 2)
    aggregate(prev_dir, dirs, tmp_path / "agg")
    merge(prev_dir, tmp_path / "agg", tmp_path / "next", FedAvg(), round_=1, shard_bytes=2000)
    out = tmp_path / "next"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0].startswith("model-00001-of-")
    loaded = {}
    for s in shards:
        loaded.update(load_file(out / s))  # the official reader accepts our streamed files
    assert set(loaded) == set(prev)


def test_fedavgm_two_rounds_by_hand(tmp_path):
    prev, prev_dir, clients, dirs = make_round(tmp_path, 2)
    aggregate(prev_dir, dirs, tmp_path / "agg")
    opt = FedAvgM(lr=0.5, momentum=0.9)
    merge(prev_dir, tmp_path / "agg", tmp_path / "r1", opt, round_=1)
    merge(tmp_path / "r1", tmp_path / "agg", tmp_path / "r2", opt, round_=2, prev_state_dir=tmp_path / "r1")
    d = load_file(tmp_path / "agg" / "delta.safetensors")
    r2 = read_model(tmp_path / "r2")
    st = load_file(tmp_path / "r2" / "server_state.safetensors")
    for n in prev:
        m1 = d[n]
        w1 = prev[n].float() + 0.5 * m1
        m2 = 0.9 * m1 + d[n]
        assert torch.allclose(st[f"m/{n}"], m2, rtol=1e-6, atol=1e-7)
        assert torch.allclose(r2[n], w1 + 0.5 * m2, rtol=1e-6, atol=1e-7)


def test_merge_refuses_wrong_state(tmp_path):
    prev, prev_dir, clients, dirs = make_round(tmp_path, 2)
    aggregate(prev_dir, dirs, tmp_path / "agg")
    merge(prev_dir, tmp_path / "agg", tmp_path / "r1", FedAdam(lr=0.1), round_=1)
    with pytest.raises(MergeError, match="fedadam, this run uses fedavgm"):
        merge(tmp_path / "r1", tmp_path / "agg", tmp_path / "r2", FedAvgM(), round_=2, prev_state_dir=tmp_path / "r1")
    with pytest.raises(MergeError, match="from round 1, expected 2"):
        merge(
            tmp_path / "r1",
            tmp_path / "agg",
            tmp_path / "r3",
            FedAdam(lr=0.1),
            round_=3,
            prev_state_dir=tmp_path / "r1",
        )
    with pytest.raises(MergeError, match="hyper-parameters"):
        merge(
            tmp_path / "r1",
            tmp_path / "agg",
            tmp_path / "r2",
            FedAdam(lr=0.2),
            round_=2,
            prev_state_dir=tmp_path / "r1",
        )


def test_merge_cli(tmp_path):
    prev, prev_dir, clients, dirs = make_round(tmp_path, 2)
    aggregate(prev_dir, dirs, tmp_path / "agg")
    cmd = [
        sys.executable,
        "-m",
        "fedagent.cli",
        "merge",
        "--prev",
        str(prev_dir),
        "--aggregate",
        str(tmp_path / "agg"),
        "--prev-server-state",
        "none",
        "--server-opt",
        "fedyogi",
        "--server-lr",
        "0.01",
        "--round",
        "1",
        "--out",
        str(tmp_path / "r1"),
        "--shard-size-mb",
        "0.001",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "r1" / "server.json").read_text())["optimizer"] == "fedyogi"
    assert (tmp_path / "r1" / "model.safetensors.index.json").is_file()


def test_merged_dir_loads_in_transformers(tmp_path):
    """A real (tiny) Llama dir round-trips: aggregate + merge output loads with from_pretrained."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fedagent.core.seeds import torch_generator

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):  # names and shapes only; no global RNG touched
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    g = torch_generator(5, "hf-roundtrip")
    prev = {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    config = {**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]}
    prev_dir = save_model_dir(tmp_path / "prev", prev, config=config)
    dirs = [
        save_model_dir(
            tmp_path / f"c{i}",
            {k: v + 1e-3 * (i + 1) for k, v in prev.items()},
            config=config,
            json_files={"metrics.json": {"num_samples": 1, "num_tokens": 1}},
        )
        for i in range(2)
    ]
    aggregate(prev_dir, dirs, tmp_path / "agg")
    merge(prev_dir, tmp_path / "agg", tmp_path / "next", FedAvg(), round_=1, shard_bytes=20_000)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "next", dtype=torch.float32)
    got = model.state_dict()
    delta = load_file(tmp_path / "agg" / "delta.safetensors")
    for k in prev:
        assert torch.equal(got[k], prev[k] + delta[k]), k


def test_merge_refuses_state_dir_without_server_json(tmp_path):
    prev, prev_dir, clients, dirs = make_round(tmp_path, 2)
    aggregate(prev_dir, dirs, tmp_path / "agg")
    with pytest.raises(MergeError, match="no server.json"):
        merge(prev_dir, tmp_path / "agg", tmp_path / "r1", FedAdam(), round_=1, prev_state_dir=prev_dir)


def test_a_corrupt_delta_hashed_beside_the_step_never_reaches_the_next_model(tmp_path):
    """merge hashes its inputs in threads beside the server step (fedagent.core.atomic.verifying): a
    delta with one flipped data byte is refused by its manifest and no next-model dir appears."""
    from fedagent.core.atomic import ManifestError
    from test_aggregate import _flip_byte

    prev, prev_dir, clients, dirs = make_round(tmp_path, 2)
    aggregate(prev_dir, dirs, tmp_path / "agg")
    _flip_byte(tmp_path / "agg" / "delta.safetensors", -3)
    with pytest.raises(ManifestError, match=r"agg.*sha256"):
        merge(prev_dir, tmp_path / "agg", tmp_path / "next", FedAvg(), round_=1)
    assert not (tmp_path / "next").exists()
