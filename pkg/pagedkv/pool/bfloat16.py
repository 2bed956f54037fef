"""bfloat16 as uint16 bit patterns (docs/contracts/paged-kv.md, '5.3 dtype').

NumPy has no bfloat16, so a bfloat16 pool stores, reads and writes the upper 16 bits of the
float32 encoding. Widening is exact (``bits << 16``); narrowing rounds to nearest, ties to
even, and keeps NaNs NaN (the quiet bit is set so a NaN payload never rounds to infinity).
"""

from __future__ import annotations

import numpy as np

from pagedkv.errors import InvalidArgumentType

__all__ = ["bf16_bits_to_float32", "float32_to_bf16_bits"]


def bf16_bits_to_float32(bits) -> np.ndarray:
    """Widen bfloat16 bit patterns (``uint16``) to ``float32`` exactly."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise InvalidArgumentType(
            f"bits: dtype {bits.dtype} is not uint16; bfloat16 travels as uint16 bit patterns")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(values) -> np.ndarray:
    """Narrow ``float32`` values to bfloat16 bit patterns (``uint16``), round to nearest even."""
    values = np.asarray(values)
    if values.dtype != np.float32:
        raise InvalidArgumentType(
            f"values: dtype {values.dtype} is not float32; cast to float32 first")
    bits = values.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16
    quiet_nan = (bits >> 16) | np.uint32(0x0040)
    return np.where(np.isnan(values), quiet_nan, rounded).astype(np.uint16)
