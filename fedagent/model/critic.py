"""The PPO value model: the policy backbone + a scalar value head, as an HF dir ``critic/``.

Layout (``fedagent.model.critic_dir``): every PPO model-like directory — the global model of a round
(``round_<r>/model/``), a client update, an aggregate — holds the critic's counterpart in a
``critic/`` subdirectory, covered by the parent's manifest. The critic is an
``AutoModelForTokenClassification`` with ``num_labels=1`` (tensors ``model.*`` of the backbone +
``score.weight`` [1, hidden] + ``score.bias`` [1]; the reference's verl critic has the same names)
with its classifier dropout off.

Round 1's critic is built with the base model (``fedagent base-model`` / ``tiny-model
--critic``): :func:`resolve_start_critic` picks, in order, an explicit ``train.ppo.critic_path``
(must hold a value head, else :class:`~fedagent.core.config.ConfigError`), the critic beside a
warm-start model (``<model>/critic``), or a fresh head on the base backbone (a loud warning when
the base is a trained fedagent model: its policy is warm, its value baseline would be noise).
A value head is detected from the tensor names in the safetensors headers (never from
config.json, which says ``...ForCausalLM`` or ``...ForTokenClassification`` whatever the weights).
Two namings are accepted: ours (``score.weight`` [1, H], ``score.bias`` [1]) and TRL's
``AutoModelForCausalLMWithValueHead`` checkpoints (``v_head.summary.weight`` [1, H],
``v_head.summary.bias`` [1], beside the backbone and usually the policy's ``lm_head``), whose head
is renamed to ``score.*`` on loading (the LM head dropped) when its shapes fit the backbone.

No torch at import. The header-only reads (:func:`~fedagent.core.weights.has_value_head`, which runs
at plan time in the config check) are :mod:`fedagent.core.weights`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fedagent.core.architectures import is_random_source
from fedagent.core.config import MODEL_KEYWORDS, ConfigError, JobKeys
from fedagent.core.weights import (
    HEAD_NAMINGS,
    HEAD_TENSORS,
    INDEX_FILE,
    NO_HEAD_HINT,  # noqa: F401 - re-exported
    SINGLE_FILE,
    has_value_head,
    safetensors_names,
    value_head_naming,
)
from fedagent.model.critic_dir import CRITIC_DIR

# critic_init values recorded in provenance.json (the reference's names)
EXPLICIT, SIBLING, FRESH = "explicit", "auto-sibling", "fresh-value-head"

# The base-model job's critic parameters, checked as planning checked them (config.CROSS_RULES).
CRITIC_KEYS = JobKeys("critic-init", {"algorithm": "train.algorithm", "critic_path": "train.ppo.critic_path"})


def check_job_keys(values: dict) -> None:
    """The critic-init parameters' checks (ConfigError naming the key), before any work."""
    CRITIC_KEYS.check(values)


def resolve_start_critic(source: str, critic_path: str | None) -> tuple[str, Path | None, str]:
    """Round 1's critic: ``(critic_init, path or None, message)`` for base model ``source``.

    Order: explicit ``critic_path`` (must hold a value head: ConfigError) > ``<source>/critic``
    when ``source`` is a local model dir (a warm start off another run's global model; must hold a
    value head) > a fresh head on the base backbone. The message says which, loudly (a boxed
    warning) when a warm start off a trained fedagent model ends up with a fresh head.
    """
    if critic_path is not None:
        p = Path(critic_path)
        if not p.is_dir():
            raise ConfigError(f"config key 'train.ppo.critic_path': {critic_path!r} is not a directory")
        if has_value_head(p) is not True:
            raise ConfigError(
                f"config key 'train.ppo.critic_path': {critic_path!r} holds no value head "
                f"({NO_HEAD_HINT}); omit the key to start a fresh head"
            )
        return EXPLICIT, p, f"critic: explicit train.ppo.critic_path {p}"
    if source not in MODEL_KEYWORDS and not is_random_source(source):
        sib = Path(source) / CRITIC_DIR
        if sib.is_dir():
            if has_value_head(sib) is not True:
                raise ConfigError(
                    f"config key 'model': the critic beside it, {sib}, holds no value head "
                    f"({NO_HEAD_HINT}); set train.ppo.critic_path or remove that directory"
                )
            return SIBLING, sib, f"critic: the critic beside the start model, {sib}"
        if (Path(source) / "server.json").is_file():
            bar = "!" * 78
            return (
                FRESH,
                None,
                (
                    f"{bar}\n[warn] PPO warm start from {source} (a trained fedagent global model) with a FRESH\n"
                    f"[warn] value head: no {sib} and no train.ppo.critic_path. The policy is warm but\n"
                    "[warn] its value baseline is random, so GAE advantages are noise until the critic\n"
                    "[warn] catches up. Remedies: set train.ppo.critic_path to a trained critic, or start\n"
                    f"[warn] from a model dir that holds one in critic/.\n{bar}"
                ),
            )
    return FRESH, None, "critic: fresh value head on the base backbone (expected for a pretrained base)"


def backbone_mismatch(actor_dir: Path, critic_dir: Path) -> str | None:
    """Why ``critic_dir``'s backbone cannot pair with ``actor_dir``'s (names/shapes), or None."""
    actor, critic = safetensors_names(actor_dir), safetensors_names(critic_dir)
    if actor is None or critic is None:
        return f"cannot read the safetensors headers of {actor_dir if actor is None else critic_dir}"
    back_a = {k: v for k, v in actor.items() if not k.startswith("lm_head.")}
    # a TRL checkpoint also carries the policy's lm_head: the critic drops it on loading
    back_c = {k: v for k, v in critic.items() if k not in HEAD_TENSORS and not k.startswith("lm_head.")}
    if back_a != back_c:
        diff = sorted(set(back_a) ^ set(back_c))
        shapes = [k for k in back_a if k in back_c and back_a[k] != back_c[k]]
        return f"backbone tensors differ from the policy's: names {diff[:4]}, shapes {shapes[:4]}"
    return None


