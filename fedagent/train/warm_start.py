"""``fedagent warm-start``: fine-tune the base model on expert demonstrations (an optional stage
between the base model and round 0; ``warm_start.enabled``, off by default).

The reference starts RL from the instruct model and nothing else; a small model that never once
finishes a task (WebShop at 135M: 0 purchases in 192 episodes per client-round) gives GRPO no
group with signal. Here, before round 1:

1. the demo pool (``plan/demo_pool.json``, :mod:`fedagent.plan.demo_pool`: train tasks no client
   owns, no validation task) is played once per task by the env's expert — TextWorld's walkthrough,
   ALFWorld's PDDL planner, WebShop's oracle — through the job's own env service
   (``expert=True``) and the rollout's episode loop, so every turn's prompt is exactly the
   rollout's and its answer is written in the rollout's answer format
   (:func:`fedagent.rollout.expert.expert_generation`);
2. the won demonstrations (``warm_start.only_won``) become one sample per turn, and the model is
   trained on them with the token-mean cross-entropy of the answer tokens only (the prompt carries
   no loss), ``warm_start.epochs`` passes of AdamW at ``warm_start.lr`` over mini-batches shuffled by
   ``python_rng(seed, "warm_start_shuffle", epoch=e)``;
3. the result is written as round 0's model (an fp32 HF dir with manifest, ``metrics.json``,
   ``demos.jsonl``, ``provenance.json``), through :func:`fedagent.core.atomic.atomic_dir`. A PPO
   base model's critic (``critic/``) is carried over as it is.

Same inputs and thread count → the same bytes (CPU).
"""

from __future__ import annotations

# First, before torch loads libgomp: OMP_WAIT_POLICY (fedagent.core.openmp says why the order matters).
from fedagent.core import openmp  # noqa: F401 - imported for its effect

import argparse
import dataclasses
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedagent.core import placement
from fedagent.core.config import JobKeys, dataclass_from_dict


@dataclass(frozen=True)
class WarmStartParams:
    """Knobs of the warm-start job (its ``--params`` JSON)."""

    base_seed: int = 0
    epochs: int = 2
    lr: float = 1e-5
    mini_batch_size: int = 16
    micro_batch_size: int = 4
    micro_batch_tokens: int | None = None  # train.micro_batch_tokens (None: rows only)
    only_won: bool = True
    max_turns: int = 3
    max_prompt_tokens: int = 1024
    pool_size: int = 8
    env_procs: int = 0  # env.procs: the expert service's worker processes (0: in process)
    answer_format: str = "think_action"
    history: int = 2
    device: str = "cpu"
    grad_clip: float = 1.0
    enabled: bool = True  # warm_start.enabled (a job that runs is the enabled stage)
    rollout_mode: str = "windowed"  # rollout.mode: the demonstrations are windowed turns
    deterministic: bool = False  # deterministic: bit-reproducible kernels (fedagent.model.determinism)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WarmStartParams":
        """Build from a dict; unknown keys and values planning would refuse are errors naming them."""
        p = dataclass_from_dict(cls, d, "warm_start")
        WARM_START_KEYS.check(dataclasses.asdict(p))
        if p.micro_batch_size < 1 or not p.grad_clip > 0:
            raise ValueError(f"bad warm-start params: micro_batch_size={p.micro_batch_size}, grad_clip={p.grad_clip}")
        return p

    def recorded(self) -> dict[str, Any]:
        """The params as metrics.json / provenance.json record them (``deterministic`` only when on:
        the files of other runs as they were)."""
        d = dataclasses.asdict(self)
        for key in ("deterministic", "micro_batch_tokens"):  # only when set: other runs' files as they were
            if not d[key]:
                d.pop(key)
        return d


WARM_START_KEYS = JobKeys.for_dataclass(
    "warm-start",
    WarmStartParams,
    "warm_start",
    {
        "base_seed": "seed",
        "micro_batch_size": "train.micro_batch_size",
        "micro_batch_tokens": "train.micro_batch_tokens",
        "max_turns": "train.max_turns",
        "max_prompt_tokens": "train.max_prompt_tokens",
        "pool_size": "env.pool_size",
        "env_procs": "env.procs",
        "answer_format": "rollout.answer_format",
        "history": "rollout.history",
        "device": "train.device",
        "rollout_mode": "rollout.mode",
        "deterministic": "deterministic",
    },
)


