"""LoRA adapters (``train.lora``): the one definition of a LoRA update, shared by the trainer that
writes it and the server step that reads it.

A LoRA client trains low-rank adapters on the round's global model, every base weight frozen: for each
adapted weight W (out × in) two factors A (r × in) and B (out × r), so that the trained model's weight
is W + ΔW with ΔW = (α / r) · B · A. Its update is the factors only — PEFT's own layout, so
``peft.PeftModel.from_pretrained(base, update_dir)`` loads a client update as it is:

- ``adapter_config.json``: ``peft.LoraConfig.save_pretrained``'s (``r``, ``lora_alpha``, ``target_modules``);
- ``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight`` (A) and ``….lora_B.weight`` (B)
  of every adapted module, fp32.

What the server reads (:func:`read_adapter`: headers only, no peft) is exactly that: the adapted weight
``<module>.weight`` of the global model, its A and B, and the scale α / r. A config asking anything else
of PEFT's LoRA family — rsLoRA's α / √r, DoRA, per-module rank or α patterns, trained biases,
``fan_in_fan_out``, extra saved modules — is refused by name, never read as plain LoRA.

The trainer's side (:func:`add_adapters`, :func:`write_adapter`, :func:`adapters_off`,
:func:`merge_into`) wraps ``peft`` (``inject_adapter_in_model``: the model stays its transformers class,
with PEFT's LoRA layers in place of the targeted projections). Two things are ours: the adapters'
initial values come from a seeded generator (:mod:`fedagent.core.seeds`), not PEFT's draw from the global
RNG, and the dropout on an adapter's input draws its masks from a seeded generator too
(:class:`SeededDropout`), in the update's forward passes only.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from fedagent.model.update_layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS  # the update's files (importable from here)

KEY_PREFIX = "base_model.model."  # PeftModel.save_pretrained's prefix of every adapter tensor
FACTOR_SUFFIX = {"A": ".lora_A.weight", "B": ".lora_B.weight"}
ADAPTER_NAME = "default"  # PEFT's name of the one adapter
# The update's metrics.json records the model its adapters were trained on: the sha256 of that model
# dir's manifest.json (the server refuses factors whose start model is not its prev).
START_MODEL_RECORD = "start_model_manifest_sha256"
# train.lora.target_modules' choices: every attention and MLP projection of the Llama / Qwen2 family
# (the schema's enum and default; a module of another family is refused by PEFT in the job, by name).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterError(ValueError):
    """An adapter update's files are not a plain LoRA adapter (the message names the file)."""


@dataclass(frozen=True)
class LoraSettings:
    """``train.lora`` as a job reads it: rank r, α, the adapters' input dropout, the targeted projections
    (module names, PEFT's ``target_modules``) and the adapters' own AdamW learning rate."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = PROJECTIONS
    lr: float = 1e-4

    @property
    def scale(self) -> float:
        """α / r: ΔW = scale · B · A."""
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> "LoraSettings":
        """From the ``train.lora`` dict (``enabled`` is the config's switch, not a setting)."""
        d = {k: v for k, v in section.items() if k != "enabled"}
        if "target_modules" in d:
            d["target_modules"] = tuple(d["target_modules"])
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown train.lora keys: {unknown} (known: {sorted(known | {'enabled'})})")
        return cls(**d)


# ---- the update's files, read without torch's model classes or peft: the server step's view


@dataclass(frozen=True)
class AdapterIndex:
    """One LoRA update as the server reads it: the scale α / r and, for each adapted weight of the
    global model (its tensor name, ``<module>.weight``), the :class:`~fedagent.model.hf_dir.TensorInfo` of
    A and B in ``adapter_model.safetensors``."""

    dir: Path
    rank: int
    alpha: float
    factors: dict = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# adapter_config.json keys whose non-default values would change what ΔW is (or add trained tensors
# beside A and B): refused when set.
_MUST_BE_OFF = ("use_rslora", "use_dora", "fan_in_fan_out", "lora_bias", "modules_to_save", "layers_to_transform")


def read_config(d: Path) -> dict:
    """``adapter_config.json`` of ``d``, checked to be plain LoRA (:class:`AdapterError` naming the key)."""
    path = Path(d) / ADAPTER_CONFIG
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path}: cannot read the adapter config ({exc})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path}: not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r}, not LORA")
    for key in _MUST_BE_OFF:
        if cfg.get(key):
            raise AdapterError(f"{path}: {key}={cfg[key]!r} is not plain LoRA (ΔW = α/r · B·A); refused")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise AdapterError(f"{path}: {key} {cfg[key]!r}: per-module ranks or α are not read; refused")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias={cfg['bias']!r}: trained biases are not part of a LoRA update here")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{path}: r={r!r} is not a rank >= 1")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{path}: lora_alpha={alpha!r} is not a number > 0")
    return cfg


