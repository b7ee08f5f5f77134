"""What a model directory's safetensors headers say, read without torch: tensor names and shapes,
and whether the weights hold a scalar value head (a PPO critic).

The plan-time config check asks this of ``train.ppo.critic_path``, so it lives below the config;
the critic model itself (building, loading, saving) is :mod:`fedagent.model.critic`.
"""

from __future__ import annotations

import json
from pathlib import Path

HEAD_WEIGHT, HEAD_BIAS = "score.weight", "score.bias"
# Value-head namings accepted in a critic checkpoint → ours (TRL: AutoModelForCausalLMWithValueHead).
HEAD_NAMINGS = {"score": (HEAD_WEIGHT, HEAD_BIAS), "trl": ("v_head.summary.weight", "v_head.summary.bias")}
HEAD_TENSORS = frozenset(n for pair in HEAD_NAMINGS.values() for n in pair)
NO_HEAD_HINT = "score.weight [1, hidden], or TRL's v_head.summary.weight [1, hidden], in its safetensors"
HIDDEN_PROBE = "model.embed_tokens.weight"  # [vocab, hidden] of the backbone, when it has that name
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


def safetensors_names(model_dir: Path) -> dict[str, list[int]] | None:
    """Tensor name → shape from the safetensors headers of a model dir (single file or sharded).

    Uses safetensors' own header reader (no tensor data, no torch). None when undeterminable:
    no safetensors weights (e.g. only a pickled ``.bin``), or a corrupt header / index.
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    try:
        if (model_dir / INDEX_FILE).is_file():
            files = sorted(set(json.loads((model_dir / INDEX_FILE).read_text())["weight_map"].values()))
        elif (model_dir / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            return None
        out: dict[str, list[int]] = {}
        for name in files:
            with safe_open(str(model_dir / name), framework="numpy") as fh:
                for key in fh.keys():
                    out[key] = list(fh.get_slice(key).get_shape())
        return out
    except Exception:  # noqa: BLE001 - any unreadable header/index is "undeterminable", never a guess
        return None


def value_head_naming(names: dict[str, list[int]]) -> str | None:
    """Which :data:`HEAD_NAMINGS` entry holds a scalar value head (weight [1, H], bias [1] or none,
    H = the backbone's hidden size when ``model.embed_tokens.weight`` says it), or None.

    Both namings at once is ambiguous: None.
    """
    hidden = names.get(HIDDEN_PROBE, [None, None])[-1]
    found = []
    for naming, (wn, bn) in HEAD_NAMINGS.items():
        w, b = names.get(wn), names.get(bn)
        if w is None and b is None:
            continue
        fits = (
            w is not None
            and len(w) == 2
            and w[0] == 1
            and (hidden is None or w[1] == hidden)
            and (b is None or b == [1])
        )
        found.append(naming if fits else None)
    return found[0] if len(found) == 1 else None


def has_value_head(model_dir: Path) -> bool | None:
    """True if the dir's weights hold a scalar value head (``score.weight`` [1, H], ``score.bias`` [1],
    or TRL's ``v_head.summary.*`` of those shapes: :func:`value_head_naming`).

    False for a plain policy (``lm_head``) or any other head; None when undeterminable (see
    :func:`safetensors_names`), which callers treat as "no".
    """
    names = safetensors_names(model_dir)
    if names is None:
        return None
    return value_head_naming(names) is not None
