"""``GroupBlocks``: one KV-cache group's blocks: an allocator, a pool and one int32
block-table row per sequence (docs/adapter.md, "Block tables and decode batches").

This is the part of the request lifecycle that differs per group kind: how many blocks a
token count needs, reserving them (with the grow policy), undoing a reservation, what a
prefix hit looks like, what is published, and the decode batch. Full attention is this
class; sliding-window attention is
:class:`pagedkv.coordinator.sliding.SlidingGroupBlocks`. The lifecycle
(:class:`~pagedkv.adapter.lifecycle.RequestLifecycle`) keeps one cursor per row for all of
its groups and calls these with the row's index.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedkv.adapter import table_ops
from pagedkv.adapter.results import DecodeBatch
from pagedkv.errors import CapacityExceeded, InvalidArgument, InvariantViolation, PoolExhausted
from pagedkv.sizing import ReservationGrowth

__all__ = ["FullHit", "GroupBlocks", "HitProposal"]

_EMPTY_IDS = np.empty(0, np.int32)
_EMPTY_IDS.setflags(write=False)


class HitProposal:
    """What one group can back of a prompt prefix, before the lifecycle settles on a
    length every group backs (docs/coordinator.md, "Hybrid hot prefix reuse").

    ``ceiling_tokens``: the group backs no boundary above this. ``valid(t)``: whether it backs
    exactly ``t`` tokens (a boundary of its blocks). ``take(t)`` hands over the table entries
    for ``[0, t)`` with one reference on each real block; ``drop()`` gives back whatever the
    proposal holds. Exactly one of ``take`` / ``drop`` is called."""

    ceiling_tokens: int = 0

    def valid(self, tokens: int) -> bool:
        raise NotImplementedError

    def take(self, tokens: int) -> np.ndarray:
        raise NotImplementedError

    def drop(self) -> None:
        raise NotImplementedError


class FullHit(HitProposal):
    """A full-attention group's hit: the longest verified cached prefix, its blocks already
    incref'd by ``find_longest_cache_hit``; a shorter take gives the tail back."""

    __slots__ = ("_allocator", "_bs", "_ids", "ceiling_tokens")

    def __init__(self, allocator, ids: np.ndarray) -> None:
        self._allocator = allocator
        self._bs = allocator.block_size
        self._ids = ids
        self.ceiling_tokens = len(ids) * self._bs

    def valid(self, tokens: int) -> bool:
        return tokens <= self.ceiling_tokens and tokens % self._bs == 0

    def take(self, tokens: int) -> np.ndarray:
        keep = tokens // self._bs
        if keep < len(self._ids):
            self._allocator.free_many(self._ids[keep:])
        return self._ids[:keep]

    def drop(self) -> None:
        if len(self._ids):
            self._allocator.free_many(self._ids)


