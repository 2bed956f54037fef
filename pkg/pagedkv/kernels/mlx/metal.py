"""The ``metal/`` kernels as MLX launches (Apple GPUs, through ``mx.fast.metal_kernel``).

Each function takes arguments :mod:`pagedkv.kernels.mlx` has checked, builds the
launches of one operation and hands them to ``run`` (:func:`~.launch.run_metal` on a
Mac; the tests' emulator elsewhere). The header is ``metal/<file>.metal`` with its
includes inlined (``pagedkv_metal.h``, ``pagedkv/quant.h``, ``pagedkv/kvquant.h``) and
``PKV_MLX_JIT`` defined, which leaves out the file's own ``[[kernel]]`` entry points;
each body is one call of the same ``pkv_*_thread`` function those entry points call.
Scalars travel in a small ``int32`` ``params`` input.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from pagedkv.kernels.launch_constants import launch_constant
from pagedkv.kernels.mlx.launch import KernelSource, Launch, Runner
from pagedkv.kernels.mlx.sources import inline_includes, strip_comments
from pagedkv.quant import kv_q8

__all__ = [
    "ATTN_PARTITION_TOKENS",
    "copy_blocks",
    "dequantize",
    "fwht256",
    "gather_blocks",
    "gemv",
    "kv_q8_quantize",
    "kv_q8_read",
    "layout_id",
    "paged_attention",
]

# pagedkv/launch.h (docs/kernels.md, "Launch constants").
SIMD_WIDTH = launch_constant("PKV_METAL_SIMD_WIDTH")
ATTN_PARTITION_TOKENS = launch_constant("PKV_METAL_ATTN_PARTITION")
ATTN_THREADS = launch_constant("PKV_METAL_ATTN_SIMDGROUPS") * SIMD_WIDTH
GEMV_SIMDGROUPS = launch_constant("PKV_METAL_GEMV_SIMDGROUPS")
GEMV_ROWS_PER_THREADGROUP = launch_constant("PKV_METAL_GEMV_ROWS") * GEMV_SIMDGROUPS
GEMV_THREADS = GEMV_SIMDGROUPS * SIMD_WIDTH
LAYOUT_Q8F16 = 4  # PKV_LAYOUT_Q8F16 in pagedkv_metal.h
KV_KIND = {"float16": 0, "bfloat16": 1, "q8": 2}


@functools.cache
def _header(source: str) -> str:
    return "#define PKV_MLX_JIT 1\n" + strip_comments(inline_includes(f"metal/{source}"))


def _kernel(source: str, name: str, inputs: tuple[str, ...], outputs: tuple[str, ...],
            body: str, *, cooperative: bool) -> KernelSource:
    return KernelSource(name=f"pagedkv_{name}", input_names=inputs, output_names=outputs,
                        source=body, header=_header(source), cooperative=cooperative)


@functools.cache
def _kernels() -> dict[str, KernelSource]:
    w, kv = "weights.metal", "kvcache.metal"
    return {
        "dequant": _kernel(w, "dequant", ("raw", "params"), ("out",),
                           "pkv_dequant_thread<FAMILY, BITS, G, Out>(raw, out, params, "
                           "thread_position_in_grid.x);", cooperative=False),
        "fwht": _kernel(w, "fwht256", ("x", "params"), ("y",),
                        "pkv_fwht256_thread(x, y, params, thread_position_in_grid.x, "
                        "thread_index_in_simdgroup);", cooperative=True),
        "gemv": _kernel(w, "gemv", ("w", "x", "params"), ("y",),
                        "pkv_gemv_thread<FAMILY, BITS, G, BMAX>(w, x, y, params, "
                        "threadgroup_position_in_grid.x * PKV_METAL_GEMV_SIMDGROUPS + "
                        "simdgroup_index_in_threadgroup, thread_index_in_simdgroup);",
                        cooperative=True),
        "q8_quantize": _kernel(kv, "kv_q8_quantize", ("src", "params"), ("out",),
                               "pkv_kv_q8_quantize_thread(src, out, params, "
                               "thread_position_in_grid.x, thread_index_in_simdgroup);",
                               cooperative=True),
        "q8_read": _kernel(kv, "kv_q8_read", ("pool", "slots", "params"), ("out",),
                           "pkv_kv_q8_read_thread(pool, slots, out, params, "
                           "thread_position_in_grid.x);", cooperative=False),
        "attention": _kernel(
            kv, "paged_attention",
            ("q", "k_pool", "v_pool", "block_tables", "seq_lens", "params"),
            ("part_out", "part_max", "part_sum"),
            "PKV_SHARED(float, sm_m, PKV_METAL_ATTN_SIMDGROUPS * GMAX);\n"
            "PKV_SHARED(float, sm_l, PKV_METAL_ATTN_SIMDGROUPS * GMAX);\n"
            "PKV_SHARED(float, sm_acc, GMAX * HEAD_DIM);\n"
            "pkv_paged_attention_thread<KIND, GMAX, HEAD_DIM>(q, k_pool, v_pool, block_tables, "
            "seq_lens, part_out, part_max, part_sum, params, threadgroup_position_in_grid, "
            "simdgroup_index_in_threadgroup, thread_index_in_simdgroup, "
            "thread_index_in_threadgroup, sm_m, sm_l, sm_acc);", cooperative=True),
        "attention_reduce": _kernel(
            kv, "paged_attention_reduce",
            ("part_out", "part_max", "part_sum", "seq_lens", "params"), ("out",),
            "pkv_paged_attention_reduce_thread(part_out, part_max, part_sum, seq_lens, out, "
            "params, thread_position_in_grid);", cooperative=False),
        "gather16": _kernel(kv, "gather_blocks16", ("src", "src_ids", "params"), ("out",),
                            "pkv_gather_blocks16_thread(src, src_ids, out, params, "
                            "thread_position_in_grid);", cooperative=False),
        "gather1": _kernel(kv, "gather_blocks1", ("src", "src_ids", "params"), ("out",),
                           "pkv_gather_blocks1_thread(src, src_ids, out, params, "
                           "thread_position_in_grid);", cooperative=False),
    }


def _params(mx, *values: int):
    """The scalars of a launch as a small ``int32`` input, one array per distinct tuple
    (a decode step re-launches with the same values: no new host-to-device copy)."""
    return _cached_params(tuple(int(v) for v in values))


@functools.lru_cache(maxsize=4096)
def _cached_params(values: tuple[int, ...]):
    import mlx.core as mx
    arr = mx.array(np.asarray(values, dtype=np.int32))
    mx.eval(arr)
    return arr


def layout_id(codec) -> int:
    """The FAMILY template argument of a codec: its affine family, or Q8F16's layout."""
    return LAYOUT_Q8F16 if codec.kind == "q8" else int(codec.family)


