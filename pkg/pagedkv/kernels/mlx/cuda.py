"""The ``hip/`` kernels as MLX launches on MLX's CUDA backend (``mx.fast.cuda_kernel``).

The device code is ``hip/weights.hip`` and ``hip/kvcache.hip`` themselves, compiled by
NVRTC inside MLX: the header is ``hip/pagedkv_compat.h`` (with the public headers it
includes), then ``PKV_KERNEL`` turned from ``extern "C" __global__`` into a
``__device__`` function template and ``__launch_bounds__`` emptied, then the source.
Every hip/ kernel is then an inline device function with its original parameters, and
each MLX body is one call of it, scalars read from an ``int64`` ``params`` input. The
``__launch_bounds__`` of the original kernel (which the tuning on the H200 chose)
reach MLX's generated kernel through a declaration of it, with the bounds, ahead of
MLX's definition. Launch geometry is :mod:`pagedkv.kernels.kvcache`'s and :mod:`pagedkv.kernels.weights`'s:
threads, partitions, rows per block and ``__launch_bounds__`` come from
``pagedkv/launch.h`` through those modules (:mod:`pagedkv.kernels.launch_constants`), the
same header the kernel text includes, so there is one value of each.

Formats the hip/ kernels do not decode (every P1 affine format but HFQ4G256, MQ4G256,
MQ4G256V2 and HFQ6G256) dequantize with a one-weight-per-thread body on quant.h's
``pkv_affine_params`` and ``pkv_unpack_code``.

MLX copies a kernel's header into a new source string on every call and hashes that
string on every launch (``mlx/backend/cuda/custom_kernel.cpp``: ``build_kernel`` in the
call, ``std::hash`` of the source in ``eval_gpu``), so a 20-45 KB header costs host time
per call. The default header mode, ``include``, writes each hip/ text once to a file
named by its SHA-256 (:func:`hip_include_path`) and passes only ``#include "<file>"``
(NVRTC reads it once, when the kernel compiles); ``inline`` passes the text itself (the
earlier path, kept selectable: ``PAGEDKV_MLX_CUDA_HEADER=inline`` or
:func:`set_header_mode`). docs/kernels.md, "MLX dispatch".
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
from pathlib import Path

import numpy as np

from pagedkv.kernels.mlx.launch import KernelSource, Launch, Runner
from pagedkv.kernels.mlx.sources import inline_includes, strip_comments
from pagedkv.quant import kv_q8

__all__ = [
    "copy_blocks",
    "dequantize",
    "fwht256",
    "gather_blocks",
    "gemv",
    "header_mode",
    "hip_include_path",
    "kernel_source",
    "kv_q8_quantize",
    "kv_q8_read",
    "paged_attention",
    "set_header_mode",
]

logger = logging.getLogger("pagedkv")

# The hip/ kernel each weight format runs (hip/weights.hip; pagedkv.kernels.weights).
HIP_WEIGHT_KERNELS = {"hfq4g256": "hfq4g256", "mq4g256": "hfq4g256",
                      "mq4g256v2": "mq4g256v2", "hfq6g256": "hfq6g256", "q8f16": "q8f16"}
MMA_KERNELS = ("hfq4g256", "mq4g256v2")
KV_NAMES = {"float16": "f16", "bfloat16": "bf16", "q8": "q8"}

# MLX's CUDA type names of dtypes in generated signatures (mlx/backend/cuda/utils.cpp).
CUDA_TYPES = {"uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t",
              "int32": "int32_t", "int64": "int64_t", "float32": "float",
              "float16": "__half", "bfloat16": "__nv_bfloat16"}

_PRELUDE = """#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
"""
_DEVICE_KERNELS = """#undef PKV_KERNEL
#define PKV_KERNEL template <int PKV_JIT_ = 0> __device__ __forceinline__
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef PKV_GRID_CONSTANT
#define PKV_GRID_CONSTANT
"""


@functools.cache
def _hip_text(source: str) -> str:
    """hip/<source>.hip with its includes inlined and every kernel a device template
    (``quant``: hip/pagedkv_compat.h and pagedkv/quant.h alone)."""
    done: set[str] = set()
    compat = inline_includes("hip/pagedkv_compat.h", done=done)
    if source == "quant":
        return strip_comments(compat + inline_includes("pagedkv/quant.h", done=done))
    body = inline_includes(f"hip/{source}.hip", done=done)
    return strip_comments(compat + _DEVICE_KERNELS + body)


#: How a kernel's header carries its hip/ text (module docstring).
HEADER_MODES = ("include", "inline")
_header_mode = [os.environ.get("PAGEDKV_MLX_CUDA_HEADER", "") or "include"]


def set_header_mode(mode: str) -> None:
    """``"include"`` (default) or ``"inline"``: how kernels built from now on carry the
    hip/ text (kernels already built keep theirs; both kinds stay cached side by side)."""
    if mode not in HEADER_MODES:
        from pagedkv.errors import InvalidArgument
        raise InvalidArgument(f"header mode {mode!r}: expected one of {HEADER_MODES} "
                              f"(PAGEDKV_MLX_CUDA_HEADER)")
    _header_mode[0] = mode
    for plan in (_dequant_plan, _gemv_plan, _attention_plan):
        plan.cache_clear()  # plans hold kernels of the mode they were built in


def header_mode() -> str:
    """The header mode of kernels built now (``PAGEDKV_MLX_CUDA_HEADER`` at import, or
    :func:`set_header_mode`)."""
    mode = _header_mode[0]
    if mode not in HEADER_MODES:
        set_header_mode(mode)  # raises, naming the variable
    return mode


def _cache_dir() -> Path:
    env = os.environ.get("PAGEDKV_MLX_CUDA_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedkv" / "mlx-cuda"


@functools.cache
def hip_include_path(source: str) -> str | None:
    """The file holding :func:`_hip_text` of ``source``, written once (atomically) under
    ``PAGEDKV_MLX_CUDA_CACHE`` (default ``$XDG_CACHE_HOME/pagedkv/mlx-cuda``) and named by
    the text's SHA-256, so a changed pagedkv never meets an old file; None (callers inline
    the text) when it cannot be written or its path cannot be quoted in an ``#include``."""
    text = _hip_text(source)
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    path = (_cache_dir() / f"{source}-{digest}.cuh").resolve()
    if any(c in str(path) for c in '"\\\n') or not path.is_absolute():
        logger.warning("pagedkv.kernels.mlx: cache path %s cannot be #included; the CUDA "
                       "kernels inline their headers", path)
        return None
    try:
        if not (path.is_file() and path.read_text() == text):
            path.parent.mkdir(parents=True, exist_ok=True)
            temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            temp.write_text(text)
            os.replace(temp, path)
    except OSError as exc:
        logger.warning("pagedkv.kernels.mlx: cannot write %s (%s); the CUDA kernels inline "
                       "their headers (set PAGEDKV_MLX_CUDA_CACHE to a writable folder)",
                       path, exc)
        return None
    return str(path)


