"""KV-cache modes in MLX array ops: encode, decode, downshift and decode attention.

The MLX path of docs/kv-quant.md for ``mx.array`` data (MLX pools, the MLX reference model).
Every step is the codec's float32 step in the codec's order (the norm's 16 partial sums, the
FWHT's ascending butterfly stages, codes as counts of thresholds exceeded, ``C[code]`` by
gather), so on MLX's CPU backend the records equal the Cython codec's byte for byte (tested);
a GPU backend may fuse multiply-adds. The tables come from ``pagedkv/kvquant.h`` through
:mod:`pagedkv.quant.kv_rotated`. Kernels (Metal, MLX CUDA) are another module's business:
this is the array-op implementation every MLX build runs.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.quant import fwht, kv_rotated

__all__ = ["attention_decode", "decode", "downshift", "encode"]

_Q8_BLOCK = 32


def _mx():
    import mlx.core as mx
    return mx


@cache
def _signs(seed: int) -> np.ndarray:
    states = fwht.lcg_states(seed, 256)
    return np.where((states >> 16) & 1, np.float32(1), np.float32(-1)).astype(np.float32)


@cache
def _rotation_tables(n: int, inverse: bool):
    mx = _mx()
    pre, post = (_signs(1042), _signs(42)) if inverse else (_signs(42), _signs(1042))
    c = np.float32(0.0625) if n == 256 else np.float32(1 / np.sqrt(np.float32(128)))
    return mx.array(pre[:n]), mx.array((c * post[:n]).astype(np.float32))


@cache
def _tables(bits: int, family: int):
    mx = _mx()
    c, t = kv_rotated.tables(bits, family)
    return mx.array(c), mx.array(t)


def _rotate(x, n: int, inverse: bool = False):
    """R (or Rᵀ) of each n-block of the rows of float32 ``x`` [..., hd]: signs, butterflies
    in ascending strides, scale·signs (the codec's operations, element for element)."""
    mx = _mx()
    pre, post = _rotation_tables(n, inverse)
    shape = x.shape
    y = x.reshape(-1, n) * pre
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = mx.stack([a + b, a - b], axis=2)
        h *= 2
    return (y.reshape(-1, n) * post).reshape(shape)


def _sumsq16(rows):
    """Row sums of squares [R] of float32 [R, hd]: 16 running partials, folded 8, 4, 2, 1."""
    sq = (rows * rows).reshape(rows.shape[0], -1, 16)
    acc = sq[:, 0]
    for i in range(1, sq.shape[1]):
        acc = acc + sq[:, i]
    w = 8
    while w:
        acc = acc[:, :w] + acc[:, w:2 * w]
        w //= 2
    return acc[:, 0]


def _as_f32(x, name: str):
    mx = _mx()
    if not isinstance(x, mx.array):
        raise InvalidArgumentType(f"{name}: expected an mx.array, got {type(x).__name__}")
    if x.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        raise InvalidArgumentType(f"{name}: dtype {x.dtype}; expected float32, float16 or "
                                  f"bfloat16 values")
    return x.astype(mx.float32)


def _pack(codes, bits: int):
    """LSB-first packing of uint32 codes [R, hd] -> uint8 [R, hd*bits/8]."""
    mx = _mx()
    r, hd = codes.shape
    shifts = mx.array(np.arange(8, dtype=np.uint32) * bits)
    word = mx.sum(codes.reshape(r, hd // 8, 8) << shifts, axis=-1)   # disjoint bits: sum == or
    out = mx.stack([(word >> (8 * b)) & 0xFF for b in range(bits)], axis=-1)
    return out.astype(mx.uint8).reshape(r, hd * bits // 8)


def _unpack(packed, hd: int, bits: int):
    """uint8 [R, hd*bits/8] -> uint32 codes [R, hd]."""
    mx = _mx()
    r = packed.shape[0]
    b = packed.astype(mx.uint32).reshape(r, hd // 8, bits)
    word = mx.sum(b << mx.array(np.arange(bits, dtype=np.uint32) * 8), axis=-1)
    codes = (word[..., None] >> mx.array(np.arange(8, dtype=np.uint32) * bits)) & ((1 << bits) - 1)
    return codes.reshape(r, hd)


#: The float16 NaN a q8 scale field holds for a NaN scale (quiet, no payload).
_F16_NAN = 0x7E00


def _encode_q8(rows):
    """``(records, scales)`` of the rows, not evaluated: the caller checks the float16
    scales with the input in one evaluation."""
    mx = _mx()
    blocks = rows.reshape(-1, _Q8_BLOCK)
    amax = mx.max(mx.abs(blocks), axis=1)
    inv = mx.where(amax > 0, 127.0 / mx.where(amax > 0, amax, 1.0), 0.0)
    inv = mx.where(mx.isinf(inv), 0.0, inv)  # 127 / amax past float32: codes 0 (kvquant.h)
    q = mx.clip(mx.round(blocks * inv[:, None]), -127, 127).astype(mx.int8)
    scale = (amax / 127.0).astype(mx.float16)
    # A NaN scale (NaN input: kv_q8_quantize takes it unchecked) as the canonical 0x7E00
    # that kvquant.h's pkv_f16_rne (the GPU kernels) and NumPy write; MLX's cast gave 0x7D00.
    bits = mx.where(mx.isnan(scale), mx.array(_F16_NAN, dtype=mx.uint16),
                    scale.view(mx.uint16))
    rec = mx.concatenate([bits[:, None].view(mx.uint8), q.view(mx.uint8)], axis=1)
    return rec.reshape(rows.shape[0], -1), scale


def encode(x: Any, mode) -> Any:
    """``x`` (``mx.array`` float32/float16/bfloat16 ``[..., head_dim]``) -> ``uint8`` records
    ``[..., row_bytes]`` of ``mode`` (a :class:`pagedkv.quant.kv.KVMode`). NaN/Inf raises
    :class:`InvalidArgument` (one evaluation of ``isfinite``; for q8 together with the check
    of its float16 scales)."""
    mx = _mx()
    xf = _as_f32(x, "x")
    if xf.ndim == 0:  # as the Cython codecs refuse it (shape[-1] raised IndexError)
        raise InvalidArgument(f"x: shape (): the last axis is head_dim; {mode.name} KV "
                              f"encodes [..., head_dim] values")
    hd = xf.shape[-1]
    row_bytes = mode.row_bytes(hd)
    lead = xf.shape[:-1]
    if xf.size == 0:  # no row: reshape(-1, ...) of an empty array raised a builtin error
        return mx.zeros((*lead, row_bytes), dtype=mx.uint8)
    rows = xf.reshape(-1, hd)
    finite = mx.all(mx.isfinite(xf))
    if mode.name == "q8":
        rec, scale = _encode_q8(rows)
        over = mx.isinf(scale)
        ok, past = mx.stack([finite, mx.any(over)]).tolist()
    else:
        ok, past = bool(finite), False
    if not ok:
        raise InvalidArgument(f"x holds a non-finite value; {mode.name} KV takes finite values "
                              f"only")
    if past:
        # A block past about 127 * 65504 has no float16 scale (it would decode to Inf/NaN):
        # refused, as the C codec refuses it.
        first = int(mx.argmax(over.astype(mx.int32)).item())
        raise InvalidArgument(
            f"x: block {first} (values {first * _Q8_BLOCK}..{first * _Q8_BLOCK + _Q8_BLOCK - 1} "
            f"of the flat input) has a largest |value| above ~8.3e6, past q8 KV's float16 "
            f"scale")
    if mode.name == "q8":
        return rec.reshape(*lead, row_bytes)
    c_tab, t_tab = _tables(mode.bits, mode.rotation)
    norm = mx.sqrt(_sumsq16(rows))
    inv = mx.where(norm > 1e-10, 1.0 / mx.where(norm > 1e-10, norm, 1.0), 0.0)
    r = _rotate(rows * inv[:, None], mode.rotation)
    codes = mx.sum(r[..., None] > t_tab, axis=-1).astype(mx.uint32)
    rn = mx.sqrt(_sumsq16(c_tab[codes]))
    cnorm = mx.where(rn > 1e-10, norm / mx.where(rn > 1e-10, rn, 1.0), norm)
    if not bool(mx.all(mx.isfinite(cnorm))):
        raise InvalidArgument(f"x: a row's norm is beyond float32; {mode.name} KV needs rows "
                              f"whose sum of squares fits float32")
    rec = mx.concatenate([cnorm[:, None].view(mx.uint8), _pack(codes, mode.bits)], axis=1)
    return rec.reshape(*lead, row_bytes)


def _records(records, mode, head_dim: int):
    mx = _mx()
    if not isinstance(records, mx.array) or records.dtype != mx.uint8:
        raise InvalidArgumentType(f"records: expected an mx.array of uint8, got "
                                  f"{getattr(records, 'dtype', type(records).__name__)}")
    rb = mode.row_bytes(head_dim)
    if records.ndim == 0 or records.shape[-1] != rb:
        raise InvalidArgument(f"records: shape {tuple(records.shape)}, the last axis must be "
                              f"{rb} bytes for {mode.name} at head_dim {head_dim}")
    return records.reshape(-1, rb)


def _factors(rows, mode, head_dim: int):
    """``(cnorm [R], C[codes] [R, hd])`` of rotated records."""
    mx = _mx()
    c_tab, _ = _tables(mode.bits, mode.rotation)
    cnorm = rows[:, :4].view(mx.float32).reshape(-1)
    return cnorm, c_tab[_unpack(rows[:, 4:], head_dim, mode.bits)]


def decode(records: Any, mode, head_dim: int, *, rotated: bool = False) -> Any:
    """``uint8`` records ``[..., row_bytes]`` -> float32 ``[..., head_dim]`` (``rotated``:
    ``cnorm * C[codes]``, the basis attention over compressed KV works in)."""
    mx = _mx()
    rows = _records(records, mode, head_dim)
    lead = records.shape[:-1]
    if mode.name == "q8":
        rec = rows.reshape(-1, 2 + _Q8_BLOCK)
        d = rec[:, :2].view(mx.float16).astype(mx.float32)
        q = rec[:, 2:].view(mx.int8).astype(mx.float32)
        return (d * q).reshape(*lead, head_dim)
    cnorm, v = _factors(rows, mode, head_dim)
    if not rotated:
        v = _rotate(v, mode.rotation, inverse=True)
    return (v * cnorm[:, None]).reshape(*lead, head_dim)


def downshift(records: Any, src, dst, head_dim: int) -> Any:
    """The in-family downshift of :func:`pagedkv.quant.kv.downshift` in MLX ops."""
    mx = _mx()
    # The Cython downshift's rule and words: a widening (lloyd2 -> lloyd4) shifted the codes
    # by a negative count, a builtin ValueError from MLX.
    if not (src.rotated and src.rotation == dst.rotation and src.sides == dst.sides
            and dst.bits < src.bits):
        raise InvalidArgument(f"{src.name} -> {dst.name}: a downshift stays in one table "
                              f"family and narrows the codes (fwht4 -> fwht2, lloyd4 -> "
                              f"lloyd3 -> lloyd2)")
    rows = _records(records, src, head_dim)
    if rows.shape[0] == 0:
        return mx.zeros((*records.shape[:-1], dst.row_bytes(head_dim)), dtype=mx.uint8)
    c_src, _ = _tables(src.bits, src.rotation)
    c_dst, _ = _tables(dst.bits, dst.rotation)
    cnorm = rows[:, :4].view(mx.float32).reshape(-1)
    codes = _unpack(rows[:, 4:], head_dim, src.bits)
    norm = cnorm * mx.sqrt(_sumsq16(c_src[codes]))
    codes = codes >> (src.bits - dst.bits)
    rn = mx.sqrt(_sumsq16(c_dst[codes]))
    new = mx.where(rn > 1e-10, norm / mx.where(rn > 1e-10, rn, 1.0), norm)
    out = mx.concatenate([new[:, None].view(mx.uint8), _pack(codes, dst.bits)], axis=1)
    return out.reshape(*records.shape[:-1], dst.row_bytes(head_dim))


def attention_decode(q: Any, k: Any, v: Any, k_mode, v_mode, head_dim: int, scale: float) -> Any:
    """One query token over one sequence's KV, in MLX ops, reading records directly.

    ``q``: float32 ``[heads, head_dim]``; ``k``/``v``: ``[n, kv_heads, row]`` records of
    ``k_mode``/``v_mode`` (:class:`~pagedkv.quant.kv.KVMode`) or float values (mode
    ``None``). A rotated K is scored in its basis (``scale * cnorm_t * q_rot · C[codes_t]``,
    ``q`` rotated once per head); a rotated V is summed in its basis (lloydN and fwht3:
    R256; fwht4/fwht2: R128 per half) and rotated back once per head (docs/kv-quant.md "Attention over compressed KV"). Returns float32
    ``[heads, head_dim]``."""
    mx = _mx()
    heads = q.shape[0]
    n, kvh = k.shape[0], k.shape[1]
    group = heads // kvh
    qf = q.astype(mx.float32).reshape(kvh, group, head_dim)

    def side(x, mode):
        if mode is None:
            return None, x.astype(mx.float32)
        if not mode.rotated:
            return None, decode(x, mode, head_dim)
        cn, val = _factors(x.reshape(-1, x.shape[-1]), mode, head_dim)
        return cn.reshape(n, kvh), val.reshape(n, kvh, head_dim)

    k_cn, kf = side(k, k_mode)
    v_cn, vf = side(v, v_mode)
    if k_cn is not None:
        qf = _rotate(qf, k_mode.rotation)
    scores = mx.einsum("kgd,nkd->kgn", qf, kf) * scale             # [kvh, group, n]
    if k_cn is not None:
        scores = scores * mx.transpose(k_cn)[:, None, :]
    p = mx.softmax(scores, axis=-1)
    if v_cn is not None:
        p = p * mx.transpose(v_cn)[:, None, :]
    out = mx.einsum("kgn,nkd->kgd", p, vf)
    if v_cn is not None:
        out = _rotate(out, v_mode.rotation, inverse=True)  # R256, or R128 per half (fwht V)
    return out.reshape(heads, head_dim)
