"""fedagent.model.smollm2_gguf.gguf_read_once: one read of a GGUF file however often transformers loads it,
a fresh read for a changed file, nothing shared outside it (its effect on the real GGUF: the read counts in
tests/test_warm_gpu_warmup.py and tests/test_scale.py)."""

from __future__ import annotations

import os
import threading

import gguf

from fedagent.model.smollm2_gguf import gguf_read_once


class CountingReader:
    """Stands in for gguf.GGUFReader: records every construction."""

    made: list[tuple[str, str]] = []

    def __init__(self, path, mode="r"):
        CountingReader.made.append((str(path), mode))


def test_a_file_is_read_once_inside_and_afresh_when_it_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    CountingReader.made = []
    f = tmp_path / "m.gguf"
    f.write_bytes(b"one")
    with gguf_read_once():
        first = gguf.GGUFReader(f)
        assert gguf.GGUFReader(str(f)) is first  # the same file by another spelling
        with gguf_read_once():  # nested: the same memo
            assert gguf.GGUFReader(f) is first
        assert gguf.GGUFReader(f) is first  # the inner exit left it in place
        assert gguf.GGUFReader(f, "r+") is not first  # a writable reader is never shared
        f.write_bytes(b"other")  # size (and mtime) changed: read afresh
        os.utime(f, ns=(1, 1))
        second = gguf.GGUFReader(f)
        assert second is not first and gguf.GGUFReader(f) is second
    assert CountingReader.made == [(str(f), "r"), (str(f), "r+"), (str(f), "r")]
    assert gguf.GGUFReader is CountingReader  # restored on exit, its readers dropped
    assert gguf.GGUFReader(f) is not second


def test_concurrent_users_share_it_and_the_last_to_leave_restores(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    CountingReader.made = []
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    inside, leave = threading.Event(), threading.Event()

    def other():
        with gguf_read_once():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(10)
    with gguf_read_once():
        a = gguf.GGUFReader(f)
    assert gguf.GGUFReader is not CountingReader  # the other thread is still inside
    assert gguf.GGUFReader(f) is a
    leave.set()
    t.join(10)
    assert gguf.GGUFReader is CountingReader
    assert len(CountingReader.made) == 1
