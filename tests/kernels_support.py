"""Shared fixtures for the kernel tests: the GPU device (skipped without one), and a ctypes
stub of libamdhip64 (tests/data/hip_stub.c) that records launches and runs nothing."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pagedkv.errors import NoDeviceError
from pagedkv.kernels import load_runtime


def gpu_required() -> bool:
    """``PAGEDKV_REQUIRE_GPU=1`` (docs/development.md, "GPU tests"): on a GPU machine a
    missing device is a failure, not a skip, so a broken driver or a wheel built without
    kernels cannot pass as "all skipped"."""
    return os.environ.get("PAGEDKV_REQUIRE_GPU", "") not in ("", "0")


@pytest.fixture(scope="session")
def device():
    from pagedkv.kernels import open_device
    try:
        return open_device()
    except NoDeviceError as exc:
        if gpu_required():
            pytest.fail(f"PAGEDKV_REQUIRE_GPU is set but no GPU was found: {exc}")
        pytest.skip(f"no GPU: {exc}")


def poisoned(device, shape, dtype, byte=0xFF):
    """An output array whose every byte is ``byte`` (0xFF is NaN in f16/f32), so an
    element the kernel did not write shows up."""
    out = device.empty(shape, dtype)
    out.fill_bytes(byte)
    return out


@pytest.fixture(scope="session")
def hip_stub(tmp_path_factory):
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the HIP stub")
    out = tmp_path_factory.mktemp("stub") / "libhipstub.so"
    src = Path(__file__).parent / "data" / "hip_stub.c"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(src)], check=True)
    return out


@pytest.fixture
def stub_runtime(hip_stub, monkeypatch):
    monkeypatch.setenv("PAGEDKV_HIP_LIBRARY", str(hip_stub))
    monkeypatch.delenv("STUB_INIT_ERROR", raising=False)
    monkeypatch.delenv("STUB_DEVICE_COUNT", raising=False)
    return load_runtime("hip")


def load_tree_script(relative: str, name: str):
    """A script of the source tree (not of the package) as a module; skips the test when
    the tree is not there (an installed package run without its sources)."""
    path = Path(__file__).resolve().parents[1] / relative
    if not path.is_file():
        pytest.skip(f"{relative} is not in this tree")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def tune():
    """hip/tune.py as a module."""
    return load_tree_script("hip/tune.py", "pagedkv_tune")
