"""fedagent.core.workflow_copy: the one workflow copy behind tests' make_workdir and the benchmarks'."""

import ast
import sys
from pathlib import Path

from fedagent.core.workflow_copy import WORKFLOW_PARTS, copy_workflow
from workflow_helpers import REPO, TEST_CONFIG, make_workdir


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_copy_is_the_workflow_parts_plus_config_and_presets_without_caches(tmp_path):
    repo = tmp_path / "repo"
    (repo / "rules" / "__pycache__").mkdir(parents=True)
    (repo / "rules" / "a.smk").write_text("rule a: pass\n")
    (repo / "rules" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    for d in ("workflow", "profiles/local", "envs"):
        (repo / d).mkdir(parents=True)
        (repo / d / "f.txt").write_text(d)
    (repo / "Snakefile").write_text("include: 'rules/a.smk'\n")
    (repo / "fedagent").mkdir()
    (repo / "fedagent" / "x.py").write_text("")  # not a workflow part: the package is installed
    cfg, preset = tmp_path / "c.yaml", tmp_path / "p-small.yaml"
    cfg.write_text("rounds: 1\n")
    preset.write_text("rounds: 2\n")
    out = copy_workflow(repo, tmp_path / "w" / "deep", cfg, presets=[preset])
    assert _files(out) == {
        "Snakefile": b"include: 'rules/a.smk'\n",
        "rules/a.smk": b"rule a: pass\n",
        "workflow/f.txt": b"workflow",
        "profiles/local/f.txt": b"profiles/local",
        "envs/f.txt": b"envs",
        "config/config.yaml": b"rounds: 1\n",
        "config/experiments/p-small.yaml": b"rounds: 2\n",
    }


def test_tests_and_bench_copy_the_same_workflow(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import small_presets
    finally:
        sys.path.remove(str(REPO / "bench"))
    preset = REPO / "config" / "experiments" / "textworld-uniform-small.yaml"
    a, b = _files(make_workdir(tmp_path / "t")), _files(small_presets.workdir_for(preset, tmp_path / "b"))
    assert a.pop("config/config.yaml") == TEST_CONFIG.read_bytes()
    assert b.pop("config/config.yaml") == (REPO / "config" / "config.yaml").read_bytes()
    assert b.pop(f"config/experiments/{preset.name}") == preset.read_bytes()
    assert a == b and {k.split("/")[0] for k in a} == set(WORKFLOW_PARTS)


def test_the_package_imports_neither_tests_nor_bench():
    """Imports point down: tests and bench import fedagent, never the reverse."""
    bad = []
    for path in sorted((REPO / "fedagent").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            bad += [
                f"{path.relative_to(REPO)}: {n}"
                for n in names
                if n.split(".")[0] in ("tests", "bench", "workflow_helpers", "small_presets")
            ]
    assert bad == []
