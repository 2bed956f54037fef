"""mypy over the package sources reports no error (the stubs of the Cython modules included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SOURCE_ROOT = Path(__file__).resolve().parents[1] / "pkg"


def test_mypy_reports_no_error(tmp_path):
    pytest.importorskip("mypy", reason="mypy is not installed (pip install mypy)")
    if not (SOURCE_ROOT / "pagedkv" / "__init__.py").is_file():
        pytest.skip(f"no source tree at {SOURCE_ROOT} (tests run from an sdist/wheel only)")
    # Run from pkg/ so `pagedkv` resolves to the sources (and their .pyi stubs), not the
    # installed copy; a fresh cache keeps results independent of earlier runs.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "pagedkv", "--ignore-missing-imports",
         "--cache-dir", str(tmp_path / "mypy-cache")],
        cwd=SOURCE_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"mypy failed:\n{result.stdout}{result.stderr}"
