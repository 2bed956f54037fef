"""Integer arguments of the sidecar and ladder APIs: one check, one message shape."""

from __future__ import annotations

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["int_argument"]


def int_argument(name: str, value, minimum: int = 0) -> int:
    """``value`` as an ``int`` (Python or NumPy integer, never a bool or float);
    ``InvalidArgumentType`` for another type, ``InvalidArgument`` below ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentType(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidArgument(f"{name} = {value} must be >= {minimum}")
    return int(value)
