#!/usr/bin/env bash
# Move a run's files between machines in pieces, so that a run goes on where it stopped on another node
# (a lent node's /tmp goes with it, and a device call brings back or carries in at most 64 MiB).
#   scripts/gpu/state.sh out DIR PATH...   the files under PATH... (relative to the checkout) as one tar
#                                          (POSIX format: every mtime to the nanosecond) split into
#                                          DIR/state-000, -001, ... of STATE_PIECE_MB (default 60) MB, and
#                                          DIR/state.sha256 (each piece's sha256); prints the pieces' count
#   scripts/gpu/state.sh in PIECE...       checks the pieces against the state.sha256 beside them, then
#                                          unpacks them into the checkout (mtimes kept)
# Snakemake decides what to run from the files and their mtimes, so the unpacked run resumes as it would
# have on the machine it came from: its finished jobs are not run again (tests/test_workflow.py). Its
# .snakemake/ record stays behind; the run's files carry their own provenance and manifests.
# Weights are fp32 safetensors, which compress by a few per cent only: the tar is not compressed.
set -euo pipefail
case "${1:-}" in
  out)
    dir=${2:?usage: state.sh out DIR PATH...}; shift 2
    [ "$#" -gt 0 ] || { echo "state.sh out: no PATH to pack" >&2; exit 2; }
    for p in "$@"; do [ -e "$p" ] || { echo "state.sh out: $p does not exist" >&2; exit 2; }; done
    mkdir -p "$dir"; rm -f "$dir"/state-* "$dir/state.sha256"
    tar --format=posix -cf - "$@" | split -d -a 3 -b "${STATE_PIECE_MB:-60}M" - "$dir/state-"
    (cd "$dir" && sha256sum state-[0-9]* > state.sha256)
    ls "$dir"/state-[0-9]* | wc -l ;;
  in)
    shift; [ "$#" -gt 0 ] || { echo "usage: state.sh in PIECE..." >&2; exit 2; }
    sums="$(dirname "$1")/state.sha256"
    [ -f "$sums" ] || { echo "state.sh in: no $sums beside the pieces" >&2; exit 2; }
    have=$(for p in "$@"; do basename "$p"; done | sort | tr '\n' ' ')
    want=$(awk '{print $2}' "$sums" | sort | tr '\n' ' ')
    [ "$have" = "$want" ] || { echo "state.sh in: pieces given [$have], $sums lists [$want]" >&2; exit 2; }
    (cd "$(dirname "$1")" && sha256sum --quiet -c state.sha256) || { echo "state.sh in: a piece differs from $sums" >&2; exit 1; }
    printf '%s\0' "$@" | sort -z | xargs -0 cat | tar -xf - ;;
  *) echo "usage: state.sh out DIR PATH... | in PIECE..." >&2; exit 2 ;;
esac
