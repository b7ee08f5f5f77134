"""The files a verl job's data loader and agent loops read: the dataset rows (one per task draw, the
local backend's seeds) and the agent-loop YAML (with its per-job file, where the env address lives)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

AGENT_NAME = "fedagent_windowed"
AGENT_LOOP_TARGET = "fedagent.train.verl.agent_loop.WindowedAgentLoop"


def write_agent_loop_yaml(
    path: Path,
    *,
    env_uds: str | None,
    env_url: str | None,
    env_token: str | None,
    p,
    record_file: Path,
    history_length: int,
    job_file: Path | None = None,
    model_dir: Path | None = None,
) -> Path:
    """The agent-loop YAML verl loads (``rollout.agent.agent_loop_config_path``).

    Each entry is ``hydra.utils.instantiate``-d per episode; its extra keys become the
    loop's constructor arguments (the job's own env service, the episode budget). With ``job_file``
    the env address and record file go into that JSON instead, with the job's start model dir
    ``model_dir`` (its generation config gives the loop's stop tokens), which the loop reads per episode
    (``agent_loop.read_job_file``: verl reads this YAML once per worker; ``train.verl.warm_refit``,
    ``train.verl.engines: run``).
    """
    import yaml

    entry = {
        "name": AGENT_NAME,
        "_target_": AGENT_LOOP_TARGET,
        "env_uds": env_uds,
        "env_url": env_url,
        "env_token": env_token,
        "max_turns": int(p.max_turns),
        "max_prompt_tokens": int(p.max_prompt_tokens),
        "invalid_penalty": float(p.invalid_penalty),
        "history_length": int(history_length),
        "answer_format": str(p.answer_format),
        "record_file": str(record_file),
    }
    if job_file is not None:
        from fedagent.core.atomic import atomic_write_text

        if model_dir is None:
            raise ValueError("an agent-loop job file needs the job's start model dir")
        per_job = {
            **{k: entry.pop(k) for k in ("env_uds", "env_url", "env_token", "record_file")},
            "model_dir": str(model_dir),
        }
        atomic_write_text(Path(job_file), json.dumps(per_job, sort_keys=True) + "\n")
        entry["job_file"] = str(job_file)
    Path(path).write_text(yaml.safe_dump([entry], sort_keys=True))
    return Path(path)


def task_rows(p, round: int, client: int) -> list[dict]:
    """One verl dataset row per task draw: the same seeds as the local backend, in order.

    The prompt is a placeholder the agent loop never reads (the env service gives the
    observation); verl's dataset needs a chat message to build its batch.
    """
    from fedagent.train.local import epoch_task_seeds

    rows = []
    for epoch in range(int(p.epochs)):
        for g, seed in enumerate(epoch_task_seeds(p, round, client, epoch)):
            rows.append(
                {
                    "data_source": "fedagent",
                    "prompt": [{"role": "user", "content": f"task seed {seed}"}],
                    "ability": "agent",
                    "agent_name": AGENT_NAME,
                    "reward_model": {"style": "rule", "ground_truth": ""},
                    # round/client/epoch/group + base_seed: the agent loop's per-request sampling seeds
                    "extra_info": {
                        "seed": int(seed),
                        "epoch": epoch,
                        "group": g,
                        "round": int(round),
                        "client": int(client),
                        "base_seed": int(p.base_seed),
                        "index": len(rows),
                    },
                }
            )
    return rows


def write_rows(path: Path, rows: Sequence[dict]) -> Path:
    """The rows as parquet (verl's dataset format)."""
    import pandas as pd

    pd.DataFrame(list(rows)).to_parquet(path)
    return Path(path)
