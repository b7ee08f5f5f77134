"""The verl backend (``train.backend: verl``): one verl GRPO job per client per round.

- :mod:`.settings`: the backend's knobs (``train.verl``).
- :mod:`.overrides`: the job's Hydra overrides against verl's ``ppo_trainer`` config.
- :mod:`.job_files`: the dataset rows and agent-loop YAML the job's loops read.
- :mod:`.launch`: per-job isolation (dirs, Ray, IPC names), the trainer process.
- :mod:`.agent_loop`: the windowed multi-turn agent loop verl runs (imports verl).
- :mod:`.ray_hook`: Ray worker setup hook salting verl's IPC socket names with the job tag.
- :mod:`.convert`: verl's FSDP checkpoint → the fp32 client-update dir (no bf16 round trip).
- :mod:`.backend`: the job: rows → verl → conversion → update dir (the job epilogue the local
  backend writes with too, :mod:`fedagent.train.epilogue`).
"""
