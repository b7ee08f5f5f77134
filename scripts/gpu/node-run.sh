#!/usr/bin/env bash
# On the GPU node: run (or resume) a preset through the workflow and pack what to bring back.
#   scripts/gpu/node-run.sh CONFIGFILE [SECONDS] [snakemake args...]
#   scripts/gpu/node-run.sh config/matrices/NAME.yaml [SECONDS] [snakemake args...]   (a whole matrix)
# Stops Snakemake cleanly after SECONDS (default 540: under one device call), or earlier when DEADLINE
# (the call's end, epoch seconds; below) leaves less, so a later call resumes the same run from its files.
# Packs results (no weights, no games), logs and benchmarks — with the TensorBoard events (tensorboard/)
# and MLflow file store (mlruns/) of report.trackers, small — into $OUT/run.tgz when OUT is set.
# WARM=1: the jobs are forked from a warm server (fedagent warm-server, all groups preloaded,
# socket under /tmp) started before Snakemake and stopped on exit; its log goes to $OUT too. Its
# standby processes (WARM_STANDBY, default 3) warm CONFIGFILE's GPU calls (scripts/gpu/warm.sh).
# First it checks that the run's env.kind imports and plays (node-setup.sh check; SKIP_ENV_CHECK=1 skips).
# DETACH=1 (OUT set): Snakemake (with the warm server and the GPU sampler) runs in its own process session,
# which a device call's end does not kill, so no job is lost at a call's boundary (each stop of the default
# mode kills the jobs in flight: ≈ 2 min of two ALFWorld train jobs, twice, 2026-12-07). SECONDS is then
# Snakemake's whole limit. The call starts it unless this run's is running already, waits on it until
# DEADLINE (less PACK_S), packs what is there into $OUT and exits with Snakemake's rc, or 75 while it still
# runs: call again (DETACH=1, within the node's idle release) to wait on the same Snakemake.
set -uo pipefail
cfg=${1:?usage: node-run.sh CONFIGFILE [SECONDS] [snakemake args...]}; limit=${2:-540}; shift; shift || true
source scripts/gpu/node-env.sh
# A matrix (config/matrices/<name>.yaml, it has `arms`): every arm x seed through `--config matrix=<name>`,
# its results in results/<name>/ (table.csv/table.md/curves.png come back; clients.csv/clients.md inside run.tgz); the warm server's standbys
# warm its base preset's GPU calls.
read -r run kind base det < <(python3 - "$cfg" <<'PY'
import sys, yaml
spec = yaml.safe_load(open(sys.argv[1]))
if "arms" in spec:
    from pathlib import Path
    base = spec.get("base")
    b = (yaml.safe_load(open(base)) or {}) if base else {}
    env = {**(b.get("env") or {}), **((spec.get("common") or {}).get("env") or {})}
    det = any(x.get("deterministic") for x in (b, spec.get("common") or {}, *(spec.get("arms") or {}).values()) if x)
    print(Path(sys.argv[1]).stem, env.get("kind") or "textworld", base or "-", int(det))
else:
    print(spec["run"], (spec.get("env") or {}).get("kind") or "textworld", "-", int(bool(spec.get("deterministic"))))
PY
)
if [ "$base" = - ]; then what=(--configfile "$cfg"); warm_cfg=$cfg; else what=(--config "matrix=$run"); warm_cfg=$base; fi
# Snakemake keeps only the last --config (each replaces the one before): a second one after ours
# would drop matrix=NAME and run the workflow's default instead (seen on the node: `--config rounds=2`
# ran the CPU default for 208 s of device time). So: one --config at most, and ours joins it.
n=0; for a in "$@"; do [ "$a" = --config ] && n=$((n + 1)); done
if [ "$n" -gt 1 ]; then
  echo "node-run.sh: --config given $n times; Snakemake keeps only the last: give every KEY=VALUE after one --config" >&2; exit 2
