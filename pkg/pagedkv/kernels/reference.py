"""NumPy references for every kernel in ``hip/``: what the GPU tests compare against.

KV q8 follows docs/contracts/hfqm-and-quant.md, '6.3 q8 (K and V)' step for step in float32 (the GPU
write is
bit-exact with it). Attention is computed in float64 from the stored (rounded)
KV. Weight dequantization, GEMV and FWHT use the CPU codecs of
:mod:`pagedkv.quant` (one implementation of the formats' math).
"""

from __future__ import annotations

import numpy as np

from pagedkv.errors import InvalidArgument

__all__ = [
    "copy_blocks",
    "dequantize",
    "fwht256",
    "gemv",
    "kv_pool_to_float",
    "kv_q8_dequantize",
    "kv_q8_quantize",
    "paged_attention_decode",
]

KVQ8_BLOCK = 32
KVQ8_RECORD_BYTES = 34


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
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[:, None]), -127, 127).astype(np.int8)
    rec = np.empty((blocks.shape[0], KVQ8_RECORD_BYTES), dtype=np.uint8)
    rec[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)  # f16 round-to-nearest-even
    rec[:, 2:] = q.view(np.uint8)
    return rec.reshape(*x.shape[:-1], hd // KVQ8_BLOCK * KVQ8_RECORD_BYTES)


def kv_q8_dequantize(records: np.ndarray, head_dim: int) -> np.ndarray:
    """``uint8[..., head_dim/32*34]`` → ``float32[..., head_dim]``."""
    records = np.ascontiguousarray(records, dtype=np.uint8)
    rec = records.reshape(-1, KVQ8_RECORD_BYTES)
    d = rec[:, :2].copy().view(np.float16).astype(np.float32)
    q = rec[:, 2:].view(np.int8).astype(np.float32)
    return (d * q).reshape(*records.shape[:-1], head_dim)


def kv_pool_to_float(pool: np.ndarray, kv_dtype: str, head_dim: int) -> np.ndarray:
    """A pool array (float16, bfloat16 as uint16 bits, q8 records, or float32) as float32."""
    if kv_dtype in ("float16", "float32"):
        return pool.astype(np.float32)
    if kv_dtype == "bfloat16":
        return (pool.astype(np.uint32) << 16).view(np.float32)
    if kv_dtype == "q8":
        return kv_q8_dequantize(pool, head_dim)
    raise InvalidArgument(f"kv_dtype={kv_dtype!r}: expected 'float16', 'bfloat16', 'q8' or "
                          f"'float32'")


def paged_attention_decode(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray,
                           block_tables: np.ndarray, seq_lens: np.ndarray, *, kv_dtype: str,
                           scale: float) -> np.ndarray:
    """One query token per sequence over a paged KV cache, in float64.

    ``q``: ``[seqs, heads, head_dim]``; pools ``[num_blocks, block_size, kv_heads, row]``;
    query head ``h`` reads KV head ``h // (heads // kv_heads)``. An empty sequence gives
    zeros. Returns ``float32[seqs, heads, head_dim]``.
    """
    seqs, heads, hd = q.shape
    _, bs, kvh = k_pool.shape[:3]
    group = heads // kvh
    k = kv_pool_to_float(k_pool, kv_dtype, hd).astype(np.float64)
    v = kv_pool_to_float(v_pool, kv_dtype, hd).astype(np.float64)
    out = np.zeros((seqs, heads, hd), dtype=np.float64)
    for s in range(seqs):
        n = int(seq_lens[s])
        if n == 0:
            continue
        pos = np.arange(n)
        blocks = block_tables[s, pos // bs]
        ks = k[blocks, pos % bs]  # [n, kvh, hd]
        vs = v[blocks, pos % bs]
        for h in range(heads):
            logits = ks[:, h // group] @ q[s, h].astype(np.float64) * scale
            p = np.exp(logits - logits.max())
            out[s, h] = (p / p.sum()) @ vs[:, h // group]
    return out.astype(np.float32)


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
