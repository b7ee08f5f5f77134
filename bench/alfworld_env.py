"""What the ALFWorld env costs a run, in CPU seconds per call, and what that makes of a preset.

On ``--tasks`` games of a catalogue (``plan/games`` of an ALFWorld run) it times, in this process
and in CPU seconds (``time.process_time``: a loaded machine inflates wall time, much less CPU time):

- **load + reset**: a game a pool slot has not loaded yet (grammar parse, PDDL translation), as
  nearly every train/eval episode is (the 8 rollouts of a group land in 8 different slots);
- **reset** again of the game already loaded; **step**: one admissible command (random, seeded);
- **expert**: the warm start's env (``make_env(policy_commands=True)``): load + reset with the
  planner's plan, then each step of its plan (TextWorld replans after every step).

Then it projects the CPU seconds of the preset given with ``--config`` (episodes × calls; every
train/eval episode counted at ``max_turns`` steps, as a lost one is): each train job, each eval,
the warm start's demos (over ``env.procs`` workers; in one process, under one lock, without), and,
for ``--cores`` (the node's 16), the wall time of the env side if the work spreads evenly over
``env.procs`` workers per service with the round's two train jobs side by side (a lower bound:
a lockstep batch waits for its slowest worker, and the GPU's turns come on top).

    python bench/alfworld_env.py --games results/gpu-alfworld/plan/games \\
        --config config/experiments/gpu-alfworld.yaml [--tasks 12] [--steps 6] [--parse-cache both]

``--parse-cache`` (``on`` by default, as the env plays): TextWorld's grammar parses memoized
(:mod:`fedagent.envs.alfworld.parse_cache`); ``off``: TextWorld's own parsing; ``both``: off, then on,
in this process on the same games and actions, with each call's ratio off/on and whether every
observation and admissible-command list came out the same.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _cpu(fn, *args):
    t = time.process_time()
    out = fn(*args)
    return out, time.process_time() - t


def measure(games: Path, n_tasks: int, n_steps: int, seed: int, seen: list | None = None) -> dict:
    """Median CPU seconds per call (load+reset, reset, step, expert reset, expert step) on n_tasks games;
    ``seen`` (a list) gets every call's observation and admissible commands."""
    from fedagent.envs.alfworld.catalogue import source_from_catalogue

    seen = [] if seen is None else seen

    source, _split = source_from_catalogue(games, "train")
    tasks = source.task_ids("train")[:n_tasks]
    rng = random.Random(seed)
    costs = {k: [] for k in ("load_reset", "reset", "step", "expert_load_reset", "expert_step")}
    env = source.make_env(50)
    for tid in tasks:
        res, dt = _cpu(env.reset, tid)
        costs["load_reset"].append(dt)
        _, dt = _cpu(env.reset, tid)
        costs["reset"].append(dt)
        admissible = res.admissible_commands
        seen.append((res.observation, admissible))
        for _ in range(n_steps):
            step, dt = _cpu(env.step, rng.choice(admissible))
            costs["step"].append(dt)
            admissible = step.admissible_commands
            seen.append((step.observation, admissible))
    env.close()
    expert = source.make_env(50, policy_commands=True)
    plan_lens = []
    for tid in tasks:
        _, dt = _cpu(expert.reset, tid)
        costs["expert_load_reset"].append(dt)
        plan_lens.append(len(expert.expert_plan()))
        while (action := expert.expert_action()) is not None:
            step, dt = _cpu(expert.step, action)
            costs["expert_step"].append(dt)
            seen.append((step.observation, step.admissible_commands))
            if step.done:
                break
    expert.close()
    mean = {k: statistics.mean(v) for k, v in costs.items()}
    return {
        "tasks": len(tasks),
        "mean_cpu_s": {k: round(v, 4) for k, v in mean.items()},
        "median_cpu_s": {k: round(statistics.median(v), 4) for k, v in costs.items()},
        "max_cpu_s": {k: round(max(v), 4) for k, v in costs.items()},
        "calls": {k: len(v) for k, v in costs.items()},
        "plan_len_mean": statistics.mean(plan_lens),
    }


