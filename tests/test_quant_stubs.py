"""The .pyi stubs of the quant and cold Cython modules agree with the compiled modules.

mypy.stubtest compares every stub signature, class and module attribute with the runtime
object; only Cython artefacts that no stub can describe are allowlisted
(stubtest_allowlist_review2.txt).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pagedkv
import pytest

CYTHON_MODULES = ("pagedkv.quant.fwht", "pagedkv.quant.affine", "pagedkv.quant.q8",
                  "pagedkv.quant.half", "pagedkv.quant.gemv_kernels", "pagedkv.quant.kv_q8",
                  "pagedkv.cold.codec")
ALLOWLIST = Path(__file__).with_name("stubtest_allowlist_review2.txt")


def test_every_cython_module_has_its_stub_next_to_it():
    installed = Path(pagedkv.__file__).resolve().parent
    for mod in CYTHON_MODULES:
        rel = Path(*mod.split(".")[1:]).with_suffix(".pyi")
        assert (installed / rel).is_file(), f"{rel} is missing next to the extension"


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install mypy to check the stubs)")
def test_stubtest_finds_no_disagreement(tmp_path):
    config = tmp_path / "mypy.ini"
    # The stubs import other pagedkv modules; their own type errors are not this test's.
    config.write_text(f"[mypy]\nfollow_imports = silent\ncache_dir = {tmp_path / 'cache'}\n")
    env = dict(os.environ)
    # An editable install leaves the stubs in the source tree (pkg/), outside site-packages.
    stub_root = Path(pagedkv.__file__).resolve().parents[1]
    if stub_root.name != "site-packages":
        env["MYPYPATH"] = str(stub_root)
    out = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", str(config),
         "--allowlist", str(ALLOWLIST), *CYTHON_MODULES],
        check=False, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "unused allowlist entry" not in out.stdout + out.stderr
