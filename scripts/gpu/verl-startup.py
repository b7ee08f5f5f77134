#!/usr/bin/env python3
"""Where each verl job's start-up went: one Markdown row per client ``metrics.json``.

    python3 scripts/gpu/verl-startup.py results/<run>/round_*/clients/*/metrics.json
    python3 scripts/gpu/verl-startup.py OUT/round_*_client_*_metrics.json      (verl-round.sh's copies)

Columns are seconds after the trainer's launch (``metrics.json``'s ``timings_s.launch_to_*``: the
first appearance of each phase's log line, fedagent.train.verl.launch.PHASE_MARKERS, and the first
generated token from the agent loop's record), then the trainer's and the job's wall time.
"""

import json
import sys
from pathlib import Path

COLUMNS = [
    ("Ray up", "launch_to_ray_started"),
    ("TaskRunner ready", "launch_to_runner_ready"),
    ("engines", "launch_to_engines_initialized"),
    ("vLLM server up", "launch_to_rollout_server_up"),
    ("ready to fit", "launch_to_ready_to_fit"),
    ("**first token**", "launch_to_first_generation"),
    ("step 1 logged", "launch_to_first_step_logged"),
    ("trainer exit", "trainer"),
    ("conversion", "convert"),
    # train.verl.warm_refit jobs (and warm jobs of train.verl.engines: run): the reset began / reset →
    # the fit's first token
    ("refit began", "launch_to_refit"),
    ("**refit → first token**", "refit_to_first_generation"),
]


def row(path: Path) -> str:
    m = json.loads(path.read_text())
    t = m.get("timings_s", {})
    v = m.get("verl", {})
    levers = ", ".join(
        f"{k}={v[k]}"
        for k in ("enforce_eager", "vllm_executor", "reward_workers", "storage_units", "warm_refit")
        if k in v
    )
    es = v.get("engine_set")
    if es:  # train.verl.engines: run — which set, and whether the job found it warm
        levers += f", engine set {es.get('set', '?')[-8:]} {'warm' if es.get('warm') else 'cold'} (job {es.get('jobs_before', 0) + 1})"
    algo = m.get("params", {}).get("algorithm", "grpo")
    if "kl_coef" in m.get("params", {}):
        algo += f", kl_coef={m['params']['kl_coef']}"
    cells = [f"{t[k]:.1f}" if isinstance(t.get(k), (int, float)) else "–" for _, k in COLUMNS]
    return (
        f"| round {m['round']}, client {m['client']} ({algo}; {levers}) | "
        + " | ".join(cells)
        + f" | {m.get('wall_time_s', float('nan')):.1f} |"
    )


def main(argv) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print("| job | " + " | ".join(c for c, _ in COLUMNS) + " | job total |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for p in sorted(argv):
        print(row(Path(p)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
