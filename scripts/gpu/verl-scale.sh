#!/usr/bin/env bash
# The verl backend at SmolLM2-1.7B's shape through Snakemake on one card (issue 48's must-show 1): a preset's
# rounds in ONE Snakemake invocation (run-scoped engine sets stay warm from round to round), every round
# verified (`fedagent verify`) as soon as its merge is done, then pruned, so that 4 rounds of 6.8 GB model dirs
# fit the node's 64 GiB disk. Install as for scripts/gpu/verl-round.sh (its header: node-setup.sh carry/install,
# `verl-round.sh check`). From the checkout's root:
#
#   scripts/gpu/verl-scale.sh start OUT     # `run` in the background (nohup; OUT/scale.log), returns at once
#   scripts/gpu/verl-scale.sh status OUT    # rounds verified, the last Snakemake lines, GPU memory now
#   scripts/gpu/verl-scale.sh run OUT       # the same in the foreground (a run longer than one device call: start)
#
# What it does: snakemake --notemp on CONFIG (+ scripts/gpu/verl-scale-short.yaml with BUDGETS=short) with
# rounds=ROUNDS; beside it, a loop that verifies round r once round_r/model's manifest is there (`--prev
# round_{r-1}/model`, `--prev-server-state` from round 2 on) and copies its records into OUT/RUN/; once its report
# is written it deletes the round's client updates and aggregate, and round r-1's model once that round's eval
# is done (temp() outputs of the preset's keep policy: Snakemake re-runs nothing for a missing temp file whose
# consumers are done). A failed
# verify stops Snakemake (SIGINT) and keeps the round's files. nvidia-smi samples every card's memory each
# second (OUT/RUN/gpu-util.csv). At the end: the engine sets stopped, OUT/RUN/memory.md
# (scripts/gpu/verl-memory.py: per job the declared memory, the plan, verl's peaks, each set's memory and growth;
# per round the wall time and its split) and OUT/RUN.tgz (records, logs, benchmarks, the sets' server.log).
#
# Knobs: CONFIG (default config/experiments/gpu-verl-scale-webshop.yaml; its -ppo twin for PPO), BUDGETS (short,
# the default: gpu-scale-webshop.yaml's budgets, the run named <run>-short; reference: the preset's own, the
# reference's 15 turns x 512 tokens), ROUNDS (default the preset's), RUN (default the preset's run name, + -short),
# LIMIT (seconds before Snakemake is stopped, default 1700: one device hold is at most 30 minutes), EXTRA (one more
# `--config` KEY=VALUE item, e.g. "train={verl: {engines_max_growth_gb: 8}}").
set -uo pipefail
cmd=${1:?usage: verl-scale.sh start OUT | run OUT | status OUT}
OUT=${2:-${OUT:-/tmp/fa-gpu-out}}
FA=${FA_GPU:-/tmp/fa-gpu}
CONFIG=${CONFIG:-config/experiments/gpu-verl-scale-webshop.yaml}
BUDGETS=${BUDGETS:-short}
case "$BUDGETS" in short|reference) ;; *) echo "verl-scale.sh: BUDGETS is short or reference (got $BUDGETS)" >&2; exit 2 ;; esac
read -r base_run base_rounds keep_every < <(python3 - "$CONFIG" <<'PY'
import sys, yaml
c = yaml.safe_load(open(sys.argv[1]))
print(c["run"], c.get("rounds", 1), (c.get("keep") or {}).get("models_every", 1))
PY
) || { echo "verl-scale.sh: cannot read $CONFIG" >&2; exit 2; }
RUN=${RUN:-$base_run$([ "$BUDGETS" = short ] && echo -short)}
ROUNDS=${ROUNDS:-$base_rounds}
R=results/$RUN
B=$OUT/$RUN
# one --configfile with both files (a second --configfile would replace the first)
cfgs=(--configfile "$CONFIG")
[ "$BUDGETS" = short ] && cfgs+=(scripts/gpu/verl-scale-short.yaml)

