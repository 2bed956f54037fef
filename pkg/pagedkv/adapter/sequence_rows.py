"""``SequenceRows``: the per-request state every KV-cache group of a lifecycle shares
(docs/adapter.md, "Block tables and decode batches").

One row per live sequence, in flat NumPy arrays: the token buffer and the cursor (one
cursor for all groups: a row moves forward only when every group backs the new count), the
lookup/registration flags and the aux latch. A ``seq_id -> row`` dict is the only
per-sequence Python structure; each group keeps its own block-table rows at the same row
index (:class:`~pagedkv.adapter.group_blocks.GroupBlocks`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType, PagedKVError

__all__ = ["SequenceRows"]

#: Per-row bool flags (one byte a row: ``.any()`` over a batch stays cheap).
FLAGS = ("lookup_done", "registered", "finalized", "captured", "aux_unbacked")

#: Per-row int arrays: dtype and meaning.
COUNTERS = {
    "num_tokens": np.int32,     # the cursor: tokens recorded
    "cached": np.int32,         # tokens the lookup served
    "restored": np.int32,       # blocks the cold tier restored this request
    "salt": np.uint64,          # the lookup's cache_salt: what pruned blocks publish under
    "publish": np.uint8,        # how a sliding group publishes dropped blocks (table_ops)
    "state_bytes": np.int64,    # per-row out-of-pool state, bytes (admission)
}


class SequenceRows:
    """Rows of request state. ``on_grow(rows)`` callbacks let the groups grow their tables
    in step when more sequences are live than rows exist."""

    # The per-row arrays (built from COUNTERS and FLAGS).
    num_tokens: np.ndarray
    cached: np.ndarray
    restored: np.ndarray
    salt: np.ndarray
    publish: np.ndarray
    state_bytes: np.ndarray
    lookup_done: np.ndarray
    registered: np.ndarray
    finalized: np.ndarray
    captured: np.ndarray
    aux_unbacked: np.ndarray

    def __init__(self, rows: int, block_size_tokens: int) -> None:
        rows = max(1, int(rows))
        self._token_unit = max(1, int(block_size_tokens))
        self.tokens = np.zeros((rows, 4 * self._token_unit), np.uint32)
        for name, dtype in COUNTERS.items():
            setattr(self, name, np.zeros(rows, dtype))
        for name in FLAGS:
            setattr(self, name, np.zeros(rows, np.bool_))
        #: Per-row Python values: the restored sidecar, the cold capture outcome, and the
        #: lookup's extra keys (``(uniform_keys, per_block_keys_or_None)``).
        self.sidecar: list[Any] = [None] * rows
        self.capture_outcome: list[Any] = [None] * rows
        self.keys: list[Any] = [None] * rows
        self.row_of: dict[Hashable, int] = {}
        self.seq_of: list[Hashable | None] = [None] * rows
        self._free = list(range(rows - 1, -1, -1))
        self.version = 0          # bumped when the seq_id -> row map changes
        self._rows_cache: tuple[Any, int, np.ndarray] | None = None
        self._on_grow: list[Callable[[int], None]] = []

    @property
    def capacity(self) -> int:
        return len(self.seq_of)

    def add_grow_callback(self, fn: Callable[[int], None]) -> None:
        self._on_grow.append(fn)

    def __len__(self) -> int:
        return len(self.row_of)

    # --- seq_id <-> row -----------------------------------------------------------------

    def find(self, seq_id: Hashable) -> int | None:
        """The row of ``seq_id``, or ``None`` when it has none; ``InvalidArgumentType`` for an
        id that cannot be a dict key (a list, a dict, an ndarray), which the lifecycle calls
        that look ids up with ``get`` / ``in`` let through as a bare ``TypeError``."""
        try:
            return self.row_of.get(seq_id)
        except TypeError:
            raise InvalidArgumentType(
                f"seq_id {seq_id!r} is unhashable ({type(seq_id).__name__}): sequence ids are "
                "dict keys; use an int, a str or a tuple of them") from None

    def row(self, seq_id: Hashable) -> int:
        try:
            return self.row_of[seq_id]
        except TypeError:
            self.find(seq_id)  # unhashable: InvalidArgumentType, not "call reset_for_new_request"
            raise
        except KeyError:
            raise PagedKVError(
                f"seq_id {seq_id!r} has no table: call reset_for_new_request({seq_id!r}) first; "
                f"live sequences: {len(self.row_of)}") from None

    def rows(self, seq_ids: Sequence[Hashable]) -> np.ndarray:
        """Rows of ``seq_ids`` as intp; cached for the same id list while no row changes, so
        a decode loop over a stable batch resolves its rows once."""
        key = seq_ids if type(seq_ids) is tuple else tuple(seq_ids)
        cache = self._rows_cache
        if cache is not None and cache[1] == self.version and (cache[0] is key or cache[0] == key):
            return cache[2]
        try:
            rows = np.fromiter(map(self.row_of.__getitem__, key), np.intp, len(key))
        except (KeyError, TypeError):
            # find: an unhashable id is InvalidArgumentType (`in` let a bare TypeError out)
            unknown = [s for s in key if self.find(s) is None]
            raise PagedKVError(f"seq_ids {unknown!r} have no table: call reset_for_new_request "
                               "for each first") from None
        if len(set(key)) != len(key):
            raise InvalidArgument("seq_ids contains duplicates; each sequence appears once per "
                                  "step")
        rows.setflags(write=False)
        self._rows_cache = (key, self.version, rows)
        return rows

    def acquire(self, seq_id: Hashable) -> int:
        self.find(seq_id)  # an unhashable id is refused before a row is taken
        if not self._free:
            self._grow(2 * self.capacity)
        row = self._free.pop()
        self.row_of[seq_id] = row
        self.seq_of[row] = seq_id
        self.version += 1
        return row

    def release(self, seq_id: Hashable, row: int) -> None:
        self.clear(row)
        del self.row_of[seq_id]
        self.seq_of[row] = None
        self._free.append(row)
        self.version += 1

    def clear(self, row: int) -> None:
        for name in COUNTERS:
            getattr(self, name)[row] = 0
        for name in FLAGS:
            getattr(self, name)[row] = False
        self.sidecar[row] = None
        self.capture_outcome[row] = None
        self.keys[row] = None

    # --- storage growth -------------------------------------------------------------------

    def _grow(self, rows: int) -> None:
        old = self.capacity

        def grown(a: np.ndarray) -> np.ndarray:
            out = np.zeros((rows,) + a.shape[1:], a.dtype)
            out[:old] = a
            return out

        self.tokens = grown(self.tokens)
        for name in (*COUNTERS, *FLAGS):
            setattr(self, name, grown(getattr(self, name)))
        for name in ("sidecar", "capture_outcome", "keys", "seq_of"):
            getattr(self, name).extend([None] * (rows - old))
        self._free[:0] = range(rows - 1, old - 1, -1)
        for fn in self._on_grow:
            fn(rows)

    def ensure_tokens(self, n: int) -> None:
        """Room for ``n`` tokens in every row (doubling)."""
        width = self.tokens.shape[1]
        if n <= width:
            return
        width = max(2 * width, -(-n // self._token_unit) * self._token_unit)
        tokens = np.zeros((self.tokens.shape[0], width), np.uint32)
        tokens[:, :self.tokens.shape[1]] = self.tokens
        self.tokens = tokens