def _hip_header(source: str, mode: str) -> str:
    """What stands for hip/<source>'s text in a header: an ``#include`` of its file, or
    the text itself."""
    path = hip_include_path(source) if mode == "include" else None
    return _hip_text(source) if path is None else f'#include "{path}"\n'


@functools.cache
def _dtype_name(dtype) -> str:
    # str() of an mx.Dtype costs ~7 us (nanobind repr); launches name dtypes on every call
    return str(dtype).rpartition(".")[2]


def kernel_source(source: str, name: str, inputs: tuple[tuple[str, str], ...],
                  outputs: tuple[tuple[str, str], ...], body: str,
                  bounds: tuple[int, ...] | None, shared_memory: int = 0) -> KernelSource:
    """One cuda_kernel: ``inputs``/``outputs`` are (name, dtype name) pairs in MLX's order;
    ``bounds`` the ``__launch_bounds__`` arguments its generated kernel is declared with;
    the header in the current :func:`header_mode`."""
    return _kernel_source(source, name, inputs, outputs, body, bounds, shared_memory,
                          header_mode())


@functools.cache
def _kernel_source(source: str, name: str, inputs: tuple[tuple[str, str], ...],
                   outputs: tuple[tuple[str, str], ...], body: str,
                   bounds: tuple[int, ...] | None, shared_memory: int,
                   mode: str) -> KernelSource:
    kernel_name = f"pagedkv_{name}"
    decl = ""
    if bounds is not None:
        params = [f"const {CUDA_TYPES[t]}* {n}" for n, t in inputs]
        params += [f"{CUDA_TYPES[t]}* {n}" for n, t in outputs]
        decl = (f"namespace mlx::core::cu {{\n__global__ void __launch_bounds__("
                f"{', '.join(map(str, bounds))}) custom_kernel_{kernel_name}(\n    "
                + ",\n    ".join(params) + ");\n}\n")
    return KernelSource(name=kernel_name, input_names=tuple(n for n, _ in inputs),
                        output_names=tuple(n for n, _ in outputs), source=body,
                        header=_PRELUDE + decl + _hip_header(source, mode), cooperative=True,
                        shared_memory=shared_memory)


