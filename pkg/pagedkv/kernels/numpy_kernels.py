"""NumPy references for every kernel in ``hip/``: what the GPU tests compare against.

KV q8 follows docs/contracts/hfqm-and-quant.md, '6.3 q8 (K and V)' step for step in float32 (the GPU
write is
bit-exact with it). The rotated KV modes (fwhtN K, lloydN V) follow docs/kv-quant.md
step for step in float32, written here independently of the Cython codec (its own
sign generator and butterflies; only the tables come from ``pagedkv/kvquant.h``), so
the tests can hold the codec to it byte for byte. Attention is computed in float64
from the stored (rounded) KV; over rotated modes it runs in the rotated basis as
docs/kv-quant.md "Attention over compressed KV" describes. Weight dequantization, GEMV and FWHT use the CPU codecs of
:mod:`pagedkv.quant` (one implementation of the formats' math).
"""

from __future__ import annotations

import numpy as np

from pagedkv.errors import InvalidArgument
from pagedkv.quant import kv_q8

__all__ = [
    "KV_ROTATED_MODES",
    "copy_blocks",
    "dequantize",
    "fwht256",
    "gemv",
    "kv_pool_to_float",
    "kv_q8_dequantize",
    "kv_q8_quantize",
    "kv_rotated_dequantize",
    "kv_rotated_quantize",
    "kv_side_to_float",
    "paged_attention_decode",
]

KVQ8_BLOCK = kv_q8.BLOCK_VALUES
KVQ8_RECORD_BYTES = kv_q8.RECORD_BYTES


