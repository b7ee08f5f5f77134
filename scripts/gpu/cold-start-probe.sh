#!/usr/bin/env bash
# Where a local-backend GPU train job's cold start goes (process start → first sampled token),
# on the GPU node after scripts/gpu/node-setup.sh install. The gpu-textworld preset's job shape
# on 8 training games; its round-1 train jobs one after the other (--jobs 1), so the first pays
# the inductor compile and the second finds the cache warm, then both again with every cache
# warm. Brings back the jobs' timings.
#   [SAMPLER=graph|compile|eager] [SKIP_IMPORT_PROBE=1] [WARM=1] scripts/gpu/cold-start-probe.sh OUT
# SAMPLER: train.sampler and eval.sampler for the jobs (default: the preset's). SKIP_IMPORT_PROBE:
# leave out the bytecode-cache and -X importtime probes (≈ 100 s on the H200 node).
set -euo pipefail
OUT=${1:?usage: cold-start-probe.sh OUT}
mkdir -p "$OUT"
source scripts/gpu/node-env.sh
cat > /tmp/fa-cold.yaml <<YAML
run: gpu-cold
rounds: 1
env: {train_games: 8, val_games: 4}
eval: {n: 4${SAMPLER:+, sampler: $SAMPLER}}
${SAMPLER:+train: {sampler: $SAMPLER\}}
YAML
# WARM=1: every job forked from a warm server (as node-run.sh), its standbys warmed for this config.
WARM_CONFIG=${WARM_CONFIG:-"config/experiments/gpu-textworld.yaml /tmp/fa-cold.yaml"} source scripts/gpu/warm.sh
# Where the imports' time goes: is the interpreter compiling bytecode it cannot cache (a
# read-only site-packages without __pycache__)? Three runs as the jobs run, then three with a
# writable bytecode cache (PYTHONPYCACHEPREFIX), then the slowest imports (-X importtime).
python3 - <<'PY' | tee "$OUT/site.txt"
import os, importlib.util
for name in ("torch", "transformers", "textworld", "fastapi"):
    spec = importlib.util.find_spec(name)
    d = os.path.dirname(spec.origin)
    pyc = os.path.join(d, "__pycache__")
    print(name, d, "writable" if os.access(d, os.W_OK) else "read-only",
          f"__pycache__ files: {len(os.listdir(pyc)) if os.path.isdir(pyc) else 0}")
PY
if [ -z "${SKIP_IMPORT_PROBE:-}" ]; then
  for prefix in "" /tmp/fa-gpu/pycache; do
    for i in 1 2 3; do
      PYTHONPYCACHEPREFIX=$prefix python3 -c "import time; t=time.time(); import torch; a=time.time(); \
from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_config; import transformers.models.llama.modeling_llama; \
b=time.time(); import fedagent.train.local; print(f'prefix={\"$prefix\" or None} torch {a-t:.2f} transformers {b-a:.2f} rest {time.time()-b:.2f}')" \
        | tee -a "$OUT/imports_pyc.txt"
    done
  done
  python3 -X importtime -c "import torch, transformers.models.llama.modeling_llama, fedagent.train.local" \
    2> "$OUT/importtime.txt" || true
  (sort -t'|' -k2 -n -r "$OUT/importtime.txt" | head -40 > "$OUT/importtime_top.txt") || true
fi
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
