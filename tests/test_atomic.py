"""Atomic outputs: nothing at the final path until complete; manifests that can fail."""

import pytest

from fedagent.atomic import ManifestError, atomic_dir, atomic_write_json, verify_manifest


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
