"""``fedagent train-client``: one client's local round, with its own env service.

The job starts the environment service over the client's shard (``partition.json`` →
``{"clients": {"<c>": [task ids]}}``) in draw mode, in a work dir beside the output's
staging dir, trains (:func:`fedagent.train.local.train_client`) and writes the update dir.
"""

from __future__ import annotations

# First, before torch loads libgomp: OMP_WAIT_POLICY (fedagent.core.openmp says why the order matters).
from fedagent.core import openmp  # noqa: F401 - imported for its effect

import argparse
import json
import os
from pathlib import Path


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent train-client``."""
    parser.add_argument("--model", type=Path, required=True, help="start model (HF dir with manifest)")
    parser.add_argument("--ref-model", type=Path, required=True, help="KL reference model (HF dir with manifest)")
    parser.add_argument("--games", type=Path, required=True, help="games directory (plan/games)")
    parser.add_argument("--partition", type=Path, required=True, help="partition.json")
    parser.add_argument("--client", type=int, required=True)
    parser.add_argument("--round", type=int, required=True)
    parser.add_argument("--params", required=True, help="JSON object of train params (see TrainParams)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--env-params", default="{}", help="JSON object of this client's env knobs (WebShop: its environment arm)"
    )
    parser.add_argument("--out", type=Path, required=True, help="output update dir")
    parser.add_argument("--quarantine", type=Path, default=None, help="where failed attempts go")
    parser.add_argument(
        "--backend",
        choices=("local", "verl"),
        default="local",
        help="local: this process (CPU); verl: one verl job (FSDP + vLLM + Ray, GPUs)",
    )
    parser.add_argument("--verl", default="{}", help="JSON object of verl settings (see VerlSettings)")


def client_shard(partition_file: Path, client: int) -> list[str]:
    """The task ids of one client from ``partition.json``; a missing or empty shard is an error."""
    part = json.loads(Path(partition_file).read_text())
    shard = part.get("clients", {}).get(str(client))
    if not shard:
        raise ValueError(f"{partition_file}: client {client} has no tasks")
    return list(shard)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent train-client``: a CUDA out-of-memory error exits with one message naming
    the knobs (:func:`fedagent.model.memory.oom_names_the_knobs`)."""
    from fedagent.model import determinism
    from fedagent.model.memory import oom_names_the_knobs

    log_gpu_ask()
    with oom_names_the_knobs("train-client"), determinism.guard("train-client"):
        return _run(args)


def log_gpu_ask() -> None:
    """A GPU job (its rule asked FEDAGENT_JOB_GPUS > 0 of the scheduler) logs, as its first line and before
    anything touches CUDA, the cards it was given: which card a job ran on is then in its log (Slurm
    hands each job its own in CUDA_VISIBLE_DEVICES). A CPU job logs nothing here."""
    try:
        gpus = int(os.environ.get("FEDAGENT_JOB_GPUS") or 0)
    except ValueError:
        gpus = 0
    if gpus > 0:
        print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}", flush=True)


def _run(args: argparse.Namespace) -> int:
    """The train-client job itself."""
    from fedagent.train.local import TrainParams, train_client
    from fedagent.train.transformed_update import TRANSFORM_RECORD, from_params

    raw = json.loads(args.params)
    # The workflow passes the backend inside --params (so a local run's params stay as they were).
    backend = raw.pop("backend", args.backend)
    verl_json = json.dumps(raw.pop("verl")) if "verl" in raw else args.verl
    ref_anchor = raw.pop("ref_anchor", None)  # verl jobs check it with their keys; --ref-model is the reference
    # A Byzantine client's upload (fedagent.train.update_transform): in --params for those clients only.
    transform = from_params(raw.pop(TRANSFORM_RECORD, None))
    if backend not in ("local", "verl"):
        raise ValueError(f"train backend must be 'local' or 'verl', got {backend!r}")
    params = TrainParams.from_dict(raw)
    env_params = json.loads(args.env_params)
    if not isinstance(env_params, dict):
        raise ValueError("--env-params must be a JSON object")
    shard = client_shard(args.partition, args.client)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if backend == "verl":
        from fedagent.train.verl.backend import check_job_keys

        check_job_keys(
            {
                "backend": backend,
                "ref_anchor": ref_anchor or "round",
                "kl_coef": params.kl_coef,
                "fedprox_mu": params.fedprox_mu,
                "rollout_mode": params.rollout_mode,
                "algorithm": params.algorithm,
                "mini_batch_size": params.mini_batch_size,
                "group_size": params.group_size,
                "groups_per_epoch": params.groups_per_epoch,
                "clip_ratio_c": params.clip_ratio_c,
                "activation_checkpointing": params.activation_checkpointing,
                "deterministic": params.deterministic,
                "lora": params.lora,
            }
        )
        return _run_verl(args, params, shard, out, verl_json, env_params, transform)
    with client_env_service(
        args, params, shard, out, env_params, pool_size=params.pool_size, env_procs=params.env_procs, wait=False
    ) as pending:
        # The service starts while train_client loads the model; it health-gates it after.
        metrics = train_client(
            args.model,
            args.ref_model,
            _LogArm(pending),
            round=args.round,
            client=args.client,
            params=params,
            threads=args.threads,
            out_dir=out,
            quarantine=args.quarantine,
            transform=transform,
        )
    # The learning signal too: with keep.client_updates false the update dir (and its metrics.json)
    # is gone after aggregation, and the job log is what is left to diagnose a flat curve with.
    print(json.dumps({"out": str(out), **{k: metrics[k] for k in LOGGED_METRICS if k in metrics}}))
    return 0


