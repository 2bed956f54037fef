from typing import Self

import numpy as np
from typing_extensions import disjoint_base

@disjoint_base
class SlotCopier:
    """Per-layer token write/gather of a NumPy pool in C (the exact-kind fast path)."""

    array: np.ndarray
    # Built in __cinit__: the runtime __init__ takes no arguments, __new__ takes the array.
    def __new__(cls, array: np.ndarray) -> Self: ...
    def write_slots(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> bool: ...
    def write_positions(self, layer: int, block_ids: np.ndarray, start: int, k: np.ndarray,
                        v: np.ndarray) -> bool: ...
    def gather(self, layer: int, block_ids: np.ndarray, num_tokens: int
               ) -> tuple[np.ndarray, np.ndarray] | None: ...
