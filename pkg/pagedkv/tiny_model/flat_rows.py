"""K/V rows of one attention layer of one sequence, contiguous, for the flat KV paths.

A full-attention layer keeps every position; a sliding-window layer forgets the positions
no later token can attend (:meth:`LayerRows.forget_before`), so its memory stays a window
plus the chunk being computed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgument

__all__ = ["LayerRows"]


class LayerRows:
    """Rows ``[first, end)`` of K and V, ``[tokens, kv_heads, head_dim]`` each.

    ``backend="numpy"``: float32 buffers that double when full (forgotten rows are dropped
    when the buffer is reallocated); ``backend="mlx"``: ``mx.array``s extended by
    concatenation and sliced when rows are forgotten.
    """

    def __init__(self, backend: str, row_shape: tuple[int, int],
                 initial_capacity_tokens: int = 64) -> None:
        if backend not in ("numpy", "mlx"):
            raise InvalidArgument(f"backend={backend!r}: expected 'numpy' or 'mlx'")
        self._backend = backend
        self._row_shape = row_shape
        self.first = 0
        self.end = 0
        # numpy: buffers and the buffer index of position `first`; mlx: the held rows or None
        # (mlx is imported lazily, so its type cannot be named here).
        self._k: Any = None
        self._v: Any = None
        self._offset = 0
        if backend == "numpy":
            self._k = np.zeros((initial_capacity_tokens, *row_shape), np.float32)
            self._v = np.zeros_like(self._k)

    def __repr__(self) -> str:
        return f"LayerRows(backend={self._backend!r}, positions=[{self.first}, {self.end}))"

    def start_at(self, position: int) -> None:
        """Make an empty store's first row position ``position`` (a resumed sliding layer)."""
        if self.end != self.first:
            raise InvalidArgument(
                f"start_at({position}) on a store holding [{self.first}, {self.end})")
        self.first = self.end = position

    def append(self, k: Any, v: Any) -> None:
        """Store K/V ``[n, kv_heads, head_dim]`` of positions ``[end, end + n)``."""
        n = k.shape[0]
        if self._backend == "mlx":
            import mlx.core as mx
            self._k = k if self._k is None else mx.concatenate([self._k, k], axis=0)
            self._v = v if self._v is None else mx.concatenate([self._v, v], axis=0)
            self.end += n
            return
        held = self.end - self.first
        if self._offset + held + n > self._k.shape[0]:
            capacity = max(2 * self._k.shape[0], held + n)
            new_k = np.zeros((capacity, *self._row_shape), np.float32)
            new_v = np.zeros_like(new_k)
            new_k[:held] = self._k[self._offset:self._offset + held]
            new_v[:held] = self._v[self._offset:self._offset + held]
            self._k, self._v, self._offset = new_k, new_v, 0
        at = self._offset + held
        self._k[at:at + n] = k
        self._v[at:at + n] = v
        self.end += n

    def forget_before(self, position: int) -> None:
        """Drop the rows of positions ``< position`` (no-op for rows already dropped)."""
        drop = min(position, self.end) - self.first
        if drop <= 0:
            return
        if self._backend == "mlx":
            self._k, self._v = self._k[drop:], self._v[drop:]
        else:
            self._offset += drop
        self.first += drop

    def rows(self, first: int) -> tuple[Any, Any]:
        """K and V of positions ``[first, end)``; ``first`` must not precede :attr:`first`."""
        if not self.first <= first <= self.end:
            raise InvalidArgument(
                f"rows from position {first} asked, but this layer holds [{self.first}, "
                f"{self.end})")
        lo = first - self.first
        if self._backend == "mlx":
            if self._k is None:
                import mlx.core as mx
                empty = mx.zeros((0, *self._row_shape), mx.float32)
                return empty, empty
            return self._k[lo:], self._v[lo:]
        lo += self._offset
        hi = self._offset + self.end - self.first
        return self._k[lo:hi], self._v[lo:hi]
