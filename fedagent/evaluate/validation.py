"""``fedagent eval``: score a model on the fixed validation set (FACTS §7).

One episode per validation seed (index mode: seed i plays tasks[i % n]), sampled at
temperature 0.4 by default with ``torch_generator(base_seed, "eval_sampling")`` — the same
generator every round, so the model is the only thing that changes between rounds. Never
penalized. Writes ``eval.json`` atomically.
"""

from __future__ import annotations

# First, before torch loads libgomp: OMP_WAIT_POLICY (fedagent.core.openmp says why the order matters).
from fedagent.core import openmp  # noqa: F401 - imported for its effect

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from fedagent.core import placement
from fedagent.core.config import JobKeys, dataclass_from_dict


@dataclass(frozen=True)
class EvalParams:
    """Knobs of one eval job (the ``--params`` JSON of ``fedagent eval``)."""

    base_seed: int = 0
    temperature: float = 0.4
    max_turns: int = 3
    max_new_tokens: int = 40
    max_prompt_tokens: int = 1024
    pool_size: int = 8
    env_procs: int = 0  # env.procs
    batch: int = 8
    answer_format: str = "think_action"  # rollout.answer_format
    projection: str = "reference"  # rollout.projection (the env service's)
    rollout_mode: str = "windowed"  # rollout.mode (eval plays the training rollout mode)
    history: int = 2  # rollout.history
    device: str = "cpu"  # cpu | cuda (cuda: bf16 weights, compiled static-cache sampler)
    sampler: str = "compile"
    sampler_widths: list[int] = field(default_factory=list)  # cuda: the sampler's narrower widths (buckets)
    sampler_fused: bool = False  # cuda: the model's q/k/v and gate/up projections merged (one GEMM each)
    sampler_compile_prefill: bool = False  # cuda: the sampler's prefill through torch.compile too
    deterministic: bool = False  # deterministic: bit-reproducible kernels (fedagent.model.determinism)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EvalParams":
        """Build from a dict; unknown keys and bad values are errors that name them.

        Config values are checked against the schema and the cross rules (:data:`EVAL_KEYS`);
        ``batch`` is ``eval.batch``.
        """
        p = dataclass_from_dict(cls, d, "eval")
        EVAL_KEYS.check(dataclasses.asdict(p))
        if p.batch < 1:
            raise ValueError(f"eval param batch must be >= 1, got {p.batch}")
        return p


# Which config key each EvalParams field comes from (workflow/common.smk's EVAL_PARAMS).
EVAL_KEYS = JobKeys.for_dataclass(
    "eval",
    EvalParams,
    "eval",
    {
        "base_seed": "seed",
        "pool_size": "env.pool_size",
        "env_procs": "env.procs",
        "answer_format": "rollout.answer_format",
        "rollout_mode": "rollout.mode",
        "history": "rollout.history",
        "projection": "rollout.projection",
        "deterministic": "deterministic",
    },
)


# The eval job's backend, beside its params (the workflow passes it only for vllm): checked with the
# keys that depend on it, as planning checked them.
EVAL_BACKEND_KEYS = JobKeys("eval-backend", {"backend": "eval.backend", "deterministic": "deterministic"})


def wilson_interval(successes: int, n: int, z: float = 1.96) -> list[float]:
    """95% Wilson score interval of a binomial proportion ([0, 1] when n == 0)."""
    if n == 0:
        return [0.0, 1.0]
    p = successes / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return [max(0.0, center - half), min(1.0, center + half)]


def summarize(trajs: Sequence, round: int) -> dict:
    """The eval.json content from one pass of trajectories (one per validation seed)."""
    n = len(trajs)
    wins = sum(1 for t in trajs if t.won)
    per_type: dict[str, dict] = {}
    for t in trajs:
        cell = per_type.setdefault(t.task_type, {"n": 0, "wins": 0})
        cell["n"] += 1
        cell["wins"] += int(t.won)
    return {
        "round": int(round),
        "n": n,
        "success_rate": wins / n if n else 0.0,
        "score_mean": math.fsum(t.score for t in trajs) / n if n else 0.0,
        "return_mean": math.fsum(t.episode_return for t in trajs) / n if n else 0.0,
        "ci95": wilson_interval(wins, n),
        "per_task_type": {k: {"n": v["n"], "success_rate": v["wins"] / v["n"]} for k, v in sorted(per_type.items())},
        "samples": [
            {
                "seed": t.seed,
                "task_id": t.task_id,
                "task_type": t.task_type,
                "won": t.won,
                "score": t.score,
                "n_turns": t.n_turns,
                "actions": [x.action for x in t.turns],
            }
            for t in trajs
        ],
    }