def factor_key(module: str, which: str) -> str:
    """The tensor name of factor ``which`` (``A`` or ``B``) of ``module`` in ``adapter_model.safetensors``."""
    return KEY_PREFIX + module + FACTOR_SUFFIX[which]


def read_adapter(d: Path) -> AdapterIndex:
    """The update in ``d``: config checked (:func:`read_config`) and every factor's header, paired by
    module, with A (r × in) and B (out × r) of the config's rank; :class:`AdapterError` names the
    file and tensor otherwise. No tensor data is read."""
    from fedagent.model.hf_dir import FLOAT_CODES, FormatError, read_header

    d = Path(d)
    cfg = read_config(d)
    path = d / ADAPTER_WEIGHTS
    if not path.is_file():
        raise AdapterError(f"{d}: {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    try:
        header = read_header(path)
    except FormatError as exc:
        raise AdapterError(f"{path}: {exc}") from None
    pairs: dict[str, dict[str, Any]] = {}
    for key, info in header.items():
        which = next((w for w, suffix in FACTOR_SUFFIX.items() if key.endswith(suffix)), None)
        if which is None or not key.startswith(KEY_PREFIX):
            raise AdapterError(f"{path}: tensor {key!r} is not a LoRA factor ({KEY_PREFIX}<module>.lora_A/B.weight)")
        module = key[len(KEY_PREFIX) : -len(FACTOR_SUFFIX[which])]
        if info.dtype not in FLOAT_CODES or len(info.shape) != 2:
            raise AdapterError(f"{path}: tensor {key!r} is {info.dtype}{list(info.shape)}, not a float matrix")
        pairs.setdefault(module, {})[which] = info
    r = cfg["r"]
    factors = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: module {module!r} has lora_{next(iter(ab))} only")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != r or b.shape[1] != r:
            raise AdapterError(
                f"{path}: module {module!r}: A {list(a.shape)} and B {list(b.shape)} are not of rank r={r}"
            )
        factors[module + ".weight"] = (a, b)
    if not factors:
        raise AdapterError(f"{path}: no LoRA factors")
    return AdapterIndex(d, r, float(cfg["lora_alpha"]), factors)


def manifest_digest(model_dir: Path) -> str:
    """sha256 of ``model_dir``'s ``manifest.json`` bytes: which model (every file's digest) it is."""
    import hashlib

    from fedagent.core.atomic import MANIFEST

    return hashlib.sha256((Path(model_dir) / MANIFEST).read_bytes()).hexdigest()


def is_adapter(d: Path) -> bool:
    """Whether ``d`` holds a LoRA update (its ``adapter_config.json``)."""
    return (Path(d) / ADAPTER_CONFIG).is_file()


# ---- the trainer's side (torch, peft)


def lora_config(settings: LoraSettings):
    """The ``peft.LoraConfig`` of ``settings`` (plain LoRA, no bias: what :func:`read_config` accepts)."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
    )


def lora_layers(model) -> list[tuple[str, Any]]:
    """``(module name, PEFT LoRA layer)`` of every adapted module of ``model``, sorted by name."""
    from peft.tuners.lora import LoraLayer

    return sorted(((n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)), key=lambda x: x[0])


def factors(layer) -> tuple[Any, Any]:
    """The (A, B) parameters of one LoRA layer."""
    return layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight


def add_adapters(model, settings: LoraSettings, generator, dropout_generator=None) -> int:
    """Put fresh LoRA adapters on ``model``'s targeted projections (in place, through
    ``peft.inject_adapter_in_model``); every other parameter is frozen. Returns the adapters' parameter count.

    Initial values, LoRA's own: A from Kaiming-uniform (a = √5, PEFT's default init) drawn from
    ``generator`` on the CPU, module by module in sorted order, B zero — so ΔW = 0 and the adapted model
    computes exactly what ``model`` did. The factors are fp32 whatever the base weights' dtype.
    ``dropout_generator``: the seeded masks of :class:`SeededDropout`, on the model's device (needed when
    ``settings.dropout`` > 0).
    """
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(lora_config(settings), model)
    except ValueError as exc:  # PEFT's "Target modules ... not found in the base model"
        raise ValueError(f"train.lora.target_modules {list(settings.target_modules)}: {exc}") from None
    layers = lora_layers(model)
    count = 0
    with torch.no_grad():
        for _, layer in layers:
            a, b = factors(layer)
            init = torch.empty(a.shape, dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)
            for mod in (layer.lora_A[ADAPTER_NAME], layer.lora_B[ADAPTER_NAME]):
                mod.to(dtype=torch.float32)  # PEFT moves them to the base weight's dtype (bf16 on the GPU path)
            a, b = factors(layer)
            a.copy_(init.to(a.device))
            b.zero_()
            count += a.numel() + b.numel()
            if settings.dropout > 0:
                if dropout_generator is None:
                    raise ValueError("train.lora.dropout > 0 needs a seeded generator for its masks")
                layer.lora_dropout[ADAPTER_NAME] = SeededDropout(settings.dropout, dropout_generator)
    return count


class SeededDropout(torch.nn.Module):
    """Dropout on an adapter's input with masks drawn from a seeded generator (on the activations'
    device), in the update's forward passes only (autograd recording): the behaviour, reference and
    rollout passes run without it, as the actor runs the model in ``eval()`` mode. No global RNG."""

    def __init__(self, p: float, generator):
        super().__init__()
        self.p, self.generator = float(p), generator

    def forward(self, x):
        if not torch.is_grad_enabled() or self.p == 0.0:
            return x
        keep = torch.empty(x.shape, dtype=torch.float32, device=x.device).bernoulli_(
            1.0 - self.p, generator=self.generator
        )
        return x * keep.to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, seeded"


def lora_param_count(model) -> int:
    """The adapters' parameters (A and B of every adapted module)."""
    return sum(a.numel() + b.numel() for _, layer in lora_layers(model) for a, b in [factors(layer)])


