"""The .pyi stubs of the Cython modules agree with the compiled modules (mypy.stubtest).

The modules are found, not listed: every extension module of the installed package.
Only Cython artefacts no stub can describe are allowlisted (stubtest_allowlist*.txt).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import pagedkv


def extension_modules() -> tuple[str, ...]:
    """Every compiled module of the installed package (found by its file suffix)."""
    found = []
    for info in pkgutil.walk_packages(pagedkv.__path__, prefix="pagedkv."):
        spec = importlib.util.find_spec(info.name)
        origin = spec.origin if spec is not None else None
        if origin and origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            found.append(info.name)
    return tuple(sorted(found))


CYTHON_MODULES = extension_modules()
ALLOWLISTS = sorted(Path(__file__).parent.glob("stubtest_allowlist*.txt"))
MYPY_CONFIG = Path(__file__).with_name("stubtest_mypy.ini")


def test_every_cython_source_is_a_discovered_module():
    """Discovery misses nothing: each .pyx of the source tree is one of CYTHON_MODULES."""
    src = Path(__file__).resolve().parents[1] / "pkg" / "pagedkv"
    if not src.is_dir():
        pytest.skip("source tree not next to the tests")
    pyx = {".".join(("pagedkv",) + p.relative_to(src).with_suffix("").parts)
           for p in src.rglob("*.pyx")}
    assert pyx == set(CYTHON_MODULES)


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
         *[a for path in ALLOWLISTS for a in ("--allowlist", str(path))], *CYTHON_MODULES],
        check=False, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "unused allowlist entry" not in out.stdout + out.stderr