def _params(mx, *values: int):
    """The scalars of a launch as a small ``int64`` input, one array per distinct tuple
    (a decode step re-launches with the same values: no new host-to-device copy)."""
    return _cached_params(tuple(int(v) for v in values))


@functools.lru_cache(maxsize=64)
def _iota(n: int, dtype: str):
    """0..n-1 (the slots a launch writes its outputs in order), cached per length."""
    import mlx.core as mx
    arr = mx.arange(n, dtype=getattr(mx, dtype))
    mx.eval(arr)
    return arr


@functools.lru_cache(maxsize=4096)
def _cached_params(values: tuple[int, ...]):
    import mlx.core as mx
    arr = mx.array(np.asarray(values, dtype=np.int64))
    mx.eval(arr)
    return arr


def _io(*pairs) -> tuple[tuple[str, str], ...]:
    return tuple((n, _dtype_name(t)) for n, t in pairs)


@functools.lru_cache(maxsize=1024)
def _dequant_plan(codec_name: str, numel: int, f16: bool):
    """``(source, params, grid, threads)`` of one dequantize configuration, built once."""
    import mlx.core as mx

    from pagedkv.kernels import weights
    from pagedkv.quant.formats import resolve
    codec = resolve(codec_name)
    out_t = "(uint16_t*)out" if f16 else "out"
    kernel = HIP_WEIGHT_KERNELS.get(codec.name)
    io_in = _io(("raw", mx.uint8), ("params", mx.int64))
    io_out = _io(("out", mx.float16 if f16 else mx.float32))
    if kernel is not None:
        span, threads = weights.DEQUANT_SPAN, weights.DEQUANT_THREADS
        suffix = "f16" if f16 else "f32"
        src = kernel_source("weights", f"dequant_{kernel}_{suffix}", io_in, io_out,
                            f"pkv_dequant_{kernel}_{suffix}<>(raw, {out_t}, params[0]);",
                            (threads,))
        blocks = math.ceil(numel / (span * threads))
        return src, _params(mx, numel), (blocks * threads, 1, 1), threads
    # One kernel for every other format (the layout comes in params): NVRTC compiles it
    # once per output dtype, not once per format.
    threads = 256
    value = "__float2half_rn(v)" if f16 else "v"
    body = (
        "const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;\n"
        "if (i >= params[0]) return;\n"
        "const int family = (int)params[1];\n"
        "const uint32_t bits = (uint32_t)params[2];\n"
        "const int64_t G = params[3], B = params[4];\n"
        "const int64_t g = i / G;\n"
        "const uint32_t e = (uint32_t)(i - g * G);\n"
        "const uint8_t* blk = raw + g * B;\n"
        "float s, o;\n"
        "pkv_affine_params(blk, family, e, &s, &o);\n"
        "const float v = (float)pkv_unpack_code(blk + PKV_AFFINE_HEADER_BYTES, e, bits) "
        "* s + o;\n"
        f"out[i] = {value};")
    src = kernel_source("quant", f"dequant_affine_{'f16' if f16 else 'f32'}", io_in, io_out,
                        body, (threads,))
    assert codec.family is not None  # every P1 format without a hip/ kernel is affine
    params = _params(mx, numel, int(codec.family), codec.bits, codec.group_size,
                     codec.group_bytes)
    return src, params, (math.ceil(numel / threads) * threads, 1, 1), threads