def play_demos(tok, env, n: int, p: WarmStartParams, on_done=None, clock=None):
    """One expert episode per demo-pool task (index mode: seed i → task i), in task order (``on_done``:
    the progress count; ``clock``: the loop's time split, :func:`fedagent.rollout.episode.run_episodes`)."""
    from fedagent.rollout.episode import run_episodes_batched

    return run_episodes_batched(
        None,
        tok,
        env,
        list(range(n)),
        batch_size=p.pool_size,
        session_prefix="warm-start",
        max_turns=p.max_turns,
        max_new_tokens=0,
        temperature=1.0,
        generator=None,
        max_prompt_tokens=p.max_prompt_tokens,
        answer_format=p.answer_format,
        history_length=p.history,
        expert=True,
        on_done=on_done,
        clock=clock,
    )


def sft_epoch(model, optimizer, samples, p: WarmStartParams, epoch: int, on_step=None) -> list[dict]:
    """One shuffled pass of mini-batch steps on the answer tokens' token-mean cross-entropy (``on_step``:
    told after each step, the progress count)."""
    import torch

    from fedagent.core.seeds import python_rng
    from fedagent.train import micro_batches
    from fedagent.train.actor import autocast, chunks, logprobs

    order = list(range(len(samples)))
    python_rng(p.base_seed, "warm_start_shuffle", epoch=epoch).shuffle(order)
    params = [q for q in model.parameters() if q.requires_grad]
    steps = []
    for mb in chunks(order, p.mini_batch_size):
        n_tok = sum(samples[i].trained_count() for i in mb)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in micro_batches.split(mb, samples, p.micro_batch_size, p.micro_batch_tokens):
            with autocast(model):
                logp, _ = logprobs(model, [samples[i] for i in micro], 1.0, p.micro_batch_size)
            loss = -logp.sum() / n_tok
            loss.backward()
            total += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, p.grad_clip))
        if not math.isfinite(grad_norm):
            raise FloatingPointError(
                f"warm start: non-finite gradient norm ({grad_norm}) in epoch {epoch}, step {len(steps)}"
            )
        optimizer.step()
        steps.append(
            {
                "epoch": epoch,
                "samples": len(mb),
                "tokens": n_tok,
                "loss": round(total, 8),
                "grad_norm": round(grad_norm, 8),
            }
        )
        if on_step is not None:
            on_step(1)
    return steps