def dequantize(mx, raw, codec, numel: int, out_dtype, run: Runner):
    """``out_dtype[numel]`` weights in the stored basis from the raw group bytes."""
    lo, hi = numel & 0x7FFFFFFF, numel >> 31
    launch = Launch(_kernels()["dequant"], [raw, _params(mx, lo, hi)], [(numel,)], [out_dtype],
                    grid=(max(1, math.ceil(numel / 8)), 1, 1), threadgroup=(256, 1, 1),
                    template=[("FAMILY", layout_id(codec)), ("BITS", codec.bits),
                              ("G", codec.group_size), ("Out", out_dtype)])
    return run(launch)[0]


def fwht256(mx, x, run: Runner):
    """FWHT-256 of each 256-segment of ``x`` (float32, any shape of size % 256 == 0)."""
    groups = x.size // 256
    launch = Launch(_kernels()["fwht"], [x.reshape(-1), _params(mx, groups)], [(x.size,)],
                    [mx.float32], grid=(32 * groups, 1, 1), threadgroup=(256, 1, 1))
    return run(launch)[0].reshape(x.shape)


def gemv(mx, w, codec, M: int, K: int, x, run: Runner):
    """``y[b] = W x[b]`` on the stored (rotated) weights; rotated formats rotate x first."""
    batch = x.shape[0]
    if codec.rotated:
        x = fwht256(mx, x, run)
    bmax = next(b for b in (1, 2, 4, 8) if b >= batch)
    tgs = math.ceil(M / GEMV_ROWS_PER_THREADGROUP)
    launch = Launch(_kernels()["gemv"], [w, x, _params(mx, M, K, batch)], [(batch, M)],
                    [mx.float32], grid=(GEMV_THREADS * tgs, 1, 1),
                    threadgroup=(GEMV_THREADS, 1, 1),
                    template=[("FAMILY", layout_id(codec)), ("BITS", codec.bits),
                              ("G", codec.group_size), ("BMAX", bmax)])
    return run(launch)[0]