def dequantize(mx, raw, codec, numel: int, out_dtype, run: Runner):
    """``out_dtype[numel]`` weights in the stored basis (hip/ kernel where one exists)."""
    src, params, grid, threads = _dequant_plan(codec.name, numel, out_dtype == mx.float16)
    return run(Launch(src, [raw, params], [(numel,)], [out_dtype], grid=grid,
                      threadgroup=(threads, 1, 1)))[0]


def fwht256(mx, x, run: Runner):
    """hip/ ``pkv_fwht256_f32``: a warp per 256-group, eight groups per 256-thread block."""
    groups = x.size // 256
    src = kernel_source("weights", "fwht256_f32", _io(("x", mx.float32), ("params", mx.int64)),
                        _io(("y", mx.float32)), "pkv_fwht256_f32<>(x, y, params[0]);", None)
    blocks = math.ceil(groups / 8)
    return run(Launch(src, [x.reshape(-1), _params(mx, groups)], [(x.size,)], [mx.float32],
                      grid=(256 * blocks, 1, 1), threadgroup=(256, 1, 1)))[0].reshape(x.shape)


@functools.lru_cache(maxsize=1024)
def _gemv_plan(kernel: str, rotated: bool, M: int, K: int, batch: int, tensor_cores: bool,
               fused: bool = False):
    """What every GEMV call of one configuration launches, built once: a decode loop then
    spends per call only the ``Launch`` objects (sources, dtype names, grids and the
    ``params`` arrays of a configuration do not change from call to call). ``fused``:
    the fused-x kernel (batch 1-2), one launch on the float32 x."""
    import mlx.core as mx

    from pagedkv.kernels.launch_constants import gemv_rows_per_block
    from pagedkv.kernels.weights import (
        GEMV_MMA_MAX_WARPS,
        GEMV_MMA_ROWS,
        GEMV_THREADS,
        GEMV_X_WORDS,
        _mma_warps,
        fused_x_grid,
    )
    if tensor_cores:
        groups = K // 256
        tiles = math.ceil(3 * batch / 8)
        row_tiles = math.ceil(M / GEMV_MMA_ROWS)
        threads = 32 * _mma_warps(row_tiles, groups)
        if fused:
            blocks, fused_warps = fused_x_grid(kernel, M, K)
            mma_x = kernel_source(
                "weights", f"gemv_mma_x_{kernel}_n1",
                _io(("w", mx.uint8), ("x", mx.float32), ("params", mx.int64)),
                _io(("y", mx.float32)),
                f"pkv_gemv_mma_x_{kernel}_n1<>(w, x, y, (int)params[0], (int)params[1], "
                "(int)params[2], (int)params[3]);", (32 * GEMV_MMA_MAX_WARPS,))
            return (mma_x, _params(mx, M, K, batch, int(rotated)),
                    (32 * fused_warps * blocks, 1, 1), 32 * fused_warps)
        prep = kernel_source(
            "weights", "gemv_prep_x", _io(("x", mx.float32), ("params", mx.int64)),
            _io(("xq", mx.uint32), ("xs", mx.float32)),
            "pkv_gemv_prep_x<>(x, xq, (float4*)xs, (int)params[0], (int)params[1], "
            "(int)params[2], (int)params[3]);", None)
        mma = kernel_source(
            "weights", f"gemv_mma_{kernel}_n{tiles}",
            _io(("w", mx.uint8), ("xq", mx.uint32), ("xs", mx.float32), ("params", mx.int64)),
            _io(("y", mx.float32)),
            f"pkv_gemv_mma_{kernel}_n{tiles}<>(w, xq, (const float4*)xs, y, (int)params[0], "
            "(int)params[1], (int)params[2]);", (32 * GEMV_MMA_MAX_WARPS,))
        return (prep, _params(mx, K, batch, tiles, int(rotated)),
                [(groups * tiles * 32 * GEMV_X_WORDS,), (groups * batch * 4,)],
                (256 * math.ceil(groups * batch / 8), 1, 1),
                mma, _params(mx, M, K, batch), (threads * row_tiles, 1, 1), threads)
    bmax = next(b for b in (1, 2, 4, 8) if b >= batch)
    threads, rows = GEMV_THREADS, gemv_rows_per_block(bmax)
    src = kernel_source(
        "weights", f"gemv_{kernel}_b{bmax}",
        _io(("w", mx.uint8), ("x", mx.float32), ("params", mx.int64)), _io(("y", mx.float32)),
        f"pkv_gemv_{kernel}_b{bmax}<>(w, x, y, (int)params[0], (int)params[1], "
        "(int)params[2]);", (threads,))
    return src, _params(mx, M, K, batch), (threads * math.ceil(M / rows), 1, 1), threads