def kv_q8_quantize(x: np.ndarray) -> np.ndarray:
    """``float32[..., head_dim]`` → ``uint8[..., head_dim/32*34]`` q8 records
    (docs/contracts/hfqm-and-quant.md, '6.3 q8 (K and V)')."""
    x = np.asarray(x, dtype=np.float32)
    hd = x.shape[-1]
    if hd % KVQ8_BLOCK:
        raise InvalidArgument(f"head_dim={hd}: q8 KV needs a multiple of 32")
    blocks = x.reshape(-1, KVQ8_BLOCK)
    amax = np.max(np.abs(blocks), axis=1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    inv[~np.isfinite(inv)] = 0  # 127 / amax past float32: codes 0 (kvquant.h)
    q = np.clip(np.rint(blocks * inv[:, None]), -127, 127).astype(np.int8)
    rec = np.empty((blocks.shape[0], KVQ8_RECORD_BYTES), dtype=np.uint8)
    d16 = d.astype(np.float16).view(np.uint16)  # f16 round-to-nearest-even
    d16[np.isnan(d)] = 0x7E00  # a NaN scale (NaN input) as kvquant.h's canonical quiet NaN
    rec[:, :2] = d16.view(np.uint8).reshape(-1, 2)
    rec[:, 2:] = q.view(np.uint8)
    return rec.reshape(*x.shape[:-1], hd // KVQ8_BLOCK * KVQ8_RECORD_BYTES)


def kv_q8_dequantize(records: np.ndarray, head_dim: int) -> np.ndarray:
    """``uint8[..., head_dim/32*34]`` → ``float32[..., head_dim]``."""
    records = np.ascontiguousarray(records, dtype=np.uint8)
    rec = records.reshape(-1, KVQ8_RECORD_BYTES)
    d = rec[:, :2].copy().view(np.float16).astype(np.float32)
    q = rec[:, 2:].view(np.int8).astype(np.float32)
    return (d * q).reshape(*records.shape[:-1], head_dim)


# --- rotated KV modes (fwhtN K or V, lloydN V or K): an independent float32 transcription -------

#: mode -> (bits, rotation block / table family)
KV_ROTATED_MODES = {"fwht4": (4, 128), "fwht3": (3, 256), "fwht2": (2, 128),
                    "lloyd4": (4, 256), "lloyd3": (3, 256), "lloyd2": (2, 256)}
_F32 = np.float32


def _signs(seed: int, n: int) -> np.ndarray:
    """The sign table of the LCG (state = (state*1103515245 + 12345) mod 2^32, 31 bits;
    +1 where bit 16 is set)."""
    out = np.empty(n, np.float32)
    state = seed
    for i in range(n):
        state = (state * 1103515245 + 12345) & 0x7FFFFFFF
        out[i] = 1.0 if (state >> 16) & 1 else -1.0
    return out


_SIGNS = {seed: _signs(seed, 256) for seed in (42, 1042)}


def _rotate_rows(x: np.ndarray, n: int, inverse: bool) -> np.ndarray:
    """R (or Rᵀ) of every n-block of the rows of float32 ``x``: signs, butterflies in
    ascending strides, then scale·signs, each step rounded to float32."""
    pre, post = (_SIGNS[1042], _SIGNS[42]) if inverse else (_SIGNS[42], _SIGNS[1042])
    c = _F32(0.0625) if n == 256 else _F32(1 / np.sqrt(128))
    y = (x.reshape(-1, n) * pre[:n]).astype(_F32)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0].copy(), y[:, :, 1].copy()
        y[:, :, 0], y[:, :, 1] = a + b, a - b
        h *= 2
    y = y.reshape(-1, n) * (c * post[:n]).astype(_F32)
    return y.reshape(x.shape)


def _sumsq16(x: np.ndarray) -> np.ndarray:
    """Row sums of squares in the codec's order: 16 running partials (element i into
    partial i % 16, in index order), folded 8, 4, 2, 1."""
    sq = (x * x).astype(_F32).reshape(x.shape[0], -1, 16)
    acc = sq[:, 0].copy()
    for i in range(1, sq.shape[1]):
        acc = acc + sq[:, i]
    w = 8
    while w:
        acc = acc[:, :w] + acc[:, w:2 * w]
        w //= 2
    return acc[:, 0]


def _tables(mode: str):
    from pagedkv.quant import kv_rotated
    bits, family = KV_ROTATED_MODES[mode]
    return kv_rotated.tables(bits, family)


def _check_rotated(mode: str, head_dim: int) -> tuple[int, int]:
    if mode not in KV_ROTATED_MODES:
        raise InvalidArgument(f"mode={mode!r}: expected one of {list(KV_ROTATED_MODES)}")
    bits, rot = KV_ROTATED_MODES[mode]
    if head_dim != 256 and not (rot == 128 and head_dim == 128):
        raise InvalidArgument(f"head_dim={head_dim}: {mode} needs head_dim "
                              f"{'128 or 256' if rot == 128 else '256'}")
    return bits, rot


def kv_rotated_quantize(x: np.ndarray, mode: str) -> np.ndarray:
    """``float32[..., head_dim]`` -> ``uint8[..., 4 + head_dim*bits/8]`` records of a
    rotated mode: norm, R (R128 per half or R256) of the normalized row, codes = count of
    thresholds strictly exceeded, cnorm = norm / ||C[codes]||, codes packed LSB first."""
    x = np.asarray(x, dtype=np.float32)
    hd = x.shape[-1]
    bits, rot = _check_rotated(mode, hd)
    C, T = _tables(mode)
    rows = x.reshape(-1, hd)
    norm = np.sqrt(_sumsq16(rows)).astype(_F32)
    with np.errstate(divide="ignore"):
        inv = np.where(norm > _F32(1e-10), _F32(1) / norm, _F32(0)).astype(_F32)
    r = _rotate_rows((rows * inv[:, None]).astype(_F32), rot, inverse=False)
    codes = (r[..., None] > T).sum(axis=-1).astype(np.uint8)
    rn = np.sqrt(_sumsq16(C[codes])).astype(_F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        cnorm = np.where(rn > _F32(1e-10), norm / rn, norm).astype(_F32)
    weights = (1 << np.arange(8, dtype=np.uint64))
    bitstream = ((codes[:, :, None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(len(rows), -1)
    packed = (bitstream.reshape(len(rows), -1, 8).astype(np.uint64) * weights).sum(-1)
    rec = np.concatenate([cnorm.astype("<f4").view(np.uint8).reshape(-1, 4),
                          packed.astype(np.uint8)], axis=1)
    return rec.reshape(*x.shape[:-1], rec.shape[1])


def kv_rotated_codes(records: np.ndarray, mode: str, head_dim: int):
    """``(cnorm float32[...], codes uint8[..., head_dim])`` of rotated records."""
    bits, _ = _check_rotated(mode, head_dim)
    rec = np.ascontiguousarray(records, dtype=np.uint8)
    flat = rec.reshape(-1, rec.shape[-1])
    cnorm = flat[:, :4].copy().view("<f4").reshape(-1).astype(_F32)
    stream = np.unpackbits(flat[:, 4:], axis=1, bitorder="little")
    codes = (stream.reshape(len(flat), head_dim, bits).astype(np.uint8)
             << np.arange(bits, dtype=np.uint8)).sum(-1).astype(np.uint8)
    return cnorm.reshape(rec.shape[:-1]), codes.reshape(*rec.shape[:-1], head_dim)


def kv_rotated_dequantize(records: np.ndarray, mode: str, head_dim: int, *,
                          rotated: bool = False) -> np.ndarray:
    """Rotated records -> ``float32[..., head_dim]``: ``cnorm * Rᵀ C[codes]`` (original
    basis) or ``cnorm * C[codes]`` (``rotated=True``)."""
    _, rot = _check_rotated(mode, head_dim)
    C, _ = _tables(mode)
    cnorm, codes = kv_rotated_codes(records, mode, head_dim)
    v = C[codes].reshape(-1, head_dim)
    if not rotated:
        v = _rotate_rows(v, rot, inverse=True)
    return (v * cnorm.reshape(-1, 1)).astype(_F32).reshape(codes.shape)


def kv_side_to_float(pool: np.ndarray, side_dtype: str, head_dim: int) -> np.ndarray:
    """One side of a pool (float16, bfloat16 bits, q8 or rotated records) as float32."""
    if side_dtype == "float16":
        return pool.astype(np.float32)
    if side_dtype == "float32":
        return pool.astype(np.float32)
    if side_dtype == "bfloat16":
        return (pool.astype(np.uint32) << 16).view(np.float32)
    if side_dtype == "q8":
        return kv_q8_dequantize(pool, head_dim)
    if side_dtype in KV_ROTATED_MODES:
        return kv_rotated_dequantize(pool, side_dtype, head_dim)
    raise InvalidArgument(f"dtype {side_dtype!r}: expected float16, bfloat16, float32, q8 or "
                          f"one of {list(KV_ROTATED_MODES)}")


def _kv_sides(kv_dtype: str) -> tuple[str, str]:
    k, sep, v = kv_dtype.partition("/")
    return (k, v) if sep else (kv_dtype, kv_dtype)


def kv_pool_to_float(pool: np.ndarray, kv_dtype: str, head_dim: int) -> np.ndarray:
    """A pool array (float16, bfloat16 as uint16 bits, q8 or rotated records) as float32;
    ``kv_dtype`` is one side's dtype."""
    return kv_side_to_float(pool, kv_dtype, head_dim)


def _rotation_matrix(n: int) -> np.ndarray:
    """R = D2·H·D1/sqrt(n) as a float64 matrix (exact signs, H[i][j] = (-1)^popcount(i&j))."""
    idx = np.arange(n)
    parity = np.bitwise_count(idx[:, None] & idx[None, :]) & 1
    h = np.where(parity, -1.0, 1.0)
    return (_SIGNS[1042][:n, None].astype(np.float64) * h
            * _SIGNS[42][None, :n].astype(np.float64)) / np.sqrt(n)


def _rotate_query(q: np.ndarray, rot: int) -> np.ndarray:
    """``q`` (float64 [..., hd]) in a rotated K basis: R256, or R128 per 128-half."""
    R = _rotation_matrix(rot)
    hd = q.shape[-1]
    blocks = q.reshape(*q.shape[:-1], hd // rot, rot)
    return (blocks @ R.T).reshape(q.shape)


def _side_rows(pool: np.ndarray, side: str, hd: int, rotated: bool):
    """A side's rows as float64 ``[..., hd]``: values, or for a rotated mode with
    ``rotated`` the factors ``(cnorm, C[codes])`` kept apart."""
    if side in KV_ROTATED_MODES and rotated:
        C, _ = _tables(side)
        cnorm, codes = kv_rotated_codes(pool, side, hd)
        return cnorm.astype(np.float64), C[codes].astype(np.float64)
    return None, kv_side_to_float(pool, side, hd).astype(np.float64)


def paged_attention_decode(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray,
                           block_tables: np.ndarray, seq_lens: np.ndarray, *, kv_dtype: str,
                           scale: float) -> np.ndarray:
    """One query token per sequence over a paged KV cache, in float64.

    ``q``: ``[seqs, heads, head_dim]``; pools ``[num_blocks, block_size, kv_heads, row]``;
    query head ``h`` reads KV head ``h // (heads // kv_heads)``. ``kv_dtype``: one dtype for
    both sides or ``"<K>/<V>"``. A rotated K is scored in its rotated basis
    (``scale * cnorm_t * q_rot · C[codes_t]``), a rotated V (lloydN: R256; fwht4/fwht2: R128
    per 128-half; fwht3: R256) is accumulated in its rotated basis and rotated back once per
    head (docs/kv-quant.md "Attention over compressed KV"). An
    empty sequence gives zeros. Returns ``float32[seqs, heads, head_dim]``.
    """
    k_side, v_side = _kv_sides(kv_dtype)
    seqs, heads, hd = q.shape
    _, bs, kvh = k_pool.shape[:3]
    group = heads // kvh
    q64 = q.astype(np.float64)
    k_cnorm, k = _side_rows(k_pool, k_side, hd, True)
    v_cnorm, v = _side_rows(v_pool, v_side, hd, True)
    if k_cnorm is not None:
        q64 = _rotate_query(q64, KV_ROTATED_MODES[k_side][1])
    out = np.zeros((seqs, heads, hd), dtype=np.float64)
    for s in range(seqs):
        n = int(seq_lens[s])
        if n == 0:
            continue
        pos = np.arange(n)
        blocks, offs = block_tables[s, pos // bs], pos % bs
        ks, vs = k[blocks, offs], v[blocks, offs]  # [n, kvh, hd]
        for h in range(heads):
            logits = ks[:, h // group] @ q64[s, h] * scale
            if k_cnorm is not None:
                logits = logits * k_cnorm[blocks, offs, h // group]
            p = np.exp(logits - logits.max())
            p = p / p.sum()
            if v_cnorm is not None:
                p = p * v_cnorm[blocks, offs, h // group]
            out[s, h] = p @ vs[:, h // group]
    if v_cnorm is not None:
        out = _unrotate_rows(out, KV_ROTATED_MODES[v_side][1])
    return out.astype(np.float32)


def _unrotate_rows(x: np.ndarray, rot: int) -> np.ndarray:
    """Rᵀ of each ``rot``-block of the rows of float64 ``x`` [..., hd] (R256, or R128 per
    128-half): the way back from a rotated V's basis."""
    hd = x.shape[-1]
    blocks = x.reshape(*x.shape[:-1], hd // rot, rot)
    return (blocks @ _rotation_matrix(rot)).reshape(x.shape)  # Rᵀ of a row: row @ R


def copy_blocks(src: np.ndarray, src_ids: np.ndarray, dst_ids: np.ndarray,
                dst: np.ndarray) -> np.ndarray:
    """``dst`` with block ``dst_ids[i]`` replaced by ``src``'s block ``src_ids[i]``."""
    out = dst.copy()
    out[np.asarray(dst_ids)] = src[np.asarray(src_ids)]
    return out


# --- weights (through the CPU codecs of pagedkv.quant) ---------------------------------


def dequantize(raw: np.ndarray, fmt: str, numel: int) -> np.ndarray:
    """What the dequant kernels emit: ``float32[numel]`` in the stored basis (rotated for
    MQ formats)."""
    from pagedkv import quant
    return quant.dequantize(raw, fmt, (numel,), basis="rotated")


def fwht256(x: np.ndarray) -> np.ndarray:
    """FWHT-256 of each 256-segment (``pagedkv.quant.fwht256``)."""
    from pagedkv import quant
    return quant.fwht256(np.asarray(x, np.float32).reshape(-1, 256)).reshape(np.shape(x))


def gemv(raw: np.ndarray, fmt: str, M: int, K: int, x: np.ndarray, *,
         rotated: bool) -> np.ndarray:
    """``y[b] = W · x[b]`` in float64 from the stored weights; rotated formats rotate
    ``x`` the way the kernels do (the result is ``W · x`` of the original weights)."""
    w = dequantize(raw, fmt, M * K).reshape(M, K).astype(np.float64)
    xr = fwht256(x) if rotated else np.asarray(x, np.float32)
    return xr.astype(np.float64) @ w.T
