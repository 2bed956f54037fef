"""Host-side contracts of pagedkv.kernels that need no GPU: DeviceArray's lifetime and the
reprs of the runtime handles, against a fake device that records every call."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pagedkv.errors import InvalidArgument
from pagedkv.kernels.device import Event, Graph, Stream
from pagedkv.kernels.device_array import DeviceArray


class FakeKernel:
    def __init__(self, device, name):
        self.device, self.name = device, name

    def __call__(self, grid, block, *args, stream=None, shared_bytes=0):
        self.device.calls.append(("launch", self.name, tuple(grid), tuple(block)))
        self.device.shared_bytes.append(shared_bytes)
        self.device.launch_args.append(args)

    def reserve_shared(self, nbytes):
        self.device.calls.append(("reserve_shared", self.name, nbytes))


class FakeDevice:
    ordinal = 0
    properties = SimpleNamespace(name="fake", warp_size=32)

    def kernel(self, source, name, signature, dependent_launch=False):
        return FakeKernel(self, name)

    def empty(self, shape, dtype):
        return DeviceArray.empty(self, shape, dtype)

    def array(self, host):
        return DeviceArray.from_numpy(self, host)

    def __init__(self):
        self.calls = []
        self.launch_args = []
        self.shared_bytes = []
        self.next_ptr = 0x1000

    def malloc(self, nbytes):
        self.calls.append(("malloc", nbytes))
        ptr = self.next_ptr = self.next_ptr + 0x1000
        self.next_ptr += -(-nbytes // 0x1000) * 0x1000  # allocations never overlap
        return ptr

    def free(self, ptr):
        self.calls.append(("free", ptr))

    def copy_htod(self, ptr, host):
        self.calls.append(("htod", ptr, host.nbytes))

    def copy_dtoh(self, host, ptr):
        self.calls.append(("dtoh", ptr, host.nbytes))

    def memset(self, ptr, value, nbytes):
        self.calls.append(("memset", ptr, value, nbytes))


def test_a_freed_array_refuses_every_transfer_and_says_so():
    dev = FakeDevice()
    a = DeviceArray.from_numpy(dev, np.arange(6, dtype=np.float32).reshape(2, 3))
    ptr = a.ptr
    assert repr(a) == f"DeviceArray(shape=(2, 3), dtype=float32, ptr=0x{ptr:x}, device='fake')"
    a.free()
    a.free()  # idempotent: freed once
    assert [c for c in dev.calls if c[0] == "free"] == [("free", ptr)]
    assert repr(a) == "DeviceArray(shape=(2, 3), dtype=float32, freed, device='fake')"
    before = list(dev.calls)
    for use in (a.to_numpy, lambda: a.copy_from(np.zeros((2, 3), np.float32)),
                lambda: a.fill_bytes(0xFF)):
        with pytest.raises(InvalidArgument, match=r"DeviceArray\(shape=\(2, 3\), "
                                                  r"dtype=float32\) was freed; allocate"):
            use()
    assert dev.calls == before  # nothing reached the runtime


def test_a_view_is_never_freed_and_its_repr_says_view():
    dev = FakeDevice()
    v = DeviceArray(dev, 0x5000, (4,), np.uint16, owned=False)
    assert repr(v) == "DeviceArray(shape=(4,), dtype=uint16, ptr=0x5000, view, device='fake')"
    v.free()
    assert dev.calls == []


def test_an_empty_array_needs_no_live_pointer():
    dev = FakeDevice()
    e = DeviceArray(dev, 0, (0, 8), np.float32)
    assert e.to_numpy().shape == (0, 8)


@pytest.mark.parametrize(("cls", "attrs", "text"), [
    (Stream, {"handle": 0xAB}, "Stream(handle=0xab, device=0)"),
    (Event, {"handle": None}, "Event(handle=0x0, device=0)"),
    (Graph, {"_exec": 0x10}, "Graph(exec=0x10, device=0)"),
])
def test_runtime_handles_have_reprs(cls, attrs, text):
    obj = cls.__new__(cls)
    obj.device = FakeDevice()
    for k, v in attrs.items():
        setattr(obj, k, v)
    assert repr(obj) == text


def test_a_kernel_refuses_a_freed_array_before_launch():
    from pagedkv.kernels.device import Kernel
    dev = FakeDevice()
    k = Kernel(dev, "copy", 0x1, "ppi")
    a = DeviceArray.empty(dev, (8,), np.float32)
    b = DeviceArray.empty(dev, (8,), np.float32)
    values, _ = k.pack((a, b, 8))
    assert [v.value for v in values] == [a.ptr, b.ptr, 8]
    b.free()
    with pytest.raises(InvalidArgument, match=r"DeviceArray\(shape=\(8,\), dtype=float32\) "
                                              r"was freed"):
        k.pack((a, b, 8))


def test_a_kernel_takes_a_tensor_map_by_value_and_refuses_anything_else():
    import ctypes

    from pagedkv.kernels.device import Kernel
    dev = FakeDevice()
    k = Kernel(dev, "tma", 0x1, "pmi")
    a = DeviceArray.empty(dev, (8,), np.float32)
    tmap = bytes(range(128))
    values, params = k.pack((a, tmap, 1))
    assert bytes(values[1]) == tmap and ctypes.sizeof(values[1]) == 128
    assert params[1] == ctypes.addressof(values[1])  # the launch reads the 128 bytes there
    for bad in (tmap[:64], list(tmap), 0):
        with pytest.raises(InvalidArgumentType, match=r"argument 1 must be a 128-byte tensor map"):
            k.pack((a, bad, 1))


# --- pagedkv.kernels.weights: the host-side checks run before any launch -----------------

from pagedkv.errors import InvalidArgumentType, UnknownQuantType, UnsupportedQuantType
from pagedkv.kernels import weights


def _launches(dev):
    return [c for c in dev.calls if c[0] == "launch"]


def test_formats_take_the_quant_spellings():
    assert weights.raw_nbytes("MQ4G256V2", 512) == weights.raw_nbytes(44, 512) == 2 * 136
    assert repr(weights.Gemv(FakeDevice(), 6, 4, 256)) == "Gemv('hfq4g256', M=4, K=256, batch=1)"
    with pytest.raises(InvalidArgument, match=r"fmt='hfq3g256': the GPU kernels take \["):
        weights.raw_nbytes("hfq3g256", 256)
    with pytest.raises(UnknownQuantType):
        weights.raw_nbytes("hfq5g999", 256)
    with pytest.raises(InvalidArgumentType):
        weights.raw_nbytes(4.0, 256)


@pytest.mark.parametrize(("m", "k", "batch", "message"), [
    (0, 256, 1, r"M=0, K=256: need M >= 1"), (4, 100, 1, r"K a positive multiple of 256"),
    (4, 256, 0, r"batch=0: expected 1\.\.8"), (4, 256, 9, r"batch=9")])
def test_gemv_geometry_is_checked_before_any_kernel_is_loaded(m, k, batch, message):
    dev = FakeDevice()
    with pytest.raises(InvalidArgument, match=message):
        weights.Gemv(dev, "hfq4g256", m, k, batch)
    assert dev.calls == []


def test_gemv_run_checks_sizes_shapes_and_alignment_before_launching():
    dev = FakeDevice()
    g = weights.Gemv(dev, "mq4g256v2", 4, 256, batch=2)
    w = dev.empty((4 * 136,), np.uint8)
    x, y = dev.empty((2, 256), np.float32), dev.empty((2, 4), np.float32)
    g.run(w, x, y)
    assert [c[1] for c in _launches(dev)] == ["pkv_fwht256_f32", "pkv_gemv_mq4g256v2_b2"]
    dev.calls.clear()
    cases = [
        ((dev.empty((4 * 136 - 1,), np.uint8), x, y), (r"raw: 543 bytes, mq4g256v2 of 1024 "
                                                       r"weights takes 544")),
        ((DeviceArray(dev, w.ptr + 4, w.shape, np.uint8, owned=False), x, y),
         r"not 8-byte aligned"),
        ((w, dev.empty((1, 256), np.float32), y), r"x: shape \(1, 256\), expected \(2, 256\)"),
        ((w, x, dev.empty((2, 4), np.float16)), r"y: dtype float16, expected float32"),
        ((w.to_numpy(), x, y), r"raw: expected a DeviceArray, got ndarray"),
    ]
    for args, message in cases:
        with pytest.raises((InvalidArgument, InvalidArgumentType), match=message):
            g.run(*args)
    assert _launches(dev) == []


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((True, 256, 1), {}, r"M=True: expected an int, got bool"),
    ((64.0, 256, 1), {}, r"M=64\.0: expected an int, got float"),
    ((64, 256.0, 1), {}, r"K=256\.0: expected an int, got float"),
    ((64, 256, True), {}, r"batch=True: expected an int, got bool"),
    ((64, 256, 2.0), {}, r"batch=2\.0: expected an int, got float"),
    ((64, 256, 1), {"warps": 2.0}, r"warps=2\.0: expected an int or None, got float"),
    ((64, 256, 16), {"splits": True}, r"splits=True: expected an int or None, got bool")])
def test_gemv_refuses_bool_and_float_sizes_before_any_kernel_is_loaded(args, kwargs, message):
    """A bool or float M, K, batch, warps or splits used to be accepted (True as 1; a float
    failed at the first launch, or in upload with a bare TypeError)."""
    for dev in (FakeDevice(), FakeCudaDevice()):
        with pytest.raises(InvalidArgumentType, match=message):
            weights.Gemv(dev, "hfq4g256", *args, **kwargs)
        assert dev.calls == []
    g = weights.Gemv(FakeCudaDevice(), "hfq4g256", np.int64(64), np.int32(256), np.uint8(2),
                     warps=np.int64(2))
    assert repr(g) == "Gemv('hfq4g256', M=64, K=256, batch=2, int8 tensor cores)"
    assert type(g.M) is type(g.K) is type(g.batch) is int


@pytest.mark.parametrize("batch", [1, 2])  # batch 1: the fused-x kernel; 2: prep + GEMV
def test_gemv_run_refuses_freed_and_overlapping_arrays_before_launching(batch):
    """A freed w or y used to be found by the GEMV launch, after the prep had launched (and
    overwritten the prepared x); a y overlapping x (which the f32 and fused-x kernels read
    while writing y) gave wrong sums."""
    for dev in (FakeDevice(), FakeCudaDevice()):
        g = weights.Gemv(dev, "hfq4g256", 64, 256, batch)
        w = weights.GemvWeights(dev.empty((g.weight_bytes,), np.uint8), "hfq4g256", 64, 256,
                                g.packed)
        x, y = dev.empty((batch, 256), np.float32), dev.empty((batch, 64), np.float32)
        g.run(w, x, y)
        dev.calls.clear()
        gone_w = weights.GemvWeights(dev.empty((g.weight_bytes,), np.uint8), "hfq4g256", 64,
                                     256, g.packed)
        gone_w.free()
        gone_y = dev.empty((batch, 64), np.float32)
        gone_y.free()
        inside_x = x.view((batch, 64))
        for args, message in [((gone_w, x, y), "was freed"), ((w, x, gone_y), "was freed"),
                              ((w, x, inside_x), "y overlaps x")]:
            with pytest.raises(InvalidArgument, match=message):
                g.run(*args)
        assert _launches(dev) == []


#: Shared bytes per block a kernel may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin).
OPTIN_SHARED = {"sm_90": 232448, "sm_80": 166912, "sm_86": 101376, "sm_75": 65536}


class FakeCudaDevice(FakeDevice):
    backend = "cuda"

    def __init__(self, arch="sm_90"):
        super().__init__()
        self.properties = SimpleNamespace(
            name="fake", warp_size=32, arch=arch, multiprocessor_count=132,
            max_shared_memory_per_block_bytes=49152,
            max_shared_memory_per_block_optin_bytes=OPTIN_SHARED[arch])


@pytest.mark.parametrize(("fmt", "batch", "kernel", "rotate"), [
    ("hfq4g256", 1, "pkv_gemv_mma_hfq4g256_n1", 0),
    ("mq4g256", 2, "pkv_gemv_mma_hfq4g256_n1", 1),  # HFQ4 bytes, x rotated in the prep
    ("mq4g256v2", 3, "pkv_gemv_mma_mq4g256v2_n2", 1),
    ("hfq4g256", 5, "pkv_gemv_mma_hfq4g256_n2", 0),
    ("mq4g256v2", 8, "pkv_gemv_mma_mq4g256v2_n3", 1),
    # batch 9-32: the staged kernel, n-tiles in whole chunks of 3 (6 up to 16 rows, 12 to 32)
    ("hfq4g256", 9, "pkv_gemv_mma_staged_hfq4g256_n6", 0),
    ("mq4g256v2", 16, "pkv_gemv_mma_staged_mq4g256v2_n6", 1),
    ("mq4g256", 17, "pkv_gemv_mma_staged_hfq4g256_n12", 1),
    ("mq4g256v2", 32, "pkv_gemv_mma_staged_mq4g256v2_n12", 1)])
def test_gemv_takes_the_tensor_core_kernel_on_sm80_and_newer(monkeypatch, fmt, batch, kernel,
                                                             rotate):
    monkeypatch.setenv("PAGEDKV_GEMV_PIPE", "0")  # batch 9-32: the staged kernel (A/B switch)
    monkeypatch.setenv("PAGEDKV_GEMV_F16X", "0")  # ... the exact int8 one
    monkeypatch.setenv("PAGEDKV_GEMV_FUSED_X", "0")  # batch 1: prep + GEMV (fused: its own test)
    dev = FakeCudaDevice()
    M, K = 37, 17 * 256
    g = weights.Gemv(dev, fmt, M, K, batch)
    assert g.tensor_cores and not g.pipe
    path = ", staged" if batch > 8 else ""
    assert repr(g) == f"Gemv('{fmt}', M=37, K=4352, batch={batch}, int8 tensor cores{path})"
    assert g.packed and g.weight_bytes == 48 * 17 * 136  # three 16-row tiles
    with pytest.raises(InvalidArgument, match=r"raw rows; the tensor-core GEMV reads "
                                              r"Gemv.upload\(raw\)"):
        g.run(dev.empty((g.weight_bytes,), np.uint8), dev.empty((batch, K), np.float32),
              dev.empty((batch, M), np.float32))
    assert _launches(dev) == []
    w = g.upload(np.zeros(M * 17 * 136, np.uint8))
    assert repr(w) == (f"GemvWeights('{fmt}', M=37, K=4352, packed 16-row tiles, "
                       f"{48 * 17 * 136} bytes)")
    x, y = dev.empty((batch, K), np.float32), dev.empty((batch, M), np.float32)
    g.run(w, x, y)
    # the prep: a warp per (group, batch row), 8 per block; then batch 1-8: 16 rows per
    # block and 8 warps splitting the 17 groups; batch 9-32 (staged): 8 tiles of 16 rows
    # per block (one row block here) and the 17 groups in 4 splits over blockIdx.y (5
    # groups per block in one wave of 132 SMs, against 17 unsplit)
    staged = batch > 8
    grid = (1, 4) if staged else (3,)
    assert [c[1:] for c in _launches(dev)] == [
        ("pkv_gemv_prep_x", (-(-17 * batch // 8),), (256,)), (kernel, grid, (256,))]
    tiles = -(-3 * batch // 8)
    tiles = tiles if tiles <= 3 else (6 if tiles <= 6 else 12)
    assert dev.launch_args[0][3:] == (K, batch, tiles, rotate)
    assert dev.launch_args[0][1].nbytes == 17 * tiles * 32 * 16 * 4  # the prepared-x scratch
    assert dev.launch_args[1][-3:] == (M, K, batch)
    if staged:  # partial[4 splits][batch][M] f32 and one zeroed counter per row block
        partial, counters = dev.launch_args[1][4:6]
        assert partial.nbytes == 4 * batch * M * 4 and counters.shape == (1,)
        assert counters.dtype == np.uint32 and not counters.to_numpy().any()
    else:
        assert len(dev.launch_args[1]) == 7
    dev.calls.clear()
    g.run(w, x, y, x_rotated=True)  # an x rotated beforehand is only quantized
    assert dev.launch_args[2][-1] == 0


@pytest.mark.parametrize(("fmt", "batch", "tiles", "shared"), [
    ("hfq4g256", 9, 6, 142080), ("mq4g256v2", 16, 6, 142080), ("mq4g256", 17, 9, 160896),
    ("hfq4g256", 24, 9, 160896), ("mq4g256v2", 25, 12, 179712), ("mq4g256v2", 32, 12, 179712)])
def test_gemv_batch_9_32_pipelined_kernel_when_opted_in(monkeypatch, fmt, batch, tiles, shared):
    monkeypatch.delenv("PAGEDKV_GEMV_PIPE", raising=False)
    default = weights.Gemv(FakeCudaDevice(), fmt, 37, 17 * 256, batch)
    assert not default.pipe  # opt-in: slower than the staged kernel on the H200 (docs/kernels.md)
    monkeypatch.setenv("PAGEDKV_GEMV_PIPE", "1")
    dev = FakeCudaDevice()
    M, K = 37, 17 * 256
    g = weights.Gemv(dev, fmt, M, K, batch)
    assert g.pipe and repr(g).endswith(", int8 tensor cores, pipelined)")
    name = f"pkv_gemv_mma_pipe_{weights.WEIGHT_FORMATS[fmt].kernel}_n{tiles}"
    # the ring (3 stages of x, sums and 16 tiles' weights) is reserved once, at construction:
    # 16 * 3 * (128 NT + 8 NT / 3 + 16 * 136) bytes
    assert shared == 16 * 3 * (128 * tiles + 8 * tiles // 3 + 16 * 136)
    assert weights.pipe_shared_bytes(tiles, 8) == shared
    assert [c for c in dev.calls if c[0] == "reserve_shared"] == [("reserve_shared", name, shared)]
    w = g.upload(np.zeros(M * 17 * 136, np.uint8))
    x, y = dev.empty((batch, K), np.float32), dev.empty((batch, M), np.float32)
    g.run(w, x, y)
    # one block of 8 warps x 2 tiles (256 rows) holds the 3 tiles; the 17 groups in 6 splits
    # (3 groups per block in one wave, the fewest splits that reach it; 8 at most)
    assert [c[1:] for c in _launches(dev)] == [
        ("pkv_gemv_prep_x", (-(-17 * batch // 8),), (256,)), (name, (1, 6), (256,))]
    assert dev.shared_bytes == [0, shared]
    assert dev.launch_args[0][3:] == (K, batch, tiles, int(g.fmt.rotated))  # n9: the prep's too
    assert dev.launch_args[0][1].nbytes == 17 * tiles * 32 * 16 * 4
    partial, counters = dev.launch_args[1][4:6]
    assert partial.nbytes == 6 * batch * M * 4 and counters.shape == (1,)
    assert not counters.to_numpy().any() and dev.launch_args[1][-3:] == (M, K, batch)


@pytest.mark.parametrize(("M", "K", "grid"), [
    (4096, 4096, (16, 8)), (14336, 4096, (56, 2)), (4096, 14336, (16, 8)), (6144, 4096, (24, 4))])
def test_pipelined_gemv_grid_fills_one_wave_of_132_sms(monkeypatch, M, K, grid):
    monkeypatch.setenv("PAGEDKV_GEMV_PIPE", "1")
    g = weights.Gemv(FakeCudaDevice(), "mq4g256v2", M, K, 32)
    assert g.pipe and g._grid == grid and g._block == (256,)
    assert grid[0] * grid[1] <= 132


def test_gemv_pipe_switches_and_limits(monkeypatch):
    monkeypatch.delenv("PAGEDKV_GEMV_PIPE", raising=False)
    M, K = 300, 2048
    staged = weights.Gemv(FakeCudaDevice(), "hfq4g256", M, K, 32, pipe=False)
    assert not staged.pipe and staged._kernel.name == "pkv_gemv_mma_staged_hfq4g256_n12"
    monkeypatch.setenv("PAGEDKV_GEMV_PIPE", "0")
    assert not weights.Gemv(FakeCudaDevice(), "hfq4g256", M, K, 32).pipe
    assert weights.Gemv(FakeCudaDevice(), "hfq4g256", M, K, 32, pipe=True).pipe  # beats the env
    monkeypatch.setenv("PAGEDKV_GEMV_PIPE", "1")
    # the same splits on both kernels (the GPU tests compare them byte for byte)
    for pipe in (False, True):
        g = weights.Gemv(FakeCudaDevice(), "hfq4g256", M, K, 32, pipe=pipe, splits=3)
        assert g._grid == ((2 if pipe else 3), 3)  # 19 tiles: 2 blocks of 16 or 3 of 8
    # sm_80 opts in to 163 KiB: n12's 175.5 KiB ring does not fit, n9's does; sm_86: none
    a100, ada = FakeCudaDevice("sm_80"), FakeCudaDevice("sm_86")
    assert not weights.Gemv(a100, "hfq4g256", M, K, 32).pipe
    assert weights.Gemv(a100, "hfq4g256", M, K, 24).pipe
    assert weights.Gemv(a100, "hfq4g256", M, K, 32, warps=4).pipe  # 8 tiles per block fit
    assert not weights.Gemv(ada, "hfq4g256", M, K, 9).pipe
    too_big = (r"pipe=True: the pipelined GEMV needs 179712 bytes of shared memory per block, "
               r"fake \(sm_80\) allows 166912; use fewer warps")
    h200 = FakeCudaDevice()
    for dev, kwargs, message in [
        (a100, {"batch": 32, "pipe": True}, too_big),
        (h200, {"batch": 8, "pipe": True}, r"pipe=True: the pipelined GEMV runs .* batch=8"),
        (h200, {"batch": 32, "splits": 9}, r"splits=9: expected 1\.\.8 \(the pipelined"),
        (h200, {"batch": 32, "pipe": False, "splits": 5}, r"splits=5: expected 1\.\.4 \(the st"),
        (h200, {"batch": 8, "splits": 2}, r"splits=2: expected"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            weights.Gemv(dev, "hfq4g256", M, K, **kwargs)
        assert _launches(dev) == []


@pytest.mark.parametrize("batch", [1, 8, 9, 32])
def test_gemv_f16_x_switch_kernel_grid_and_refusals(monkeypatch, batch):
    """f16_x=True: gemv_f16 with ceil(batch / 8) n-tiles, the prep's f16 layout (tiles 0:
    batch x 32 units of 16 bytes per group), blocks of 8 warps (4 above 4096 rows, 8 again
    and unsplit where 128-row blocks cover the SMs, as 4 warps of 2 tiles) x
    GEMV_F16_TILES_PER_WARP tiles, group
    splits up to 8; the env variable where f16_x is None; refused, before any launch, where
    there is no such kernel or with the pipelined one."""
    monkeypatch.delenv("PAGEDKV_GEMV_F16X", raising=False)
    M, K = 300, 2048
    dev = FakeCudaDevice()
    g = weights.Gemv(dev, "mq4g256v2", M, K, batch, f16_x=True)
    nt = -(-batch // 8)
    assert g.f16_x and not g.pipe and g.tensor_cores and g.packed
    tpw = weights.GEMV_F16_TILES_PER_WARP
    assert g._kernel.name == f"pkv_gemv_f16_mq4g256v2_n{nt}_t{tpw}"
    blocks = -(-19 // (8 * tpw))  # 19 tiles of 16 rows, 8 warps (M <= 4096)
    assert g._grid == (blocks, weights._staged_splits(blocks, 8, 132, 8)) and g._block == (256,)
    wide = weights.Gemv(dev, "mq4g256v2", 4352, K, batch, f16_x=True)  # M > 4096: 4 warps
    assert wide._block == (128,) and wide._grid[0] == -(-272 // (4 * tpw))
    # ... unless 128-row blocks alone cover the SMs (132 x 128 rows): no split;
    # explicit warps or splits are kept
    assert not weights.gemv_f16_fills_sms(1055, 132) and weights.gemv_f16_fills_sms(1056, 132)
    below = weights.Gemv(dev, "mq4g256v2", 16880, K, batch, f16_x=True)  # 1055 tiles
    assert below._block == (128,) and below._grid == (
        -(-1055 // (4 * tpw)), weights._staged_splits(-(-1055 // (4 * tpw)), 8, 132, 8))
    gate_up = weights.Gemv(dev, "mq4g256v2", 28672, 4096, batch, f16_x=True)  # 1792 tiles
    # 128-row blocks: 4 warps x 2 tiles
    assert gate_up._block == (128,) and gate_up._grid == (1792 // 8, 1)
    assert gate_up.launch == f"pkv_gemv_f16_mq4g256v2_n{nt}_t2 224x1 x 128"
    assert gate_up._split_args[0].shape == (1,)  # no partials to keep
    blocks4 = -(-1792 // (4 * tpw))
    assert weights._staged_splits(blocks4, 16, 132, 8) > 1  # what 4 warps would have split
    asked = weights.Gemv(dev, "mq4g256v2", 28672, 4096, batch, f16_x=True, warps=4)
    assert asked._block == (128,) and asked._grid == (
        blocks4, weights._staged_splits(blocks4, 16, 132, 8))
    split = weights.Gemv(dev, "mq4g256v2", 28672, 4096, batch, f16_x=True, splits=2)
    assert split._block == (128,) and split._grid == (224, 2)
    assert g._xq.shape == (8 * batch * 128,) and g.prepared_x().tiles == 0
    # its x ring in dynamic shared memory (the launch passes it): slots of 8 nt rows
    assert g._shared == weights.gemv_f16_shared_bytes(nt) == (
        weights.GEMV_F16_X_STAGES * 8 * nt * 33 * 16)
    assert repr(g) == f"Gemv('mq4g256v2', M=300, K=2048, batch={batch}, f16 x, tensor cores)"
    # the default above 8 batch rows, unless an int8 batch 9-32 kernel is asked for
    assert weights.Gemv(dev, "mq4g256v2", M, K, batch).f16_x == (batch > 8)
    assert not weights.Gemv(dev, "mq4g256v2", M, K, max(batch, 9), pipe=False).f16_x
    monkeypatch.setenv("PAGEDKV_GEMV_PIPE", "1")
    assert not weights.Gemv(dev, "mq4g256v2", M, K, max(batch, 9)).f16_x
    monkeypatch.delenv("PAGEDKV_GEMV_PIPE")
    monkeypatch.setenv("PAGEDKV_GEMV_F16X", "0")
    assert not weights.Gemv(dev, "hfq4g256", M, K, batch).f16_x
    monkeypatch.setenv("PAGEDKV_GEMV_F16X", "1")
    assert weights.Gemv(dev, "hfq4g256", M, K, batch).f16_x
    assert not weights.Gemv(dev, "hfq4g256", M, K, batch, f16_x=False).f16_x  # beats the env
    # where no f16 kernel exists the variable leaves the exact kernels in place
    assert not weights.Gemv(FakeCudaDevice("sm_75"), "hfq4g256", M, K, min(batch, 8)).f16_x
    assert not weights.Gemv(dev, "q8f16", M, K, min(batch, 8)).f16_x
    for dev2, fmt, kwargs, message in [
        (FakeCudaDevice("sm_75"), "hfq4g256", {}, (r"f16_x=True: the f16-activation GEMV runs "
         r"\['hfq4g256', 'mq4g256v2'\] on NVIDIA sm_80\+; this is hfq4g256 on sm_75")),
        (dev, "hfq6g256", {}, r"this is hfq6g256 on sm_90"),
        (dev, "hfq4g256", {"pipe": True}, r"pipe=True and f16_x=True"),
        (dev, "hfq4g256", {"splits": 9}, r"splits=9: expected 1\.\.8 \(the f16"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            weights.Gemv(dev2, fmt, M, K, min(batch, 8) if fmt != "hfq4g256" or
                         dev2 is not dev else batch, f16_x=True, **kwargs)
        assert _launches(dev2) == []


class _OptInDevice(FakeCudaDevice):
    def __init__(self, arch):
        super().__init__(arch)
        self.properties.name = "NVIDIA H200" if arch == "sm_90" else "NVIDIA A100"

    def make_current(self):
        self.calls.append(("make_current",))

    def call(self, name, *args):
        self.calls.append((name, *args))


def test_reserve_shared_opts_in_above_48_kib_and_names_the_device_limit():
    from pagedkv.kernels.device import Kernel
    h200 = _OptInDevice("sm_90")
    k = Kernel(h200, "pkv_gemv_mma_pipe_hfq4g256_n12", 0x77, "p")
    k.reserve_shared(40000)  # within the default 48 KiB: nothing to set
    assert h200.calls == []
    k.reserve_shared(179712)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
    assert h200.calls == [("make_current",), ("func_set_attribute", 0x77, 8, 179712)]
    a100 = _OptInDevice("sm_80")
    with pytest.raises(InvalidArgument, match=r"pkv_gemv_mma_pipe_hfq4g256_n12: 179712 bytes of "
                                              r"shared memory per block, NVIDIA A100 \(sm_80\) "
                                              r"allows at most 166912"):
        Kernel(a100, "pkv_gemv_mma_pipe_hfq4g256_n12", 0x77, "p").reserve_shared(179712)
    assert a100.calls == []


class FakeHipDevice(FakeDevice):
    backend = "hip"

    def __init__(self, arch="gfx90a"):
        super().__init__()
        self.properties = SimpleNamespace(name="fake", warp_size=64 if arch.startswith("gfx9") else 32,
                                          arch=arch)


@pytest.mark.parametrize("arch", ["gfx908", "gfx90a", "gfx940", "gfx942"])
@pytest.mark.parametrize(("fmt", "batch", "kernel", "warps"), [
    ("mq4g256", 1, "pkv_gemv_mma_hfq4g256_n1", 8),
    ("mq4g256v2", 8, "pkv_gemv_mma_mq4g256v2_n3", 2),
    ("hfq4g256", 32, "pkv_gemv_mma_tiled_hfq4g256_n12", 1)])
def test_gemv_takes_the_mfma_kernel_on_cdna_with_wavefronts_of_64(arch, fmt, batch, kernel,
                                                                  warps, monkeypatch):
    monkeypatch.setenv("PAGEDKV_GEMV_MFMA", "1")  # opt-in until an AMD device run
    # AMD CDNA runs gemv_amd_mc (MfmaI8) under the NVIDIA kernel names, on the same prepared x and
    # packed tiles; a block is `warps` wavefronts of 64 (docs/kernels.md, "AMD matrix cores")
    dev = FakeHipDevice(arch)
    M, K = 37, 17 * 256
    g = weights.Gemv(dev, fmt, M, K, batch, warps=warps)
    assert g.tensor_cores and g.packed and weights.max_batch(dev, fmt) == 32
    assert repr(g) == f"Gemv('{fmt}', M=37, K=4352, batch={batch}, int8 matrix cores)"
    w = g.upload(np.zeros(M * 17 * 136, np.uint8))
    g.run(w, dev.empty((batch, K), np.float32), dev.empty((batch, M), np.float32))
    assert [c[1:] for c in _launches(dev)] == [
        ("pkv_gemv_prep_x", (-(-17 * batch // 8),), (256,)), (kernel, (3,), (64 * warps,))]


@pytest.mark.parametrize("arch", ["gfx1100", "gfx1151", "gfx1152"])
@pytest.mark.parametrize(("fmt", "batch", "kernel", "warps"), [
    ("hfq4g256", 1, "pkv_gemv_mma_hfq4g256_n1", 8),
    ("mq4g256v2", 8, "pkv_gemv_mma_mq4g256v2_n3", 2),
    ("mq4g256", 32, "pkv_gemv_mma_tiled_hfq4g256_n12", 4)])
def test_gemv_takes_the_wmma_kernel_on_rdna3_with_wave32(arch, fmt, batch, kernel, warps,
                                                         monkeypatch):
    monkeypatch.setenv("PAGEDKV_GEMV_WMMA", "1")  # opt-in until an AMD device run
    monkeypatch.setenv("PAGEDKV_GEMV_MFMA", "0")  # the CDNA switch does not gate RDNA3
    # gfx11 runs gemv_amd_mc's WMMA build under the NVIDIA kernel names, on the same
    # prepared x and packed tiles; a block is `warps` waves of 32
    dev = FakeHipDevice(arch)
    M, K = 37, 17 * 256
    g = weights.Gemv(dev, fmt, M, K, batch, warps=warps)
    assert g.tensor_cores and g.packed and weights.max_batch(dev, fmt) == 32
    w = g.upload(np.zeros(M * 17 * 136, np.uint8))
    g.run(w, dev.empty((batch, K), np.float32), dev.empty((batch, M), np.float32))
    assert [c[1:] for c in _launches(dev)] == [
        ("pkv_gemv_prep_x", (-(-17 * batch // 8),), (256,)), (kernel, (3,), (32 * warps,))]


@pytest.mark.parametrize("arch", ["gfx1030", "gfx1100", "gfx1201", "gfx906", "gfx90a-off",
                                  "gfx942-default", "gfx1100-mfma", "gfx1201-wmma"])
def test_gemv_runs_the_cuda_core_kernel_on_amd_without_int8_matrix_cores(arch, monkeypatch):
    monkeypatch.delenv("PAGEDKV_GEMV_WMMA", raising=False)
    if arch.endswith("-off"):  # the switch that keeps never-run MFMA code off a CDNA GPU
        monkeypatch.setenv("PAGEDKV_GEMV_MFMA", "0")
    elif arch.endswith("-default"):  # and its default, until an AMD device run
        monkeypatch.delenv("PAGEDKV_GEMV_MFMA", raising=False)
    elif arch.endswith("-mfma"):  # the CDNA switch does not turn on WMMA
        monkeypatch.setenv("PAGEDKV_GEMV_MFMA", "1")
    elif arch.endswith("-wmma"):  # RDNA4's WMMA has other layouts: no kernel for it
        monkeypatch.setenv("PAGEDKV_GEMV_WMMA", "1")
    arch = arch.split("-")[0]
    dev = FakeHipDevice(arch)
    g = weights.Gemv(dev, "mq4g256v2", 16, 256, 8)
    assert not g.tensor_cores and not g.packed and weights.max_batch(dev, "hfq4g256") == 8
    assert repr(g) == "Gemv('mq4g256v2', M=16, K=256, batch=8)"
    with pytest.raises(InvalidArgument, match=r"batch=9: expected 1\.\.8"):
        weights.Gemv(dev, "hfq4g256", 16, 256, 9)


@pytest.mark.parametrize(("arch", "unit_env", "other_env"), [
    ("gfx90a", "PAGEDKV_GEMV_MFMA", "PAGEDKV_GEMV_WMMA"),
    ("gfx942", "PAGEDKV_GEMV_MFMA", "PAGEDKV_GEMV_WMMA"),
    ("gfx1100", "PAGEDKV_GEMV_WMMA", "PAGEDKV_GEMV_MFMA")])
@pytest.mark.parametrize(("fmt", "batch", "kernel", "warps"), [
    ("hfq6g256", 1, "pkv_gemv_mma_hfq6g256_n1", 4),
    ("q8f16", 5, "pkv_gemv_mma_q8f16_n2", 2),
    ("q8f16", 8, "pkv_gemv_mma_q8f16_n3", 1)])
def test_gemv_takes_the_amd_hfq6_q8f16_kernels_only_with_both_switches(
        arch, unit_env, other_env, fmt, batch, kernel, warps, monkeypatch):
    # gemv_amd_mc's HFQ6G256 / Q8F16 kernels (never run on an AMD GPU): the unit's opt-in and
    # the wide switch (wide_mma, or the variable when it is None) must both ask for them
    dev = FakeHipDevice(arch)
    M, K = 37, 4 * 256
    cases = [  # (unit opt-in, PAGEDKV_GEMV_MMA_HFQ6_Q8F16, wide_mma) -> matrix cores
        (("1", "1", None), True), (("1", None, True), True), (("1", "1", False), False),
        (("1", "0", None), False), (("0", "1", None), False), ((None, "1", None), False),
        # the variable unset: the NVIDIA default (both formats on), behind the unit's opt-in
        (("1", None, None), True), ((None, None, None), False)]
    for (unit_on, wide_on, wide_mma), want in cases:
        for name, value in ((unit_env, unit_on), (weights.WIDE_MMA_ENV, wide_on)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        monkeypatch.setenv(other_env, "1")  # the other unit's switch never gates this one
        g = weights.Gemv(dev, fmt, M, K, batch, warps=warps, wide_mma=wide_mma)
        assert (g.tensor_cores, g.packed) == (want, want), (unit_on, wide_on, wide_mma)
        # batch 9-32: the tiled n6 / n12 wherever batch 1-8 is on the matrix cores
        assert weights.max_batch(dev, fmt, wide_mma) == (32 if want else 8)
    monkeypatch.setenv(unit_env, "1")
    g = weights.Gemv(dev, fmt, M, K, batch, warps=warps, wide_mma=True)
    assert repr(g) == f"Gemv('{fmt}', M=37, K=1024, batch={batch}, int8 matrix cores)"
    raw = np.zeros(weights.raw_nbytes(fmt, M * K), np.uint8)
    # the NVIDIA kernels' packing (48 rows: 3 tiles), prepared x and launch: warps of the
    # device's wavefront size
    assert g.pack(raw).nbytes == g.weight_bytes == 48 * K // 256 * (200 if fmt == "hfq6g256"
                                                                    else 272)
    w = g.upload(raw)
    dev.calls.clear()
    g.run(w, dev.empty((batch, K), np.float32), dev.empty((batch, M), np.float32))
    assert [c[1:] for c in _launches(dev)] == [
        ("pkv_gemv_prep_x", (-(-4 * batch // 8),), (256,)),
        (kernel, (3,), (dev.properties.warp_size * warps,))]


def test_wide_mma_true_on_amd_is_refused_naming_what_is_missing(monkeypatch):
    monkeypatch.delenv("PAGEDKV_GEMV_MFMA", raising=False)
    monkeypatch.delenv("PAGEDKV_GEMV_WMMA", raising=False)
    monkeypatch.delenv(weights.WIDE_MMA_ENV, raising=False)
    # a matrix unit without its opt-in: the variable to set
    for arch, env in [("gfx90a", "PAGEDKV_GEMV_MFMA"), ("gfx1151", "PAGEDKV_GEMV_WMMA")]:
        with pytest.raises(InvalidArgument, match=rf"wide_mma=True: the (MFMA|WMMA) GEMV on "
                                                  rf"{arch} is opt-in until an AMD device run "
                                                  rf".*; set {env}=1$"):
            weights.Gemv(FakeHipDevice(arch), "q8f16", 64, 512, 4, wide_mma=True)
    # no kernel for the arch, a 4-bit format, K not whole 256-groups: where it runs
    monkeypatch.setenv("PAGEDKV_GEMV_MFMA", "1")
    monkeypatch.setenv("PAGEDKV_GEMV_WMMA", "1")
    for arch, fmt, K in [("gfx1030", "hfq6g256", 512), ("gfx1201", "q8f16", 512),
                         ("gfx90a", "hfq4g256", 512), ("gfx90a", "q8f16", 288)]:
        with pytest.raises(InvalidArgument, match=rf"wide_mma=True: the int8 tensor-core GEMV "
                                                  rf"runs \['hfq6g256', 'q8f16'\] with K a "
                                                  rf"multiple of 256 on NVIDIA sm_80\+, AMD "
                                                  rf"gfx908/gfx90a/gfx940-942 \(PAGEDKV_GEMV_MFMA"
                                                  rf"=1\) or gfx11 \(PAGEDKV_GEMV_WMMA=1\); "
                                                  rf"this is {fmt}, K={K} on {arch}$"):
            weights.Gemv(FakeHipDevice(arch), fmt, 64, K, 4, wide_mma=True)


def test_gemv_batch_limit_is_32_on_tensor_cores_and_8_elsewhere():
    cuda, old = FakeCudaDevice(), FakeCudaDevice("sm_75")
    assert [weights.max_batch(cuda, f) for f in ("mq4g256v2", "hfq6g256", "q8f16")] == [32] * 3
    assert weights.max_batch(cuda, "q8f16", wide_mma=False) == 8
    assert weights.max_batch(old, "hfq4g256") == 8 and weights.max_batch(old, "q8f16") == 8
    for dev, fmt, batch in [(cuda, "hfq4g256", 33), (cuda, "q8f16", 33), (old, "mq4g256", 9),
                            (old, "hfq6g256", 9)]:
        most = weights.max_batch(dev, fmt)
        with pytest.raises(InvalidArgument, match=rf"batch={batch}: expected 1\.\.{most} for "
                                                  rf"{fmt} on this device; split larger"):
            weights.Gemv(dev, fmt, 16, 256, batch)
        assert dev.calls == []


def test_gemv_prepared_x_serves_several_weights_and_is_required():
    dev = FakeCudaDevice()
    g = weights.Gemv(dev, "mq4g256v2", 4, 256)
    w1, w2 = (g.upload(np.zeros(4 * 136, np.uint8)) for _ in range(2))
    y = dev.empty((1, 4), np.float32)
    with pytest.raises(InvalidArgument, match=r"no prepared x; call prepare\(x\) first"):
        g.run_prepared(w1, y)
    assert _launches(dev) == []
    g.prepare(dev.empty((1, 256), np.float32))
    g.run_prepared(w1, y)
    g.run_prepared(w2, y)
    assert [c[1] for c in _launches(dev)] == ["pkv_gemv_prep_x", "pkv_gemv_mma_mq4g256v2_n1",
                                              "pkv_gemv_mma_mq4g256v2_n1"]
    assert _launches(dev)[1][3] == (32,)  # one group: one warp per block
    assert weights.Gemv(dev, "mq4g256v2", 4, 256, warps=8)._block == (256,)  # as asked
    with pytest.raises(InvalidArgument, match=r"warps=9: expected 1\.\.8"):
        weights.Gemv(dev, "mq4g256v2", 4, 256, warps=9)
    other = weights.Gemv(dev, "mq4g256v2", 8, 256)
    dev.calls.clear()
    for w, message in [(other.upload(np.zeros(8 * 136, np.uint8)), r"uploaded for another GEMV"),
                       (weights.GemvWeights(dev.empty((16 * 136,), np.float32), "mq4g256v2", 4,
                                            256, True), r"w: dtype float32, expected uint8")]:
        with pytest.raises(InvalidArgument, match=message):
            g.run_prepared(w, y)
    assert _launches(dev) == []


@pytest.mark.parametrize(("fmt", "batch", "kernel", "rotate"), [
    ("hfq4g256", 1, "pkv_gemv_mma_x_hfq4g256_n1", 0),
    ("mq4g256", 2, "pkv_gemv_mma_x_hfq4g256_n1", 1),  # HFQ4 bytes, x rotated in the warps
    ("mq4g256v2", 1, "pkv_gemv_mma_x_mq4g256v2_n1", 1),
    ("hfq6g256", 2, "pkv_gemv_mma_x_hfq6g256_n1", 0),
    ("q8f16", 1, "pkv_gemv_mma_x_q8f16_n1", 0)])
def test_gemv_fused_x_is_one_launch_on_the_gemv_grid(monkeypatch, fmt, batch, kernel, rotate):
    monkeypatch.delenv("PAGEDKV_GEMV_FUSED_X", raising=False)
    monkeypatch.delenv("PAGEDKV_GEMV_F16X", raising=False)
    for knob in ("GEMV_X_ROW_TILES", "GEMV_X_ROW_TILES_WIDE"):  # a tile per block
        monkeypatch.setattr(weights, knob, 1)
    dev = FakeCudaDevice()
    M, K = 37, 17 * 256
    two = weights.Gemv(dev, fmt, M, K, batch, fused_x=False)
    g = weights.Gemv(dev, fmt, M, K, batch, fused_x=True)
    assert g.fused_x and not two.fused_x
    assert repr(g) == f"Gemv('{fmt}', M=37, K=4352, batch={batch}, int8 tensor cores, fused x)"
    assert repr(two) == f"Gemv('{fmt}', M=37, K=4352, batch={batch}, int8 tensor cores)"
    raw = np.zeros(weights.raw_nbytes(fmt, M * K), np.uint8)
    w = g.upload(raw)
    x, y = dev.empty((batch, K), np.float32), dev.empty((batch, M), np.float32)
    two.run(two.upload(raw), x, y)
    dev.calls.clear()
    dev.launch_args.clear()
    g.run(w, x, y)
    # at a tile per block, the two-launch GEMV's grid and block; x and the
    # rotation switch in place of the scratch
    assert _launches(dev) == [("launch", kernel, two._grid, two._block)]
    assert g.fused_launch == f"{kernel} 3 x {two._block[0]}" and two.fused_launch is None
    assert dev.launch_args[0][1:] == (x, y, M, K, batch, rotate)
    assert dev.launch_args[0][0] is w.array
    g.run(w, x, y, x_rotated=True)
    assert dev.launch_args[1][-1] == 0
    # run() left no prepared x behind: run_prepared asks for prepare() again
    with pytest.raises(InvalidArgument, match=r"no prepared x; call prepare\(x\) first"):
        g.run_prepared(w, y)
    g.prepare(x)
    g.run_prepared(w, y)
    assert [c[1] for c in _launches(dev)[2:]] == ["pkv_gemv_prep_x", kernel.replace("_x_", "_")]


@pytest.mark.parametrize(("fmt", "knob"), [("hfq4g256", "GEMV_X_ROW_TILES"),
                                           ("mq4g256v2", "GEMV_X_ROW_TILES"),
                                           ("hfq6g256", "GEMV_X_ROW_TILES_WIDE"),
                                           ("q8f16", "GEMV_X_ROW_TILES_WIDE")])
def test_gemv_fused_x_grid_takes_the_row_tiles_of_its_format(monkeypatch, fmt, knob):
    # launch.h's PKV_GEMV_X_ROW_TILES(_WIDE): 16-row tiles per fused-x block
    monkeypatch.setattr(weights, knob, 2)
    dev = FakeCudaDevice()
    M, K = 37, 17 * 256  # 3 tiles: 2 blocks, the last of one tile
    assert weights.fused_x_grid(weights.WEIGHT_FORMATS[fmt].kernel, M, K) == (2, 8)
    # the two-launch kernel's warps (_mma_warps on the 16-row tiles: y keeps its bits), 4
    # for 896 tiles, 8 for 256, one per group at most
    assert weights.fused_x_grid(weights.WEIGHT_FORMATS[fmt].kernel, 14336, 4096) == (448, 4)
    assert weights.fused_x_grid(weights.WEIGHT_FORMATS[fmt].kernel, 4096, 4096) == (128, 8)
    assert weights.fused_x_grid(weights.WEIGHT_FORMATS[fmt].kernel, 4096, 256) == (128, 1)
    for rows, cols in ((14336, 4096), (4096, 14336), (37, 17 * 256), (28672, 4096)):
        assert weights.fused_x_grid(weights.WEIGHT_FORMATS[fmt].kernel, rows, cols)[1] == \
            weights._mma_warps(-(-rows // 16), cols // 256)
    assert weights.fused_x_grid(weights.WEIGHT_FORMATS[fmt].kernel, 14336, 4096, 4) == (448, 4)
    g = weights.Gemv(dev, fmt, M, K, 1, fused_x=True)
    raw = np.zeros(weights.raw_nbytes(fmt, M * K), np.uint8)
    w = g.upload(raw)
    dev.calls.clear()
    g.run(w, dev.empty((1, K), np.float32), dev.empty((1, M), np.float32))
    assert _launches(dev) == [("launch", f"pkv_gemv_mma_x_{weights.WEIGHT_FORMATS[fmt].kernel}_n1",
                               (2,), (256,))]
    assert g._grid == (3,)  # run_prepared's unfused kernel keeps a tile per block
    other = "GEMV_X_ROW_TILES_WIDE" if knob == "GEMV_X_ROW_TILES" else "GEMV_X_ROW_TILES"
    monkeypatch.setattr(weights, knob, 1)
    monkeypatch.setattr(weights, other, 2)  # the other family's knob leaves this one alone
    assert weights.fused_x_grid(weights.WEIGHT_FORMATS[fmt].kernel, M, K) == (3, 8)


def test_gemv_fused_x_switch_env_and_refusals(monkeypatch):
    dev = FakeCudaDevice()
    monkeypatch.delenv("PAGEDKV_GEMV_F16X", raising=False)
    monkeypatch.setenv("PAGEDKV_GEMV_FUSED_X", "1")
    assert weights.Gemv(dev, "hfq4g256", 16, 256, 2).fused_x
    assert not weights.Gemv(dev, "hfq4g256", 16, 256, 3).fused_x  # two n-tiles: none fused
    assert not weights.Gemv(dev, "hfq4g256", 16, 256, 1, f16_x=True).fused_x
    assert not weights.Gemv(dev, "hfq4g256", 16, 256, 1, fused_x=False).fused_x
    monkeypatch.setenv("PAGEDKV_GEMV_FUSED_X", "0")
    assert not weights.Gemv(dev, "hfq4g256", 16, 256, 1).fused_x
    monkeypatch.delenv("PAGEDKV_GEMV_FUSED_X")
    # unset: batch 1 of HFQ4G256 / HFQ6G256 / Q8F16 (x not rotated), measured faster in one
    # launch
    assert [weights.Gemv(dev, fmt, 16, 256, batch).fused_x for fmt, batch in [
        ("hfq4g256", 1), ("hfq6g256", 1), ("hfq4g256", 2), ("q8f16", 1), ("mq4g256", 1),
        ("mq4g256v2", 1), ("q8f16", 2)]] == [True, True, False, True, False, False, False]
    dev.calls.clear()
    for kw, where in [({"batch": 3}, r"this is batch=3 of hfq4g256 on sm_90"),
                      ({"batch": 1, "f16_x": True}, r"on sm_90, f16_x")]:
        with pytest.raises(InvalidArgument, match=r"fused_x=True: the fused-x GEMV runs the "
                                                  r"int8 tensor-core kernel at batch 1-2 .*" + where):
            weights.Gemv(dev, "hfq4g256", 16, 256, fused_x=True, **kw)
    with pytest.raises(InvalidArgument, match=r"fused_x=True: .* on sm_75"):
        weights.Gemv(FakeCudaDevice("sm_75"), "hfq4g256", 16, 256, fused_x=True)
    assert dev.calls == []


def _expected_pack(raw, M, groups, B=136):
    """The tensor-core GEMV's tile layout, written out byte by byte (weights.hip)."""
    tiles = -(-M // 16)
    rows = raw.reshape(M, groups, B)
    want = np.zeros(tiles * 16 * groups * B, np.uint8)
    for row in range(M):  # padding rows past M stay zero groups
        for grp in range(groups):
            base = ((row // 16) * groups + grp) * 16 * B
            r = row % 16
            want[base + 8 * r:base + 8 * r + 8] = rows[row, grp, :8]
            gid, rr = r % 8, r // 8
            for chunk in range(16):  # chunk 4j + t -> load 2 rr + j // 2 of lane 4 gid + t
                j, t = divmod(chunk, 4)
                at = base + 128 + 16 * (32 * (2 * rr + j // 2) + 4 * gid + t) + 8 * (j % 2)
                want[at:at + 8] = rows[row, grp, 8 + 8 * chunk:16 + 8 * chunk]
    return want


@pytest.mark.parametrize("M", [21, 32])  # a padded last tile; whole tiles
def test_gemv_pack_puts_every_byte_where_the_packed_kernel_loads_it(M):
    K, B = 512, 136
    raw = np.random.default_rng(M).integers(0, 256, M * K // 256 * B, dtype=np.uint8)
    g = weights.Gemv(FakeCudaDevice(), "hfq4g256", M, K)
    packed = g.pack(raw)
    assert packed.dtype == np.uint8 and packed.size == g.weight_bytes == 32 * 2 * B
    want = _expected_pack(raw, M, 2)
    np.testing.assert_array_equal(packed, want)
    unaligned = np.empty(raw.size + 1, np.uint8)[1:]  # words are copied out first
    unaligned[:] = raw
    np.testing.assert_array_equal(g.pack(unaligned), want)
    size = M * 2 * B
    with pytest.raises(InvalidArgument, match=rf"raw: uint8\[100\], expected uint8\[{size}\]"):
        g.pack(raw[:100])
    f32 = weights.Gemv(FakeDevice(), "hfq4g256", M, K)  # the f32 kernel reads raw rows
    assert not f32.packed
    np.testing.assert_array_equal(f32.pack(raw), raw)


@pytest.mark.parametrize(("arch", "fmt", "kw"), [
    ("sm_75", "hfq4g256", {}), ("sm_75", "hfq6g256", {}),  # below sm_80: HFQ6's default too
    ("sm_90", "hfq6g256", {"wide_mma": False}), ("sm_90", "q8f16", {"wide_mma": False})])
def test_gemv_keeps_the_f32_kernel_below_sm80_and_for_other_formats(arch, fmt, kw, monkeypatch):
    monkeypatch.delenv(weights.WIDE_MMA_ENV, raising=False)
    dev = FakeCudaDevice(arch)
    g = weights.Gemv(dev, fmt, 4, 256, **kw)
    assert not g.tensor_cores
    g.run(dev.empty((weights.raw_nbytes(fmt, 1024),), np.uint8), dev.empty((1, 256), np.float32),
          dev.empty((1, 4), np.float32))
    assert [c[1] for c in _launches(dev)] == [f"pkv_gemv_{fmt}_b1"]


def test_dequantize_and_fwht_check_before_launching():
    dev = FakeDevice()
    raw = dev.empty((136,), np.uint8)
    with pytest.raises(InvalidArgument, match=r"out: dtype float64, expected float32"):
        weights.dequantize(dev, raw, "hfq4g256", dev.empty((256,), np.float64))
    with pytest.raises(InvalidArgument, match=r"x/out: sizes 255/255, expected equal"):
        weights.fwht256(dev, dev.empty((255,), np.float32), dev.empty((255,), np.float32))
    weights.dequantize(dev, dev.empty((0,), np.uint8), "hfq4g256",
                       dev.empty((0,), np.float32))  # nothing to decode: no launch
    assert _launches(dev) == []
    weights.dequantize(dev, raw, "HFQ4G256", dev.empty((256,), np.float16))
    assert [c[1] for c in _launches(dev)] == ["pkv_dequant_hfq4g256_f16"]


@pytest.mark.parametrize(("fmt", "kernel", "shape", "nbytes"), [
    ("hfp4g32", "hfp4", (3, 96), 3 * (16 + 17 * 3)),
    ("mfp4g32", "hfp4", (2, 256), 2 * (16 + 17 * 8)),
    ("mfp4g32p", "mfp4p", (2, 256), 2 * (16 + 17 * 8)),
    ("mq2g256gl", "gl2", (2, 256), 2 * 66), ("mq3g256gl", "gl3", (1, 512), 2 * 98),
    ("mq8g256", "mq8", (1, 300), 2 * 258), ("q8hfq", "q8hfq", (2, 160), 2 * 256),
    ("q4f16g64", "q4f16g64", (1, 100), 2 * 36), ("q4k", "q4k", (1, 256), 144),
    ("tq2g128", "tq2", (3, 100), 3 * 34), ("bq1g128", "bq1", (1, 128), 18)])
def test_dequantize_dispatches_the_p2_formats(fmt, kernel, shape, nbytes):
    # the P2 kernels take (raw, out, n, K): K from out's last dimension, the payload size
    # from pagedkv.quant's register rule (rows for FP4/Q8HFQ)
    dev = FakeDevice()
    n = shape[0] * shape[1]
    weights.dequantize(dev, dev.empty((nbytes,), np.uint8), fmt, dev.empty(shape, np.float16))
    per_block = weights.DEQUANT_SPAN * weights.DEQUANT_THREADS
    assert [c[1:] for c in _launches(dev)] == [(f"pkv_dequant_{kernel}_f16", (-(-n // per_block),),
                                                (weights.DEQUANT_THREADS,))]
    assert dev.launch_args[-1][2:] == (n, shape[1])
    with pytest.raises(InvalidArgument, match=f"{nbytes + 1}"):
        weights.dequantize(dev, dev.empty((nbytes + 1,), np.uint8), fmt,
                           dev.empty(shape, np.float32))
    assert len(_launches(dev)) == 1


def test_dequantize_refuses_p2_shapes_before_launching():
    dev = FakeDevice()
    with pytest.raises(InvalidArgument, match="multiple of 256"):      # MFP4: K % 256
        weights.dequantize(dev, dev.empty((2 * 67,), np.uint8), "mfp4g32",
                           dev.empty((2, 32 * 3), np.float32))
    with pytest.raises(InvalidArgument, match="multiple of 32"):       # Q8HFQ: K % 32
        weights.dequantize(dev, dev.empty((128,), np.uint8), "q8hfq", dev.empty((1, 40), np.float32))
    with pytest.raises(InvalidArgument, match="multiple of 256"):      # GL: whole groups
        weights.dequantize(dev, dev.empty((66,), np.uint8), "mq2g256gl",
                           dev.empty((200,), np.float32))
    with pytest.raises(UnsupportedQuantType):
        weights.dequantize(dev, dev.empty((16,), np.uint8), 28, dev.empty((1, 128), np.float32))
    assert _launches(dev) == []


# --- the KV q8 launchers' host-side checks (no GPU: the fake device records the launch) ---

def _q8_args(dev, *, n=3, kvh=2, hd=64, dtype=np.float32, num_blocks=2, block_size=4):
    rows = dev.empty((n, kvh, hd), dtype)
    slots = dev.array(np.arange(n, dtype=np.int64))
    pool = dev.empty((num_blocks, block_size, kvh, hd // 32 * 34), np.uint8)
    return rows, slots, pool


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("dtype,suffix", [(np.float32, "f32"), (np.float16, "f16")])
def test_kv_q8_launchers_pick_the_kernel_and_grid(op, dtype, suffix):
    from pagedkv.kernels import kvcache
    dev = FakeDevice()
    rows, slots, pool = _q8_args(dev, dtype=dtype)
    dev.calls.clear()
    if op == "write":
        kvcache.kv_q8_write(dev, rows, slots, pool)
    else:
        kvcache.kv_q8_read(dev, pool, slots, rows)
    # 3 tokens x 2 heads x 64 values = 384 lanes -> 2 blocks of 256
    assert dev.calls == [("launch", f"pkv_kv_q8_{op}_{suffix}", (2,), (256,))]


@pytest.mark.parametrize("op", ["write", "read"])
def test_kv_q8_launchers_reject_bad_arguments_before_launching(op):
    from pagedkv.errors import InvalidArgumentType
    from pagedkv.kernels import kvcache
    dev = FakeDevice()
    name = "src" if op == "write" else "out"

    def call(rows, slots, pool):
        if op == "write":
            kvcache.kv_q8_write(dev, rows, slots, pool)
        else:
            kvcache.kv_q8_read(dev, pool, slots, rows)

    rows, slots, pool = _q8_args(dev)
    cases = [
        ((dev.empty((3, 2, 64), np.float64), slots, pool), InvalidArgument,
         f"{name}: float64[3, 2, 64], expected float32 or float16 [n, kv_heads, head_dim]"),
        ((rows, dev.array(np.arange(3, dtype=np.int32)), pool), InvalidArgument,
         "slots: dtype int32, expected int64"),
        ((rows, np.arange(3, dtype=np.int64), pool), InvalidArgumentType,
         "slots: expected a DeviceArray, got ndarray"),
        ((rows, slots, dev.empty((2, 4, 2, 68), np.float16)), InvalidArgument,
         "pool: dtype float16, expected uint8"),
        ((dev.empty((3, 2, 48), np.float32), slots, pool), InvalidArgument,
         "head_dim=48: q8 KV needs a multiple of 32"),
        ((rows, slots, dev.empty((2, 4, 2, 64), np.uint8)), InvalidArgument,
         ("pool: shape (2, 4, 2, 64), expected [num_blocks, block_size, 2, 68] for q8 at "
          f"kv_heads 2, head_dim 64 (those of {name} float32[3, 2, 64])")),
        ((rows, dev.array(np.arange(2, dtype=np.int64)), pool), InvalidArgument,
         "slots: length 2, expected 3 (one per token)"),
    ]
    dev.calls.clear()
    for args, exc, message in cases:
        with pytest.raises(exc) as info:
            call(*args)
        assert str(info.value) == message
    assert not [c for c in dev.calls if c[0] == "launch"]
    # no tokens: nothing to launch
    empty_rows, empty_slots, _ = _q8_args(dev, n=0)
    call(empty_rows, empty_slots, pool)
    assert not [c for c in dev.calls if c[0] == "launch"]


def test_gemv_pack_module_refuses_rows_of_another_width():
    from pagedkv.kernels.gemv_pack import pack_tiles_4bit
    with pytest.raises(InvalidArgument, match=r"rows: 33 words per row, expected 34 for 2 groups"):
        pack_tiles_4bit(np.zeros((16, 33), np.uint64), 2)
    assert pack_tiles_4bit(np.zeros((0, 34), np.uint64), 2).size == 0  # no rows: no tiles


# --- paged attention over compressed KV: kernel choice and host checks (fake device) ---

def _attn(dev, kv_dtype, *, heads=8, kv_heads=2, head_dim=256, seqs=3, max_seq_len=1100):
    from pagedkv.kernels import kvcache
    return kvcache.PagedAttention(dev, num_seqs=seqs, num_heads=heads, kv_heads=kv_heads,
                                  head_dim=head_dim, block_size=16, max_seq_len=max_seq_len,
                                  kv_dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype,head_dim,heads,k_row,v_row,partition,reduce,threads", [
    ("fwht4/lloyd4", 256, 8, 132, 132, "pkv_paged_attention_fwht4_lloyd4_mma_g4",
     "pkv_paged_attention_reduce_ifwht256", 256),
    ("fwht3/lloyd2", 256, 2, 100, 68, "pkv_paged_attention_fwht3_lloyd2_g1",
     "pkv_paged_attention_reduce_ifwht256", 256),
    ("fwht4/q8", 128, 16, 68, 136, "pkv_paged_attention_fwht4_q8_mma_g8",
     "pkv_paged_attention_reduce", 96),
    ("fwht2/q8", 128, 6, 36, 136, "pkv_paged_attention_fwht2_q8_mma_g4",
     "pkv_paged_attention_reduce", 96),
    ("lloyd4/q8", 256, 4, 132, 272, "pkv_paged_attention_lloyd4_q8_mma_g2",
     "pkv_paged_attention_reduce", 96),
    ("lloyd3/lloyd2", 256, 8, 100, 68, "pkv_paged_attention_fwht3_lloyd2_g4",
     "pkv_paged_attention_reduce_ifwht256", 256),
    # pagedkv's fwht V: R128 per half, rotated back by the ifwht128 reduce (a warp per
    # partition slice, at least head_dim threads); an fwht3 V runs lloyd3's kernels. 4/2-bit K with a q8/4/2-bit V: the _mma
    # kernels by default (PAGEDKV_ATTN_QKV_MMA unset), 3-bit codes the CUDA-core ones
    ("fwht4/fwht4", 128, 8, 68, 68, "pkv_paged_attention_fwht4_fwht4_mma_g4",
     "pkv_paged_attention_reduce_ifwht128", 128),
    ("fwht2/fwht4", 128, 2, 36, 68, "pkv_paged_attention_fwht2_fwht4_mma_g1",
     "pkv_paged_attention_reduce_ifwht128", 128),
    ("lloyd4/fwht2", 256, 16, 132, 68, "pkv_paged_attention_lloyd4_fwht2_mma_g8",
     "pkv_paged_attention_reduce_ifwht128", 256),
    ("lloyd3/fwht3", 256, 4, 100, 100, "pkv_paged_attention_fwht3_lloyd3_g2",
     "pkv_paged_attention_reduce_ifwht256", 256),
])
def test_compressed_attention_picks_its_kernels_and_reads_records(kv_dtype, head_dim, heads,
                                                                  k_row, v_row, partition,
                                                                  reduce, threads):
    dev = FakeDevice()
    attn = _attn(dev, kv_dtype, heads=heads, head_dim=head_dim)
    assert (attn.k_row, attn.v_row, attn.partition_tokens, attn.max_partitions) == \
        (k_row, v_row, 512, 3)
    q = dev.empty((3, heads, head_dim), np.float32)
    k_pool = dev.empty((40, 16, 2, k_row), np.uint8)
    v_pool = dev.empty((40, 16, 2, v_row), np.uint8)
    tables = dev.array(np.zeros((3, 69), np.int32))
    lens = dev.array(np.zeros(3, np.int32))
    dev.calls.clear()
    attn.run(q, k_pool, v_pool, tables, lens, dev.empty((3, heads, head_dim), np.float32))
    launches = [c for c in dev.calls if c[0] == "launch"]
    assert launches == [("launch", partition, (3, 2, 3), (128,)),
                        ("launch", reduce, (heads, 3), (threads,))]
    # the scalar argument block: scale, heads, kv_heads, head_dim, block_size, width, parts,
    # tokens per partition (the fake device has no SM count: never split)
    assert dev.launch_args[-2][8:] == (head_dim ** -0.5, heads, 2, head_dim, 16, 69, 3, 512)
    # dynamic shared memory: the scores of a partition, or the per-warp sums if larger
    gmax = 1 << (heads // 2 - 1).bit_length()
    assert dev.shared_bytes[-2] == 4 * max(512 * gmax, 4 * gmax * head_dim)


def test_compressed_attention_refuses_what_it_cannot_read_before_launching():
    dev = FakeDevice()
    with pytest.raises(InvalidArgument, match="lloyd4 \\(of kv_dtype 'fwht4/lloyd4'\\) needs "
                                              "head_dim 256"):
        _attn(dev, "fwht4/lloyd4", head_dim=128)
    with pytest.raises(InvalidArgument, match="fwht3 \\(of kv_dtype 'fwht3/q8'\\) needs"):
        _attn(dev, "fwht3/q8", head_dim=128)
    with pytest.raises(InvalidArgument, match="kv_dtype='q8/lloyd4'"):
        _attn(dev, "q8/lloyd4")
    attn = _attn(dev, "fwht4/q8")
    q = dev.empty((3, 8, 256), np.float32)
    good_k, good_v = dev.empty((4, 16, 2, 132), np.uint8), dev.empty((4, 16, 2, 272), np.uint8)
    tables = dev.array(np.zeros((3, 4), np.int32))
    lens = dev.array(np.zeros(3, np.int32))
    dev.calls.clear()
    for k_pool, v_pool, message in [
            (good_v, good_v, "k_pool: shape (4, 16, 2, 272), expected [num_blocks, 16, 2, 132]"),
            (good_k, good_k, "v_pool: shape (4, 16, 2, 132), expected [num_blocks, 16, 2, 272]"),
            (dev.empty((4, 16, 2, 132), np.float16), good_v,
             "k_pool: expected a fwht4/q8 pool DeviceArray")]:
        with pytest.raises(InvalidArgument) as info:
            attn.run(q, k_pool, v_pool, tables, lens, q)
        assert str(info.value) == message
    assert not [c for c in dev.calls if c[0] == "launch"]


def _set_env(monkeypatch, name, value):
    """``name`` set to ``value``, or unset for None."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


def _q8_attention_launches(dev, attn, seqs, heads, head_dim, num_blocks, width):
    """Run ``attn`` once on empty q8 pools (all sequences of length 0) and return its
    launches (name, grid, block)."""
    q = dev.empty((seqs, heads, head_dim), np.float32)
    pool = dev.empty((num_blocks, 16, 2, head_dim // 32 * 34), np.uint8)
    dev.calls.clear()
    attn.run(q, pool, pool, dev.array(np.zeros((seqs, width), np.int32)),
             dev.array(np.zeros(seqs, np.int32)), dev.empty((seqs, heads, head_dim), np.float32))
    return [c for c in dev.calls if c[0] == "launch"]


@pytest.mark.parametrize("q8_mma,env,kernel", [
    (None, None, "pkv_paged_attention_q8_g4"),       # default: the tensor-core q8 kernel
    (None, "0", "pkv_paged_attention_q8cc_g4"),      # PAGEDKV_ATTN_Q8_MMA=0: CUDA cores
    (None, "off", "pkv_paged_attention_q8cc_g4"),
    (None, "1", "pkv_paged_attention_q8_g4"),
    (None, "maybe", "pkv_paged_attention_q8_g4"),    # unparseable: ignored (a warning)
    (False, "1", "pkv_paged_attention_q8cc_g4"),     # the argument wins over the env
    (True, "0", "pkv_paged_attention_q8_g4"),
])
def test_q8_attention_path_is_selectable(monkeypatch, q8_mma, env, kernel):
    from pagedkv.kernels import kvcache
    monkeypatch.setenv("PAGEDKV_ATTN_Q8_STAGE", "0")  # the staged variant: the test below
    _set_env(monkeypatch, "PAGEDKV_ATTN_Q8_MMA", env)
    dev = FakeDevice()
    attn = kvcache.PagedAttention(dev, num_seqs=2, num_heads=8, kv_heads=2, head_dim=128,
                                  block_size=16, max_seq_len=1100, kv_dtype="q8",
                                  q8_mma=q8_mma)
    mma = kernel.endswith("q8_g4")
    assert repr(attn).endswith(f"kv_dtype='q8', partitions=3x512, q8_mma={mma}, q8_stage=False)")
    launches = _q8_attention_launches(dev, attn, 2, 8, 128, 10, 69)
    # both q8 kernels share the partition (512 tokens), grid, threads and shared memory
    assert launches == [("launch", kernel, (3, 2, 2), (128,)),
                        ("launch", "pkv_paged_attention_reduce", (8, 2), (96,))]
    assert dev.shared_bytes[-2] == 4 * max(512 * 4, 4 * 4 * 128)


@pytest.mark.parametrize("q8_mma,q8_stage,env,kernel", [
    (None, None, None, "pkv_paged_attention_q8s_g2"),    # default: staged (1.18x on the H200)
    (None, None, "1", "pkv_paged_attention_q8s_g2"),     # PAGEDKV_ATTN_Q8_STAGE=1
    (None, None, "0", "pkv_paged_attention_q8_g2"),
    (None, True, None, "pkv_paged_attention_q8s_g2"),
    (None, False, "1", "pkv_paged_attention_q8_g2"),     # the argument wins over the env
    (False, True, "1", "pkv_paged_attention_q8cc_g2"),   # staging is of the mma path only
])
def test_q8_staged_attention_path_is_selectable(monkeypatch, q8_mma, q8_stage, env, kernel):
    from pagedkv.kernels import kvcache
    monkeypatch.delenv("PAGEDKV_ATTN_Q8_MMA", raising=False)
    _set_env(monkeypatch, "PAGEDKV_ATTN_Q8_STAGE", env)
    dev = FakeDevice()
    attn = kvcache.PagedAttention(dev, num_seqs=1, num_heads=4, kv_heads=2, head_dim=64,
                                  block_size=16, max_seq_len=600, kv_dtype="q8",
                                  q8_mma=q8_mma, q8_stage=q8_stage)
    staged = kernel.startswith("pkv_paged_attention_q8s")
    assert attn._partition.name == kernel and attn.q8_stage is staged
    assert repr(attn).endswith(f"q8_mma={q8_mma is not False}, q8_stage={staged})")
    launches = _q8_attention_launches(dev, attn, 1, 4, 64, 40, 38)
    # the same partition (512 tokens), grid, threads and dynamic shared memory as q8
    assert launches == [("launch", kernel, (2, 2, 1), (128,)),
                        ("launch", "pkv_paged_attention_reduce", (4, 1), (64,))]  # 2 warps


@pytest.mark.parametrize("kv_dtype,qkv_mma,env,kernel", [
    ("fwht4/lloyd4", None, None, "pkv_paged_attention_fwht4_lloyd4_mma_g2"),  # default: mma
    ("fwht4/q8", None, "1", "pkv_paged_attention_fwht4_q8_mma_g2"),
    ("fwht2/fwht4", None, "0", "pkv_paged_attention_fwht2_fwht4_g2"),  # PAGEDKV_ATTN_QKV_MMA=0
    ("fwht4/fwht2", True, "0", "pkv_paged_attention_fwht4_fwht2_mma_g2"),  # argument wins
    ("lloyd2/q8", False, None, "pkv_paged_attention_lloyd2_q8_g2"),
    ("fwht3/lloyd4", None, None, "pkv_paged_attention_fwht3_lloyd4_g2"),  # 3-bit: no _mma
    ("fwht4/lloyd3", True, None, "pkv_paged_attention_fwht4_lloyd3_g2"),
    ("fwht4/fwht3", None, None, "pkv_paged_attention_fwht4_lloyd3_g2"),  # fwht3 V: lloyd3's
])
def test_compressed_attention_tensor_core_path_is_selectable(monkeypatch, kv_dtype, qkv_mma,
                                                              env, kernel):
    from pagedkv.kernels import kvcache
    from pagedkv.quant import kv as kv_modes
    if env is None:
        monkeypatch.delenv("PAGEDKV_ATTN_QKV_MMA", raising=False)
    else:
        monkeypatch.setenv("PAGEDKV_ATTN_QKV_MMA", env)
    dev = FakeDevice()
    attn = kvcache.PagedAttention(dev, num_seqs=1, num_heads=4, kv_heads=2, head_dim=256,
                                  block_size=16, max_seq_len=600, kv_dtype=kv_dtype,
                                  qkv_mma=qkv_mma)
    mma = kernel.split("_g")[0].endswith("_mma")
    has_mma = kvcache.qkv_mma_applies(kv_dtype)
    assert attn._partition.name == kernel and attn.qkv_mma == (mma if has_mma else None)
    assert repr(attn).endswith(f", qkv_mma={mma})" if has_mma else "partitions=2x512)")
    q = dev.empty((1, 4, 256), np.float32)
    k_side, v_side = kv_modes.split_kv_dtype(kv_dtype)
    k_pool = dev.empty((40, 16, 2, kv_modes.side_row_bytes(k_side, 256)), np.uint8)
    v_pool = dev.empty((40, 16, 2, kv_modes.side_row_bytes(v_side, 256)), np.uint8)
    dev.calls.clear()
    attn.run(q, k_pool, v_pool, dev.array(np.zeros((1, 38), np.int32)),
             dev.array(np.zeros(1, np.int32)), dev.empty((1, 4, 256), np.float32))
    # either kernel: the same partition (512 tokens), grid, threads and shared memory
    launches = [c for c in dev.calls if c[0] == "launch"]
    assert launches[0] == ("launch", kernel, (2, 2, 1), (128,))
    assert dev.shared_bytes[-2] == 4 * max(512 * 2, 4 * 2 * 256)


@pytest.mark.parametrize("kv_dtype,heads,qkv_mma,most", [
    ("fwht4/lloyd4", 16, None, 1024),   # NVIDIA _mma tensor-core passes: their own partition
    ("fwht2/fwht4", 8, True, 1024),
    ("fwht4/lloyd4", 16, False, 512),   # the CUDA-core kernel of the same pair
    ("fwht3/lloyd3", 16, None, 512),    # 3-bit: CUDA cores only
    ("fwht4/lloyd4", 32, None, 512),    # 8 heads a group: the _mma kernel's CUDA-core passes
])
def test_the_nvidia_mma_kernels_get_their_own_partition(monkeypatch, kv_dtype, heads, qkv_mma,
                                                        most):
    # PKV_ATTN_PARTITION_QKV_MMA (1,024) where hip/kvcache.hip compiles the _mma passes with
    # it (MMA_OK: NVIDIA, at most 4 heads a group), PKV_ATTN_PARTITION_QKV (512) elsewhere;
    # the launch's partition, its split and its shared memory all follow that most.
    from pagedkv.kernels import kvcache
    from pagedkv.kernels.launch_constants import launch_constant
    monkeypatch.delenv("PAGEDKV_ATTN_QKV_MMA", raising=False)
    monkeypatch.delenv("PAGEDKV_ATTN_PARTITION_TOKENS", raising=False)
    assert kvcache.ATTN_PARTITION_TOKENS_QKV_MMA == launch_constant("PKV_ATTN_PARTITION_QKV_MMA")
    assert most in (kvcache.ATTN_PARTITION_TOKENS_QKV_MMA, kvcache.ATTN_PARTITION_TOKENS[kv_dtype])
    attn = kvcache.PagedAttention(FakeCudaDevice(), num_seqs=32, num_heads=heads, kv_heads=4,
                                  head_dim=256, block_size=16, max_seq_len=4096,
                                  kv_dtype=kv_dtype, qkv_mma=qkv_mma)
    assert attn.partition_tokens == most  # 32 x 4 CTAs of each partition fill a wave
    assert attn.max_partitions == 4096 // most
    assert attn.shared_bytes == 4 * max(most * attn.gmax, 4 * attn.gmax * 256)
    with pytest.raises(InvalidArgument, match=f"16..{most}"):
        kvcache.PagedAttention(FakeCudaDevice(), num_seqs=1, num_heads=heads, kv_heads=4,
                               head_dim=256, block_size=16, max_seq_len=4096,
                               kv_dtype=kv_dtype, qkv_mma=qkv_mma, partition_tokens=most + 16)


@pytest.mark.parametrize("head_dim,heads,kv_heads,kernel", [
    (128, 8, 2, "pkv_paged_attention_q8s_g4"),   # the staged tensor-core passes apply
    (256, 16, 4, "pkv_paged_attention_q8_g4"),   # CUDA-core passes: no idle stage buffers
    (128, 16, 2, "pkv_paged_attention_q8_g8"),   # 8 query heads per KV head: likewise
    (32, 2, 1, "pkv_paged_attention_q8_g2"),
])
def test_q8_default_stages_only_where_the_staged_passes_run(monkeypatch, head_dim, heads,
                                                           kv_heads, kernel):
    # At head_dim 256 the q8s kernel's 36 KB of stage buffers plus the scores' scratch went
    # over the 48 KB of a launch on the H200 (CUDA_ERROR_INVALID_VALUE): the default keeps
    # the unstaged kernel wherever the staged tensor-core passes would not run anyway.
    from pagedkv.kernels import kvcache
    monkeypatch.delenv("PAGEDKV_ATTN_Q8_STAGE", raising=False)
    monkeypatch.delenv("PAGEDKV_ATTN_Q8_MMA", raising=False)
    attn = kvcache.PagedAttention(FakeDevice(), num_seqs=1, num_heads=heads,
                                  kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                                  max_seq_len=64, kv_dtype="q8")
    assert attn._partition.name == kernel
    assert attn.q8_stage is kernel.startswith("pkv_paged_attention_q8s")
@pytest.mark.parametrize("max_seq_len,flags,kernel,tokens", [
    (1024, {}, "pkv_paged_attention_q8_g4", 64),       # 1 chunk per warp, 128 CTAs: unstaged
    (1025, {}, "pkv_paged_attention_q8_g4", 64),       # 136 CTAs < 2 per SM
    (4097, {}, "pkv_paged_attention_q8s_g4", 64),      # 520 CTAs: they share instruction fetch
    (32769, {}, "pkv_paged_attention_q8s_g4", 512),    # 8 chunks per warp: staged
    (1024, {"partition_tokens": 192}, "pkv_paged_attention_q8s_g4", 192),  # 3 chunks per warp
    (1024, {"partition_tokens": 176}, "pkv_paged_attention_q8_g4", 176),
    (1025, {"q8_stage": True}, "pkv_paged_attention_q8s_g4", 64),   # the argument wins
    (1025, {"q8_int": True}, "pkv_paged_attention_q8i_g4", 64),     # and so does q8_int
    (32769, {"q8_stage": False}, "pkv_paged_attention_q8_g4", 512),
])
def test_q8_default_stages_where_staging_pays(monkeypatch, max_seq_len, flags, kernel, tokens):
    # The q8s kernels' prologue copies a warp's first PKV_ATTN_Q8_STAGES - 1 chunks: with no
    # more chunks than that nothing overlaps, and on a grid of fewer than 2 CTAs per SM the
    # unstaged kernel ran faster on the H200 (batch 1 over 1k tokens: 11.0 against 13.2 µs;
    # over 4k, 4 CTAs per SM, staged 14.8 against 15.5; docs/performance.md, "Decode step").
    from pagedkv.kernels import kvcache
    for name in ("PAGEDKV_ATTN_Q8_STAGE", "PAGEDKV_ATTN_Q8_MMA", "PAGEDKV_ATTN_Q8_INT",
                 "PAGEDKV_ATTN_PARTITION_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    assert kvcache.ATTN_Q8_STAGE_MIN_TOKENS == 3 * 16 * 4 == 192
    assert kvcache.q8_stage_pays(64, 264, 132) and not kvcache.q8_stage_pays(64, 263, 132)
    assert kvcache.q8_stage_pays(64, 1, 0)  # unknown SM count: staged
    attn = kvcache.PagedAttention(FakeCudaDevice(), num_seqs=1, num_heads=32, kv_heads=8,
                                  head_dim=128, block_size=16, max_seq_len=max_seq_len,
                                  kv_dtype="q8", **flags)
    assert (attn._partition.name, attn.partition_tokens) == (kernel, tokens)
    assert attn.q8_stage is not kernel.startswith("pkv_paged_attention_q8_")
    assert repr(attn).endswith(f"x{tokens}, q8_mma=True, q8_stage={attn.q8_stage}"
                               + (", q8_int=True)" if "q8i" in kernel else ")"))


@pytest.mark.parametrize("q8_int,env,kernel", [
    (None, None, "pkv_paged_attention_q8s_g2"),    # opt-in until a device run vouches for it
    (None, "1", "pkv_paged_attention_q8i_g2"),     # PAGEDKV_ATTN_Q8_INT=1
    (True, "0", "pkv_paged_attention_q8i_g2"),     # the argument wins over the env
    (False, "1", "pkv_paged_attention_q8s_g2"),
])
def test_q8_int_attention_path_is_selectable(monkeypatch, q8_int, env, kernel):
    from pagedkv.kernels import kvcache
    for name in ("PAGEDKV_ATTN_Q8_MMA", "PAGEDKV_ATTN_Q8_STAGE"):
        monkeypatch.delenv(name, raising=False)
    _set_env(monkeypatch, "PAGEDKV_ATTN_Q8_INT", env)
    dev = FakeDevice()
    attn = kvcache.PagedAttention(dev, num_seqs=1, num_heads=4, kv_heads=2, head_dim=128,
                                  block_size=16, max_seq_len=600, kv_dtype="q8", q8_int=q8_int)
    is_int = kernel.startswith("pkv_paged_attention_q8i")
    assert attn._partition.name == kernel and attn.q8_int is is_int and attn.q8_stage is True
    assert repr(attn).endswith("q8_stage=True, q8_int=True)" if is_int else "q8_stage=True)")
    launches = _q8_attention_launches(dev, attn, 1, 4, 128, 40, 38)
    # the q8s partition (512 tokens), grid, threads and dynamic shared memory
    assert launches == [("launch", kernel, (2, 2, 1), (128,)),
                        ("launch", "pkv_paged_attention_reduce", (4, 1), (64,))]  # 2 warps


def test_q8_int_needs_the_staged_tensor_core_path():
    from pagedkv.errors import InvalidArgumentType
    from pagedkv.kernels import kvcache
    dev = FakeDevice()
    kw = {"num_seqs": 1, "num_heads": 2, "kv_heads": 1, "head_dim": 128, "block_size": 16,
          "max_seq_len": 32, "kv_dtype": "q8"}
    for off in ({"q8_stage": False}, {"q8_mma": False}):
        with pytest.raises(InvalidArgument, match=r"q8_int=True: the q8i kernels are the staged "
                                                  r"tensor-core ones; leave q8_mma and q8_stage"):
            kvcache.PagedAttention(dev, **kw, q8_int=True, **off)
    with pytest.raises(InvalidArgumentType, match=r"q8_int='yes': expected True, False or None"):
        kvcache.PagedAttention(dev, **kw, q8_int="yes")
    assert not dev.calls  # nothing allocated before a refusal
    # a pool off 8-byte alignment runs the unstaged tensor-core kernel, as for q8s
    attn = kvcache.PagedAttention(dev, **kw, q8_int=True)
    base = dev.empty((3, 16, 1, 136), np.uint8)
    shifted = DeviceArray(dev, base.ptr + 4, (2, 16, 1, 136), np.uint8, owned=False, base=base)
    q = dev.empty((1, 2, 128), np.float32)
    tables, lens = dev.array(np.zeros((1, 2), np.int32)), dev.array(np.zeros(1, np.int32))
    for v_pool, kernel in ((base, "pkv_paged_attention_q8i_g2"),
                           (shifted, "pkv_paged_attention_q8_g2")):
        dev.calls.clear()
        attn.run(q, v_pool, v_pool, tables, lens, q)  # K and V of one block count
        assert next(c[1] for c in dev.calls if c[0] == "launch") == kernel


def test_q8_staged_attention_refuses_a_pool_off_8_byte_alignment():
    # The q8s kernels copy rows in 8-byte units from pool + row * 136: a pool view that
    # starts off 8-byte alignment is refused before any launch (q8 and q8cc take it).
    from pagedkv.kernels import kvcache
    dev = FakeDevice()
    kw = {"num_seqs": 1, "num_heads": 2, "kv_heads": 1, "head_dim": 128, "block_size": 16,
              "max_seq_len": 32, "kv_dtype": "q8", "q8_mma": True}
    base = dev.empty((3, 16, 1, 136), np.uint8)
    shifted = DeviceArray(dev, base.ptr + 4, (2, 16, 1, 136), np.uint8, owned=False, base=base)
    head = DeviceArray(dev, base.ptr, (2, 16, 1, 136), np.uint8, owned=False, base=base)
    q = dev.empty((1, 2, 128), np.float32)
    tables, lens = dev.array(np.zeros((1, 2), np.int32)), dev.array(np.zeros(1, np.int32))
    attn = kvcache.PagedAttention(dev, **kw, q8_stage=True)
    dev.calls.clear()
    with pytest.raises(InvalidArgument, match=r"v_pool: the q8_stage kernels need an 8-byte "
                                              rf"aligned pool, this one starts at {base.ptr + 4:#x}"):
        attn.run(q, head, shifted, tables, lens, q)
    assert not [c for c in dev.calls if c[0] == "launch"]
    kvcache.PagedAttention(dev, **kw, q8_stage=False).run(q, head, shifted, tables, lens, q)
    assert next(c[1] for c in dev.calls if c[0] == "launch") == "pkv_paged_attention_q8_g2"


def test_q8_default_stages_aligned_pools_and_falls_back_for_others(monkeypatch):
    # Staging is the default (q8_stage=None): an aligned pool runs q8s, a pool off 8-byte
    # alignment runs the unstaged tensor-core kernel (same partition, grid and shared
    # memory) instead of being refused; asked for explicitly, staging refuses it (above).
    from pagedkv.kernels import kvcache
    monkeypatch.delenv("PAGEDKV_ATTN_Q8_STAGE", raising=False)
    monkeypatch.delenv("PAGEDKV_ATTN_Q8_MMA", raising=False)
    dev = FakeDevice()
    attn = kvcache.PagedAttention(dev, num_seqs=1, num_heads=2, kv_heads=1, head_dim=128,
                                  block_size=16, max_seq_len=32, kv_dtype="q8")
    assert attn.q8_stage is True and attn._partition.name == "pkv_paged_attention_q8s_g2"
    base = dev.empty((3, 16, 1, 136), np.uint8)
    shifted = DeviceArray(dev, base.ptr + 4, (2, 16, 1, 136), np.uint8, owned=False, base=base)
    head = DeviceArray(dev, base.ptr, (2, 16, 1, 136), np.uint8, owned=False, base=base)
    q = dev.empty((1, 2, 128), np.float32)
    tables, lens = dev.array(np.zeros((1, 2), np.int32)), dev.array(np.zeros(1, np.int32))
    for k_pool, v_pool, kernel in ((head, head, "pkv_paged_attention_q8s_g2"),
                                   (head, shifted, "pkv_paged_attention_q8_g2"),
                                   (shifted, head, "pkv_paged_attention_q8_g2"),
                                   (head, head, "pkv_paged_attention_q8s_g2")):
        dev.calls.clear()
        attn.run(q, k_pool, v_pool, tables, lens, q)
        launches = [c for c in dev.calls if c[0] == "launch"]
        assert [c[1:3] for c in launches] == [(kernel, (1, 1, 1)),
                                              ("pkv_paged_attention_reduce", (2, 1))]


@pytest.mark.parametrize(("arch", "kv_heads", "block_size", "env", "offset", "use"), [
    ("sm_90", 2, 16, None, 0, 1),   # sm_90, even heads, 16-token blocks, aligned pools
    ("sm_90", 8, 32, "1", 0, 1),
    ("sm_80", 2, 16, None, 0, 0),   # no tensor copies before sm_90
    ("sm_90", 1, 16, None, 0, 0),   # a 136-byte slot: windows would leave it
    ("sm_90", 2, 8, None, 0, 0),    # a 16-token chunk spans two blocks
    ("sm_90", 2, 16, "0", 0, 0),    # PAGEDKV_ATTN_Q8_TMA=0
    ("sm_90", 2, 16, None, 8, 0)])  # a pool 8 bytes off 16-byte alignment (still staged)
def test_q8_staged_launch_passes_tensor_maps_where_they_apply(monkeypatch, arch, kv_heads,
                                                              block_size, env, offset, use):
    from pagedkv.kernels import kvcache
    _set_env(monkeypatch, "PAGEDKV_ATTN_Q8_TMA", env)
    dev = FakeCudaDevice(arch)
    encoded = []

    def tensor_map_2d(*args):
        encoded.append(args)
        return bytes([len(encoded)]) * 128

    dev.tensor_map_2d = tensor_map_2d
    attn = kvcache.PagedAttention(dev, num_seqs=1, num_heads=2 * kv_heads, kv_heads=kv_heads,
                                  head_dim=128, block_size=block_size, max_seq_len=64,
                                  kv_dtype="q8", q8_stage=True)
    base = dev.empty((5, block_size, kv_heads, 136), np.uint8)
    k_pool = DeviceArray(dev, base.ptr + offset, (4, block_size, kv_heads, 136), np.uint8,
                         owned=False, base=base)
    v_pool = dev.empty((4, block_size, kv_heads, 136), np.uint8)
    q = dev.empty((1, 2 * kv_heads, 128), np.float32)
    tables = dev.array(np.zeros((1, -(-64 // block_size)), np.int32))
    lens = dev.array(np.full(1, 64, np.int32))
    for _ in range(2):  # the maps are encoded once per pair of pools
        attn.run(q, k_pool, v_pool, tables, lens, q)
    slot = kv_heads * 136
    assert encoded == ([(k_pool.ptr, slot, 4 * block_size, slot, 144, 16),
                        (v_pool.ptr, slot, 4 * block_size, slot, 144, 16)] if use else [])
    partition_args = dev.launch_args[-2]
    assert len(partition_args) == 19 and partition_args[-1] == use
    assert partition_args[-3:-1] == ((bytes([1]) * 128, bytes([2]) * 128) if use
                                     else (bytes(128), bytes(128)))


def test_q8_tma_false_keeps_cp_async_and_says_so(monkeypatch):
    from pagedkv.errors import InvalidArgumentType
    from pagedkv.kernels import kvcache
    monkeypatch.delenv("PAGEDKV_ATTN_Q8_TMA", raising=False)
    dev = FakeCudaDevice()
    dev.tensor_map_2d = lambda *a: pytest.fail("q8_tma=False encodes no tensor map")
    kw = {"num_seqs": 1, "num_heads": 4, "kv_heads": 2, "head_dim": 128, "block_size": 16,
          "max_seq_len": 32, "kv_dtype": "q8", "q8_stage": True}
    with pytest.raises(InvalidArgumentType, match=r"q8_tma=1: expected True, False or None"):
        kvcache.PagedAttention(dev, **kw, q8_tma=1)
    attn = kvcache.PagedAttention(dev, **kw, q8_tma=False)
    assert attn.q8_tma is False and repr(attn).endswith(", q8_stage=True, q8_tma=False)")
    pool = dev.empty((2, 16, 2, 136), np.uint8)
    attn.run(dev.empty((1, 4, 128), np.float32), pool, pool,
             dev.array(np.zeros((1, 2), np.int32)), dev.array(np.full(1, 32, np.int32)),
             dev.empty((1, 4, 128), np.float32))
    assert dev.launch_args[-2][-3:] == (bytes(128), bytes(128), 0)
    assert kvcache.PagedAttention(dev, **kw).q8_tma is True  # the default
    assert kvcache.PagedAttention(dev, **dict(kw, kv_dtype="float16", q8_stage=None)).q8_tma is None


def test_q8_mma_switch_is_refused_for_a_non_bool_and_ignored_for_other_dtypes():
    from pagedkv.errors import InvalidArgumentType
    from pagedkv.kernels import kvcache
    dev = FakeDevice()
    with pytest.raises(InvalidArgumentType, match=r"q8_mma=1: expected True, False or None"):
        kvcache.PagedAttention(dev, num_seqs=1, num_heads=2, kv_heads=1, head_dim=64,
                               block_size=16, max_seq_len=16, kv_dtype="q8", q8_mma=1)
    with pytest.raises(InvalidArgumentType, match=r"q8_stage='yes': expected True, False or"):
        kvcache.PagedAttention(dev, num_seqs=1, num_heads=2, kv_heads=1, head_dim=64,
                               block_size=16, max_seq_len=16, kv_dtype="q8", q8_stage="yes")
    assert not dev.calls  # nothing allocated before the refusal
    f16 = kvcache.PagedAttention(dev, num_seqs=1, num_heads=2, kv_heads=1, head_dim=64,
                                 block_size=16, max_seq_len=16, kv_dtype="float16",
                                 q8_mma=False, q8_stage=True)
    assert f16.q8_mma is None and f16.q8_stage is None and "q8_" not in repr(f16)
    assert f16._partition.name == "pkv_paged_attention_f16_g2"


def attention_kernel_names() -> set[str]:
    """Every partition and reduce kernel name the attention launcher can build from a
    kv_dtype (the .hip file defines them through macros)."""
    from pagedkv.kernels import kvcache
    names = {f"pkv_paged_attention_{d.replace('lloyd3/', 'fwht3/').replace('/fwht3', '/lloyd3')}"
             .replace("/", "_") + f"_g{g}" for d in kvcache.QUANT_KV_DTYPES for g in (1, 2, 4, 8)}
    names |= {f"pkv_paged_attention_{k}_g{g}" for k in ("f16", "bf16", "q8", "q8cc", "q8s", "q8i")
              for g in (1, 2, 4, 8)}
    names |= {f"pkv_paged_attention_{d.replace('/', '_')}_mma_g{g}"
              for d in kvcache.QUANT_KV_DTYPES if kvcache.qkv_mma_applies(d)
              for g in (1, 2, 4, 8)}
    return names | {"pkv_paged_attention_reduce", "pkv_paged_attention_reduce_ifwht256",
                    "pkv_paged_attention_reduce_ifwht128"}


def mfma_attention_kernel_names(arch: str) -> set[str]:
    """The AMD-only matrix-core attention kernels an arch's kvcache code object must define
    (PagedAttention with PAGEDKV_ATTN_MFMA=1 / PAGEDKV_ATTN_WMMA=1 names them there): MFMA
    f16 and q8 on every MFMA arch, bf16 only on those with the k-16 bf16 MFMA; WMMA f16 and
    bf16 on gfx11."""
    from pagedkv.kernels.device import MFMA_ARCHES, MFMA_BF16_ARCHES, WMMA_ARCHES
    kinds = (("f16mfma", "q8mfma") if arch in MFMA_ARCHES else ()) + (
        ("bf16mfma",) if arch in MFMA_BF16_ARCHES else ()) + (
        ("f16wmma", "bf16wmma", "q8wmma") if arch in WMMA_ARCHES else ())
    return {f"pkv_paged_attention_{k}_g{g}" for k in kinds for g in (1, 2, 4, 8)}


def test_every_attention_kernel_the_launcher_names_is_in_the_built_objects():
    # Compare with the symbols of the objects this build produced (skip without). nvcc
    # compresses a large fatbin (kvcache's, 5 MB since the _mma kernels), which hides its
    # names: such an object is checked on the GPU instead (the test below looks every name
    # up in the loaded module); the same macros define the names in the AMD objects.
    from pagedkv.kernels import code_objects
    objects = [n for n in code_objects.list_objects() if n.startswith("kvcache.")]
    if not objects:
        pytest.skip("built without a GPU compiler: no kernel objects")
    names, checked = attention_kernel_names(), []
    for obj in objects:
        backend, arch = ("cuda", "") if obj.endswith(".fatbin") else ("hip", obj.split(".")[1])
        data = code_objects.read_object("kvcache", backend, arch)
        if backend == "cuda" and b"pkv_paged_attention_reduce" not in data:
            continue  # compressed device code: no readable names
        missing = sorted(n for n in names | mfma_attention_kernel_names(arch)
                         if n.encode() not in data)
        assert not missing, f"{obj} lacks {missing}"
        checked.append(obj)
    if not checked:
        pytest.skip(f"only compressed objects ({objects}): checked on the GPU")


@pytest.mark.gpu
def test_gpu_every_attention_kernel_the_launcher_names_loads(device):
    # The loaded module resolves every name (cuModuleGetFunction / hipModuleGetFunction
    # raise DeviceError for a missing one), compressed fatbin or not. Looked up directly:
    # device.kernel would cache each name under a signature the launchers do not use.
    from ctypes import byref, c_void_p

    from pagedkv.kernels import kvcache
    module = device.module(kvcache.SOURCE)
    for name in sorted(attention_kernel_names()):
        fn = c_void_p()
        device.call("module_get_function", byref(fn), module, name.encode())
        assert fn.value, name


@pytest.mark.parametrize(("arch", "env", "kv_dtype", "head_dim", "kernel"), [
    ("gfx90a", "1", "float16", 128, "pkv_paged_attention_f16mfma_g4"),
    ("gfx940", "1", "float16", 64, "pkv_paged_attention_f16mfma_g4"),
    ("gfx908", "1", "float16", 64, "pkv_paged_attention_f16mfma_g4"),
    ("gfx90a", None, "float16", 128, "pkv_paged_attention_f16_g4"),  # opt-in: off by default
    ("gfx90a", "0", "float16", 128, "pkv_paged_attention_f16_g4"),
    ("gfx90a", "1", "float16", 256, "pkv_paged_attention_f16_g4"),  # head_dim 64/128 only
    ("gfx90a", "1", "bfloat16", 128, "pkv_paged_attention_bf16mfma_g4"),
    ("gfx942", "1", "bfloat16", 64, "pkv_paged_attention_bf16mfma_g4"),
    ("gfx90a", None, "bfloat16", 128, "pkv_paged_attention_bf16_g4"),
    ("gfx90a", "1", "bfloat16", 256, "pkv_paged_attention_bf16_g4"),
    # gfx908 has no k-16 bf16 MFMA: its code object has no bf16mfma kernels
    ("gfx908", "1", "bfloat16", 128, "pkv_paged_attention_bf16_g4"),
    ("gfx90a", "1", "q8", 128, "pkv_paged_attention_q8mfma_g4"),  # q8: pass 1 on MFMA
    ("gfx908", "1", "q8", 64, "pkv_paged_attention_q8mfma_g4"),
    ("gfx90a", None, "q8", 128, "pkv_paged_attention_q8_g4"),
    ("gfx90a", "1", "q8", 256, "pkv_paged_attention_q8_g4"),
    ("gfx1030", "1", "float16", 128, "pkv_paged_attention_f16_g4"),  # RDNA: no MFMA
    ("gfx1030", "1", "bfloat16", 128, "pkv_paged_attention_bf16_g4")])
def test_attention_takes_the_mfma_kernels_only_when_asked_on_cdna(
        monkeypatch, arch, env, kv_dtype, head_dim, kernel):
    # docs/kernels.md, "AMD matrix cores": both passes on MFMA are compile-checked and
    # emulated only
    from pagedkv.kernels import kvcache
    if env is None:
        monkeypatch.delenv("PAGEDKV_ATTN_MFMA", raising=False)
    else:
        monkeypatch.setenv("PAGEDKV_ATTN_MFMA", env)
    attn = kvcache.PagedAttention(FakeHipDevice(arch), num_seqs=1, num_heads=8, kv_heads=2,
                                  head_dim=head_dim, block_size=16, max_seq_len=64,
                                  kv_dtype=kv_dtype)
    assert attn._partition.name == kernel
    assert attn.mfma == kernel.endswith("mfma_g4")
    assert repr(attn).endswith(", mfma=True)" if attn.mfma else ")")
    assert (", mfma=True" in repr(attn)) == attn.mfma


@pytest.mark.parametrize(("arch", "env", "kv_dtype", "head_dim", "kernel"), [
    ("gfx1100", "1", "float16", 128, "pkv_paged_attention_f16wmma_g4"),
    ("gfx1151", "1", "bfloat16", 64, "pkv_paged_attention_bf16wmma_g4"),
    ("gfx1100", None, "float16", 128, "pkv_paged_attention_f16_g4"),  # opt-in: off by default
    ("gfx1100", "0", "bfloat16", 128, "pkv_paged_attention_bf16_g4"),
    ("gfx1100", "1", "float16", 256, "pkv_paged_attention_f16_g4"),  # head_dim 64/128 only
    ("gfx1100", "1", "q8", 128, "pkv_paged_attention_q8wmma_g4"),  # q8 as for MFMA
    ("gfx1100", None, "q8", 64, "pkv_paged_attention_q8_g4"),
    ("gfx1030", "1", "float16", 128, "pkv_paged_attention_f16_g4"),  # RDNA2: no WMMA
    ("gfx1201", "1", "float16", 128, "pkv_paged_attention_f16_g4"),  # RDNA4: other layouts
    ("gfx90a", "1", "float16", 128, "pkv_paged_attention_f16_g4")])  # the CDNA switch is MFMA's
def test_attention_takes_the_wmma_kernels_only_when_asked_on_rdna3(
        monkeypatch, arch, env, kv_dtype, head_dim, kernel):
    from pagedkv.kernels import kvcache
    monkeypatch.delenv("PAGEDKV_ATTN_MFMA", raising=False)
    if env is None:
        monkeypatch.delenv("PAGEDKV_ATTN_WMMA", raising=False)
    else:
        monkeypatch.setenv("PAGEDKV_ATTN_WMMA", env)
    attn = kvcache.PagedAttention(FakeHipDevice(arch), num_seqs=1, num_heads=8, kv_heads=2,
                                  head_dim=head_dim, block_size=16, max_seq_len=64,
                                  kv_dtype=kv_dtype)
    assert attn._partition.name == kernel
    assert attn.wmma == kernel.endswith("wmma_g4") and not attn.mfma
    assert (", wmma=True" in repr(attn)) == attn.wmma


@pytest.mark.parametrize(("arch", "env", "qkv_mma", "kernel", "unit"), [
    ("gfx90a", {}, None, "pkv_paged_attention_fwht4_lloyd4_g8", None),  # opt-in: off by default
    ("gfx90a", {"PAGEDKV_ATTN_MFMA": "1"}, None, "pkv_paged_attention_fwht4_lloyd4_mma_g8", "mfma"),
    ("gfx942", {"PAGEDKV_ATTN_MFMA": "1"}, None, "pkv_paged_attention_fwht4_lloyd4_mma_g8", "mfma"),
    ("gfx90a", {"PAGEDKV_ATTN_MFMA": "1", "PAGEDKV_ATTN_QKV_MMA": "0"}, None,
     "pkv_paged_attention_fwht4_lloyd4_g8", None),
    ("gfx90a", {"PAGEDKV_ATTN_MFMA": "1"}, False, "pkv_paged_attention_fwht4_lloyd4_g8", None),
    ("gfx90a", {}, True, "pkv_paged_attention_fwht4_lloyd4_mma_g8", "mfma"),  # asked by name
    ("gfx90a", {"PAGEDKV_ATTN_WMMA": "1"}, None, "pkv_paged_attention_fwht4_lloyd4_g8", None),
    ("gfx1100", {"PAGEDKV_ATTN_WMMA": "1"}, None, "pkv_paged_attention_fwht4_lloyd4_mma_g8", "wmma"),
    ("gfx1100", {}, None, "pkv_paged_attention_fwht4_lloyd4_g8", None),
    # RDNA3.5 arches past gfx1151: their objects hold WMMA too (__GFX11__), same opt-in
    ("gfx1152", {}, None, "pkv_paged_attention_fwht4_lloyd4_g8", None),
    ("gfx1153", {"PAGEDKV_ATTN_WMMA": "1"}, None, "pkv_paged_attention_fwht4_lloyd4_mma_g8",
     "wmma"),
    # no matrix cores: the _mma kernels run the CUDA-core passes there, as before
    ("gfx1030", {}, None, "pkv_paged_attention_fwht4_lloyd4_mma_g8", None)])
def test_compressed_attention_takes_amd_matrix_cores_only_when_asked(
        monkeypatch, arch, env, qkv_mma, kernel, unit):
    # On CDNA / gfx11 the compressed pairs' _mma kernels are the MFMA / WMMA code passes,
    # compile-checked and emulated only (tests/test_attention_codes_amd_simulated.py)
    from pagedkv.kernels import kvcache
    for name in ("PAGEDKV_ATTN_MFMA", "PAGEDKV_ATTN_WMMA", "PAGEDKV_ATTN_QKV_MMA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    attn = kvcache.PagedAttention(FakeHipDevice(arch), num_seqs=1, num_heads=16, kv_heads=2,
                                  head_dim=256, block_size=16, max_seq_len=64,
                                  kv_dtype="fwht4/lloyd4", qkv_mma=qkv_mma)
    assert attn._partition.name == kernel
    assert attn.qkv_mma == kernel.endswith("_mma_g8")
    assert (attn.mfma, attn.wmma) == (unit == "mfma", unit == "wmma")
    assert (", mfma=True" in repr(attn), ", wmma=True" in repr(attn)) == (attn.mfma, attn.wmma)


@pytest.mark.parametrize(("arch", "kv_dtype", "shared"), [
    # 8 heads a KV head at head_dim 256, PKV_ATTN_PARTITION_QKV (512) tokens: the scores are
    # 16 KB; the warps' partial outputs (4 waves x 8 heads x 256 f32 = 32 KB) stay in static
    # shared memory with a rotated V on matrix cores, so the launch reserves the scores alone
    ("gfx1100", "fwht2/lloyd2", 16384), ("gfx1100", "fwht4/lloyd4", 16384),
    ("gfx1100", "fwht4/q8", 32768),   # a q8 V: CUDA-core pass 2, partials in dynamic memory
    ("gfx90a", "lloyd4/lloyd4", 16384),  # wave64: 2 waves, 16 KB of partials either way
    ("gfx1030", "fwht2/lloyd2", 32768)])  # no matrix cores: CUDA-core passes
def test_amd_matrix_core_code_passes_reserve_the_scores_alone(monkeypatch, arch, kv_dtype,
                                                                shared):
    # Reserving room for partials the kernel keeps in qs put gfx11's g8 head_dim-256 kernels
    # at ~77 KB, over the 64 KB of LDS a workgroup gets (hip/kvcache.hip asserts the sum)
    from pagedkv.kernels import kvcache
    for name in ("PAGEDKV_ATTN_MFMA", "PAGEDKV_ATTN_WMMA", "PAGEDKV_ATTN_QKV_MMA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PAGEDKV_ATTN_WMMA" if arch == "gfx1100" else "PAGEDKV_ATTN_MFMA", "1")
    attn = kvcache.PagedAttention(FakeHipDevice(arch), num_seqs=1, num_heads=8, kv_heads=1,
                                  head_dim=256, block_size=16, max_seq_len=64,
                                  kv_dtype=kv_dtype)
    assert attn._partition.name.endswith("_mma_g8") and attn.shared_bytes == shared
    # NVIDIA's _mma kernels reserve both terms, equal at 1,024 tokens and 4 warps
    assert kvcache.attention_shared_bytes(kv_dtype, 4, 256, warp_size=32, most=1024) == \
        kvcache.attention_shared_bytes(kv_dtype, 4, 256, warp_size=32, most=1024,
                                       partials=False) == 16384


@pytest.mark.parametrize("flags", [{"q8_mma": False}, {"q8_stage": True},
                                   {"q8_stage": True, "q8_int": True}])
def test_q8_attention_keeps_the_kernel_asked_for_over_mfma(monkeypatch, flags):
    # q8mfma replaces the plain q8 kernel only: the CUDA-core (q8cc) and staged (q8s, q8i)
    # kernels asked for by name keep their names, MFMA or not
    from pagedkv.kernels import kvcache
    monkeypatch.setenv("PAGEDKV_ATTN_MFMA", "1")
    attn = kvcache.PagedAttention(FakeHipDevice("gfx90a"), num_seqs=1, num_heads=8, kv_heads=2,
                                  head_dim=128, block_size=16, max_seq_len=64, kv_dtype="q8",
                                  **flags)
    assert not attn.mfma
    assert attn._partition.name == {"q8_mma": "pkv_paged_attention_q8cc_g4",
                                    "q8_stage": "pkv_paged_attention_q8s_g4",
                                    "q8_int": "pkv_paged_attention_q8i_g4"}[list(flags)[-1]]


# --- paged attention: tokens per partition (the split of short contexts) ---

@pytest.mark.parametrize("kv_dtype,seqs,kv_heads,max_seq_len,sms,tokens", [
    # a wave is 4 CTAs per SM, 528 on 132 SMs
    ("float16", 1, 8, 1025, 132, 64),      # 8 CTAs of 1024 -> 17 of 64 (the floor)
    ("float16", 1, 8, 32768, 132, 512),    # 32 x 8 = 256 CTAs -> 66 parts: 497 -> 512 tokens
    ("float16", 1, 8, 32769, 132, 512),    # 65 x 8 = 520 CTAs
    ("float16", 1, 4, 32769, 132, 256),    # 33 x 4 -> 132 parts: 249 -> 256 (129 x 4 = 516)
    ("float16", 32, 8, 1024, 132, 512),    # 256 CTAs -> 2 parts: 512 CTAs
    ("float16", 32, 8, 1025, 132, 528),    # 2 x 256 = 512 CTAs, under a wave -> 2 parts of 528
    ("float16", 8, 8, 32769, 132, 1008),   # 33 x 64 = 2112 CTAs: 33 even shares, not 32 + 1
    ("float16", 66, 8, 1024, 132, 1024),   # 528 CTAs: exactly a wave, the most
    ("q8", 32, 8, 1025, 132, 352),         # 3 x 256 = 768 CTAs: 352 + 352 + 321, not 512 + 512 + 1
    ("q8", 1, 8, 1025, 132, 64),
    ("q8", 1, 8, 32768, 132, 512),         # 64 x 8 = 512 CTAs at the most already
    ("q8", 4, 8, 4000, 132, 256),          # 8 x 32 = 256 CTAs -> 16 parts: 250 -> 256 tokens
    ("bfloat16", 2, 2, 100, 132, 64),      # shorter than the floor: one partition of 64
    ("fwht4/q8", 1, 4, 20000, 132, 160),   # 132 parts: 152 -> 160 tokens (125 x 4 = 500)
    ("float16", 1, 8, 1025, 0, 1024),      # unknown SM count: no split
])
def test_attention_partition_tokens_fill_the_gpu(kv_dtype, seqs, kv_heads, max_seq_len, sms,
                                                 tokens):
    from pagedkv.kernels import kvcache
    got = kvcache.attention_partition_tokens(kv_dtype, seqs, kv_heads, max_seq_len, sms)
    assert got == tokens
    assert got % 16 == 0 and 64 <= got <= kvcache.ATTN_PARTITION_TOKENS[kv_dtype]


def test_paged_attention_launches_its_partition_tokens(monkeypatch):
    from pagedkv.kernels import kvcache
    monkeypatch.delenv("PAGEDKV_ATTN_PARTITION_TOKENS", raising=False)
    dev = FakeCudaDevice()
    attn = kvcache.PagedAttention(dev, num_seqs=1, num_heads=32, kv_heads=8, head_dim=128,
                                  block_size=16, max_seq_len=1025, kv_dtype="float16")
    assert (attn.partition_tokens, attn.max_partitions) == (64, 17)
    assert "partitions=17x64" in repr(attn)
    q = dev.empty((1, 32, 128), np.float32)
    pool = dev.empty((70, 16, 8, 128), np.float16)
    tables = dev.array(np.zeros((1, 65), np.int32))
    lens = dev.array(np.zeros(1, np.int32))
    dev.calls.clear()
    attn.run(q, pool, pool, tables, lens, dev.empty((1, 32, 128), np.float32))
    launches = [c for c in dev.calls if c[0] == "launch"]
    assert launches[0][2] == (17, 8, 1)
    assert dev.launch_args[-2][-2:] == (17, 64)   # partition kernel: parts, tokens
    assert dev.launch_args[-1][-2:] == (17, 64)   # reduce: the same split
    # an explicit size, and the environment's, win over the choice
    assert kvcache.PagedAttention(dev, num_seqs=1, num_heads=32, kv_heads=8, head_dim=128,
                                  block_size=16, max_seq_len=1025, kv_dtype="float16",
                                  partition_tokens=1024).max_partitions == 2
    monkeypatch.setenv("PAGEDKV_ATTN_PARTITION_TOKENS", "256")
    assert kvcache.PagedAttention(dev, num_seqs=1, num_heads=32, kv_heads=8, head_dim=128,
                                  block_size=16, max_seq_len=1025,
                                  kv_dtype="float16").partition_tokens == 256


# --- paged attention: the reduce fused with the O projection's x prep ---

@pytest.mark.parametrize("fmt,batch,heads,kv_heads,head_dim,tiles,rotate", [
    ("hfq4g256", 1, 32, 8, 128, 1, 0),   # 16 groups of 2 heads: 2 blocks of 8 warps
    ("mq4g256v2", 3, 8, 2, 64, 2, 1),    # 2 groups of 4 heads x 3 rows, x rotated
    ("hfq4g256", 8, 4, 2, 256, 3, 0),    # a head per group, 8 rows
])
def test_paged_attention_run_prep_launches_the_fused_reduce(monkeypatch, fmt, batch, heads,
                                                            kv_heads, head_dim, tiles, rotate):
    from pagedkv.kernels import kvcache
    monkeypatch.delenv("PAGEDKV_ATTN_PARTITION_TOKENS", raising=False)
    dev = FakeCudaDevice()
    attn = kvcache.PagedAttention(dev, num_seqs=batch, num_heads=heads, kv_heads=kv_heads,
                                  head_dim=head_dim, block_size=16, max_seq_len=1025,
                                  kv_dtype="float16")
    assert attn.prep_fusable
    prepared = weights.Gemv(dev, fmt, 64, heads * head_dim, batch).prepared_x()
    q = dev.empty((batch, heads, head_dim), np.float32)
    pool = dev.empty((70 * batch, 16, kv_heads, head_dim), np.float16)
    tables = dev.array(np.zeros((batch, 65), np.int32))
    lens = dev.array(np.zeros(batch, np.int32))
    out = dev.empty((batch, heads, head_dim), np.float32)
    for written in (None, out):
        dev.calls.clear()
        dev.launch_args.clear()
        attn.run_prep(q, pool, pool, tables, lens, prepared, written)
        groups = heads * head_dim // 256  # a block of 8 warps (slices) per (256-group, row)
        assert _launches(dev) == [
            ("launch", attn._partition.name, (attn.max_partitions, kv_heads, batch), (128,)),
            ("launch", "pkv_attention_reduce_prep_f32", (groups, batch), (256,))]
        part, fused = dev.launch_args
        # the reduce reads the partition launch's workspace and geometry
        assert part[5:8] == fused[:3] == (attn.part_out, attn.part_max, attn.part_sum)
        assert part[-2:] == (attn.max_partitions, attn.partition_tokens)
        assert fused[3] is lens and fused[4] == (0 if written is None else out)
        assert fused[5:7] == (prepared.xq, prepared.xs)
        assert fused[7:] == (batch, heads, head_dim, attn.max_partitions,
                             attn.partition_tokens, tiles, rotate)


@pytest.mark.parametrize("kv_dtype,head_dim,fusable", [
    ("float16", 128, True), ("bfloat16", 64, True), ("q8", 128, True),
    ("fwht4/q8", 256, True),        # a q8 V: the plain reduce
    ("fwht4/lloyd4", 256, False),   # a rotated V: its reduce rotates each head back
    ("fwht4/fwht4", 128, False),
])
def test_paged_attention_prep_fusable_geometries(kv_dtype, head_dim, fusable):
    from pagedkv.kernels import kvcache
    dev = FakeCudaDevice()
    attn = kvcache.PagedAttention(dev, num_seqs=2, num_heads=8, kv_heads=2, head_dim=head_dim,
                                  block_size=16, max_seq_len=300, kv_dtype=kv_dtype)
    assert attn.prep_fusable is fusable
    # 2 heads of 64: a 128-value row, no whole 256-group
    assert not kvcache.PagedAttention(dev, num_seqs=1, num_heads=2, kv_heads=2, head_dim=64,
                                      block_size=16, max_seq_len=300,
                                      kv_dtype="float16").prep_fusable


def test_paged_attention_run_prep_checks_before_launching():
    from pagedkv.kernels import kvcache
    dev = FakeCudaDevice()
    f32 = np.float32

    def attn_of(kv_dtype, head_dim=128):
        return kvcache.PagedAttention(dev, num_seqs=2, num_heads=8, kv_heads=2,
                                      head_dim=head_dim, block_size=16, max_seq_len=300,
                                      kv_dtype=kv_dtype)

    attn = attn_of("float16")
    q, out = dev.empty((2, 8, 128), f32), dev.empty((2, 8, 128), f32)
    pool = dev.empty((40, 16, 2, 128), np.float16)
    tables, lens = dev.array(np.zeros((2, 19), np.int32)), dev.array(np.zeros(2, np.int32))
    prepared = weights.Gemv(dev, "hfq4g256", 64, 1024, 2).prepared_x()
    rotated = attn_of("fwht4/lloyd4", 256)
    rpool = dev.empty((40, 16, 2, rotated.k_row), np.uint8)
    cases = [
        (lambda: attn.run_prep(q, pool, pool, tables, lens, (1, 2)),
         "prepared: expected Gemv.prepared_x"),
        (lambda: attn.run_prep(q, pool, pool, tables, lens,
                               weights.Gemv(dev, "hfq4g256", 64, 1024, 3).prepared_x()),
         "prepared: a Gemv of batch 3 and K 1024; x has 2 rows of 1024"),
        (lambda: attn.run_prep(q, pool, pool, tables, lens,
                               weights.Gemv(dev, "hfq4g256", 64, 2048, 2).prepared_x()),
         "prepared: a Gemv of batch 2 and K 2048; x has 2 rows of 1024"),
        (lambda: attn.run_prep(q, pool, pool, tables, lens, prepared, dev.empty((2, 8, 64), f32)),
         r"out: shape \(2, 8, 64\), expected \(2, 8, 128\)"),
        (lambda: attn.run_prep(dev.empty((2, 8, 64), f32), pool, pool, tables, lens, prepared),
         r"q: shape \(2, 8, 64\), expected \(2, 8, 128\)"),
        (lambda: rotated.run_prep(dev.empty((2, 8, 256), f32), rpool, rpool, tables, lens,
                                  weights.Gemv(dev, "hfq4g256", 64, 2048, 2).prepared_x()),
         r"no fused reduce \+ prep here .*call run\(...\) then Gemv.prepare\(out\)"),
    ]
    dev.calls.clear()
    for call, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            call()
    assert _launches(dev) == []
    attn.run_prep(q, pool, pool, tables, lens, prepared, out)
    assert len(_launches(dev)) == 2


@pytest.mark.parametrize("tokens", [0, 8, 100, 2048, True, 64.0])
def test_paged_attention_refuses_bad_partition_tokens(tokens, monkeypatch):
    from pagedkv.kernels import kvcache
    monkeypatch.delenv("PAGEDKV_ATTN_PARTITION_TOKENS", raising=False)
    dev = FakeCudaDevice()
    with pytest.raises(InvalidArgument, match="partition_tokens=.*multiple of 16 in 16..1024"):
        kvcache.PagedAttention(dev, num_seqs=1, num_heads=32, kv_heads=8, head_dim=128,
                               block_size=16, max_seq_len=1025, kv_dtype="float16",
                               partition_tokens=tokens)
    assert dev.calls == []  # nothing allocated


@pytest.mark.parametrize(("scale", "error", "message"), [
    ("x", InvalidArgumentType, "scale='x': expected a float"),
    (True, InvalidArgumentType, "scale=True: expected a float"),
    (np.array([0.1]), InvalidArgumentType, "expected a float .* got ndarray"),
    (float("nan"), InvalidArgument, "scale=nan: must be finite"),
    (-float("inf"), InvalidArgument, "scale=-inf: must be finite"),
    (10**400, InvalidArgument, "must be finite")])
def test_paged_attention_refuses_a_scale_that_is_not_a_finite_number(scale, error, message):
    """Found by a review: ``scale="x"`` raised a builtin ValueError (``float("x")``) and NaN
    was taken (every output NaN). The MLX path shares the check (test_kernels_mlx.py)."""
    from pagedkv.kernels import kvcache
    dev = FakeCudaDevice()
    with pytest.raises(error, match=message):
        kvcache.PagedAttention(dev, num_seqs=1, num_heads=4, kv_heads=2, head_dim=64,
                               block_size=16, max_seq_len=64, kv_dtype="float16", scale=scale)
    assert dev.calls == []  # nothing allocated
    for ok in (0.125, np.float32(0.125), 1, None):
        attn = kvcache.PagedAttention(dev, num_seqs=1, num_heads=4, kv_heads=2, head_dim=64,
                                      block_size=16, max_seq_len=64, kv_dtype="float16",
                                      scale=ok)
        assert attn.scale == (0.125 if ok is None else float(ok))
