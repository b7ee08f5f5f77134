"""GPU memory: the sizes a job asks of the card (vLLM's KV cache)."""

from __future__ import annotations


def kv_cache_bytes(gb: float) -> int:
    """GiB → vLLM's ``kv_cache_memory_bytes`` (a positive whole number of bytes)."""
    if not gb > 0:
        raise ValueError(f"kv_cache_gb must be > 0, got {gb}")
    return int(float(gb) * 2**30)
