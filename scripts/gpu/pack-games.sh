#!/usr/bin/env bash
# Pack a run's generated task catalogue (and Snakemake's record of it) to carry to a GPU node, so the
# node does not spend device time generating it (same seeds, same games):
#   gpu-textworld: 384 games, 3.5 min on the H200 node's 16 cores;
#   gpu-alfworld: 384 + 128 games solved by the PDDL planner (docs/results/cpu.md has the time; the node
#   never finished it inside a device call).
#   scripts/gpu/pack-games.sh CONFIGFILE OUTDIR      (here, after: snakemake results/<run>/plan/games
#                                                     --profile profiles/local --configfile CONFIGFILE)
#   scripts/gpu/pack-games.sh config/matrices/NAME.yaml OUTDIR     (a matrix: its shared catalogues, after
#                                                     snakemake --config matrix=NAME <each one's plan/games>)
#     OUTDIR/games.tgz   results/<run>/plan/games + its .snakemake/metadata record
# On the node, from the checkout's root: tar -xzf OUTDIR/games.tgz (before scripts/gpu/node-run.sh);
# `snakemake -n --profile profiles/local --configfile CONFIGFILE` there must not list the games job.
# One device call carries at most 64 MiB: a tarball over 60 MB (10^6 bytes) is refused.
set -euo pipefail
cfg=${1:?usage: pack-games.sh CONFIGFILE OUTDIR}; out=${2:?usage: pack-games.sh CONFIGFILE OUTDIR}
[ -f "$cfg" ] || { echo "pack-games.sh: no config file $cfg" >&2; exit 2; }
# A run's plan/games, or every shared catalogue of a matrix (its file has `arms`).
games_dirs=$(python3 - "$cfg" <<'PY'
import sys, yaml
spec = yaml.safe_load(open(sys.argv[1]))
if "arms" in spec:
    from pathlib import Path
    from fedagent.plan.matrix import load_matrix
    m = load_matrix(str(Path(sys.argv[1])), yaml.safe_load(open("config/config.yaml")))
    print(" ".join(f"{m.out_dir}/_catalogue/{key}/plan/games" for key in m.catalogues))
else:
    print(f"results/{spec['run']}/plan/games")
PY
) || exit 1
# Snakemake's file persistence names an output's record by the URL-safe base64 of its path, cut into
# NAME_MAX-1 pieces ('@'-prefixed folders but the last) (snakemake/persistence/file.py, _record_path).
record_path() {
  python3 - "$1" <<'PY'
import base64, os, sys
b = base64.urlsafe_b64encode(sys.argv[1].encode()).decode()
n = max(os.pathconf(".snakemake/metadata" if os.path.isdir(".snakemake/metadata") else ".", "PC_NAME_MAX"), 2) - 1
parts = [b[i:i + n] for i in range(0, len(b), n)]
print(os.path.join(".snakemake/metadata", *(["@" + p for p in parts[:-1]] + parts[-1:])))
PY
}
files=()
for games in $games_dirs; do
  [ -f "$games/manifest.json" ] || { echo "pack-games.sh: $games has no manifest.json (generate it first)" >&2; exit 1; }
  meta=$(record_path "$games")
  [ -f "$meta" ] || { echo "pack-games.sh: no Snakemake record $meta (generate the games with snakemake)" >&2; exit 1; }
  files+=("$games" "$meta")
done
mkdir -p "$out"
tar -czf "$out/games.tgz" "${files[@]}"
size=$(stat -c %s "$out/games.tgz")
ls -l "$out/games.tgz"
if [ "$size" -gt 60000000 ]; then
  echo "pack-games.sh: $out/games.tgz is $size bytes, over the 60 MB one device call carries" >&2; exit 1
fi
