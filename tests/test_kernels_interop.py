"""DeviceArray interop (docs/kernels.md, "Interop"): DLPack capsules (legacy and versioned
1.0, the deleter, ``used_dltensor`` renaming), the CUDA array interface v3 and stream
handles.

Host tests use the HIP stub, whose "device" memory is host memory: with kDLCPU added to
the stub backend's DLPack device types, NumPy and CPU torch can consume and produce the
capsules, so ownership and layout are checked on real consumers. GPU tests (marked gpu) do
the same with CUDA torch tensors."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import re
import sys
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.kernels import DeviceArray, interop
from pagedkv.kernels.device import Stream, stream_handle
from pagedkv.kernels.dlpack import import_capsule

HAVE_TORCH = importlib.util.find_spec("torch") is not None

_name = ctypes.pythonapi.PyCapsule_GetName
_name.restype, _name.argtypes = ctypes.c_char_p, [ctypes.py_object]


@pytest.fixture
def host_dlpack(stub_device, monkeypatch):
    """The stub's memory is host memory: let it travel as kDLCPU both ways."""
    monkeypatch.setitem(interop.DLPACK_DEVICE_TYPES, "hip",
                        {"export": (interop.KDL_CPU,), "import": (interop.KDL_CPU,)})
    return stub_device


def test_numpy_consumes_a_capsule_without_copying(host_dlpack):
    dev = host_dlpack
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    arr = dev.array(host)
    view = np.from_dlpack(arr)
    assert view.ctypes.data == arr.ptr and view.shape == (3, 4) and view.dtype == np.float32
    view[1, 2] = -7.0  # the same memory both ways
    assert arr.to_numpy()[1, 2] == -7.0
    arr.copy_from(host)
    assert view[1, 2] == 6.0
    assert arr.__dlpack_device__() == (interop.KDL_CPU, 0)


def test_capsule_names_versions_and_the_owner_reference(host_dlpack):
    arr = host_dlpack.empty((2, 3), np.uint16)
    refs = sys.getrefcount(arr)
    legacy = arr.__dlpack__()
    assert _name(legacy) == b"dltensor" and sys.getrefcount(arr) == refs + 1
    versioned = arr.__dlpack__(max_version=(1, 2))
    assert _name(versioned) == b"dltensor_versioned"
    assert _name(arr.__dlpack__(max_version=(0, 8))) == b"dltensor"
    del legacy, versioned  # dropped unconsumed: the capsule destructors call the deleters
    gc.collect()
    assert sys.getrefcount(arr) == refs
    capsule = arr.__dlpack__(max_version=(1, 0))
    tensor = import_capsule(capsule)
    assert _name(capsule) == b"used_dltensor_versioned"  # consumed once
    assert (tensor.data, tensor.shape, tensor.strides) == (arr.ptr, (2, 3), (3, 1))
    assert tensor.dtype == (1, 16, 1) and tensor.version == (1, 0) and not tensor.read_only
    del capsule
    gc.collect()
    assert sys.getrefcount(arr) == refs + 1  # the consumer still holds the tensor
    del tensor
    gc.collect()
    assert sys.getrefcount(arr) == refs  # its deleter ran
    with pytest.raises(InvalidArgument, match="got a capsule named 'used_dltensor'"):
        used = arr.__dlpack__()
        import_capsule(used)
        import_capsule(used)
    with pytest.raises(InvalidArgument, match="got int"):
        import_capsule(3)


def test_an_exported_array_outlives_its_owner_reference(host_dlpack):
    arr = host_dlpack.array(np.arange(4, dtype=np.int32))
    ref = weakref.ref(arr)
    view = np.from_dlpack(arr)
    del arr
    gc.collect()
    assert ref() is not None and view.tolist() == [0, 1, 2, 3]  # kept by the capsule
    del view
    gc.collect()
    assert ref() is None  # the consumer let go: freed


def test_export_refuses_copies_other_devices_and_freed_arrays(host_dlpack):
    arr = host_dlpack.empty((2,), np.float32)
    with pytest.raises(BufferError, match="copy=True"):
        arr.__dlpack__(copy=True)
    with pytest.raises(BufferError, match=r"dl_device=\(2, 0\)"):
        arr.__dlpack__(dl_device=(2, 0))
    with pytest.raises(InvalidArgument, match="dtype complex64: DLPack export takes"):
        host_dlpack.empty((2,), np.complex64).__dlpack__()
    arr.free()
    with pytest.raises(InvalidArgument, match="was freed"):
        arr.__dlpack__()


