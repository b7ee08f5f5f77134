"""The policy: load/save an fp32 HF causal LM and sample from it reproducibly.

``transformers``' ``generate`` draws from the global torch RNG, which fedagent forbids, so
:func:`sample` is a small batched KV-cache loop of its own (left padding, attention mask,
explicit position ids) whose only randomness is ``torch.multinomial(generator=...)`` on a
caller-provided local generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

# Chat-turn terminators that end an answer even when the tokenizer's eos says otherwise
# (SmolLM2's GGUF metadata names <|im_start|> as eos; the model itself ends with <|im_end|>).
_EXTRA_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


@dataclass
class Generation:
    """One sampled answer: the prompt and response token ids and the decoded response."""

    prompt_ids: list[int]
    response_ids: list[int]  # includes the stop token when one was produced
    text: str  # response decoded without special tokens
    finished: bool  # True iff a stop token ended it (not the length cap)


def load_policy(model_dir: Path, threads: int, *, verify: bool = True, device: str = "cpu"):
    """Load ``(model, tokenizer)`` from an HF dir: fp32, eval mode, left-padding tokenizer.

    Sets torch's intra-op thread count to ``threads`` (results are reproducible for a
    fixed thread count). ``verify`` checks the directory's manifest first. ``device``
    ("cpu" or "cuda"): where the fp32 weights live (a CUDA request without a GPU is an
    error, never a silent fall back to the CPU).
    """
    from transformers import AutoModelForCausalLM

    from fedagent.core.atomic import verifying

    torch.set_num_threads(int(threads))
    check_device(device)
    # safetensors only: a pickled checkpoint (pytorch_model.bin) in a model dir is refused, never unpickled
    # On a GPU the safetensors go straight to the device (no model built and filled on the CPU
    # first, then copied): the larger part of a GPU job's model load.
    placement = {"device_map": device} if device != "cpu" else {}
    with verifying([model_dir], enabled=verify):
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, use_safetensors=True, **placement
        )
    model.to(device=device, dtype=torch.float32)
    model.eval()
    tokenizer = load_tokenizer(model_dir)
    return model, tokenizer


def check_device(device: str) -> None:
    """``cpu`` or ``cuda`` (when a GPU is visible); anything else is an error naming it."""
    if device == "cpu":
        return
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "device 'cuda' asked for, but torch sees no GPU (CUDA_VISIBLE_DEVICES="
            f"{__import__('os').environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )


def load_tokenizer(model_dir: Path):
    """The model's tokenizer, left padding, with a pad token (padded slots are masked anyway)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        fallback = "<|endoftext|>" if "<|endoftext|>" in tokenizer.get_vocab() else tokenizer.eos_token
        tokenizer.pad_token = fallback
    return tokenizer


def stop_token_ids(model, tokenizer) -> list[int]:
    """Token ids that end an answer: tokenizer eos, generation-config eos, ChatML terminators."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in _EXTRA_STOP_TOKENS if t in vocab)
    return sorted(ids)


def stop_token_ids_for_dir(tokenizer, model_dir) -> list[int]:
    """:func:`stop_token_ids` without loading the model: the generation config of ``model_dir`` (a dir
    without one: the tokenizer's eos and the ChatML ends; a dir that does not exist: FileNotFoundError)."""
    from types import SimpleNamespace

    gen = None
    if model_dir:
        from pathlib import Path

        from transformers import GenerationConfig

        if not Path(model_dir).is_dir():  # never the default stop tokens in place of a named model's
            raise FileNotFoundError(f"stop tokens: model dir {model_dir} does not exist")

        try:
            gen = GenerationConfig.from_pretrained(str(model_dir))
        except OSError:
            gen = None  # no generation_config.json: the tokenizer's eos and the ChatML ends
    return stop_token_ids(SimpleNamespace(generation_config=gen), tokenizer)


def _left_pad(prompts: list[list[int]], pad_id: int):
    """Left-padded ids, attention mask and position ids (0 at each prompt's first token)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ids, mask, pos


@torch.no_grad()
def sample(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int] | str],
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
) -> list[Generation]:
    """Sample one answer per prompt in one batch; greedy when ``temperature == 0``.

    ``prompts`` are token id lists that already hold the chat formatting (see
    :func:`fedagent.rollout.prompts.encode_prompt`); a plain string is tokenized as is
    (no special tokens added). Each sequence stops at its first stop token or after
    ``max_new_tokens``. Sampling uses only ``generator`` (required when temperature > 0).
    """
    if not prompts:
        return []
    if temperature > 0 and generator is None:
        raise ValueError("sampling with temperature > 0 needs a local torch.Generator")
    prompt_ids = [
        list(tokenizer.encode(p, add_special_tokens=False)) if isinstance(p, str) else [int(t) for t in p]
        for p in prompts
    ]
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("empty prompt")
    stops = torch.tensor(stop_token_ids(model, tokenizer), dtype=torch.long)
    pad_id = int(tokenizer.pad_token_id)
    ids, mask, pos = _left_pad(prompt_ids, pad_id)
    batch = len(prompt_ids)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    past = out.past_key_values
    logits = out.logits[:, -1, :]
    next_pos = pos[:, -1:] + 1
    finished = torch.zeros(batch, dtype=torch.bool)
    responses: list[list[int]] = [[] for _ in range(batch)]
    for step in range(max_new_tokens):
        logits = logits.float()
        if temperature == 0:
            tok = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits / float(temperature), dim=-1)
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        tok = torch.where(finished, torch.full_like(tok, pad_id), tok)
        for i in range(batch):
            if not finished[i]:
                responses[i].append(int(tok[i]))
        finished |= torch.isin(tok, stops)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long)], dim=1)
        out = model(
            input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, past_key_values=past, use_cache=True
        )
        past = out.past_key_values
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    stop_set = set(stops.tolist())
    gens = []
    for p, r in zip(prompt_ids, responses):
        done = bool(r) and r[-1] in stop_set
        body = r[:-1] if done else r
        gens.append(
            Generation(
                prompt_ids=p, response_ids=r, text=tokenizer.decode(body, skip_special_tokens=True), finished=done
            )
        )
    return gens


def save_policy(model, tokenizer, out_dir: Path) -> None:
    """Write an fp32 safetensors HF dir: config, generation config, tokenizer, chat template."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(device="cpu", dtype=torch.float32)
    model.save_pretrained(str(out_dir))
    model.generation_config.save_pretrained(str(out_dir))
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    tokenizer.save_pretrained(str(out_dir))
    tokenizer.padding_side = padding_side
    if getattr(tokenizer, "chat_template", None) and not (out_dir / "chat_template.jinja").exists():
        (out_dir / "chat_template.jinja").write_text(tokenizer.chat_template)
