# Sourced by the GPU node scripts (after node-env.sh): with WARM=1, start a warm fork server
# (fedagent warm-server, every preload group, socket under /tmp), export FEDAGENT_WARM_SOCKET for
# Snakemake's jobs, and stop it when the script exits (its log goes to $OUT/warm-server.log).
# WARM_STANDBY (default 3: a round's two train jobs and the last round's eval start together):
# standby processes that start CUDA before a train-client/eval job asks (fedagent warm-server
# --standby N; 0: none, every job forked plainly). WARM_CONFIG (the run's config files, space-separated;
# node-run.sh sets its CONFIGFILE): each standby also runs that run's GPU calls once on a 1-layer
# model (--standby-config).
# WARM_STANDBY_DELAY (default 0): seconds after a hand-over before its replacement is forked
# (--standby-refill-delay; not yet measured on the H200).
if [ "${WARM:-0}" = 1 ]; then
  warm_dir=$(mktemp -d /tmp/fa-warm.XXXXXX)
  export FEDAGENT_WARM_SOCKET="$warm_dir/s"
  stop_warm() {
    fedagent warm-server --socket "$FEDAGENT_WARM_SOCKET" --stop >/dev/null 2>&1 || true
    if [ -n "${OUT:-}" ]; then cp "$warm_dir/s.log" "$OUT/warm-server.log" 2>/dev/null || true; fi
    rm -rf "$warm_dir"
  }
  trap stop_warm EXIT
  standby=(--standby "${WARM_STANDBY:-3}" --standby-refill-delay "${WARM_STANDBY_DELAY:-0}")
  if [ "${WARM_STANDBY:-3}" != 0 ]; then
    for f in ${WARM_CONFIG:-}; do standby+=(--standby-config "$f"); done   # space-separated config files
  fi
  fedagent warm-server --socket "$FEDAGENT_WARM_SOCKET" --preload train,eval,env,server "${standby[@]}" \
    --detach || exit 1
fi
