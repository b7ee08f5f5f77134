"""``fedagent eval``: score a model on the fixed validation set (FACTS §7).

One episode per validation seed (index mode: seed i plays tasks[i % n]), sampled at
temperature 0.4 by default with ``torch_generator(base_seed, "eval_sampling")`` — the same
generator every round, so the model is the only thing that changes between rounds. Never
penalized. Writes ``eval.json`` atomically.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

# Must precede the first torch import: libgomp reads it once. Idle OpenMP workers that spin
# (the default) make 2 threads ~30x slower than 1 on a busy 2-core box; PASSIVE makes them
# sleep. A value set by the caller wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from fedagent.config import dataclass_from_dict  # noqa: E402 - after the OpenMP setting (imports no torch)


@dataclass(frozen=True)
class EvalParams:
    """Knobs of one eval job (the ``--params`` JSON of ``fedagent eval``)."""

    base_seed: int = 0
    temperature: float = 0.4
    max_turns: int = 3
    max_new_tokens: int = 40
    max_prompt_tokens: int = 1024
    pool_size: int = 8
    batch: int = 8

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EvalParams":
        """Build from a dict; unknown keys are an error that names them."""
        p = dataclass_from_dict(cls, d, "eval")
        if p.batch < 1 or p.pool_size < 1 or p.max_turns < 1 or p.max_new_tokens < 1 or p.temperature < 0:
            raise ValueError(f"bad eval params: {p}")
        return p


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
        "samples": [{"seed": t.seed, "task_id": t.task_id, "task_type": t.task_type, "won": t.won,
                     "score": t.score, "n_turns": t.n_turns, "actions": [x.action for x in t.turns]}
                    for t in trajs],
    }


def evaluate(model, tokenizer, env, seeds: Sequence[int], params: EvalParams, *, round: int) -> dict:
    """Play one episode per seed with the fixed eval generator; return the eval.json dict."""
    from fedagent.rollout.episode import run_episodes_batched
    from fedagent.seeds import torch_generator

    gen = torch_generator(params.base_seed, "eval_sampling")
    trajs = run_episodes_batched(
        model, tokenizer, env, list(seeds), batch_size=min(params.batch, params.pool_size),
        session_prefix=f"eval-r{round}", max_turns=params.max_turns, max_new_tokens=params.max_new_tokens,
        temperature=params.temperature, generator=gen, max_prompt_tokens=params.max_prompt_tokens)
    out = summarize(trajs, round)
    out["params"] = dataclasses.asdict(params)
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


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent eval``."""
    from fedagent.atomic import atomic_write_json
    from fedagent.envs.lifecycle import job_env_service
    from fedagent.policy import load_policy

    params = EvalParams.from_dict(json.loads(args.params))
    tasks, seeds = load_val_set(args.val_set)
    model, tok = load_policy(args.model, args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with job_env_service(args.games, "val", tasks, out, mode="index", pool_size=params.pool_size,
                         max_turns=params.max_turns) as env:
        result = evaluate(model, tok, env, seeds, params, round=args.round)
    if args.client is not None:
        result["client"] = args.client
    atomic_write_json(out, result)
    print(json.dumps({k: result[k] for k in ("round", "n", "success_rate", "score_mean", "ci95")}))
    return 0