def test_export_on_another_stream_makes_it_wait(host_dlpack, hip_stub):
    from kernels_support import StubRecorder
    rec = StubRecorder(hip_stub)
    arr = host_dlpack.empty((2,), np.float32)
    arr.__dlpack__(stream=0x5000)
    assert rec.last_wait_stream() == 0x5000
    with pytest.raises(InvalidArgumentType, match="stream: expected an int"):
        arr.__dlpack__(stream="s")


def test_from_dlpack_imports_numpy_memory_and_releases_it(host_dlpack):
    host = np.arange(6, dtype=np.int64).reshape(2, 3)
    refs = sys.getrefcount(host)
    arr = DeviceArray.from_dlpack(host, host_dlpack)
    assert arr.ptr == host.ctypes.data and arr.shape == (2, 3) and arr.dtype == np.int64
    assert "view" in repr(arr) and sys.getrefcount(host) > refs
    assert arr.to_numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
    sub = arr.rows(1, 2)  # a view keeps the import alive
    del arr
    gc.collect()
    assert sub.to_numpy().tolist() == [[3, 4, 5]]
    del sub
    gc.collect()
    assert sys.getrefcount(host) == refs  # the producer's deleter ran
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        DeviceArray.from_dlpack(np.zeros((4, 4), np.float32)[:, ::2], host_dlpack)
    with pytest.raises(InvalidArgumentType, match="has no __dlpack__"):
        interop.from_dlpack([1, 2], host_dlpack)