def gemv(mx, w, codec, M: int, K: int, x, run: Runner, *, tensor_cores: bool):
    """``y = W x`` with hip/'s GEMV: the int8 tensor-core kernel (4-bit formats, sm_80+,
    weights packed by :func:`pagedkv.kernels.weights._pack_tiles`) or the f32 one."""
    from pagedkv.kernels.weights import fused_x_by_default
    batch = x.shape[0]
    rotated = codec.rotated
    kernel = HIP_WEIGHT_KERNELS[codec.name]
    fused = tensor_cores and batch <= 2 and fused_x_by_default(kernel, rotated, batch)
    plan = _gemv_plan(kernel, rotated, M, K, batch, tensor_cores, fused)
    if fused:  # one launch: each warp prepares its groups' x (weights.Gemv's fused_x)
        src, params, grid, threads = plan
        return run(Launch(src, [w, x, params], [(batch, M)], [mx.float32], grid=grid,
                          threadgroup=(threads, 1, 1)))[0]
    if tensor_cores:
        prep, prep_params, prep_shapes, prep_grid, mma, params, grid, threads = plan
        xq, xs = run(Launch(prep, [x, prep_params], prep_shapes, [mx.uint32, mx.float32],
                            grid=prep_grid, threadgroup=(256, 1, 1)))
        return run(Launch(mma, [w, xq, xs, params], [(batch, M)], [mx.float32], grid=grid,
                          threadgroup=(threads, 1, 1)))[0]
    if rotated:
        x = fwht256(mx, x, run)
    src, params, grid, threads = plan
    return run(Launch(src, [w, x, params], [(batch, M)], [mx.float32], grid=grid,
                      threadgroup=(threads, 1, 1)))[0]


