"""Per-job thread counts: applied in a forked job through the libraries, not refused.

Snakemake sets ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``,
``GOTO_NUM_THREADS``, ``VECLIB_MAXIMUM_THREADS`` and ``NUMEXPR_NUM_THREADS`` to each rule's
``threads`` in every job's environment. libgomp, MKL and OpenBLAS read them once, when they are
loaded — in the warm server — so one server cannot match every rule by its own environment.
A forked job therefore sets what its environment asks through the libraries' own calls:
``torch.set_num_threads`` (torch's intra-op pool, libgomp's and MKL's counts) and OpenBLAS's
``openblas_set_num_threads`` (numpy's BLAS pool). Refused instead (:func:`refusal`): a count that
is not a positive integer, OMP and MKL counts that differ (torch sets both to one), and a count
the server has but the job does not (the library default a fresh process would pick is not
recoverable). ``VECLIB_MAXIMUM_THREADS`` is macOS-only and ignored.
"""

from __future__ import annotations

import ctypes
import re
import sys

TORCH_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
BLAS_KEYS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")
NUMEXPR_KEY = "NUMEXPR_NUM_THREADS"
KEYS = (*TORCH_KEYS, *BLAS_KEYS, NUMEXPR_KEY, "VECLIB_MAXIMUM_THREADS")


def refusal(job_env: dict[str, str], server_env: dict[str, str]) -> str | None:
    """Why the job's thread counts cannot be applied in a fork of this server, or None."""
    for key in KEYS:
        job, server = job_env.get(key), server_env.get(key)
        if job == server or key == "VECLIB_MAXIMUM_THREADS":
            continue
        if job is None:
            return (
                f"environment variable {key} is {server!r} in the warm server but unset for this job "
                "(a fresh job would use the library's default): start the warm server without it"
            )
        if not job.isdigit() or int(job) < 1:
            return f"environment variable {key}={job!r} for this job is not a positive thread count"
    for pair in (TORCH_KEYS, BLAS_KEYS):
        values = {job_env[k] for k in pair if k in job_env}
        if len(values) > 1:
            return f"environment variables {' and '.join(pair)} differ for this job ({sorted(values)}): give one count"
    return None


def apply(job_env: dict[str, str], server_env: dict[str, str]) -> None:
    """In the forked job: set every count the job's environment gives and the server's lacks."""

    def wanted(keys):
        for key in keys:
            if key in job_env and job_env[key] != server_env.get(key):
                return int(job_env[key])
        return None

    n = wanted(TORCH_KEYS)
    if n is not None and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    n = wanted(BLAS_KEYS)
    if n is not None:
        for fn in _openblas("set_num_threads"):
            fn(n)
    n = wanted((NUMEXPR_KEY,))
    if n is not None and "numexpr" in sys.modules:
        sys.modules["numexpr"].set_num_threads(n)


def _openblas(name: str) -> list:
    """``openblas_<name>`` of every OpenBLAS loaded in this process (numpy's is ``scipy_openblas64_``)."""
    with open("/proc/self/maps") as fh:
        paths = sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", fh.read())))
    found = []
    for path in paths:
        lib = ctypes.CDLL(path)  # already loaded: the same library, not a second copy
        for symbol in (f"{p}openblas_{name}{s}" for p in ("", "scipy_") for s in ("", "64_")):
            fn = getattr(lib, symbol, None)
            if fn is not None:
                found.append(fn)
                break
    return found


def openblas_threads() -> list[int]:
    """The thread count of every loaded OpenBLAS (what the tests check :func:`apply` against)."""
    return [fn() for fn in _openblas("get_num_threads")]
