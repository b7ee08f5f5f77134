"""Batched sampling on one GPU: a static KV cache and a compiled decode step (the GPU fast path).

:func:`fedagent.policy.sample` is the CPU path: a dynamic cache, one host sync per token, and
byte-for-byte reproducible for a fixed thread count. On a GPU that loop is bound by launch
overhead and host syncs, so :class:`StaticSampler` keeps every shape fixed for the whole job:

- the batch is padded to ``batch_size`` rows (padding rows repeat row 0; their tokens are
  dropped) and every prompt is left-padded to ``max_prompt_tokens`` columns;
- one :class:`transformers.StaticCache` of ``max_prompt_tokens + max_new_tokens`` slots is
  reset in place and reused by every call, with one 2-D attention mask of that full length
  (the causal mask hides the slots not yet written, so the mask is constant while decoding);
- the one-token decode step is ``torch.compile``'d (``mode="reduce-overhead"``: CUDA graphs),
  so a step is one graph replay; compiled once per job, and the compiled artefacts land in
  the inductor cache dir (``TORCHINDUCTOR_CACHE_DIR``) that a run's jobs share;
- sampling runs on the device from a CUDA generator seeded from the caller's (derived) seed;
  tokens are collected on the device and copied to the host once; whether every row has
  stopped is checked every ``sync_every`` steps, never per token.

The same code runs on the CPU with ``compile=False`` (the tests check it against the CPU
sampler's greedy output on a tiny model).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from fedagent.policy import Generation, stop_token_ids


class StaticSampler:
    """A callable with :func:`fedagent.policy.sample`'s signature, bound to one model and shape."""

    def __init__(self, model, tokenizer, *, batch_size: int, max_prompt_tokens: int, max_new_tokens: int,
                 compile: bool = True, sync_every: int = 8):
        from transformers import StaticCache

        if batch_size < 1 or max_prompt_tokens < 1 or max_new_tokens < 1:
            raise ValueError("batch_size, max_prompt_tokens and max_new_tokens must be >= 1")
        self.model = model
        self.device = next(model.parameters()).device
        self.batch_size = int(batch_size)
        self.width = int(max_prompt_tokens)
        self.max_new_tokens = int(max_new_tokens)
        self.sync_every = max(1, int(sync_every))
        self.cache = StaticCache(config=model.config, max_cache_len=self.width + self.max_new_tokens)
        self.stops = torch.tensor(stop_token_ids(model, tokenizer), dtype=torch.long, device=self.device)
        self.pad_id = int(tokenizer.pad_token_id)
        self._decode = (torch.compile(self._decode_step, mode="reduce-overhead", fullgraph=False)
                        if compile else self._decode_step)
        # transformers < 5 took explicit cache positions; 5.x static layers count their own.
        import inspect

        self._cache_pos_arg = "cache_position" in inspect.signature(type(model).forward).parameters
        self._cuda_gen = None
        self.first_token_time: float | None = None    # wall clock of the first sampled token
        self.calls = 0
        self.tokens = 0                                # response tokens produced (real rows only)

    @torch.no_grad()
    def _decode_step(self, tok, pos, cache_pos, mask):
        extra = {"cache_position": cache_pos} if self._cache_pos_arg else {}
        out = self.model(input_ids=tok, position_ids=pos, attention_mask=mask, past_key_values=self.cache,
                         use_cache=True, **extra)
        return out.logits[:, -1, :]

    def _generator(self, generator: torch.Generator | None):
        if generator is None:
            return None
        if generator.device == self.device:
            return generator
        # A device generator seeded from the caller's derived seed plus how many calls came
        # before, so each call of a job draws fresh yet reproducible randomness.
        if self._cuda_gen is None:
            self._cuda_gen = torch.Generator(device=self.device)
        self._cuda_gen.manual_seed((generator.initial_seed() + 1_000_003 * self.calls) % (2**63))
        return self._cuda_gen

    def _pick(self, logits, temperature: float, gen):
        logits = logits.float()
        # A row with non-finite logits would make the sampling kernel assert on the device (an
        # unreadable crash). Flag it on the device, sample that row from zeros, and raise a
        # clear error at the next host sync (no extra sync per token).
        finite = torch.isfinite(logits).all(dim=-1)
        self._bad |= ~finite
        logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))
        if temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / float(temperature), dim=-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(1)

    def _check_finite(self, step: int) -> None:
        if bool(self._bad.any()):
            rows = self._bad.nonzero().flatten().tolist()
            raise FloatingPointError(f"non-finite logits (NaN/inf) by decode step {step} in batch rows {rows} "
                                     f"of sampler call {self.calls}: the rollout weights or activations are broken")

    @torch.no_grad()
    def __call__(self, model, tokenizer, prompts: Sequence[Sequence[int] | str], max_new_tokens: int,
                 temperature: float, generator: torch.Generator | None) -> list[Generation]:
        """Sample one answer per prompt (at most ``batch_size`` prompts per call)."""
        if model is not self.model:
            raise ValueError("StaticSampler is bound to the model it was built for")
        if not prompts:
            return []
        if temperature > 0 and generator is None:
            raise ValueError("sampling with temperature > 0 needs a local torch.Generator")
        if max_new_tokens > self.max_new_tokens:
            raise ValueError(f"max_new_tokens {max_new_tokens} > the sampler's {self.max_new_tokens}")
        prompt_ids = [
            list(tokenizer.encode(p, add_special_tokens=False)) if isinstance(p, str) else [int(t) for t in p]
            for p in prompts
        ]
        n = len(prompt_ids)
        if n > self.batch_size:
            raise ValueError(f"{n} prompts > the sampler's batch size {self.batch_size}")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("empty prompt")
        if any(len(p) > self.width for p in prompt_ids):
            raise ValueError(f"a prompt is longer than max_prompt_tokens={self.width}")
        gen = self._generator(generator)
        self.calls += 1
        self._bad = torch.zeros(self.batch_size, dtype=torch.bool, device=self.device)
        rows = prompt_ids + [prompt_ids[0]] * (self.batch_size - n)
        B, W, N = self.batch_size, self.width, self.max_new_tokens
        ids = torch.full((B, W), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, W + N), dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, W - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, W - len(p):] = 1        # prompt tokens, then every generated slot
        pos = (mask[:, :W].cumsum(dim=1) - 1).clamp(min=0)
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        self.cache.reset()   # in place: the compiled step keeps seeing the same cache tensors
        extra = {"cache_position": torch.arange(W, device=self.device)} if self._cache_pos_arg else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1, **extra)
        logits = out.logits[:, -1, :]
        del out
        next_pos = pos[:, -1:] + 1
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        finished[n:] = True                  # padding rows never hold the loop open
        tokens = torch.full((B, max_new_tokens), self.pad_id, dtype=torch.long, device=self.device)
        for step in range(max_new_tokens):
            tok = self._pick(logits, temperature, gen)
            tok = torch.where(finished, torch.full_like(tok, self.pad_id), tok)
            tokens[:, step] = tok
            finished = finished | torch.isin(tok, self.stops)
            if self.first_token_time is None:
                torch.cuda.synchronize(self.device) if self.device.type == "cuda" else None
                self.first_token_time = time.time()
            if step == max_new_tokens - 1:
                break
            if (step + 1) % self.sync_every == 0:
                self._check_finite(step)
                if bool(finished.all()):
                    break
            logits = self._decode(tok[:, None].clone(), next_pos.clone(),
                                  torch.tensor([W + step], device=self.device), mask).clone()
            next_pos = next_pos + 1
        self._check_finite(max_new_tokens)
        host = tokens.cpu().tolist()
        stop_set = set(self.stops.tolist())
        gens = []
        for p, r in zip(prompt_ids, host[:n]):
            resp = []
            for t in r:
                resp.append(t)
                if t in stop_set:
                    break
            # A row that stopped early holds pad ids after its stop token: cut above. A row
            # cut by the length cap holds exactly the tokens it sampled.
            resp = resp[:max_new_tokens]
            done = bool(resp) and resp[-1] in stop_set
            body = resp[:-1] if done else resp
            self.tokens += len(resp)
            gens.append(Generation(prompt_ids=p, response_ids=resp,
                                   text=tokenizer.decode(body, skip_special_tokens=True), finished=done))
        return gens
