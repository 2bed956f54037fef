"""The MLX-CUDA path without a GPU: the launches pagedkv.kernels.mlx.cuda builds for every
kernel, wrapped as MLX's cuda_kernel wraps them (tests/cuda_jit.py), compile with nvcc
for sm_90a; the launch bounds of the hip/ kernels reach MLX's generated kernels; and,
where a libnvrtc is installed, NVRTC itself compiles them with MLX's options. The GPU
run is tests/test_kernels_mlx_gpu.py (marked gpu)."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

from cuda_jit import DEFAULT_HEADER, find_nvrtc, mlx_cuda_source, nvrtc_compile, record_launches
from pagedkv.quant.formats import resolve

mx = pytest.importorskip("mlx.core")
cuda = pytest.importorskip("pagedkv.kernels.mlx.cuda")


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


def _kvcache_calls(run):
    q = mx.zeros((2, 8, 128))
    tables, lens = mx.zeros((2, 4), dtype=mx.int32), mx.array([10, 20], dtype=mx.int32)
    for kv_dtype, pool_dtype, row in (("float16", mx.float16, 128), ("q8", mx.uint8, 136)):
        pool = mx.zeros((8, 16, 2, row), dtype=pool_dtype)
        cuda.paged_attention(mx, q, pool, pool, tables, lens, kv_dtype=kv_dtype, scale=0.1,
                             max_seq_len=64, run=run)
    cuda.kv_q8_quantize(mx, mx.zeros((3, 2, 64), dtype=mx.float16), run)
    cuda.kv_q8_read(mx, mx.zeros((8, 2, 68), dtype=mx.uint8), mx.zeros((3,), dtype=mx.int64),
                    2, 64, mx.float32, run)
    cuda.gather_blocks(mx, mx.zeros((4, 64), dtype=mx.uint8), mx.zeros((2,), dtype=mx.int32),
                       run)
    cuda.gather_blocks(mx, mx.zeros((4, 13), dtype=mx.uint8), mx.zeros((2,), dtype=mx.int32),
                       run)


# The hip/ text each group of kernels is built on ("quant": compat + quant.h only).
CALLS = {"weights": _weights_calls, "kvcache": _kvcache_calls, "quant": _weights_calls}


def _launches(source: str) -> list:
    common = cuda._hip_text(source)
    return [launch for launch in record_launches(CALLS[source])
            if launch.kernel.header.endswith(common)]


def _batched(source: str, launches) -> str:
    """One translation unit for every launch of a hip source: MLX's default header, each
    kernel's declaration (its header minus the shared hip/ text), the shared text once,
    then MLX's wrapper of each kernel."""
    common = cuda._hip_text(source)
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
        if "__launch_bounds__" not in launch.kernel.header.split(cuda._hip_text(source))[0]:
            continue
        bounds = re.search(r"__launch_bounds__\(([\d, ]+)\)", launch.kernel.header).group(1)
        want = [int(b) for b in bounds.split(",")]
        block = re.search(rf"\.entry \S*custom_kernel_{launch.kernel.name}E[^{{]*", ptx)
        assert block is not None, launch.kernel.name
        assert f".maxntid {want[0]}, 1, 1" in block.group(0), launch.kernel.name
        if len(want) > 1:
            assert f".minnctapersm {want[1]}" in block.group(0), launch.kernel.name


@pytest.mark.parametrize("source", ["kvcache"])
def test_nvrtc_compiles_the_exact_mlx_source(source):
    lib = find_nvrtc()
    if lib is None:
        pytest.skip("no libnvrtc (pip install nvidia-cuda-nvrtc, or set PAGEDKV_NVRTC_LIBRARY)")
    launches = record_launches(CALLS[source])
    by_name = {launch.kernel.name: launch for launch in launches}
    launch = next(v for k, v in by_name.items() if k.startswith("pagedkv_paged_attention_f16"))
    ok, log = nvrtc_compile(lib, mlx_cuda_source(launch), launch.kernel.name)
    assert ok, log[-4000:]


def test_launch_geometry_mirrors_the_hip_launchers():
    from pagedkv.kernels import kvcache, weights
    assert cuda.hip_constant("kvcache", "PKV_ATTN_THREADS") == kvcache.ATTN_THREADS
    assert cuda.hip_constant("kvcache", "PKV_ATTN_PARTITION_F16") == \
        kvcache.ATTN_PARTITION_TOKENS["float16"]
    assert cuda.hip_constant("kvcache", "PKV_ATTN_PARTITION") == kvcache.ATTN_PARTITION_TOKENS["q8"]
    assert cuda.hip_constant("weights", "GEMV_THREADS") == weights.GEMV_THREADS
    assert cuda.hip_constant("weights", "DEQUANT_THREADS") == weights.DEQUANT_THREADS
    assert cuda.hip_constant("weights", "DEQUANT_SPAN") == weights.DEQUANT_SPAN
    launches = record_launches(_kvcache_calls)
    attn = next(launch for launch in launches if "attention_f16" in launch.kernel.name)
    # 2 seqs, 2 KV heads, ceil(64 / 1024) partitions of 128 threads; 4 heads per KV head
    assert attn.grid == (128, 2, 2) and attn.threadgroup == (128, 1, 1)
    assert attn.kernel.shared_memory == 4 * max(1024 * 4, 4 * 4 * 128)
    reduce = next(launch for launch in launches if launch.kernel.name.endswith("reduce"))
    assert reduce.grid == (8 * 128, 2, 1) and reduce.threadgroup == (128, 1, 1)
    params = np.array(attn.inputs[-1])
    assert params[0] == np.float32(0.1).view(np.int32) and list(params[1:]) == [8, 2, 128, 16,
                                                                                4, 1]
