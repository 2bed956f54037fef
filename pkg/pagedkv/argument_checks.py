"""Integer argument checks every layer shares: one test for "an int, not a bool", one
message shape for a refused count.

``bool`` is a subclass of ``int``, so ``isinstance(True, int)`` holds and ``True`` would
silently become a block count of 1; NumPy integers (``np.int64(3)`` from an array) are
accepted, NumPy booleans and floats are not. Base layer: imports nothing of pagedkv but
:mod:`pagedkv.errors`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeGuard

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["int_argument", "is_int", "items_argument", "row_span"]


def is_int(value: object) -> TypeGuard[int | np.integer]:
    """True for a Python ``int`` or a NumPy integer scalar; False for ``bool`` and
    ``numpy.bool_`` (and everything else: floats, strings, 0-d arrays)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def int_argument(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as a Python ``int``: :class:`~pagedkv.errors.InvalidArgumentType` when it
    is not an int (:func:`is_int`), :class:`~pagedkv.errors.InvalidArgument` below
    ``minimum``."""
    if not is_int(value):
        raise InvalidArgumentType(f"{name} must be an int, got {type(value).__name__}")
    number = int(value)
    if number < minimum:
        raise InvalidArgument(f"{name} = {number} must be >= {minimum}")
    return number


def items_argument(name: str, value: object) -> list:
    """``value``'s items as a list: :class:`~pagedkv.errors.InvalidArgumentType` when it is
    not a collection of items (``None``, a number, a ``str`` or ``bytes``, a mapping)."""
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes, Mapping)):
        raise InvalidArgumentType(f"{name} must be a sequence, got {type(value).__name__}")
    return list(value)


def row_span(rows: object, n: int, tensor: str, dim: int = 0) -> tuple[int, int]:
    """The rows ``[lo, hi)`` that ``rows`` selects along a dim of ``n`` rows (dim ``dim``
    of the tensor named ``tensor``; the model sources' ``read`` share it): an int in
    ``-n..n-1`` selects that row (negative from the end), a slice with step 1 (or none)
    its rows clipped as Python clips them (a reversed one none, ``lo == hi``). Raises
    :class:`~pagedkv.errors.InvalidArgument` naming the tensor and the range for an int
    outside it or a slice with another step, ``InvalidArgumentType`` for anything else."""
    of = repr(tensor) if dim == 0 else f"{tensor!r} (dim {dim})"
    if isinstance(rows, slice):
        if rows.step not in (None, 1):
            raise InvalidArgument(f"row slice {rows} of {of} has step {rows.step}; only "
                                  "contiguous rows (step 1) are read")
        try:
            lo, hi, _ = rows.indices(n)
        except TypeError:
            raise InvalidArgumentType(f"row slice {rows} of {of} must have int bounds") from None
        return lo, max(hi, lo)
    if not is_int(rows):
        raise InvalidArgumentType(f"row index of {of} must be an int or a slice, got "
                                  f"{type(rows).__name__}")
    if not -n <= int(rows) < n:
        raise InvalidArgument(f"row {rows!r} of {of} is out of range: the "
                              f"{'tensor' if dim == 0 else 'dim'} has {n} rows, pass "
                              f"-{n}..{n - 1}")
    lo = int(rows) % n
    return lo, lo + 1
