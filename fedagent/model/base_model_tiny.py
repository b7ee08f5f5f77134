"""A tiny randomly initialised Llama model (SmolLM2's architecture family) for tests.

The tokenizer is built offline and deterministically: a byte-level BPE (SmolLM2's
pre-tokenizer and decoder) whose merges are learned here by a small pure-Python BPE over a
fixed built-in corpus, ties broken lexicographically, so every machine builds the same
``tokenizer.json``. Special tokens and the chat template are SmolLM2's (ChatML), so the
rest of the code cannot tell the tiny model from the real one. Converting the real
SmolLM2 tokenizer from its GGUF takes ≈30 s, too slow for a test fixture; pass
``--tokenizer DIR`` to reuse an existing HF tokenizer directory instead.

Weights come from :func:`fedagent.core.seeds.torch_generator` draws, never the global RNG.
"""

from __future__ import annotations

# First, before torch loads libgomp: OMP_WAIT_POLICY (fedagent.core.openmp says why the order matters).
from fedagent.core import openmp  # noqa: F401 - imported for its effect

import argparse
import json
from collections import Counter
from pathlib import Path


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# SmolLM2-135M-Instruct's chat template (ChatML with a default system turn).
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Words the agent sees and writes: the prompt template, TextWorld-ish commands, the tags.
_CORPUS = """
You are an expert agent operating in a text-based game. Your task is to: find the key and
open the chest. Prior to this step, you have already taken 2 step(s). Below are the most
recent 2 observations and the corresponding actions you took: [Observation 1: 'You are in
the kitchen.', Action 1: 'go north'] You are now at step 3 and your current observation is:
You see a table, a door, a box. Your admissible actions of the current situation are:
'go north', 'go south', 'go east', 'go west', 'take key', 'open chest', 'look', 'inventory',
'examine table', 'drop apple', 'eat apple', 'put key in box', 'unlock door with key'.
Now it's your turn to take an action. You should first reason step-by-step about the
current situation. This reasoning process MUST be enclosed within <think> </think> tags.
Once you've finished your reasoning, you should choose an admissible action for current step
and present it within <action> </action> tags.
<think>I should take the key first.</think><action>take key</action>
The room is dark. You won! Nothing happens. The door is locked. You open the chest.
"""

_VOCAB_MERGES = 320
# Larger than the usual 0.02 so the random model's outputs depend on context and position
# (at 0.02 greedy decoding just repeats one token and padding bugs go unnoticed).
INIT_STD = 0.15


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _learn_merges(words: list[str], n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE over pre-tokenized words; most frequent pair first, ties lexicographic."""
    counts = Counter(words)
    seqs = {w: list(w) for w in counts}
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in counts.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        if pairs[best] < 2:
            break
        merges.append(best)
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def build_tokenizer():
    """The deterministic tiny byte-level BPE tokenizer (a transformers fast tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = [w for w, _ in pre.pre_tokenize_str(_CORPUS)]
    merges = _learn_merges(words, _VOCAB_MERGES)
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(_bytes_to_unicode().values()):
        vocab[ch] = len(vocab)
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(
    vocab_size: int,
    seed: int,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_positions: int = 4096,
):
    """A LlamaForCausalLM (tied embeddings) with weights drawn from a seed-derived generator."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedagent.core.seeds import torch_generator

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    gen = torch_generator(seed, "tiny_model_init")
    state = {}
    # Sorted names: the draw order (hence the weights) never depends on module traversal.
    for name, tensor in sorted(model.state_dict().items()):
        if name.endswith("norm.weight") or "layernorm" in name:
            state[name] = torch.ones_like(tensor)
        else:
            state[name] = torch.randn(tensor.shape, generator=gen, dtype=torch.float32) * INIT_STD
    model.load_state_dict(state, strict=False)
    model.eval()
    return model


def write_tiny_model(
    out_dir: Path, seed: int, quarantine: Path | None = None, tokenizer_dir: Path | None = None, critic_args=None
) -> Path:
    """Build tokenizer + model and write them atomically as an fp32 HF directory.

    ``critic_args`` (``--critic*`` flags): PPO's round-1 critic too (fedagent.model.critic).
    """
    from transformers import AutoTokenizer

    from fedagent.core.atomic import atomic_dir
    from fedagent.model.policy import save_policy

    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed)
    from fedagent.core.provenance import write_provenance

    with atomic_dir(Path(out_dir), quarantine) as staging:
        save_policy(model, tokenizer, staging)
        from fedagent.model.critic import critic_from_args

        critic = critic_from_args(critic_args, staging, "tiny") if critic_args is not None else None
        write_provenance(
            staging,
            job="base_model",
            params={"source": "tiny", "seed": seed},
            seeds={"base_seed": seed},
            **({"extra": {"critic": critic}} if critic else {}),
        )
    return Path(out_dir)


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent tiny-model``."""
    parser.add_argument("--out", type=Path, required=True, help="output HF model directory")
    parser.add_argument("--seed", type=int, required=True, help="base seed of the weight draws")
    parser.add_argument("--quarantine", type=Path, default=None, help="where failed attempts go")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="reuse this HF tokenizer directory instead of the built-in tiny BPE",
    )
    from fedagent.model.critic import add_critic_args

    add_critic_args(parser)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent tiny-model``."""
    out = write_tiny_model(args.out, args.seed, args.quarantine, args.tokenizer, critic_args=args)
    print(json.dumps({"model": str(out)}))
    return 0
