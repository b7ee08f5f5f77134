"""``eval.backend: vllm``: the validation pass sampled by vLLM's offline engine on a GPU.

Same episodes, prompts, env service and ``eval.json`` as ``fedagent eval`` on CPU
(:func:`fedagent.evaluate.validation.evaluate`); only the sampler differs: :class:`VllmSampler` has
:func:`fedagent.model.policy.sample`'s signature and result, stops at the same token ids, and
seeds every request with ``derive_seed(base_seed, "eval_sampling", epoch=<call>, index=<i>)``,
the same every round, so the model is the only thing that changes between rounds.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from fedagent.model.policy import Generation
from fedagent.core.seeds import derive_seed


@dataclass(frozen=True)
class VllmEvalSettings:
    """``eval.vllm`` keys."""

    gpu_memory_utilization: float = 0.3
    dtype: str = "float32"  # the global model's own precision
    enforce_eager: bool = False
    kv_cache_gb: float | None = None  # fixed KV cache (GiB): no memory profiling (GPU shared with other jobs)


class VllmSampler:
    """A :func:`fedagent.model.policy.sample` stand-in over a vLLM ``LLM`` (or anything with its ``generate``)."""

    def __init__(self, llm, stop_ids: Sequence[int], base_seed: int, sampling_params_cls=None):
        self.llm = llm
        self.stop_ids = [int(i) for i in stop_ids]
        self.base_seed = int(base_seed)
        self.calls = 0
        self.first_token_time: float | None = None  # wall clock when the first batch came back
        self.tokens = 0  # response tokens produced
        if sampling_params_cls is None:
            from vllm import SamplingParams as sampling_params_cls
        self.sp = sampling_params_cls

    def __call__(
        self, model, tokenizer, prompts, max_new_tokens: int, temperature: float, generator
    ) -> list[Generation]:
        prompt_ids = [[int(t) for t in p] for p in prompts]
        params = [
            self.sp(
                temperature=float(temperature),
                max_tokens=int(max_new_tokens),
                stop_token_ids=self.stop_ids,
                seed=derive_seed(self.base_seed, "eval_sampling", epoch=self.calls, index=i) % 2**31,
            )
            for i in range(len(prompt_ids))
        ]
        self.calls += 1
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        if self.first_token_time is None:
            self.first_token_time = time.time()
        stops = set(self.stop_ids)
        gens = []
        for p, o in zip(prompt_ids, outs):
            r = [int(t) for t in o.outputs[0].token_ids][:max_new_tokens]
            self.tokens += len(r)
            done = bool(r) and r[-1] in stops
            body = r[:-1] if done else r
            gens.append(
                Generation(
                    prompt_ids=p, response_ids=r, text=tokenizer.decode(body, skip_special_tokens=True), finished=done
                )
            )
        return gens


def make_llm(model_dir: Path, settings: VllmEvalSettings, base_seed: int):
    """vLLM's offline engine over the model dir (its engine process is spawned: call from a guarded main)."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM

    from fedagent.model.memory import kv_cache_bytes

    kv = {"kv_cache_memory_bytes": kv_cache_bytes(settings.kv_cache_gb)} if settings.kv_cache_gb is not None else {}
    return LLM(
        model=str(model_dir),
        dtype=settings.dtype,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enforce_eager=settings.enforce_eager,
        seed=int(base_seed) % 2**31,
        tensor_parallel_size=1,
        **kv,
    )