def adapter_state(model) -> dict:
    """The update's tensors: every adapted module's A and B, fp32 on the CPU, under PEFT's saved names."""
    out = {}
    for name, layer in lora_layers(model):
        a, b = factors(layer)
        out[factor_key(name, "A")] = a.detach().to(device="cpu", dtype=torch.float32).contiguous()
        out[factor_key(name, "B")] = b.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return out


def write_adapter(model, settings: LoraSettings, out_dir: Path) -> dict:
    """Write the LoRA update of ``model`` into ``out_dir`` (:data:`ADAPTER_CONFIG` + :data:`ADAPTER_WEIGHTS`)
    and return what the job's metrics record of it (rank, α, the targeted projections, the adapted weights'
    count and the adapters' parameters)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = adapter_state(model)
    save_file(state, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    cfg = lora_config(settings)
    cfg.save_pretrained(str(out_dir))
    # PEFT writes the config with its own key order and version: keep only what the update means, sorted
    saved = json.loads((out_dir / ADAPTER_CONFIG).read_text())
    saved["target_modules"] = sorted(saved.get("target_modules") or [])
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return {
        "rank": settings.rank,
        "alpha": settings.alpha,
        "target_modules": sorted(settings.target_modules),
        "adapted_weights": len(state) // 2,
        "adapter_params": sum(t.numel() for t in state.values()),
    }


@contextlib.contextmanager
def adapters_off(model) -> Iterator[Any]:
    """``model`` with its adapters switched off inside the block (the base model's outputs, no copy)."""
    layers = [layer for _, layer in lora_layers(model)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class AdaptersOff:
    """The KL reference as the trained model with its adapters switched off: the same base weights
    (when the reference is the round's start model), no second copy. :meth:`scoring` yields the model
    with the adapters off for the block."""

    def __init__(self, model):
        self.model = model

    def scoring(self):
        return adapters_off(self.model)


def merge_into(target, model) -> None:
    """Write each adapted weight of ``model``, W + (α/r)·B·A computed in fp32, into the same-named
    module's weight of ``target`` (a plain copy of the base model: the GPU path's bf16 rollout copy),
    cast to its dtype. Weights of unadapted modules are left as they are (frozen: equal already)."""
    with torch.no_grad():
        for name, layer in lora_layers(model):
            a, b = factors(layer)
            w = layer.get_base_layer().weight
            delta = (b.float() @ a.float()) * float(layer.scaling[ADAPTER_NAME])
            dst = target.get_submodule(name).weight
            dst.copy_((w.float() + delta).to(dst.dtype))