def evaluate(
    model,
    tokenizer,
    env,
    seeds: Sequence[int],
    params: EvalParams,
    *,
    round: int,
    sampler=None,
    on_done=None,
    clock=None,
) -> dict:
    """Play one episode per seed with the fixed eval generator; return the eval.json dict (``on_done``:
    the job's progress count; ``clock``: the loop's time split, :func:`fedagent.rollout.episode.run_episodes`)."""
    from fedagent.rollout.episode import run_episodes_batched
    from fedagent.core.seeds import torch_generator

    gen = torch_generator(params.base_seed, "eval_sampling")
    trajs = run_episodes_batched(
        model,
        tokenizer,
        env,
        list(seeds),
        batch_size=min(params.batch, params.pool_size),
        session_prefix=f"eval-r{round}",
        max_turns=params.max_turns,
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        generator=gen,
        max_prompt_tokens=params.max_prompt_tokens,
        answer_format=params.answer_format,
        sampler=sampler,
        rollout_mode=params.rollout_mode,
        history_length=params.history,
        on_done=on_done,
        clock=clock,
    )
    out = summarize(trajs, round)
    turns = [x for t in trajs for x in t.turns]
    out["invalid_rate"] = (sum(1 for x in turns if not x.valid) / len(turns)) if turns else 0.0
    out["params"] = dataclasses.asdict(params)
    for k in ("sampler_widths", "sampler_fused", "sampler_compile_prefill", "deterministic"):
        if not out["params"][k]:  # only when set / on (eval.json of other runs as they were)
            out["params"].pop(k)
    return out