# What a train-client job's log line carries of its metrics.json (the GPU runs keep no client updates).
LOGGED_METRICS = (
    "num_samples",
    "mean_return",
    "success_rate",
    "invalid_rate",
    "kl",
    "groups",
    "groups_nonzero_advantage",
    "group_wins",
    "by_epoch",
    "samples_nonzero_reward",
    "wall_time_s",
    "update_transform",
)


class _LogArm:
    """A pending env service whose ``ready()`` also prints the env's arm into the job log."""

    def __init__(self, pending):
        self.pending = pending

    def ready(self):
        return log_env_info(self.pending.ready())


def client_env_service(args: argparse.Namespace, params, shard: list[str], out: Path, env_params: dict, **kwargs):
    """The job's env service over the client's shard in draw mode, beside ``out`` (either backend);
    ``kwargs``: what the backends start differently (pool size, worker processes, waiting)."""
    from fedagent.envs.lifecycle import job_env_service
    from fedagent.plan.tasks import games_kind

    return job_env_service(
        args.games,
        "train",
        shard,
        out,
        mode="draw",
        max_turns=params.max_turns,
        client_id=str(args.client),
        answer_format=params.answer_format,
        projection=params.projection,
        source=games_kind(args.games),
        env_params=env_params or None,
        **kwargs,
    )


def log_env_info(env):
    """Print the env's arm into the job log; return ``env``."""
    print(json.dumps({"env_info": env.health().get("env_info", {})}), flush=True)
    return env


def verl_settings(text: str):
    """``--verl`` JSON → :class:`fedagent.train.verl.settings.VerlSettings` (unknown keys are an error)."""
    from fedagent.core.config import dataclass_from_dict
    from fedagent.train.verl.settings import VerlSettings

    d = dict(json.loads(text))
    for key in ("extra_overrides", "cudagraph_capture_sizes"):
        if d.get(key) is not None:
            d[key] = tuple(d[key])
    s = dataclass_from_dict(VerlSettings, d, "train.verl")
    if (
        s.gpus < 1
        or (s.gpu_memory_utilization is not None and not 0 < s.gpu_memory_utilization <= 1)
        or s.vllm_executor not in ("mp", "uni")
        or s.reward_workers < 1
        or s.storage_units < 1
        or s.engines not in ("job", "run")
        or s.engine_sets < 1
        or not s.engines_idle_s > 0
        or not s.engines_max_growth_gb > 0
    ):
        raise ValueError(f"bad train.verl settings: {s}")
    if s.engines == "run" and s.warm_refit:
        raise ValueError(
            "train.verl.engines: run and train.verl.warm_refit: the probe refits inside one job, the "
            "engine sets across jobs; choose one"
        )
    return s


def _run_verl(
    args: argparse.Namespace, params, shard: list[str], out: Path, verl_json: str, env_params: dict, transform=None
) -> int:
    """The verl backend: same env service, then one verl job (fedagent.train.verl.backend)."""
    from fedagent.train.verl.backend import train_client_verl

    settings = verl_settings(verl_json)
    # verl plays every rollout of a step at once: one env session each.
    pool = max(params.pool_size, params.groups_per_epoch * params.group_size)
    with client_env_service(args, params, shard, out, env_params, pool_size=pool) as env:
        log_env_info(env)
        metrics = train_client_verl(
            args.model,
            args.ref_model,
            env.address,
            round=args.round,
            client=args.client,
            params=params,
            settings=settings,
            out_dir=out,
            quarantine=args.quarantine,
            transform=transform,
        )
    print(
        json.dumps(
            {
                "out": str(out),
                "backend": "verl",
                "num_samples": metrics["num_samples"],
                "mean_return": metrics["mean_return"],
                "success_rate": metrics["success_rate"],
                "wall_time_s": metrics["wall_time_s"],
            }
        )
    )
    return 0
