"""The linters run with the tests, so CI (.ci/run runs the test suite) keeps the tree clean:
``ruff check`` over pkg/, tests/ and asv_bench/ (rules in pyproject.toml) and ``cython-lint``
over every ``.pyx``/``.pxd`` (max line length in pyproject.toml). Both come with the ``test``
extra; a run without them skips, naming the missing tool."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (ROOT / "pyproject.toml").is_file(),
                                reason="source tree not next to the tests")


def _tool(name: str) -> str:
    exe = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} is not installed (pip install {name}, or the test extra)")
    return exe


def test_ruff_is_clean():
    out = subprocess.run([_tool("ruff"), "check", "--no-cache", "--output-format", "concise",
                          "pkg", "tests", "asv_bench"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_cython_lint_is_clean():
    files = sorted(str(p.relative_to(ROOT)) for ext in ("*.pyx", "*.pxd")
                   for p in (ROOT / "pkg").rglob(ext))
    assert files
    out = subprocess.run([_tool("cython-lint"), *files], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
