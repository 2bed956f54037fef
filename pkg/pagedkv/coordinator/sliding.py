"""``SlidingGroupBlocks``: the blocks of a sliding-window attention group
(docs/coordinator.md, "Sliding null sentinel" and "Hybrid hot prefix reuse").

Tables keep their absolute logical width: entry ``i`` always stands for tokens
``[i*bs, (i+1)*bs)``, so positions are never renumbered. When no token of a block can be
attended any more, its physical block goes back to the allocator and the entry points at the
group's shared null block (the allocator's reserved block). Expired entries are always a
prefix of the row, so one int per row (``null_upto``) says where the live blocks start and a
prune costs O(blocks freed), never O(table width).

Blocks a row drops are first published in the group's prefix cache (under the request's
lookup salt and extra keys), so later requests sharing the prefix find a window's blocks;
the blocks still held are published at registration.

A cold restore may rebuild a first live block only from some row on (docs/cold.md, "Grouped
restore"): such a block is published with its first written position recorded, and a hit
takes it only at boundaries whose window rows all lie at or after that position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedkv.adapter import table_ops
from pagedkv.adapter.group_blocks import GroupBlocks, HitProposal
from pagedkv.adapter.sequence_rows import SequenceRows
from pagedkv.argument_checks import is_int
from pagedkv.errors import CapacityExceeded, InvalidArgument, InvariantViolation

__all__ = ["SlidingGroupBlocks", "SlidingHit", "expired_blocks"]


def expired_blocks(committed_tokens: int, window: int, block_size: int) -> int:
    """Leading blocks no query can attend once ``committed_tokens`` are committed:
    ``max(0, n - window + 1) // bs`` (the next query, at position ``n``, attends
    ``[n - window + 1, n]``). Window 4, bs 2: n = 4 → 0, 5 → 1, 7 → 2, 11 → 4."""
    return max(0, committed_tokens - window + 1) // block_size


class SlidingHit(HitProposal):
    """What a sliding group backs of a prompt: boundary ``t`` is valid when every block of
    its last window, ``[expired_blocks(t), t / bs)``, is cached and verifies (the earlier
    entries become null). A pure probe until :meth:`take`, which increfs the window."""

    __slots__ = ("_group", "_ids", "_partial", "_run", "ceiling_tokens")

    def __init__(self, group: SlidingGroupBlocks, ids: np.ndarray) -> None:
        self._group = group
        self._ids = ids
        index = np.arange(len(ids))
        # _run[i]: cached blocks in a row ending at block i.
        last_hole = np.maximum.accumulate(np.where(ids < 0, index, -1)) if len(ids) else index
        self._run = index - last_hole
        self.ceiling_tokens = len(ids) * group.block_size
        # {block index: first written position} of the partly restored blocks among ids.
        self._partial = group.partial_blocks(ids)

    def _window(self, tokens: int) -> tuple[int, int]:
        g = self._group
        return expired_blocks(tokens, g.window, g.block_size), tokens // g.block_size

    def valid(self, tokens: int) -> bool:
        bs = self._group.block_size
        if tokens % bs or tokens > self.ceiling_tokens:
            return False
        cut, end = self._window(tokens)
        if end == cut:
            return True
        if int(self._run[end - 1]) < end - cut:
            return False
        # A partly restored block serves only windows inside its written rows: those of
        # boundary t, [t - min(t, window), t), as a restore at t writes them.
        first_row = tokens - min(tokens, self._group.window)
        return all(written <= first_row for i, written in self._partial.items()
                   if cut <= i < end)

    def take(self, tokens: int) -> np.ndarray:
        cut, end = self._window(tokens)
        entries = np.full(end, self._group.null_block_id, np.int32)
        entries[cut:] = self._ids[cut:end]
        if end > cut:
            self._group.allocator.incref_many(entries[cut:])
        return entries

    def drop(self) -> None:
        """A probe holds no reference."""


class SlidingGroupBlocks(GroupBlocks):
    """Block tables of one sliding-window group (window in tokens).

    The allocator must reserve a null block (``BlockAllocator(..., reserve_null_block=True)``;
    else ``InvalidArgument``). ``max_admission_blocks`` (from the group spec) caps a turn's
    admission reservation: a row never holds more blocks of this group at once.
    """

    kind_name = "sliding"
    limits_tokens = False
    _row_arrays = (*GroupBlocks._row_arrays, "null_upto", "parent_hash", "parent_known",
                   "written_from")

    def __init__(self, allocator, pool, window: int, *, growth: bool = False, rows: int = 8,
                 counters: dict[str, int] | None = None,
                 max_admission_blocks: int | None = None) -> None:
        super().__init__(allocator, pool, growth=growth, rows=rows, counters=counters)
        if allocator.null_block_id is None:
            raise InvalidArgument(
                "a sliding group's allocator must reserve the null block: build it with "
                "BlockAllocator(..., reserve_null_block=True)")
        if not is_int(window) or window < 1:
            raise InvalidArgument(f"window = {window!r} must be an int >= 1 (tokens)")
        self.window = int(window)
        self.null_block_id = int(allocator.null_block_id)
        self.max_admission_blocks = max_admission_blocks
        rows = self.table.shape[0]
        self.null_upto = np.zeros(rows, np.int32)      # leading null entries
        self.parent_hash = np.zeros(rows, np.uint64)   # hash of block null_upto - 1 ...
        self.parent_known = np.zeros(rows, np.bool_)   # ... once computed (publication)
        # The first position a cold restore wrote (its window rows), or a hit on a block
        # it rebuilt took: the rows of the first live block before it hold whatever the
        # block held before (0 otherwise).
        self.written_from = np.zeros(rows, np.int64)
        # {block id: (hot hash, first written position)} of published blocks a restore
        # rebuilt only from some row on; an entry counts while the block is cached under
        # that hash (a block later reused holds another hash, or the same tokens in full:
        # then the entry only narrows its hits).
        self._partial: dict[int, tuple[int, int]] = {}
        self._zeros = np.zeros(0, np.uint8)

    def __repr__(self) -> str:
        return (f"SlidingGroupBlocks(window={self.window}, block_size={self.block_size}, "
                f"layers={self.num_layers}, pool_blocks={self.pool.num_blocks}, "
                f"null_block={self.null_block_id}, free_or_evictable="
                f"{self.allocator.free_or_evictable_blocks})")

    # --- row storage ----------------------------------------------------------------------

    def clear_row(self, row: int) -> None:
        super().clear_row(row)
        self.null_upto[row] = 0
        self.parent_hash[row] = 0
        self.parent_known[row] = False
        self.written_from[row] = 0

    # --- sizes ----------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return np.iinfo(np.int64).max

    def first_live_position(self, row: int) -> int:
        """The first position whose K/V the row holds: the start of its first live block,
        or, after a cold restore (:meth:`install_restored`), the first window row the
        restore wrote when that is later (the block's earlier rows were never written)."""
        return max(int(self.null_upto[row]) * self.block_size, int(self.written_from[row]))

    def live_blocks(self, row: int) -> int:
        return int(self.num_blocks[row]) - int(self.null_upto[row])

    def check_capacity(self, row: int, new_total: int, phrase: str) -> None:
        """``CapacityExceeded`` when the row would hold more blocks at once than the max pool
        gives rows (expired blocks cost nothing; prune before extending)."""
        live = self.live_blocks(row) + self.blocks_needed(row, new_total)
        usable = self.usable_max_blocks()
        if live > usable:
            raise CapacityExceeded(
                f"{phrase}: {new_total} tokens need {live} live blocks in the sliding group "
                f"(window {self.window}, block size {self.block_size}) but its max pool "
                f"holds {usable}; prefill in chunks and prune_sliding between them")

    def cap_reservation(self, blocks: int) -> int:
        if self.max_admission_blocks is None:
            return blocks
        return min(blocks, self.max_admission_blocks)

    def backs(self, row: int, tokens: int) -> bool:
        return (super().backs(row, tokens) and int(self.null_upto[row])
                <= expired_blocks(tokens, self.window, self.block_size))

    def check_rollback(self, row: int, new_total: int, seq_id) -> None:
        if int(self.null_upto[row]) > expired_blocks(new_total, self.window, self.block_size):
            raise InvalidArgument(
                f"rollback_last_tokens: seq_id {seq_id!r} would resume at {new_total} tokens "
                f"but its sliding group (window {self.window}) already dropped positions "
                f"before {self.first_live_position(row)}: a rollback cannot pass the "
                "committed frontier it was pruned at")
        super().check_rollback(row, new_total, seq_id)

    def publishes(self, hot_reuse: bool) -> bool:
        return hot_reuse

    # --- prefix reuse ---------------------------------------------------------------------

    def propose_hit(self, tokens: np.ndarray, extra_keys: Sequence[int],
                    extra_keys_per_block, cache_salt: int) -> HitProposal:
        ids = self.allocator.cached_block_ids(
            tokens, extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
            cache_salt=cache_salt)
        return SlidingHit(self, np.asarray(ids, np.int32))

    def partial_blocks(self, ids: np.ndarray) -> dict[int, int]:
        """``{index: first written position}`` of the entries of ``ids`` (blocks a lookup
        found cached) that a restore rebuilt only from some row on. An entry recorded for
        a block now cached under another hash is stale (the block was reused) and dropped;
        a publication of a partly written block always records it again first."""
        if not self._partial:
            return {}
        hashes = self.allocator.block_records["hot_hash"]
        out = {}
        for i in np.flatnonzero(np.isin(ids, np.fromiter(self._partial, np.int64))):
            block = int(ids[i])
            block_hash, written = self._partial[block]
            if int(hashes[block]) == block_hash:
                out[int(i)] = written
            else:
                del self._partial[block]
        return out

    def install(self, row: int, entries: np.ndarray) -> None:
        super().install(row, entries)
        first = int(np.count_nonzero(entries == self.null_block_id))
        self.null_upto[row] = first
        self.parent_known[row] = False
        # A hit's first live block may be a partly restored one (SlidingHit.valid took it
        # only where the window's rows are written): the row starts at its written rows.
        self.written_from[row] = self.partial_blocks(entries[first:first + 1]).get(0, 0)

    def install_restored(self, row: int, entries: np.ndarray, tokens: int) -> None:
        """:meth:`install` for a table a cold restore rebuilt at ``tokens`` from the window
        rows ``[tokens - min(tokens, window), tokens)`` (docs/cold.md, "Grouped restore"):
        when the window is not a multiple of the block size, the first live block also
        covers earlier rows that nobody wrote. That block is published with its first
        written position (:meth:`partial_blocks`), so a hot hit takes it only at
        boundaries whose window rows it holds, and :meth:`first_live_position` starts at
        the written rows, so ``gather_kv`` never returns the others."""
        self.install(row, entries)
        self.written_from[row] = tokens - min(tokens, self.window)

    def _partial_index(self, row: int) -> int:
        """Table index of the row's partly written first live block, or -1."""
        written = int(self.written_from[row])
        return written // self.block_size if written % self.block_size else -1

    def _chain_keys(self, per_block, uniform, first: int, stop: int):
        """Key arguments for chain blocks ``[first, stop)`` (segment-relative per-block keys),
        or ``None`` when per-block keys do not reach ``stop``."""
        if per_block is None:
            return {"extra_keys": uniform}
        if len(per_block) < stop:
            return None
        return {"extra_keys_per_block": per_block[first:stop]}

    def _parent(self, tokens: np.ndarray, first: int, keys_of, salt: int) -> int | None:
        """Chain hash of block ``first - 1`` (0 for block 0); ``None`` without keys for it."""
        if first == 0:
            return 0
        keys = keys_of(0, first)
        if keys is None:
            return None
        return int(self.allocator.chain_hashes(tokens[:first * self.block_size],
                                               cache_salt=salt, **keys)[-1])

    def _publish(self, row: int, tokens: np.ndarray, first: int, stop: int, uniform, per_block,
                 salt: int, parent: int | None) -> tuple[int, int | None]:
        """Publish entries ``[first, stop)`` of the row as a chain segment; returns (new
        entries, hash of block ``stop - 1`` or ``None`` when it could not be computed)."""
        def keys_of(a, b):
            return self._chain_keys(per_block, uniform, a, b)

        if parent is None:
            parent = self._parent(tokens, first, keys_of, salt)
        keys = keys_of(first, stop)
        if parent is None or keys is None or stop <= first:
            return 0, parent if stop <= first else None
        bs = self.block_size
        segment = tokens[first * bs:stop * bs]
        hashes = self.allocator.chain_hashes(segment, cache_salt=salt, parent_hash=parent,
                                             first_block=first, **keys)
        partial = self._partial_index(row)
        if first <= partial < stop:  # recorded before the block can be found
            self._partial[int(self.table[row, partial])] = (
                int(hashes[partial - first]), int(self.written_from[row]))
        new = self.allocator.cache_full_blocks(
            segment, self.table[row, first:stop].copy(), cache_salt=salt, parent_hash=parent,
            first_block=first, **keys)
        return new, int(hashes[-1])

    def register(self, row: int, tokens: np.ndarray, num_tokens: int, extra_keys,
                 extra_keys_per_block, cache_salt: int) -> int:
        """Publish the blocks the row still holds (its last window) under the given keys."""
        first = int(self.null_upto[row])
        stop = num_tokens // self.block_size
        per_block = None if extra_keys_per_block is None else list(extra_keys_per_block)
        new, _ = self._publish(row, tokens, first, stop, tuple(extra_keys), per_block,
                               int(cache_salt), None)
        return new

    # --- the null sentinel ----------------------------------------------------------------

    def prune(self, row: int, committed_tokens: int, rows: SequenceRows | None = None,
              publish: bool = False) -> int:
        """Point the entries no query can attend after ``committed_tokens`` at the null block
        and free their blocks, newest first; returns the blocks freed. With ``publish`` and
        a lookup that declared the request's domain, the blocks are published first (they
        stay cached, evictable, for other requests)."""
        cut = min(expired_blocks(committed_tokens, self.window, self.block_size),
                  int(self.num_blocks[row]))
        first = int(self.null_upto[row])
        if cut <= first:
            return 0
        ids = self.table[row, first:cut].copy()
        if publish and rows is not None and rows.publish[row]:
            uniform, per_block = rows.keys[row]
            parent = int(self.parent_hash[row]) if self.parent_known[row] else None
            _, last = self._publish(row, rows.tokens[row], first, cut, uniform, per_block,
                                    int(rows.salt[row]), parent)
            if last is None:
                rows.publish[row] = False  # keys ran out: nothing later verifies either
            else:
                self.parent_hash[row] = last
                self.parent_known[row] = True
        self.allocator.free_many(ids[::-1])
        self.table[row, first:cut] = self.null_block_id
        self.null_upto[row] = cut
        self.revision[row] += 1
        return cut - first

    def prune_many(self, rows: np.ndarray, committed: np.ndarray, seq_rows: SequenceRows,
                   publish: bool) -> int:
        """:meth:`prune` for a batch of rows (``committed``: int32 per row), in C; rows whose
        request has extra keys publish through :meth:`prune`. Returns the blocks freed."""
        if publish:
            # Rows whose first live block a restore rebuilt only in part take the Python
            # path, which records that block's written rows as it publishes it.
            held = self.written_from[rows] > self.null_upto[rows].astype(np.int64) * \
                self.block_size
            if held.any():
                freed = sum(self.prune(int(r), int(c), seq_rows, True)
                            for r, c in zip(rows[held], committed[held], strict=True))
                return freed + self.prune_many(rows[~held], committed[~held], seq_rows, True)
        modes = seq_rows.publish if publish else self._no_publish(len(seq_rows.publish))
        freed, keyed = table_ops.prune_rows(
            self.allocator, self.table, self.num_blocks, self.null_upto, self.revision,
            self.parent_hash, self.parent_known, rows, committed, self.window,
            seq_rows.tokens, seq_rows.salt, modes)
        if len(keyed):
            at = {int(r): i for i, r in enumerate(rows)}
            for r in keyed:
                freed += self.prune(int(r), int(committed[at[int(r)]]), seq_rows, True)
        return freed

    def _no_publish(self, rows: int) -> np.ndarray:
        if self._zeros.shape[0] != rows:
            self._zeros = np.zeros(rows, np.uint8)
        return self._zeros

    def _check_row_prefix(self, row: int, first: int) -> None:
        if first != int(self.null_upto[row]) or \
                (self.table[row, :first] != self.null_block_id).any():
            raise InvariantViolation(
                f"sliding group: row {row} entries [0, {first}) are not all the null block "
                f"{self.null_block_id}")
        n = int(self.num_blocks[row])
        if (self.table[row, first:n] == self.null_block_id).any():
            raise InvariantViolation(
                f"sliding group: row {row} holds the null block after its expired prefix")