def _token_classifier_config(actor_config):
    import copy

    cfg = copy.deepcopy(actor_config)
    cfg.num_labels = 1
    cfg.classifier_dropout = 0.0  # verl's critic turns it off too; we score in eval mode anyway
    cfg.architectures = None
    return cfg


def fresh_critic(actor_dir: Path, seed: int):
    """The policy backbone of ``actor_dir`` + a value head drawn from ``torch_generator(seed,
    "value_head_init")``: weight ~ N(0, initializer_range), bias 0 (HF's own init, seeded)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from fedagent.core.seeds import torch_generator

    actor = AutoModelForCausalLM.from_pretrained(str(actor_dir), dtype=torch.float32, use_safetensors=True)
    cfg = _token_classifier_config(actor.config)
    critic = AutoModelForTokenClassification.from_config(cfg, dtype=torch.float32)
    getattr(critic, critic.base_model_prefix).load_state_dict(actor.base_model.state_dict(), strict=True)
    gen = torch_generator(seed, "value_head_init")
    std = float(getattr(cfg, "initializer_range", 0.02))
    with torch.no_grad():
        critic.score.weight.copy_(torch.randn(critic.score.weight.shape, generator=gen, dtype=torch.float32) * std)
        if critic.score.bias is not None:
            critic.score.bias.zero_()
    critic.eval()
    return critic


def load_critic(critic_dir: Path, device: str = "cpu"):
    """An fp32 critic from an HF dir (safetensors only), eval mode, on ``device``.

    A TRL checkpoint (``v_head.summary.*``) is rebuilt as our token classifier: backbone as is,
    its head as ``score.*``, the LM head dropped (loaded strictly, so nothing else may differ).
    """
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    names = safetensors_names(critic_dir)
    naming = value_head_naming(names) if names is not None else None
    if naming is None:
        raise ValueError(f"{critic_dir}: no value head ({NO_HEAD_HINT})")
    if naming == "score":
        critic = AutoModelForTokenClassification.from_pretrained(
            str(critic_dir), dtype=torch.float32, use_safetensors=True, classifier_dropout=0.0
        )
    else:
        from safetensors.torch import load_file

        cfg = _token_classifier_config(AutoConfig.from_pretrained(str(critic_dir)))
        critic = AutoModelForTokenClassification.from_config(cfg, dtype=torch.float32)
        files = (
            sorted({f for f in json.loads((Path(critic_dir) / INDEX_FILE).read_text())["weight_map"].values()})
            if (Path(critic_dir) / INDEX_FILE).is_file()
            else [SINGLE_FILE]
        )
        rename = dict(zip(HEAD_NAMINGS[naming], HEAD_NAMINGS["score"]))
        state = {}
        for name in files:
            for k, t in load_file(str(Path(critic_dir) / name)).items():
                if not k.startswith("lm_head."):
                    state[rename.get(k, k)] = t.to(torch.float32)
        critic.load_state_dict(state, strict=True)
    critic.to(device=device, dtype=torch.float32)
    critic.eval()
    return critic


def save_critic(critic, out_dir: Path) -> None:
    """Write the critic as an fp32 safetensors HF dir (config.json + weights)."""
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    critic.to(device="cpu", dtype=torch.float32).save_pretrained(str(out_dir))


def write_start_critic(actor_dir: Path, out_dir: Path, *, source: str, critic_path: str | None, seed: int) -> dict:
    """Write round 1's critic for the policy just saved in ``actor_dir`` (a staging dir).

    Returns the record for provenance.json: ``{critic_init, start_critic, value_head_seed}``.
    The explicit / sibling critic is re-saved fp32 (aggregate refuses mixed dtypes) after its
    backbone is checked against the policy's.
    """
    check_job_keys({"algorithm": "ppo", "critic_path": critic_path})
    mode, path, message = resolve_start_critic(source, critic_path)
    print(message, file=sys.stderr, flush=True)
    if path is None:
        critic = fresh_critic(actor_dir, seed)
    else:
        problem = backbone_mismatch(actor_dir, path)
        if problem:
            raise ConfigError(
                f"config key '{'train.ppo.critic_path' if mode == EXPLICIT else 'model'}': critic {path}: {problem}"
            )
        critic = load_critic(path)
    save_critic(critic, out_dir)
    return {
        "critic_init": mode,
        "start_critic": str(path) if path is not None else None,
        "value_head_seed": seed if path is None else None,
    }


def add_critic_args(parser) -> None:
    """``--critic``, ``--critic-seed``, ``--critic-path`` of ``fedagent base-model`` / ``tiny-model``."""
    parser.add_argument(
        "--critic",
        action="store_true",
        help="PPO: also write round 1's critic in critic/ (train.ppo.critic_path, the critic "
        "beside the source model, or a fresh value head)",
    )
    parser.add_argument("--critic-seed", type=int, default=None, help="seed of a fresh value head (the run's seed)")
    parser.add_argument("--critic-path", default=None, help="train.ppo.critic_path: an HF dir with a value head")


def critic_from_args(args, staging: Path, source: str) -> dict | None:
    """Write ``staging/critic`` when ``--critic`` was given; the provenance record, else None."""
    if not getattr(args, "critic", False):
        return None
    if args.critic_seed is None:
        raise ConfigError("--critic needs --critic-seed (the run's seed)")
    from fedagent.model.critic_dir import critic_of

    return write_start_critic(
        staging, critic_of(staging), source=source, critic_path=args.critic_path, seed=args.critic_seed
    )
