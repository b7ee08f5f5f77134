#!/usr/bin/env bash
# Set up (first time only) and run the embedded default experiment end to end.
# Extra arguments go to Snakemake, e.g. `scripts/run-default.sh --config rounds=3`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec snakemake --profile profiles/local "$@"
