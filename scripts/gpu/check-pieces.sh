#!/usr/bin/env bash
# Every piece DIR/part-* of each DIR must travel in one device call: at most PIECE_MB (10^6 bytes), and,
# since a call carries the checkout (tracked and untracked-not-ignored files) beside the piece, 64 MiB in
# all, the piece plus today's checkout plus MARGIN_MB (default 4, for the checkout's growth) within 64 MiB.
# make-wheelhouse.sh's 60 MiB pieces were refused beside an 8 MB checkout.
#   scripts/gpu/check-pieces.sh PIECE_MB DIR...      exit 1 naming each piece that would not travel
set -euo pipefail
piece=${1:?usage: check-pieces.sh PIECE_MB DIR...}; shift
[ $# -gt 0 ] || { echo "usage: check-pieces.sh PIECE_MB DIR..." >&2; exit 2; }
parts=(); for d in "$@"; do parts+=("$d"/part-*); done
here=$(cd "$(dirname "$0")" && pwd)
root=${CHECKOUT:-$(cd "$here/../.." && pwd)}
tree=$(cd "$root" && git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
ls -laL "${parts[@]}" | awk -v max=$((piece * 1000000)) -v tree="${tree:-0}" \
  -v room=$(( 64 * 1048576 - ${tree:-0} - ${MARGIN_MB:-4} * 1000000 )) '
  {s+=$5; if ($5 > max) big=big" "$9; if ($5 > room) wide=wide" "$9}
  END {printf "%d pieces, %.0f MB; the checkout %.1f MB\n", NR, s/1e6, tree/1e6
       if (big) {print "pieces over PIECE_MB:" big; exit 1}
       if (wide) {printf "pieces that beside the checkout (%.1f MB) and MARGIN_MB do not fit a device call'"'"'s 64 MiB (give a smaller PIECE_MB):%s\n", tree/1e6, wide; exit 1}}'
