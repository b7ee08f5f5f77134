#!/usr/bin/env bash
# What a fresh process on the GPU node pays to import what each verl job process imports, twice per
# module (the second run reads bytecode the first wrote, if the site dirs are writable). Imports only:
# nothing here touches the GPU (torch is imported, CUDA is not initialised). Run from the repository
# root after scripts/gpu/node-setup.sh install; prints one line per (module, try) and vLLM's slowest
# imports (python -X importtime). Issue 30: is a job's ≈ 25 s per process import or initialisation?
set -euo pipefail
FA=${FA_GPU:-/tmp/fa-gpu}
source scripts/gpu/node-env.sh
export PYTHONPATH="$FA/vsite:$PYTHONPATH" VLLM_USE_FLASHINFER_SAMPLER=0 RAY_USAGE_STATS_ENABLED=0
python3 -c 'import sys, os; print("dont_write_bytecode", sys.dont_write_bytecode, "PYTHONDONTWRITEBYTECODE", os.environ.get("PYTHONDONTWRITEBYTECODE"), "cores", os.cpu_count())'
python3 - <<'PY'
import subprocess, sys, time
for m in ("torch", "transformers", "ray", "vllm", "verl.trainer.main_ppo", "verl.trainer.ppo.v1.trainer_base",
          "verl.workers.engine_workers", "vllm.v1.engine.core", "fedagent.train.verl.agent_loop"):
    for attempt in (1, 2):
        t0 = time.monotonic()
        rc = subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True).returncode
        print(f"{m:40s} try {attempt}  {time.monotonic() - t0:6.2f} s" + ("" if rc == 0 else "  (import failed)"))
PY
echo "pyc files under vsite: $(find "$FA/vsite" -name '*.pyc' | wc -l)"
python3 -X importtime -c "import verl.workers.engine_workers" 2>&1 | sort -t'|' -k2 -n | tail -12
