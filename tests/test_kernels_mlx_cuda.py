"""The MLX-CUDA path without a GPU: the launches pagedkv.kernels.mlx.cuda builds for every
kernel, wrapped as MLX's cuda_kernel wraps them (tests/cuda_jit.py), compile with nvcc
for sm_90a; the launch bounds of the hip/ kernels reach MLX's generated kernels; and,
where a libnvrtc is installed, NVRTC itself compiles them with MLX's options. The GPU
run is tests/test_kernels_mlx_gpu.py (marked gpu)."""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
from functools import partial
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from cuda_jit import DEFAULT_HEADER, find_nvrtc, mlx_cuda_source, nvrtc_compile, record_launches
from pagedkv.kernels import weights
from pagedkv.quant.formats import resolve

mx = pytest.importorskip("mlx.core")
cuda = pytest.importorskip("pagedkv.kernels.mlx.cuda")
SM_COUNT = cuda.sm_count        # the autouse fixture replaces it


def _weights_calls(run):
    for fmt, out in (("hfq4g256", mx.float32), ("mq4g256v2", mx.float16),
                     ("hfq3g128", mx.float32), ("mq5g256v2", mx.float16)):
        c = resolve(fmt)
        cuda.dequantize(mx, mx.zeros((c.nbytes(1024),), dtype=mx.uint8), c, 1024, out, run)
    cuda.fwht256(mx, mx.zeros((4, 256)), run)
    for fmt, batch, tc in (("hfq4g256", 1, False), ("q8f16", 8, False),
                           ("mq4g256v2", 5, True)):
        c = resolve(fmt)
        cuda.gemv(mx, mx.zeros((c.nbytes(64 * 512),), dtype=mx.uint8), c, 64, 512,
                  mx.zeros((batch, 512)), run, tensor_cores=tc)
    with mock.patch.dict(os.environ, {"PAGEDKV_GEMV_FUSED_X": "1"}):  # the fused-x kernel
        c = resolve("mq4g256v2")
        cuda.gemv(mx, mx.zeros((c.nbytes(64 * 512),), dtype=mx.uint8), c, 64, 512,
                  mx.zeros((2, 512)), run, tensor_cores=True)


def _kvcache_calls(run):
    q = mx.zeros((2, 8, 128))
    tables, lens = mx.zeros((2, 4), dtype=mx.int32), mx.array([10, 20], dtype=mx.int32)
    for kv_dtype, pool_dtype, row in (("float16", mx.float16, 128), ("bfloat16", mx.bfloat16, 128),
                                      ("q8", mx.uint8, 136)):
        pool = mx.zeros((8, 16, 2, row), dtype=pool_dtype)
        cuda.paged_attention(mx, q, pool, pool, tables, lens, kv_dtype=kv_dtype, scale=0.1,
                             max_seq_len=64, run=run)
    # q8 at 8 query heads per KV head: the unstaged kernel (the one above is staged, q8s)
    pool = mx.zeros((8, 16, 2, 68), dtype=mx.uint8)
    cuda.paged_attention(mx, mx.zeros((2, 16, 64)), pool, pool, tables, lens, kv_dtype="q8",
                         scale=0.1, max_seq_len=64, run=run)
    cuda.kv_q8_quantize(mx, mx.zeros((3, 2, 64), dtype=mx.float16), run)
    cuda.kv_q8_read(mx, mx.zeros((8, 2, 68), dtype=mx.uint8), mx.zeros((3,), dtype=mx.int64),
                    2, 64, mx.float32, run)
    cuda.gather_blocks(mx, mx.zeros((4, 64), dtype=mx.uint8), mx.zeros((2,), dtype=mx.int32),
                       run)
    cuda.gather_blocks(mx, mx.zeros((4, 13), dtype=mx.uint8), mx.zeros((2,), dtype=mx.int32),
                       run)


# The hip/ text each group of kernels is built on ("quant": compat + quant.h only).
CALLS = {"weights": _weights_calls, "kvcache": _kvcache_calls, "quant": _weights_calls}


