#!/usr/bin/env bash
# Where a local-backend GPU train job's cold start goes (process start → first sampled token),
# on the GPU node after scripts/gpu/node-setup.sh install. The gpu-textworld preset's job shape
# on 8 training games; its round-1 train jobs one after the other (--jobs 1), so the first pays
# the inductor compile and the second finds the cache warm, then both again with every cache
# warm. Brings back the jobs' timings.
#   scripts/gpu/cold-start-probe.sh OUT
set -euo pipefail
OUT=${1:?usage: cold-start-probe.sh OUT}
mkdir -p "$OUT"
source scripts/gpu/node-env.sh
cat > /tmp/fa-cold.yaml <<YAML
run: gpu-cold
rounds: 1
env: {train_games: 8, val_games: 4}
eval: {n: 4}
YAML
# Imports alone (the job's first seconds), three times.
for i in 1 2 3; do
  python3 -c "import time; t=time.time(); import torch, transformers, fedagent.train.local; \
torch.zeros(1, device='cuda'); print(f'import+cuda_init_s {time.time()-t:.2f}')" | tee -a "$OUT/imports.txt"
done
# Pass 1: the run from scratch (client 0 pays the inductor compile, client 1 finds it warm);
# pass 2: both train jobs again (--forcerun), every cache warm. --notemp keeps the client dirs.
R=results/gpu-cold
for pass in 1 2; do
  extra=(); [ "$pass" = 2 ] && extra=(--forcerun train_client)
  t0=$(date +%s)
  snakemake results/gpu-cold/round_001/aggregate --profile profiles/local --cores "$(nproc)" --jobs 1 \
    --notemp --configfile config/experiments/gpu-textworld.yaml /tmp/fa-cold.yaml "${extra[@]}" \
    2>&1 | tail -30 > "$OUT/snakemake_pass$pass.log"
  echo "wall $(( $(date +%s) - t0 )) s" >> "$OUT/snakemake_pass$pass.log"
  for m in "$R"/round_001/clients/*/metrics.json; do
    c=$(basename "$(dirname "$m")")
    python3 - "$m" <<'PY' | tee "$OUT/pass${pass}_client_$c.txt"
import json, sys
m = json.load(open(sys.argv[1]))
print(json.dumps({"timings": m["timings"], "wall_time_s": m["wall_time_s"]}, indent=1))
PY
  done
  mkdir -p "$OUT/bench_pass$pass"
  for b in "$R"/benchmarks/round_001/train_client_*.tsv; do cp "$b" "$OUT/bench_pass$pass/"; done
done
# The round-0 eval job's timings (same overlap of env service and model load/warm-up).
cp "$R"/round_000/eval_timings.json "$OUT/round0_eval_timings.json" 2>/dev/null || true
