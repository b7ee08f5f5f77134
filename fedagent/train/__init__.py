"""Training backends. ``local``: GRPO with torch + transformers on CPU or one GPU."""
