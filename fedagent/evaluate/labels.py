"""``fedagent labels``: hardness labels — a reference policy plays every train task once.

FACTS §2: labels must come from a (trained) reference policy rolled out in the **same
rollout mode as training** (windowed here, the only mode); success → easy. Index mode: seed
i plays train task i, so the n train tasks take exactly n episodes. The sampler is seeded
from the params' ``base_seed`` (the workflow passes ``data_seed``: labels are part of plan/).
Validation is not involved: no penalty, nothing is trained.

``--policy random`` is a model-free reference for smoke runs and tiny pools where no trained
policy exists (an untrained SmolLM2 wins none of the -small presets' games, so every task would
be "hard"): each turn picks uniformly among the admissible commands with
``python_rng(base_seed, "labels_random", index=task)``, for the same turn budget, through the
same service. Its labels measure difficulty for a random walker, not for a trained agent.

``--policy expert`` (ALFWorld only) is a scripted reference: the PDDL planner's next command
from the current state with probability ``--expert-p``, else a random admissible command
(:mod:`fedagent.envs.alfworld.expert`, seeded by ``python_rng(base_seed, "labels_expert",
index=task)``), for the same turn budget. Games with longer solutions are won less often, so
its labels measure difficulty for a noisy planner — again not a trained agent's. It plays the
games in this process (the service does not expose the planner), with the same env class and
budget; the file records ``expert_p`` and, per task, the plan length and turns used.

Output (atomic): ``{"labels": {task id: bool}, "policy", "n", "easy", "easy_rate", "params",
"games_sha256"}`` — the ``{"labels": ...}`` form ``fedagent partition --labels`` reads.
"""

from __future__ import annotations

# First, before torch loads libgomp: OMP_WAIT_POLICY (fedagent.core.openmp says why the order matters).
from fedagent.core import openmp  # noqa: F401 - imported for its effect

import argparse
import json
import tempfile
from pathlib import Path


def resolve_policy(policy: str, workdir: Path, seed: int) -> Path:
    """An HF model dir for ``policy``: a local dir as is; 'smollm2' / 'tiny' built into ``workdir``."""
    if policy == "smollm2":
        from fedagent.model.base_model import build_base_model

        out = workdir / "policy"
        build_base_model("smollm2", out)
        return out
    if policy == "tiny":
        from fedagent.model.base_model_tiny import write_tiny_model

        out = workdir / "policy"
        write_tiny_model(out, seed)
        return out
    path = Path(policy)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"labels policy {policy!r}: not 'smollm2', 'tiny' or an HF model dir")
    return path


def describe(policy: str, expert_p: float | None = None) -> str:
    """What the labels measure, in words (recorded in the labels file as ``reference``)."""
    if policy == "random":
        return "random walker: a uniformly random admissible command each turn (model-free)"
    if policy == "expert":
        return (
            f"noisy planner: the ALFWorld PDDL planner's next command with probability {expert_p}, "
            "else a uniformly random admissible command (scripted, model-free)"
        )
    return f"model {policy}: sampled in the training rollout mode"


def random_walk_labels(env, n_tasks: int, base_seed: int, max_turns: int) -> list[dict]:
    """One random-admissible-command episode per task (seed i → task i); returns samples."""
    from fedagent.core.seeds import python_rng

    samples = []
    for i in range(n_tasks):
        sid = f"labels-random-{i}"
        env.create(sid)
        try:
            obs = env.reset(sid, i)
            rng = python_rng(base_seed, "labels_random", index=i)
            won, admissible = False, [c for c in obs["admissible_commands"]]
            for _ in range(max_turns):
                if not admissible:
                    break
                cmd = admissible[rng.randrange(len(admissible))]
                r = env.step(sid, f"<think>random</think><action>{cmd}</action>")
                won, admissible = bool(r["won"]), list(r["admissible_commands"])
                if r["done"]:
                    break
            samples.append({"task_id": obs["task_id"], "won": won})
        finally:
            env.close(sid)
    return samples


