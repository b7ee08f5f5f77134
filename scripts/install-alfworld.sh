#!/usr/bin/env bash
# Install ALFWorld's TextWorld side (alfworld + textworld[pddl]) into a venv, reproducibly.
#
#   scripts/install-alfworld.sh [VENV]        (default: .venv)
#
# alfworld 0.4.2 depends only on textworld[pddl], i.e. on fast-downward-textworld, which has
# no wheel: pip builds the planner from source (cmake + a C++ compiler + make, ~3-10 min on
# 2 cores). It does not touch torch / transformers / numpy / textworld versions.
set -euo pipefail

VENV="${1:-${VENV:-.venv}}"
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "no python at $PY (create the project venv first)" >&2; exit 1; }
for tool in c++ make; do
    command -v "$tool" >/dev/null || { echo "$tool not found: fast-downward needs a C++ toolchain" >&2; exit 1; }
done

# fast-downward-textworld's setup.py runs `python build.py` from PATH. Inside pip's isolated
# build env a pyenv shim (or a foreign python) fails with "No module named 'glob'", so the
# venv's own bin goes first.
export PATH="$(cd "$VENV/bin" && pwd):$PATH"

"$PY" -m pip install "alfworld==0.4.2" "fast-downward-textworld==20.6.4"

# Fail here, not in the first test, if the planner library did not build.
"$PY" - <<'PY'
import importlib.util, os
before = os.environ.get("ALFWORLD_DATA")
import fast_downward, textworld.envs.pddl
lib = fast_downward.load_lib(); fast_downward.close_lib(lib)
spec = importlib.util.find_spec("alfworld")
assert spec is not None, "alfworld not importable"
print("alfworld + fast_downward OK:", list(spec.submodule_search_locations)[0])
PY
