#!/usr/bin/env python3
"""Did a job on warm engines do what the same job does on fresh ones? Two client update dirs compared.

    python3 scripts/gpu/verl-same.py WARM COLD [--start MODEL_DIR] [--json OUT.json]

WARM and COLD are two ``train_client`` outputs of the same round and client (``verl-round.sh same``
makes COLD: the job run again with ``train.verl.engines: job``). Every per-request sampling seed derives
from the job's coordinates (``fedagent.core.seeds.request_seed``), so the two sample with the same noise;
with the same weights, a turn's text differs only where the GPU's numerics differ between the two
engines' batches. A warm engine that kept another model (the previous round's, the set's first job's)
gives different texts from the first turns on.

Prints one Markdown table row (see ``HEADER``) and, with ``--json``, writes the numbers:
episodes and turns matched by (epoch, group, session, turn); task ids and sampling seeds equal (over the
turns both played; both must be 1.0: the job's draws); the share of episodes of equal length, of identical
turn texts (a turn only one of them played counts as not identical) and of episodes identical throughout;
verl's per-step metrics side by side; and with ``--start`` the update's relative difference
‖w_warm − w_cold‖ / ‖w_cold − w_start‖ over all tensors (and the critic's, for PPO).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HEADER = (
    "| job | episodes | task ids equal | seeds equal | identical turns | identical episodes "
    "| update rel. diff | critic rel. diff |"
)


def episodes(d: Path) -> dict:
    out = {}
    for line in (Path(d) / "samples.jsonl").read_text().splitlines():
        if line.strip():
            e = json.loads(line)
            out[(e["epoch"], e["group"], e["session"])] = e
    return out


def rel_diff(a: Path, b: Path, start: Path) -> float | None:
    """‖a − b‖ / ‖b − start‖ over every tensor of the safetensors files (fp64 sums); None without files."""
    if not (a.is_file() and b.is_file() and start.is_file()):
        return None
    from safetensors.torch import load_file

    ta, tb, ts = load_file(a), load_file(b), load_file(start)
    if set(ta) != set(tb):
        raise ValueError(f"{a} and {b} hold different tensors")
    num = den = 0.0
    for k in sorted(tb):
        x, y = ta[k].double(), tb[k].double()
        num += float((x - y).square().sum())
        den += float((y - ts[k].double()).square().sum())
    return math.sqrt(num) / math.sqrt(den) if den else (0.0 if num == 0 else math.inf)


def compare(warm: Path, cold: Path, start: Path | None = None) -> dict:
    ew, ec = episodes(warm), episodes(cold)
    if set(ew) != set(ec):
        raise ValueError(f"{warm} and {cold} hold different episodes: {sorted(set(ew) ^ set(ec))[:5]}")
    turns = both = same_text = same_seed = 0
    same_task = same_episode = same_length = 0
    for key in sorted(ec):
        a, b = ew[key], ec[key]
        same_task += a["task_id"] == b["task_id"]
        ta, tb = a["turns"], b["turns"]
        same_episode += [t["text"] for t in ta] == [t["text"] for t in tb]
        same_length += len(ta) == len(tb)
        turns += max(len(ta), len(tb))  # a turn only one of them played counts as not identical
        for k in range(min(len(ta), len(tb))):  # seeds: over the turns both played (an episode's length
            both += 1  # may differ with its texts)
            same_text += ta[k]["text"] == tb[k]["text"]
            same_seed += ta[k].get("sampling_seed") is not None and ta[k].get("sampling_seed") == tb[k].get(
                "sampling_seed"
            )
    mw, mc = (json.loads((Path(d) / "metrics.json").read_text()) for d in (warm, cold))
    out = {
        "round": mc.get("round"),
        "client": mc.get("client"),
        "episodes": len(ec),
        "turns": turns,
        "task_ids_equal": same_task / len(ec),
        "seeds_equal": same_seed / both if both else None,
        "equal_lengths": same_length / len(ec),
        "identical_turns": same_text / turns if turns else None,
        "identical_episodes": same_episode / len(ec),
        "warm": (mw.get("verl", {}).get("engine_set") or {}).get("warm"),
        "steps": {
            k: [mw.get(k), mc.get(k)] for k in ("kl", "entropy", "clipfrac", "vf_loss", "mean_return") if k in mc
        },
    }
    if start is not None:
        out["update_rel_diff"] = rel_diff(
            Path(warm) / "model.safetensors", Path(cold) / "model.safetensors", Path(start) / "model.safetensors"
        )
        out["critic_rel_diff"] = rel_diff(
            Path(warm) / "critic" / "model.safetensors",
            Path(cold) / "critic" / "model.safetensors",
            Path(start) / "critic" / "model.safetensors",
        )
    return out


def row(r: dict) -> str:
    def f(x, fmt="{:.3f}"):
        return "–" if x is None else fmt.format(x)

    return (
        f"| round {r['round']}, client {r['client']} ({'warm' if r['warm'] else 'cold'} vs cold) | "
        f"{r['episodes']} | {f(r['task_ids_equal'])} | {f(r['seeds_equal'])} | {f(r['identical_turns'])} | "
        f"{f(r['identical_episodes'])} | {f(r.get('update_rel_diff'), '{:.3g}')} | "
        f"{f(r.get('critic_rel_diff'), '{:.3g}')} |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("warm", type=Path)
    ap.add_argument("cold", type=Path)
    ap.add_argument("--start", type=Path, help="the round's start model (the update's relative difference)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    r = compare(a.warm, a.cold, a.start)
    print(HEADER)
    print("|---" * (HEADER.count("|") - 1) + "|")
    print(row(r))
    if a.json:
        a.json.write_text(json.dumps(r, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
