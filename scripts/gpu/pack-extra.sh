#!/usr/bin/env bash
# The wheels scripts/gpu/device-wheels.txt pins that an existing proj pack lacks, as one small bundle
# ("extra"), so a node that has proj's pieces needs one more transfer instead of a new pack (≈ 10 min):
#   scripts/gpu/pack-extra.sh PROJ_CONTENTS OUTDIR      (PROJ_CONTENTS: that pack's proj/contents.txt)
#     OUTDIR/extra/part-NN   the missing wheels (cp312, manylinux), in pieces of at most 48 MB (check-pieces.sh)
# On the node: node-setup.sh carry extra OUTDIR/extra/part-00 ...; node-setup.sh install.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
contents=${1:?usage: pack-extra.sh PROJ_CONTENTS OUTDIR}; out=${2:?usage: pack-extra.sh PROJ_CONTENTS OUTDIR}
py=${PYTHON:-python3}
mkdir -p "$out/extra"; out=$(cd "$out" && pwd)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheelhouse"
# A pin is missing when contents.txt (first column: the wheel's normalised name) has no such name.
"$py" - "$here/device-wheels.txt" "$contents" > "$work/reqs.txt" <<'PY'
import re, sys
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
have = {norm(line.split()[0]) for line in open(sys.argv[2]) if line.strip()}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line and norm(re.split(r"[=<>\[ ]", line)[0]) not in have:
        print(line)
PY
[ -s "$work/reqs.txt" ] || { echo "pack-extra.sh: every pin is in $contents already"; exit 0; }
cat "$work/reqs.txt"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$work/wheelhouse" -r "$work/reqs.txt"
rm -f "$out"/extra/part-*
(cd "$work" && tar -cf - wheelhouse | split -b 48MB -d -a 2 - "$out/extra/part-")
ls -la "$out"/extra/part-*
"$here/check-pieces.sh" 48 "$out/extra"
