"""The verl backend (``train.backend: verl``): one verl GRPO job per client per round.

- :mod:`.launch`: Hydra overrides, per-job isolation (dirs, Ray, IPC names), the trainer process.
- :mod:`.agent_loop`: the windowed multi-turn agent loop verl runs (imports verl).
- :mod:`.ray_hook`: Ray worker setup hook salting verl's IPC socket names with the job tag.
- :mod:`.convert`: verl's FSDP checkpoint → the fp32 client-update dir (no bf16 round trip).
- :mod:`.backend`: the job: rows → verl → conversion → update dir (same contract as local).
"""
