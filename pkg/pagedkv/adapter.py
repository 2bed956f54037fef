"""``PagedKVCacheAdapter``: the per-request lifecycle over one allocator and one pool
(paged-kv.md §7).

Many sequences share one :class:`~pagedkv.allocator.BlockAllocator` and one
:class:`~pagedkv.pool.LayerKVPool`. Per-sequence state lives in flat NumPy arrays indexed by a
*row*: one ``int32[rows, width]`` block table (``-1`` for unused entries), per-row length
arrays and one ``uint32[rows, width * block_size]`` token buffer; a ``seq_id -> row`` dict is
the only per-sequence Python structure, and nothing is kept per block. A decode step for many
sequences (:meth:`PagedKVCacheAdapter.record_decode_tokens` then
:meth:`PagedKVCacheAdapter.prepare_decode`) is a handful of vectorized NumPy operations.

The adapter is not thread-safe: callers serialize calls on one adapter and on adapters that
share an allocator (the allocator's own operations are atomic).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np

from pagedkv.errors import (
    AuxStateUnconfirmed,
    CapacityExceeded,
    ContextLengthExceeded,
    InvalidArgument,
    InvalidArgumentType,
    LookupAlreadyDone,
    PagedKVError,
    PoolExhausted,
)
from pagedkv.sizing import ReservationGrowth

__all__ = ["DecodeBatch", "PagedKVCacheAdapter", "PrefixLookup", "TurnPlan", "TurnPlanReason"]

log = logging.getLogger("pagedkv.adapter")

_EMPTY_IDS = np.empty(0, np.int32)
_EMPTY_IDS.setflags(write=False)
_U32_MAX = 0xFFFFFFFF


class PrefixLookup(NamedTuple):
    """Result of :meth:`PagedKVCacheAdapter.find_cached_prefix`.

    cached_tokens: positions whose K/V the table now holds (a multiple of the block size).
    hot_blocks: int32 ids the in-process prefix cache served.
    restored_blocks: int32 ids the cold tier restored after them (empty without a cold tier).
    sidecar: the restored out-of-pool state, or ``None``.
    """

    cached_tokens: int
    hot_blocks: np.ndarray
    restored_blocks: np.ndarray
    sidecar: Any


class DecodeBatch(NamedTuple):
    """What a paged-attention decode kernel needs for one step (§7.3).

    block_tables: ``int32[n, width]``, row ``i`` the table of ``seq_ids[i]``, ``-1`` padded.
    seq_lens: ``int32[n]`` tokens of each sequence, this step's token included.
    slot_mapping: ``int64[n]`` the slot (``block * block_size + offset``) of each sequence's
    last position, where this step's K/V goes.
    generation: the pool generation the ids belong to; a grow makes the batch stale.
    """

    block_tables: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    generation: int


class TurnPlanReason(enum.Enum):
    CONTINUED_LIVE_PREFIX = "continued_live_prefix"
    FRESH_RESET = "fresh_reset"
    CONTINUE_FAILED_RESET = "continue_failed_reset"


class TurnPlan(NamedTuple):
    """Result of :meth:`PagedKVCacheAdapter.prepare_turn`: how many prompt tokens the table
    already holds (compute only ``prompt[cached_tokens:]``) and why."""

    reason: TurnPlanReason
    cached_tokens: int
    newly_allocated: int


def _as_tokens(tokens, name: str = "tokens") -> np.ndarray:
    """Any 1-D integer array-like as uint32 (no copy for a C-contiguous uint32 array)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32 and tokens.ndim == 1:
        return tokens
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgument(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, np.uint32)
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentType(
            f"{name} must be integers, got dtype {arr.dtype}: pass token ids, not floats/bools")
    if int(arr.min()) < 0 or int(arr.max()) > _U32_MAX:
        raise InvalidArgument(f"{name} must satisfy 0 <= t < 2**32, got range "
                              f"[{int(arr.min())}, {int(arr.max())}]")
    return arr.astype(np.uint32)


