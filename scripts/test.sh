#!/usr/bin/env bash
# Set up (first time only) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-alfworld
export PATH="$PWD/.venv/bin:$PATH"
# Two workers (pytest-xdist), one test file each at a time: a file's module/session fixtures (the
# shared workflow runs) are built once per worker. The files go out in collection order, which
# tests/conftest.py starts with the longest files (LONGEST_FILES), so both workers end together.
# `-n 0` (given after) runs it serially. The 25 slowest tests are listed.
exec python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=25 "$@"
