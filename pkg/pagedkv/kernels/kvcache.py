"""Launchers for ``hip/kvcache.hip``: q8 KV write/read, paged-attention decode (f16, bf16, q8
and compressed ``<K mode>/<V mode>`` KV, docs/kv-quant.md), block copies.

Each function checks shapes and dtypes of its :class:`DeviceArray` arguments
(``InvalidArgument`` naming the argument, nothing launched) and enqueues the
kernel on ``stream`` (default stream when ``None``); results are ready after
``device.synchronize()`` or a copy back. Block ids in tables are not checked on
the device: :func:`check_decode_batch` checks host tables before upload.
"""

from __future__ import annotations

import math

import numpy as np

from pagedkv.env_knobs import env_bool, env_u32
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.kernels.device import (
    MFMA_BF16_ARCHES,
    Device,
    Stream,
    amd_matrix_unit,
    sm_version,
)
from pagedkv.kernels.device_array import (
    DeviceArray,
    need_array,
    need_device_array,
    need_writable,
)
from pagedkv.kernels.launch_constants import (
    KV_SUFFIX,
    attn_min_blocks,
    attn_partition_tokens,
    launch_constant,
)
from pagedkv.kernels.weights import PreparedX, check_prepared
from pagedkv.quant import kv_q8

__all__ = [
    "KV_DTYPES",
    "QUANT_KV_DTYPES",
    "PagedAttention",
    "check_decode_batch",
    "check_kv_rows",
    "copy_blocks",
    "kv_dtype_of",
    "kv_q8_read",
    "kv_q8_write",
    "kv_rotated_write",
]

SOURCE = "kvcache"
# Tokens per attention partition and __launch_bounds__ minimum blocks by KV dtype, and the
# threads per block (pagedkv/launch.h). The ctypes and MLX CUDA launchers both read these
# tables; hip/tune.py sets a swept variant's partition here.
ATTN_PARTITION_TOKENS = {dt: attn_partition_tokens(dt) for dt in KV_SUFFIX}
ATTN_MIN_BLOCKS = {dt: attn_min_blocks(dt) for dt in KV_SUFFIX}
ATTN_THREADS = launch_constant("PKV_ATTN_THREADS")
#: Slices of the partition reduce (hip/attention_reduce.h: partition p in slice p % slices, a
#: 32-lane warp per slice); the fused reduce + prep runs a block of this many warps.
ATTN_REDUCE_SLICES = launch_constant("PKV_ATTN_REDUCE_SLICES")
#: The staged q8 kernels' tensor-copy box (bytes, rows): a chunk's 16 token slots x a
#: head_dim-128 row's 136 bytes in its 16-byte aligned window (_tensor_maps).
ATTN_Q8_TMA_BOX = (launch_constant("PKV_ATTN_Q8_TMA_BOX_BYTES"),
                   launch_constant("PKV_ATTN_Q8_TMA_BOX_ROWS"))
REDUCE_PREP_THREADS = 32 * ATTN_REDUCE_SLICES
KV_DTYPES = {"float16": "f16", "bfloat16": "bf16", "q8": "q8"}
#: The opt-in variable of the never-run AMD matrix-core attention, per unit
#: (device.amd_matrix_unit); the unit is also the kernel name's suffix (f16mfma, q8wmma).
_ATTN_AMD_OPT_IN = {"mfma": "PAGEDKV_ATTN_MFMA", "wmma": "PAGEDKV_ATTN_WMMA"}
#: The compressed K/V pairs hip/kvcache.hip has kernels for: a rotated K (fwhtN, or a lloyd
#: mode on K) with a q8, lloyd or fwht V (pagedkv's extension, docs/kv-quant.md "Modes").
QUANT_KV_DTYPES = tuple(f"{k}/{v}" for k in ("fwht4", "fwht3", "fwht2", "lloyd4", "lloyd3",
                                             "lloyd2")
                        for v in ("q8", "lloyd4", "lloyd3", "lloyd2", "fwht4", "fwht3", "fwht2"))
# A lloyd3 K is fwht3's bytes and tables (R256, 3-bit 256 family): it runs fwht3's kernels;
# likewise an fwht3 V runs the lloyd3 V kernels.
_K_KERNEL = {"lloyd3": "fwht3"}
_V_KERNEL = {"fwht3": "lloyd3"}
#: Code widths with a tensor-core (``_mma``) kernel: K 4 or 2 bits, V q8, 4 or 2 bits
#: (docs/kernels.md, "Compressed KV on tensor cores"); 3-bit codes keep the CUDA-core kernels.
QKV_MMA_K_BITS = (4, 2)
QKV_MMA_V_BITS = (8, 4, 2)


def qkv_mma_applies(kv_dtype: str) -> bool:
    """Whether a compressed pair has ``_mma`` kernels (both sides' code widths do)."""
    from pagedkv.quant import kv as kv_modes
    k_side, v_side = kv_modes.split_kv_dtype(kv_dtype)
    return (kv_modes.kv_mode(k_side).bits in QKV_MMA_K_BITS
            and kv_modes.kv_mode(v_side).bits in QKV_MMA_V_BITS)
# Every compressed pair's CUDA-core kernels run one launch setting (PKV_*_QKV).
ATTN_PARTITION_TOKENS.update(dict.fromkeys(QUANT_KV_DTYPES,
                                           launch_constant("PKV_ATTN_PARTITION_QKV")))
ATTN_MIN_BLOCKS.update(dict.fromkeys(QUANT_KV_DTYPES, launch_constant("PKV_ATTN_MIN_BLOCKS_QKV")))
#: The compressed pairs' tensor-core (_mma) kernels: their own bound, and on NVIDIA their
#: own partition (AMD's matrix-core ones keep :data:`ATTN_PARTITION_TOKENS`'s).
ATTN_MIN_BLOCKS_QKV_MMA = launch_constant("PKV_ATTN_MIN_BLOCKS_QKV_MMA")
ATTN_PARTITION_TOKENS_QKV_MMA = launch_constant("PKV_ATTN_PARTITION_QKV_MMA")


#: A split partition's fewest tokens (a tensor-core pass takes 16 tokens per warp and mma, 4
#: warps per CTA) and its granularity (the staged q8 chunk).
ATTN_SPLIT_MIN_TOKENS = 64
ATTN_SPLIT_STEP_TOKENS = 16
#: CTAs per SM of one wave, what a split fills: the f16 / bf16 / q8 kernels' occupancy (128
#: threads of 128 registers, ``PKV_ATTN_MIN_BLOCKS``: 4 per SM). A split to 2 per SM left
#: half of each SM's slots idle: batch 1 over 32k tokens ran 33 partitions of 1,008 tokens
#: in 54.0 µs, 64 of 512 in 44.9 (reduce included; H200, docs/performance.md "Decode step").
ATTN_SPLIT_CTAS_PER_SM = min(ATTN_MIN_BLOCKS[dt] for dt in KV_DTYPES)


