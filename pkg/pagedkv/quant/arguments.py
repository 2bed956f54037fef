"""Validation of the arguments of the :mod:`pagedkv.quant` API: one place for the checks
and messages that ``quantize``, ``dequantize``, ``fwht256`` and ``gemv`` share."""

from __future__ import annotations

import math
import operator

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["BASES", "basis_argument", "float32_out", "float_array", "raw_bytes",
           "reject_nonfinite", "reject_unrepresentable", "shape_tuple"]

#: The ``basis`` a decode of a rotated (MQ) format returns its weights in.
BASES = ("original", "rotated")


def basis_argument(basis) -> bool:
    """Whether ``basis`` asks for the stored (rotated) basis: ``"rotated"`` True,
    ``"original"`` False. ``InvalidArgumentType`` for anything but a ``str`` (an array of
    names compared with ``in`` raised a builtin ValueError), ``InvalidArgument`` for
    another name."""
    if not isinstance(basis, str):
        raise InvalidArgumentType(f"basis must be a str, one of {BASES}, got "
                                  f"{type(basis).__name__} {basis!r}")
    if basis not in BASES:
        raise InvalidArgument(f"basis must be one of {BASES}, got {basis!r}")
    return basis == "rotated"


def float32_out(out, shape: tuple[int, ...]) -> np.ndarray:
    """``out`` if it is a writeable, C-contiguous float32 ``numpy.ndarray`` of ``shape``
    (an output buffer a call fills and returns). ``InvalidArgumentType`` for another type
    or dtype, and for ``numpy.matrix``, which stays 2-D under ``reshape`` (the decoders
    write through a flat view of ``out``); ``InvalidArgument`` for the shape or layout."""
    if not isinstance(out, np.ndarray) or isinstance(out, np.matrix) \
            or out.dtype != np.float32:
        got = (type(out).__name__ if not isinstance(out, np.ndarray)
               else "numpy.matrix" if isinstance(out, np.matrix) else out.dtype)
        raise InvalidArgumentType(f"out must be a float32 numpy.ndarray, got {got}; pass "
                                  f"np.empty({shape}, np.float32)")
    if out.shape != shape:
        raise InvalidArgument(f"out must have shape {shape}, got shape {out.shape}")
    if not out.flags.c_contiguous:
        raise InvalidArgument(
            f"out (shape {shape}) must be C-contiguous, got strides {out.strides}; pass "
            "np.empty(shape, np.float32) or np.ascontiguousarray")
    if not out.flags.writeable:
        raise InvalidArgument(f"out (shape {shape}) is read-only; pass a writeable array")
    return out


def float_array(array, what: str) -> np.ndarray:
    """``array`` if it is a float32/float16 ndarray with at least one dimension."""
    if not isinstance(array, np.ndarray):
        kind = "numpy scalar " if isinstance(array, np.generic) else ""
        raise InvalidArgumentType(
            f"{what} must be a numpy.ndarray of float32 or float16, got {kind}"
            f"{type(array).__name__}; wrap it with np.asarray(..., dtype=np.float32)")
    if array.dtype not in (np.float32, np.float16):
        raise InvalidArgumentType(
            f"{what} must have dtype float32 or float16, got {array.dtype}; convert explicitly "
            f"(e.g. .astype(np.float32)) so no rounding happens behind your back")
    if array.ndim == 0:
        raise InvalidArgument(f"{what} must have at least one dimension, got a 0-d array; "
                              f"reshape it (e.g. {what}.reshape(1))")
    return array


def reject_nonfinite(flat: np.ndarray, index: int, what: str, shape: tuple[int, ...]) -> None:
    """Raise InvalidArgument naming the element when ``index`` (into ``flat``) is not -1."""
    if index >= 0:
        where = tuple(int(i) for i in np.unravel_index(index, shape)) if shape else ()
        raise InvalidArgument(
            f"{what} holds a non-finite value {flat[index]!r} at index {where}; "
            f"the weight codecs accept finite values only (docs/contracts/hfqm-and-quant.md, '3.1 Arithmetic discipline')")


