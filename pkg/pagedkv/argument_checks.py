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

__all__ = ["int_argument", "is_int", "items_argument"]


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
