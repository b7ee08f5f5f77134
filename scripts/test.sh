#!/usr/bin/env bash
# Set up (first time only) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-alfworld
export PATH="$PWD/.venv/bin:$PATH"
exec python -m pytest -q -p no:cacheprovider "$@"