def kv_q8_quantize(mx, values, run: Runner):
    """q8 records (``uint8[..., head_dim/32*34]``) of ``values`` (f32/f16 ``[..., head_dim]``)."""
    n_rec = values.size // kv_q8.BLOCK_VALUES
    launch = Launch(_kernels()["q8_quantize"], [values.reshape(-1), _params(mx, n_rec)],
                    [(n_rec * kv_q8.RECORD_BYTES,)], [mx.uint8], grid=(kv_q8.BLOCK_VALUES * n_rec, 1, 1),
                    threadgroup=(256, 1, 1))
    return run(launch)[0].reshape(*values.shape[:-1], values.shape[-1] // kv_q8.BLOCK_VALUES * kv_q8.RECORD_BYTES)


def kv_q8_read(mx, pool, slots, kv_heads: int, head_dim: int, out_dtype, run: Runner):
    """``out_dtype[n, kv_heads, head_dim]``: the q8 rows of ``pool`` at ``slots`` (int64)."""
    n = slots.shape[0]
    total = n * kv_heads * head_dim
    launch = Launch(_kernels()["q8_read"],
                    [pool.reshape(-1), slots, _params(mx, n, kv_heads, head_dim)],
                    [(n, kv_heads, head_dim)], [out_dtype], grid=(total, 1, 1),
                    threadgroup=(256, 1, 1))
    return run(launch)[0]


def paged_attention(mx, q, k_pool, v_pool, block_tables, seq_lens, *, kv_dtype: str,
                    scale: float, max_seq_len: int, run: Runner):
    """Decode attention: ``float32[seqs, heads, head_dim]`` (partitions, then their reduce)."""
    seqs, heads, head_dim = q.shape
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = heads // kv_heads
    gmax = 1 << (group - 1).bit_length()
    parts = max(1, math.ceil(max_seq_len / ATTN_PARTITION_TOKENS))
    scale_bits = int(np.float32(scale).view(np.int32))
    as_bytes = (lambda p: p.view(mx.uint8)) if kv_dtype != "q8" else (lambda p: p)
    params = _params(mx, heads, kv_heads, block_size, block_tables.shape[1], parts, scale_bits)
    part_shape = (seqs, heads, parts)
    part_out, part_max, part_sum = run(Launch(
        _kernels()["attention"],
        [q, as_bytes(k_pool).reshape(-1), as_bytes(v_pool).reshape(-1), block_tables, seq_lens,
         params],
        [part_shape + (head_dim,), part_shape, part_shape], [mx.float32] * 3,
        grid=(parts * ATTN_THREADS, kv_heads, seqs), threadgroup=(ATTN_THREADS, 1, 1),
        template=[("KIND", KV_KIND[kv_dtype]), ("GMAX", gmax), ("HEAD_DIM", head_dim)]))
    return run(Launch(
        _kernels()["attention_reduce"],
        [part_out, part_max, part_sum, seq_lens, _params(mx, heads, head_dim, parts)],
        [(seqs, heads, head_dim)], [mx.float32], grid=(head_dim, heads, seqs),
        threadgroup=(min(head_dim, 256), 1, 1)))[0]


def gather_blocks(mx, src, src_ids, run: Runner):
    """``uint8[n, block_bytes]``: block ``src_ids[i]`` of ``src`` (blocks on axis 0)."""
    n = src_ids.shape[0]
    block_bytes = src.nbytes // src.shape[0]
    flat = src.reshape(-1).view(mx.uint8) if src.dtype != mx.uint8 else src.reshape(-1)
    vec = 16 if block_bytes % 16 == 0 else 1
    launch = Launch(_kernels()["gather16" if vec == 16 else "gather1"],
                    [flat, src_ids, _params(mx, n, block_bytes)], [(n, block_bytes)],
                    [mx.uint8], grid=(block_bytes // vec, n, 1), threadgroup=(256, 1, 1))
    return run(launch)[0]


def copy_blocks(mx, src, src_ids, dst_ids, dst, run: Runner):
    """``dst`` with block ``dst_ids[i]`` replaced by ``src``'s block ``src_ids[i]``."""
    from pagedkv.kernels.mlx.array_ops import scatter_blocks
    return scatter_blocks(mx, gather_blocks(mx, src, src_ids, run), dst_ids, dst)
