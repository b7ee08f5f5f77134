"""``provenance.json``: which code, packages, config and machine made a job's output.

Every job that writes an output directory (base model, client update or drop record,
aggregate, merged model) adds ``provenance.json`` to it before the manifest, so every round
directory says how it was made: the job and its own params, the seeds' coordinates, the
sha256 of the run's whole validated config (``FEDAGENT_CONFIG_SHA256``, exported by
``workflow/common.smk``; null when a command is run by hand), the run's mode (``federated``,
``centralized`` or pinned ``local``: ``FEDAGENT_RUN_MODE``, likewise; a matrix's runs by their
directory in ``FEDAGENT_RUNS``, :func:`register_run`), the git commit of the fedagent
code, whether its tree had uncommitted changes and a sha256 of the code as it was, Python and
package versions, host, device and backend. No timestamps or process ids: the same job on the
same machine and code writes the same bytes, so re-runs stay byte-identical.
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


CODE_PATHS = ("fedagent", "pyproject.toml", "Snakefile", "rules", "workflow")  # the code a job's output depends on


@functools.lru_cache(maxsize=1)
def git_state(root: Path = _CODE_ROOT) -> dict:
    """{commit, dirty, tree_sha256} of the code under ``root`` (:data:`CODE_PATHS`): the git commit and
    whether the tree differs from it (nulls outside a git tree), and a sha256 of the code files'
    contents as they are (:func:`tree_sha256`), which names the code that ran even when the commit
    cannot (a dirty tree, a copy whose git metadata is stale or absent)."""

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout if proc.returncode == 0 else None

    tree = tree_sha256(root, git("ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *CODE_PATHS))
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "tree_sha256": tree}
    status = git("status", "--porcelain", "--", *CODE_PATHS)
    return {"commit": commit.strip(), "dirty": bool(status and status.strip()), "tree_sha256": tree}


def tree_sha256(root: Path, listing: str | None = None) -> str | None:
    """sha256 over the code files under ``root``, each as its relative path, NUL, its bytes, NUL, in
    sorted path order; ``listing``: git's NUL-separated list of them (tracked and untracked, not
    ignored), else every file under :data:`CODE_PATHS` but caches. None when there is no such file."""
    root = Path(root)
    if listing is not None:
        names = [n for n in listing.split("\0") if n]
    else:
        names = []
        for top in CODE_PATHS:
            base = root / top
            paths = [base] if base.is_file() else sorted(base.rglob("*")) if base.is_dir() else []
            names += [
                p.relative_to(root).as_posix()
                for p in paths
                if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p) and p.suffix != ".pyc"
            ]
    h, seen = hashlib.sha256(), 0
    for name in sorted(set(names)):
        path = root / name
        if not path.is_file():  # tracked but deleted in the working tree
            continue
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
        seen += 1
    return h.hexdigest() if seen else None


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
