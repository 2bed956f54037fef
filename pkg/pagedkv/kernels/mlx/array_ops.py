"""The kernel set in plain MLX array ops: the path where no custom kernel runs (MLX's CPU
backend; a CUDA build of pagedkv without its hip/ sources), and the scatters every path
ends with (custom kernels return new arrays; ``a[idx] = v`` on MLX updates in place
when nothing else holds ``a``).

Each step is one f32 operation in the order quant.h and the NumPy references take
them, so dequantization, FWHT and KV q8 are bit-exact with the CPU codecs here; GEMV
and attention differ from the references by summation order only (docs/kernels.md,
"Tolerances").
"""

from __future__ import annotations

import functools
import math

import numpy as np

from pagedkv.quant import kv_q8

__all__ = [
    "copy_blocks",
    "dequantize",
    "fwht256",
    "gemv",
    "kv_q8_quantize",
    "kv_q8_read",
    "paged_attention",
    "scatter_blocks",
    "unpack_codes",
]


@functools.cache
def _signs() -> tuple[np.ndarray, np.ndarray]:
    from pagedkv.quant.fwht import sign_table
    return sign_table(42), sign_table(1042)  # SIGNS1 (D1), SIGNS2 (D2): quant.h's seeds


def unpack_codes(mx, payload, bits: int, count: int):
    """``uint8[rows, count]`` codes from ``uint8[rows, bits*count/8]`` LSB-first payloads."""
    rows = payload.shape[0]
    if bits == 8:
        return payload
    if bits == 4:
        lo, hi = payload & 0x0F, payload >> 4
        return mx.stack([lo, hi], axis=-1).reshape(rows, count)
    shifts = mx.arange(8, dtype=mx.uint8)
    bit_planes = (payload[:, :, None] >> shifts) & 1  # [rows, bytes, 8], bit order LSB first
    per_code = bit_planes.reshape(rows, count, bits).astype(mx.uint32)
    weights = mx.array(1 << np.arange(bits, dtype=np.uint32))
    return (per_code * weights).sum(axis=-1).astype(mx.uint8)


def _f16_fields(mx, group_bytes, start: int, count: int):
    """``count`` little-endian f16 fields from byte ``start`` of each row, as float32."""
    return group_bytes[:, start:start + 2 * count].view(mx.float16).astype(mx.float32)


def dequantize(mx, raw, codec, numel: int, out_dtype):
    """``out_dtype[numel]`` weights in the stored basis, quant.h's decode op by op."""
    G, B = codec.group_size, codec.group_bytes
    groups = raw.reshape(-1, B)
    if codec.kind == "q8":
        d = _f16_fields(mx, groups, 0, 1)
        w = d * groups[:, 2:].view(mx.int8).astype(mx.float32)
    elif codec.kind == "lloyd":  # 2**bits f16 centroids, then the indices: w = cb[idx]
        n_cb = 1 << codec.bits
        cb = _f16_fields(mx, groups, 0, n_cb)
        idx = unpack_codes(mx, groups[:, 2 * n_cb:], codec.bits, G).astype(mx.uint32)
        w = mx.take_along_axis(cb, idx, axis=1)
    else:
        q = unpack_codes(mx, groups[:, 8:], codec.bits, G).astype(mx.float32)
        family = int(codec.family)
        if family in (0, 1):  # HFQ, MQ v1: f32 scale, f32 min
            scale = groups[:, 0:4].view(mx.float32)
            offset = groups[:, 4:8].view(mx.float32)
            w = q * scale + offset
        elif family == 2:  # MQ V2: (s, z) per 128-half
            sz = _f16_fields(mx, groups, 0, 4).reshape(-1, 2, 2, 1)
            w = (q.reshape(-1, 2, 128) * sz[:, :, 0] + sz[:, :, 1]).reshape(-1, G)
        else:  # MQ4C: one (s, z)
            sz = _f16_fields(mx, groups, 0, 2)
            w = q * sz[:, 0:1] + sz[:, 1:2]
    return w.reshape(-1)[:numel].astype(out_dtype)