def load_val_set(path: Path) -> tuple[list[str], list[int]]:
    """``val_set.json`` → (tasks, seeds); seeds must be 0..n-1 (index mode)."""
    vs = json.loads(Path(path).read_text())
    tasks, seeds = list(vs["tasks"]), [int(s) for s in vs["seeds"]]
    if not tasks or seeds != list(range(len(seeds))):
        raise ValueError(f"{path}: expected non-empty tasks and seeds 0..n-1")
    return tasks, seeds


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent eval``."""
    parser.add_argument("--model", type=Path, required=True, help="HF model dir (with manifest)")
    parser.add_argument("--games", type=Path, required=True, help="games directory (plan/games)")
    parser.add_argument("--val-set", type=Path, required=True, help="val_set.json")
    parser.add_argument("--params", default="{}", help="JSON object of eval params (see EvalParams)")
    parser.add_argument("--round", type=int, required=True)
    parser.add_argument("--client", type=int, default=None, help="a client update's eval (eval.clients)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True, help="eval.json path")
    parser.add_argument(
        "--timings",
        type=Path,
        default=None,
        help="where to write the job's phase timings (JSON; wall clock, informational)",
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent eval``: a CUDA out-of-memory error exits with one message naming
    the knobs (:func:`fedagent.model.memory.oom_names_the_knobs`)."""
    from fedagent.model import determinism
    from fedagent.model.memory import oom_names_the_knobs

    with oom_names_the_knobs("eval"), determinism.guard("eval"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """The eval job itself."""
    from fedagent.core.atomic import atomic_write_json
    from fedagent.envs.lifecycle import job_env_service
    from fedagent.model.policy import load_policy
    from fedagent.plan.tasks import games_kind

    from fedagent.core.progress import Progress
    from fedagent.core.timing import PhaseClock

    clock = PhaseClock()
    raw = json.loads(args.params)
    # The workflow passes the backend inside --params only for vllm (local evals' params stay as they were).
    backend = raw.pop("backend", "local")
    # warm_start.enabled: what round 0's model is (base | warm_start), recorded in eval.json
    label = raw.pop("label", None)
    if label not in (None, "base", "warm_start"):
        raise ValueError(f"eval label must be 'base' or 'warm_start', got {label!r}")
    vllm_settings = raw.pop("vllm", None)
    # model: random:<architecture>: the run's weights are random; eval.json says so
    random_weights = raw.pop("random_weights", None)
    if backend not in ("local", "vllm"):
        raise ValueError(f"eval backend must be 'local' or 'vllm', got {backend!r}")
    params = EvalParams.from_dict(raw)
    EVAL_BACKEND_KEYS.check({"backend": backend, "deterministic": params.deterministic})
    det_flags = None
    if params.deterministic:  # the kernels pinned before any model is loaded (eval_timings.json records them)
        from fedagent.model import determinism

        det_flags = determinism.enable(params.device)
    tasks, seeds = load_val_set(args.val_set)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Validation always runs on the unperturbed env: no env params (no WebShop arm) here. The
    # service starts first and comes up while this process loads (and warms) the model. The progress
    # line counts from here (loading included): episodes done of the validation set.
    job = "eval" if args.client is None else f"eval_client/{args.client}"
    with (
        Progress(job, "episodes", len(seeds)) as progress,
        job_env_service(
            args.games,
            "val",
            tasks,
            out,
            mode="index",
            pool_size=params.pool_size,
            max_turns=params.max_turns,
            answer_format=params.answer_format,
            projection=params.projection,
            source=games_kind(args.games),
            env_procs=params.env_procs,
            wait=False,
        ) as pending,
    ):
        sampler = None
        if backend == "vllm":
            from fedagent.core.atomic import verify_manifest
            from fedagent.evaluate.vllm import VllmEvalSettings, VllmSampler, make_llm
            from fedagent.model.policy import load_tokenizer, stop_token_ids_for_dir

            settings = dataclass_from_dict(VllmEvalSettings, dict(vllm_settings or {}), "eval.vllm")
            verify_manifest(Path(args.model))
            model, tok = None, load_tokenizer(args.model)
            sampler = VllmSampler(
                make_llm(args.model, settings, params.base_seed),
                stop_token_ids_for_dir(tok, args.model),
                params.base_seed,
            )
        else:
            model, tok = load_policy(args.model, args.threads, device=params.device)
        if backend == "local" and params.device == "cuda":
            import torch

            from fedagent.model.static_sampler import StaticSampler

            model = model.to(torch.bfloat16)
            sampler = StaticSampler(
                model,
                tok,
                batch_size=min(params.batch, params.pool_size),
                max_prompt_tokens=params.max_prompt_tokens,
                max_new_tokens=params.max_new_tokens,
                mode=params.sampler,
                widths=params.sampler_widths,
                fused=params.sampler_fused,
                compile_prefill=params.sampler_compile_prefill,
                deterministic=params.deterministic,
            )
        clock.mark("model_loaded")
        if backend == "local" and params.device == "cuda" and params.sampler != "eager":
            sampler.warmup(params.temperature)
            clock.mark("sampler_warm")
        env = pending.ready()
        clock.mark("env_ready")
        print(json.dumps({"env_info": env.health().get("env_info", {})}), flush=True)
        with clock.phase("rollout"):
            result = evaluate(
                model,
                tok,
                env,
                seeds,
                params,
                round=args.round,
                sampler=sampler,
                on_done=progress.advance,
                clock=clock,
            )
    if sampler is not None and sampler.first_token_time is not None:
        clock.set("first_token", sampler.first_token_time)
    server_json = Path(args.model) / "server.json"
    if server_json.is_file():
        server = json.loads(server_json.read_text())
        if server.get("dropped"):
            result["dropped_clients"] = [Path(d["dir"]).name for d in server["dropped"]]
        if server.get("round_notes"):  # aggregate.json's (fedagent.server.aggregators): the summary's columns
            result["round_notes"] = server["round_notes"]
    if backend != "local":
        result["backend"] = backend
    if args.client is not None:
        result["client"] = args.client
    if label is not None:
        result["label"] = label
    if random_weights is not None:
        from fedagent.core.architectures import RANDOM_WEIGHTS_NOTE

        result["random_weights"] = {"source": random_weights, "note": RANDOM_WEIGHTS_NOTE}
    atomic_write_json(out, result)
    if args.timings is not None:
        # Beside eval.json, not in it: eval.json is byte-identical across re-runs; wall time is not.
        # On the GPU also the job's peak memory (recorded per job, beside its declared gpu_mem_mb)
        from fedagent.model.memory import gpu_peak_mib

        peak = gpu_peak_mib(params.device) if backend == "local" else {}
        stats = getattr(sampler, "stats", None)  # the static sampler's shapes against the prompts (GPU path)
        atomic_write_json(
            args.timings,
            {
                "round": args.round,
                "device": params.device,
                **clock.summary(),
                **peak,
                **placement.recorded(),  # the card it was placed on, if any
                **({"sampler": stats()} if stats is not None else {}),
                **({"deterministic": det_flags} if det_flags is not None else {}),
            },
        )
    print(json.dumps({k: result[k] for k in ("round", "n", "success_rate", "score_mean", "ci95")}))
    return 0
