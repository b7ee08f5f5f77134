#!/usr/bin/env python3
"""A verl run's memory and time, per job and per round, as Markdown (issue 48's must-show 1 table).

    python3 scripts/gpu/verl-memory.py OUT/RUN          (verl-scale.sh's copies: round_NNN_client_C_metrics.json,
                                                          round_NNN_timings.csv)

Per job (each client's metrics.json): the declared memory and the plan the job sized itself with
(``verl.memory``: offload, checkpointing, micro-batch, vLLM's KV cache and share), verl's own per-step peaks of the
FSDP worker (``actor/perf/max_memory_allocated_gb`` / ``..._reserved_gb``, the largest of the job's steps; a PPO
critic's beside), the engine set's device memory after the job and its growth since the set's first job
(``verl.engine_set.memory_gb`` / ``memory_growth_gb``: flat is ≤ 0.2 GB), the job's wall time and its trainer / conversion.
Per round: the last round's timings.csv (round wall time and its split: train jobs, cold start, generation,
training, aggregate, merge, eval).
"""

import csv
import json
import re
import sys
from pathlib import Path


def _peak(steps, suffix):
    vals = [v for s in steps or [] for k, v in s.items() if k.endswith(suffix) and isinstance(v, (int, float))]
    return max(vals) if vals else None


def _f(v, nd=2):
    return "–" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def job_rows(folder: Path) -> list[str]:
    rows = [
        "| round | client | warm | declared MiB | plan (offload p/o, ckpt, micro, KV GiB, vLLM share) | peak alloc / reserved GB "
        "| set memory GB (growth) | job s | trainer s | convert s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(folder.glob("round_*_client_*_metrics.json")):
        m = json.loads(path.read_text())
        v = m.get("verl", {})
        mem = v.get("memory") or {}
        plan = mem.get("plan") or {}
        es = v.get("engine_set") or {}
        kv = mem.get("kv_cache_bytes")
        choice = (
            f"{int(bool(mem.get('param_offload')))}/{int(bool(mem.get('optimizer_offload')))}, "
            f"{int(bool(mem.get('gradient_checkpointing')))}, {mem.get('micro_batch_size')}, "
            f"{_f(kv / 2**30 if kv else None, 1)}, {_f(mem.get('gpu_memory_utilization'))}"
        )
        steps = m.get("verl_steps") or m.get("steps")
        peaks = f"{_f(_peak(steps, 'max_memory_allocated_gb'))} / {_f(_peak(steps, 'max_memory_reserved_gb'))}"
        t = m.get("timings_s", {})
        r, c = re.match(r"round_(\d+)_client_(\d+)_", path.name).groups()
        rows.append(
            f"| {int(r)} | {c} | {es.get('warm', '–')} | {_f(plan.get('budget_mib'))} | {choice} | {peaks} | "
            f"{_f(es.get('memory_gb'))} ({_f(es.get('memory_growth_gb'))}) | {_f(m.get('wall_time_s'), 1)} | "
            f"{_f(t.get('trainer'), 1)} | {_f(t.get('convert'), 1)} |"
        )
    return rows


def round_rows(folder: Path) -> list[str]:
    files = sorted(folder.glob("round_*_timings.csv"))
    if not files:
        return []
    with files[-1].open() as fh:
        rows = list(csv.DictReader(fh))
    cols = [
        "round",
        "round_wall_s",
        "train_job_s",
        "cold_start_s",
        "generation_s",
        "training_s",
        "aggregate_s",
        "merge_s",
        "eval_s",
    ]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(row.get(c, "") or "–" for c in cols) + " |" for row in rows]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    folder = Path(argv[0])
    print("\n".join(job_rows(folder) + [""] + round_rows(folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
