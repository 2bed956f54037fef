"""``gemv``: x · Wᵀ with the weights dequantized on the fly (docs/contracts/hfqm-and-quant.md, '3.6
FWHT rotation').

The fused kernels (``pagedkv.quant.gemv_kernels``) never materialise W: per
group they convert the codes to floats and take ``scale·Σ q·x + min·Σ x``. For
rotated (MQ) formats ``x`` is rotated once with the same forward FWHT per
256-segment and meets the stored weights as they are (``Σ w'·x' = Σ w·x``).
Where the fused path does not apply (groups straddling rows, K % G != 0) the
weights are dequantized a block of rows at a time and multiplied with NumPy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType, SizeMismatch
from pagedkv.quant import gemv_kernels
from pagedkv.quant.arguments import raw_bytes, shape_tuple
from pagedkv.quant.formats import AFFINE, GL, Q8, check_k, resolve

__all__ = ["MAX_BATCH", "check_activations", "check_weights", "gemv"]

#: Most rows of x one call takes (decode batches).
MAX_BATCH = 8

# Rows dequantized per step of the fallback path: bounded scratch (~4 MiB of float32).
_FALLBACK_ELEMS = 1 << 20


def check_weights(raw, fmt, shape):
    """``(codec, data, M, K)`` of a quantized 2-D ``W``; raises on a bad format, shape or size."""
    codec = resolve(fmt)
    data = raw_bytes(raw)
    dims = shape_tuple(shape)
    if len(dims) != 2:
        raise InvalidArgument(f"gemv needs a 2-D weight shape [M, K], got {dims}")
    check_k(codec, dims)
    m, k = dims
    expected = codec.payload_nbytes((m, k))
    if data.size != expected:
        raise SizeMismatch(
            f"raw has {data.size} bytes, but {codec.name} of shape {dims} needs {expected}")
    return codec, data, m, k


def check_activations(x, k: int, max_batch: int | None = None):
    """``(x2, batch)``: ``x`` (float32 ``[K]`` or ``[B, K]``) as a C-contiguous ``[B, K]``."""
    if not isinstance(x, np.ndarray):
        raise InvalidArgumentType(f"x must be a numpy.ndarray of float32, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise InvalidArgumentType(
            f"x must have dtype float32, got {x.dtype}; convert explicitly with "
            "x.astype(np.float32)")
    if x.ndim not in (1, 2) or x.shape[-1] != k:
        raise InvalidArgument(f"x must be [K] or [B, K] with K = {k}, got shape {x.shape}")
    batch = 1 if x.ndim == 1 else x.shape[0]
    if batch < 1 or (max_batch is not None and batch > max_batch):
        limit = f"1 to {max_batch}" if max_batch is not None else "at least 1"
        raise InvalidArgument(f"x holds {batch} rows; gemv takes {limit}")
    return np.ascontiguousarray(x.reshape(batch, k)), batch


def _validate(raw, fmt, shape, x):
    codec, data, m, k = check_weights(raw, fmt, shape)
    x2, batch = check_activations(x, k, MAX_BATCH)
    return codec, data, m, k, x2, batch


def _gemv_by_row_blocks(data, codec, m, k, x2):
    """Reference path: dequantize row blocks (whole groups, or whole rows for the row
    formats; GL's scales follow every group's indices, so it is decoded whole) and multiply."""
    from pagedkv.quant import dequantize
    if codec.kind == GL or codec.row_multiple:
        row_bytes = codec.payload_nbytes((1, k))
        rows = m if codec.kind == GL else max(1, _FALLBACK_ELEMS // max(k, 1))
        y = np.empty((x2.shape[0], m), np.float32)
        for r0 in range(0, m, rows):
            r1 = min(m, r0 + rows)
            w = dequantize(data[r0 * row_bytes:r1 * row_bytes] if codec.row_multiple else data,
                           codec.qt.id, (r1 - r0, k))
            for b in range(x2.shape[0]):
                y[b, r0:r1] = w @ x2[b]
        return y
    g = codec.group_size
    # a row block must start on a group boundary: rows per block is a multiple of
    # G / gcd(K, G) (one period of the straddling pattern)
    period = g // math.gcd(k, g)
    rows = max(period, (_FALLBACK_ELEMS // max(k, 1)) // period * period)
    y = np.empty((x2.shape[0], m), np.float32)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        b0 = (r0 * k) // g * codec.group_bytes
        b1 = -(-(r1 * k) // g) * codec.group_bytes
        w = dequantize(data[b0:b1], codec.qt.id, (r1 - r0, k))
        for b in range(x2.shape[0]):      # row by row: a batch never changes a row's bits
            y[b, r0:r1] = w @ x2[b]
    return y


def gemv(raw, fmt: str | int, shape: Sequence[int], x: np.ndarray) -> np.ndarray:
    """``x · Wᵀ`` for a quantized ``W`` of ``shape`` ``[M, K]`` (see :func:`pagedkv.quant.gemv`)."""
    codec, data, m, k, x2, batch = _validate(raw, fmt, shape, x)
    if not np.isfinite(x2).all():
        raise InvalidArgument("x holds NaN or Inf; gemv takes finite activations only")
    y = np.empty((batch, m), np.float32)
    if k == 0 or m == 0:  # an empty sum: no kernel has anything to read
        y.fill(0.0)
        return y[0] if x.ndim == 1 else y
    if codec.kind == AFFINE and k % codec.group_size == 0 and (not codec.rotated or k % 256 == 0):
        gemv_kernels.gemv_affine(data, m, k, codec.affine_family, codec.bits, codec.group_size,
                                 x2, y)
    elif codec.kind == Q8 and k % 32 == 0:
        gemv_kernels.gemv_q8f16(data, m, k, x2, y)
    else:
        y = _gemv_by_row_blocks(data, codec, m, k, x2)
    return y[0] if x.ndim == 1 else y
