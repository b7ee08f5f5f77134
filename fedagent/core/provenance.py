"""``provenance.json``: which code, packages, config and machine made a job's output.

Every job that writes an output directory (base model, client update or drop record,
aggregate, merged model) adds ``provenance.json`` to it before the manifest, so every round
directory says how it was made: the job and its own params, the seeds' coordinates, the
sha256 of the run's whole validated config (``FEDAGENT_CONFIG_SHA256``, exported by
``workflow/common.smk``; null when a command is run by hand), the run's mode (``federated``,
``centralized`` or pinned ``local``: ``FEDAGENT_RUN_MODE``, likewise), the git commit of the fedagent
code and whether its tree had uncommitted changes, Python and package versions, host,
device and backend. No timestamps or process ids: the same job on the same machine and code
writes the same bytes, so re-runs stay byte-identical.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PROVENANCE_JSON = "provenance.json"
CONFIG_HASH_ENV = "FEDAGENT_CONFIG_SHA256"
RUN_MODE_ENV = "FEDAGENT_RUN_MODE"      # federated | centralized | local (workflow/common.smk)
PACKAGES = ("fedagent", "torch", "transformers", "safetensors", "numpy", "textworld", "snakemake")
_CODE_ROOT = Path(__file__).resolve().parents[2]


def config_sha256(config: dict) -> str:
    """sha256 of a config as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def git_state(root: Path = _CODE_ROOT) -> dict:
    """{commit, dirty} of the git tree holding the fedagent code (nulls if it is not one)."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--", "fedagent", "pyproject.toml", "Snakefile", "rules", "workflow")
    return {"commit": commit.strip(), "dirty": bool(status and status.strip())}


@functools.lru_cache(maxsize=1)
def package_versions() -> dict:
    """Installed versions of the packages that make the numbers."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_name() -> str:
    """``cpu`` or the CUDA device's name (torch is imported only if already loaded)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(0)}"
    return "cpu"


def provenance(job: str, *, params: dict | None = None, seeds: dict | None = None, backend: str = "local",
               extra: dict | None = None) -> dict:
    """The provenance record of one job (see the module docstring)."""
    return {
        "format": "fedagent-provenance-v1",
        "job": job,
        "params": params or {},
        "seeds": seeds or {},
        "config_sha256": os.environ.get(CONFIG_HASH_ENV),
        "run_mode": os.environ.get(RUN_MODE_ENV),
        "code": git_state(),
        "python": platform.python_version(),
        "packages": package_versions(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "device": device_name(),
        "backend": backend,
        **(extra or {}),
    }


def write_provenance(directory: Path, job: str, **kwargs) -> dict:
    """Write ``provenance.json`` into a staging directory (before its manifest); return it."""
    record = provenance(job, **kwargs)
    (Path(directory) / PROVENANCE_JSON).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record
