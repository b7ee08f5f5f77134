"""Policy: reproducible batched sampling with a local generator, left padding, save/load."""

from __future__ import annotations

import pytest
import torch

from fake_env import build_tiny_model
from fedagent.model.policy import load_policy, sample, save_policy
from fedagent.core.seeds import torch_generator


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    d = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=11)
    return load_policy(d, threads=1)


def _prompts(tok):
    texts = [
        "go",
        "You are in the kitchen. There is a table and a key here, take it",
        "Your admissible actions of the current situation are: 'go north', 'take key', 'look' and more",
    ]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def test_same_generator_seed_same_tokens_different_seed_different(policy):
    model, tok = policy
    ps = _prompts(tok)
    a = sample(model, tok, ps, 12, 1.0, torch_generator(5, "t"))
    b = sample(model, tok, ps, 12, 1.0, torch_generator(5, "t"))
    c = sample(model, tok, ps, 12, 1.0, torch_generator(6, "t"))
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    assert [g.response_ids for g in a] != [g.response_ids for g in c]


def test_sampling_never_touches_global_rng(policy):
    model, tok = policy
    before = torch.get_rng_state()
    sample(model, tok, _prompts(tok), 6, 1.0, torch_generator(1, "t"))
    assert torch.equal(before, torch.get_rng_state())
    with pytest.raises(ValueError):
        sample(model, tok, _prompts(tok), 6, 1.0, None)


def test_left_padded_batch_equals_one_by_one(policy):
    model, tok = policy
    ps = _prompts(tok)
    assert len({len(p) for p in ps}) == 3
    batched = sample(model, tok, ps, 10, 0.0, None)
    for p, g in zip(ps, batched):
        single = sample(model, tok, [p], 10, 0.0, None)[0]
        assert g.prompt_ids == p
        assert g.response_ids == single.response_ids


def test_left_padded_forward_matches_unpadded_logits(policy):
    from fedagent.model.policy import _left_pad

    model, tok = policy
    ps = _prompts(tok)
    ids, mask, pos = _left_pad(ps, int(tok.pad_token_id))
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        for i, p in enumerate(ps):
            alone = model(input_ids=torch.tensor([p])).logits[0, -1]
            assert torch.allclose(batched[i], alone, atol=1e-4), i


def test_stops_at_stop_token_per_sequence(policy, monkeypatch):
    model, tok = policy
    ps = _prompts(tok)
    free = sample(model, tok, ps, 8, 0.0, None)
    first = free[0].response_ids[0]
    if any(first in g.response_ids for g in free[1:]):
        pytest.skip("greedy outputs share the chosen stop token")
    monkeypatch.setattr("fedagent.model.policy.stop_token_ids", lambda m, t: [first])
    out = sample(model, tok, ps, 8, 0.0, None)
    assert out[0].response_ids == [first] and out[0].finished and out[0].text == ""
    assert [g.response_ids for g in out[1:]] == [g.response_ids for g in free[1:]]
    assert not any(g.finished for g in out[1:])


def test_save_policy_roundtrip_fp32(policy, tmp_path):
    model, tok = policy
    save_policy(model, tok, tmp_path / "m")
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "m" / f).is_file()
    m2, t2 = load_policy(tmp_path / "m", threads=1, verify=False)
    assert all(p.dtype == torch.float32 for p in m2.parameters())
    assert t2.padding_side == "left" and t2.chat_template
    ps = _prompts(tok)
    assert [g.response_ids for g in sample(m2, t2, ps, 6, 0.0, None)] == [
        g.response_ids for g in sample(model, tok, ps, 6, 0.0, None)
    ]


def test_tiny_model_cli_is_deterministic(tmp_path):
    import argparse
    import hashlib
    import json

    from fedagent.model import base_model_tiny
    from fedagent.core.atomic import verify_manifest

    parser = argparse.ArgumentParser()
    base_model_tiny.add_args(parser)
    digests = []
    for name in ("a", "b"):
        assert base_model_tiny.run(parser.parse_args(["--out", str(tmp_path / name), "--seed", "3"])) == 0
        verify_manifest(tmp_path / name)
        digests.append(
            {
                f: hashlib.sha256((tmp_path / name / f).read_bytes()).hexdigest()
                for f in ("model.safetensors", "tokenizer.json", "config.json")
            }
        )
    assert digests[0] == digests[1]
    base_model_tiny.run(parser.parse_args(["--out", str(tmp_path / "c"), "--seed", "4"]))
    assert (
        hashlib.sha256((tmp_path / "c" / "model.safetensors").read_bytes()).hexdigest()
        != digests[0]["model.safetensors"]
    )
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"]
    model, tok = load_policy(tmp_path / "a", threads=1)
    assert (
        tok.chat_template
        and tok.decode(tok.encode("<think>go</think><action>take key</action>"))
        == "<think>go</think><action>take key</action>"
    )


def test_load_policy_refuses_a_model_whose_bytes_differ_from_its_manifest(tmp_path):
    """The manifest is checked while the weights load (in a thread): a flipped byte still stops the
    load, naming the file, before the caller gets a model."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(build_tiny_model(tmp_path / "m", seed=11), bad)
    f = bad / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x01  # a tensor byte: safetensors still parses the file
    f.write_bytes(bytes(data))
    with pytest.raises(Exception, match="model.safetensors"):
        load_policy(bad, threads=1)
    load_policy(bad, threads=1, verify=False)  # the file itself loads: only the manifest refuses it