node_env() {
  source scripts/gpu/node-env.sh
  export PYTHONPATH="$FA/vsite:$PYTHONPATH"   # vLLM + verl's set first (verl-round.sh says why)
  export VLLM_USE_FLASHINFER_SAMPLER=0 RAY_USAGE_STATS_ENABLED=0 PYTHONHASHSEED=0
  export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$FA/vllm-cache}
}

round_dir() { printf '%s/round_%03d' "$R" "$1"; }

# round r's records that its pruning deletes, into OUT/RUN (flat names): the clients' metrics, the aggregate's
# and the server step's records
keep_records() {
  local rd name; rd=$(round_dir "$1"); name=$(basename "$rd")
  for m in "$rd"/clients/*/metrics.json; do
    if [ -f "$m" ]; then cp "$m" "$B/${name}_client_$(basename "$(dirname "$m")")_metrics.json"; fi
  done
  if [ -f "$rd/aggregate/aggregate.json" ]; then cp "$rd/aggregate/aggregate.json" "$B/${name}_aggregate.json"; fi
  if [ -f "$rd/model/server.json" ]; then cp "$rd/model/server.json" "$B/${name}_server.json"; fi
}

# every round's small records (never pruned), at the end
keep_round_files() {
  local rd name
  for rd in "$R"/round_*; do
    name=$(basename "$rd")
    for f in eval.json timings.csv summary.csv eval_timings.json; do
      if [ -f "$rd/$f" ]; then cp "$rd/$f" "$B/${name}_$f"; fi
    done
  done
}

# verify round r against round r-1; 0 when OK
verify_round() {
  local r=$1 rd prev state=()
  rd=$(round_dir "$r"); prev=$(round_dir $(( r - 1 )))/model
  [ "$r" -gt 1 ] && state=(--prev-server-state "$prev")
  local t0; t0=$(date +%s)
  fedagent verify --prev "$prev" --clients "$rd"/clients/* --aggregate "$rd/aggregate" --model "$rd/model" \
    "${state[@]}" >> "$B/verify.log" 2>&1
  local vrc=$?
  echo "verify round $r rc=$vrc ($(( $(date +%s) - t0 )) s)" | tee -a "$B/verify.log"
  return $vrc
}

case "$cmd" in
start)
  mkdir -p "$OUT"
  nohup "$0" run "$OUT" > "$OUT/scale.log" 2>&1 &
  echo "verl-scale.sh: run $RUN started (pid $!); poll: $0 status $OUT"
  ;;
status)
  echo "run $RUN: verified rounds: $(ls -d "$R"/round_*/.verified 2>/dev/null | wc -l) of $ROUNDS"
  tail -n 3 "$B/verify.log" 2>/dev/null
  grep -E "^\[|steps \(|Error|error" "$B/snakemake.log" 2>/dev/null | tail -n 8
  tail -n 3 "$OUT/scale.log" 2>/dev/null
  nvidia-smi --query-gpu=index,memory.used,memory.total,utilization.gpu --format=csv,noheader 2>/dev/null
  df -h . | tail -n 1; free -g | head -n 2
  ;;
