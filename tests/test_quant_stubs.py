"""The .pyi stubs of the quant, cold and kernels Cython modules agree with the compiled modules.

The checks are test_stubs.py's (mypy.stubtest over the modules, the stub installed next to
each extension), run over this area's modules with this area's allowlist: only Cython
artefacts that no stub can describe (stubtest_allowlist_review2.txt).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import test_stubs

CYTHON_MODULES = ("pagedkv.quant.fwht", "pagedkv.quant.affine", "pagedkv.quant.q8",
                  "pagedkv.quant.half", "pagedkv.quant.gemv_kernels", "pagedkv.quant.kv_q8",
                  "pagedkv.quant.kv_rotated",
                  "pagedkv.cold.codec", "pagedkv.kernels.gemv_pack", "pagedkv.kernels.dlpack")
ALLOWLIST = Path(__file__).with_name("stubtest_allowlist_review2.txt")


@pytest.fixture
def quant_cold_modules(monkeypatch):
    monkeypatch.setattr(test_stubs, "CYTHON_MODULES", CYTHON_MODULES)
    monkeypatch.setattr(test_stubs, "ALLOWLIST", ALLOWLIST)


def test_every_stub_is_installed_next_to_its_extension(quant_cold_modules):
    test_stubs.test_stubs_and_pep561_marker_are_installed()


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install mypy to check the stubs)")
def test_stubtest_finds_no_disagreement(quant_cold_modules, tmp_path):
    test_stubs.test_stubtest_finds_no_disagreement(tmp_path)
