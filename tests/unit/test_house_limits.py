"""The house's limits, enforced: the README stays a user's page, bench/ stays a short list of lasting benchmarks,
and the import contracts in pyproject.toml (run by `lint-imports` in .ci/run) catch a new back-edge."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 220  # the target is 200; past 220 the README has grown into docs/ material
BENCH_MAX_FILES = 20  # bench/results/ excluded
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_the_readme_stays_a_first_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move details to docs/"


def test_bench_holds_at_most_twenty_files():
    bench = ROOT / "bench"
    files = sorted(str(p.relative_to(bench)) for p in bench.rglob("*")
                   if p.is_file() and not {"results", "__pycache__"} & set(p.relative_to(bench).parts))
    assert len(files) <= BENCH_MAX_FILES, f"bench/ holds {len(files)} files (at most {BENCH_MAX_FILES}): {files}"


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    # The copy's packages come first on the path, ahead of the editable install's finder.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_lint_imports_fails_on_a_new_engine_to_deployments_import(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("engine", "deployments", "bench", "tests"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")

    clean = _lint_imports(tree)
    assert clean.returncode == 0, clean.stdout + clean.stderr

    with (tree / "engine" / "errors.py").open("a", encoding="utf-8") as errors:
        errors.write("\nimport deployments.config  # a back-edge: the engine must know nothing of serving\n")
    broken = _lint_imports(tree)
    assert broken.returncode != 0
    assert "engine/ knows nothing of serving" in broken.stdout and "BROKEN" in broken.stdout
    assert "engine.errors -> deployments.config" in broken.stdout
