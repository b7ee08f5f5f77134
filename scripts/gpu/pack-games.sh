#!/usr/bin/env bash
# Pack a run's generated games (and Snakemake's record of them) to carry to a GPU node, so the
# node does not spend device time generating them (gpu-textworld: 384 games, 3.5 min on the
# H200 node's 16 cores; same seeds, same games):
#   scripts/gpu/pack-games.sh CONFIGFILE OUTDIR      (here, after: snakemake results/<run>/plan/games
#                                                     --profile profiles/local --configfile CONFIGFILE)
#   scripts/gpu/pack-games.sh config/matrices/NAME.yaml OUTDIR     (a matrix: its shared catalogues)
#     OUTDIR/games.tgz   results/<run>/plan/games + its .snakemake/metadata record
# On the node, from the checkout's root: tar -xzf OUTDIR/games.tgz (before scripts/gpu/node-run.sh).
set -euo pipefail
cfg=${1:?usage: pack-games.sh CONFIGFILE OUTDIR}; out=${2:?usage: pack-games.sh CONFIGFILE OUTDIR}
[ -f "$cfg" ] || { echo "pack-games.sh: no config file $cfg" >&2; exit 2; }
# A run's plan/games, or every shared catalogue of a matrix (config/matrices/<name>.yaml: it has `arms`;
# generate them with `snakemake --config matrix=<name> <each catalogue's plan/games>`).
games_dirs=$(python3 - "$cfg" <<'PY'
import sys, yaml
spec = yaml.safe_load(open(sys.argv[1]))
if "arms" in spec:
    from pathlib import Path
    from fedagent.plan.matrix import load_matrix
    defaults = yaml.safe_load(open("config/config.yaml"))
    m = load_matrix(str(Path(sys.argv[1])), defaults)
    print(" ".join(f"{m.out_dir}/_catalogue/{key}/plan/games" for key in m.catalogues))
else:
    print(f"results/{spec['run']}/plan/games")
PY
) || exit 1
files=()
for games in $games_dirs; do
  [ -f "$games/manifest.json" ] || { echo "pack-games.sh: $games has no manifest.json (generate it first)" >&2; exit 1; }
  meta=".snakemake/metadata/$(printf '%s' "$games" | base64 -w0)"
  [ -f "$meta" ] || { echo "pack-games.sh: no Snakemake record $meta (generate the games with snakemake)" >&2; exit 1; }
  files+=("$games" "$meta")
done
mkdir -p "$out"
tar -czf "$out/games.tgz" "${files[@]}"
ls -l "$out/games.tgz"
