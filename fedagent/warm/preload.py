"""What the warm server imports once, whether forking it is safe, and what a forked job must match.

Preloading imports modules only: no CUDA, no torch op (no OpenMP thread pool may exist before a
fork), no tokenizer. :func:`fork_problem` checks that afterwards. :class:`Guard` then refuses any
job that the pre-imported code or the server's start-up environment would run differently from a
fresh process: a fedagent source file changed since the preload, another interpreter or fedagent
package, or an environment variable that is read when the interpreter starts or a module is
imported (``PYTHON*``, ``OMP_*``, ``MKL_*``, ...: a forked job would silently run with the server's).
Per-job thread counts are the exception: :mod:`fedagent.warm.threads` applies them in the job.
:meth:`Guard.standby_mismatch` is the stricter test for a standby (:mod:`fedagent.warm.standby`),
whose CUDA already started under the server's environment: the CUDA variables must match too.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time

import fedagent
from fedagent.core import envs
from fedagent.warm import threads

_TORCH = (
    "torch",
    "transformers",
    "transformers:AutoModelForCausalLM",
    "transformers:AutoTokenizer",
    "transformers.models.llama.modeling_llama",
    "torch._dynamo",
    "safetensors.torch",
    "jsonschema",
)
_JOB = (
    "fedagent.model.static_sampler",
    "fedagent.model.policy",
    "fedagent.rollout.episode",
    "fedagent.envs.lifecycle",
    "fedagent.plan.tasks",
    "fedagent.core.config",
    "fedagent.core.provenance",
)
# fedagent.train.cli / fedagent.evaluate.validation first: they import fedagent.core.openmp, which sets
# OMP_WAIT_POLICY before torch loads libgomp.
# The lists are what a job imports (measured: modules new in sys.modules after a job ran in-process).
PRELOADS: dict[str, tuple[str, ...]] = {
    # peft: what a LoRA client (train.lora) adds, ≈ 2 s of imports on the 2-core machine
    # base_model_tiny: `fedagent tiny-model` (the tiny round-0 model of test runs), torch + transformers only
    "train": (
        "fedagent.train.cli",
        *_TORCH,
        "fedagent.train.local",
        "fedagent.train.grpo",
        *_JOB,
        "peft.tuners.lora",
        "fedagent.model.base_model_tiny",
    ),
    "eval": ("fedagent.evaluate.validation", *_TORCH, *_JOB),
    # `fedagent serve-env` (fedagent.envs.serve.run): app, uvicorn's loop and protocols, and the default
    # env kind's modules (its spec's preload).
    "env": (
        "fedagent.envs.serve",
        "fedagent.envs.service",
        "fedagent.envs.client",
        *envs.spec(envs.UNNAMED_CATALOGUE_KIND).preload,
        "fastapi",
        "pydantic.v1",
        "uvicorn",
        "uvicorn.config",
        "uvicorn.server",
        "uvicorn.lifespan.on",
        "uvicorn.loops.asyncio",
        "uvicorn.protocols.http.auto",
        "uvicorn.protocols.websockets.auto",
    ),
    # the server's side of a round: `fedagent aggregate` and `fedagent merge` (torch + safetensors), and the
    # round's `fedagent report` (pandas; matplotlib's figure and Agg canvas, not pyplot: the job picks the
    # backend before it imports pyplot).
    "server": (
        "fedagent.server.aggregate",
        "torch",
        "safetensors.torch",
        "fedagent.server.merge",
        "fedagent.server.optimizers",
        "fedagent.model.hf_dir",
        "fedagent.core.atomic",
        "fedagent.core.provenance",
        "fedagent.report.summary",
        "matplotlib.figure",
        "matplotlib.backends.backend_agg",
    ),
}

# Environment read when the interpreter starts or a library is imported (the loader, libgomp,
# MKL/OpenBLAS, torch/transformers/huggingface_hub configs, matplotlib's MPLCONFIGDIR/MPLBACKEND: its rc
# file, read once at import, styles the report's curves.png): a forked job cannot change these.
_STARTUP_PREFIXES = (
    "PYTHON",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH_",
    "TRANSFORMERS_",
    "HF_",
    "TOKENIZERS_",
    "MPL",
)
_STARTUP_KEYS = ("LD_PRELOAD", "LD_LIBRARY_PATH")
# Read when CUDA starts or a cuBLAS/cuDNN handle or the caching allocator is made (CUDA_VISIBLE_DEVICES,
# CUDA_DEVICE_ORDER, CUDA_MODULE_LOADING, CUBLAS_WORKSPACE_CONFIG, NVIDIA_VISIBLE_DEVICES, NCCL_*, and
# the start-up set above: PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF, ...): a standby did all of that
# under the server's values (fedagent.warm.standby).
_CUDA_PREFIXES = ("CUDA_", "NVIDIA_", "CUBLAS", "CUDNN_", "NCCL_")


def parse_groups(text: str) -> list[str]:
    """``train,eval,env`` → the groups, each known (ValueError naming an unknown one)."""
    groups = [g.strip() for g in text.split(",") if g.strip()]
    for g in groups:
        if g not in PRELOADS:
            raise ValueError(f"--preload: unknown group {g!r} (known: {', '.join(PRELOADS)})")
    return groups


def preload(groups: list[str]) -> dict[str, str]:
    """Import every module of ``groups``; the environment variables the imports set or changed."""
    before = dict(os.environ)
    for group in groups:
        for entry in PRELOADS[group]:
            module, _, attr = entry.partition(":")
            mod = importlib.import_module(module)
            if attr:
                getattr(mod, attr)  # transformers' lazy attributes import their module
    return {k: v for k, v in os.environ.items() if before.get(k) != v}


def fork_problem() -> str | None:
    """Why forking this process now would be unsafe, or None."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised while preloading (a forked child cannot use it)"
    if threading.active_count() != 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        return f"{threading.active_count() - 1} Python thread(s) run after the preload ({names}): a fork copies their locks mid-use"
    return None