def add_args(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``fedagent labels``."""
    parser.add_argument(
        "--policy",
        required=True,
        help="reference policy: HF model dir, 'smollm2', 'tiny', 'random' (uniform admissible "
        "commands) or 'expert' (ALFWorld: the planner's next command with probability "
        "--expert-p, else a random admissible one)",
    )
    parser.add_argument(
        "--expert-p",
        type=float,
        default=None,
        help="--policy expert: probability of the planner's command each turn, in [0, 1]",
    )
    parser.add_argument("--games", type=Path, required=True, help="games directory (plan/games)")
    parser.add_argument("--params", default="{}", help="JSON object of rollout params (see evaluate.EvalParams)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True, help="labels.json")
    parser.add_argument("--quarantine", type=Path, default=None, help="accepted for symmetry")


def run(args: argparse.Namespace) -> int:
    """Play every train task once; write the labels file."""
    from fedagent.core.atomic import atomic_write_json
    from fedagent.envs.lifecycle import job_env_service
    from fedagent.evaluate.validation import EvalParams, evaluate
    from fedagent.model.policy import load_policy
    from fedagent.plan.tasks import load_games_index
    import dataclasses

    params = EvalParams.from_dict(json.loads(args.params))
    index = load_games_index(args.games)
    train = list(index["train"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    extra: dict = {}
    if (args.expert_p is not None) != (args.policy == "expert"):
        raise SystemExit("fedagent labels: --expert-p goes with --policy expert (and only with it)")
    if args.policy == "expert":
        from fedagent.core import envs
        from fedagent.envs.lifecycle import games_source

        expert = envs.spec(games_source(args.games)).labels_expert
        if expert is None:
            raise SystemExit(
                f"fedagent labels: --policy expert needs games of an env with a labels expert (ALFWorld), "
                f"{args.games} holds {games_source(args.games)!r}"
            )
        if not 0.0 <= args.expert_p <= 1.0:
            raise SystemExit(f"fedagent labels: --expert-p must be in [0, 1], got {args.expert_p}")
        samples = envs.resolve(expert)(args.games, train, params.base_seed, args.expert_p, params.max_turns)
        result = {"samples": samples, "params": dataclasses.asdict(params)}
        extra = {
            "expert_p": args.expert_p,
            "episodes": {s["task_id"]: {k: s[k] for k in ("turns", "plan_len", "expert_moves")} for s in samples},
        }
    elif args.policy == "random":
        with job_env_service(
            args.games, "train", train, out, mode="index", pool_size=params.pool_size, max_turns=params.max_turns
        ) as env:
            samples = random_walk_labels(env, len(train), params.base_seed, params.max_turns)
        result = {"samples": samples, "params": dataclasses.asdict(params)}
    else:
        with tempfile.TemporaryDirectory(prefix=".labels-", dir=out.parent) as tmp:
            model_dir = resolve_policy(args.policy, Path(tmp), params.base_seed)
            model, tok = load_policy(model_dir, args.threads)
            with job_env_service(
                args.games,
                "train",
                train,
                out,
                mode="index",
                pool_size=params.pool_size,
                max_turns=params.max_turns,
                projection=params.projection,
            ) as env:
                result = evaluate(model, tok, env, list(range(len(train))), params, round=0)
    labels = {s["task_id"]: bool(s["won"]) for s in result["samples"]}
    if sorted(labels) != sorted(train):
        raise RuntimeError("labels: the episodes did not cover every train task exactly once")
    easy = sum(labels.values())
    atomic_write_json(
        out,
        {
            "labels": labels,
            "policy": args.policy,
            "reference": describe(args.policy, args.expert_p),
            "n": len(labels),
            "easy": easy,
            "easy_rate": easy / len(labels),
            "params": result["params"],
            "games_sha256": index["sha256"],
            **extra,
        },
    )
    print(json.dumps({"n": len(labels), "easy": easy, "easy_rate": easy / len(labels)}))
    return 0
