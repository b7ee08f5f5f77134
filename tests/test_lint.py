"""The code's lint and format hold: ``ruff check`` and ``ruff format --check`` over the repository
(``[tool.ruff]`` in pyproject.toml), and both can fail on a copy with one fault added."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")


def _ruff(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_ruff_check_is_clean():
    res = _ruff("check", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_format_is_clean():
    res = _ruff("format", "--check", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_both_fail_on_a_fault(tmp_path):
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    pkg = tmp_path / "fedagent"
    pkg.mkdir()
    (pkg / "ok.py").write_text('"""Clean."""\n\nX = 1\n')
    assert _ruff("check", ".", cwd=tmp_path).returncode == 0
    assert _ruff("format", "--check", ".", cwd=tmp_path).returncode == 0
    (pkg / "bad.py").write_text("import os\nX = {'a':1}\n")  # an unused import; unformatted
    assert "F401" in _ruff("check", ".", cwd=tmp_path).stdout
    assert _ruff("format", "--check", ".", cwd=tmp_path).returncode == 1
