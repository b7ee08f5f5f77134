"""eval.backend=vllm: the vLLM sampler adapter (a fake engine on CPU; vLLM itself needs a GPU).

Same prompts as the CPU path, the local stop set, one seed per request from derive_seed that
is the same every round, the stop token kept in the response but not in the text.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fake_env import FakeEnv, build_tiny_model

from fedagent.evaluate.validation import EvalParams, evaluate
from fedagent.evaluate.vllm import VllmSampler
from fedagent.model.policy import load_tokenizer, stop_token_ids_for_dir
from fedagent.rollout.prompts import encode_prompt, windowed_prompt
from fedagent.core.seeds import derive_seed


class FakeSP:
    def __init__(self, **kw):
        self.kw = kw


class FakeLLM:
    """Answers "<target action>" + <|im_end|> for every prompt; records requests."""

    def __init__(self, tok, answer):
        self.tok, self.answer, self.requests = tok, answer, []

    def generate(self, prompts, params, use_tqdm=False):
        self.requests.append((prompts, params))
        ids = self.tok.encode(self.answer, add_special_tokens=False) + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids)]) for _ in prompts]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m")
    return d, load_tokenizer(d)


def run_eval(tiny, rnd):
    d, tok = tiny
    llm = FakeLLM(tok, "x</think><action>take key</action>")
    stops = stop_token_ids_for_dir(tok, d)
    sampler = VllmSampler(llm, stops, base_seed=5, sampling_params_cls=FakeSP)
    p = EvalParams(base_seed=5, max_turns=2, max_new_tokens=30, pool_size=8, batch=8)
    out = evaluate(None, tok, FakeEnv(mode="index", max_turns=2), list(range(6)), p, round=rnd, sampler=sampler)
    return out, llm, stops


def test_vllm_sampler_prompts_seeds_stops(tiny):
    _, tok = tiny
    out, llm, stops = run_eval(tiny, 1)
    prompts, params = llm.requests[0]
    env = FakeEnv(mode="index")
    env.create("s")
    r = env.reset("s", 0)
    assert prompts[0]["prompt_token_ids"] == encode_prompt(
        tok,
        windowed_prompt(r["task"], r["observation"], r["admissible_commands"], [], template=r["prompt_template"]),
        p_max := 1024,
    )
    assert p_max == EvalParams().max_prompt_tokens
    assert [q.kw["seed"] for q in params] == [
        derive_seed(5, "eval_sampling", epoch=0, index=i) % 2**31 for i in range(6)
    ]
    assert all(
        q.kw["stop_token_ids"] == stops and q.kw["max_tokens"] == 30 and q.kw["temperature"] == 0.4 for q in params
    )
    assert tok.convert_tokens_to_ids("<|im_end|>") in stops
    # fake-002 (seed 2) wins with "take key" on turn 1; the others play 2 turns and lose.
    won = {s["seed"]: s["won"] for s in out["samples"]}
    assert won[2] and not won[0] and out["n"] == 6
    assert [s["actions"][0] for s in out["samples"]] == ["take key"] * 6
    again, llm2, _ = run_eval(tiny, 7)  # another round: the same request seeds
    assert [q.kw["seed"] for q in llm2.requests[0][1]] == [q.kw["seed"] for q in params]
    assert again["samples"] == out["samples"]


def test_make_llm_passes_a_fixed_kv_cache_only_when_asked(monkeypatch, tmp_path):
    """eval.vllm.kv_cache_gb → vLLM's kv_cache_memory_bytes (no memory profiling); unset → vLLM sizes it."""
    import sys
    import types

    from fedagent.evaluate.vllm import VllmEvalSettings, make_llm

    seen = []
    fake = types.ModuleType("vllm")
    fake.LLM = lambda **kw: seen.append(kw) or "llm"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    assert make_llm(tmp_path, VllmEvalSettings(kv_cache_gb=2.0), base_seed=3) == "llm"
    assert seen[-1]["kv_cache_memory_bytes"] == 2 * 2**30
    make_llm(tmp_path, VllmEvalSettings(), base_seed=3)
    assert "kv_cache_memory_bytes" not in seen[-1]