run)
  node_env
  mkdir -p "$B" results
  exec 9> "results/.verl-scale-$RUN.lock"
  flock -n 9 || { echo "verl-scale.sh: a run of $RUN is going on (results/.verl-scale-$RUN.lock)" >&2; exit 2; }
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,noheader,nounits -l 1 \
      >> "$B/gpu-util.csv" 2>/dev/null & sampler=$!
  fi
  t0=$(date +%s); echo "snakemake started $(date -u +%FT%T) ($RUN, $ROUNDS rounds, budgets $BUDGETS)" | tee -a "$B/snakemake.log"
  # one --config (Snakemake keeps only the last): the run's name and rounds, then EXTRA's item
  extra=(); [ -n "${EXTRA:-}" ] && extra=("$EXTRA")
  timeout --signal=INT --kill-after=30 "${LIMIT:-1700}" \
    snakemake --profile profiles/local --cores "$(nproc)" --notemp "${cfgs[@]}" \
    --config "run=$RUN" "rounds=$ROUNDS" "${extra[@]}" >> "$B/snakemake.log" 2>&1 &
  smk=$!
  next=1; vfail=0; pending=()    # verified rounds whose files still wait for their last consumer
  while :; do
    alive=1; kill -0 "$smk" 2>/dev/null || alive=0
    while [ "$next" -le "$ROUNDS" ]; do
      rd=$(round_dir "$next")
      if [ -f "$rd/.verified" ]; then next=$(( next + 1 )); continue; fi    # an earlier call's
      [ -f "$rd/model/manifest.json" ] && [ -d "$rd/aggregate" ] || break
      verify_round "$next" || { vfail=1; break; }
      keep_records "$next"
      touch "$rd/.verified"
      pending+=("$next")
      next=$(( next + 1 ))
    done
    # prune a verified round r once Snakemake is done with its files: its clients and aggregate after its
    # report (which reads the clients' metrics), round r-1's model (temp unless every keep.models_every-th)
    # after round r-1's eval
    left=()
    for r in "${pending[@]}"; do
      rd=$(round_dir "$r")
      if [ -f "$rd/summary.csv" ] && [ -f "$rd/points.csv" ] && { [ "$r" = 1 ] || [ -f "$(round_dir $(( r - 1 )))/eval.json" ]; }; then
        rm -rf "$rd"/clients/* "$rd/aggregate"
        if [ "$r" -gt 1 ] && [ $(( (r - 1) % keep_every )) -ne 0 ]; then rm -rf "$(round_dir $(( r - 1 )))/model"; fi
        echo "pruned round $r" >> "$B/verify.log"
      else
        left+=("$r")
      fi
    done
    pending=("${left[@]}")
    if [ "$vfail" = 1 ]; then
      echo "verl-scale.sh: round $next did not verify: stopping Snakemake, its files kept" | tee -a "$B/verify.log"
      kill -INT "$smk" 2>/dev/null
      break
    fi
    [ "$alive" = 1 ] || break
    sleep "${POLL_S:-10}"
  done
  wait "$smk"; rc=$?
  echo "snakemake rc=$rc wall=$(( $(date +%s) - t0 ))s" | tee -a "$B/snakemake.log"
  [ -n "${sampler:-}" ] && kill "$sampler" 2>/dev/null
  for d in "$R"/.verl-engines/slot-*/; do   # a run cut by LIMIT leaves its sets up: stop them (GPU memory)
    [ -d "$d" ] && python3 -c 'import sys, pathlib; from fedagent.train.verl.engines.client import stop_set; stop_set(pathlib.Path(sys.argv[1]))' "$d"
    [ -f "$d/server.log" ] && sed 's/\x1b\[[0-9;]*m//g' "$d/server.log" > "$B/engines_$(basename "$d")_server.log"
  done
  for f in $(cd "$R" && find logs benchmarks -type f 2>/dev/null); do cp "$R/$f" "$B/$(echo "$f" | tr / _)"; done
  keep_round_files
  python3 scripts/gpu/verl-memory.py "$B" > "$B/memory.md" 2>&1
  nvidia-smi > "$B/nvidia-smi.txt" 2>&1 || true
  tar -czf "$OUT/$RUN.tgz" -C "$OUT" "$RUN"
  echo "verl-scale.sh: $(ls -d "$R"/round_*/.verified 2>/dev/null | wc -l) of $ROUNDS rounds verified; $OUT/$RUN.tgz"
  [ "$rc" -eq 0 ] && [ "$vfail" = 0 ]
  ;;
*)
  echo "unknown step $cmd" >&2; exit 2
  ;;
esac