def warm_start(
    base_dir: Path,
    env,
    *,
    n_demos: int,
    params: WarmStartParams,
    threads: int,
    out_dir: Path,
    quarantine: Path | None = None,
) -> dict:
    """Play the demos, fine-tune ``base_dir``'s model on the won ones, write ``out_dir``; the metrics."""
    import torch

    from fedagent.core.atomic import atomic_dir
    from fedagent.core.progress import Progress
    from fedagent.core.timing import PhaseClock
    from fedagent.model.critic_dir import critic_of
    from fedagent.model.policy import load_policy, save_policy
    from fedagent.train import grpo
    from fedagent.train.epilogue import write_job_records

    p = params
    clock = PhaseClock()
    t0 = time.time()
    det_flags = None
    if p.deterministic:  # the kernels pinned before the model is loaded (metrics.json records them)
        from fedagent.model import determinism

        det_flags = determinism.enable(p.device)
    model, tok = load_policy(base_dir, threads, device=p.device)
    clock.mark("model_loaded")
    if hasattr(env, "ready"):
        env = env.ready()
    # progress lines (fedagent.core.progress): the demos played, then the fine-tune's steps
    with clock.phase("rollout"), Progress("warm_start", "demos", n_demos) as progress:
        trajs = play_demos(tok, env, n_demos, p, on_done=progress.advance, clock=clock)
    kept = [t for t in trajs if t.won or not p.only_won]
    samples = grpo.turn_samples(kept, [0] * len(kept), 0.0)
    won = sum(1 for t in trajs if t.won)
    if not samples:
        raise RuntimeError(
            f"warm start: the expert won {won} of {len(trajs)} demonstrations"
            + (" and warm_start.only_won keeps only won ones" if p.only_won else "")
            + ": nothing to learn from (more warm_start.demos, or a larger train.max_turns)"
        )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=p.lr, weight_decay=0.0, **({"fused": True} if p.device == "cuda" else {})
    )
    model.eval()  # no dropout in Llama; the same numerics as the rollouts score with
    steps = []
    n_steps = p.epochs * math.ceil(len(samples) / p.mini_batch_size)
    with clock.phase("train"), Progress("warm_start", "steps", n_steps) as progress:
        for epoch in range(p.epochs):
            steps.extend(sft_epoch(model, optimizer, samples, p, epoch, on_step=progress.advance))
    first = [s["loss"] for s in steps if s["epoch"] == 0]
    last = [s["loss"] for s in steps if s["epoch"] == p.epochs - 1]
    metrics = {
        "demos": len(trajs),
        "demos_won": won,
        "demo_success_rate": won / len(trajs) if trajs else 0.0,
        "demos_kept": len(kept),
        "demo_turns": sum(t.n_turns for t in kept),
        "num_samples": len(samples),
        "num_tokens": sum(s.trained_count() for s in samples),
        "num_prompt_tokens": sum(len(s.prompt_ids) for s in samples),
        "loss_first_epoch": round(math.fsum(first) / len(first), 8) if first else None,
        "loss_last_epoch": round(math.fsum(last) / len(last), 8) if last else None,
        "steps": steps,
        "params": p.recorded(),
        "threads": threads,
        "wall_time_s": round(time.time() - t0, 3),
        **({"deterministic": det_flags} if det_flags is not None else {}),
    }
    # The card the job was placed on (fedagent.core.placement; nothing when none was placed) and, on a
    # GPU, its peak memory beside its declared gpu_mem_mb, as a train job records them.
    metrics.update(placement.recorded())
    if p.device == "cuda":
        from fedagent.model.memory import gpu_peak_mib

        metrics.update(gpu_peak_mib(p.device))
    with atomic_dir(Path(out_dir), quarantine) as staging:
        save_policy(model, tok, staging)
        if critic_of(base_dir).is_dir():  # PPO: round 1's critic, as the base model built it
            shutil.copytree(critic_of(base_dir), critic_of(staging))
        write_job_records(
            staging,
            metrics,
            clock,
            (t.summary() for t in trajs),
            "demos.jsonl",
            provenance={
                "job": "warm_start",
                "params": {**p.recorded(), "threads": threads},
                "seeds": {"base_seed": p.base_seed},
                "backend": "local",
                "extra": {"base_model": str(base_dir), "demos": len(trajs)},
            },
        )
    return metrics


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent warm-start``."""
    parser.add_argument("--model", type=Path, required=True, help="the base model (HF dir with manifest)")
    parser.add_argument("--games", type=Path, required=True, help="games directory (plan/games)")
    parser.add_argument("--demo-pool", type=Path, required=True, help="plan/demo_pool.json")
    parser.add_argument("--params", required=True, help="JSON object of warm-start params (WarmStartParams)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True, help="round 0's model dir")
    parser.add_argument("--quarantine", type=Path, default=None, help="where failed attempts go")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fedagent warm-start``."""
    from fedagent.model import determinism
    from fedagent.model.memory import oom_names_the_knobs

    with oom_names_the_knobs("warm-start"), determinism.guard("warm-start"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from fedagent.envs.lifecycle import job_env_service
    from fedagent.plan.demo_pool import load_demo_tasks
    from fedagent.plan.tasks import games_kind

    params = WarmStartParams.from_dict(json.loads(args.params))
    tasks = load_demo_tasks(args.demo_pool)
    if not tasks:
        raise ValueError(f"{args.demo_pool}: no demo tasks")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Index mode: demo seed i plays task i of the pool, each task once; the unperturbed env (no arm).
    with job_env_service(
        args.games,
        "train",
        tasks,
        out,
        mode="index",
        pool_size=params.pool_size,
        max_turns=params.max_turns,
        answer_format=params.answer_format,
        source=games_kind(args.games),
        expert=True,
        env_procs=params.env_procs,
        wait=False,
    ) as pending:
        metrics = warm_start(
            args.model,
            pending,
            n_demos=len(tasks),
            params=params,
            threads=args.threads,
            out_dir=out,
            quarantine=args.quarantine,
        )
    print(
        json.dumps(
            {
                k: metrics[k]
                for k in ("demos", "demos_won", "num_samples", "loss_first_epoch", "loss_last_epoch", "wall_time_s")
            }
        )
    )
    return 0
