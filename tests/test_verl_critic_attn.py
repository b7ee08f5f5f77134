"""fedagent.train.verl.critic_attn: verl's critic loads with the config's attention, not flash_attention_2."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

pytest.importorskip("verl.utils.model")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fedagent.train.verl import critic_attn  # noqa: E402


def _critic_dir(path):
    from transformers import AutoModelForTokenClassification, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_labels=1,
    )
    torch.manual_seed(0)
    AutoModelForTokenClassification.from_config(cfg).save_pretrained(path)
    return path


def _load_like_verl(local_path):
    """``FSDPEngine._build_module``'s value-model branch (verl 0.9.1 transformer_impl.py)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(local_path, attn_implementation="sdpa")  # verl's override_config
    assert hf_config._attn_implementation == "sdpa"
    from verl.utils.model import load_valuehead_model

    hf_config.num_labels = 1
    hf_config.classifier_dropout = 0.0
    hf_config.hidden_dropout = "0"
    hf_config.summary_dropout_prob = 0.0
    return load_valuehead_model(
        local_path=local_path, torch_dtype=torch.float32, model_config=hf_config, trust_remote_code=False
    )


@pytest.fixture
def verl_model():
    import verl.utils.model as vmodel

    original = vmodel.load_valuehead_model
    yield vmodel
    vmodel.load_valuehead_model = original


def _check(model):
    from transformers import LlamaForTokenClassification

    assert isinstance(model, LlamaForTokenClassification)
    assert model.config.num_labels == 1 and model.score.out_features == 1
    assert model.config._attn_implementation == "sdpa"


def test_armed_after_import_loads_with_config_attention(tmp_path, verl_model, capsys):
    local = str(_critic_dir(tmp_path / "critic"))
    original = verl_model.load_valuehead_model  # verl's own (the fixture restores it)
    assert original is not critic_attn.load_valuehead_model
    critic_attn.arm()
    assert critic_attn.armed_line() in capsys.readouterr().out
    assert verl_model.load_valuehead_model is critic_attn.load_valuehead_model
    _check(_load_like_verl(local))
    critic_attn.arm()  # idempotent: still ours, verl's kept
    assert verl_model.load_valuehead_model is critic_attn.load_valuehead_model
    assert critic_attn.load_valuehead_model.__wrapped__ is original


def test_armed_before_import(tmp_path, verl_model, capsys, monkeypatch):
    local = str(_critic_dir(tmp_path / "critic"))
    import verl.utils

    monkeypatch.setattr(verl.utils, "model", verl_model)  # restored after the re-import below
    monkeypatch.delitem(sys.modules, "verl.utils.model")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    critic_attn.arm()
    assert critic_attn.armed_line() not in capsys.readouterr().out  # nothing to patch yet
    fresh = importlib.import_module("verl.utils.model")
    assert critic_attn.armed_line() in capsys.readouterr().out
    assert fresh.load_valuehead_model is critic_attn.load_valuehead_model
    _check(_load_like_verl(local))


def test_unpatched_verl_needs_flash_attn(tmp_path, verl_model):
    """verl's own loader asks for flash_attention_2 whatever the config says (the bug armed away)."""
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn installed: verl's hard-coded flash_attention_2 would load")
    local = str(_critic_dir(tmp_path / "critic"))
    assert not getattr(verl_model.load_valuehead_model, "_fedagent_critic_attn", False)
    with pytest.raises(RuntimeError, match="is not a value head model") as err:
        _load_like_verl(local)
    assert "FlashAttention2" in str(err.value.__cause__)  # the cause: the forced flash_attention_2


def test_attn_implementation_choice():
    class C:
        _attn_implementation = None

    assert critic_attn.attn_implementation(C()) == "sdpa"
    C._attn_implementation = "flash_attention_2"
    assert critic_attn.attn_implementation(C()) == "flash_attention_2"
    C._attn_implementation = "eager"
    assert critic_attn.attn_implementation(C()) == "eager"
