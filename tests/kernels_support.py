"""Shared fixtures for the kernel tests: the GPU device (skipped without one), and a ctypes
stub of libamdhip64 (tests/data/hip_stub.c) that records launches and runs nothing."""

from __future__ import annotations

import ctypes
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
    monkeypatch.delenv("STUB_DEVICE_NAME", raising=False)
    monkeypatch.delenv("STUB_ARCH_NAME", raising=False)
    return load_runtime("hip")


@pytest.fixture
def stub_device(stub_runtime, monkeypatch):
    """A Device on the HIP stub, made the default (``open_device()``), so
    ``LayerKVPool(backend="device")`` runs on host memory: the stub emulates the pool's
    byte movers (copy_blocks, the slab gather/scatter) and runs no other kernel. Needs the
    AMD code objects (the stub loads the real gfx90a images)."""
    from pagedkv._build_config import HIP_TARGETS
    from pagedkv.kernels import Device
    from pagedkv.kernels import device as device_module
    if "gfx90a" not in HIP_TARGETS:
        pytest.skip("built without hipcc for gfx90a: no AMD code objects for the stub")
    dev = Device(stub_runtime, 0)
    monkeypatch.setattr(device_module, "_default", dev)
    return dev


class StubLaunch(ctypes.Structure):
    """The HIP stub's record of its last launch (tests/data/hip_stub.c)."""
    _fields_ = [("name", ctypes.c_char * 128), ("grid", ctypes.c_uint * 3),
                ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("n_params", ctypes.c_int), ("params", (ctypes.c_uint8 * 8) * 32),
                ("stream", ctypes.c_void_p)]


class StubRecorder:
    """Reads the HIP stub's launch counter and last launch; ``record_params(sizes)`` makes
    the next launch copy that many bytes of each parameter."""

    def __init__(self, hip_stub):
        self.lib = ctypes.CDLL(str(hip_stub))
        self.lib.stub_launch_count.restype = ctypes.c_long
        self.lib.stub_last_launch.restype = ctypes.POINTER(StubLaunch)
        self.lib.stub_last_wait_stream.restype = ctypes.c_void_p

    @property
    def count(self) -> int:
        return self.lib.stub_launch_count()

    def last(self) -> StubLaunch:
        return self.lib.stub_last_launch().contents

    def last_wait_stream(self) -> int | None:
        return self.lib.stub_last_wait_stream()

    def record_params(self, sizes) -> None:
        self.lib.stub_set_param_sizes(len(sizes), (ctypes.c_int * len(sizes))(*sizes))

    def param(self, i: int, signed: bool = False) -> int:
        return int.from_bytes(bytes(self.last().params[i]), "little", signed=signed)


@pytest.fixture
def stub_recorder(hip_stub, stub_device):
    return StubRecorder(hip_stub)


def track_allocations(monkeypatch, device, *, fail_at: int | None = None,
                      error: Exception | None = None) -> set[int]:
    """The addresses ``device`` allocates from now on and has not freed (a live set,
    updated as the test runs); with ``fail_at``, that ``malloc`` call (1-based) raises
    ``error`` instead (out of memory)."""
    live: set[int] = set()
    calls = [0]
    real_malloc, real_free = device.malloc, device.free

    def malloc(nbytes):
        calls[0] += 1
        if calls[0] == fail_at:
            raise error
        ptr = real_malloc(nbytes)
        live.add(ptr)
        return ptr

    def free(ptr):
        live.discard(ptr)
        real_free(ptr)

    monkeypatch.setattr(device, "malloc", malloc)
    monkeypatch.setattr(device, "free", free)
    return live


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


def quant_header_dir() -> Path | None:
    """Where the private C headers of pagedkv.quant are (installed beside the modules or
    in the source tree), or None."""
    import pagedkv
    candidates = [Path(pagedkv.__file__).resolve().parent / "quant",
                  Path(__file__).resolve().parents[1] / "pkg" / "pagedkv" / "quant"]
    return next((d for d in candidates if (d / "prepared_gemv_loops.h").exists()), None)


@pytest.fixture(scope="session")
def tune():
    """hip/tune.py as a module."""
    return load_tree_script("hip/tune.py", "pagedkv_tune")
