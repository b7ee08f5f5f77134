"""provenance.json: what it records, the config hash from the environment, the git state."""

from __future__ import annotations

import json
import subprocess

from fedagent.core import provenance as prov


def test_record_has_every_field(tmp_path, monkeypatch):
    monkeypatch.setenv(prov.CONFIG_HASH_ENV, "ab" * 32)
    monkeypatch.setenv(prov.RUN_MODE_ENV, "centralized")
    rec = prov.write_provenance(tmp_path, job="aggregate", params={"weighting": "uniform"}, seeds={"base_seed": 7})
    assert json.loads((tmp_path / "provenance.json").read_text()) == rec
    assert rec["config_sha256"] == "ab" * 32 and rec["params"] == {"weighting": "uniform"}
    assert rec["run_mode"] == "centralized"
    assert rec["seeds"] == {"base_seed": 7} and rec["device"] == "cpu" and rec["backend"] == "local"
    assert rec["python"].count(".") == 2 and rec["packages"]["torch"] and rec["host"]
    assert set(rec["code"]) == {"commit", "dirty", "tree_sha256"} and len(rec["code"]["tree_sha256"]) == 64


def test_config_hash_is_canonical():
    assert prov.config_sha256({"a": 1, "b": {"c": 2}}) == prov.config_sha256({"b": {"c": 2}, "a": 1})
    assert prov.config_sha256({"a": 1}) != prov.config_sha256({"a": 2})


def test_git_commit_and_dirty_flag(tmp_path):
    repo, copy = tmp_path / "repo", tmp_path / "copy"  # the copy lies outside the repository
    repo.mkdir()

    def git(*a):
        subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)

    git("init", "-q")
    (repo / "fedagent").mkdir()
    (repo / "fedagent" / "x.py").write_text("x = 1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    prov.git_state.cache_clear()
    clean = prov.git_state(repo)
    assert {k: clean[k] for k in ("commit", "dirty")} == {"commit": head, "dirty": False}
    (repo / "fedagent" / "x.py").write_text("x = 2\n")
    prov.git_state.cache_clear()
    dirty = prov.git_state(repo)
    assert {k: dirty[k] for k in ("commit", "dirty")} == {"commit": head, "dirty": True}
    # The tree hash names the code as it was: it moves with the edit although the commit does not, and
    # a copy without git metadata (walked, caches left out) gives the same hash as git's listing.
    assert dirty["tree_sha256"] != clean["tree_sha256"]
    (copy / "fedagent" / "__pycache__").mkdir(parents=True)
    (copy / "fedagent" / "x.py").write_text("x = 2\n")
    (copy / "fedagent" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"cache")
    prov.git_state.cache_clear()
    assert prov.git_state(copy) == {"commit": None, "dirty": None, "tree_sha256": dirty["tree_sha256"]}
    prov.git_state.cache_clear()
    assert prov.git_state(repo / "nowhere") == {"commit": None, "dirty": None, "tree_sha256": None}
    prov.git_state.cache_clear()