class GroupBlocks:
    """Block tables of one full-attention group.

    ``allocator`` and ``pool`` must agree on ``block_size``, ``num_blocks`` and
    ``max_num_blocks`` (else ``InvalidArgument``). ``growth`` enables grow-on-demand
    (docs/adapter.md, "Growth"); ``counters`` is the lifecycle's counter dict
    (``grow_events``, ``blocks_allocated`` are bumped here).
    """

    #: Attention kind of the group, for reprs and checks.
    kind_name = "full"
    #: Per-row 1-D arrays (grown with the rows, zeroed by clear_row).
    _row_arrays: tuple[str, ...] = ("num_blocks", "revision", "reserved")

    def __init__(self, allocator, pool, *, growth: bool = True, rows: int = 8,
                 counters: dict[str, int] | None = None) -> None:
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
        self.growth = bool(growth)
        self.block_size = bs
        self.num_layers = pool.geometry.num_layers
        self.token_shape = (pool.geometry.num_kv_heads, pool.geometry.head_dim)
        rows = max(1, int(rows))
        self.table = np.full((rows, 4), -1, np.int32)
        self.num_blocks = np.zeros(rows, np.int32)
        self.revision = np.zeros(rows, np.int64)
        self.reserved = np.zeros(rows, np.int32)  # admission reservation, blocks
        self.counters = counters if counters is not None else {
            "grow_events": 0, "blocks_allocated": 0}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(block_size={self.block_size}, "
                f"layers={self.num_layers}, pool_blocks={self.pool.num_blocks}/"
                f"{self.pool.max_num_blocks}, free_or_evictable="
                f"{self.allocator.free_or_evictable_blocks}, growth={self.growth})")

    # --- row storage ----------------------------------------------------------------------

    def grow_rows(self, rows: int) -> None:
        old = self.table.shape[0]
        table = np.full((rows, self.table.shape[1]), -1, np.int32)
        table[:old] = self.table
        self.table = table
        for name in self._row_arrays:
            a = getattr(self, name)
            out = np.zeros(rows, a.dtype)
            out[:old] = a
            setattr(self, name, out)

    def ensure_width(self, blocks: int) -> None:
        width = self.table.shape[1]
        if blocks <= width:
            return
        table = np.full((self.table.shape[0], max(2 * width, blocks)), -1, np.int32)
        table[:, :width] = self.table
        self.table = table

    def clear_row(self, row: int) -> None:
        self.table[row] = -1
        self.num_blocks[row] = 0
        self.reserved[row] = 0
        self.revision[row] += 1

    # --- sizes ----------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence can hold in this group: ``max_num_blocks * bs``.
        A sliding group has no limit in tokens (its limit is the blocks it holds at once):
        ``sys.maxsize``; :attr:`limits_tokens` says which kind of limit applies."""
        return self.allocator.max_num_blocks * self.block_size

    #: Whether :attr:`capacity_tokens` bounds a row (checked once per decode step).
    limits_tokens = True

    def usable_blocks(self) -> int:
        """Blocks of the pool now that rows can hold (the null block excluded)."""
        return self.allocator.num_blocks - (self.allocator.null_block_id is not None)

    def usable_max_blocks(self) -> int:
        """Blocks the pool can ever give rows (at its max, the null block excluded)."""
        return self.allocator.max_num_blocks - (self.allocator.null_block_id is not None)

    def cap_reservation(self, blocks: int) -> int:
        """A turn's reservation in this group (full attention keeps every block)."""
        return blocks

    def unallocated_reserved(self, live_rows: np.ndarray) -> int:
        """Blocks the live rows reserved at admission and do not hold yet."""
        held = np.fromiter((self.live_blocks(int(r)) for r in live_rows), np.int64,
                           len(live_rows))
        return int(np.maximum(self.reserved[live_rows] - held, 0).sum())

    def grow_once(self, needed: int) -> bool:
        """One growth toward ``needed`` more blocks (growable pools); whether it grew."""
        return self.growth and self._grow_before(self._growth(), needed, 0) > 0

    def _growth(self) -> ReservationGrowth:
        return ReservationGrowth(self.pool, self.allocator.grow_by)

    def _grow_before(self, growth: ReservationGrowth, needed: int, free: int) -> int:
        """``growth``'s one grow before an allocation of ``needed`` blocks, counted."""
        grown = growth.before_allocation(needed, free)
        if grown:
            self.counters["grow_events"] += 1
        return grown

    def backs(self, row: int, tokens: int) -> bool:
        """Whether the row's table holds the K/V a continuation at ``tokens`` reads."""
        return int(self.num_blocks[row]) * self.block_size >= tokens

    def shared_block(self, row: int, first: int, n: int) -> int:
        """The table index of the first block holding positions ``[first, first + n)`` (within
        the row's blocks) that the row does not own alone, or -1: one of a prefix hit other
        requests hold too, or one it published to the prefix cache (either way refcount > 1).
        A write there would change K/V that other requests read, or that the table serves
        under the old tokens' hash. A decode write spans one block: one lookup."""
        ref_count, item, bs = self.allocator.ref_count, self.table.item, self.block_size
        i, last = first // bs, (first + n - 1) // bs
        if i == last:  # the decode hot path: no loop
            return i if ref_count(item(row, i)) > 1 else -1
        return next((j for j in range(i, last + 1) if ref_count(item(row, j)) > 1), -1)

    def check_rollback(self, row: int, new_total: int, seq_id) -> None:
        """``InvalidArgument`` when resuming at ``new_total`` tokens would rewrite a block
        the row does not own alone (:meth:`shared_block`)."""
        bs = self.block_size
        i = self.shared_block(row, new_total, int(self.num_blocks[row]) * bs - new_total)
        if i >= 0:
            b = self.table.item(row, i)
            raise InvalidArgument(
                f"rollback_last_tokens: seq_id {seq_id!r} would resume at {new_total} "
                f"tokens, inside block {b} (table index {i}), which other requests or the "
                f"prefix cache also hold (refcount {self.allocator.ref_count(b)}): the next "
                f"write would change their K/V. Roll back only tokens past the last shared or "
                f"registered block ({i * bs + bs} tokens here at least), or start a fresh "
                f"request")

    def check_write(self, row: int, first: int, n: int, seq_id, what: str) -> None:
        """``InvalidArgument`` when a write of positions ``[first, first + n)`` would land in
        a block the row does not own alone (:meth:`shared_block`; rollback's reason)."""
        i = self.shared_block(row, first, n) if n else -1
        if i >= 0:
            b, bs = self.table.item(row, i), self.block_size
            raise InvalidArgument(
                f"{what} positions [{first}, {first + n}) of seq_id {seq_id!r} reach block {b} "
                f"(table index {i}, positions [{i * bs}, {i * bs + bs})), which other requests "
                f"or the prefix cache also hold (refcount {self.allocator.ref_count(b)}): the "
                f"write would change their K/V. Write only the positions past the prefix hit "
                f"and the registered blocks ({i * bs + bs} and on here)")

    def publishes(self, hot_reuse: bool) -> bool:
        """Whether registration publishes this group's blocks (full groups always do)."""
        return True

    def first_live_position(self, row: int) -> int:
        """The first position whose K/V the row still holds (0: full attention keeps all)."""
        return 0

    def live_blocks(self, row: int) -> int:
        """Real (not null) blocks the row holds."""
        return int(self.num_blocks[row])

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def blocks_needed(self, row: int, new_total: int) -> int:
        """New blocks the row needs so its table backs ``new_total`` tokens."""
        return max(0, self.blocks_for(new_total) - int(self.num_blocks[row]))

    def check_capacity(self, row: int, new_total: int, phrase: str) -> None:
        """``CapacityExceeded`` when ``new_total`` tokens can never fit this group."""
        if new_total > self.capacity_tokens:
            raise CapacityExceeded(
                f"{phrase}: requested {new_total} tokens, paged cache capacity is "
                f"{self.capacity_tokens} tokens ({self.allocator.max_num_blocks} blocks of "
                f"{self.block_size})")

    def available_blocks(self) -> int:
        """Blocks a reservation can get now: free or evictable, plus what growth may add."""
        room = self.pool.max_num_blocks - self.pool.num_blocks if self.growth else 0
        return self.allocator.free_or_evictable_blocks + room

    # --- reservations ---------------------------------------------------------------------

    def reserve(self, needed: int, total_tokens: int, phrase: str) -> np.ndarray:
        """``needed`` new block ids, all or nothing: one grow before, one grow + retry after a
        dry allocation (``pagedkv.sizing.ReservationGrowth``). ``allocate_many`` takes nothing
        when it fails, so a failed reservation leaves the allocator as it was (a growth that
        happened stays: the pool is only bigger)."""
        allocator = self.allocator
        if not self.growth:
            blocks = allocator.allocate_many(needed)
        else:
            growth = self._growth()
            self._grow_before(growth, needed, allocator.free_or_evictable_blocks)
            blocks = allocator.allocate_many(needed)
            if blocks is None and growth.for_retry(needed - allocator.free_or_evictable_blocks):
                self.counters["grow_events"] += 1
                blocks = allocator.allocate_many(needed)
        if blocks is None:
            self.raise_exhausted(needed, total_tokens, phrase)
        self.counters["blocks_allocated"] += needed
        return blocks

    def raise_exhausted(self, needed: int, total_tokens: int, phrase: str) -> None:
        allocator = self.allocator
        raise PoolExhausted(
            f"{phrase}: {needed} more blocks needed for {total_tokens} tokens, "
            f"{allocator.free_or_evictable_blocks} free or evictable of "
            f"{allocator.num_blocks} (max {allocator.max_num_blocks}); preempt a request "
            "or raise the pool's memory_mb")

    def preflight(self, needed: int, total_tokens: int, phrase: str) -> None:
        """``PoolExhausted`` now, before any group reserves, when ``needed`` blocks cannot
        come from free, evictable or growth blocks: a failure then changes nothing (not
        even the free-list order). A growable pool that needs to grow grows here (the
        reservation's one grow before allocating), so a growth the pool refuses (a memory
        budget) fails before any group has allocated, i.e. before an earlier group evicted
        a cached block for its share; a growth that happened stays."""
        if needed > self.available_blocks():
            self.raise_exhausted(needed, total_tokens, phrase)
        free = self.allocator.free_or_evictable_blocks
        if self.growth and needed > free:
            self._grow_before(self._growth(), needed, free)
            if needed > self.allocator.free_or_evictable_blocks:
                self.raise_exhausted(needed, total_tokens, phrase)

    def append(self, row: int, blocks: np.ndarray) -> None:
        n = int(self.num_blocks[row])
        self.ensure_width(n + len(blocks))
        self.table[row, n:n + len(blocks)] = blocks
        self.num_blocks[row] = n + len(blocks)
        self.revision[row] += 1

    def extend(self, row: int, new_total: int, phrase: str) -> int:
        """Reserve and append what ``new_total`` tokens need (capacity checked first).
        Returns the blocks appended; on error nothing changed."""
        self.check_capacity(row, new_total, phrase)
        needed = self.blocks_needed(row, new_total)
        if needed:
            self.append(row, self.reserve(needed, new_total, phrase))
        return needed

    def truncate(self, row: int, num_blocks: int, revision: int | None = None) -> None:
        """Undo appends: free the entries past ``num_blocks`` (newest first) and drop them.
        ``revision``: the row's revision before the appends, restored (the table is as it
        was, so kernels' cached copies are still valid); else the revision moves on."""
        n = int(self.num_blocks[row])
        if n <= num_blocks:
            return
        ids = self.table[row, num_blocks:n][::-1].copy()
        self.allocator.free_many(ids)
        self.table[row, num_blocks:n] = -1
        self.num_blocks[row] = num_blocks
        if revision is None:
            self.revision[row] += 1
        else:
            self.revision[row] = revision

    def decode_crossing(self, rows: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, int]:
        """The rows whose ``ends`` cross a block boundary (one new block each) and the table
        width that needs; nothing changes."""
        return table_ops.crossing_rows(self.num_blocks, rows, ends, self.block_size)

    def extend_decode(self, crossing: np.ndarray, width: int, top: int, phrase: str
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Give each crossing row one block from one ``allocate_many`` (``top``: the largest
        token count, for messages). Returns ``(rows, ids)`` for :meth:`undo_decode`."""
        blocks = self.reserve(len(crossing), top, phrase)
        if width > self.table.shape[1]:
            self.ensure_width(width)
        table_ops.append_blocks(self.table, self.num_blocks, self.revision, crossing, blocks)
        return crossing, blocks

    def undo_decode(self, appended: tuple[np.ndarray, np.ndarray]) -> None:
        """Give back what :meth:`extend_decode` appended; the rows' tables and revisions are
        as they were before it."""
        crossing, blocks = appended
        slots = self.num_blocks[crossing] - 1
        self.table[crossing, slots] = -1
        self.num_blocks[crossing] = slots
        self.revision[crossing] -= 1
        self.allocator.free_many(blocks)

    def release_row(self, row: int) -> int:
        """Decref every real block of the row and clear it; returns the blocks released.
        ``free_many`` validates the whole batch first: on ``InvariantViolation`` nothing
        changed."""
        first = int(self.num_blocks[row]) - self.live_blocks(row)
        n = int(self.num_blocks[row])
        if n > first:
            self.allocator.free_many(self.table[row, first:n])
        self.clear_row(row)
        return n - first

    # --- prefix reuse ---------------------------------------------------------------------

    def propose_hit(self, tokens: np.ndarray, extra_keys: Sequence[int],
                    extra_keys_per_block, cache_salt: int) -> HitProposal:
        hot, _ = self.allocator.find_longest_cache_hit(
            tokens, extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
            cache_salt=cache_salt)
        return FullHit(self.allocator, np.asarray(hot, np.int32))

    def drop_entries(self, entries: np.ndarray) -> None:
        """Give back the references a taken hit holds (the lookup failed after the take)."""
        real = entries[entries >= 0]
        if self.allocator.null_block_id is not None:
            real = real[real != self.allocator.null_block_id]
        if len(real):
            self.allocator.free_many(real)

    def install(self, row: int, entries: np.ndarray) -> None:
        """Put a lookup's entries (already referenced) at the start of an empty row."""
        if len(entries):
            self.ensure_width(len(entries))
            self.table[row, :len(entries)] = entries
            self.num_blocks[row] = len(entries)
            self.revision[row] += 1

    def install_restored(self, row: int, entries: np.ndarray, tokens: int) -> None:
        """:meth:`install` for entries a cold restore rebuilt at ``tokens``: the same here,
        every restored block is whole (a sliding group's first one may not be)."""
        self.install(row, entries)

    def register(self, row: int, tokens: np.ndarray, num_tokens: int, extra_keys,
                 extra_keys_per_block, cache_salt: int) -> int:
        """Publish the row's full blocks in the prefix cache; returns new entries."""
        full = num_tokens // self.block_size
        return self.allocator.cache_full_blocks(
            tokens[:full * self.block_size], self.table[row, :full].copy(),
            extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
            cache_salt=cache_salt)

    # --- decode ---------------------------------------------------------------------------

    def decode_batch(self, rows: np.ndarray, lens: np.ndarray) -> DecodeBatch:
        tables, slots = table_ops.decode_batch(self.table, self.num_blocks, rows, lens,
                                               self.block_size)
        return DecodeBatch(tables, lens, slots, self.pool.generation, self.pool.instance_id)

    def slots(self, row: int, start: int, stop: int) -> np.ndarray:
        pos = np.arange(start, stop)
        bs = self.block_size
        return self.table[row, pos // bs].astype(np.int64) * bs + pos % bs

    # --- checks ---------------------------------------------------------------------------

    def check_invariants(self, live_rows: Sequence[int]) -> None:
        """The allocator's invariants, then the tables': entries past ``num_blocks`` are -1,
        every held entry is an allocated block, and no block is held by more table entries
        than it has references."""
        self.allocator.check_invariants()
        held = []
        for row in live_rows:
            n = int(self.num_blocks[row])
            if (self.table[row, n:] != -1).any():
                raise InvariantViolation(f"{self.kind_name} group: row {row} has entries past "
                                         f"its {n} blocks")
            first = n - self.live_blocks(row)
            self._check_row_prefix(row, first)
            held.append(self.table[row, first:n])
        ids = np.concatenate(held) if held else _EMPTY_IDS
        if len(ids):
            counts = np.bincount(ids, minlength=self.allocator.num_blocks)
            for b in np.flatnonzero(counts):
                if self.allocator.ref_count(int(b)) < counts[b]:
                    raise InvariantViolation(
                        f"{self.kind_name} group: block {b} is in {counts[b]} table entries "
                        f"but has {self.allocator.ref_count(int(b))} references")

    def _check_row_prefix(self, row: int, first: int) -> None:
        if first:
            raise InvariantViolation(f"row {row} of a full group has {first} null entries")
