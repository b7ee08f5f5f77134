"""Atomic job outputs: write privately, add a manifest last, rename into place.

A job never writes at its final path. :func:`atomic_dir` yields a private staging
directory beside the final one; on success it writes ``manifest.json`` (sha256 and size
of every file) *last* and renames the staging directory into place in one ``rename``.
A consumer calls :func:`verify_manifest` before reading, so a half-written directory can
never be consumed. Leftovers of a killed attempt are moved to a quarantine folder
(``results/<run>/_failed/...``) with an attempt number, never deleted and never read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

MANIFEST = "manifest.json"
STAGING_PREFIX = ".partial-"
# Files other tools add to a finished output directory: Snakemake stamps directory() outputs.
IGNORED_FILES = frozenset({".snakemake_timestamp"})
_CHUNK = 8 << 20


class ManifestError(RuntimeError):
    """A directory's manifest is missing, malformed or disagrees with the files on disk."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of one file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_pool(n: int):
    """Threads for ``n`` files' sha256 (hashlib releases the GIL on large buffers)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max(1, min(n, os.cpu_count() or 1)), thread_name_prefix="sha256")


def write_manifest(directory: Path) -> dict:
    """Hash every file under ``directory`` (sorted, relative paths; files in parallel threads) and
    write the manifest."""
    directory = Path(directory)
    paths = [p for p in sorted(directory.rglob("*")) if p.is_file() and p.relative_to(directory).as_posix() != MANIFEST]
    with _hash_pool(len(paths)) as pool:
        digests = list(pool.map(sha256_file, paths))
    files = {
        path.relative_to(directory).as_posix(): {"sha256": digest, "bytes": path.stat().st_size}
        for path, digest in zip(paths, digests)
    }
    manifest = {"format": "fedagent-manifest-v1", "files": files}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, directory / MANIFEST)
    return manifest


def _listing(directory: Path) -> dict:
    """The manifest of ``directory`` once its file list and sizes agree with the disk (no hashing)."""
    directory = Path(directory)
    mpath = directory / MANIFEST
    if not mpath.is_file():
        raise ManifestError(f"{directory}: no {MANIFEST} (incomplete or foreign output)")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"{mpath}: unreadable manifest ({exc})") from exc
    on_disk = {
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST and p.name not in IGNORED_FILES
    }
    missing = sorted(set(files) - on_disk)
    if missing:
        raise ManifestError(f"{directory}: file(s) listed in manifest are missing: {missing}")
    extra = sorted(on_disk - set(files))
    if extra:
        raise ManifestError(f"{directory}: file(s) not in manifest: {extra}")
    for rel, entry in files.items():
        path = directory / rel
        if path.stat().st_size != entry["bytes"]:
            raise ManifestError(f"{path}: size {path.stat().st_size} != manifest {entry['bytes']}")
    return manifest


def _check_hash(path: Path, expected: str) -> None:
    if sha256_file(path) != expected:
        raise ManifestError(f"{path}: sha256 differs from manifest")


def verify_manifest(directory: Path, *, check_hashes: bool = True, hash_only=None) -> dict:
    """Check that ``directory`` holds exactly what its manifest lists; return the manifest.

    Every listed file must exist with its size; ``check_hashes`` also compares each one's
    sha256, or, with ``hash_only`` (a predicate on the relative path), only those it accepts:
    a reader of a few files of a large directory hashes what it reads.
    Raises :class:`ManifestError` naming the directory and the first offending file.
    """
    directory = Path(directory)
    manifest = _listing(directory)
    for rel, entry in manifest["files"].items():
        if check_hashes and (hash_only is None or hash_only(rel)):
            _check_hash(directory / rel, entry["sha256"])
    return manifest


class Verifying:
    """The sha256 checks of :func:`verifying`, running; :meth:`wait` raises the first failure."""

    def __init__(self, checks):
        self._checks = checks

    def wait(self) -> None:
        for check in self._checks:
            check.result()


@contextlib.contextmanager
def verifying(dirs, *, enabled: bool = True) -> Iterator[Verifying]:
    """Verify the manifests of ``dirs`` while the body reads them: the listings and sizes first
    (here, before the body), then every file's sha256 in parallel threads beside the body.

    A body that writes an output calls ``.wait()`` before committing it (inside its
    :func:`atomic_dir`), so nothing derived from an unverified input reaches a final path. On
    leaving, the checks are waited for in any case, and a failed check raises its
    :class:`ManifestError` even over the body's own error (the corrupt input is the cause).
    Each directory is checked once however often it is listed.
    """
    unique: dict[Path, Path] = {}
    for d in dirs if enabled else []:
        unique.setdefault(Path(d).resolve(), Path(d))
    dirs = list(unique.values())
    work = [(d / rel, entry["sha256"]) for d in dirs for rel, entry in _listing(d)["files"].items()]
    if not work:
        yield Verifying([])
        return
    with _hash_pool(len(work)) as pool:
        handle = Verifying([pool.submit(_check_hash, path, digest) for path, digest in work])
        try:
            yield handle
        finally:
            handle.wait()


def quarantine(path: Path, quarantine_root: Path, label: str | None = None) -> Path:
    """Move ``path`` to ``quarantine_root/<label>.attempt<N>`` (N = first free number)."""
    quarantine_root = Path(quarantine_root)
    quarantine_root.mkdir(parents=True, exist_ok=True)
    label = label or Path(path).name
    n = 1
    while (quarantine_root / f"{label}.attempt{n}").exists():
        n += 1
    dest = quarantine_root / f"{label}.attempt{n}"
    shutil.move(str(path), str(dest))
    return dest


def _label_for(final: Path, quarantine_root: Path) -> str:
    # Keep the output's place in the run (round_002/clients/1) readable in the quarantine name.
    try:
        rel = final.resolve().relative_to(quarantine_root.resolve().parent)
        return rel.as_posix().replace("/", "__")
    except ValueError:
        return final.name


@contextlib.contextmanager
def atomic_dir(final: Path, quarantine_root: Path | None = None) -> Iterator[Path]:
    """Yield a private staging directory that becomes ``final`` only on success.

    On normal exit the manifest is written last and the staging directory is renamed to
    ``final``. On an exception the staging directory is quarantined (if a root is given)
    and the exception propagates. Leftovers of an earlier killed attempt are quarantined
    before the new attempt starts.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    qroot = Path(quarantine_root) if quarantine_root is not None else final.parent / "_failed"
    staging = final.parent / f"{STAGING_PREFIX}{final.name}"
    label = _label_for(final, qroot)
    if staging.exists():
        quarantine(staging, qroot, label)
    if final.exists():
        # Snakemake removes outputs before a job; anything still here is a stale attempt.
        quarantine(final, qroot, label + ".stale")
    staging.mkdir()
    try:
        yield staging
        write_manifest(staging)
        _fsync_dir(staging)
        os.rename(staging, final)
        _fsync_dir(final.parent)
    except BaseException:
        if staging.exists():
            quarantine(staging, qroot, label)
        raise


def atomic_write_text(path: Path, text: str, quarantine_root: Path | None = None) -> None:
    """Write a small file so that it appears complete or not at all.

    The text goes to ``.partial-<name>.<pid>`` first and is renamed into place. A temporary
    file left by an earlier, killed writer of the same path is quarantined first (to
    ``quarantine_root``, default ``<parent>/_failed``), never deleted and never read.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in sorted(path.parent.glob(f"{STAGING_PREFIX}{path.name}.*")):
        if leftover.is_file() and leftover.name.rsplit(".", 1)[-1].isdigit():
            quarantine(leftover, quarantine_root or path.parent / "_failed", path.name)
    tmp = path.parent / f"{STAGING_PREFIX}{path.name}.{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # the final path only ever sees a complete file
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write_json(path: Path, obj) -> None:
    """Write ``obj`` as canonical (sorted, indented) JSON, atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
