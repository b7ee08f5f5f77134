"""Atomic outputs: nothing at the final path until complete; manifests that can fail."""

import pytest

from fedagent.core.atomic import ManifestError, atomic_dir, atomic_write_json, verify_manifest


def test_success_renames_with_manifest(tmp_path):
    final = tmp_path / "run" / "round_001" / "model"
    with atomic_dir(final, tmp_path / "run" / "_failed") as staging:
        (staging / "a.bin").write_bytes(b"x" * 10)
        assert not final.exists()
    assert (final / "manifest.json").is_file()
    assert verify_manifest(final)["files"]["a.bin"]["bytes"] == 10


def test_failure_quarantines_and_leaves_nothing(tmp_path):
    final = tmp_path / "run" / "round_001" / "model"
    q = tmp_path / "run" / "_failed"
    with pytest.raises(RuntimeError):
        with atomic_dir(final, q) as staging:
            (staging / "half.bin").write_bytes(b"x")
            raise RuntimeError("boom")
    assert not final.exists()
    [moved] = list(q.iterdir())
    assert moved.name == "round_001__model.attempt1" and (moved / "half.bin").exists()


def test_leftover_of_killed_attempt_is_quarantined(tmp_path):
    final = tmp_path / "run" / "round_001" / "model"
    leftover = final.parent / ".partial-model"
    leftover.mkdir(parents=True)
    (leftover / "junk").write_text("partial")
    with atomic_dir(final, tmp_path / "run" / "_failed") as staging:
        (staging / "ok").write_text("ok")
    assert sorted(verify_manifest(final)["files"]) == ["ok"]
    assert (tmp_path / "run" / "_failed" / "round_001__model.attempt1" / "junk").exists()


@pytest.mark.parametrize("damage", ["tamper", "delete", "extra", "no_manifest"])
def test_verify_fails(tmp_path, damage):
    final = tmp_path / "d"
    with atomic_dir(final) as staging:
        (staging / "w.bin").write_bytes(b"abcdef")
    if damage == "tamper":
        (final / "w.bin").write_bytes(b"abcdeX")
    elif damage == "delete":
        (final / "w.bin").unlink()
    elif damage == "extra":
        (final / "other").write_text("?")
    else:
        (final / "manifest.json").unlink()
    with pytest.raises(ManifestError):
        verify_manifest(final)


def test_atomic_json_is_canonical(tmp_path):
    atomic_write_json(tmp_path / "x.json", {"b": 1, "a": [2]})
    assert (tmp_path / "x.json").read_text() == '{\n  "a": [\n    2\n  ],\n  "b": 1\n}\n'
    assert not list(tmp_path.glob(".partial-*"))


def test_snakemake_directory_stamp_is_not_foreign(tmp_path):
    with atomic_dir(tmp_path / "d") as staging:
        (staging / "w.bin").write_bytes(b"1")
    (tmp_path / "d" / ".snakemake_timestamp").write_text("")
    verify_manifest(tmp_path / "d")


# ---- the three guarantees (issue 13), each seen failing on its mutant ----------------------


def test_manifest_is_written_last(tmp_path, monkeypatch):
    """Every file the job writes, up to its last byte, is in the manifest; and the rename
    comes after the manifest, so a crash while writing it leaves nothing at the final path."""
    import fedagent.core.atomic as atomic

    final = tmp_path / "out"
    with atomic_dir(final) as staging:
        (staging / "first.bin").write_bytes(b"1" * 100)
        (staging / "sub").mkdir()
        (staging / "sub" / "last.bin").write_bytes(b"2" * 7)  # written just before the block ends
    files = verify_manifest(final)["files"]
    assert sorted(files) == ["first.bin", "sub/last.bin"] and files["sub/last.bin"]["bytes"] == 7
    mtimes = [p.stat().st_mtime_ns for p in final.rglob("*") if p.is_file() and p.name != "manifest.json"]
    assert (final / "manifest.json").stat().st_mtime_ns >= max(mtimes)

    def crash(directory):  # the process dies while hashing / writing the manifest
        raise KeyboardInterrupt("killed while writing the manifest")

    monkeypatch.setattr(atomic, "write_manifest", crash)
    final2 = tmp_path / "out2"
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(final2, tmp_path / "_failed") as staging:
            (staging / "w.bin").write_bytes(b"x")
    assert not final2.exists()