@pytest.fixture(autouse=True)
def _kernel_cache(tmp_path_factory, monkeypatch):
    """Include files in a test folder, never the user's cache; every cache fresh; no SM
    count (the launches do not depend on the GPU of the machine the tests run on)."""
    monkeypatch.setenv("PAGEDKV_MLX_CUDA_CACHE", str(tmp_path_factory.getbasetemp() / "mlxcu"))
    monkeypatch.setattr(cuda, "sm_count", lambda ordinal=0: 0)
    _clear_caches()
    yield
    cuda.set_header_mode("include")
    _clear_caches()


def _clear_caches():
    for cached in (cuda.hip_include_path, cuda._kernel_source, cuda._dequant_plan,
                   cuda._gemv_plan, cuda._attention_plan):
        cached.cache_clear()


def _common(source: str) -> str:
    """What stands for the shared hip/ text in this mode's headers."""
    return cuda._hip_header(source, cuda.header_mode())


def _launches(source: str) -> list:
    common = _common(source)
    return [launch for launch in record_launches(CALLS[source])
            if launch.kernel.header.endswith(common)]


def _batched(source: str, launches) -> str:
    """One translation unit for every launch of a hip source: MLX's default header, each
    kernel's declaration (its header minus the shared hip/ text), the shared text once,
    then MLX's wrapper of each kernel."""
    common = _common(source)
    decls, bodies, seen = [], [], set()
    for launch in launches:
        if launch.kernel.name in seen:
            continue
        seen.add(launch.kernel.name)
        header = launch.kernel.header
        decls.append(header[len(cuda._PRELUDE):-len(common)])
        wrapped = mlx_cuda_source(launch)
        bodies.append(wrapped[wrapped.index("namespace mlx::core::cu {\n\nnamespace cg"):])
    return DEFAULT_HEADER + cuda._PRELUDE + "".join(decls) + common + "".join(bodies)