fi
if [ "$n" = 1 ] && [ "$base" != - ]; then
  args=(); for a in "$@"; do args+=("$a"); [ "$a" = --config ] && args+=("matrix=$run"); done
  set -- "${args[@]}"; what=()
fi
# The run's environment must import and play here before any job starts (one line naming what is
# missing; ≈ 2-20 s). SKIP_ENV_CHECK=1: not again (a resumed call of the same run on the same node).
# The report's trackers too (TensorBoard + MLflow write and read back here): a round's report would stop
# the run otherwise, after its GPU work.
[ "${SKIP_ENV_CHECK:-0}" = 1 ] || scripts/gpu/node-setup.sh check "$kind" trackers || exit 1
# deterministic (the config's, or deterministic=true on the command line): cuBLAS's workspace setting exported
# before the warm server starts, so its standbys' CUDA starts with it and takes the runs' jobs (the workflow
# exports it to the jobs; fedagent/model/determinism.py).
for a in "$@"; do case "$a" in deterministic=[Tt]rue|deterministic=1) det=1 ;; deterministic=[Ff]alse|deterministic=0) det=0 ;; esac; done
[ "$det" = 1 ] && export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
# Results (no weights, no games), logs and benchmarks into $1.
pack() {
  if [ "$base" != - ] && [ -d "results/$run" ]; then
    tar -czf "$1/run.tgz" --exclude='*.safetensors' --exclude='*/plan/games' --exclude='*/tokenizer.json' \
      --exclude='*/samples.jsonl' "results/$run"
    for f in table.csv table.md curves.png; do cp "results/$run/$f" "$1/" 2>/dev/null; done
  elif [ -d "results/$run" ]; then
    tar -czf "$1/run.tgz" --exclude='*.safetensors' --exclude="results/$run/plan/games" \
      --exclude='*/tokenizer.json' "results/$run"
    cp "results/$run/summary.csv" "$1/" 2>/dev/null; cp "results/$run/curves.png" "$1/" 2>/dev/null
    last=$(ls -d "results/$run"/round_* 2>/dev/null | tail -1)   # its timings.csv has every round's row
    [ -n "$last" ] && cp "$last/timings.csv" "$1/" 2>/dev/null
  fi
  return 0
}
stop_s=${STOP_S:-30}
if [ "${DETACH:-0}" = 1 ]; then
  [ -n "${OUT:-}" ] || { echo "node-run.sh: DETACH=1 needs OUT (where each call packs what the run has)" >&2; exit 2; }
  state=${NODE_RUN_STATE:-/tmp/fa-node-run}/$run; mkdir -p "$state"
  pid=$(cat "$state/pid" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    echo "node-run.sh: $run's Snakemake runs already (pid $pid, started by an earlier call): waiting on it"
  else
    rm -f "$state/rc" "$state/pid"
    # This script again, in a new session (setsid), in the default mode with no DEADLINE: it owns the warm
    # server, the sampler and Snakemake, packs into $state when Snakemake ends and writes its rc there.
    setsid env DETACH=0 DEADLINE= SKIP_ENV_CHECK=1 OUT="$state" NODE_RUN_RC="$state/rc" \
      bash scripts/gpu/node-run.sh "$cfg" "$limit" "$@" >> "$state/node-run.log" 2>&1 < /dev/null &
    pid=$!; echo "$pid" > "$state/pid"
    echo "node-run.sh: $run's Snakemake started in its own session (pid $pid, limit $limit s; log $state/node-run.log)"
  fi
  end=$(( ${DEADLINE:-$(( $(date +%s) + limit + stop_s + 5 ))} - ${PACK_S:-30} ))
  while [ ! -f "$state/rc" ] && kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 1; done
  pack "$OUT"
  for f in node-run.log gpu-util.csv warm-server.log; do cp "$state/$f" "$OUT/" 2>/dev/null; done
  if [ -f "$state/rc" ]; then
    rc=$(cat "$state/rc"); rm -f "$state/pid" "$state/rc"
    echo "node-run.sh: $run's Snakemake ended: rc=$rc"; exit "$rc"
  fi
  if ! kill -0 "$pid" 2>/dev/null; then
    rm -f "$state/pid"; echo "node-run.sh: $run's Snakemake (pid $pid) ended without writing its rc" >&2; exit 1
  fi
  echo "node-run.sh: $run's Snakemake still runs (pid $pid): call again with DETACH=1 to wait on it"; exit 75
fi
WARM_CONFIG=${WARM_CONFIG:-$warm_cfg} source scripts/gpu/warm.sh
# GPU utilisation and memory every second while Snakemake runs ($OUT/gpu-util.csv; GPU_SAMPLE=0: off).
if [ -n "${OUT:-}" ] && [ "${GPU_SAMPLE:-1}" = 1 ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -l 1 \
    >> "$OUT/gpu-util.csv" 2>/dev/null & sampler=$!
fi
# A Snakemake killed by the timeout below (SIGKILL after 30 s of SIGINT) or by the device call's own limit
# leaves its lock in .snakemake/locks, and the next call stops at once with "Directory cannot be locked"
# (seen on the node, 2026-12-03). When no Snakemake of this checkout is running, the lock is stale: unlock.
if [ -n "$(ls -A .snakemake/locks 2>/dev/null)" ]; then
  live=0; for p in $(pgrep -f snakemake 2>/dev/null); do
    [ "$p" != $$ ] && [ "$(readlink "/proc/$p/cwd" 2>/dev/null)" = "$PWD" ] && live=1
  done
  if [ "$live" = 0 ]; then
    echo "node-run.sh: a stale Snakemake lock (no Snakemake of this checkout runs): unlocking"
    snakemake --profile profiles/local "${what[@]}" "$@" --unlock || exit 1
  fi
fi
# DEADLINE (epoch seconds): when the device call running this script ends. Snakemake's limit is cut so
# that its stop (SIGINT, then up to STOP_S = 30 s before SIGKILL) and the packing below (PACK_S, default
# 30 s) end before it, whatever the set-up before this line took (install, the env check, the warm server):
# a call that ran `node-setup.sh install` first and gave node-run.sh 515 s of its 600 was cut off while
# packing, and its run.tgz never came back (node, 2026-12-06). Set it first thing in the call:
#   DEADLINE=$(( $(date +%s) + 595 )) ...; OUT=$OUT DEADLINE=$DEADLINE scripts/gpu/node-run.sh CONFIG 600
if [ -n "${DEADLINE:-}" ]; then
  left=$(( DEADLINE - $(date +%s) - stop_s - ${PACK_S:-30} ))
  if [ "$left" -lt 1 ]; then
    echo "node-run.sh: no time left before DEADLINE for Snakemake (stop ${stop_s} s and packing ${PACK_S:-30} s kept)" >&2
    exit 1
  fi
  if [ "$left" -lt "$limit" ]; then echo "node-run.sh: limit $limit s cut to $left s (DEADLINE)"; limit=$left; fi
fi
t0=$(date +%s); echo "snakemake started $(date -u +%FT%T)"
timeout --signal=INT --kill-after="$stop_s" "$limit" snakemake --profile profiles/local "${what[@]}" --cores all "$@"
rc=$?
echo "snakemake rc=$rc after $(( $(date +%s) - t0 )) s (ended $(date -u +%FT%T))"
[ -n "${sampler:-}" ] && kill "$sampler" 2>/dev/null
[ -n "${OUT:-}" ] && pack "$OUT"
[ -n "${NODE_RUN_RC:-}" ] && echo "$rc" > "$NODE_RUN_RC.tmp" && mv "$NODE_RUN_RC.tmp" "$NODE_RUN_RC"
exit $rc   # (WARM=1: the EXIT trap stops the warm server)
