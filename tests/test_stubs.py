"""The .pyi stubs of the Cython modules agree with the compiled modules (mypy.stubtest).

Only Cython artefacts no stub can describe are allowlisted (stubtest_allowlist.txt).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pagedkv

CYTHON_MODULES = ("pagedkv.hashing", "pagedkv.allocator", "pagedkv.hfqm.index",
                  "pagedkv.adapter.table_ops")
ALLOWLIST = Path(__file__).with_name("stubtest_allowlist.txt")
MYPY_CONFIG = Path(__file__).with_name("stubtest_mypy.ini")


def test_stubs_and_pep561_marker_are_installed():
    installed = Path(pagedkv.__file__).resolve().parent
    assert (installed / "py.typed").is_file()
    for mod in CYTHON_MODULES:
        rel = Path(*mod.split(".")[1:]).with_suffix(".pyi")
        assert (installed / rel).is_file(), f"{rel} not installed next to the extension"


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install mypy to check the stubs)")
def test_stubtest_finds_no_disagreement(tmp_path):
    env = dict(os.environ, MYPY_CACHE_DIR=str(tmp_path / "cache"))
    # An editable install leaves the stubs in the source tree (pkg/), outside site-packages.
    stub_root = Path(pagedkv.__file__).resolve().parents[1]
    if stub_root.name != "site-packages":
        env["MYPYPATH"] = str(stub_root)
    out = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", str(MYPY_CONFIG),
         "--allowlist", str(ALLOWLIST), *CYTHON_MODULES],
        check=False, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "unused allowlist entry" not in out.stdout + out.stderr