@pytest.mark.parametrize("source", ["weights", "kvcache", "quant"])
def test_mlx_wrapped_kernels_compile_with_nvcc_and_keep_their_launch_bounds(source, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc")
    import subprocess

    from cuda_jit import MLX_STAND_IN
    launches = _launches(source)
    assert launches
    path = tmp_path / f"{source}.cu"
    path.write_text(_batched(source, launches))
    done = subprocess.run(["nvcc", "-ptx", "-arch=sm_90a", "-std=c++17", "-I", str(MLX_STAND_IN),
                           str(path), "-o", str(tmp_path / f"{source}.ptx")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    ptx = (tmp_path / f"{source}.ptx").read_text()
    for name in {launch.kernel.name for launch in launches}:
        assert re.search(rf"\.entry \S*custom_kernel_{name}E", ptx), name
    for launch in launches:
        if "__launch_bounds__" not in launch.kernel.header.split(_common(source))[0]:
            continue
        bounds = re.search(r"__launch_bounds__\(([\d, ]+)\)", launch.kernel.header).group(1)
        want = [int(b) for b in bounds.split(",")]
        block = re.search(rf"\.entry \S*custom_kernel_{launch.kernel.name}E[^{{]*", ptx)
        assert block is not None, launch.kernel.name
        assert f".maxntid {want[0]}, 1, 1" in block.group(0), launch.kernel.name
        if len(want) > 1:
            assert f".minnctapersm {want[1]}" in block.group(0), launch.kernel.name


@pytest.mark.parametrize("mode", ["include", "inline"])
@pytest.mark.parametrize("source", ["kvcache"])
def test_nvrtc_compiles_the_exact_mlx_source(source, mode):
    lib = find_nvrtc()
    if lib is None:
        pytest.skip("no libnvrtc (pip install nvidia-cuda-nvrtc, or set PAGEDKV_NVRTC_LIBRARY)")
    cuda.set_header_mode(mode)  # include: NVRTC reads the hip/ text from the cached file
    launches = record_launches(CALLS[source])
    by_name = {launch.kernel.name: launch for launch in launches}
    launch = next(v for k, v in by_name.items() if k.startswith("pagedkv_paged_attention_f16"))
    ok, log = nvrtc_compile(lib, mlx_cuda_source(launch), launch.kernel.name)
    assert ok, log[-4000:]


def test_launch_geometry_is_the_hip_launchers_and_launch_h():
    from pagedkv.kernels import kvcache, weights
    from pagedkv.kernels.launch_constants import launch_constant
    for kv_dtype, suffix in (("float16", "F16"), ("bfloat16", "BF16"), ("q8", "Q8")):
        geo = cuda.attention_geometry(kv_dtype, 32, 8, 128)
        partition = launch_constant(f"PKV_ATTN_PARTITION_{suffix}")
        assert geo["partition"] == partition == kvcache.ATTN_PARTITION_TOKENS[kv_dtype]
        assert geo["bounds"] == (launch_constant("PKV_ATTN_THREADS"),
                                 launch_constant(f"PKV_ATTN_MIN_BLOCKS_{suffix}"))
        assert geo["shared"] == 4 * max(partition * 4, 4 * 4 * 128)
    assert weights.GEMV_THREADS == launch_constant("PKV_GEMV_THREADS")
    assert weights.DEQUANT_THREADS == launch_constant("PKV_DEQUANT_THREADS")
    assert weights.DEQUANT_SPAN == launch_constant("PKV_DEQUANT_SPAN")
    launches = record_launches(_kvcache_calls)
    attn = next(launch for launch in launches if "attention_f16" in launch.kernel.name)
    # 2 seqs, 2 KV heads, ceil(64 / 1024) partitions of 128 threads; 4 heads per KV head
    assert attn.grid == (128, 2, 2) and attn.threadgroup == (128, 1, 1)
    assert attn.kernel.shared_memory == 4 * max(1024 * 4, 4 * 4 * 128)
    reduce = next(launch for launch in launches if launch.kernel.name.endswith("reduce"))
    # one partition: one 32-lane warp per (head, seq) (kvcache.reduce_threads)
    assert reduce.grid == (8 * 32, 2, 1) and reduce.threadgroup == (32, 1, 1)
    params = np.array(attn.inputs[-1])
    # scale bits, heads, kv heads, head_dim, block size, table width, partitions, tokens each
    assert params[0] == np.float32(0.1).view(np.int32) and list(params[1:]) == [8, 2, 128, 16,
                                                                                4, 1, 1024]


# -- per-call host work (docs/kernels.md, "MLX dispatch") ------------------------------------

def test_include_headers_are_small_and_name_a_file_holding_the_hip_text():
    launches = record_launches(_weights_calls) + record_launches(_kvcache_calls)
    files = set()
    for launch in launches:
        header = launch.kernel.header
        assert len(header) < 2048, (launch.kernel.name, len(header))
        line = header.rstrip("\n").rsplit("\n", 1)[-1]
        m = re.fullmatch(r'#include "(/[^"]+)"', line)
        assert m is not None, line
        files.add(m.group(1))
    texts = {Path(f).read_text() for f in files}
    assert texts == {cuda._hip_text(s) for s in ("weights", "kvcache", "quant")}
    for f in files:  # named by the text's digest: another pagedkv never reads this file
        source, digest = Path(f).stem.split("-")
        assert source in ("weights", "kvcache", "quant")
        assert hashlib.sha256(Path(f).read_bytes()).hexdigest()[:20] == digest
        assert Path(f).parent == Path(os.environ["PAGEDKV_MLX_CUDA_CACHE"]).resolve()


def test_a_stale_or_damaged_include_file_is_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_MLX_CUDA_CACHE", str(tmp_path))
    path = Path(cuda.hip_include_path("kvcache"))
    path.write_text("garbage")
    cuda.hip_include_path.cache_clear()
    assert cuda.hip_include_path("kvcache") == str(path)
    assert path.read_text() == cuda._hip_text("kvcache")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


def test_an_unwritable_cache_falls_back_to_inline_headers(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDKV_MLX_CUDA_CACHE", str(blocker / "sub"))
    with caplog.at_level("WARNING", logger="pagedkv"):
        launches = record_launches(_kvcache_calls)
    assert "PAGEDKV_MLX_CUDA_CACHE" in caplog.text
    assert launches
    assert all(launch.kernel.header.endswith(cuda._hip_text("kvcache")) for launch in launches)


def test_inline_mode_is_the_earlier_path_and_both_stay_cached():
    gemv = partial(_one_gemv, tc=True)
    include = [launch.kernel for launch in record_launches(gemv)]
    cuda.set_header_mode("inline")
    inline = [launch.kernel for launch in record_launches(gemv)]
    assert [k.name for k in include] == [k.name for k in inline]
    for a, b in zip(include, inline, strict=True):
        assert b.header.endswith(cuda._hip_text("weights"))
        assert a.header.split("#include")[0] == b.header[:-len(cuda._hip_text("weights"))]
        assert (a.source, a.input_names) == (b.source, b.input_names)
    cuda.set_header_mode("include")
    assert [launch.kernel for launch in record_launches(gemv)] == include


def test_a_bad_header_mode_is_refused_and_changes_nothing():
    from pagedkv.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="PAGEDKV_MLX_CUDA_HEADER"):
        cuda.set_header_mode("tiny")
    assert cuda.header_mode() == "include"


def _one_gemv(run, *, tc: bool, batch: int = 1, x=None):
    c = resolve("hfq4g256")
    x = mx.zeros((batch, 512)) if x is None else x
    return cuda.gemv(mx, mx.zeros((c.nbytes(64 * 512),), dtype=mx.uint8), c, 64, 512, x, run,
                     tensor_cores=tc)


class _FakeCudaKernel:
    """``mx.fast.cuda_kernel`` stand-in: counts kernel objects built and calls made."""

    def __init__(self):
        self.built, self.calls = [], 0

    def __call__(self, **kw):
        self.built.append(kw["name"])

        def launch(**call):
            self.calls += 1
            return [mx.zeros(s, dtype=d) for s, d in zip(call["output_shapes"],
                                                         call["output_dtypes"], strict=True)]
        return launch


@pytest.mark.parametrize("tc", [True, False])
def test_repeated_calls_reuse_kernel_objects_and_build_no_source(monkeypatch, tc):
    from pagedkv.kernels.mlx import launch as launch_mod
    fake = _FakeCudaKernel()
    monkeypatch.setattr(mx.fast, "cuda_kernel", fake)
    launch_mod._cuda_kernel.cache_clear()
    try:
        x = mx.zeros((3, 512))
        _one_gemv(launch_mod.run_cuda, tc=tc, x=x)
        built, sources = list(fake.built), cuda._kernel_source.cache_info()
        calls = fake.calls
        for _ in range(10):
            _one_gemv(launch_mod.run_cuda, tc=tc, x=x)
        assert fake.built == built  # no new kernel object
        assert cuda._kernel_source.cache_info().misses == sources.misses  # no source rebuilt
        assert fake.calls == 11 * calls
        # tensor cores: prep + mma; f32 kernel: one launch (HFQ4G256 is not rotated)
        assert calls == (2 if tc else 1) and len(built) == calls
    finally:
        launch_mod._cuda_kernel.cache_clear()


def test_gemv_of_at_most_8_rows_launches_on_x_itself(monkeypatch):
    import pagedkv.kernels.mlx as K
    launches = []

    def record(launch):
        launches.append(launch)
        return [mx.zeros(s, dtype=d) for s, d in zip(launch.output_shapes, launch.output_dtypes,
                                                     strict=True)]
    monkeypatch.setattr(K, "_impl", lambda: ("cuda", cuda, record))
    c = resolve("hfq4g256")
    w = K.GemvWeights(mx.zeros((c.nbytes(64 * 512),), dtype=mx.uint8), c, 64, 512, "cuda", True)
    x = mx.zeros((8, 512))
    assert K.gemv(w, x).shape == (8, 64)
    assert launches[0].inputs[0] is x and len(launches) == 2
    launches.clear()
    assert K.gemv(w, mx.zeros((11, 512))).shape == (11, 64)
    assert [launch.inputs[0].shape for launch in launches[::2]] == [(8, 512), (3, 512)]


@pytest.mark.parametrize("fmt,rotate", [("hfq4g256", 0), ("mq4g256v2", 1)])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_gemv_fused_x_is_one_launch_on_the_mma_grid(monkeypatch, fmt, rotate, batch):
    c = resolve(fmt)
    w, x = mx.zeros((c.nbytes(64 * 512),), dtype=mx.uint8), mx.zeros((batch, 512))
    monkeypatch.setenv("PAGEDKV_GEMV_FUSED_X", "0")
    two = record_launches(lambda run: cuda.gemv(mx, w, c, 64, 512, x, run, tensor_cores=True))
    monkeypatch.setenv("PAGEDKV_GEMV_FUSED_X", "1")
    one = record_launches(lambda run: cuda.gemv(mx, w, c, 64, 512, x, run, tensor_cores=True))
    if batch > 2:  # two n-tiles: no fused kernel, the prep and the mma as before
        assert [launch.kernel.name for launch in one] == [launch.kernel.name for launch in two]
        return
    (fused,) = one
    prep, mma = two
    assert prep.kernel.name == "pagedkv_gemv_prep_x"
    assert fused.kernel.name == f"pagedkv_gemv_mma_x_{fmt}_n1"
    assert fused.kernel.source.startswith(f"pkv_gemv_mma_x_{fmt}_n1<>(w, x, y, ")
    assert fused.inputs[0] is w and fused.inputs[1] is x
    assert np.array(fused.inputs[2]).tolist() == [64, 512, batch, rotate]
    # weights.fused_x_grid: 2 row tiles a block (launch.h), the groups' warps as the mma's
    blocks, warps = weights.fused_x_grid(fmt, 64, 512)
    assert blocks == -(-4 // weights.GEMV_X_ROW_TILES)
    assert (fused.grid, fused.threadgroup) == ((blocks * warps * 32, 1, 1), mma.threadgroup)
    assert (fused.output_shapes, fused.output_dtypes) == (mma.output_shapes, mma.output_dtypes)


def _record_launches(launches):
    def record(launch):
        launches.append(launch)
        return [mx.zeros(s, dtype=d) for s, d in zip(launch.output_shapes, launch.output_dtypes,
                                                     strict=True)]
    return record


@pytest.mark.parametrize("kv_dtype, pool_dtype, row", [("float16", "float16", 64),
                                                       ("q8", "uint8", 68)])
def test_attention_splits_the_context_over_the_gpus_sms(monkeypatch, kv_dtype, pool_dtype, row):
    """With an SM count the MLX launches split the context as PagedAttention does
    (attention_partition_tokens): batch 1 over 1,025 tokens with 2 KV heads on 132 SMs is
    one wave of 64-token partitions, where the most tokens per partition gave 2-5 CTAs."""
    from pagedkv.kernels import kvcache
    monkeypatch.setattr(cuda, "sm_count", lambda ordinal=0: 132)
    launches = []
    q = mx.zeros((1, 4, 64))
    pool = mx.zeros((80, 16, 2, row), dtype=getattr(mx, pool_dtype))
    tables = mx.zeros((1, 80), dtype=mx.int32)
    cuda.paged_attention(mx, q, pool, pool, tables, mx.array([1025], dtype=mx.int32),
                         kv_dtype=kv_dtype, scale=0.125, max_seq_len=1025,
                         run=_record_launches(launches))
    tokens = kvcache.attention_partition_tokens(kv_dtype, 1, 2, 1025, 132)
    parts = math.ceil(1025 / tokens)
    assert tokens == 64 and parts == 17
    threads = kvcache.ATTN_THREADS
    assert launches[0].grid == (parts * threads, 2, 1)
    assert launches[0].output_shapes[1] == (1, 4, parts)
    params = np.array(launches[0].inputs[-1], copy=False)
    assert params[-2:].tolist() == [parts, tokens]           # the kernel's partition scalars
    assert np.array(launches[1].inputs[-1], copy=False)[-2:].tolist() == [parts, tokens]
    # without an SM count: the most tokens per partition
    monkeypatch.setattr(cuda, "sm_count", lambda ordinal=0: 0)
    launches.clear()
    cuda.paged_attention(mx, q, pool, pool, tables, mx.array([1025], dtype=mx.int32),
                         kv_dtype=kv_dtype, scale=0.125, max_seq_len=1025,
                         run=_record_launches(launches))
    most = kvcache.ATTN_PARTITION_TOKENS[kv_dtype]
    assert launches[0].grid == (math.ceil(1025 / most) * threads, 2, 1)


@pytest.mark.parametrize("sms, seqs, heads, head_dim, env, staged", [
    (0, 2, 8, 128, None, True),       # no SM count: staged (q8_stage_pays)
    (132, 32, 8, 128, None, True),    # 32 x 2 KV heads x 3 partitions of 352: two waves
    (132, 1, 8, 128, None, False),    # batch 1 over 1,025: 17 x 64 tokens on 132 SMs
    (0, 2, 16, 128, None, False),     # 8 query heads per KV head: no staged kernel
    (0, 2, 4, 256, None, False),      # head_dim 256: none either
    (0, 2, 8, 64, None, True),
    (0, 2, 8, 128, "0", False),       # PAGEDKV_ATTN_Q8_STAGE=0
])
def test_q8_attention_is_staged_where_the_ctypes_launcher_stages_it(monkeypatch, sms, seqs,
                                                                     heads, head_dim, env,
                                                                     staged):
    """The MLX q8 attention runs the staged kernels (q8s) by PagedAttention's default rule
    (kvcache.q8_staged_by_default), with cp.async copies: zero tensor maps and use_maps 0."""
    from pagedkv.kernels import kvcache
    monkeypatch.setattr(cuda, "sm_count", lambda ordinal=0: sms)
    if env is None:
        monkeypatch.delenv("PAGEDKV_ATTN_Q8_STAGE", raising=False)
    else:
        monkeypatch.setenv("PAGEDKV_ATTN_Q8_STAGE", env)
    launches = []
    row = head_dim // 32 * 34
    pool = mx.zeros((80, 16, 2, row), dtype=mx.uint8)
    n = 1025
    cuda.paged_attention(mx, mx.zeros((seqs, heads, head_dim)), pool, pool,
                         mx.zeros((seqs, 80), dtype=mx.int32),
                         mx.array([n] * seqs, dtype=mx.int32), kv_dtype="q8", scale=0.125,
                         max_seq_len=n, run=_record_launches(launches))
    gmax = kvcache.attention_group_slots(heads, 2)
    tokens = kvcache.attention_partition_tokens("q8", seqs, 2, n, sms)
    assert staged == kvcache.q8_staged_by_default(head_dim, gmax, tokens,
                                                  seqs * 2 * math.ceil(n / tokens), sms)
    kernel = launches[0].kernel
    assert kernel.name.startswith(f"pagedkv_paged_attention_q8{'s' if staged else ''}_g{gmax}_")
    assert kernel.source.endswith("(int)params[7], PkvTensorMap{}, PkvTensorMap{}, 0);"
                                  if staged else "(int)params[7]);")


def test_sm_count_is_zero_without_a_driver(monkeypatch):
    monkeypatch.setattr(cuda, "sm_count", SM_COUNT)     # the module's own, uncached
    cuda.sm_count.cache_clear()
    monkeypatch.setenv("PAGEDKV_CUDA_LIBRARY", "/nonexistent/libcuda.so")
    try:
        assert cuda.sm_count() == 0
    finally:
        cuda.sm_count.cache_clear()


def test_consecutive_decode_lengths_share_one_attention_plan():
    """A decode step is one token longer than the last: the plan is keyed by the partition
    count, so steps inside one partition build nothing (mlx-lm's attention="paged" calls
    this once per layer per step); the next partition gets its own."""
    launches = []

    def record(launch):
        launches.append(launch)
        return [mx.zeros(s, dtype=d) for s, d in zip(launch.output_shapes, launch.output_dtypes,
                                                     strict=True)]
    q = mx.zeros((1, 4, 64))
    pool = mx.zeros((80, 16, 2, 64), dtype=mx.float16)
    tables = mx.zeros((1, 80), dtype=mx.int32)
    for n in range(1000, 1030):
        cuda.paged_attention(mx, q, pool, pool, tables, mx.array([n], dtype=mx.int32),
                             kv_dtype="float16", scale=0.125, max_seq_len=n, run=record)
    info = cuda._attention_plan.cache_info()
    assert info.misses == 2 and info.hits == 28  # 1000..1024: one partition; 1025..: two
    grids = [launch.grid for launch in launches[::2]]
    assert grids[0] != grids[-1] and len(set(grids)) == 2