def kv_q8_quantize(mx, values, run: Runner):
    """hip/ ``pkv_kv_q8_write``, writing the n tokens' records in order (slots 0..n-1)."""
    n, kvh, hd = values.shape
    f16 = values.dtype == mx.float16
    src = kernel_source(
        "kvcache", f"kv_q8_write_{'f16' if f16 else 'f32'}",
        _io(("src", values.dtype), ("slots", mx.int64), ("params", mx.int64)),
        _io(("out", mx.uint8)),
        f"pkv_kv_q8_write_{'f16' if f16 else 'f32'}<>({'(const uint16_t*)src' if f16 else 'src'}"
        ", slots, out, (int)params[0], (int)params[1], (int)params[2]);", None)
    slots = _iota(n, 'int64')
    total = n * kvh * hd
    return run(Launch(src, [values, slots, _params(mx, n, kvh, hd)], [(n, kvh, hd // kv_q8.BLOCK_VALUES * kv_q8.RECORD_BYTES)],
                      [mx.uint8], grid=(256 * math.ceil(total / 256), 1, 1),
                      threadgroup=(256, 1, 1)))[0]


def kv_q8_read(mx, pool, slots, kv_heads: int, head_dim: int, out_dtype, run: Runner):
    """hip/ ``pkv_kv_q8_read``: the q8 rows at ``slots`` (int64) as f32 or f16."""
    n = slots.shape[0]
    f16 = out_dtype == mx.float16
    src = kernel_source(
        "kvcache", f"kv_q8_read_{'f16' if f16 else 'f32'}",
        _io(("pool", mx.uint8), ("slots", mx.int64), ("params", mx.int64)),
        _io(("out", out_dtype)),
        f"pkv_kv_q8_read_{'f16' if f16 else 'f32'}<>(pool, slots, "
        f"{'(uint16_t*)out' if f16 else 'out'}, (int)params[0], (int)params[1], "
        "(int)params[2]);", None)
    total = n * kv_heads * head_dim
    return run(Launch(src, [pool.reshape(-1), slots, _params(mx, n, kv_heads, head_dim)],
                      [(n, kv_heads, head_dim)], [out_dtype],
                      grid=(256 * math.ceil(total / 256), 1, 1), threadgroup=(256, 1, 1)))[0]


def attention_geometry(kv_dtype: str, heads: int, kv_heads: int, head_dim: int) -> dict:
    """Partition tokens, threads, ``__launch_bounds__`` and dynamic shared memory of the
    hip/ attention kernel for one geometry: pagedkv.kernels.kvcache's tables, the ones
    PagedAttention launches with (pagedkv/launch.h, per KV dtype by its own name)."""
    from pagedkv.kernels import kvcache
    partition = kvcache.ATTN_PARTITION_TOKENS[kv_dtype]
    gmax = kvcache.attention_group_slots(heads, kv_heads)
    shared = kvcache.attention_shared_bytes(kv_dtype, gmax, head_dim, warp_size=32)
    return {"partition": partition, "threads": kvcache.ATTN_THREADS,
            "bounds": (kvcache.ATTN_THREADS, kvcache.ATTN_MIN_BLOCKS[kv_dtype]),
            "gmax": gmax, "shared": shared}


@functools.lru_cache(maxsize=8)
def sm_count(ordinal: int = 0) -> int:
    """SMs of CUDA device ``ordinal`` (MLX's GPU is device 0), read from the driver through
    pagedkv's runtime loader (cuInit, cuDeviceGet, cuDeviceGetAttribute: no context is
    created beside MLX's); 0 when the driver cannot say, and the attention launches then
    take the most tokens per partition. Read once per process."""
    import ctypes

    from pagedkv.errors import DeviceError, NoDeviceError
    from pagedkv.kernels.runtime import load_runtime
    try:
        rt = load_runtime("cuda")
        dev = ctypes.c_int(0)
        rt.call("device_get", ctypes.byref(dev), ordinal)
        return rt.attribute("multiprocessor_count", dev.value)
    except (NoDeviceError, DeviceError) as exc:
        logger.info("MLX CUDA attention: no SM count (%s); partitions of the most tokens", exc)
        return 0


@functools.lru_cache(maxsize=1024)
def _attention_plan(kv_dtype: str, pool_dtype: str, seqs: int, heads: int, kv_heads: int,
                    head_dim: int, block_size: int, table_width: int, parts: int,
                    partition_tokens: int, scale_bits: int):
    """The partition and reduce launches of one attention configuration, built once (a
    decode step launches the same configuration for every layer). Keyed by the partition
    count and size, not the length: consecutive decode steps share a plan."""
    import mlx.core as mx

    from pagedkv.kernels import kvcache
    geo = attention_geometry(kv_dtype, heads, kv_heads, head_dim)
    pool_t = getattr(mx, pool_dtype)
    # q8: the staged kernels where ctypes' PagedAttention would stage by default, with
    # cp.async copies (a tensor map encodes the pool's address, which MLX does not give this
    # launcher; nor can it see a pool view off 8-byte alignment: the kernel stages those by
    # byte loads, hip/kvcache.hip q8_stage_bytes).
    staged = kv_dtype == "q8" and kvcache.q8_staged_by_default(
        head_dim, geo["gmax"], partition_tokens, seqs * kv_heads * parts, sm_count())
    name = f"pkv_paged_attention_{KV_NAMES[kv_dtype]}{'s' if staged else ''}_g{geo['gmax']}"
    src = kernel_source(
        "kvcache", name[4:] + f"_s{geo['shared']}",
        _io(("q", mx.float32), ("k_pool", pool_t), ("v_pool", pool_t),
            ("block_tables", mx.int32), ("seq_lens", mx.int32), ("params", mx.int64)),
        _io(("part_out", mx.float32), ("part_max", mx.float32), ("part_sum", mx.float32)),
        f"{name}<>(q, (const uint8_t*)k_pool, (const uint8_t*)v_pool, block_tables, seq_lens, "
        "part_out, part_max, part_sum, __int_as_float((int)params[0]), (int)params[1], "
        "(int)params[2], (int)params[3], (int)params[4], (int)params[5], (int)params[6], "
        f"(int)params[7]{', PkvTensorMap{}, PkvTensorMap{}, 0' if staged else ''});",
        geo["bounds"], geo["shared"])
    part_shape = (seqs, heads, parts)
    threads = geo["threads"]
    partition = (src, _params(mx, scale_bits, heads, kv_heads, head_dim, block_size,
                              table_width, parts, partition_tokens),
                 [part_shape + (head_dim,), part_shape, part_shape],
                 (parts * threads, kv_heads, seqs), threads)
    reduce = kernel_source(
        "kvcache", "paged_attention_reduce",
        _io(("part_out", mx.float32), ("part_max", mx.float32), ("part_sum", mx.float32),
            ("seq_lens", mx.int32), ("params", mx.int64)), _io(("out", mx.float32)),
        "pkv_paged_attention_reduce<>(part_out, part_max, part_sum, seq_lens, out, "
        "(int)params[0], (int)params[1], (int)params[2], (int)params[3]);", None)
    t = kvcache.reduce_threads(parts, head_dim, rotated=False)
    return partition, (reduce, _params(mx, heads, head_dim, parts, partition_tokens),
                       (heads * t, seqs, 1), t)


def paged_attention(mx, q, k_pool, v_pool, block_tables, seq_lens, *, kv_dtype: str,
                    scale: float, max_seq_len: int, run: Runner):
    """hip/ paged attention (partitions, then ``pkv_paged_attention_reduce``), split over
    the context as ``PagedAttention`` splits it (``kvcache.attention_partition_tokens`` on
    this GPU's SM count)."""
    from pagedkv.kernels import kvcache
    seqs, heads, head_dim = q.shape
    kv_heads = k_pool.shape[2]
    tokens = kvcache.attention_partition_tokens(kv_dtype, seqs, kv_heads, max_seq_len,
                                                sm_count())
    parts = max(1, math.ceil(max_seq_len / tokens))
    partition, reduce = _attention_plan(
        kv_dtype, _dtype_name(k_pool.dtype), seqs, heads, kv_heads, head_dim,
        k_pool.shape[1], block_tables.shape[1], parts, tokens,
        int(np.float32(scale).view(np.int32)))
    src, params, part_shapes, grid, threads = partition
    part_out, part_max, part_sum = run(Launch(
        src, [q, k_pool, v_pool, block_tables, seq_lens, params], part_shapes,
        [mx.float32] * 3, grid=grid, threadgroup=(threads, 1, 1)))
    src, params, grid, t = reduce
    return run(Launch(src, [part_out, part_max, part_sum, seq_lens, params],
                      [(seqs, heads, head_dim)], [mx.float32], grid=grid,
                      threadgroup=(t, 1, 1)))[0]


def gather_blocks(mx, src, src_ids, run: Runner):
    """hip/ ``pkv_copy_blocks_{16,1}`` into a new ``uint8[n, block_bytes]`` (slots 0..n-1)."""
    n = src_ids.shape[0]
    block_bytes = src.nbytes // src.shape[0]
    flat = src.reshape(-1).view(mx.uint8) if src.dtype != mx.uint8 else src.reshape(-1)
    vec = block_bytes % 16 == 0  # MLX buffers are 16-byte aligned
    name = "copy_blocks_16" if vec else "copy_blocks_1"
    kernel = kernel_source(
        "kvcache", name, _io(("src", mx.uint8), ("src_ids", mx.int32), ("dst_ids", mx.int32),
                             ("params", mx.int64)), _io(("out", mx.uint8)),
        f"pkv_{name}<>(src, src_ids, dst_ids, out, (int)params[0], params[1]);", None)
    units = block_bytes // 16 if vec else block_bytes
    gx, gy = min(math.ceil(units / 256), 64), min(n, 65535)
    return run(Launch(kernel, [flat, src_ids, _iota(n, 'int32'),
                               _params(mx, n, block_bytes)], [(n, block_bytes)], [mx.uint8],
                      grid=(256 * gx, gy, 1), threadgroup=(256, 1, 1)))[0]


def copy_blocks(mx, src, src_ids, dst_ids, dst, run: Runner):
    """``dst`` with block ``dst_ids[i]`` replaced by ``src``'s block ``src_ids[i]``."""
    from pagedkv.kernels.mlx.array_ops import scatter_blocks
    return scatter_blocks(mx, gather_blocks(mx, src, src_ids, run), dst_ids, dst)
