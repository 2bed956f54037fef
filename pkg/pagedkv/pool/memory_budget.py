"""MemoryBudget: one byte limit shared by every pool of a process (docs/contracts/paged-kv.md, '5.6
grow_to and generations').

Each pool holds a *debit*. Growth is two-phase: ``try_reserve(pool_id, new_total_bytes)``
checks that the transient peak (old generation + new generation) fits and raises the debit
to ``old + new``; after the swap ``update_pool(pool_id, new_total_bytes)`` drops it to the
grown total. Until then both generations may be resident (lazy computations and cached views
can still hold the old one), so the limit is checked against the peak, not the end state.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Hashable

from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["MemoryBudget"]


def _non_negative_bytes(name: str, value) -> int:
    if isinstance(value, bool):
        raise InvalidArgumentType(f"{name}: expected an int number of bytes, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise InvalidArgumentType(
            f"{name}: expected an int number of bytes, got {type(value).__name__}") from None
    if value < 0:
        raise InvalidArgument(f"{name}: {value} bytes is negative; it must be >= 0")
    return value


class MemoryBudget:
    """A byte limit over the debits of several pools (thread-safe).

    ``limit_bytes``: the most bytes all pools together may hold, transient growth included.
    """

    def __init__(self, limit_bytes: int) -> None:
        self._limit_bytes = _non_negative_bytes("limit_bytes", limit_bytes)
        self._debits: dict[Hashable, int] = {}
        # Re-entrant: try_reserve_new_pool holds it across its id check and try_reserve
        # (which a subclass may override and which takes it again).
        self._lock = threading.RLock()

    @property
    def limit_bytes(self) -> int:
        return self._limit_bytes

    @property
    def total_debit_bytes(self) -> int:
        """Bytes debited by all pools now."""
        with self._lock:
            return sum(self._debits.values())

    @property
    def available_bytes(self) -> int:
        """``limit_bytes - total_debit_bytes`` (never negative)."""
        with self._lock:
            return max(0, self._limit_bytes - sum(self._debits.values()))

    def debit(self, pool_id: Hashable) -> int:
        """Bytes debited by ``pool_id`` (0 for an unknown pool)."""
        with self._lock:
            return self._debits.get(pool_id, 0)

    def pools(self) -> dict[Hashable, int]:
        """A copy of every pool's debit."""
        with self._lock:
            return dict(self._debits)

    def try_reserve(self, pool_id: Hashable, new_total_bytes: int) -> bool:
        """Reserve the transient peak of growing ``pool_id`` to ``new_total_bytes``.

        Succeeds iff the other pools' debits + this pool's current debit + ``new_total_bytes``
        <= ``limit_bytes``; then this pool's debit becomes ``current + new_total_bytes`` until
        :meth:`update_pool`. A new pool (no debit yet) reserves its first allocation this way.
        On ``False`` nothing changes.
        """
        new_total_bytes = _non_negative_bytes("new_total_bytes", new_total_bytes)
        with self._lock:
            if sum(self._debits.values()) + new_total_bytes > self._limit_bytes:
                return False
            self._debits[pool_id] = self._debits.get(pool_id, 0) + new_total_bytes
            return True

    def try_reserve_new_pool(self, pool_id: Hashable, total_bytes: int) -> bool:
        """:meth:`try_reserve` of a new pool's first allocation, refusing an id that already
        has a debit with ``InvalidArgument`` (nothing changes). The check and the reservation
        are one step under the budget's lock, so two pools built at once with one id cannot
        both be debited under it."""
        with self._lock:
            if pool_id in self._debits:
                raise InvalidArgument(
                    f"pool_id: {pool_id!r} is already debited in this MemoryBudget "
                    f"({self._debits[pool_id]} bytes); give each pool its own id")
            return self.try_reserve(pool_id, total_bytes)

    def update_pool(self, pool_id: Hashable, total_bytes: int) -> None:
        """Set ``pool_id``'s debit to ``total_bytes`` (after a grow commits or rolls back)."""
        total_bytes = _non_negative_bytes("total_bytes", total_bytes)
        with self._lock:
            self._debits[pool_id] = total_bytes

    def release_pool(self, pool_id: Hashable) -> int:
        """Drop ``pool_id``'s debit (the pool was closed); returns the bytes released."""
        with self._lock:
            return self._debits.pop(pool_id, 0)

    def __repr__(self) -> str:
        with self._lock:
            used = sum(self._debits.values())
            return (f"MemoryBudget(limit_bytes={self._limit_bytes}, debit_bytes={used}, "
                    f"pools={len(self._debits)})")
