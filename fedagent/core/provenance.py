"""``provenance.json``: which code, packages, config and machine made a job's output.

Every job that writes an output directory (base model, client update or drop record,
aggregate, merged model) adds ``provenance.json`` to it before the manifest, so every round
directory says how it was made: the job and its own params, the seeds' coordinates, the
sha256 of the run's whole validated config (``FEDAGENT_CONFIG_SHA256``, exported by
``workflow/common.smk``; null when a command is run by hand), the run's mode (``federated``,
``centralized`` or pinned ``local``: ``FEDAGENT_RUN_MODE``, likewise; a matrix's runs by their
directory in ``FEDAGENT_RUNS``, :func:`register_run`), the git commit of the fedagent
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
RUN_MODE_ENV = "FEDAGENT_RUN_MODE"  # federated | centralized | local (workflow/common.smk)
RUNS_ENV = "FEDAGENT_RUNS"  # JSON {absolute run dir: {config_sha256, run_mode}} (register_run)
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


def register_run(run_dir: str, config_hash: str, mode: str, environ=os.environ) -> None:
    """Export a run's config hash and mode to the jobs Snakemake starts (``workflow/common.smk``).

    One run per Snakemake process (the usual case): ``FEDAGENT_CONFIG_SHA256`` / ``FEDAGENT_RUN_MODE``
    hold its values. A matrix (``workflow/matrix.smk``) loads several runs into one process, whose jobs
    all see one environment: every run is also recorded in ``FEDAGENT_RUNS`` by its absolute directory,
    and once a second run registers, the single-run variables are dropped, so a job can only take its
    own run's values (:func:`run_record`, by the directory it writes into), never another run's.
    """
    runs = json.loads(environ.get(RUNS_ENV) or "{}")
    runs[os.path.abspath(run_dir)] = {"config_sha256": config_hash, "run_mode": mode}
    environ[RUNS_ENV] = json.dumps(runs, sort_keys=True)
    if len(runs) == 1:
        environ[CONFIG_HASH_ENV], environ[RUN_MODE_ENV] = config_hash, mode
    else:
        environ.pop(CONFIG_HASH_ENV, None)
        environ.pop(RUN_MODE_ENV, None)


def run_record(directory: Path | str | None, environ=os.environ) -> dict:
    """{config_sha256, run_mode} of the run a job's output ``directory`` lies in (nulls when unknown)."""
    if directory is not None and environ.get(RUNS_ENV):
        path = os.path.abspath(directory)
        runs = json.loads(environ[RUNS_ENV])
        owners = [d for d in runs if path == d or path.startswith(d.rstrip(os.sep) + os.sep)]
        if owners:
            return dict(runs[max(owners, key=len)])
    return {"config_sha256": environ.get(CONFIG_HASH_ENV), "run_mode": environ.get(RUN_MODE_ENV)}


def provenance(
    job: str,
    *,
    params: dict | None = None,
    seeds: dict | None = None,
    backend: str = "local",
    extra: dict | None = None,
    directory: Path | str | None = None,
) -> dict:
    """The provenance record of one job (see the module docstring); ``directory``: where it is written
    (a matrix's jobs take their run's config hash and mode by it)."""
    run = run_record(directory)
    return {
        "format": "fedagent-provenance-v1",
        "job": job,
        "params": params or {},
        "seeds": seeds or {},
        "config_sha256": run["config_sha256"],
        "run_mode": run["run_mode"],
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
    record = provenance(job, directory=directory, **kwargs)
    (Path(directory) / PROVENANCE_JSON).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record