def read_at_startup(key: str) -> bool:
    """Whether ``key`` is read when the interpreter starts or a module is imported."""
    return key.startswith(_STARTUP_PREFIXES) or key in _STARTUP_KEYS


def read_at_cuda_start(key: str) -> bool:
    """Whether ``key`` is read when CUDA (or one of its libraries, or torch's use of them) starts."""
    return key.startswith(_CUDA_PREFIXES) or read_at_startup(key)


def module_files(package_dir: str) -> dict[str, tuple[int, int]]:
    """(mtime_ns, size) of every imported module's file under ``package_dir``."""
    root = os.path.join(os.path.realpath(package_dir), "")
    table = {}
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__file__", None)
        if path and os.path.realpath(path).startswith(root):
            st = os.stat(path)
            table[path] = (st.st_mtime_ns, st.st_size)
    return table


class Guard:
    """The checks a request must pass before it is forked (one message naming the first failure)."""

    def __init__(self, socket_path: str, import_env: dict[str, str], extra_files: list[str] = ()):
        self.socket_path = socket_path
        self.import_env = dict(import_env)
        self.package = os.path.dirname(os.path.abspath(fedagent.__file__))
        self.files = module_files(self.package)
        for path in extra_files:  # the test suite's hook: the same check on its own files
            st = os.stat(path)
            self.files[path] = (st.st_mtime_ns, st.st_size)
        self.started = time.time()

    def job_env(self, env: dict[str, str]) -> dict[str, str]:
        """The environment a fresh job would have after its imports: the request's, plus what the
        preload's imports set that the request does not name (``OMP_WAIT_POLICY``, ...)."""
        out = dict(env)
        for key, value in self.import_env.items():
            out.setdefault(key, value)
        return out

    def changed_file(self) -> str | None:
        """The first preloaded fedagent file that changed (or vanished) since the preload."""
        for path, (mtime_ns, size) in sorted(self.files.items()):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return path
            if (st.st_mtime_ns, st.st_size) != (mtime_ns, size):
                return path
        return None

    def refusal(self, request: dict) -> str | None:
        """Why ``request`` must not be forked from this server, or None."""
        restart = (
            f"restart the warm server (fedagent warm-server --socket {self.socket_path} --stop, then start it again)"
        )
        changed = self.changed_file()
        if changed is not None:
            return f"{changed} changed since the warm server imported it: {restart}"
        if request.get("executable") != sys.executable:
            return (
                f"this job's interpreter is {request.get('executable')} but the warm server runs "
                f"{sys.executable}: start the warm server with the job's interpreter"
            )
        if request.get("package") != self.package:
            return (
                f"this job imports fedagent from {request.get('package')} but the warm server "
                f"preloaded {self.package}: start the warm server with the job's PYTHONPATH"
            )
        env = self.job_env(request.get("env") or {})
        for key in sorted(set(env) | set(os.environ)):
            if key in threads.KEYS:
                continue  # applied in the job (fedagent.warm.threads)
            if read_at_startup(key) and env.get(key) != os.environ.get(key):
                return (
                    f"environment variable {key} is {env.get(key)!r} for this job but "
                    f"{os.environ.get(key)!r} in the warm server; it is read when the interpreter "
                    "starts or a module is imported, so a forked job would run with the server's: "
                    "start the warm server from the job's environment"
                )
        return threads.refusal(env, dict(os.environ))

    def standby_mismatch(self, request_env: dict[str, str], card: str | None = None) -> str | None:
        """Why a job with this environment must not run in a standby (whose CUDA started under the
        server's environment; a standby of one card, ``card``, with ``CUDA_VISIBLE_DEVICES`` set to it),
        or None. Thread counts are applied in the job, as in a fresh fork."""
        env = self.job_env(request_env)
        standby_env = dict(os.environ)
        if card is not None:
            standby_env["CUDA_VISIBLE_DEVICES"] = card
        for key in sorted(set(env) | set(standby_env)):
            if key not in threads.KEYS and read_at_cuda_start(key) and env.get(key) != standby_env.get(key):
                whose = "the warm server" if card is None else f"the standbys of GPU {card}"
                return (
                    f"environment variable {key} is {env.get(key)!r} for this job but "
                    f"{standby_env.get(key)!r} in {whose}, whose standbys started CUDA with it"
                )
        return None
