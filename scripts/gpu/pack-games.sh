#!/usr/bin/env bash
# Pack a run's generated games (and Snakemake's record of them) to carry to a GPU node, so the
# node does not spend device time generating them (gpu-textworld: 384 games, 3.5 min on the
# H200 node's 16 cores; same seeds, same games):
#   scripts/gpu/pack-games.sh CONFIGFILE OUTDIR      (here, after: snakemake results/<run>/plan/games
#                                                     --profile profiles/local --configfile CONFIGFILE)
#     OUTDIR/games.tgz   results/<run>/plan/games + its .snakemake/metadata record
# On the node, from the checkout's root: tar -xzf OUTDIR/games.tgz (before scripts/gpu/node-run.sh).
set -euo pipefail
cfg=${1:?usage: pack-games.sh CONFIGFILE OUTDIR}; out=${2:?usage: pack-games.sh CONFIGFILE OUTDIR}
[ -f "$cfg" ] || { echo "pack-games.sh: no config file $cfg" >&2; exit 2; }
run=$(python3 -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['run'])" "$cfg")
games="results/$run/plan/games"
[ -f "$games/manifest.json" ] || { echo "pack-games.sh: $games has no manifest.json (generate it first)" >&2; exit 1; }
meta=".snakemake/metadata/$(printf '%s' "$games" | base64 -w0)"
[ -f "$meta" ] || { echo "pack-games.sh: no Snakemake record $meta (generate the games with snakemake)" >&2; exit 1; }
mkdir -p "$out"
tar -czf "$out/games.tgz" "$games" "$meta"
ls -l "$out/games.tgz"
