"""Weight codecs (HFQ/MQ/Q8), FWHT-256 and KV-cache quantization (docs/contracts/hfqm-and-quant.md,
'3. Shared primitives' to '6. KV-cache quantization').

Public API::

    quantize(array, fmt) -> uint8[nbytes]              # hipfire's exact bytes
    dequantize(raw, fmt, shape, basis="original") -> float32[shape]
    fwht256(x, inverse=False) -> float32[..., 256]     # R = D2·H·D1/16 per row
    gemv(raw, fmt, shape, x) -> float32                # x · Wᵀ, dequantizing on the fly
    prepare_gemv(raw, fmt, shape) -> PreparedGemv      # repacked once; g(x) = x · Wᵀ, int8 x

``fmt`` is a lower-case qt name (``"hfq4g256"``, ``"mq4g256v2"``, ...) or a qt id.
Tensors are flattened row-major and cut into groups of G weights (groups may
straddle rows, the last one is padded), except that the V2 and MQ4C formats
need the last dimension K to be a multiple of 256.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from pagedkv.errors import (
    InvalidArgument,
    InvalidArgumentType,
    SizeMismatch,
    UnsupportedQuantType,
)
from pagedkv.quant import affine, codebook, fp4, fwht, gaussian_codebook, half, legacy, q8, ternary
from pagedkv.quant.arguments import (
    basis_argument,
    float32_out,
    float_array,
    raw_bytes,
    reject_nonfinite,
    reject_unrepresentable,
    shape_tuple,
)
from pagedkv.quant.formats import (
    AFFINE,
    CODECS,
    FP4,
    GL,
    LLOYD,
    MQ8,
    Q4F16G64,
    Q4K,
    Q8,
    Q8HFQ,
    TERNARY,
    Codec,
    check_k,
    resolve,
)
from pagedkv.quant.prepared_gemv import PreparedGemv, aligned_empty, check_threads

__all__ = ["CODECS", "Codec", "PreparedGemv", "dequantize", "fwht256", "gemv", "prepare_gemv",
           "quantize", "resolve"]

_MQ2G256V2 = 50
_FP4_KIND = {21: 0, 24: 1, 33: 2}     # pagedkv.quant.fp4.KINDS
_DECODE_ONLY_WHY = {
    TERNARY: "Bonsai's ternary/binary weights come from quantization-aware training and are "
             "passed through, never encoded from float weights",
}

# Decoders of the P2 kinds: (codec, raw, out, K, rotated_basis) -> None.
# (codec, raw, out, K, rotated_basis, threads)
_P2_DECODERS = {
    FP4: lambda c, raw, out, k, rb, t: fp4.decode(raw, out, k, _FP4_KIND[c.qt.id], rb, t),
    GL: lambda c, raw, out, k, rb, t: gaussian_codebook.decode(raw, out, c.bits, rb, t),
    MQ8: lambda c, raw, out, k, rb, t: q8.mq8_decode(raw, out, rb, t),
    Q8HFQ: lambda c, raw, out, k, rb, t: q8.q8hfq_decode(raw, out, k, t),
    Q4F16G64: lambda c, raw, out, k, rb, t: legacy.q4f16g64_decode(raw, out, t),
    Q4K: lambda c, raw, out, k, rb, t: legacy.q4k_decode(raw, out, t),
    TERNARY: lambda c, raw, out, k, rb, t: ternary.decode(raw, out, c.bits, t),
}


def quantize(array: np.ndarray, fmt: str | int) -> np.ndarray:
    """Encode ``array`` in format ``fmt``; returns the payload as ``uint8[nbytes]``.

    ``array`` is float32 (float16 is widened exactly). The bytes are hipfire's:
    F16 by truncation (docs/contracts/hfqm-and-quant.md, '3.2 f32 to f16 by truncation'), BF16 by
    truncation, the group codecs per docs/contracts/hfqm-and-quant.md, '4. Weight codecs';
    Q4K's are ggml's (``quantize_row_q4_K_ref``; K a multiple of 256).
    NaN or Inf raises :class:`~pagedkv.errors.InvalidArgument`, and so does a group
    of finite weights the format cannot store with finite values (near ±3.4e38, or
    an f16 scale/zero beyond ±65504: docs/formats/quant.md, "Groups the codecs
    refuse"); F16/BF16 keep the spec's truncation (``|x| >= 65536`` becomes ±inf).
    """
    codec = resolve(fmt)
    if not codec.encodes:
        raise UnsupportedQuantType(
            f"{codec.name} (qt {codec.qt.id}) is decode-only in pagedkv: "
            f"{_DECODE_ONLY_WHY[codec.kind]} (docs/formats/quant.md, 'P2 formats')")
    array = float_array(array, "array")
    shape = tuple(int(d) for d in array.shape)
    check_k(codec, shape)
    if codec.kind == Q4K and shape[-1] % 256:
        # ggml's rows are whole super-blocks; the decoder alone accepts groups that
        # straddle rows (a payload written elsewhere)
        raise InvalidArgument(
            f"q4k (GGML Q4_K) encodes rows of whole 256-weight super-blocks: the last "
            f"dimension K must be a multiple of 256, got shape {shape}; pad K or use hfq4g128")
    if codec.qt.id == _MQ2G256V2:
        # docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register': wire-complete, but upstream
        # rejects it on quality; encode only when asked, warn
        warnings.warn(
            "MQ2G256V2 (qt 50) decodes correctly but upstream rejects it on quality (Qwen3.8 "
            "KLD 12-14 nats); use mq3g256v2 or wider for real models", UserWarning, stacklevel=2)
    if codec.name == "f16" and array.dtype == np.float16:
        if not np.isfinite(array).all():
            flat16 = array.reshape(-1)
            reject_nonfinite(flat16, int(np.flatnonzero(~np.isfinite(flat16))[0]), "array", shape)
        return np.ascontiguousarray(array).reshape(-1).view(np.uint8).copy()
    # Aligned too: the Cython encoders read floats through typed pointers (a float32 view
    # at an odd byte offset would be undefined behaviour there).
    flat = np.require(array, np.float32, ["C", "A"]).reshape(-1)
    out = np.empty(codec.payload_nbytes(shape), dtype=np.uint8)
    k = shape[-1]
    if codec.kind == AFFINE:
        bad = affine.encode(flat, out, codec.affine_family, codec.bits, codec.group_size)
    elif codec.kind == Q8:
        bad = q8.encode(flat, out)
    elif codec.kind == LLOYD:
        bad = codebook.encode(flat, out, codec.bits, codec.rotated)
    elif codec.kind == FP4:
        bad = fp4.encode(flat, out, k, _FP4_KIND[codec.qt.id]) if flat.size else -1
    elif codec.kind == GL:
        bad = gaussian_codebook.encode(flat, out, codec.bits)
    elif codec.kind == MQ8:
        bad = q8.mq8_encode(flat, out)
    elif codec.kind == Q8HFQ:
        bad = q8.q8hfq_encode(flat, out, k) if flat.size else -1
    elif codec.kind == Q4F16G64:
        bad = legacy.q4f16g64_encode(flat, out)
    elif codec.kind == Q4K:
        bad = legacy.q4k_encode(flat, out)
    else:
        finite = np.isfinite(flat)
        bad = -1 if finite.all() else int(np.flatnonzero(~finite)[0])
        if bad < 0:
            if codec.name == "f32":
                out[:] = flat.view(np.uint8)
            elif codec.name == "f16":
                half.f16_trunc(flat, out.view(np.uint16))
            else:
                half.bf16_trunc(flat, out.view(np.uint16))
    if bad <= -2:
        family = codec.family.name if codec.family is not None else \
            (codec.kind if codec.kind != Q8 else None)
        unit = k if codec.row_multiple else codec.group_size
        reject_unrepresentable(flat, -2 - bad, unit, codec.name, family, "array", shape)
    reject_nonfinite(flat, bad, "array", shape)
    return out


def dequantize(raw, fmt: str | int, shape: Sequence[int] | int, *,
               basis: str = "original", out: np.ndarray | None = None,
               threads: int = 1) -> np.ndarray:
    """Decode ``raw`` (format ``fmt``) into a ``float32`` array of ``shape``.

    Exact on the CPU (every weight is the reference decode, bit for bit). For
    rotated (MQ) formats ``basis="original"`` undoes the FWHT per 256-group;
    ``basis="rotated"`` returns the stored basis, what the kernels emit (it needs
    the element count to be a multiple of 256). ``out``: a C-contiguous float32
    array of ``shape`` to decode into (returned), e.g. to reuse one buffer per layer;
    one from ``pagedkv.quant.prepared_gemv.aligned_empty`` (64-byte aligned, as the
    array allocated without ``out``) lets large MQ 4-bit decodes bypass the caches.
    An ``out`` whose memory overlaps ``raw`` is decoded from a copy of ``raw``.
    ``threads``: decode on that many threads (the process's worker pool; the bits do
    not depend on it). Every format's decoder splits its groups or rows; F32 is a copy
    and runs on one. Below ~64 KiB of floats per thread a call stays on fewer threads.
    """
    codec = resolve(fmt)
    data = raw_bytes(raw)
    dims = shape_tuple(shape)
    threads = check_threads(threads)
    rotated_basis = basis_argument(basis)
    check_k(codec, dims)
    numel = math.prod(dims)
    expected = codec.payload_nbytes(dims)
    if data.size != expected:
        rule = (f"{dims[-1] and numel // dims[-1]} rows of K = {dims[-1]}" if codec.row_multiple
                else f"ceil({numel}/{codec.group_size}) groups x {codec.group_bytes} bytes")
        raise SizeMismatch(
            f"raw has {data.size} bytes, but {codec.name} of shape {dims} needs {expected} "
            f"({rule})")
    if rotated_basis and codec.rotated and numel % 256 != 0:
        raise InvalidArgument(
            f"basis='rotated' needs a multiple of 256 weights (whole rotated groups), got "
            f"shape {dims}")
    if out is None:             # 64-byte aligned: the MQ decoders' streaming stores need it
        result = aligned_empty(dims, np.float32)
    else:
        result = float32_out(out, dims)
        if np.may_share_memory(data, result):
            # the decoders read raw while writing out: a raw inside out (a buffer reused
            # for both) would be overwritten before it is read
            data = data.copy()
    out = result.reshape(-1)
    if codec.kind == AFFINE:
        affine.decode(data, out, codec.affine_family, codec.bits, codec.group_size,
                      rotated_basis and codec.rotated, threads)
    elif codec.kind == Q8:
        q8.decode(data, out, threads)
    elif codec.kind == LLOYD:
        codebook.decode(data, out, codec.bits, codec.rotated, rotated_basis and codec.rotated,
                        threads)
    elif codec.kind in _P2_DECODERS:
        if numel:
            _P2_DECODERS[codec.kind](codec, data, out, dims[-1], rotated_basis, threads)
    elif codec.name == "f32":
        out[:] = data.view(np.float32)
    else:
        # HFQM payloads sit at any byte offset of the file: widen from an aligned copy.
        halves = np.require(data.view(np.uint16), requirements=["C", "A"])
        (half.f16_to_f32 if codec.name == "f16" else half.bf16_to_f32)(halves, out, threads)
    return result


def fwht256(x: np.ndarray, *, inverse: bool = False) -> np.ndarray:
    """The FWHT-256 rotation ``R = D2·H·D1/16`` (docs/contracts/hfqm-and-quant.md, '3.6 FWHT
    rotation') of every row of ``x`` (``[..., 256]``).

    ``inverse=True`` applies ``Rᵀ`` (R is orthogonal). Bit-exact with hipfire's
    ``cpu_fwht_256``. Returns a new float32 array of ``x``'s shape.
    """
    # Only a real bool: a truthy string ("false") or array would silently pick a direction.
    if not isinstance(inverse, (bool, np.bool_)):
        raise InvalidArgumentType(
            f"inverse must be a bool, got {type(inverse).__name__} {inverse!r}; pass True "
            "or False")
    x = float_array(x, "x")
    if x.shape[-1] != 256:
        raise InvalidArgument(
            f"fwht256 needs rows of 256 values (x.shape[-1] == 256), got shape {x.shape}")
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 256)
    out = np.empty_like(rows)
    fwht.fwht_rows(rows, out, bool(inverse))
    return out.reshape(x.shape)


def prepare_gemv(raw, fmt: str | int, shape: Sequence[int], *, threads: int = 1,
                 isa: str | None = None) -> PreparedGemv:
    """Repack a quantized ``W`` of ``shape`` ``[M, K]`` for fast ``x · Wᵀ`` on the CPU.

    Returns a :class:`PreparedGemv`; ``g(x)`` takes float32 ``x`` ``[K]`` or ``[B, K]``
    and returns ``[M]`` or ``[B, M]``. x is quantized to int8 per span of K (rotated
    first for MQ formats) and multiplied with integer dot products: within a documented
    bound of ``x · dequantize(W)ᵀ`` (docs/formats/cpu-gemv.md), several times faster
    than :func:`gemv`. Every HFQ/MQ format, Q8F16 and Q4K with ``K % G == 0``. The copy
    takes ``nbytes`` bytes (the stored size for 4-bit formats and Q8F16; 2- and 3-bit
    codes widened to 4 bits, 5- and 6-bit codes to 8; Q4K 6 bits per weight, its scales
    and minimums per 32 as f32). ``threads``: the default thread
    count of its calls, also used for the repacking. ``isa``: a kernel name
    (``prepared_gemv.supported_isas()``; default: the best this CPU runs, or the
    ``PAGEDKV_CPU_ISA`` environment variable); every kernel gives the same bits.
    """
    return PreparedGemv(raw, fmt, shape, threads=threads, isa=isa)


def gemv(raw, fmt: str | int, shape: Sequence[int], x: np.ndarray) -> np.ndarray:
    """``x · Wᵀ`` for a quantized ``W`` of ``shape`` ``[M, K]``, dequantizing on the fly.

    ``x`` is float32 ``[K]`` or ``[B, K]`` with 1 ≤ B ≤ 8; returns ``[M]`` or ``[B, M]``.
    For rotated (MQ) formats ``x`` is rotated with the same forward FWHT per
    256-segment and multiplied with the stored (rotated) weights (docs/contracts/hfqm-and-quant.md,
    '3.6 FWHT rotation').
    """
    from pagedkv.quant.matvec import gemv as _gemv
    return _gemv(raw, fmt, shape, x)
