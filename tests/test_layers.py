"""The house in layers: the import-linter contracts of pyproject.toml hold, and they can fail.

``[tool.importlinter]`` in pyproject.toml writes fedagent's layering (docs/explanation/architecture.md,
"Layers") as contracts: layers top to bottom, envs never import train, nothing imports the warm
server but the CLI, the package never imports tests/ or bench/, no import circles. The first test
runs ``lint-imports`` on the tree as it is; the others run it on a copy of the package with one
forbidden import added, and expect that contract (by name) to break.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "fedagent"
LINT = Path(sys.executable).with_name("lint-imports")
MAX_LINES = 520  # "no module over ~500 lines without a reason written at its top"
REASON = "Why over 500 lines"


def _lint(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with the repo's contracts on the ``fedagent`` package found under ``root``."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_contracts_hold_on_the_tree():
    res = _lint(REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout
    assert res.stdout.count(" KEPT") == 5


# (file of the package, line added at its end, the contract that must break)
FORBIDDEN = [
    ("envs/base.py", "import fedagent.train.grpo", "the environments never import training"),
    ("plan/tasks.py", "import fedagent.warm.protocol", "nothing imports the warm server except the CLI"),
    ("core/atomic.py", "import fedagent.model.hf_dir", "fedagent's layers: each imports only from the layers below it"),
    ("report/status.py", "import tests.fake_env", "the package never imports the tests or the benchmarks"),
    ("train/ppo.py", "import fedagent.train.local", "no import circles between fedagent's subpackages and modules"),
    (
        "evaluate/vllm.py",
        "import fedagent.train.verl.launch",
        "fedagent's layers: each imports only from the layers below it",
    ),
]


@pytest.mark.parametrize("path,line,contract", FORBIDDEN, ids=[f[0] for f in FORBIDDEN])
def test_a_forbidden_import_breaks_its_contract(tmp_path, path, line, contract):
    copy = tmp_path / "fedagent"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / path
    target.write_text(target.read_text() + f"\n{line}  # noqa: E402,F401 - the test's forbidden import\n")
    res = _lint(tmp_path)
    assert res.returncode != 0, res.stdout
    broken = res.stdout.split("Broken contracts", 1)[-1]
    assert f"{contract}\n" in broken, res.stdout


def test_no_module_over_500_lines_without_a_reason():
    long = []
    for f in sorted(PACKAGE.rglob("*.py")):
        n = len(f.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(f.read_text())) or ""
        if n > MAX_LINES and REASON not in doc:
            long.append(f"{f.relative_to(REPO)}: {n} lines")
    assert not long, long


def test_every_subpackage_says_what_it_is_for():
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and doc.strip(), f"{init.relative_to(REPO)} has no docstring"