def _as_count(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentType(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise InvalidArgument(f"{name} = {value} must be >= 0")
    return int(value)


class PagedKVCacheAdapter:
    """Per-sequence block tables over a shared allocator and pool (paged-kv.md §7).

    Parameters
    ----------
    allocator, pool:
        Must agree on ``block_size``, ``num_blocks`` and ``max_num_blocks`` (else
        ``InvalidArgument``). The pool grows before the allocator (§5.6).
    cold_tier:
        ``None`` or an object with ``capture(...)`` and ``restore(...)`` (docs/adapter.md,
        "Cold-tier hooks"). A failing hook is logged and counted, never raised into inference.
    requires_aux_confirmation:
        The model family keeps state outside the pool: enables the aux latch (§7.5).
    growth:
        Grow the pool on demand (§6.1); ``False`` keeps it at its current size.
    initial_rows:
        Sequence rows allocated up front (the tables double when more are live).
    """

    def __init__(self, allocator, pool, *, cold_tier=None, requires_aux_confirmation: bool = False,
                 growth: bool = True, initial_rows: int = 8) -> None:
        bs = allocator.block_size
        if bs != pool.block_size:
            raise InvalidArgument(f"allocator.block_size = {bs} differs from pool.block_size = "
                                  f"{pool.block_size}: build both with one block size")
        for attr in ("num_blocks", "max_num_blocks"):
            if getattr(allocator, attr) != getattr(pool, attr):
                raise InvalidArgument(
                    f"allocator.{attr} = {getattr(allocator, attr)} differs from pool.{attr} = "
                    f"{getattr(pool, attr)}: build both with the same sizes")
        self.allocator = allocator
        self.pool = pool
        self.cold_tier = cold_tier
        self.requires_aux_confirmation = bool(requires_aux_confirmation)
        self.growth = bool(growth)
        self.block_size = bs
        self._num_layers = pool.geometry.num_layers
        self._token_shape = (pool.geometry.num_kv_heads, pool.geometry.head_dim)
        rows = max(1, int(initial_rows))
        width = 4
        self._table = np.full((rows, width), -1, np.int32)
        self._tokens = np.zeros((rows, width * bs), np.uint32)
        self._num_blocks = np.zeros(rows, np.int32)
        self._num_tokens = np.zeros(rows, np.int32)
        self._cached = np.zeros(rows, np.int32)
        self._restored = np.zeros(rows, np.int32)  # blocks the cold tier restored this request
        self._revision = np.zeros(rows, np.int64)
        # Flags, one byte per row: a bool array keeps `.any()` over a batch cheap.
        self._lookup_done = np.zeros(rows, np.bool_)
        self._registered = np.zeros(rows, np.bool_)
        self._finalized = np.zeros(rows, np.bool_)
        self._captured = np.zeros(rows, np.bool_)
        self._aux_unbacked = np.zeros(rows, np.bool_)
        self._sidecar: list[Any] = [None] * rows
        self._capture_outcome: list[Any] = [None] * rows
        self._row_of: dict[Hashable, int] = {}
        self._seq_of: list[Hashable | None] = [None] * rows
        self._free_rows = list(range(rows - 1, -1, -1))
        self._row_map_version = 0
        self._rows_cache: tuple[Any, int, np.ndarray] | None = None
        self._suppress_cold_restore_once = False
        self._counters = dict.fromkeys((
            "lookups", "lookup_tokens", "hit_tokens", "hit_blocks", "restored_blocks",
            "blocks_allocated", "registered_blocks", "grow_events", "cold_capture_errors",
            "cold_restore_errors"), 0)

    def __repr__(self) -> str:
        return (f"PagedKVCacheAdapter(live={len(self._row_of)}, block_size={self.block_size}, "
                f"pool_blocks={self.pool.num_blocks}/{self.pool.max_num_blocks}, "
                f"generation={self.pool.generation}, growth={self.growth}, "
                f"cold_tier={'on' if self.cold_tier is not None else 'off'})")

    # --- rows ----------------------------------------------------------------------------

    def _row(self, seq_id: Hashable) -> int:
        try:
            return self._row_of[seq_id]
        except (KeyError, TypeError):
            raise PagedKVError(
                f"seq_id {seq_id!r} has no table: call reset_for_new_request({seq_id!r}) first; "
                f"live sequences: {len(self._row_of)}") from None

    def _rows(self, seq_ids: Sequence[Hashable]) -> np.ndarray:
        """Rows of ``seq_ids`` as intp; cached for the same id list while no row changes, so a
        decode loop over a stable batch resolves its rows once."""
        key = seq_ids if type(seq_ids) is tuple else tuple(seq_ids)
        cache = self._rows_cache
        if cache is not None and cache[1] == self._row_map_version and (
                cache[0] is key or cache[0] == key):
            return cache[2]
        try:
            rows = np.fromiter(map(self._row_of.__getitem__, key), np.intp, len(key))
        except (KeyError, TypeError):
            unknown = [s for s in key if s not in self._row_of]
            raise PagedKVError(f"seq_ids {unknown!r} have no table: call reset_for_new_request "
                               "for each first") from None
        if len(set(key)) != len(key):
            raise InvalidArgument("seq_ids contains duplicates; each sequence appears once per "
                                  "step")
        rows.setflags(write=False)
        self._rows_cache = (key, self._row_map_version, rows)
        return rows

    def _acquire_row(self, seq_id: Hashable) -> int:
        if not self._free_rows:
            self._grow_rows(2 * len(self._seq_of))
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        self._seq_of[row] = seq_id
        self._row_map_version += 1
        return row

    def _grow_rows(self, rows: int) -> None:
        old = len(self._seq_of)

        def grown(a: np.ndarray, fill) -> np.ndarray:
            out = np.full((rows,) + a.shape[1:], fill, a.dtype)
            out[:old] = a
            return out

        self._table = grown(self._table, -1)
        self._tokens = grown(self._tokens, 0)
        for name in ("_num_blocks", "_num_tokens", "_cached", "_restored", "_revision",
                     "_lookup_done",
                     "_registered", "_finalized", "_captured", "_aux_unbacked"):
            setattr(self, name, grown(getattr(self, name), 0))
        self._sidecar.extend([None] * (rows - old))
        self._capture_outcome.extend([None] * (rows - old))
        self._seq_of.extend([None] * (rows - old))
        self._free_rows[:0] = range(rows - 1, old - 1, -1)

    def _ensure_width(self, blocks: int) -> None:
        width = self._table.shape[1]
        if blocks <= width:
            return
        width = max(2 * width, blocks)
        table = np.full((self._table.shape[0], width), -1, np.int32)
        table[:, :self._table.shape[1]] = self._table
        tokens = np.zeros((self._tokens.shape[0], width * self.block_size), np.uint32)
        tokens[:, :self._tokens.shape[1]] = self._tokens
        self._table, self._tokens = table, tokens

    def _clear_row(self, row: int) -> None:
        self._table[row] = -1
        self._num_blocks[row] = 0
        self._num_tokens[row] = 0
        self._cached[row] = 0
        self._restored[row] = 0
        self._revision[row] += 1
        self._lookup_done[row] = False
        self._registered[row] = False
        self._finalized[row] = False
        self._captured[row] = False
        self._aux_unbacked[row] = False
        self._sidecar[row] = None
        self._capture_outcome[row] = None

    # --- reservations and growth ---------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence can ever hold: ``max_num_blocks * block_size``."""
        return self.allocator.max_num_blocks * self.block_size

    def _check_capacity(self, total_tokens: int, phrase: str) -> None:
        if total_tokens > self.capacity_tokens:
            raise CapacityExceeded(
                f"{phrase}: requested {total_tokens} tokens, paged cache capacity is "
                f"{self.capacity_tokens} tokens ({self.allocator.max_num_blocks} blocks of "
                f"{self.block_size})")

    def _reserve(self, needed: int, total_tokens: int, phrase: str) -> np.ndarray:
        """``needed`` new block ids, all or nothing: one grow before, one grow + retry after
        a dry allocation (§6.1, :class:`pagedkv.sizing.ReservationGrowth`). ``allocate_many``
        takes nothing when it fails, so a failed reservation leaves the allocator as it was
        (a growth that happened stays: the pool is only bigger)."""
        allocator = self.allocator
        if not self.growth:
            blocks = allocator.allocate_many(needed)
        else:
            growth = ReservationGrowth(self.pool, allocator.grow_by)
            if growth.before_allocation(needed, allocator.free_or_evictable_blocks):
                self._counters["grow_events"] += 1
            blocks = allocator.allocate_many(needed)
            if blocks is None and growth.for_retry(needed - allocator.free_or_evictable_blocks):
                self._counters["grow_events"] += 1
                blocks = allocator.allocate_many(needed)
        if blocks is None:
            raise PoolExhausted(
                f"{phrase}: {needed} more blocks needed for {total_tokens} tokens, "
                f"{allocator.free_or_evictable_blocks} free or evictable of "
                f"{allocator.num_blocks} (max {allocator.max_num_blocks}); preempt a request "
                "or raise the pool's memory_mb")
        self._counters["blocks_allocated"] += needed
        return blocks

    def _append_blocks(self, row: int, blocks: np.ndarray) -> None:
        n = int(self._num_blocks[row])
        self._ensure_width(n + len(blocks))
        self._table[row, n:n + len(blocks)] = blocks
        self._num_blocks[row] = n + len(blocks)
        self._revision[row] += 1

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- lifecycle -----------------------------------------------------------------------

    def reset_for_new_request(self, seq_id: Hashable) -> None:
        """Release any live request of ``seq_id`` and give it an empty table."""
        if seq_id in self._row_of:
            self.release_request(seq_id)
        self._acquire_row(seq_id)

    def find_cached_prefix(self, seq_id: Hashable, prompt, *, extra_keys: Sequence[int] = (),
                           extra_keys_per_block=None, cache_salt: int = 0,
                           skip_lookup: bool = False, max_tokens: int | None = None
                           ) -> PrefixLookup:
        """Put the longest verified cached prefix of ``prompt[:max_tokens]`` into the table.

        Hot hit first (``allocator.find_longest_cache_hit``), then the cold tier extends it.
        The blocks come incref'd and the table owns them. One lookup per request
        (``LookupAlreadyDone``); ``skip_lookup`` forces a miss.
        """
        row = self._row(seq_id)
        if self._lookup_done[row]:
            raise LookupAlreadyDone(
                f"find_cached_prefix was already called for seq_id {seq_id!r} in this request; "
                "call reset_for_new_request to start another")
        tokens = _as_tokens(prompt, "prompt")
        if isinstance(cache_salt, str):
            raise InvalidArgumentType(
                "cache_salt must be a u64 domain id, got a str: pass salt_domain_id(salt)")
        suppress_cold = self._suppress_cold_restore_once
        self._suppress_cold_restore_once = False
        if skip_lookup:
            self._lookup_done[row] = True
            return PrefixLookup(0, _EMPTY_IDS, _EMPTY_IDS, None)
        if max_tokens is not None:
            tokens = tokens[:_as_count(max_tokens, "max_tokens")]
        hot, _ = self.allocator.find_longest_cache_hit(
            tokens, extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
            cache_salt=cache_salt)
        hot = np.asarray(hot, np.int32)
        restored = _EMPTY_IDS
        if (self.cold_tier is not None and not suppress_cold
                and (len(hot) + 1) * self.block_size <= len(tokens)):
            restored = self._cold_restore(tokens, hot, cache_salt, extra_keys,
                                          extra_keys_per_block)
        blocks = np.concatenate([hot, restored]) if len(restored) else hot
        cached = min(len(blocks) * self.block_size, len(tokens))
        self._ensure_width(len(blocks))
        self._table[row, :len(blocks)] = blocks
        self._num_blocks[row] = len(blocks)
        self._tokens[row, :cached] = tokens[:cached]
        self._num_tokens[row] = cached
        self._cached[row] = cached
        self._restored[row] = len(restored)
        if len(blocks):
            self._revision[row] += 1
        self._lookup_done[row] = True
        sidecar = None
        self._sidecar[row] = sidecar
        # A family with out-of-pool state cannot resume from K/V alone (§7.5).
        self._aux_unbacked[row] = self.requires_aux_confirmation and cached > 0
        c = self._counters
        c["lookups"] += 1
        c["lookup_tokens"] += len(tokens)
        c["hit_tokens"] += cached
        c["hit_blocks"] += len(hot)
        c["restored_blocks"] += len(restored)
        return PrefixLookup(cached, hot, restored, sidecar)

    def allocate_suffix_blocks(self, seq_id: Hashable, total_tokens: int) -> int:
        """Reserve blocks for a prompt of ``total_tokens`` (decode blocks come lazily from
        :meth:`record_tokens`). All or nothing. Returns the number of blocks newly allocated."""
        row = self._row(seq_id)
        total = _as_count(total_tokens, "total_tokens")
        self._check_capacity(total, "paged cache could not reserve")
        needed = self._blocks_for(total) - int(self._num_blocks[row])
        if needed <= 0:
            return 0
        self._append_blocks(row, self._reserve(needed, total, "paged cache could not reserve"))
        return needed

    def _check_latch(self, row: int, call: str) -> None:
        if self._aux_unbacked[row]:
            raise AuxStateUnconfirmed(
                f"{call}: seq_id {self._seq_of[row]!r} resumed {int(self._cached[row])} cached "
                "tokens but its out-of-pool state is unconfirmed; install it and call "
                f"confirm_aux_prefix_primed(seq_id, {int(self._cached[row])})")

    def record_tokens(self, seq_id: Hashable, tokens) -> None:
        """Append ``tokens`` to the sequence, allocating blocks when it crosses a boundary.

        Errors (``CapacityExceeded``, ``PoolExhausted``, "paged decode could not reserve")
        change nothing. Call it before :meth:`write_kv` for those positions.
        """
        row = self._row(seq_id)
        self._check_latch(row, "record_tokens")
        toks = _as_tokens(tokens)
        start = int(self._num_tokens[row])
        end = start + len(toks)
        self._check_capacity(end, "paged decode could not reserve")
        needed = self._blocks_for(end) - int(self._num_blocks[row])
        if needed > 0:
            self._append_blocks(row, self._reserve(needed, end, "paged decode could not reserve"))
        self._tokens[row, start:end] = toks
        self._num_tokens[row] = end

    def record_decode_tokens(self, seq_ids: Sequence[Hashable], tokens) -> None:
        """One decode step: append ``tokens[i]`` to ``seq_ids[i]`` for every sequence at once.

        The batched form of :meth:`record_tokens` (same errors, all or nothing over the batch):
        sequences that cross a block boundary get their blocks from one ``allocate_many``.
        """
        rows = self._rows(seq_ids)
        toks = _as_tokens(tokens)
        if len(toks) != len(rows):
            raise InvalidArgument(
                f"tokens has {len(toks)} entries for {len(rows)} seq_ids: one token each")
        if self.requires_aux_confirmation and self._aux_unbacked[rows].any():
            self._check_latch(int(rows[self._aux_unbacked[rows].argmax()]), "record_decode_tokens")
        bs = self.block_size
        ends = self._num_tokens[rows] + 1
        if int(ends.max(initial=0)) > self.capacity_tokens:
            self._check_capacity(int(ends.max()), "paged decode could not reserve")
        crossing = rows[ends > self._num_blocks[rows] * bs]
        if len(crossing):
            blocks = self._reserve(len(crossing), int(ends.max()), "paged decode could not reserve")
            slots = self._num_blocks[crossing]
            self._ensure_width(int(slots.max()) + 1)
            self._table[crossing, slots] = blocks
            self._num_blocks[crossing] = slots + 1
            self._revision[crossing] += 1
        self._tokens[rows, ends - 1] = toks
        self._num_tokens[rows] = ends

    def prepare_decode(self, seq_ids: Sequence[Hashable]) -> DecodeBatch:
        """The kernel inputs of one decode step, after its :meth:`record_decode_tokens`."""
        rows = self._rows(seq_ids)
        lens = self._num_tokens[rows]
        last = lens - 1
        if len(rows) and int(last.min()) < 0:
            empty = [self._seq_of[r] for r in rows[lens == 0]]
            raise InvalidArgument(f"seq_ids {empty!r} hold no tokens: record_tokens first")
        bs = self.block_size
        width = int(self._num_blocks[rows].max(initial=0))
        tables = self._table[rows, :width]
        slots = self._table[rows, last // bs].astype(np.int64) * bs + last % bs
        return DecodeBatch(tables, lens, slots, self.pool.generation)

    def check_batch(self, batch: DecodeBatch) -> None:
        """``StaleBlockTable`` unless ``batch`` (or a ``block_tables_array`` result's
        generation) belongs to the pool's current generation: a grow between
        :meth:`prepare_decode` and the kernel call makes every handed-out table stale."""
        self.pool.check_generation(batch.generation)

    def rollback_last_tokens(self, seq_id: Hashable, n: int) -> None:
        """Move the cursor back ``n`` tokens (speculative decoding); blocks stay in the table."""
        row = self._row(seq_id)
        n = _as_count(n, "n")
        have = int(self._num_tokens[row])
        if n > have:
            raise InvalidArgument(f"rollback_last_tokens: n = {n} exceeds the {have} tokens of "
                                  f"seq_id {seq_id!r}")
        self._num_tokens[row] = have - n

    # --- K/V -----------------------------------------------------------------------------

    def _check_layer(self, layer) -> int:
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)) \
                or not 0 <= layer < self._num_layers:
            raise InvalidArgument(
                f"layer = {layer!r} is outside [0, {self._num_layers}) physical layers")
        return int(layer)

    def _token_count(self, name: str, x, n: int | None) -> int:
        """Tokens in ``x`` (``[n, kv_heads, head_dim]``); the pool validates the rest of the
        shape and the dtype before it writes anything."""
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) != 3 or (n is not None and shape[0] != n):
            want = ("n" if n is None else str(n)) + ", " + ", ".join(map(str, self._token_shape))
            raise InvalidArgument(f"{name} has shape {list(shape)}, expected [{want}] "
                                  "(tokens, kv_heads, head_dim)")
        return shape[0]

    def _slots(self, row: int, start: int, stop: int) -> np.ndarray:
        pos = np.arange(start, stop)
        bs = self.block_size
        return self._table[row, pos // bs].astype(np.int64) * bs + pos % bs

    def write_kv(self, seq_id: Hashable, layer: int, k, v, *, start: int | None = None,
                 generation: int | None = None) -> None:
        """Scatter K/V ``[n, kv_heads, head_dim]`` of positions ``[start, start + n)`` into
        the sequence's slots (``start`` defaults to ``num_tokens - n``: call it after
        :meth:`record_tokens`). Bad shape, dtype, layer or positions change nothing; a
        ``generation`` other than the pool's raises ``StaleBlockTable``."""
        row = self._row(seq_id)
        have = int(self._num_tokens[row])
        # Fast path (once per layer per step): the pool's C copy takes exact-kind arrays and
        # checks everything else; only the recorded-positions bound is the adapter's.
        if type(k) is np.ndarray and k.ndim == 3:
            n = k.shape[0]
            first = have - n if start is None else start
            if type(first) is int and 0 <= first and first + n <= have and n and \
                    self.pool.try_write_positions(layer, self._table[row], first, k, v,
                                                  generation=generation):
                return
        layer = self._check_layer(layer)
        n = self._token_count("k", k, None)
        self._token_count("v", v, n)
        first = have - n if start is None else _as_count(start, "start")
        if first < 0 or first + n > have:
            raise InvalidArgument(
                f"write_kv positions [{first}, {first + n}) are outside the {have} recorded "
                f"tokens of seq_id {seq_id!r}: record_tokens first")
        if n:
            self.pool.write_tokens(layer, self._slots(row, first, first + n), k, v,
                                   generation=generation)

    def write_kv_layers(self, seq_id: Hashable, k_layers, v_layers) -> None:
        """All layers at once: ``[num_layers, n, kv_heads, head_dim]`` each, default ``start``."""
        for name, x in (("k_layers", k_layers), ("v_layers", v_layers)):
            if tuple(getattr(x, "shape", ()))[:1] != (self._num_layers,):
                raise InvalidArgument(f"{name} has shape {list(getattr(x, 'shape', ()))}, "
                                      f"expected [{self._num_layers}, n, kv_heads, head_dim]")
        row = self._row(seq_id)
        n = self._token_count("k_layers[0]", k_layers[0], None)
        self._token_count("v_layers[0]", v_layers[0], n)
        have = int(self._num_tokens[row])
        if n > have:
            raise InvalidArgument(f"write_kv_layers: {n} tokens but seq_id {seq_id!r} recorded "
                                  f"only {have}: record_tokens first")
        if n:
            self.pool.write_tokens_layers(self._slots(row, have - n, have), k_layers, v_layers)

    def gather_kv(self, seq_id: Hashable, layer: int, *, generation: int | None = None):
        """Copies of the sequence's K and V, ``[num_tokens, kv_heads, head_dim]``, in order."""
        row = self._row(seq_id)
        n = int(self._num_tokens[row])
        out = self.pool.try_gather(layer, self._table[row], n, generation=generation)
        if out is not None:
            return out
        layer = self._check_layer(layer)
        return self.pool.gather(layer, self._table[row, :self._blocks_for(n)], n,
                                generation=generation)

    def gather_kv_layers(self, seq_id: Hashable, *, generation: int | None = None):
        """All layers at once: ``(k_layers, v_layers)``, ``[num_layers, num_tokens, kv_heads,
        head_dim]`` each, every layer's slice C-contiguous (one gather per array)."""
        row = self._row(seq_id)
        n = int(self._num_tokens[row])
        return self.pool.gather_layers(self._table[row, :self._blocks_for(n)], n,
                                       generation=generation)

    # --- registration, release, turns ----------------------------------------------------

    def _register(self, row: int, call: str, extra_keys, extra_keys_per_block, cache_salt) -> int:
        self._check_latch(row, call)
        if self._registered[row]:
            return 0
        n = int(self._num_tokens[row])
        full = n // self.block_size
        tokens = self._tokens[row, :full * self.block_size]
        block_ids = self._table[row, :full].copy()
        new = self.allocator.cache_full_blocks(
            tokens, block_ids, extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
            cache_salt=cache_salt)
        self._registered[row] = True
        self._counters["registered_blocks"] += new
        if self.cold_tier is not None and not self._captured[row] and full:
            self._captured[row] = True
            # Copies: the cold writer may keep them after this row is reused.
            self._capture_outcome[row] = self._cold_capture(
                tokens.copy(), block_ids, cache_salt, extra_keys, extra_keys_per_block)
        return new

    def register_full_blocks_for_reuse(self, seq_id: Hashable, *, extra_keys: Sequence[int] = (),
                                       extra_keys_per_block=None, cache_salt: int = 0) -> int:
        """Publish the sequence's full blocks in the prefix cache (once per request), then
        offer them to the cold tier. Returns the number of new prefix entries."""
        return self._register(self._row(seq_id), "register_full_blocks_for_reuse", extra_keys,
                              extra_keys_per_block, cache_salt)

    def finalize_turn_keep_live(self, seq_id: Hashable, *, extra_keys: Sequence[int] = (),
                                extra_keys_per_block=None, cache_salt: int = 0) -> int:
        """Register like :meth:`register_full_blocks_for_reuse` but keep the table, tokens and
        partial last block live for :meth:`continue_turn`. Idempotent."""
        row = self._row(seq_id)
        new = self._register(row, "finalize_turn_keep_live", extra_keys, extra_keys_per_block,
                             cache_salt)
        self._finalized[row] = True
        return new

    def release_request(self, seq_id: Hashable) -> int:
        """Decref every table block and forget the sequence; registered blocks stay cached.
        Unknown or already released → 0. Returns the number of blocks released."""
        row = self._row_of.get(seq_id)
        if row is None:
            return 0
        n = int(self._num_blocks[row])
        if n:
            # free_many validates the whole batch first: on InvariantViolation nothing changed.
            self.allocator.free_many(self._table[row, :n])
        self._clear_row(row)
        del self._row_of[seq_id]
        self._seq_of[row] = None
        self._free_rows.append(row)
        self._row_map_version += 1
        return n

    def release_request_and_purge_prefix_cache(self, seq_id: Hashable) -> int:
        """Release, drop the whole prefix cache, and skip the cold restore of the next lookup."""
        n = self.release_request(seq_id)
        self.allocator.purge_prefix_cache()
        self._suppress_cold_restore_once = True
        return n

    def is_live_for_continue(self, seq_id: Hashable) -> bool:
        row = self._row_of.get(seq_id)
        return row is not None and bool(self._finalized[row])

    def continue_turn(self, seq_id: Hashable, prompt, total_tokens: int) -> tuple[int, int]:
        """Next turn on a finalized live table: ``prompt`` must extend the live tokens.

        Returns ``(prior_len, newly_allocated)``; record ``prompt[prior_len:]`` next.
        """
        row = self._row(seq_id)
        if not self._finalized[row]:
            raise PagedKVError(f"continue_turn: seq_id {seq_id!r} was not finalized; call "
                               "finalize_turn_keep_live at the end of the previous turn")
        toks = _as_tokens(prompt, "prompt")
        prior = int(self._num_tokens[row])
        live = self._tokens[row, :prior]
        if len(toks) < prior or not np.array_equal(toks[:prior], live):
            same = np.flatnonzero(toks[:prior] != live[:len(toks)])
            at = int(same[0]) if len(same) else min(prior, len(toks))
            raise PagedKVError(f"continue_turn: prompt diverges from the live tokens of seq_id "
                               f"{seq_id!r} at position {at}: start a fresh request")
        total = _as_count(total_tokens, "total_tokens")
        self._check_capacity(total, "paged cache could not reserve")
        needed = self._blocks_for(total) - int(self._num_blocks[row])
        if needed > 0:
            self._append_blocks(row, self._reserve(needed, total, "paged cache could not reserve"))
        self._registered[row] = False
        self._finalized[row] = False
        self._captured[row] = False
        self._aux_unbacked[row] = False
        self._sidecar[row] = None
        return prior, max(needed, 0)

    def prepare_turn(self, seq_id: Hashable, prompt, *, total_tokens: int, reuse_live: bool = True,
                     extra_keys: Sequence[int] = (), extra_keys_per_block=None,
                     cache_salt: int = 0, skip_lookup: bool = False,
                     max_cached_tokens: int | None = None) -> TurnPlan:
        """Continue the live table when the prompt extends it, else reset + lookup + allocate.

        Continues (``CONTINUED_LIVE_PREFIX``) when ``reuse_live``, the table is finalized, the
        prompt starts with its tokens and it holds at most ``max_cached_tokens`` (default
        ``len(prompt) - 1``: the last prompt token is always recomputed). Otherwise, or when
        the continuation runs out of blocks (``CONTINUE_FAILED_RESET``), the sequence is
        released and starts fresh (``FRESH_RESET``). Any error releases the sequence, so no
        prefix reference leaks.
        """
        toks = _as_tokens(prompt, "prompt")
        limit = len(toks) - 1 if max_cached_tokens is None else max_cached_tokens
        reason = TurnPlanReason.FRESH_RESET
        row = self._row_of.get(seq_id)
        if reuse_live and row is not None and self._finalized[row]:
            prior = int(self._num_tokens[row])
            if prior <= limit and prior <= len(toks) and np.array_equal(
                    toks[:prior], self._tokens[row, :prior]):
                try:
                    _, new = self.continue_turn(seq_id, toks, total_tokens)
                    return TurnPlan(TurnPlanReason.CONTINUED_LIVE_PREFIX, prior, new)
                except ContextLengthExceeded:
                    reason = TurnPlanReason.CONTINUE_FAILED_RESET
        try:
            self.reset_for_new_request(seq_id)
            hit = self.find_cached_prefix(
                seq_id, toks, extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
                cache_salt=cache_salt, skip_lookup=skip_lookup, max_tokens=max(limit, 0))
            new = self.allocate_suffix_blocks(seq_id, total_tokens)
        except BaseException:
            self.release_request(seq_id)
            raise
        return TurnPlan(reason, hit.cached_tokens, new)

    def restart_prepared_turn_cold(self, seq_id: Hashable, prompt, total_tokens: int) -> int:
        """Discard a prepared hit: release, reset, forced miss, allocate. Returns new blocks.
        Throwing away a hit that the cold tier restored counts ``restore_suppressed``."""
        if self._restored[self._row(seq_id)] > 0:  # only with a cold tier, so it is loaded
            from pagedkv.cold.stats import sidecar_counters
            sidecar_counters().add("restore_suppressed")
        self.reset_for_new_request(seq_id)
        try:
            self.find_cached_prefix(seq_id, prompt, skip_lookup=True)
            return self.allocate_suffix_blocks(seq_id, total_tokens)
        except BaseException:
            self.release_request(seq_id)
            raise

    # --- aux latch -----------------------------------------------------------------------

    def confirm_aux_prefix_primed(self, seq_id: Hashable, n: int) -> None:
        """The family installed its out-of-pool state at ``n == cached_token_count``."""
        row = self._row(seq_id)
        if not self._aux_unbacked[row]:
            return
        cached = int(self._cached[row])
        if n != cached:
            raise InvalidArgument(f"confirm_aux_prefix_primed: n = {n}, but seq_id {seq_id!r} "
                                  f"resumed {cached} cached tokens; prime the state at {cached}")
        self._aux_unbacked[row] = False

    def aux_prefix_unbacked(self, seq_id: Hashable) -> bool:
        return bool(self._aux_unbacked[self._row(seq_id)])

    def cold_capture_outcome(self, seq_id: Hashable):
        """What the cold tier's ``capture`` returned for this request's registration (``None``
        before it ran, without a cold tier, or when it failed)."""
        return self._capture_outcome[self._row(seq_id)]

    def take_restored_sidecar(self, seq_id: Hashable):
        """Move the restored sidecar out (valid for exactly ``cached_token_count`` tokens)."""
        row = self._row(seq_id)
        sidecar, self._sidecar[row] = self._sidecar[row], None
        return sidecar

    # --- cold-tier hooks -----------------------------------------------------------------

    def _per_block_keys(self, extra_keys, extra_keys_per_block, blocks: int):
        if extra_keys_per_block is not None:
            return list(extra_keys_per_block)
        keys = tuple(extra_keys)
        return [keys] * blocks if keys else None

    def _cold_restore(self, tokens, hot, cache_salt, extra_keys, extra_keys_per_block):
        try:
            extra = self.cold_tier.restore(
                tokens=tokens, hot_blocks=hot, cache_salt=cache_salt,
                extra_keys_per_block=self._per_block_keys(
                    extra_keys, extra_keys_per_block, len(tokens) // self.block_size),
                pool=self.pool, allocator=self.allocator)
            extra = np.asarray(extra, np.int32).reshape(-1)
        except Exception:
            self._counters["cold_restore_errors"] += 1
            log.exception("cold tier restore failed; continuing with the hot hit only")
            return _EMPTY_IDS
        if (len(hot) + len(extra)) * self.block_size > len(tokens):
            self._counters["cold_restore_errors"] += 1
            log.error("cold tier restore returned %d blocks past a %d-block hot hit of a "
                      "%d-token lookup; refused", len(extra), len(hot), len(tokens))
            try:
                # The caller owns one reference on each returned block: give them back.
                self.allocator.free_many(extra)
            except Exception:
                log.exception("cold tier restore: could not release the refused blocks")
            return _EMPTY_IDS
        return extra

    def _cold_capture(self, tokens, block_ids, cache_salt, extra_keys, extra_keys_per_block):
        try:
            per_block = self._per_block_keys(extra_keys, extra_keys_per_block, len(block_ids))
            hashes = self.allocator.chain_hashes(
                tokens, extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
                cache_salt=cache_salt)
            return self.cold_tier.capture(
                tokens=tokens, block_ids=block_ids, hashes=hashes, cache_salt=cache_salt,
                extra_keys_per_block=per_block, pool=self.pool, allocator=self.allocator)
        except Exception:
            self._counters["cold_capture_errors"] += 1
            log.exception("cold tier capture failed; the hot cache is unaffected")
            return None

    # --- read-only views -----------------------------------------------------------------

    def live_seq_ids(self) -> list[Hashable]:
        return list(self._row_of)

    def num_tokens(self, seq_id: Hashable) -> int:
        return int(self._num_tokens[self._row(seq_id)])

    def num_table_blocks(self, seq_id: Hashable) -> int:
        return int(self._num_blocks[self._row(seq_id)])

    def cached_token_count(self, seq_id: Hashable) -> int:
        return int(self._cached[self._row(seq_id)])

    def physical_revision(self, seq_id: Hashable) -> int:
        return int(self._revision[self._row(seq_id)])

    def request_tokens(self, seq_id: Hashable) -> np.ndarray:
        row = self._row(seq_id)
        return self._tokens[row, :self._num_tokens[row]].copy()

    def block_table(self, seq_id: Hashable) -> np.ndarray:
        """A copy of the row's used entries (int32)."""
        row = self._row(seq_id)
        return self._table[row, :self._num_blocks[row]].copy()

    def block_tables_array(self, seq_ids: Sequence[Hashable], width: int | None = None
                           ) -> tuple[np.ndarray, int]:
        """``int32[len(seq_ids), width]`` tables padded with -1, and the pool generation."""
        rows = self._rows(seq_ids)
        need = int(self._num_blocks[rows].max(initial=0))
        width = need if width is None else _as_count(width, "width")
        if width < need:
            raise InvalidArgument(f"width = {width} is narrower than the widest table ({need})")
        out = np.full((len(rows), width), -1, np.int32)
        w = min(width, self._table.shape[1])
        out[:, :w] = self._table[rows, :w]
        return out, self.pool.generation

    def stats(self) -> dict[str, int]:
        """Counters since construction (lookups, hits, allocations, growth, hook failures)."""
        return dict(self._counters, live_sequences=len(self._row_of))