def _butterflies(mx, y):
    """quant.h's pkv_fwht_butterflies on each row of ``y`` (``[rows, 256]``)."""
    rows = y.shape[0]
    h = 1
    while h < 256:
        pairs = y.reshape(rows, 256 // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = mx.stack([a + b, a - b], axis=2).reshape(rows, 256)
        h *= 2
    return y


def fwht256(mx, x, *, inverse: bool = False):
    """FWHT-256 (or its inverse) of each 256-segment of float32 ``x``: pkv_fwht/pkv_ifwht."""
    s1, s2 = _signs()
    pre, post = (s2, s1) if inverse else (s1, s2)
    y = x.reshape(-1, 256) * mx.array(pre)
    y = _butterflies(mx, y) * mx.array(np.float32(0.0625) * post)  # c * (+-1) is exact
    return y.reshape(x.shape)


def gemv(mx, w_raw, codec, M: int, K: int, x):
    """``W x[b]`` from the stored weights (rotated formats rotate ``x``)."""
    w = dequantize(mx, w_raw, codec, M * K, mx.float32).reshape(M, K)
    if codec.rotated:
        x = fwht256(mx, x)
    return x @ w.T


def kv_q8_quantize(mx, values):
    """q8 records of ``values`` (f32/f16 ``[..., head_dim]``), docs/contracts/hfqm-and-quant.md,
    '6.3 q8 (K and V)': the KV-mode encoder's (:mod:`pagedkv.quant.kv_mlx`), one encoder for
    both, so kvquant.h's rules (codes 0 where ``127 / amax`` overflows) hold in each."""
    from pagedkv.quant.kv_mlx import _encode_q8
    shape = values.shape
    records, _ = _encode_q8(values.astype(mx.float32).reshape(-1, shape[-1]))
    return records.reshape(*shape[:-1], shape[-1] // kv_q8.BLOCK_VALUES * kv_q8.RECORD_BYTES)


def _q8_to_float(mx, records, head_dim: int):
    rec = records.reshape(-1, kv_q8.RECORD_BYTES)
    d = _f16_fields(mx, rec, 0, 1)
    return (d * rec[:, 2:].view(mx.int8).astype(mx.float32)).reshape(
        *records.shape[:-1], head_dim)


def kv_q8_read(mx, pool, slots, kv_heads: int, head_dim: int, out_dtype):
    """The q8 rows of ``pool`` (``[num_slots, kv_heads, row]``) at ``slots``, dequantized."""
    rows = mx.take(pool.reshape(-1, kv_heads, head_dim // kv_q8.BLOCK_VALUES * kv_q8.RECORD_BYTES), slots, axis=0)
    return _q8_to_float(mx, rows, head_dim).astype(out_dtype)


def _pool_float(mx, rows, kv_dtype: str, head_dim: int):
    if kv_dtype == "q8":
        return _q8_to_float(mx, rows, head_dim)
    return rows.astype(mx.float32)


def paged_attention(mx, q, k_pool, v_pool, block_tables, seq_lens, *, kv_dtype: str,
                    scale: float, max_seq_len: int):
    """Decode attention by gathering each sequence's K/V rows (f32 math, masked softmax)."""
    seqs, heads, head_dim = q.shape
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = heads // kv_heads
    if block_tables.shape[1] == 0 or k_pool.shape[0] == 0:  # no token anywhere: zeros
        return mx.zeros((seqs, heads, head_dim), mx.float32)
    width = max(1, min(block_tables.shape[1], math.ceil(max_seq_len / block_size)))
    # Only a sequence's used entries (the first ceil(len / block_size)) are ids; the rest
    # is padding (-1 from the adapter, or anything: check_decode_batch reads used entries
    # only) and reads block 0 instead, masked below. mx.take does not bounds-check: an
    # out-of-range padding id read past the pool (wrong results or a segfault). Clipping
    # keeps an unchecked (check=False) bad id inside the pool too.
    used = mx.arange(width)[None, :] < (seq_lens[:, None] + block_size - 1) // block_size
    tables = mx.where(used, mx.clip(block_tables[:, :width], 0, k_pool.shape[0] - 1), 0)
    tokens = width * block_size

    def rows(pool):
        r = mx.take(pool, tables.reshape(-1), axis=0)  # [seqs * width, bs, kvh, row]
        r = _pool_float(mx, r, kv_dtype, head_dim).reshape(seqs, tokens, kv_heads, head_dim)
        return r.transpose(0, 2, 1, 3)  # [seqs, kvh, tokens, head_dim]

    k, v = rows(k_pool), rows(v_pool)
    qg = (q.astype(mx.float32) * scale).reshape(seqs, kv_heads, group, head_dim)
    scores = qg @ k.transpose(0, 1, 3, 2)  # [seqs, kvh, group, tokens]
    live = mx.arange(tokens)[None, :] < seq_lens[:, None]  # [seqs, tokens]
    scores = mx.where(live[:, None, None, :], scores, -mx.inf)
    p = mx.softmax(scores, axis=-1, precise=True)
    # p is 0 past the length, but 0 * inf is NaN: a dead slot's V (a reused block's stale
    # tokens, block 0 read for padding) must not reach the sum, as the kernels never read it
    v = mx.where(live[:, None, :, None], v, 0.0)
    out = (p @ v).reshape(seqs, heads, head_dim)
    return mx.where((seq_lens > 0)[:, None, None], out, 0.0)


def scatter_blocks(mx, blocks, dst_ids, dst):
    """``dst`` (blocks on axis 0) with block ``dst_ids[i]`` set to the bytes ``blocks[i]``."""
    flat = dst.reshape(dst.shape[0], -1)
    if dst.dtype != mx.uint8:
        flat = flat.view(mx.uint8)
    flat[dst_ids] = blocks.reshape(blocks.shape[0], -1)
    out = flat if dst.dtype == mx.uint8 else flat.view(dst.dtype)
    return out.reshape(dst.shape)


def copy_blocks(mx, src, src_ids, dst_ids, dst):
    """``dst`` with block ``dst_ids[i]`` replaced by ``src``'s block ``src_ids[i]``."""
    blocks = mx.take(src.reshape(src.shape[0], -1), src_ids, axis=0)
    if src.dtype != mx.uint8:
        blocks = blocks.view(mx.uint8)
    return scatter_blocks(mx, blocks, dst_ids, dst)