def test_from_dlpack_refuses_memory_of_another_device(stub_device):
    with pytest.raises(InvalidArgument, match=r"lives on DLPack device \(1, 0\); this hip "
                                              r"device takes types \(10,\)"):
        DeviceArray.from_dlpack(np.zeros(3, np.float32), stub_device)


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_torch_round_trips_and_bfloat16_travels_as_bits(host_dlpack):
    import torch
    t = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    arr = DeviceArray.from_dlpack(t, host_dlpack)
    assert arr.ptr == t.data_ptr() and arr.shape == (2, 4)
    back = torch.from_dlpack(arr)
    assert back.data_ptr() == t.data_ptr() and back.dtype == torch.float32
    back[0, 0] = 42.0
    assert t[0, 0].item() == 42.0
    bf = torch.tensor([1.0, -2.5], dtype=torch.bfloat16)
    bits = DeviceArray.from_dlpack(bf, host_dlpack)
    assert bits.dtype == np.uint16
    assert bits.to_numpy().tolist() == [0x3F80, 0xC020]
    assert torch.from_dlpack(bits).view(torch.bfloat16).tolist() == [1.0, -2.5]
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        DeviceArray.from_dlpack(t.t(), host_dlpack)


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_a_device_pool_layer_is_a_torch_tensor_of_its_memory(host_dlpack):
    import torch

    from pagedkv.pool import LayerKVPool, PoolGeometry
    g = PoolGeometry(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
    pool = LayerKVPool(g, 3, 6, backend="device")
    k = torch.from_dlpack(pool.layer(1)[0])
    assert tuple(k.shape) == (3, 4, 2, 8) and k.dtype == torch.float16
    slots = pool.slots_for_positions([2], [1])
    rows = np.full((1, 2, 8), 1.5, np.float16)
    pool.write_tokens(1, slots, rows, rows)
    assert (k[2, 1] == 1.5).all() and int((k != 0).sum()) == 16
    assert pool.grow_to(6)
    assert (k[2, 1] == 1.5).all()  # the old generation's memory lives while torch holds it


def test_cuda_array_interface_export_and_import(host_dlpack):
    arr = host_dlpack.empty((3, 2), np.float16)
    cai = arr.__cuda_array_interface__
    assert cai == {"shape": (3, 2), "typestr": "<f2", "data": (arr.ptr, False), "version": 3,
                   "strides": None, "stream": 1}

    class Producer:
        def __init__(self, **extra):
            self.__cuda_array_interface__ = {**cai, **extra}

    p = Producer()
    view = DeviceArray.from_dlpack(p, host_dlpack)  # no __dlpack__: the interface
    assert (view.ptr, view.shape, view.dtype) == (arr.ptr, (3, 2), np.float16)
    assert view.base is p
    assert interop.from_cuda_array_interface(Producer(strides=(4, 2)), host_dlpack).shape == (3, 2)
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        interop.from_cuda_array_interface(Producer(strides=(2, 6)), host_dlpack)
    with pytest.raises(InvalidArgument, match="masked"):
        interop.from_cuda_array_interface(Producer(mask=object()), host_dlpack)
    with pytest.raises(InvalidArgument, match="malformed"):
        interop.from_cuda_array_interface(Producer(typestr="not a dtype"), host_dlpack)
    # found by a review: these leaked ValueError, or reached a launch misaligned
    for extra, message in (({"strides": (4,)}, "1 strides for the 2 dims"),
                           ({"stream": "x"}, "stream 'x' is not an int"),
                           ({"shape": (-3, 2)}, "negative dimension"),
                           ({"data": (arr.ptr + 1, False)}, "not a multiple of its float16")):
        with pytest.raises(InvalidArgument, match=message):
            interop.from_cuda_array_interface(Producer(**extra), host_dlpack)


def test_from_dlpack_refuses_misaligned_memory_and_a_malformed_device(host_dlpack):
    host = np.zeros(9, np.float32)
    odd = np.frombuffer(host.view(np.uint8)[1:33].data, np.float32)  # 1 byte past alignment
    with pytest.raises(InvalidArgument, match="not a multiple of its float32 element size"):
        DeviceArray.from_dlpack(odd, host_dlpack)

    class Odd:
        def __dlpack__(self, **kw):
            return host.__dlpack__(**kw)

        def __dlpack_device__(self):
            return "cpu"
    with pytest.raises(InvalidArgument, match="returned 'cpu', not"):
        DeviceArray.from_dlpack(Odd(), host_dlpack)


class _Interface:
    """A producer of nothing but a CUDA array interface (``data: (ptr, read_only)``)."""

    def __init__(self, arr, read_only):
        self.__cuda_array_interface__ = {**arr.__cuda_array_interface__,
                                         "data": (arr.ptr, read_only)}


def test_read_only_imports_are_read_but_never_written(host_dlpack, stub_recorder):
    """Found by a review: a buffer its producer flagged read-only (a NumPy array with
    writeable=False through a versioned capsule, ``data: (ptr, True)``) was taken as
    writable, as a kernel's output or a pool. Every launcher refuses it where it writes,
    before any launch, and its bytes stay as they were."""
    from pagedkv.kernels import kvcache, weights
    dev = host_dlpack
    host = np.arange(256, dtype=np.float32)
    host.flags.writeable = False
    by_dlpack = DeviceArray.from_dlpack(host, dev)
    backing = dev.array(np.arange(256, dtype=np.float32))
    by_interface = DeviceArray.from_dlpack(_Interface(backing, True), dev)
    assert not DeviceArray.from_dlpack(_Interface(backing, False), dev).readonly
    x = dev.array(np.ones(256, np.float32))
    for ro in (by_dlpack, by_interface):
        assert ro.readonly and ro.view((16, 16)).readonly and "read-only" in repr(ro)
        before, launches = ro.to_numpy(), stub_recorder.count
        for write, args in ((weights.fwht256, (dev, x, ro)),
                            (weights.fwht256, (dev, x, ro.view((16, 16)))),
                            (ro.copy_from, (np.zeros(256, np.float32),)),
                            (ro.fill_bytes, (0xFF,))):
            with pytest.raises(InvalidArgument, match="imported read-only"):
                write(*args)
        assert stub_recorder.count == launches
        np.testing.assert_array_equal(ro.to_numpy(), before)
        weights.fwht256(dev, ro, x)  # read: taken
        assert stub_recorder.count == launches + 1
        # exported again, it says so
        assert import_capsule(ro.__dlpack__(max_version=(1, 0))).read_only
        assert ro.__cuda_array_interface__["data"] == (ro.ptr, True)
    # a q8 pool and a block copy's destination
    pool = dev.empty((2, 4, 2, 68), np.uint8)
    pool.fill_bytes(7)
    ro_pool = DeviceArray.from_dlpack(_Interface(pool, True), dev)
    src, slots = dev.array(np.ones((3, 2, 64), np.float32)), dev.array(np.arange(3))
    ids, launches = dev.array(np.array([0], np.int32)), stub_recorder.count
    with pytest.raises(InvalidArgument, match="pool: .* imported read-only"):
        kvcache.kv_q8_write(dev, src, slots, ro_pool)
    with pytest.raises(InvalidArgument, match="dst: .* imported read-only"):
        kvcache.copy_blocks(dev, pool, ids, dev.array(np.array([1], np.int32)), ro_pool)
    assert stub_recorder.count == launches and (pool.to_numpy() == 7).all()


def test_from_dlpack_checks_the_capsules_own_device_id(host_dlpack):
    """Found by a review: without ``__dlpack_device__`` only the capsule's device type was
    checked, so a tensor of another GPU (its id) was imported onto this one."""
    from pagedkv.kernels.dlpack import export_capsule
    host = np.zeros(4, np.float32)

    class OnDevice:
        def __init__(self, device_id):
            self.device_id = device_id

        def __dlpack__(self, **kw):
            return export_capsule(host, host.ctypes.data, (4,), (2, 32, 1), interop.KDL_CPU,
                                  self.device_id, True)

    assert DeviceArray.from_dlpack(OnDevice(0), host_dlpack).shape == (4,)
    with pytest.raises(InvalidArgument, match=r"capsule's DLPack device \(1, 1\) is not this "
                                              r"hip device \(types \(1,\), ordinal 0\)"):
        DeviceArray.from_dlpack(OnDevice(1), host_dlpack)


def test_stream_handles_of_pagedkv_torch_and_cupy_streams(stub_device):
    class TorchLike:
        cuda_stream = 0x77

    class CupyLike:
        ptr = 0x88

    s = Stream(stub_device)
    assert stream_handle(s) == s.handle
    assert [stream_handle(x) for x in (None, 0, 0x10, TorchLike(), CupyLike())] == \
        [None, None, 0x10, 0x77, 0x88]
    with pytest.raises(InvalidArgumentType, match="got str"):
        stream_handle("default")
    with pytest.raises(InvalidArgumentType):
        stream_handle(True)


def test_views_of_device_arrays(stub_device):
    arr = stub_device.array(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert arr.view((12,)).to_numpy().tolist() == list(range(12))
    assert arr.view(dtype=np.uint8).shape == (48,)
    assert arr.rows(1, 3).to_numpy().tolist() == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert arr.view((2,), offset_bytes=40).to_numpy().tolist() == [10, 11]
    with pytest.raises(InvalidArgument, match="does not fit"):
        arr.view((4,), offset_bytes=40)
    with pytest.raises(InvalidArgument, match=r"rows \[2, 4\) are outside 0..3"):
        arr.rows(2, 4)


# --- GPU ------------------------------------------------------------------------------------


def _cuda_torch():
    try:
        import torch
    except ImportError:
        pytest.skip("torch not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


@pytest.mark.gpu
def test_gpu_torch_tensors_are_queries_outputs_and_pool_storage(device):
    torch = _cuda_torch()
    from pagedkv.kernels import weights
    x = torch.randn(2, 512, device="cuda")
    y = torch.full((2, 512), float("nan"), device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        weights.fwht256(device, DeviceArray.from_dlpack(x, device, stream=stream.cuda_stream),
                        DeviceArray.from_dlpack(y, device, stream=stream.cuda_stream),
                        stream=stream)  # on torch's stream: torch sees it in order
        got = y.cpu().numpy()
    from pagedkv import quant
    np.testing.assert_array_equal(got, quant.fwht256(x.cpu().numpy().reshape(-1, 256))
                                  .reshape(2, 512))
    arr = device.array(np.arange(6, dtype=np.float32))
    t = torch.from_dlpack(arr)
    assert t.device.type == "cuda" and t.data_ptr() == arr.ptr
    assert t.cpu().tolist() == [0, 1, 2, 3, 4, 5]
    c = torch.as_tensor(arr, device="cuda")  # through __cuda_array_interface__
    assert c.data_ptr() == arr.ptr


def test_a_new_thread_makes_the_device_current_once(stub_device, monkeypatch):
    import threading
    activations = []
    activate = stub_device.runtime.activate
    monkeypatch.setattr(stub_device.runtime, "activate",
                        lambda ordinal: (activations.append(threading.get_ident()),
                                         activate(ordinal))[1])
    results = []

    def work():
        a = stub_device.array(np.arange(3, dtype=np.float32))
        results.append(a.to_numpy().tolist())
        a.free()

    stub_device.array(np.zeros(2, np.float32))  # the opening thread: already current
    assert activations == []
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert results == [[0.0, 1.0, 2.0]] and activations == [t.ident]  # once, on that thread


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_host_tensors_are_host_data_for_a_device_pool(stub_device):
    """A CPU torch tensor offers host memory through DLPack: a device pool reads it as a
    host payload (uploaded), not as device memory."""
    import torch

    from pagedkv.pool import LayerKVPool, PoolGeometry
    assert not interop.is_device_buffer(torch.zeros(2))
    assert not interop.is_device_buffer(np.zeros(2))
    g = PoolGeometry(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float16")
    pool = LayerKVPool(g, 2, backend="device")
    k = torch.arange(16, dtype=torch.float16).reshape(2, 1, 8)
    pool.write_tokens(0, [5, 1], k, k)
    got = pool.layer(0)[0].to_numpy().reshape(8, 1, 8)
    assert got[[5, 1]].tolist() == k.numpy().tolist()


def test_zero_size_buffers_are_contiguous_whatever_their_strides(host_dlpack):
    """Found by a review: a buffer of zero elements was refused as "not C-contiguous; make it
    contiguous first" for the strides its producer gives it (NumPy's all-zero strides, torch's
    (1, 1) for shape (3, 0)), which .contiguous() does not change: an empty batch could not
    be imported. With no element to address, any strides are contiguous."""
    for shape in ((0,), (3, 0), (0, 3), (2, 0, 3)):
        host = np.empty(shape, np.float32)
        arr = DeviceArray.from_dlpack(host, host_dlpack)
        assert (arr.shape, arr.dtype, arr.nbytes) == (shape, np.float32, 0)
        assert np.from_dlpack(arr).shape == shape
    backing = host_dlpack.empty((1,), np.float16)

    class Producer:
        def __init__(self, shape, strides):
            self.__cuda_array_interface__ = {"shape": shape, "strides": strides, "version": 3,
                                             "typestr": "<f2", "data": (backing.ptr, False)}

    for shape, strides in (((3, 0), (2, 2)), ((0, 4), (0, 0)), ((0,), (6,))):
        arr = interop.from_cuda_array_interface(Producer(shape, strides), host_dlpack)
        assert (arr.shape, arr.nbytes) == (shape, 0)
    with pytest.raises(InvalidArgument, match="1 strides for the 2 dims"):
        interop.from_cuda_array_interface(Producer((3, 0), (2,)), host_dlpack)


def test_imports_and_arrays_of_types_pagedkv_does_not_hold_are_refused(host_dlpack,
                                                                        monkeypatch):
    """Found by a review: __cuda_array_interface__ took any typestr NumPy parses, so an
    object ('|O') buffer became a DeviceArray whose to_numpy() read device bytes as PyObject
    pointers (a segfault), and void, complex, datetime, unicode, big-endian and 16-byte
    floats came in too; DeviceArray.empty / from_numpy / view took an object dtype the
    same way, and a DLPack float of 128 bits came in as NumPy's float128 (x87 extended, not
    IEEE binary128). The interface now takes what DLPack import takes (a native bool, int,
    uint or float of at most 8 bytes) and a DeviceArray never has an object dtype, all
    refused before any allocation."""
    from pagedkv.kernels.dlpack import export_capsule
    dev = host_dlpack
    backing = dev.array(np.zeros(4, np.uint64))
    def producer(typestr):
        return SimpleNamespace(__cuda_array_interface__={
            "shape": (2,), "typestr": typestr, "version": 3, "data": (backing.ptr, False)})

    for typestr in ("|O", "|V8", "<c8", ">f4", "<M8[s]", "<U2", "<f16"):
        with pytest.raises(InvalidArgument, match=re.escape(typestr) + r"' \(.*\) is not a "
                                                  r"native bool, int, uint or float of at "
                                                  r"most 8 bytes"):
            DeviceArray.from_dlpack(producer(typestr), dev)
    for typestr, dtype in (("|b1", np.bool_), ("<u2", np.uint16), ("<f8", np.float64)):
        assert interop.from_cuda_array_interface(producer(typestr), dev).dtype == dtype
    mallocs = []  # nothing is allocated for a refused dtype
    monkeypatch.setattr(dev, "malloc", lambda n: mallocs.append(n) or 0)
    with pytest.raises(InvalidArgument, match="dtype object: device memory holds numbers"):
        dev.empty((2,), object)
    with pytest.raises(InvalidArgument, match="dtype object: device memory holds numbers"):
        dev.array(np.array([None, 1], dtype=object))
    with pytest.raises(InvalidArgument, match=r"dtype \[\('a', 'O'\)\]: device memory"):
        backing.view((2,), np.dtype([("a", "O")]))
    assert mallocs == []
    host = np.zeros(4, np.float32)

    class Quad:
        def __dlpack__(self, **kw):
            return export_capsule(host, host.ctypes.data, (1,), (2, 128, 1), interop.KDL_CPU,
                                  0, True)

    with pytest.raises(InvalidArgument, match=r"DLPack dtype \(code 2, bits 128, lanes 1\) "
                                              r"has no pagedkv equivalent"):
        DeviceArray.from_dlpack(Quad(), dev)


def _rocm_producer(asked):
    """A class of ROCm float32[4] tensors of device 0 whose ``__dlpack__`` records the
    ``stream=`` it is asked for in ``asked``."""
    from pagedkv.kernels.dlpack import export_capsule
    host = np.zeros(4, np.float32)

    class OnDevice:  # a ROCm tensor of this device
        def __dlpack_device__(self):
            return (interop.KDL_ROCM, 0)

        def __dlpack__(self, *, stream=None, max_version=None):
            asked.append(stream)
            return export_capsule(host, host.ctypes.data, (4,), (2, 32, 1), interop.KDL_ROCM,
                                  0, True)

    return OnDevice


def test_from_dlpack_takes_the_stream_a_launcher_takes(stub_device):
    """Found by a review: from_dlpack's stream= went through int(), so a pagedkv Stream or a
    torch stream (what every launcher's stream= takes) and a str let a bare TypeError /
    ValueError out, and 1.5 or True were truncated to a stream handle silently. It is read
    like a launcher's stream= now: InvalidArgumentType before the producer is asked."""
    asked = []
    OnDevice = _rocm_producer(asked)
    s = Stream(stub_device)
    for stream, handle in ((None, 0), (0, 0), (0x77, 0x77), (s, s.handle),
                           (SimpleNamespace(cuda_stream=0x66), 0x66)):
        arr = DeviceArray.from_dlpack(OnDevice(), stub_device, stream=stream)
        assert arr.shape == (4,) and asked.pop() == handle
    for bad in ("x", 1.5, True, object()):
        with pytest.raises(InvalidArgumentType, match="stream: expected a pagedkv Stream, an "
                                                      "integer stream handle"):
            DeviceArray.from_dlpack(OnDevice(), stub_device, stream=bad)
    assert asked == []


def test_from_dlpack_on_hip_refuses_cudas_default_stream_values(stub_device):
    """Found by a review: from_dlpack(x, stream=1) or (stream=2) on a HIP device passed 1
    or 2 on to the producer's __dlpack__(stream=), where DLPack's 1 (legacy default) and 2
    (per-thread default) are CUDA-only values: ROCm takes 0 for its default stream and 1/2
    are not supported (a ROCm torch wraps them as ExternalStream(1)). They raise
    InvalidArgument naming what to pass, before the producer is asked."""
    asked = []
    OnDevice = _rocm_producer(asked)
    for stream in (1, 2, np.int64(1), SimpleNamespace(cuda_stream=2)):
        with pytest.raises(InvalidArgument, match=r"from_dlpack\(stream=[12]\): .*not a HIP "
                                                  r"stream.*pass None or 0 \(the default "
                                                  r"stream\)"):
            DeviceArray.from_dlpack(OnDevice(), stub_device, stream=stream)
    assert asked == []
    assert DeviceArray.from_dlpack(OnDevice(), stub_device, stream=3).shape == (4,)
    assert asked == [3]


def test_a_read_only_array_is_never_exported_as_a_legacy_capsule(host_dlpack, stub_recorder):
    """Found by a review: a read-only import exported again to a consumer of legacy DLPack
    (no max_version: older torch, CuPy, JAX) went out as a plain "dltensor", which has no
    read-only flag, so the consumer got it as writable memory. It is refused with
    BufferError (NumPy's answer), before any stream wait; a DLPack 1.0 consumer still gets
    the flag, and a writable array still goes out legacy."""
    host = np.arange(4, dtype=np.float32)
    host.flags.writeable = False
    ro = DeviceArray.from_dlpack(host, host_dlpack)
    waited = stub_recorder.last_wait_stream()
    for kw in ({}, {"max_version": None}, {"max_version": (0, 8)}, {"stream": 0x5000}):
        with pytest.raises(BufferError, match="read-only and a legacy DLPack capsule"):
            ro.__dlpack__(**kw)
    assert stub_recorder.last_wait_stream() == waited
    out = np.from_dlpack(ro)  # NumPy asks for 1.0
    assert not out.flags.writeable and out.tolist() == [0, 1, 2, 3]
    assert _name(host_dlpack.empty((2,), np.float32).__dlpack__()) == b"dltensor"


def test_an_exported_view_keeps_its_memory_after_the_view_is_freed(host_dlpack):
    """Found by a review: a capsule held only the exported DeviceArray, and a view's free()
    ("a view only forgets its address") drops the view's base, so exporting a view (a pool
    layer's slab, rows of an array, an import), then freeing the view and dropping the owner
    freed the memory the consumer still read (NumPy read garbage on the HIP stub). The
    capsule now holds the view's whole base chain, taken at export."""
    for make in (lambda a: a.view(), lambda a: a.rows(1, 3).view((2,))):
        arr = host_dlpack.array(np.arange(4, dtype=np.int32))
        ref = weakref.ref(arr)
        view = make(arr)
        out = np.from_dlpack(view)
        expected = out.tolist()
        del arr
        view.free()
        gc.collect()
        assert ref() is not None and out.tolist() == expected  # still the owner's memory
        del out
        gc.collect()
        assert ref() is None  # the consumer let go: freed
    host = np.arange(3, dtype=np.float32)  # an import exported again: the producer stays
    refs = sys.getrefcount(host)
    imported = DeviceArray.from_dlpack(host, host_dlpack)
    out = np.from_dlpack(imported)
    imported.free()
    del imported
    gc.collect()
    assert sys.getrefcount(host) > refs and out.tolist() == [0, 1, 2]
    del out
    gc.collect()
    assert sys.getrefcount(host) == refs


def test_export_streams_follow_the_dlpack_rule_of_the_backend(host_dlpack, stub_recorder,
                                                              monkeypatch):
    """Found by a review: __dlpack__(stream=1) or (stream=2) on the HIP backend made the
    default stream wait on handle 1 or 2, which is no HIP stream (DLPack: ROCm takes 0 for
    its default stream, 1 and 2 are not supported), so the wait failed inside the runtime;
    on CUDA, stream 0 (disallowed as ambiguous) was waited on as a handle. Such values raise
    BufferError before any wait now; CUDA's 1 (legacy default) and 2 (per-thread default)
    and -1 (no synchronization) need no wait."""
    arr = host_dlpack.empty((2,), np.float32)
    arr.__dlpack__(stream=0x5000)
    for stream in (1, 2, -2, np.int64(1)):
        with pytest.raises(BufferError, match=rf"stream={int(stream)}\): not a hip stream under "
                                              r"the DLPack rule; pass None, -1 .*0 \(the "
                                              r"default stream\)"):
            arr.__dlpack__(stream=stream)
    for stream in (None, 0, -1):
        assert _name(arr.__dlpack__(stream=stream)) == b"dltensor"
    assert stub_recorder.last_wait_stream() == 0x5000  # none of these waited
    monkeypatch.setattr(interop, "_backend", lambda device: "cuda")
    monkeypatch.setitem(interop.DLPACK_DEVICE_TYPES, "cuda",
                        {"export": (interop.KDL_CPU,), "import": (interop.KDL_CPU,)})
    arr.__dlpack__(stream=0x6000)
    for stream in (0, -2):
        with pytest.raises(BufferError, match=rf"stream={stream}\): not a cuda stream under "
                                              r"the DLPack rule.*1 \(the legacy default "
                                              r"stream\), 2 \(the per-thread default"):
            arr.__dlpack__(stream=stream)
    for stream in (None, 1, 2, -1):
        assert _name(arr.__dlpack__(stream=stream, max_version=(1, 0))) == \
            b"dltensor_versioned"
    assert stub_recorder.last_wait_stream() == 0x6000


def test_a_malformed_max_version_names_the_expected_tuple(host_dlpack, stub_recorder):
    """Found by a review: __dlpack__(max_version=1) let a bare TypeError out of tuple()
    ('int' object is not iterable), and ("1", "0") one of a comparison. Anything but a
    (major, minor) pair of ints raises InvalidArgumentType naming the expected form, before
    any stream wait."""
    arr = host_dlpack.empty((2,), np.float32)
    waited = stub_recorder.last_wait_stream()
    for bad in (1, 1.0, "1.0", (1,), (1, 0, 0), ("1", "0"), (1.0, 0), (True, 0)):
        with pytest.raises(InvalidArgumentType, match=r"max_version=.*expected a \(major, "
                                                      r"minor\) tuple of ints.*such as \(1, 0\)"):
            arr.__dlpack__(max_version=bad, stream=0x7000)
    assert stub_recorder.last_wait_stream() == waited
    assert _name(arr.__dlpack__(max_version=[1, 3])) == b"dltensor_versioned"
    assert _name(arr.__dlpack__(max_version=(np.int64(0), 8))) == b"dltensor"


def test_from_dlpack_of_an_interface_takes_and_honours_the_stream(host_dlpack, monkeypatch):
    """Found by a review: DeviceArray.from_dlpack(obj, stream=s) of an object without
    __dlpack__ (the CUDA array interface path) dropped s unchecked, so a str or a float
    went through, and a producer's interface stream was only synchronized with the default
    stream, not with s: a kernel on s could read the buffer before the producer's writes.
    s is read like a launcher's stream= now (InvalidArgumentType before the interface is
    read), and s waits (an event recorded on the producer's stream) for that stream."""
    dev = host_dlpack
    arr = dev.empty((4,), np.float32)
    calls = []
    real_call = dev.call

    def call(name, *args):
        if name in ("event_record", "stream_wait_event", "stream_synchronize"):
            calls.append((name, args[0] if name == "stream_wait_event" else args[-1]))
        return real_call(name, *args)

    monkeypatch.setattr(dev, "call", call)
    read = []

    class Producer:
        def __init__(self, stream):
            self.stream = stream

        @property
        def __cuda_array_interface__(self):
            read.append(self.stream)
            cai = dict(arr.__cuda_array_interface__)
            if self.stream is None:
                del cai["stream"]
            else:
                cai["stream"] = self.stream
            return cai

    for bad in ("x", 1.5, True):
        with pytest.raises(InvalidArgumentType, match="stream: expected a pagedkv Stream"):
            DeviceArray.from_dlpack(Producer(0x5000), dev, stream=bad)
    assert read == [] and calls == []
    s = Stream(dev)
    for producer, consumer, expected in (
            (0x5000, 0x77, [("event_record", 0x5000), ("stream_wait_event", 0x77)]),
            (1, 0x77, [("event_record", None), ("stream_wait_event", 0x77)]),
            (2, SimpleNamespace(cuda_stream=0x66),
             [("event_record", 2), ("stream_wait_event", 0x66)]),
            (0x5000, s, [("event_record", 0x5000), ("stream_wait_event", s.handle)]),
            (0x77, 0x77, []), (None, 0x77, []),
            (0x5000, None, [("stream_synchronize", 0x5000)]), (1, None, []), (2, 0, [])):
        view = DeviceArray.from_dlpack(Producer(producer), dev, stream=consumer)
        assert view.ptr == arr.ptr and calls == expected, (producer, consumer)
        calls.clear()
