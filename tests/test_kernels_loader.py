"""The ctypes loader without a GPU: error paths, the HIP branch against a stub
runtime (no AMD device is available to the project), and the installed objects."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import pagedkv
from pagedkv import errors
from pagedkv._build_config import CUDA_TARGETS, HIP_TARGETS
from pagedkv.kernels import Device, DeviceArray, list_objects, load_runtime
from pagedkv.kernels.code_objects import object_name, read_object


def test_no_library_raises_no_device_error_in_one_line(monkeypatch):
    monkeypatch.setenv("PAGEDKV_CUDA_LIBRARY", "/nonexistent/libcuda.so.1")
    monkeypatch.setenv("PAGEDKV_HIP_LIBRARY", "/nonexistent/libamdhip64.so")
    with pytest.raises(errors.NoDeviceError) as info:
        load_runtime()
    msg = str(info.value)
    assert "\n" not in msg
    assert "no cuda runtime library could be loaded" in msg
    assert "PAGEDKV_HIP_LIBRARY=/nonexistent/libamdhip64.so" in msg


def test_unknown_backend_is_invalid_argument(monkeypatch):
    with pytest.raises(errors.InvalidArgument, match="backend='opencl'"):
        load_runtime("opencl")
    monkeypatch.setenv("PAGEDKV_GPU_BACKEND", "metal")
    with pytest.raises(errors.InvalidArgument, match="PAGEDKV_GPU_BACKEND"):
        load_runtime()


def test_failed_init_names_the_runtime_error(stub_runtime, monkeypatch):
    monkeypatch.setenv("STUB_INIT_ERROR", "100")
    with pytest.raises(errors.NoDeviceError) as info:
        load_runtime("hip")
    assert "hipInit failed: hipErrorNoDevice (100)" in str(info.value)


def test_zero_devices_is_no_device_error(stub_runtime, monkeypatch):
    monkeypatch.setenv("STUB_DEVICE_COUNT", "0")
    with pytest.raises(errors.NoDeviceError, match="reports no device"):
        load_runtime("hip")


def test_hip_device_properties_from_the_stub(stub_runtime):
    dev = Device(stub_runtime, 0)
    p = dev.properties
    assert (p.name, p.arch, p.warp_size) == ("pagedkv HIP stub", "gfx90a", 64)
    assert (p.multiprocessor_count, p.l2_cache_bytes) == (110, 8 << 20)
    assert p.total_memory_bytes == 64 << 30
    assert "gfx90a" in repr(dev)
    with pytest.raises(errors.InvalidArgument, match="ordinal=1: .* valid 0..0"):
        Device(stub_runtime, 1)


def test_hip_arch_is_the_gcn_arch_name_field_not_the_first_gfx(stub_runtime, monkeypatch):
    # _hip_arch took the first b"gfx" anywhere in hipDeviceProp_t, and the device name comes
    # first: a device named after a target (an APU's board name, a renamed card) got the
    # arch "gfx1100 (stub)" and no kernel object. It reads gcnArchName at byte 396 now.
    monkeypatch.setenv("STUB_DEVICE_NAME", "Radeon gfx1100 (stub)")
    p = Device(stub_runtime, 0).properties
    assert (p.name, p.arch) == ("Radeon gfx1100 (stub)", "gfx90a")
    from pagedkv.kernels.runtime import _HipDevicePropR0000
    assert _HipDevicePropR0000.gcnArchName.offset == 396  # hip_stub.c's, ROCm 5's


@pytest.mark.parametrize("arch", ["", "sm_90:xnack-"])
def test_a_hip_arch_name_that_is_no_gfx_target_is_a_device_error(stub_runtime, monkeypatch,
                                                                  hip_stub, arch):
    # The old scan found "gfx942" in the name and never looked at the arch field.
    monkeypatch.setenv("STUB_DEVICE_NAME", "gfx942 lookalike")
    monkeypatch.setenv("STUB_ARCH_NAME", arch)
    with pytest.raises(errors.DeviceError) as info:
        Device(stub_runtime, 0)
    e = info.value
    assert (e.call, e.code, e.name) == ("hipGetDeviceProperties", 0, "no gcnArchName")
    assert str(e) == (
        "hipGetDeviceProperties failed: no gcnArchName (0): hipDeviceProp_t.gcnArchName (byte "
        f"396 of the ROCm 5 / R0000 layout) holds {arch.encode()!r}, not a 'gfx...' arch "
        "name; point PAGEDKV_HIP_LIBRARY at a ROCm 5 or later libamdhip64 "
        f"({hip_stub} filled it)")
    monkeypatch.delenv("STUB_ARCH_NAME")  # the runtime is as it was: the next open works
    assert Device(stub_runtime, 0).properties.arch == "gfx90a"


def test_hip_arch_prefers_the_r0000_symbol_where_the_library_has_it(hip_stub):
    # ROCm 6 and later export hipGetDevicePropertiesR0000 (the layout read) beside the plain
    # name; a library with only the R0000 symbol is read through it.
    from pagedkv.kernels.runtime import Runtime
    stub = ctypes.CDLL(str(hip_stub))

    class Rocm6:
        hipGetDevicePropertiesR0000 = stub.hipGetDeviceProperties

        def __getattr__(self, name):
            if name == "hipGetDeviceProperties":
                raise AttributeError(name)
            return getattr(stub, name)

    assert Runtime("hip", Rocm6(), "rocm6")._hip_arch(0) == "gfx90a"


def test_device_error_carries_the_runtime_name_and_message(stub_runtime):
    dev = Device(stub_runtime, 0)
    with pytest.raises(errors.DeviceError) as info:
        dev.malloc(1 << 41)
    e = info.value
    assert (e.call, e.code, e.name, e.runtime_message) == (
        "hipMalloc", 2, "hipErrorOutOfMemory", "out of memory")
    assert str(e) == "hipMalloc failed: hipErrorOutOfMemory (2): out of memory"


def test_device_array_round_trip_and_poison(stub_runtime):
    dev = Device(stub_runtime, 0)
    host = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    arr = DeviceArray.from_numpy(dev, host)
    assert arr.shape == (2, 3, 4) and arr.nbytes == 96 and arr.dtype == np.float32
    np.testing.assert_array_equal(arr.to_numpy(), host)
    arr.fill_bytes(0xFF)
    assert np.isnan(arr.to_numpy()).all()
    with pytest.raises(errors.InvalidArgument, match="does not match"):
        arr.copy_from(np.zeros((3, 2, 4), np.float32))
    assert np.isnan(arr.to_numpy()).all()  # unchanged after the refused copy
    with pytest.raises(errors.InvalidArgumentType):
        DeviceArray.from_numpy(dev, [1, 2, 3])
    arr.free()
    assert arr.ptr == 0


@pytest.mark.skipif(not HIP_TARGETS, reason="built without hipcc: no AMD code objects")
def test_hip_launch_packs_typed_arguments(stub_runtime, hip_stub):
    dev = Device(stub_runtime, 0)
    k = dev.kernel("kvcache", "pkv_copy_blocks_16", "ppppiq")
    stub = ctypes.CDLL(str(hip_stub))
    sizes = (ctypes.c_int * 6)(8, 8, 8, 8, 4, 8)
    stub.stub_set_param_sizes(6, sizes)
    a = dev.empty((4, 64), np.uint8)
    k((3, 2), (256,), a, 0x1234, a.ptr + 16, 7, -5, 1 << 40, shared_bytes=96)

    class Record(ctypes.Structure):
        _fields_ = [("name", ctypes.c_char * 128), ("grid", ctypes.c_uint * 3),
                    ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                    ("n_params", ctypes.c_int), ("params", (ctypes.c_uint8 * 8) * 32)]
    stub.stub_last_launch.restype = ctypes.POINTER(Record)
    rec = stub.stub_last_launch().contents
    assert rec.name == b"pkv_copy_blocks_16"
    assert list(rec.grid) == [3, 2, 1] and list(rec.block) == [256, 1, 1]
    assert rec.shared_bytes == 96
    params = [bytes(rec.params[i]) for i in range(6)]
    assert int.from_bytes(params[0], "little") == a.ptr
    assert int.from_bytes(params[1], "little") == 0x1234
    assert int.from_bytes(params[2], "little") == a.ptr + 16
    assert int.from_bytes(params[3], "little") == 7
    assert int.from_bytes(params[4][:4], "little", signed=True) == -5
    assert int.from_bytes(params[5], "little", signed=True) == 1 << 40
    with pytest.raises(errors.InvalidArgument, match="1 arguments given, the kernel takes 6"):
        k((1,), (1,), a)
    with pytest.raises(errors.InvalidArgumentType, match="argument 4 must be an integer"):
        k((1,), (1,), a, a, a, a, 1.5, 0)
    with pytest.raises(errors.DeviceError, match="hipErrorNotFound"):
        dev.kernel("kvcache", "not_a_kernel", "p")


def test_missing_code_object_is_no_device_error():
    # gfx803 is never built: a device of that arch cannot run pagedkv's kernels.
    with pytest.raises(errors.NoDeviceError, match="no kernel object kvcache.gfx803.hsaco"):
        read_object("kvcache", "hip", "gfx803")


@pytest.mark.skipif(not HIP_TARGETS, reason="built without hipcc: no AMD code objects")
def test_a_device_of_an_arch_not_built_is_told_the_rebuild(stub_runtime):
    # An MI300X reports gfx942, whose kernels a gfx940 code object does not hold: the first
    # kernel lookup names the arches built and the meson option that adds this one (the
    # error once listed every object file of the build, CUDA fatbins included, and no fix).
    import dataclasses
    dev = Device(stub_runtime, 0)
    dev.properties = dataclasses.replace(dev.properties, arch="gfx942")
    with pytest.raises(errors.NoDeviceError) as info:
        dev.kernel("kvcache", "pkv_copy_blocks_16", "ppppiq")
    msg = str(info.value)
    assert msg.startswith("no kernel object kvcache.gfx942.hsaco for this hip device (gfx942)")
    assert f"AMD code objects for {', '.join(sorted(HIP_TARGETS))}," in msg
    assert "-Csetup-args=-Dhip_arches=gfx942" in msg and ".fatbin" not in msg


def test_code_objects_match_the_build_and_show_config():
    objects = list_objects()
    expected = []
    for source in ("bench", "decode", "kvcache", "pool", "weights"):
        expected += [object_name(source, "hip", a) for a in HIP_TARGETS]
        if CUDA_TARGETS:
            expected.append(object_name(source, "cuda", ""))
        for arch in HIP_TARGETS:  # clang offload bundles of AMD code objects
            assert read_object(source, "hip", arch)[:24] == b"__CLANG_OFFLOAD_BUNDLE__"
        if CUDA_TARGETS:  # NVIDIA fatbin magic 0xBA55ED50
            assert read_object(source, "cuda", "")[:4] == bytes.fromhex("50ed55ba")
    assert objects == sorted(expected)
    assert pagedkv._config.config()["kernel_objects"] == objects


def test_load_module_serves_a_source_from_another_image(stub_runtime):
    dev = Device(stub_runtime, 0)
    before = dict(dev._modules)
    with pytest.raises(errors.DeviceError, match="hipErrorInvalidImage"):
        dev.load_module("weights", b"not a code object")
    assert dev._modules == before  # the refused image replaced nothing
    with pytest.raises(errors.InvalidArgumentType, match="expected non-empty bytes"):
        dev.load_module("weights", "\x7fELF")
    dev.load_module("weights", b"\x7fELF" + bytes(60))  # the stub accepts any ELF
    k = dev.kernel("weights", "pkv_fwht256_f32", "ppq")
    assert k.name == "pkv_fwht256_f32" and "weights" in dev._modules
    dev.load_module("weights", b"\x7fELF" + bytes(60))
    assert dev.kernel("weights", "pkv_fwht256_f32", "ppq") is not k  # looked up afresh