# Why a group's finite weights cannot be stored, per codec family (formats.Codec.family
# names; None for Q8F16). docs/formats/quant.md, "Groups the codecs refuse".
_UNREPRESENTABLE_WHY = {
    "HFQ": "its largest decoded value (L·scale + min) overflows float32",
    "MQ_V1": "its FWHT-256 rotation overflows float32, or a stored (rotated) value would "
             "exceed 2**119 ≈ 6.6e35, beyond which the inverse rotation can overflow",
    "MQ_V2": "a half's f16 scale or zero would be beyond ±65504 (or the FWHT-256 rotation "
             "overflows float32)",
    "MQ4C": "its f16 scale or zero would be beyond ±65504 (or the FWHT-256 rotation "
            "overflows float32)",
    None: "its f16 scale max|x|/127 would be beyond 65504",
    "lloyd": "its f16 codebook entries would be beyond ±65504 (or the FWHT-256 rotation "
             "overflows float32)",
    "fp4": "the row's f16 scale max|x|/6 would be beyond 65504 (or the FWHT-256 rotation "
           "overflows float32)",
    "gl": "its f16 RMS scale would be beyond 65504 (or the FWHT-256 rotation overflows "
          "float32)",
    "mq8": "its f16 scale max|r|/127 would be beyond 65504 (or the FWHT-256 rotation "
           "overflows float32)",
    "q8hfq": "a 32-weight block's f16 scale max|x|/127 would be beyond 65504",
    "q4f16g64": "its f16 scale (max - min)/15 or f16 minimum would be beyond ±65504",
    "q4k": "its f16 d (the largest sub-block scale / 63) or dmin (the largest sub-block "
           "minimum / 63) would be beyond 65504: weights spanning more than about 6e7, or "
           "below about -4e6",
}


def reject_unrepresentable(flat: np.ndarray, group: int, group_size: int, codec_name: str,
                           family: str | None, what: str, shape: tuple[int, ...]) -> None:
    """Raise InvalidArgument for group ``group`` (of ``group_size`` weights of ``flat``),
    whose finite weights ``codec_name`` cannot store with finite values."""
    start = group * group_size
    values = flat[start:start + group_size]
    end = start + values.size - 1
    first = tuple(int(i) for i in np.unravel_index(start, shape))
    last = tuple(int(i) for i in np.unravel_index(end, shape))
    raise InvalidArgument(
        f"{what}: group {group} (elements {first}..{last}, values in "
        f"[{values.min():.7g}, {values.max():.7g}]) cannot be stored in {codec_name} with finite "
        f"values: {_UNREPRESENTABLE_WHY[family]}. The codecs refuse it rather than write "
        "weights that decode to Inf/NaN; rescale the tensor or keep it in f32")


def raw_bytes(raw) -> np.ndarray:
    """A quantized payload as a flat uint8 array (bytes-like objects without a copy; a
    strided memoryview, e.g. ``memoryview(buf)[::2]``, is copied in its logical order, as a
    strided uint8 array is). ``InvalidArgument`` for a released memoryview."""
    if isinstance(raw, memoryview):
        try:
            # np.frombuffer refuses a non-contiguous buffer with a bare BufferError
            return np.frombuffer(raw if raw.c_contiguous else raw.tobytes(), dtype=np.uint8)
        except ValueError:
            raise InvalidArgument("raw is a released memoryview; pass the payload while "
                                  "its memoryview is open (or the buffer itself)") from None
    if isinstance(raw, (bytes, bytearray)):
        return np.frombuffer(raw, dtype=np.uint8)
    if not isinstance(raw, np.ndarray):
        raise InvalidArgumentType(
            f"raw must be a uint8 numpy array or a bytes-like object, got {type(raw).__name__}")
    if raw.dtype != np.uint8:
        raise InvalidArgumentType(
            f"raw must have dtype uint8, got {raw.dtype}; pass raw.view(np.uint8)")
    return np.ascontiguousarray(raw).reshape(-1)


def _dim(d) -> int:
    # operator.index: 4.5 or "4" must not become 4, nor True become 1
    if isinstance(d, (bool, np.bool_)):
        raise TypeError(d)
    return operator.index(d)


def shape_tuple(shape) -> tuple[int, ...]:
    """``shape`` (an int or a sequence of ints >= 0) as a tuple."""
    if is_int(shape):
        shape = (shape,)
    try:
        if isinstance(shape, (str, bytes)):
            raise TypeError(shape)
        dims = tuple(_dim(d) for d in shape)
    except TypeError:
        raise InvalidArgumentType(
            f"shape must be an int or a sequence of ints (e.g. (4096, 4096)), got "
            f"{type(shape).__name__} {shape!r}") from None
    if not dims or any(d < 0 for d in dims):
        raise InvalidArgument(f"shape must have at least one non-negative dimension, got {dims}")
    # NumPy refuses to create a float32 array whose non-zero dims multiply past its
    # index range, even when another dim is 0 and the array would be empty.
    if math.prod(d for d in dims if d) * 4 > np.iinfo(np.intp).max:
        raise InvalidArgument(f"shape {dims} is too large: its non-zero dimensions make more "
                              f"than {np.iinfo(np.intp).max} bytes of float32")
    return dims
