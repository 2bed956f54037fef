"""Argument checks shared by the request lifecycle's public calls."""

from __future__ import annotations

import numpy as np

from pagedkv.argument_checks import int_argument
from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["as_count", "as_tokens"]

_U32_MAX = 0xFFFFFFFF


def as_tokens(tokens, name: str = "tokens") -> np.ndarray:
    """Any 1-D integer array-like as uint32 (no copy for a C-contiguous uint32 array)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32 and tokens.ndim == 1:
        return tokens
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError) as exc:  # ragged or unconvertible
        raise InvalidArgumentType(
            f"{name} must be a 1-D array-like of token ids in [0, 2**32); got "
            f"{type(tokens).__name__} ({exc})") from None
    if arr.ndim != 1:
        raise InvalidArgument(f"{name} must be 1-D, got shape {arr.shape}")
    # An empty list converts to float64 and is fine; an empty array's dtype is the caller's.
    if arr.size == 0 and not (isinstance(tokens, np.ndarray) and arr.dtype.kind not in "iu"):
        return np.empty(0, np.uint32)
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentType(
            f"{name} must be integers, got dtype {arr.dtype}: pass token ids, not floats/bools")
    if int(arr.min()) < 0 or int(arr.max()) > _U32_MAX:
        raise InvalidArgument(f"{name} must satisfy 0 <= t < 2**32, got range "
                              f"[{int(arr.min())}, {int(arr.max())}]")
    return arr.astype(np.uint32)


def as_count(value, name: str) -> int:
    """A non-negative Python int (bools and floats refused)."""
    return int_argument(name, value)
