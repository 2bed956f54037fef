"""The GPU benchmark's plumbing (pagedkv.bench.gpu, hip/tune.py) on the HIP ctypes stub: the
kernels do not run, every event pair reads 0.5 ms, the stub reports an 8 MiB L2. What is
checked: rotation counts, the bytes each row is charged, the rows produced, the tune sweeps'
loops; the kernels' own speed and results are the GPU suite's."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_support import load_tree_script
from pagedkv import errors
from pagedkv._build_config import HIP_TARGETS
from pagedkv.bench import gpu
from pagedkv.kernels import Device, Stream, weights
from pagedkv.kernels.code_objects import read_object

pytestmark = pytest.mark.skipif(not HIP_TARGETS, reason="built without hipcc: no AMD objects "
                                                        "for the stub to load")
SMALL_CASE = {"seqs": 2, "tokens": 64, "kv_heads": 2, "heads": 4, "head_dim": 64,
              "block_size": 16}


@pytest.fixture
def dev(stub_runtime):
    return Device(stub_runtime, 0)


def test_rotation_covers_four_l2s_and_rounds_calls_to_copies(dev):
    assert gpu._rotation(dev, 1 << 20) == (32, 64)  # 4 x 8 MiB / 1 MiB copies
    assert gpu._rotation(dev, 3 << 20) == (11, 55)  # 64 // 11 = 5 rounds
    assert gpu._rotation(dev, 1 << 30) == (2, 64)  # at least two copies
    w, calls = gpu.rotating_weights(dev, "hfq4g256", 1024, 1024, np.zeros(557056, np.uint8))
    assert (len(w), calls) == (61, 61)  # 557,056 bytes each
    assert all(x.array.nbytes == 557056 and not x.packed for x in w)  # HIP: raw rows


def test_attention_inputs_and_rows(dev):
    args, nbytes, kw = gpu.attention_inputs(dev, np.random.default_rng(0), "q8", **SMALL_CASE)
    q, k_pool, v_pool, tables, lens, out = args
    assert k_pool.shape == (8, 16, 2, 68) and k_pool.dtype == np.uint8  # 64 dims: 2 records
    assert tables.shape == (2, 4) and sorted(tables.to_numpy().ravel()) == list(range(8))
    assert (lens.to_numpy() == 64).all() and q.shape == out.shape == (2, 4, 64)
    assert v_pool.shape == k_pool.shape and v_pool.dtype == np.uint8
    assert nbytes == 2 * k_pool.nbytes + 2 * q.nbytes + tables.nbytes
    assert kw == {"num_seqs": 2, "num_heads": 4, "kv_heads": 2, "head_dim": 64,
                  "block_size": 16, "max_seq_len": 64, "kv_dtype": "q8"}
    rows: list[dict] = []
    gpu.bench_attention(dev, Stream(dev), rows, 1e12, None, case=SMALL_CASE)
    assert [r["kernel"] for r in rows] == ["paged_attention float16", "paged_attention bfloat16",
                                           "paged_attention q8",
                                           "paged_attention q8 cuda-cores",
                                           "paged_attention q8 unstaged",
                                           "paged_attention q8 int pass 1",
                                           "paged_attention q8 cp.async"]
    # 0.5 ms per graph over its launches, which cycle over pool copies of 4 x the 8 MiB L2
    f16_calls, q8_calls = (gpu.attention_rotation(dev, 2 * k_pool.nbytes * w)[1] for w in (
        128 / 68, 1))
    assert (f16_calls, q8_calls) == (512, 964)  # 65,536 and 34,816 bytes of K + V
    assert [r["us"] for r in rows] == pytest.approx([500 / f16_calls] * 2 + [500 / q8_calls] * 5)


def test_attention_rotation_covers_four_l2s_and_times_at_least_five_launches(dev):
    assert gpu.attention_rotation(dev, 64 << 20) == (1, 5)  # one pool passes 4 x 8 MiB
    assert gpu.attention_rotation(dev, 12 << 20) == (3, 6)
    assert gpu.attention_rotation(dev, 1 << 20) == (32, 32)
    assert gpu.attention_rotation(dev, 32 << 20) == (1, 5)


def test_time_attention_cycles_over_byte_equal_pool_copies(dev):
    """Each launch of the timing graph gets the next copy of the K and V pools (the first
    is the caller's), every copy the caller's bytes, and the copies are freed after."""
    args, _, _ = gpu.attention_inputs(dev, np.random.default_rng(1), "q8", **SMALL_CASE)
    launched, seen_bytes = [], []

    class Recorder:
        def run(self, q, k_pool, v_pool, tables, lens, out, *, stream=None):
            launched.append((k_pool, v_pool))
            if len(seen_bytes) < 3:  # the copies live while the graph is captured
                seen_bytes.append((k_pool.to_numpy().tobytes(), v_pool.to_numpy().tobytes()))

    gpu.time_attention(dev, Stream(dev), Recorder(), args)
    copies, calls = gpu.attention_rotation(dev, args[1].nbytes + args[2].nbytes)
    assert len(launched) == calls and copies == 964
    assert launched[0] == (args[1], args[2])
    assert len({id(k) for k, _ in launched}) == len({id(v) for _, v in launched}) == copies
    want = (args[1].to_numpy().tobytes(), args[2].to_numpy().tobytes())
    assert seen_bytes == [want] * 3
    with pytest.raises(errors.InvalidArgument, match="was freed"):
        launched[1][0].live_ptr()
    args[1].live_ptr()  # the caller's pools stay


def test_attention_inputs_of_a_partial_last_block(dev):
    # A decode step over 64 cached tokens attends over 65: whole blocks (5 of 16), the
    # lengths say 65, and the row is charged the 65 rows of each side it reads.
    case = dict(SMALL_CASE, tokens=65)
    args, nbytes, kw = gpu.attention_inputs(dev, np.random.default_rng(0), "float16", **case)
    q, k_pool, v_pool, tables, lens, out = args
    assert k_pool.shape == v_pool.shape == (10, 16, 2, 64) and tables.shape == (2, 5)
    assert sorted(tables.to_numpy().ravel()) == list(range(10))
    assert (lens.to_numpy() == 65).all() and kw["max_seq_len"] == 65 and out.shape == q.shape
    assert nbytes == 2 * (2 * 65 * 2 * 64 * 2) + 2 * q.nbytes + tables.nbytes


def test_attention_launch_rows_compare_the_choice_with_the_fixed_ones(dev):
    rows: list[dict] = []
    cases = ((1, 65, "float16"), (2, 100, "q8"))
    gpu.bench_attention_launch(dev, Stream(dev), rows, 1e12, cases, kv_heads=2, heads=4,
                               head_dim=64)
    assert [(r["kernel"], r["shape"]) for r in rows] == [
        ("paged_attention float16 launch", "1x65 kvh2 d64"),
        ("paged_attention q8 launch", "2x100 kvh2 d64")]
    assert all(r["vs_most"] == pytest.approx(1.0) for r in rows)  # every launch reads 0.5 ms
    assert "staged" not in rows[0] and rows[1]["vs_other_staging"] == pytest.approx(1.0)
    assert rows[1]["staged"] is False  # HIP: the q8s kernels are NVIDIA's
    assert [r["attention_kernel"] for r in rows] == ["pkv_paged_attention_f16_g2",
                                                     "pkv_paged_attention_q8_g2"]
    asv = _asv_gpu()
    assert {n.rsplit(" | ", 1)[1] for n in asv.LAUNCH_ROWS} == {"vs_most", "vs_other_staging"}
    assert {n.split(" | ")[0] for n in asv.LAUNCH_ROWS} == {
        f"paged_attention {kv} launch" for kv in ("float16", "q8")}
    assert [f"{s}x{t}" for s, t, _ in gpu.LAUNCH_CASES] == [
        n.split(" | ")[1].split()[0] for n in asv.LAUNCH_ROWS[:6]]


def test_compressed_attention_rows_charge_stored_bytes_and_compare_with_f16(dev):
    case = dict(SMALL_CASE, head_dim=256)
    args, nbytes, kw = gpu.attention_inputs(dev, np.random.default_rng(0), "fwht4/lloyd4",
                                            **case)
    q, k_pool, v_pool, tables, _lens, _out = args
    assert k_pool.shape == v_pool.shape == (8, 16, 2, 132) and k_pool.dtype == np.uint8
    assert nbytes == 2 * k_pool.nbytes + 2 * q.nbytes + tables.nbytes  # compressed bytes
    assert kw["kv_dtype"] == "fwht4/lloyd4"
    rows: list[dict] = []
    gpu.bench_attention(dev, Stream(dev), rows, 1e12, None, case=case,
                        dtypes=("float16", "fwht4/q8", "fwht4/lloyd4", "lloyd4/lloyd4"))
    # each 4/2-bit pair: its _mma kernel (default), then its CUDA-core kernel on the same pool
    assert [r["kernel"] for r in rows] == ["paged_attention float16", "paged_attention fwht4/q8",
                                           "paged_attention fwht4/q8 cuda-cores",
                                           "paged_attention fwht4/lloyd4",
                                           "paged_attention fwht4/lloyd4 cuda-cores",
                                           "paged_attention lloyd4/lloyd4",
                                           "paged_attention lloyd4/lloyd4 cuda-cores"]
    assert "vs_float16" not in rows[0]
    # the stub: 0.5 ms per graph, whose launches number by the pools' bytes (rotation)
    # (8 blocks x 16 tokens x 2 heads, each a K and a V row: 512 + 512, 132 + 272, 132 + 132)
    calls = {n: gpu.attention_rotation(dev, 8 * 16 * 2 * row)[1]
             for n, row in (("float16", 1024), ("fwht4/q8", 132 + 272), ("4/4", 264))}
    assert calls == {"float16": 128, "fwht4/q8": 325, "4/4": 497}
    want = [calls["fwht4/q8"] / calls["float16"]] * 2 + [calls["4/4"] / calls["float16"]] * 4
    assert [r["vs_float16"] for r in rows[1:]] == pytest.approx(want)
    assert all(r["mma_speedup"] == pytest.approx(1.0) for r in rows[2::2])
    assert rows[1]["GB/s"] * rows[1]["us"] * 1e3 == pytest.approx(
        8 * 16 * 2 * (132 + 272) + 2 * 2 * 4 * 256 * 4 + 2 * 4 * 4)


def test_kv_write_rows_charge_float32_in_and_records_out(dev, monkeypatch):
    monkeypatch.setattr(gpu, "KV_WRITE_CASES", (("q8", 128, 2), ("fwht4", 128, 2),
                                                ("lloyd4", 256, 1)))
    rows: list[dict] = []
    gpu.bench_kv_write(dev, Stream(dev), rows, 1e12, tokens=64)
    assert [(r["kernel"], r["shape"]) for r in rows] == [
        ("kv_write q8 f32", "64x2x128"), ("kv_write fwht4 f32", "64x2x128"),
        ("kv_write lloyd4 f32", "64x1x256")]
    assert "vs_q8" not in rows[0] and rows[1]["vs_q8"] == pytest.approx(1.0)
    assert "vs_q8" not in rows[2]  # no q8 row at head_dim 256 in this run
    for r, nbytes in zip(rows, (64 * 2 * 128 * 4 + 64 * 2 * 136, 64 * 2 * 128 * 4 + 64 * 2 * 68,
                                64 * 256 * 4 + 64 * 132), strict=True):
        assert r["us"] == pytest.approx(50.0)  # 0.5 ms / 10 launches
        assert r["GB/s"] * r["us"] * 1e3 == pytest.approx(nbytes)


def test_gemv_rows_charge_weights_x_and_y(dev):
    rows: list[dict] = []
    gpu.bench_gemv(dev, Stream(dev), rows, 1e12, None, [(32, 512)], (1, 2))
    names = [r["kernel"] for r in rows]
    assert names[:5] == ["read probe (ceiling)", "gemv mq4g256v2 b1",
                         "gemv mq4g256v2 b1 (x prepared)", "gemv mq4g256v2 b2",
                         "gemv mq4g256v2 b2 (x prepared)"]
    assert len(rows) == 1 + 5 * 4
    b2 = rows[3]  # weights + x + y of batch 2
    calls = gpu._rotation(dev, 32 * 2 * 136)[1]
    assert b2["GB/s"] * b2["us"] * 1e3 == pytest.approx(32 * 2 * 136 + 4 * 2 * (512 + 32))
    assert b2["us"] == pytest.approx(500.0 / calls)


# The stub runs no kernel, so outputs hold whatever the allocator left: NaN differences.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_tune_sweeps_load_each_variant_and_report(dev, tune, capsys, monkeypatch):
    from pagedkv.kernels import kvcache, weights
    # the sweeps set the launchers' mirrors to each variant's values: restore them after
    monkeypatch.setitem(kvcache.ATTN_PARTITION_TOKENS, "float16", 1024)
    monkeypatch.setattr(weights, "DEQUANT_THREADS", weights.DEQUANT_THREADS)
    monkeypatch.setattr(weights, "DEQUANT_SPAN", weights.DEQUANT_SPAN)
    arch = dev.properties.arch
    images = [({"PKV_ATTN_PARTITION_F16": "512"}, read_object("kvcache", "hip", arch)),
              ({"PKV_ATTN_PARTITION_F16": "1024"}, read_object("kvcache", "hip", arch))]
    stream = Stream(dev)
    tune.sweep_attn(dev, stream, 1e12, gpu, images, case=SMALL_CASE)
    tune.sweep_dequant(dev, stream, 1e12, gpu,
                       [({"PKV_DEQUANT_THREADS": "64"}, read_object("weights", "hip", arch))],
                       shape=(16, 256))
    tune.sweep_gemv(dev, stream, 1e12, gpu, [2, 4], shapes=((32, 512),))
    monkeypatch.setattr(weights, "GEMV_PIPE_STAGES", weights.GEMV_PIPE_STAGES)
    monkeypatch.setattr(weights, "GEMV_PIPE_TILES_PER_WARP", weights.GEMV_PIPE_TILES_PER_WARP)
    tune.sweep_gemv32(dev, stream, 1e12, gpu,
                      [({"PKV_GEMV_PIPE_STAGES": "4"}, read_object("weights", "hip", arch))],
                      shapes=((32, 512),))
    lines = capsys.readouterr().out.splitlines()
    # the stub's gfx90a runs no pipelined GEMV (nor batch 32 off the opt-in MFMA kernel):
    # each case says why and the sweep goes on; the launcher mirrors took the variant's values
    pipe = [line for line in lines if line.startswith("gemv32 ")]
    assert len(pipe) == 2 and all("32x512 {'PKV_GEMV_PIPE_STAGES': '4'}: batch=32: expected "
                                  "1..8" in line for line in pipe)
    assert weights.GEMV_PIPE_STAGES == 4 and weights.GEMV_PIPE_TILES_PER_WARP == 2
    assert [line.split("}")[0] + "}" for line in lines[:2]] == [
        "attn float16 2x64 {'PKV_ATTN_PARTITION_F16': '512'}",
        "attn float16 2x64 {'PKV_ATTN_PARTITION_F16': '1024'}"]
    assert kvcache.ATTN_PARTITION_TOKENS["float16"] == 1024  # the last variant's partition
    assert sum(line.startswith("dequant ") for line in lines) == 8  # 4 formats x f16/f32
    assert sum(line.startswith("gemv ") for line in lines) == 4  # 2 formats x 2 warp counts
    assert weights.DEQUANT_THREADS == 64


def test_gemv_sweeps_load_their_first_variant_before_any_gemv_of_an_objectless_build(
        stub_runtime, tune, capsys, monkeypatch):
    # device_check.sh OBJECTS=0 installs no kernel object: the sweep's first Gemv (the
    # bench's rotating weights) must find the variant it compiled already served. On the
    # stub's gfx90a the fused launch itself is then refused (NVIDIA only), after the two
    # launches were timed on the variant.
    from pagedkv.errors import InvalidArgument, NoDeviceError
    from pagedkv.kernels import device as device_module
    image = read_object("weights", "hip", Device(stub_runtime, 0).properties.arch)

    def no_object(source, backend, arch):
        raise NoDeviceError(f"no kernel object {source}.{arch}.hsaco")
    monkeypatch.setattr(device_module, "read_object", no_object)
    for name in tune.X_KNOBS + tune.F16_KNOBS:
        monkeypatch.setattr(weights, name, getattr(weights, name))
    dev = Device(stub_runtime, 0)  # nothing loaded
    with pytest.raises(InvalidArgument, match="fused_x=True: .* on gfx90a"):
        tune.sweep_gemvx(dev, Stream(dev), 1e12, gpu, [({"PKV_GEMV_X_ROW_TILES": "2"}, image)],
                         [None], [1], ("hfq4g256",), ((32, 512),))
    assert capsys.readouterr().out.startswith("gemvx hfq4g256 b1 32x512 two launches: ")
    assert weights.GEMV_X_ROW_TILES == 2
    dev = Device(stub_runtime, 0)
    with pytest.raises(InvalidArgument, match="f16_x=True"):  # NVIDIA only, likewise
        tune.sweep_gemvf16(dev, Stream(dev), 1e12, gpu, [({}, image)], [4], [8],
                           formats=("hfq4g256",), shapes=((32, 512),))


def _asv_gpu():
    return load_tree_script("asv_bench/benchmarks/gpu.py", "pagedkv_asv_gpu")


def test_asv_tracks_rows_the_bench_emits(dev):
    asv = _asv_gpu()
    rows: list[dict] = []
    stream = Stream(dev)
    gpu.bench_gemv(dev, stream, rows, 1e12, None, [(32, 512)], (1,))
    gpu.bench_dequant(dev, stream, rows, 1e12, (16, 256))
    gpu.bench_fwht(dev, stream, rows, 1e12, 1024)
    gpu.bench_attention(dev, stream, rows, 1e12, None, case=SMALL_CASE)
    n_default = len(rows)
    gpu.bench_attention(dev, stream, rows, 1e12, None, case=dict(SMALL_CASE, head_dim=256),
                        dtypes=("float16", "fwht4/lloyd4"))
    emitted = {r["kernel"] for r in rows}
    tracked = {name.split(" | ")[0] for name in asv.BANDWIDTH_ROWS + asv.TORCH_ROWS}
    # HFQ6 / Q8F16 on tensor cores: NVIDIA sm_80+ only (the stub is a HIP device)
    nvidia_only = {n for n in tracked if n.endswith("(tensor cores)")}
    assert nvidia_only == {f"gemv {fmt} b{b} (tensor cores)" for fmt in ("hfq6g256", "q8f16")
                           for b in (1, 32)}
    assert tracked - nvidia_only <= emitted, tracked - nvidia_only - emitted
    # the other x path's rows (NVIDIA only): labelled by what the default is not
    labels = {fmt: "prep + gemv" if weights.fused_x_by_default(kernel, rotated, 1) else "fused x"
              for fmt, kernel, rotated in (("hfq4g256", "hfq4g256", False),
                                           ("hfq6g256", "hfq6g256", False),
                                           ("q8f16", "q8f16", False),
                                           ("mq4g256v2", "mq4g256v2", True))}
    assert {n.split(" | ")[0] for n in asv.X_PATH_ROWS} == {
        f"gemv {fmt} b1 ({label})" for fmt, label in labels.items()}
    assert labels == {"hfq4g256": "prep + gemv", "hfq6g256": "prep + gemv",
                      "q8f16": "prep + gemv", "mq4g256v2": "fused x"}
    got = asv.by_row(rows, "of_copy")
    assert (rows[3]["kernel"], rows[3]["shape"]) == ("gemv hfq4g256 b1", "32x512")
    assert got["gemv hfq4g256 b1 | 32x512"] == rows[3]["of_copy"]
    assert len(got) == len(rows)  # every row has its fraction of the copy
    assert list(asv.by_row(rows, "vs_float16")) == [
        f"paged_attention q8 | {rows[n_default - 1]['shape']}",
        f"paged_attention q8 cuda-cores | {rows[n_default - 1]['shape']}",
        f"paged_attention q8 unstaged | {rows[n_default - 1]['shape']}",
        f"paged_attention q8 int pass 1 | {rows[n_default - 1]['shape']}",
        f"paged_attention q8 cp.async | {rows[n_default - 1]['shape']}",
        f"paged_attention fwht4/lloyd4 | {rows[-1]['shape']}",
        f"paged_attention fwht4/lloyd4 cuda-cores | {rows[-1]['shape']}"]
    assert asv.by_row(rows, "speedup_vs_torch") == {}  # no torch: no baseline rows


def test_asv_batch32_rows_are_rows_the_bench_emits(dev, monkeypatch):
    """GpuGemvBatch32's rows: the bench's batch-32 GEMV rows (the matrix-unit kernels take
    32 rows; on the stub's gfx90a that is the opt-in MFMA path), one per format and step
    shape."""
    monkeypatch.setenv("PAGEDKV_GEMV_MFMA", "1")
    asv = _asv_gpu()
    rows: list[dict] = []
    gpu.bench_gemv(dev, Stream(dev), rows, 1e12, None, [(32, 512)], (32,))
    tracked = {n.split(" | ")[0] for n in asv.BATCH32_ROWS}
    assert tracked == {"gemv mq4g256v2 b32", "gemv hfq4g256 b32"}
    assert tracked <= {r["kernel"] for r in rows}
    assert len(asv.BATCH32_ROWS) == 2 * len(asv.STEP_SHAPES) == 8
    assert {n.split(" | ")[1] for n in asv.BATCH32_ROWS} == {
        f"{m}x{k}" for m, k in asv.STEP_SHAPES}


def test_asv_gpu_suites_skip_without_a_gpu():
    from pagedkv.errors import NoDeviceError
    from pagedkv.kernels import open_device
    try:
        open_device()
        pytest.skip("a GPU is present")
    except NoDeviceError:
        pass
    asv = _asv_gpu()
    for suite in (asv.GpuBandwidth(), asv.GpuVsTorch(), asv.GpuGemvBatch32()):
        with pytest.raises(NotImplementedError, match="no GPU"):
            suite.setup_cache()
    assert asv.GpuBandwidth().track_percent_of_copy({"x | y": 83.0}, "x | y") == 83.0


def test_copy_bandwidth_without_kernel_objects_is_the_memcpy_alone(dev, monkeypatch):
    # A Cython-only build (-Dcuda=disabled -Dhip=disabled, what a hip/tune.py call needs:
    # it launches only the variants it compiles) has no block-copy kernel: the runtime's
    # memcpy is the reference. The stub's events time every span at 0.5 ms (10 calls).
    nbytes = 1 << 20
    bw, both = gpu.copy_bandwidth(dev, Stream(dev), nbytes)  # the stub runs both copies
    assert bw == pytest.approx(2 * nbytes / 0.5e-4)
    assert both["copy_kernel_GBps"] == pytest.approx(both["memcpy_GBps"])
    from pagedkv.errors import NoDeviceError
    from pagedkv.kernels import device as device_module

    def no_object(source, backend, arch):
        raise NoDeviceError(f"no kernel object {source}.{arch}.hsaco")
    monkeypatch.setattr(device_module, "read_object", no_object)
    dev2 = Device(dev.runtime, 0)  # nothing loaded yet
    bw, both = gpu.copy_bandwidth(dev2, Stream(dev2), nbytes)
    assert bw == pytest.approx(2 * nbytes / 0.5e-4)
    assert both == {"memcpy_GBps": pytest.approx(2 * nbytes / 0.5e-4 / 1e9),
                    "copy_kernel_GBps": None}