#: Partitions of fewer tokens run q8 KV unstaged by default where the grid gives SMs fewer
#: than two CTAs each: 16-token chunks per warp no more than the PKV_ATTN_Q8_STAGES - 1 the
#: staged (q8s) kernel's prologue copies leave no copy to overlap with a read, and with one
#: CTA on an SM nothing shares its instruction fetches: the staged kernel's longer code (155
#: KiB of sm_90 SASS against the unstaged kernel's 86) then costs more than its copies save.
#: H200, 64-token partitions: batch 1 over 1k tokens (128 CTAs) 13.2 µs staged against 11.0
#: unstaged (Nsight Compute: 57% of the staged kernel's stalls wait on instruction fetch);
#: over 4k (512 CTAs) 14.8 against 15.5; 512-token partitions over 32k: 49.3 against 56.8
#: (docs/performance.md, "Decode step").
ATTN_Q8_STAGE_MIN_TOKENS = (launch_constant("PKV_ATTN_Q8_STAGES") * ATTN_SPLIT_STEP_TOKENS
                            * (ATTN_THREADS // 32))


def q8_stage_pays(partition_tokens: int, grid_ctas: int, sm_count: int) -> bool:
    """Whether the staged q8 kernels are the default for a launch of ``grid_ctas`` CTAs of
    ``partition_tokens`` tokens on ``sm_count`` SMs (0: unknown, staged):
    :data:`ATTN_Q8_STAGE_MIN_TOKENS` tokens or more, or two CTAs or more per SM."""
    return partition_tokens >= ATTN_Q8_STAGE_MIN_TOKENS or grid_ctas >= 2 * sm_count


def q8_staged_by_default(head_dim: int, gmax: int, partition_tokens: int, grid_ctas: int,
                         sm_count: int, *, pays: bool = False) -> bool:
    """Whether a q8 launch on NVIDIA runs the staged (q8s) kernels when its caller does not
    say: ``PAGEDKV_ATTN_Q8_STAGE`` (default on), where their tensor-core passes run (head_dim
    64 or 128, at most 4 query heads per KV head: elsewhere the q8s kernels would run the
    CUDA-core passes under 36 KB of idle stage buffers, which cost occupancy and, with head_dim
    256's scratch, exceed the 48 KB a launch gets: CUDA_ERROR_INVALID_VALUE on the H200 at kvh4
    d256, 2026-12-02), and where staging pays for its longer code (:func:`q8_stage_pays`;
    ``pays=True`` skips that test). The ctypes and MLX CUDA launchers both ask this."""
    return (env_bool("PAGEDKV_ATTN_Q8_STAGE", True) and head_dim in (64, 128) and gmax <= 4
            and (pays or q8_stage_pays(partition_tokens, grid_ctas, sm_count)))


def attention_partition_tokens(kv_dtype: str, num_seqs: int, kv_heads: int, max_seq_len: int,
                               sm_count: int, *, most: int | None = None) -> int:
    """Tokens per partition of one launch geometry, a multiple of 16 between 64 and the
    kernel's most (:data:`ATTN_PARTITION_TOKENS`): as many partitions as the most needs or,
    where that grid (``num_seqs × kv_heads × partitions``) is less than one wave
    (:data:`ATTN_SPLIT_CTAS_PER_SM` CTAs on every SM), as many as one wave holds; then the
    tokens that share ``max_seq_len`` evenly among them. ``sm_count`` 0 (unknown): the most
    (the MLX CUDA launcher's case where the driver cannot give its SM count). A batch-1
    decode over 1,024 tokens with 8 KV heads ran 8 CTAs of 1,024 tokens on the H200's 132
    SMs: 40 µs a layer, 100 GB/s (docs/performance.md, "Decode step"); split into 64-token
    partitions it runs 136. Even
    shares: a decode step over 1,024 cached tokens attends over 1,025, which the most (512
    for q8) would cut into 512 + 512 + 1. ``most``: the kernel's most where it is not the
    KV dtype's (the NVIDIA ``_mma`` kernels': :data:`ATTN_PARTITION_TOKENS_QKV_MMA`)."""
    most = ATTN_PARTITION_TOKENS[kv_dtype] if most is None else most
    if sm_count <= 0:
        return most
    slots = ATTN_SPLIT_CTAS_PER_SM * sm_count
    parts = max(math.ceil(max_seq_len / most), slots // (num_seqs * kv_heads))
    step = ATTN_SPLIT_STEP_TOKENS
    tokens = step * math.ceil(math.ceil(max_seq_len / parts) / step)
    return min(most, max(ATTN_SPLIT_MIN_TOKENS, tokens))


def reduce_threads(max_partitions: int, head_dim: int, rotated: bool) -> int:
    """Threads per block of the partition reduce: a 32-lane warp per slice that can hold a
    partition (fewer warps for fewer partitions: one partition, one warp), and for a rotated
    V at least ``head_dim`` (its back-rotation in shared memory strides over the block)."""
    threads = 32 * max(1, min(ATTN_REDUCE_SLICES, max_partitions))
    return max(threads, head_dim) if rotated else threads


def attention_group_slots(num_heads: int, kv_heads: int) -> int:
    """The kernel variant's query heads per KV head (``_g<GMAX>``): the group rounded up
    to a power of two."""
    return 1 << (num_heads // kv_heads - 1).bit_length()


def attention_shared_bytes(kv_dtype: str, gmax: int, head_dim: int, *, warp_size: int,
                           most: int | None = None, partials: bool = True) -> int:
    """Dynamic shared memory of one attention CTA, bytes: a partition's f32 scores for the
    group (``scores[PARTITION][GMAX]``), reused later for the warps' partial outputs.
    ``most``: the kernel's PARTITION where it is not the KV dtype's; ``partials=False``: the
    kernel keeps its partial outputs in static shared memory (the rotated-V ``_mma`` kernels
    on AMD matrix cores), so the scores alone."""
    n_warps = ATTN_THREADS // warp_size
    most = ATTN_PARTITION_TOKENS[kv_dtype] if most is None else most
    return 4 * max(most * gmax, n_warps * gmax * head_dim if partials else 0)


def kv_dtype_of(pool: DeviceArray) -> str:
    """The pool dtype name from its array dtype: float16, bfloat16 (uint16 bits), q8 (uint8)."""
    names = {np.dtype(np.float16): "float16", np.dtype(np.uint16): "bfloat16",
             np.dtype(np.uint8): "q8"}
    try:
        return names[pool.dtype]
    except KeyError:
        raise InvalidArgument(f"pool dtype {pool.dtype}: expected float16, uint16 (bfloat16 "
                              f"bits) or uint8 (q8 records)") from None


def check_kv_rows(rows: DeviceArray, name: str, slots: DeviceArray, pool: DeviceArray,
                  mode: str = "q8", *, into_pool: bool,
                  device: Device | None = None) -> tuple[int, int, int]:
    """Check the arguments shared by the KV writes and the q8 read: ``rows`` (``src`` or
    ``out``, ``float32``/``float16[n, kv_heads, head_dim]``), one ``int64`` slot per token,
    and a ``uint8`` pool of ``mode``'s records at that geometry; the side written (the
    pool ``into_pool``, else ``rows``) not read-only; all three on ``device`` when given
    (the launch's). Returns ``(n, kv_heads, head_dim)``. Launches nothing: a launcher of
    several writes checks every one first."""
    need_writable(*((pool, "pool") if into_pool else (rows, name)), device)
    need_device_array(rows, name, device)
    if rows.dtype not in (np.dtype(np.float32), np.dtype(np.float16)) or rows.ndim != 3:
        raise InvalidArgument(f"{name}: {rows.dtype}{list(rows.shape)}, expected float32 or "
                              f"float16 [n, kv_heads, head_dim]")
    need_array(slots, "slots", np.int64, 1, device=device)
    need_array(pool, "pool", np.uint8, device=device)
    n, kvh, hd = rows.shape
    if mode == "q8":
        if hd % kv_q8.BLOCK_VALUES:
            raise InvalidArgument(f"head_dim={hd}: q8 KV needs a multiple of "
                                  f"{kv_q8.BLOCK_VALUES}")
        row = hd // kv_q8.BLOCK_VALUES * kv_q8.RECORD_BYTES
    else:
        from pagedkv.quant import kv as kv_modes
        row = kv_modes.kv_mode(mode).row_bytes(hd)
    if pool.ndim != 4 or pool.shape[2:] != (kvh, row):
        raise InvalidArgument(f"pool: shape {pool.shape}, expected [num_blocks, block_size, "
                              f"{kvh}, {row}] for {mode} at kv_heads {kvh}, head_dim {hd} "
                              f"(those of {name} {rows.dtype}{list(rows.shape)})")
    if slots.shape[0] != n:
        raise InvalidArgument(f"slots: length {slots.shape[0]}, expected {n} (one per token)")
    return n, kvh, hd


def kv_q8_write(device: Device, src: DeviceArray, slots: DeviceArray, pool: DeviceArray,
                *, stream: Stream | None = None) -> None:
    """Quantize ``src`` (``float32`` or ``float16[n, kv_heads, head_dim]``) into the q8 pool
    at ``slots`` (``int64[n]``, slot = block * block_size + offset; -1 skips a token)."""
    rows = check_kv_rows(src, "src", slots, pool, into_pool=True, device=device)
    _launch_kv_q8_write(device, src, slots, pool, rows, stream)


def _launch_kv_q8_write(device: Device, src: DeviceArray, slots: DeviceArray,
                        pool: DeviceArray, rows: tuple[int, int, int], stream) -> None:
    """:func:`kv_q8_write`'s launch, its arguments checked (``rows``: what
    :func:`check_kv_rows` returned for them)."""
    n, kvh, hd = rows
    if n == 0:
        return
    name = "pkv_kv_q8_write_f32" if src.dtype == np.float32 else "pkv_kv_q8_write_f16"
    k = device.kernel(SOURCE, name, "pppiii")
    threads = n * kvh * hd  # one lane per value
    k((math.ceil(threads / 256),), (256,), src, slots, pool, n, kvh, hd, stream=stream)


def kv_q8_read(device: Device, pool: DeviceArray, slots: DeviceArray, out: DeviceArray,
               *, stream: Stream | None = None) -> None:
    """Dequantize the q8 rows at ``slots`` into ``out`` (``float32``/``float16[n, kv_heads,
    head_dim]``)."""
    rows = check_kv_rows(out, "out", slots, pool, into_pool=False, device=device)
    _launch_kv_q8_read(device, pool, slots, out, rows, stream)


def _launch_kv_q8_read(device: Device, pool: DeviceArray, slots: DeviceArray,
                       out: DeviceArray, rows: tuple[int, int, int], stream) -> None:
    """:func:`kv_q8_read`'s launch, its arguments checked (``rows`` from
    :func:`check_kv_rows`)."""
    n, kvh, hd = rows
    if n == 0:
        return
    name = "pkv_kv_q8_read_f32" if out.dtype == np.float32 else "pkv_kv_q8_read_f16"
    k = device.kernel(SOURCE, name, "pppiii")
    k((math.ceil(n * kvh * hd / 256),), (256,), pool, slots, out, n, kvh, hd, stream=stream)


KV_WRITE_THREADS = 256  # PKV_KV_WRITE_THREADS


def kv_rotated_write(device: Device, src: DeviceArray, slots: DeviceArray, pool: DeviceArray,
                     mode: str, *, stream: Stream | None = None) -> None:
    """Encode ``src`` (``float32`` or ``float16[n, kv_heads, head_dim]``) as records of the
    rotated KV mode ``mode`` (``fwht4``, ``fwht3``, ``fwht2``, ``lloyd4``, ``lloyd3``,
    ``lloyd2``) into ``pool`` (``uint8[num_blocks, block_size, kv_heads, row_bytes]``) at
    ``slots`` (``int64[n]``; -1 skips a token): the bytes :func:`pagedkv.quant.kv.encode`
    writes on the host, one CTA per (token, head) row. Finite input only (not checked on
    the device)."""
    from pagedkv.quant import kv as kv_modes
    m = kv_modes.kv_mode(mode)
    if not m.rotated:
        raise InvalidArgument(f"mode={mode!r}: expected a rotated KV mode (fwht4, fwht3, fwht2, "
                              f"lloyd4, lloyd3, lloyd2); q8 rows go through kv_q8_write")
    rows = check_kv_rows(src, "src", slots, pool, mode, into_pool=True, device=device)
    _launch_kv_rotated_write(device, src, slots, pool, m.id, rows, stream)


def _launch_kv_rotated_write(device: Device, src: DeviceArray, slots: DeviceArray,
                             pool: DeviceArray, mode_id: int, rows: tuple[int, int, int],
                             stream) -> None:
    """:func:`kv_rotated_write`'s launch, its arguments checked (``mode_id`` a rotated
    mode's, ``rows`` from :func:`check_kv_rows`)."""
    n, kvh, hd = rows
    if n == 0:
        return
    name = "pkv_kv_rotated_write_f32" if src.dtype == np.float32 else "pkv_kv_rotated_write_f16"
    k = device.kernel(SOURCE, name, "pppiiii")
    k((n * kvh,), (KV_WRITE_THREADS,), src, slots, pool, n, kvh, hd, mode_id, stream=stream)


def attention_scale(scale, head_dim: int) -> float:
    """The softmax scale of a decode attention: ``head_dim ** -0.5`` for ``None``, else
    ``scale`` as a float. A real number (``InvalidArgumentType`` for a str, a bool, an
    array) and finite (``InvalidArgument``: NaN or Inf turns every score, and so the
    output, into NaN)."""
    if scale is None:
        return float(head_dim ** -0.5)
    if not isinstance(scale, (int, float, np.integer, np.floating)) or isinstance(
            scale, (bool, np.bool_)):
        raise InvalidArgumentType(f"scale={scale!r}: expected a float (or None for "
                                  f"head_dim ** -0.5), got {type(scale).__name__}")
    try:
        value = float(scale)
    except OverflowError:  # an int past float's range
        value = math.inf
    if not math.isfinite(value):
        raise InvalidArgument(f"scale={scale!r}: must be finite (or None for head_dim ** -0.5)")
    return value


def check_decode_batch(block_tables: np.ndarray, seq_lens: np.ndarray, *, num_blocks: int,
                       block_size: int) -> None:
    """Host-side check of a decode batch before upload: every table entry a sequence
    uses is a valid block id and every length fits its table row."""
    given = {"block_tables": type(block_tables).__name__, "seq_lens": type(seq_lens).__name__}
    block_tables = np.asarray(block_tables)
    seq_lens = np.asarray(seq_lens)

    def what(name: str, arr: np.ndarray) -> str:
        # a list or tuple has no dtype of its own: say what was passed, and what it became
        kind = given[name]
        return (f"{arr.dtype}{list(arr.shape)}" if kind in ("ndarray", "array") else
                f"a {kind} (as an array {arr.dtype}{list(arr.shape)})")

    if block_size < 1:
        raise InvalidArgument(f"block_size = {block_size}: a pool holds at least one token "
                              "per block")
    if block_tables.dtype != np.int32 or block_tables.ndim != 2:
        raise InvalidArgument(f"block_tables: {what('block_tables', block_tables)}, expected "
                              f"an int32[seqs, width] array (np.asarray(tables, np.int32))")
    if seq_lens.dtype != np.int32 or seq_lens.shape != (block_tables.shape[0],):
        raise InvalidArgument(f"seq_lens: {what('seq_lens', seq_lens)}, expected an "
                              f"int32[{block_tables.shape[0]}] array")
    width = block_tables.shape[1]
    if seq_lens.size and (seq_lens.min() < 0 or seq_lens.max() > width * block_size):
        raise InvalidArgument(f"seq_lens: values must be in 0..{width * block_size} "
                              f"(table width {width} x block_size {block_size})")
    used = np.arange(width)[None, :] < -(-seq_lens[:, None] // block_size)
    ids = block_tables[used]
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise InvalidArgument(f"block_tables: a used entry is outside 0..{num_blocks - 1}")


class PagedAttention:
    """Paged-attention decode for one geometry, with its partition workspace allocated once.

    ``run(q, k_pool, v_pool, block_tables, seq_lens, out)``: ``q`` ``float32[seqs, heads,
    head_dim]``; pools ``[num_blocks, block_size, kv_heads, row]`` of float16, bfloat16
    (uint16), q8 (uint8), or for a compressed ``kv_dtype`` (``"fwht4/q8"``,
    ``"fwht4/lloyd4"``, ...: :data:`QUANT_KV_DTYPES`) uint8 records of each side's mode, read
    as stored (no decompressed copy); ``block_tables`` ``int32[seqs, width]``; ``seq_lens``
    ``int32[seqs]``, each at most ``max_seq_len``; ``out`` ``float32[seqs, heads, head_dim]``.

    ``q8_mma``: q8 KV on the f16 tensor-core passes (NVIDIA sm_80+, head_dim 64/128, at most 4
    query heads per KV head; elsewhere the same kernel runs its CUDA-core passes) or, when
    False, the CUDA-core ``_cc`` kernels everywhere; ``None`` reads ``PAGEDKV_ATTN_Q8_MMA``
    (default on), the switch that turns the tensor-core q8 path off without a code change.

    ``q8_stage``: with ``q8_mma``, the ``q8s`` kernels: the same tensor-core passes with each
    warp's next K/V rows copied into shared memory by wide asynchronous copies first
    (docs/kernels.md, "q8 attention on tensor cores"; 1.18x the unstaged kernel on the
    H200). They read pools in 8-byte units: ``True`` refuses a pool that starts off 8-byte
    alignment (``InvalidArgument``), ``None`` (the default; ``PAGEDKV_ATTN_Q8_STAGE``, default
    on, where set) runs the unstaged tensor-core kernel for such a pool instead, and for
    short partitions on a sparse grid (:func:`q8_stage_pays`). Ignored when ``q8_mma`` is off.

    ``qkv_mma``: a compressed pair with 4- or 2-bit K and a q8, 4- or 2-bit V runs its
    ``_mma`` kernels (q.K and, for a rotated V, P.V as f16 tensor-core mma over centroid
    tables, NVIDIA sm_80+ with at most 4 query heads per KV head; on AMD CDNA and gfx11 as
    MFMA / WMMA with up to 8; elsewhere the same kernels run the CUDA-core passes) or, when
    False, the CUDA-core kernels; ``None`` reads ``PAGEDKV_ATTN_QKV_MMA`` (default on), and on
    an AMD arch with matrix cores also the unit's opt-in (``PAGEDKV_ATTN_MFMA=1`` /
    ``PAGEDKV_ATTN_WMMA=1``, default off: compile-checked and emulated only, docs/kernels.md,
    "AMD matrix cores"); :attr:`mfma` / :attr:`wmma` then say so too. :attr:`qkv_mma` says
    which (``None`` for a pair without ``_mma`` kernels and for the other KV dtypes).
    ``q8_int``: with ``q8_stage``, the ``q8i`` kernels: the staged kernels with pass 1 (q·Kᵀ) on
    integer tensor cores, q quantized once per CTA to exact 22-bit integers per 32-dim record
    and the K codes multiplied as they are stored (docs/kernels.md, "q8 attention on tensor cores"). ``None``
    reads ``PAGEDKV_ATTN_Q8_INT`` (default off until a device run vouches for it); ``True``
    with ``q8_stage`` or ``q8_mma`` off is refused. Same alignment rule as ``q8_stage``.
    ``q8_tma``: the staged kernels copy each chunk with one TMA tensor copy where it applies
    (CUDA sm_90+, head_dim 128, ``kv_heads`` even, ``block_size`` a multiple of 16, pools
    16-byte aligned; docs/kernels.md, "q8 attention on tensor cores"), else with ``cp.async``;
    ``False`` always ``cp.async``; ``None`` reads ``PAGEDKV_ATTN_Q8_TMA`` (default on).

    ``partition_tokens``: tokens per partition (a multiple of 16, at most the kernel's
    :data:`ATTN_PARTITION_TOKENS`); ``None`` reads ``PAGEDKV_ATTN_PARTITION_TOKENS`` where set,
    else :func:`attention_partition_tokens` picks it from the geometry (fewer tokens when a
    small batch would leave SMs idle).

    ``PAGEDKV_ATTN_MFMA=1`` (default off): float16 KV with head_dim 64/128 on AMD CDNA
    (gfx908/gfx90a/gfx940-942), and bfloat16 KV on gfx90a/gfx940-942, run both passes on MFMA
    matrix cores (``pkv_paged_attention_{f16,bf16}mfma_g*``), and so does q8 KV with
    ``q8_mma`` on and unstaged, the AMD default (``pkv_paged_attention_q8mfma_g*``);
    compile-checked and emulated only, docs/kernels.md, "AMD matrix cores". :attr:`mfma` says
    whether this object does. ``PAGEDKV_ATTN_WMMA=1`` (default off) does the same with RDNA3
    WMMA on gfx11 (``pkv_paged_attention_{f16,bf16,q8}wmma_g*``, q8 as for MFMA);
    :attr:`wmma` says whether this object does.
    """

    def __init__(self, device: Device, *, num_seqs: int, num_heads: int, kv_heads: int,
                 head_dim: int, block_size: int, max_seq_len: int, kv_dtype: str,
                 scale: float | None = None, q8_mma: bool | None = None,
                 q8_stage: bool | None = None, q8_int: bool | None = None,
                 q8_tma: bool | None = None, qkv_mma: bool | None = None,
                 partition_tokens: int | None = None) -> None:
        for name, flag in (("q8_mma", q8_mma), ("q8_stage", q8_stage), ("q8_int", q8_int),
                           ("q8_tma", q8_tma), ("qkv_mma", qkv_mma)):
            if flag is not None and not isinstance(flag, bool):
                raise InvalidArgumentType(f"{name}={flag!r}: expected True, False or None")
        if kv_dtype not in KV_DTYPES and kv_dtype not in QUANT_KV_DTYPES:
            raise InvalidArgument(f"kv_dtype={kv_dtype!r}: expected one of {list(KV_DTYPES)} or "
                                  f"a compressed pair {list(QUANT_KV_DTYPES)}")
        if head_dim not in (32, 64, 128, 256):
            raise InvalidArgument(f"head_dim={head_dim}: expected 32, 64, 128 or 256")
        if kv_dtype in QUANT_KV_DTYPES:
            from pagedkv.quant import kv as kv_modes
            for side in kv_modes.split_kv_dtype(kv_dtype):
                if not kv_modes.kv_mode(side).supports(head_dim):
                    raise InvalidArgument(f"head_dim={head_dim}: {side} (of kv_dtype "
                                          f"{kv_dtype!r}) needs head_dim "
                                          f"{kv_modes.kv_mode(side).head_dims()}")
            self.k_row, self.v_row = (kv_modes.side_row_bytes(m, head_dim)
                                      for m in kv_modes.split_kv_dtype(kv_dtype))
        else:
            self.k_row = self.v_row = (head_dim // kv_q8.BLOCK_VALUES * kv_q8.RECORD_BYTES
                                       if kv_dtype == "q8" else head_dim)
        if kv_heads < 1 or num_heads % kv_heads or num_heads // kv_heads > 8:
            raise InvalidArgument(f"num_heads={num_heads}, kv_heads={kv_heads}: num_heads must "
                                  f"be 1..8 times kv_heads")
        if block_size < 1 or num_seqs < 1 or max_seq_len < 1:
            raise InvalidArgument(f"block_size={block_size}, num_seqs={num_seqs}, max_seq_len="
                                  f"{max_seq_len}: each must be >= 1")
        self.device = device
        self.num_seqs, self.num_heads, self.kv_heads = num_seqs, num_heads, kv_heads
        self.head_dim, self.block_size, self.kv_dtype = head_dim, block_size, kv_dtype
        self.scale = attention_scale(scale, head_dim)
        group = num_heads // kv_heads
        self.gmax = attention_group_slots(num_heads, kv_heads)
        if self.gmax > head_dim // 8:  # a token's head_dim/8 lanes carry the group's scores
            raise InvalidArgument(f"head_dim={head_dim} with {group} query heads per KV head: "
                                  f"at most {head_dim // 8} heads per KV head at this head_dim")
        self.qkv_mma = None
        qkv_unit = None  # the AMD matrix unit the _mma kernels' code passes run on
        if kv_dtype in QUANT_KV_DTYPES and qkv_mma_applies(kv_dtype):
            # On CDNA / gfx11 the _mma kernels run the code passes on MFMA / WMMA, which no
            # AMD device has run yet: taken only when asked (the unit's opt-in or
            # qkv_mma=True), like the other AMD matrix-core kernels.
            unit = amd_matrix_unit(device)
            default = env_bool("PAGEDKV_ATTN_QKV_MMA", True) and (
                unit is None or env_bool(_ATTN_AMD_OPT_IN[unit], False))
            self.qkv_mma = bool(default if qkv_mma is None else qkv_mma)
            qkv_unit = unit if self.qkv_mma else None
        # The _mma kernels' tensor-core passes on NVIDIA (at most 4 heads a group: MMA_OK in
        # hip/kvcache.hip) have a partition of their own; AMD's and the CUDA-core fallback
        # inside an _mma kernel keep the pair's.
        most = (ATTN_PARTITION_TOKENS_QKV_MMA
                if self.qkv_mma and getattr(device, "backend", None) == "cuda"
                and self.gmax <= 4 and device.properties.warp_size == 32
                else ATTN_PARTITION_TOKENS[kv_dtype])
        source = "partition_tokens"
        if partition_tokens is None:
            partition_tokens = env_u32("PAGEDKV_ATTN_PARTITION_TOKENS", None)
            source = "PAGEDKV_ATTN_PARTITION_TOKENS"
        if partition_tokens is None:
            partition_tokens = attention_partition_tokens(
                kv_dtype, num_seqs, kv_heads, max_seq_len,
                getattr(device.properties, "multiprocessor_count", 0), most=most)
        elif (isinstance(partition_tokens, bool) or not isinstance(partition_tokens, int)
              or not 16 <= partition_tokens <= most or partition_tokens % 16):
            raise InvalidArgument(f"{source}={partition_tokens!r}: expected a multiple "
                                  f"of 16 in 16..{most} (kv_dtype {kv_dtype!r})")
        self.partition_tokens = partition_tokens
        self.max_partitions = math.ceil(max_seq_len / self.partition_tokens)
        # A rotated V's pass 2 on AMD matrix cores leaves the waves' partial outputs in
        # static shared memory: reserving room for them too put gfx11's g8 kernels at
        # head_dim 256 at ~77 KB, over a workgroup's 64 KB (hip/kvcache.hip checks the sum).
        self.shared_bytes = attention_shared_bytes(
            kv_dtype, self.gmax, head_dim, warp_size=device.properties.warp_size, most=most,
            partials=qkv_unit is None or kv_dtype.endswith("/q8"))
        if q8_mma is None:
            q8_mma = env_bool("PAGEDKV_ATTN_Q8_MMA", True)
        self.q8_mma = bool(q8_mma) if kv_dtype == "q8" else None
        stage_asked = q8_stage is True
        if q8_stage is None:
            # NVIDIA only; q8_int=True asks for the q8i kernels, staged whether it pays or not
            q8_stage = (getattr(device, "backend", None) != "hip"
                        and device.properties.warp_size == 32
                        and q8_staged_by_default(
                            head_dim, self.gmax, self.partition_tokens,
                            num_seqs * kv_heads * self.max_partitions,
                            getattr(device.properties, "multiprocessor_count", 0),
                            pays=q8_int is True))
        self.q8_stage = bool(q8_stage and self.q8_mma) if kv_dtype == "q8" else None
        if q8_int is True and kv_dtype == "q8" and not self.q8_stage:
            raise InvalidArgument("q8_int=True: the q8i kernels are the staged tensor-core ones; "
                                  "leave q8_mma and q8_stage on (True or None)")
        if q8_int is None:
            q8_int = env_bool("PAGEDKV_ATTN_Q8_INT", False)
        self.q8_int = bool(q8_int and self.q8_stage) if kv_dtype == "q8" else None
        if q8_tma is None:
            q8_tma = env_bool("PAGEDKV_ATTN_Q8_TMA", True)
        # whether staged launches may take tensor copies (_tensor_maps: where they apply)
        self.q8_tma = bool(q8_tma and self.q8_stage) if kv_dtype == "q8" else None
        parts = (num_seqs, num_heads, self.max_partitions)
        self.part_out = device.empty(parts + (head_dim,), np.float32)
        self.part_max = device.empty(parts, np.float32)
        self.part_sum = device.empty(parts, np.float32)
        # f16 / bf16 / q8 KV, head_dim 64/128, on AMD matrix cores (MFMA on CDNA, WMMA on
        # gfx11): both passes there (q8 in place of the plain q8 kernel only; bf16 on CDNA
        # only with the k-16 bf16 MFMA), opt-in per unit (PAGEDKV_ATTN_MFMA=1 /
        # PAGEDKV_ATTN_WMMA=1): compile-checked and emulated only, never run on AMD.
        unit = amd_matrix_unit(device) if head_dim in (64, 128) else None
        matrix = ""  # the partition kernel's suffix: "", "mfma" or "wmma"
        if unit is not None and env_bool(_ATTN_AMD_OPT_IN[unit], False):
            dtypes = {"float16", "q8" if self.q8_mma and not self.q8_stage else "",
                      "bfloat16" if unit == "wmma" or device.properties.arch in MFMA_BF16_ARCHES
                      else ""}
            matrix = unit if kv_dtype in dtypes else ""
        self.mfma = matrix == "mfma"
        self.wmma = matrix == "wmma"
        if kv_dtype in KV_DTYPES:
            kind = KV_DTYPES[kv_dtype] + ("cc" if self.q8_mma is False else
                                          "i" if self.q8_int else
                                          "s" if self.q8_stage else "")
            kind += matrix
        else:
            k_side, v_side = kv_dtype.split("/")
            kind = f"{_K_KERNEL.get(k_side, k_side)}_{_V_KERNEL.get(v_side, v_side)}"
        if self.qkv_mma is not None:
            kind += "_mma" if self.qkv_mma else ""
            self.mfma, self.wmma = qkv_unit == "mfma", qkv_unit == "wmma"
        # The staged q8 kernels (q8s, q8i) also take the pools' tensor maps (_tensor_maps).
        self._partition = device.kernel(
            SOURCE, f"pkv_paged_attention_{kind}_g{self.gmax}",
            "ppppppppfiiiiiii" + ("mmi" if self.q8_stage else ""))
        self._maps_key: tuple | None = None
        self._maps: tuple[bytes, bytes, int] = (bytes(128), bytes(128), 0)
        # Staged by default: a pool off 8-byte alignment (a DLPack import at an odd offset)
        # runs the unstaged tensor-core kernel instead, same partition and shared memory.
        self._unstaged = (device.kernel(SOURCE, f"pkv_paged_attention_q8_g{self.gmax}",
                                        "ppppppppfiiiiiii")
                          if self.q8_stage and not stage_asked else None)
        # A rotated V leaves each head's output in its basis (lloyd, fwht3: R256; fwht4,
        # fwht2: R128 per half): its reduce rotates it back.
        v_rot = 0
        if kv_dtype in QUANT_KV_DTYPES:
            from pagedkv.quant import kv as kv_modes
            v_rot = kv_modes.kv_mode(kv_dtype.split("/")[1]).rotation
        self._rotated_out = v_rot != 0
        self._reduce_threads = reduce_threads(self.max_partitions, head_dim, v_rot != 0)
        self._reduce = device.kernel(
            SOURCE, f"pkv_paged_attention_reduce_ifwht{v_rot}" if v_rot
            else "pkv_paged_attention_reduce", "pppppiiii")
        #: Whether :meth:`run_prep` takes this geometry: the plain reduce's combine (a rotated
        #: V's reduce rotates each head back through shared memory first: not fused) over
        #: rows of whole 256-groups (``num_heads * head_dim % 256 == 0``).
        self.prep_fusable = not self._rotated_out and num_heads * head_dim % 256 == 0

    @property
    def kernel_name(self) -> str:
        """The partition kernel a launch runs (a q8 pool off 8-byte alignment runs the
        unstaged tensor-core one instead, :meth:`run` decides per call)."""
        return self._partition.name

    @property
    def launch(self) -> str:
        """The launch :meth:`run` makes: ``"<partition kernel> <partitions>x<tokens>"``, e.g.
        ``"pkv_paged_attention_q8_g4 17x64"`` (as :attr:`Gemv.launch` says a GEMV's), so a
        figure can say which launch made it."""
        return f"{self.kernel_name} {self.max_partitions}x{self.partition_tokens}"

    def __repr__(self) -> str:
        return (f"PagedAttention(seqs={self.num_seqs}, heads={self.num_heads}/{self.kv_heads}, "
                f"head_dim={self.head_dim}, block_size={self.block_size}, "
                f"kv_dtype={self.kv_dtype!r}, partitions={self.max_partitions}"
                f"x{self.partition_tokens}"
                + ("" if self.q8_mma is None else
                   f", q8_mma={self.q8_mma}, q8_stage={self.q8_stage}")
                + (", q8_int=True" if self.q8_int else "")
                + (", q8_tma=False" if self.q8_tma is False and self.q8_stage else "")
                + (", mfma=True" if self.mfma else "")
                + (", wmma=True" if self.wmma else "")
                + ("" if self.qkv_mma is None else f", qkv_mma={self.qkv_mma}") + ")")

    def _check(self, q, k_pool, v_pool, block_tables, seq_lens, out):
        """Validate a launch's arguments (``out`` may be None: :meth:`run_prep`); returns the
        partition kernel to run."""
        partition = self._partition
        s, h, d = self.num_seqs, self.num_heads, self.head_dim
        need_array(q, "q", np.float32, 3, device=self.device)
        if q.shape != (s, h, d):
            raise InvalidArgument(f"q: shape {q.shape}, expected {(s, h, d)}")
        self._check_reduce(seq_lens, out)
        storage = "q8" if self.kv_dtype in QUANT_KV_DTYPES else self.kv_dtype  # uint8 records
        for name, pool, row in (("k_pool", k_pool, self.k_row), ("v_pool", v_pool, self.v_row)):
            if not isinstance(pool, DeviceArray) or kv_dtype_of(pool) != storage:
                raise InvalidArgument(f"{name}: expected a {self.kv_dtype} pool DeviceArray")
            need_device_array(pool, name, self.device)
            if pool.ndim != 4 or pool.shape[1:] != (self.block_size, self.kv_heads, row):
                raise InvalidArgument(f"{name}: shape {pool.shape}, expected [num_blocks, "
                                      f"{self.block_size}, {self.kv_heads}, {row}]")
            if self.q8_stage and pool.ptr % 8:  # the q8s kernels copy rows in 8-byte units
                if self._unstaged is None:
                    raise InvalidArgument(f"{name}: the q8_stage kernels need an 8-byte "
                                          f"aligned pool, this one starts at {pool.ptr:#x}")
                partition = self._unstaged
        if k_pool.shape[0] != v_pool.shape[0]:  # a table's ids index both
            raise InvalidArgument(f"v_pool: {v_pool.shape[0]} blocks, k_pool {k_pool.shape[0]}: "
                                  "the two pools of a layer hold the same blocks")
        need_array(block_tables, "block_tables", np.int32, 2, device=self.device)
        if block_tables.shape[0] != s:
            raise InvalidArgument(f"block_tables: {block_tables.shape[0]} rows, expected {s}")
        return partition

    def run(self, q: DeviceArray, k_pool: DeviceArray, v_pool: DeviceArray,
            block_tables: DeviceArray, seq_lens: DeviceArray, out: DeviceArray,
            *, stream: Stream | None = None) -> None:
        partition = self._check(q, k_pool, v_pool, block_tables, seq_lens, out)
        self._partitions(partition, q, k_pool, v_pool, block_tables, seq_lens, stream)
        self._launch_reduce(seq_lens, out, stream)

    def reduce(self, seq_lens: DeviceArray, out: DeviceArray, *,
               stream: Stream | None = None) -> None:
        """The partition reduce alone (the second launch of :meth:`run`): combine the
        partition workspace (:attr:`part_out`, :attr:`part_max`, :attr:`part_sum`, as the
        last partition launch left them, or as a caller filled them: a sequence of
        ``seq_lens[s]`` tokens reads its first ``ceil(seq_lens[s] / partition_tokens)``
        partitions, none past them) into ``out`` ``float32[seqs, heads, head_dim]`` (an
        empty sequence: zeros). The summation order is fixed (hip/attention_reduce.h)."""
        self._check_reduce(seq_lens, out)
        self._launch_reduce(seq_lens, out, stream)

    def run_prep(self, q: DeviceArray, k_pool: DeviceArray, v_pool: DeviceArray,
                 block_tables: DeviceArray, seq_lens: DeviceArray, prepared: PreparedX,
                 out: DeviceArray | None = None, *, stream: Stream | None = None) -> None:
        """:meth:`run` whose reduce also writes its output, as ``float32[seqs, heads *
        head_dim]`` rows, into ``prepared`` (``Gemv.prepared_x()`` of a tensor-core GEMV of
        batch ``num_seqs`` and ``K = num_heads * head_dim``: the O projection's), one launch
        instead of the reduce and ``Gemv.prepare``: the bytes ``gemv.prepare(out)`` writes
        after :meth:`run` (``pkv_attention_reduce_prep_f32``, hip/decode.hip; the reduce's
        arithmetic and summation order are hip/attention_reduce.h, shared). Then
        ``gemv.run_prepared(w, y)`` on the same stream. ``out`` may be ``None`` (not
        written). Geometries: :attr:`prep_fusable` (``InvalidArgument`` otherwise, nothing
        launched)."""
        self._check_prep(prepared)
        partition = self._check(q, k_pool, v_pool, block_tables, seq_lens, out)
        self._partitions(partition, q, k_pool, v_pool, block_tables, seq_lens, stream)
        self._launch_reduce_prep(seq_lens, prepared, out, stream)

    def reduce_prep(self, seq_lens: DeviceArray, prepared: PreparedX,
                    out: DeviceArray | None = None, *, stream: Stream | None = None) -> None:
        """The fused reduce + prep alone (the second launch of :meth:`run_prep`) over the
        partition workspace, as :meth:`reduce` reads it."""
        self._check_prep(prepared)
        self._check_reduce(seq_lens, out)
        self._launch_reduce_prep(seq_lens, prepared, out, stream)

    def _check_prep(self, prepared: PreparedX) -> None:
        if not self.prep_fusable:
            raise InvalidArgument(
                f"{self!r}: no fused reduce + prep here (a rotated V's reduce, or num_heads * "
                f"head_dim {self.num_heads * self.head_dim} not a multiple of 256); call "
                f"run(...) then Gemv.prepare(out)")
        check_prepared(prepared, self.num_seqs, self.num_heads * self.head_dim, self.device)

    def _check_reduce(self, seq_lens: DeviceArray, out: DeviceArray | None) -> None:
        """The reduce's own arguments (``out`` None: :meth:`reduce_prep` without one)."""
        need_array(seq_lens, "seq_lens", np.int32, 1, device=self.device)
        if seq_lens.shape[0] != self.num_seqs:
            raise InvalidArgument(f"seq_lens: {seq_lens.shape[0]} rows, expected "
                                  f"{self.num_seqs}")
        if out is not None:
            need_array(out, "out", np.float32, 3, writable=True, device=self.device)
            want = (self.num_seqs, self.num_heads, self.head_dim)
            if out.shape != want:
                raise InvalidArgument(f"out: shape {out.shape}, expected {want}")

    def _launch_reduce(self, seq_lens, out, stream) -> None:
        self._reduce((self.num_heads, self.num_seqs), (self._reduce_threads,),
                     self.part_out, self.part_max, self.part_sum, seq_lens, out,
                     self.num_heads, self.head_dim, self.max_partitions, self.partition_tokens,
                     stream=stream)

    def _launch_reduce_prep(self, seq_lens, prepared, out, stream) -> None:
        kernel = self.device.kernel("decode", "pkv_attention_reduce_prep_f32", "pppppppiiiiiii",
                                    dependent_launch=True)
        # a block of ATTN_REDUCE_SLICES 32-lane warps per (256-group, seq)
        kernel((self.num_heads * self.head_dim // 256, self.num_seqs), (REDUCE_PREP_THREADS,),
               self.part_out, self.part_max, self.part_sum, seq_lens,
               0 if out is None else out, prepared.xq, prepared.xs, self.num_seqs,
               self.num_heads, self.head_dim, self.max_partitions, self.partition_tokens,
               prepared.tiles, int(prepared.rotate), stream=stream)

    def _tensor_maps(self, k_pool: DeviceArray, v_pool: DeviceArray) -> tuple[bytes, bytes, int]:
        """The staged q8 kernels' TMA tensor maps of the two pools and whether to use them
        (hip/kvcache.hip, PKV_ATTN_Q8_STAGE_TMA): each pool as [blocks x block_size] token
        slots of ``kv_heads x row`` bytes, boxes of 16 slots x 144 bytes (a KV head's row in
        its 16-byte aligned window). Only with :attr:`q8_tma`, on CUDA sm_90+, head_dim 128,
        ``kv_heads`` even, ``block_size`` a multiple of 16 and pools 16-byte aligned; else
        zeros and 0 (cp.async). Built once per pair of pool
        allocations: a host-side encoding, so a launch inside a graph capture may build them."""
        key = (k_pool.ptr, v_pool.ptr, k_pool.shape[0], v_pool.shape[0])
        if key != self._maps_key:
            dev, row = self.device, self.k_row
            slot_bytes = self.kv_heads * row
            # sm_90 and newer (an sm_80 build's code ignores the maps)
            use = (getattr(dev, "backend", None) == "cuda"
                   and sm_version(getattr(dev.properties, "arch", "")) >= 90
                   and self.q8_tma is True and self.head_dim == 128
                   and self.kv_heads % 2 == 0 and self.block_size % ATTN_Q8_TMA_BOX[1] == 0
                   and k_pool.ptr % 16 == 0 and v_pool.ptr % 16 == 0)
            maps = tuple(dev.tensor_map_2d(pool.ptr, slot_bytes, pool.shape[0] * self.block_size,
                                           slot_bytes, *ATTN_Q8_TMA_BOX)
                         if use else bytes(128) for pool in (k_pool, v_pool))
            self._maps, self._maps_key = (maps[0], maps[1], int(use)), key
        return self._maps

    def _partitions(self, partition, q, k_pool, v_pool, block_tables, seq_lens, stream) -> None:
        """Launch the partition kernel (``_check``'s choice) into the partition workspace."""
        maps = (self._tensor_maps(k_pool, v_pool) if partition is self._partition
                and self.q8_stage else ())
        partition((self.max_partitions, self.kv_heads, self.num_seqs), (ATTN_THREADS,),
                  q, k_pool, v_pool, block_tables, seq_lens, self.part_out,
                  self.part_max, self.part_sum, self.scale, self.num_heads,
                  self.kv_heads, self.head_dim, self.block_size, block_tables.shape[1],
                  self.max_partitions, self.partition_tokens, *maps,
                  shared_bytes=self.shared_bytes, stream=stream)

    def run_pool(self, q: DeviceArray, pool, layer: int, tables, out: DeviceArray, *,
                 generation: int | None = None, stream=None) -> None:
        """:meth:`run` over ``layer`` of a device ``LayerKVPool`` and a
        :class:`~pagedkv.kernels.paged.DeviceDecodeBatch`; a table of another pool
        generation raises ``StaleBlockTable`` before any launch (pagedkv.kernels.paged)."""
        from pagedkv.kernels.paged import attention
        attention(self, q, pool, layer, tables, out, generation=generation, stream=stream)


def copy_blocks(device: Device, src: DeviceArray, src_ids: DeviceArray, dst_ids: DeviceArray,
                dst: DeviceArray, *, stream: Stream | None = None) -> None:
    """Copy block ``src_ids[i]`` of ``src`` to block ``dst_ids[i]`` of ``dst`` (axis 0 is the
    block; both arrays have the same bytes per block): pool growth, cold capture (pool →
    staging) and restore (staging → pool)."""
    need_array(src_ids, "src_ids", np.int32, 1, device=device)
    need_array(dst_ids, "dst_ids", np.int32, 1, device=device)
    if src_ids.shape != dst_ids.shape:
        raise InvalidArgument(f"src_ids/dst_ids: lengths {src_ids.shape[0]} and "
                              f"{dst_ids.shape[0]} differ")
    if not isinstance(src, DeviceArray) or not isinstance(dst, DeviceArray):
        raise InvalidArgumentType("src, dst: expected DeviceArrays")
    need_device_array(src, "src", device)
    need_writable(dst, "dst", device)
    if src.ndim < 1 or dst.ndim < 1 or src.shape[0] == 0 or dst.shape[0] == 0:
        raise InvalidArgument(f"src/dst: shapes {src.shape}/{dst.shape} need blocks on axis 0")
    block_bytes = src.nbytes // src.shape[0]
    if dst.nbytes // dst.shape[0] != block_bytes:
        raise InvalidArgument(f"src/dst: {block_bytes} and {dst.nbytes // dst.shape[0]} bytes "
                              f"per block differ")
    n = src_ids.shape[0]
    if n == 0:
        return
    vec = block_bytes % 16 == 0 and src.ptr % 16 == 0 and dst.ptr % 16 == 0
    name = "pkv_copy_blocks_16" if vec else "pkv_copy_blocks_1"
    units = block_bytes // 16 if vec else block_bytes
    k = device.kernel(SOURCE, name, "ppppiq")
    k((min(math.ceil(units / 256), 64), min(n, 65535)), (256,), src, src_ids, dst_ids, dst, n,
      block_bytes, stream=stream)