def test_stale_output_is_quarantined_not_deleted(tmp_path):
    final = tmp_path / "run" / "round_001" / "aggregate"
    final.mkdir(parents=True)
    (final / "old.bin").write_bytes(b"evidence")
    with atomic_dir(final, tmp_path / "run" / "_failed") as staging:
        (staging / "new.bin").write_bytes(b"new")
    assert sorted(verify_manifest(final)["files"]) == ["new.bin"]
    kept = tmp_path / "run" / "_failed" / "round_001__aggregate.stale.attempt1" / "old.bin"
    assert kept.read_bytes() == b"evidence"
    # a second stale copy gets the next attempt number; the first is still there
    (final / "manifest.json").unlink()
    with atomic_dir(final, tmp_path / "run" / "_failed") as staging:
        (staging / "newer.bin").write_bytes(b"n")
    assert kept.read_bytes() == b"evidence"
    assert (tmp_path / "run" / "_failed" / "round_001__aggregate.stale.attempt2" / "new.bin").exists()


class _HalfWriter:
    """A file object that writes half of what it is given, then fails (disk full, kill)."""

    def __init__(self, fh):
        self.fh = fh

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()

    def write(self, text):
        self.fh.write(text[: len(text) // 2])
        self.fh.flush()
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.fh, name)


def test_atomic_write_text_never_leaves_a_half_written_file(tmp_path, monkeypatch):
    import builtins

    import fedagent.core.atomic as atomic

    path = tmp_path / "eval.json"
    path.write_text("old complete content\n")
    real_open = builtins.open
    monkeypatch.setattr(atomic, "open", lambda *a, **k: _HalfWriter(real_open(*a, **k)), raising=False)
    with pytest.raises(OSError):
        atomic.atomic_write_text(path, "new content " * 1000)
    assert path.read_text() == "old complete content\n"
    assert not list(tmp_path.glob(".partial-*"))  # the temporary file is cleaned up too
    fresh = tmp_path / "fresh.json"
    with pytest.raises(OSError):
        atomic.atomic_write_text(fresh, "x" * 1000)
    assert not fresh.exists()


def test_atomic_write_text_under_sigkill(tmp_path):
    """A writer SIGKILLed at seeded random moments: the final path holds a complete version."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from fedagent.core.seeds import python_rng

    path = tmp_path / "big.txt"
    versions = {f"{v}\n" * 400_000 for v in "ab"}  # 800 kB each: the write takes a while
    code = (
        "import sys; from fedagent.core.atomic import atomic_write_text as w\n"
        "i = 0\nwhile True:\n    w(sys.argv[1], ('ab'[i % 2] + '\\n') * 400_000); i += 1\n"
    )
    rng = python_rng(13, "atomic_kill_test")
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", code, str(path)])
        time.sleep(0.3 + rng.random() * 0.5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if path.exists():
            assert path.read_text() in versions


def test_a_killed_atomic_write_text_leftover_is_quarantined_on_the_next_write(tmp_path):
    """Seen in the kill suite: SIGKILL before the rename left .partial-selection.json.<pid> behind."""
    from fedagent.core.atomic import atomic_write_text

    left = tmp_path / "round_001" / ".partial-selection.json.12887"
    left.parent.mkdir()
    left.write_text('{"round": 1, "cli')  # what the killed writer had got to
    atomic_write_text(tmp_path / "round_001" / "selection.json", "{}\n")
    assert (tmp_path / "round_001" / "selection.json").read_text() == "{}\n"
    assert not list((tmp_path / "round_001").glob(".partial-*"))
    kept = tmp_path / "round_001" / "_failed" / "selection.json.attempt1"
    assert kept.read_text() == '{"round": 1, "cli'