def project(cfg: dict, med: dict, plan_len: float, cores: int) -> dict:
    """CPU seconds of the preset's env side (``med``: mean CPU seconds per call), and a wall-time
    estimate on ``cores`` cores: every service's work spread evenly over its workers, a round's
    train jobs side by side, each eval and the warm start's demos alone."""
    env, tr, ev, ws = cfg["env"], cfg["train"], cfg["eval"], cfg.get("warm_start") or {}
    procs = max(1, int(env.get("procs") or 1))
    episode = med["load_reset"] + tr["max_turns"] * med["step"]
    train_eps = tr["epochs"] * tr["groups_per_epoch"] * tr["group_size"]
    train_cpu = train_eps * episode
    eval_cpu = ev["n"] * (med["load_reset"] + ev["max_turns"] * med["step"])
    demo_cpu = (
        ws.get("demos", 0) * (med["expert_load_reset"] + plan_len * med["expert_step"]) if ws.get("enabled") else 0.0
    )
    per_round = cfg["clients"]["per_round"]
    # a round: per_round train jobs side by side (each over `procs` workers, all over `cores`), then an eval
    par_train = min(procs * per_round, cores)
    round_wall = train_cpu * per_round / par_train + eval_cpu / min(procs, cores)
    evals = cfg["rounds"] + 1 + (1 if ws.get("enabled") else 0)
    demo_par = min(procs, cores) if env.get("procs") else 1  # expert service: in process without env.procs
    return {
        "train_job_episodes": train_eps,
        "train_job_cpu_s": round(train_cpu, 1),
        "eval_cpu_s": round(eval_cpu, 1),
        "warm_start_demos_cpu_s": round(demo_cpu, 1),
        "round_env_wall_s_on_cores": round(round_wall, 1),
        "run_env_wall_s_on_cores": round(
            cfg["rounds"] * (train_cpu * per_round / par_train)
            + evals * eval_cpu / min(procs, cores)
            + demo_cpu / demo_par,
            1,
        ),
        "cores": cores,
        "procs_per_service": procs,
    }


def _config(path: Path) -> dict:
    """``config/config.yaml`` with a preset over it; a matrix file (``base`` + ``common`` + ``arms``): its base
    preset, then its ``common`` block (the arms' shared recipe; an arm's own keys are not projected)."""
    root = Path(__file__).resolve().parents[1]
    base = yaml.safe_load((root / "config" / "config.yaml").read_text())
    over = yaml.safe_load(Path(path).read_text())

    def merge(a, b):
        for k, v in b.items():
            a[k] = merge(a.get(k) or {}, v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
        return a

    if "arms" in over:  # a matrix (config/matrices/*.yaml)
        preset = yaml.safe_load((root / over["base"]).read_text()) if over.get("base") else {}
        return merge(merge(base, preset), over.get("common") or {})
    return merge(base, over)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--games", type=Path, required=True)
    ap.add_argument(
        "--config", type=Path, default=None, help="a preset or a matrix to project (its env/train/eval sizes)"
    )
    ap.add_argument("--tasks", type=int, default=12)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cores", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parse-cache", choices=("on", "off", "both"), default="on")
    args = ap.parse_args()
    from fedagent.envs.alfworld import parse_cache

    if args.parse_cache == "both":
        parse_cache.set_enabled(False)
        seen_off, seen_on = [], []
        off = measure(args.games, args.tasks, args.steps, args.seed, seen_off)
        parse_cache.set_enabled(True)
        out = measure(args.games, args.tasks, args.steps, args.seed, seen_on)
        out["parse_cache_off"] = off
        out["off_over_on_mean_cpu"] = {
            k: round(off["mean_cpu_s"][k] / v, 3) for k, v in out["mean_cpu_s"].items() if v > 0
        }
        out["same_observations"] = seen_off == seen_on
    else:
        # measure() opens its envs through fedagent.envs.alfworld.env.open_game, which installs the cache
        parse_cache.set_enabled(args.parse_cache == "on")
        out = measure(args.games, args.tasks, args.steps, args.seed)
    out["parse_cache"] = args.parse_cache
    if args.config:
        out["projection"] = project(_config(args.config), out["mean_cpu_s"], out["plan_len_mean"], args.cores)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
