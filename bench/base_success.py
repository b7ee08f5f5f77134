"""Does a model give GRPO any signal? Success, format and non-zero-advantage groups per variant.

    python bench/base_success.py --model results/<run>/round_000/model --games results/<run>/plan/games \
        --variants think_action:0.4:48 action:0.7:16 --tasks 32 --group-size 8 [--device cuda]

For each variant (answer format : temperature : max new tokens) every one of ``--tasks`` train
tasks is played ``--group-size`` times (one GRPO group per task, as a train job draws them) and
the table shows the success rate, the invalid-format rate and the share of groups whose
rewards differ (only those give a non-zero advantage). No training, nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--games", type=Path, required=True)
    ap.add_argument("--variants", nargs="+", default=["think_action:0.4:48", "action:0.7:16"])
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)

    import torch

    from fedagent.envs.lifecycle import env_service
    from fedagent.envs.textworld.games import TextWorldTaskSource
    from fedagent.model.policy import load_policy
    from fedagent.rollout.episode import run_episodes_batched
    from fedagent.core.seeds import torch_generator

    tasks = TextWorldTaskSource(args.games).task_ids("train")[: args.tasks]
    model, tok = load_policy(args.model, args.threads, device=args.device)
    if args.device == "cuda":
        model = model.to(torch.bfloat16)
    seeds = [i for i in range(len(tasks)) for _ in range(args.group_size)]  # index mode: seed i → task i
    batch = min(len(seeds), 128)
    rows = []
    for spec in args.variants:
        fmt, temp, ntok = spec.split(":")
        temp, ntok = float(temp), int(ntok)
        sampler = None
        if args.device == "cuda":
            from fedagent.model.static_sampler import StaticSampler

            sampler = StaticSampler(
                model,
                tok,
                batch_size=batch,
                max_prompt_tokens=args.max_prompt_tokens,
                max_new_tokens=ntok,
                mode="eager",
            )
        t0 = time.time()
        with env_service(
            args.games,
            "train",
            tasks,
            Path(tempfile.mkdtemp()),
            mode="index",
            pool_size=batch,
            max_turns=args.max_turns,
            answer_format=fmt,
        ) as env:
            trajs = run_episodes_batched(
                model,
                tok,
                env,
                seeds,
                batch_size=batch,
                session_prefix=f"probe-{fmt}",
                max_turns=args.max_turns,
                max_new_tokens=ntok,
                temperature=temp,
                generator=torch_generator(args.seed, "probe"),
                max_prompt_tokens=args.max_prompt_tokens,
                answer_format=fmt,
                sampler=sampler,
            )
        wins = [t.won for t in trajs]
        turns = [x for t in trajs for x in t.turns]
        groups = [wins[k : k + args.group_size] for k in range(0, len(wins), args.group_size)]
        row = {
            "variant": spec,
            "episodes": len(trajs),
            "success": sum(wins) / len(wins),
            "invalid": sum(not x.valid for x in turns) / max(1, len(turns)),
            "groups_with_signal": sum(0 < sum(g) < len(g) for g in groups) / len(groups),
            "seconds": round(time.time() - t0, 1),
            "top_actions": _top([x.action for x in turns]),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'variant':24} {'success':>8} {'invalid':>8} {'signal':>8}  (tasks {len(tasks)} x {args.group_size})")
    for r in rows:
        print(f"{r['variant']:24} {r['success']:8.3f} {r['invalid']:8.3f} {r['groups_with_signal']:8.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def _top(actions, k=6):
    counts: dict[str, int] = {}
    for a in actions:
        counts[a] = counts.get(a, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])[:k]


if __name__ == "__main__":
    raise SystemExit(main())
