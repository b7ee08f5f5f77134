# Source on the GPU node after scripts/gpu/node-setup.sh install (from the checkout's root).
FA=${FA_GPU:-/tmp/fa-gpu}
export PATH="$FA/bin:$FA/site/bin:$PATH"
export PYTHONPATH="$PWD:$FA/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# One inductor/Triton cache for every job of the node: only the first job pays compilation.
export TORCHINDUCTOR_CACHE_DIR="$FA/inductor-cache" TRITON_CACHE_DIR="$FA/triton-cache"
export VLLM_USE_FLASHINFER_SAMPLER=0   # flashinfer is not in the wheelhouse
