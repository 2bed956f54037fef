"""``RequestLifecycle``: the per-request state machine over one or more KV-cache groups
(docs/adapter.md, "Lifecycle"; docs/coordinator.md, "All-groups operations and the cursor rule").

Reset → lookup → allocate → record … → register → release, plus keep-live turns, the aux
latch and admission, written once for any number of groups. The single-group
:class:`~pagedkv.adapter.PagedKVCacheAdapter` and the grouped
:class:`~pagedkv.coordinator.GroupedKVCoordinator` are this class with one group and with
several.

**Cursor rule.** Every group of a row shares one cursor (``num_tokens``) and one token
buffer. A call that moves the cursor first makes every group back the new count, in group
order; if one group fails, the groups before it give back what they just took, the error is
raised and nothing changed (a pool growth that happened stays: the pool is only bigger).
Only then does the cursor move.

The lifecycle is not thread-safe: callers serialize calls on one lifecycle and on lifecycles
that share an allocator (the allocator's own operations are atomic).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from pagedkv.adapter.admission import AdmissionControl
from pagedkv.adapter.arguments import as_count, as_tokens
from pagedkv.adapter.cold_hooks import ColdCalls
from pagedkv.adapter.group_blocks import GroupBlocks, HitProposal
from pagedkv.adapter.results import DecodeBatch, PrefixLookup
from pagedkv.adapter.sequence_rows import SequenceRows
from pagedkv.adapter.table_ops import PUBLISH_KEYED, PUBLISH_PLAIN
from pagedkv.errors import (
    AuxStateUnconfirmed,
    CapacityExceeded,
    InvalidArgument,
    InvalidArgumentType,
    InvariantViolation,
    LookupAlreadyDone,
    PagedKVError,
)
from pagedkv.hashing import as_domain_id, make_chain_keys

__all__ = ["RequestLifecycle"]

log = logging.getLogger("pagedkv.adapter")

_EMPTY_IDS = np.empty(0, np.int32)
_EMPTY_IDS.setflags(write=False)

_RESERVE = "paged cache could not reserve"
_DECODE = "paged decode could not reserve"

_COUNTERS = ("lookups", "lookup_tokens", "hit_tokens", "hit_blocks", "restored_blocks",
             "blocks_allocated", "registered_blocks", "grow_events", "cold_capture_errors",
             "cold_restore_errors")


class RequestLifecycle(AdmissionControl):
    """Per-sequence lifecycle over ``groups`` (at least one; every group's tables are row
    aligned with the shared :class:`~pagedkv.adapter.sequence_rows.SequenceRows`).

    Parameters
    ----------
    groups:
        :class:`~pagedkv.adapter.group_blocks.GroupBlocks` (or subclasses), built with this
        lifecycle's ``counters``.
    cold:
        ``None`` or the cold-tier hooks (:class:`~pagedkv.adapter.cold_hooks.ColdHooks`).
    checkpoints:
        ``None`` or a state checkpoint store
        (:class:`~pagedkv.coordinator.StateCheckpointStore`): the model keeps recurrent state,
        and a hot hit is valid only at a boundary the store holds a checkpoint for.
    requires_aux_confirmation:
        The model keeps state outside the pool: a hit without its state latches
        (docs/adapter.md, "Aux latch").
    hot_reuse:
        ``False``: no cross-request hot hits and no publication by sliding groups (the
        fail-closed rule); registration of full groups is unchanged.
    """

    def __init__(self, groups: Sequence[GroupBlocks], *, cold=None, checkpoints=None,
                 requires_aux_confirmation: bool = False, initial_rows: int = 8,
                 hot_reuse: bool = True, counters: dict[str, int] | None = None) -> None:
        if not groups:
            raise InvalidArgument("a request lifecycle needs at least one KV-cache group")
        self._counters = counters if counters is not None else dict.fromkeys(_COUNTERS, 0)
        for name in _COUNTERS:
            self._counters.setdefault(name, 0)
        self._groups = tuple(groups)
        rows = max(int(initial_rows), *(g.table.shape[0] for g in self._groups))
        self._rows = SequenceRows(rows, self._groups[0].block_size)
        for g in self._groups:
            if g.table.shape[0] != self._rows.capacity:
                g.grow_rows(self._rows.capacity)
            self._rows.add_grow_callback(g.grow_rows)
        self._unit = math.lcm(*(g.block_size for g in self._groups))
        self._cold = cold
        self._cold_calls = ColdCalls(cold, self._counters) if cold is not None else None
        # Disk restore of a grouped model: one full group (group 0) whose chain the tier
        # walks, every other group sliding, of one window, and rebuilt from the one sliding
        # sidecar at the same boundary (docs/coordinator.md, "The cold tier"). Any other
        # grouping (two full groups, sliding groups of several windows, a sliding-only
        # model) restores nothing from disk.
        sliding = self._groups[1:]
        self._sliding_cold = (len(self._groups) > 1 and self._groups[0].kind_name == "full"
                              and all(g.kind_name == "sliding" for g in sliding)
                              and len({getattr(g, "window", None) for g in sliding}) == 1)
        if checkpoints is not None and not all(
                callable(getattr(checkpoints, name, None)) for name in ("deepest", "clear")):
            # Else the first lookup failed with a bare AttributeError ('str' object has no
            # attribute 'deepest') after the hit was proposed.
            raise InvalidArgumentType(
                f"checkpoints must be None or a state checkpoint store (a "
                f"StateCheckpointStore: deepest, clear), got {type(checkpoints).__name__}"
                + ("; GroupedKVCoordinator.from_specs takes True / False to create one or none"
                   if len(self._groups) > 1 else ""))
        self.checkpoints = checkpoints
        self.requires_aux_confirmation = bool(requires_aux_confirmation)
        self.hot_reuse = bool(hot_reuse)
        self._suppress_cold_restore_once = False
        # A row's limit in tokens, checked once per decode step: the tightest group whose
        # capacity is in tokens (a sliding group's limit is the blocks it holds at once,
        # which one decode token cannot break) and the model's (max_row_tokens).
        self._decode_groups = tuple(g for g in self._groups if g.limits_tokens)
        self._decode_limit = min((g.capacity_tokens for g in self._decode_groups),
                                 default=np.iinfo(np.int64).max)
        if self.max_row_tokens is not None:
            self._decode_limit = min(self._decode_limit, self.max_row_tokens)

    # --- rows -------------------------------------------------------------------------------

    def _row(self, seq_id: Hashable) -> int:
        return self._rows.row(seq_id)

    @property
    def cold(self):
        """The cold-tier hooks, or ``None``."""
        return self._cold

    def live_seq_ids(self) -> list[Hashable]:
        return list(self._rows.row_of)

    # --- lifecycle ------------------------------------------------------------------------

    def reset_for_new_request(self, seq_id: Hashable) -> None:
        """Release any live request of ``seq_id`` in every group and give it empty tables."""
        if self._rows.find(seq_id) is not None:
            self.release_request(seq_id)
        self._rows.acquire(seq_id)

    def find_cached_prefix(self, seq_id: Hashable, prompt, *,
                           extra_keys: Sequence[int] | None = (), extra_keys_per_block=None,
                           cache_salt: int = 0, skip_lookup: bool = False,
                           max_tokens: int | None = None) -> PrefixLookup:
        """Put the longest cached prefix of ``prompt[:max_tokens]`` that every group backs
        into the tables (docs/coordinator.md, "Hybrid hot prefix reuse"; one group: the
        longest verified hot hit), then let the cold tier extend it. The blocks come
        incref'd and the tables own them. One lookup per request (``LookupAlreadyDone``);
        ``skip_lookup`` forces a miss. ``cache_salt`` and the extra keys are also what
        blocks a sliding group drops are published under; ``extra_keys=None`` is no keys."""
        rows = self._rows
        row = rows.row(seq_id)
        if rows.lookup_done[row]:
            raise LookupAlreadyDone(
                f"find_cached_prefix was already called for seq_id {seq_id!r} in this request; "
                "call reset_for_new_request to start another")
        held = [int(g.num_blocks[row]) for g in self._groups]
        if rows.num_tokens[row] or any(held):
            # install() writes the hit over the row: blocks it held would leak
            raise LookupAlreadyDone(
                f"find_cached_prefix: seq_id {seq_id!r} already holds {int(rows.num_tokens[row])} "
                f"tokens and {held} blocks per group; the lookup comes first after "
                "reset_for_new_request (reset, lookup, allocate, record)")
        tokens = as_tokens(prompt, "prompt")
        if isinstance(cache_salt, str):
            raise InvalidArgumentType(
                "cache_salt must be a u64 domain id, got a str: pass salt_domain_id(salt)")
        salt = as_domain_id(cache_salt)
        # Every argument is checked before anything changes: a refused call leaves the row,
        # and the one-shot cold-restore suppression of a purge, as they were.
        if extra_keys is None:          # no keys, as for make_chain_keys and the allocator
            extra_keys = ()
        make_chain_keys(extra_keys, extra_keys_per_block)
        if max_tokens is not None:
            tokens = tokens[:as_count(max_tokens, "max_tokens")]
        suppress_cold = self._suppress_cold_restore_once
        self._suppress_cold_restore_once = False
        if skip_lookup:
            rows.lookup_done[row] = True
            return PrefixLookup(0, _EMPTY_IDS, _EMPTY_IDS, None)
        # The request's domain, for blocks a sliding group publishes before registration (a
        # forced miss declares none, so its dropped blocks are never published).
        rows.salt[row] = salt
        uniform = tuple(extra_keys)
        rows.keys[row] = (uniform,
                          None if extra_keys_per_block is None else list(extra_keys_per_block))
        rows.publish[row] = (PUBLISH_PLAIN if not uniform and extra_keys_per_block is None
                             else PUBLISH_KEYED)
        entries, cached, checkpoint, full_ceiling = self._hot_hit(
            tokens, extra_keys, extra_keys_per_block, salt)
        first = self._groups[0]
        restored, sidecar = _EMPTY_IDS, checkpoint
        sliding_restored = False
        calls = self._cold_calls
        if (calls is not None and not suppress_cold and len(self._groups) == 1
                and cached + first.block_size <= len(tokens)):
            restored, restored_sidecar = calls.restore(
                tokens, entries[0], first.block_size, salt, extra_keys, extra_keys_per_block,
                first.pool, first.allocator)
            if len(restored):
                entries[0] = np.concatenate([entries[0], restored])
                sidecar = restored_sidecar
        elif (calls is not None and not suppress_cold and self._sliding_cold
              and full_ceiling <= cached and cached + first.block_size <= len(tokens)):
            # A full group with hot blocks past the hit could not publish restored copies of
            # them; its deeper state, if any, is in the checkpoint store.
            grouped = calls.restore_grouped(
                tokens, entries[0], first, self._groups[1:], salt, extra_keys,
                extra_keys_per_block, self._unit)
            if grouped is not None:
                cached, restored, tables, sidecar = grouped
                entries[0] = np.concatenate([entries[0], restored])
                for i, (g, table) in enumerate(zip(self._groups[1:], tables, strict=True), 1):
                    g.drop_entries(entries[i])
                    entries[i] = table
                sliding_restored = True
        if len(self._groups) == 1:
            cached = min(len(entries[0]) * first.block_size, len(tokens))
        for i, (g, e) in enumerate(zip(self._groups, entries, strict=True)):
            if sliding_restored and i:
                g.install_restored(row, e, cached)
            else:
                g.install(row, e)
        rows.ensure_tokens(cached)
        rows.tokens[row, :cached] = tokens[:cached]
        rows.num_tokens[row] = cached
        rows.cached[row] = cached
        rows.restored[row] = len(restored)
        rows.lookup_done[row] = True
        rows.sidecar[row] = sidecar
        # A family with out-of-pool state cannot resume from K/V alone (docs/adapter.md,
        # "Aux latch"): unless its state came back for exactly this boundary.
        rows.aux_unbacked[row] = self.requires_aux_confirmation and cached > 0 and not (
            sidecar is not None and getattr(sidecar, "boundary_tokens", None) == cached)
        c = self._counters
        c["lookups"] += 1
        c["lookup_tokens"] += len(tokens)
        c["hit_tokens"] += cached
        hot = entries[0][:len(entries[0]) - len(restored)]
        c["hit_blocks"] += len(hot)
        c["restored_blocks"] += len(restored)
        return PrefixLookup(cached, hot, restored, sidecar)

    def _hot_hit(self, tokens: np.ndarray, extra_keys, extra_keys_per_block, salt: int
                 ) -> tuple[list[np.ndarray], int, Any, int]:
        """Every group's table entries for the longest boundary all groups (and the
        checkpoint store, when there is one) back: ``(entries per group, tokens,
        checkpoint, the first group's own ceiling in tokens)``. Each group proposes what it
        can back; the boundary is the longest multiple of every block size that every
        proposal accepts."""
        if not self.hot_reuse or not len(tokens):
            return [_EMPTY_IDS for _ in self._groups], 0, None, 0
        proposals: list[HitProposal] = []
        entries: list[np.ndarray] = []
        try:
            for g in self._groups:
                proposals.append(g.propose_hit(tokens, extra_keys, extra_keys_per_block, salt))
            ceiling = min(min(p.ceiling_tokens for p in proposals), len(tokens))
            unit = self._unit
            t = ceiling - ceiling % unit
            checkpoint = None
            if self.checkpoints is None:
                while t > 0 and not all(p.valid(t) for p in proposals):
                    t -= unit
            else:
                found = self.checkpoints.deepest(
                    tokens[:t], extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
                    cache_salt=salt,
                    accept=lambda b: b % unit == 0 and all(p.valid(b) for p in proposals))
                t, checkpoint = (found.boundary_tokens, found) if found is not None else (0, None)
            for p in proposals:
                entries.append(p.take(t))
        except BaseException:
            for p in proposals[len(entries):]:
                p.drop()
            for g, e in zip(self._groups, entries, strict=False):
                g.drop_entries(e)
            raise
        return entries, t, checkpoint, int(proposals[0].ceiling_tokens)

    def allocate_suffix_blocks(self, seq_id: Hashable, total_tokens: int) -> int:
        """Reserve in every group what a prompt of ``total_tokens`` needs (decode blocks
        come lazily from :meth:`record_tokens`). All or nothing over every group
        (``CapacityExceeded``: it can never fit; ``PoolExhausted``: not now). Returns the
        blocks newly allocated, summed over the groups."""
        row = self._row(seq_id)
        total = as_count(total_tokens, "total_tokens")
        return self._extend_all(row, total, _RESERVE)

    #: The most tokens a row may hold whatever the pools (a model's max_model_len), or None.
    max_row_tokens: int | None = None

    def _check_row_limit(self, total: int, phrase: str) -> None:
        if self.max_row_tokens is not None and total > self.max_row_tokens:
            raise CapacityExceeded(f"{phrase}: requested {total} tokens, the model's "
                                   f"max_model_len is {self.max_row_tokens}")

    def _extend_all(self, row: int, total: int, phrase: str) -> int:
        """The cursor rule's reservation: capacity in every group first, then reserve in
        group order; a failure gives back what earlier groups took and re-raises."""
        self._check_row_limit(total, phrase)
        for g in self._groups:
            g.check_capacity(row, total, phrase)
        for g in self._groups:
            g.preflight(g.blocks_needed(row, total), total, phrase)
        done: list[tuple[GroupBlocks, int, int]] = []
        added = 0
        try:
            for g in self._groups:
                before = (int(g.num_blocks[row]), int(g.revision[row]))
                added += g.extend(row, total, phrase)
                done.append((g, *before))
        except BaseException:
            for g, blocks, revision in reversed(done):
                g.truncate(row, blocks, revision)
            raise
        return added

    def _check_latch(self, row: int, call: str) -> None:
        if self._rows.aux_unbacked[row]:
            cached = int(self._rows.cached[row])
            raise AuxStateUnconfirmed(
                f"{call}: seq_id {self._rows.seq_of[row]!r} resumed {cached} cached "
                "tokens but its out-of-pool state is unconfirmed; install it and call "
                f"confirm_aux_prefix_primed(seq_id, {cached})")

    def _check_not_finalized(self, row: int, call: str) -> None:
        # A finalized turn is published once; tokens recorded after it would never be (the
        # next finalize or register returns 0), so the next turn must reopen it first.
        if self._rows.finalized[row]:
            raise PagedKVError(
                f"{call}: seq_id {self._rows.seq_of[row]!r} was finalized by "
                "finalize_turn_keep_live; call continue_turn(seq_id, prompt, total_tokens) "
                "before recording more tokens")

    def record_tokens(self, seq_id: Hashable, tokens) -> None:
        """Append ``tokens`` to the sequence; every group gets the blocks the new count
        needs first (cursor rule). Errors (``CapacityExceeded``, ``PoolExhausted``, "paged
        decode could not reserve") change nothing. Call it before ``write_kv`` for those
        positions. A finalized turn (``finalize_turn_keep_live``) → ``PagedKVError``:
        ``continue_turn`` first."""
        rows = self._rows
        row = rows.row(seq_id)
        self._check_not_finalized(row, "record_tokens")
        self._check_latch(row, "record_tokens")
        toks = as_tokens(tokens)
        start = int(rows.num_tokens[row])
        end = start + len(toks)
        self._extend_all(row, end, _DECODE)
        rows.ensure_tokens(end)
        rows.tokens[row, start:end] = toks
        rows.num_tokens[row] = end

    def record_decode_tokens(self, seq_ids: Sequence[Hashable], tokens) -> None:
        """One decode step: append ``tokens[i]`` to ``seq_ids[i]`` for every sequence at once.

        The batched form of :meth:`record_tokens` (same errors, all or nothing over the batch
        and over the groups): in each group the sequences that cross a block boundary get
        their blocks from one ``allocate_many``."""
        rows_state = self._rows
        rows = rows_state.rows(seq_ids)
        toks = as_tokens(tokens)
        if len(toks) != len(rows):
            raise InvalidArgument(
                f"tokens has {len(toks)} entries for {len(rows)} seq_ids: one token each")
        if rows_state.finalized[rows].any():
            self._check_not_finalized(int(rows[rows_state.finalized[rows].argmax()]),
                                      "record_decode_tokens")
        if self.requires_aux_confirmation and rows_state.aux_unbacked[rows].any():
            self._check_latch(int(rows[rows_state.aux_unbacked[rows].argmax()]),
                              "record_decode_tokens")
        ends = rows_state.num_tokens[rows] + 1
        top = int(ends.max(initial=0))
        if top > self._decode_limit:
            self._check_row_limit(top, _DECODE)
            for g in self._decode_groups:
                g.check_capacity(int(rows[ends.argmax()]), top, _DECODE)
        plans = []
        for g in self._groups:
            crossing, width = g.decode_crossing(rows, ends)
            if len(crossing):
                g.preflight(len(crossing), top, _DECODE)
                plans.append((g, crossing, width))
        done = []
        try:
            for g, crossing, width in plans:
                done.append((g, g.extend_decode(crossing, width, top, _DECODE)))
        except BaseException:
            for g, appended in reversed(done):
                g.undo_decode(appended)
            raise
        if top > rows_state.tokens.shape[1]:
            rows_state.ensure_tokens(top)
        rows_state.tokens[rows, ends - 1] = toks
        rows_state.num_tokens[rows] = ends

    def _decode_batches(self, seq_ids: Sequence[Hashable]) -> list[DecodeBatch]:
        rows = self._rows.rows(seq_ids)
        lens = self._rows.num_tokens[rows]
        if len(rows) and int(lens.min()) < 1:
            empty = [self._rows.seq_of[r] for r in rows[lens == 0]]
            raise InvalidArgument(f"seq_ids {empty!r} hold no tokens: record_tokens first")
        return [g.decode_batch(rows, lens) for g in self._groups]

    def rollback_last_tokens(self, seq_id: Hashable, n: int) -> None:
        """Move the cursor back ``n`` tokens (speculative decoding); blocks stay in the tables.
        A sliding group must still hold the window behind the new cursor (rolling back past
        the committed frontier it pruned at → ``InvalidArgument``)."""
        row = self._row(seq_id)
        n = as_count(n, "n")
        have = int(self._rows.num_tokens[row])
        if n > have:
            raise InvalidArgument(f"rollback_last_tokens: n = {n} exceeds the {have} tokens of "
                                  f"seq_id {seq_id!r}")
        for g in self._groups:
            g.check_rollback(row, have - n, seq_id)
        self._rows.num_tokens[row] = have - n

    # --- registration, release, turns ---------------------------------------------------

    def _register(self, row: int, call: str, extra_keys, extra_keys_per_block,
                  cache_salt) -> int:
        self._check_latch(row, call)
        # Checked before the once-per-request early return: a second call with a float or
        # bool salt, or bad extra keys, is refused like the first, not silently taken.
        cache_salt = as_domain_id(cache_salt)
        make_chain_keys(extra_keys, extra_keys_per_block)
        rows = self._rows
        if rows.registered[row]:
            return 0
        n = int(rows.num_tokens[row])
        tokens = rows.tokens[row, :n]
        new = 0
        for g in self._groups:
            if g.publishes(self.hot_reuse):
                new += g.register(row, tokens, n, extra_keys, extra_keys_per_block, cache_salt)
        rows.registered[row] = True
        self._counters["registered_blocks"] += new
        first = self._groups[0]
        full = n // first.block_size
        # A family with sidecar state enters capture every turn, even without a full block
        # (its sidecar stats count that turn as chain_empty: docs/cold.md, "Sidecar capture").
        if (self._cold_calls is not None and not rows.captured[row]
                and (full or self._cold_calls.has_sidecar) and first.kind_name == "full"):
            rows.captured[row] = True
            # Copies: the cold writer may keep them after this row is reused.
            rows.capture_outcome[row] = self._cold_calls.capture(
                tokens[:full * first.block_size].copy(), first.table[row, :full].copy(),
                cache_salt, extra_keys, extra_keys_per_block, first.pool, first.allocator)
        return new

    def register_full_blocks_for_reuse(self, seq_id: Hashable, *, extra_keys: Sequence[int] = (),
                                       extra_keys_per_block=None, cache_salt: int = 0) -> int:
        """Publish the sequence's full blocks in the prefix cache (once per request; a
        sliding group publishes the blocks it still holds), then offer the first group's
        to the cold tier. Returns the number of new prefix entries over all groups."""
        return self._register(self._row(seq_id), "register_full_blocks_for_reuse", extra_keys,
                              extra_keys_per_block, cache_salt)

    def finalize_turn_keep_live(self, seq_id: Hashable, *, extra_keys: Sequence[int] = (),
                                extra_keys_per_block=None, cache_salt: int = 0) -> int:
        """Register like :meth:`register_full_blocks_for_reuse` but keep the tables, tokens
        and partial last block live for :meth:`continue_turn`. Idempotent. Until
        ``continue_turn`` reopens the turn, ``record_tokens`` and ``record_decode_tokens``
        refuse the sequence (``PagedKVError``): what they added would never be published."""
        row = self._row(seq_id)
        new = self._register(row, "finalize_turn_keep_live", extra_keys, extra_keys_per_block,
                             cache_salt)
        self._rows.finalized[row] = True
        return new

    def release_request(self, seq_id: Hashable) -> int:
        """Decref every table block in every group and forget the sequence; registered
        blocks stay cached. Unknown or already released → 0. Every group is released even if
        one fails; then the first error is raised and the sequence stays live with the
        failed groups' tables as they were (``free_many`` changes nothing on error), so a
        retry releases only what is left. Returns the blocks released."""
        rows = self._rows
        row = rows.find(seq_id)
        if row is None:
            return 0
        released = 0
        error: BaseException | None = None
        for g in self._groups:
            try:
                released += g.release_row(row)
            except Exception as exc:  # noqa: BLE001 - every group first, then the first error
                if error is None:
                    error = exc
        if error is not None:
            raise error
        rows.release(seq_id, row)
        return released

    def release_request_and_purge_prefix_cache(self, seq_id: Hashable) -> int:
        """Release, drop every group's prefix cache and every state checkpoint, and skip the
        cold restore of the next lookup."""
        n = self.release_request(seq_id)
        for g in self._groups:
            g.allocator.purge_prefix_cache()
        if self.checkpoints is not None:
            # Keyed like blocks: once the blocks are registered again, a checkpoint kept
            # from before the purge would be served with them.
            self.checkpoints.clear()
        self._suppress_cold_restore_once = True
        return n

    def is_live(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` has a row (a table) now; ``InvalidArgumentType`` when unhashable."""
        return self._rows.find(seq_id) is not None

    def is_live_for_continue(self, seq_id: Hashable) -> bool:
        row = self._rows.find(seq_id)
        return row is not None and bool(self._rows.finalized[row])

    def _check_groups_back(self, row: int, tokens: int) -> None:
        for g in self._groups:
            if not g.backs(row, tokens):
                raise InvariantViolation(
                    f"groups disagree on live continuation boundary: the cursor is at {tokens} "
                    f"tokens but {g!r} does not back them for seq_id {self._rows.seq_of[row]!r}")

    def continue_turn(self, seq_id: Hashable, prompt, total_tokens: int) -> tuple[int, int]:
        """Next turn on a finalized live table: ``prompt`` must extend the live tokens.

        Returns ``(prior_len, newly_allocated)``; record ``prompt[prior_len:]`` next.
        """
        rows = self._rows
        row = rows.row(seq_id)
        if not rows.finalized[row]:
            raise PagedKVError(f"continue_turn: seq_id {seq_id!r} was not finalized; call "
                               "finalize_turn_keep_live at the end of the previous turn")
        toks = as_tokens(prompt, "prompt")
        prior = int(rows.num_tokens[row])
        live = rows.tokens[row, :prior]
        if len(toks) < prior or not np.array_equal(toks[:prior], live):
            same = np.flatnonzero(toks[:prior] != live[:len(toks)])
            at = int(same[0]) if len(same) else min(prior, len(toks))
            raise PagedKVError(f"continue_turn: prompt diverges from the live tokens of seq_id "
                               f"{seq_id!r} at position {at}: start a fresh request")
        total = as_count(total_tokens, "total_tokens")
        self._check_groups_back(row, prior)
        needed = self._extend_all(row, total, _RESERVE)
        rows.registered[row] = False
        rows.finalized[row] = False
        rows.captured[row] = False
        rows.aux_unbacked[row] = False
        rows.sidecar[row] = None
        return prior, needed

    # --- aux latch and sidecars -------------------------------------------------------------

    def confirm_aux_prefix_primed(self, seq_id: Hashable, n: int) -> None:
        """The family installed its out-of-pool state at ``n == cached_token_count``."""
        n = as_count(n, "n")
        rows = self._rows
        row = rows.row(seq_id)
        if not rows.aux_unbacked[row]:
            return
        cached = int(rows.cached[row])
        if n != cached:
            raise InvalidArgument(f"confirm_aux_prefix_primed: n = {n}, but seq_id {seq_id!r} "
                                  f"resumed {cached} cached tokens; prime the state at {cached}")
        rows.aux_unbacked[row] = False

    def aux_prefix_unbacked(self, seq_id: Hashable) -> bool:
        return bool(self._rows.aux_unbacked[self._row(seq_id)])

    def cold_capture_outcome(self, seq_id: Hashable):
        """What the cold tier's ``capture`` returned for this request's registration (``None``
        before it ran, without a cold tier, or when it failed)."""
        return self._rows.capture_outcome[self._row(seq_id)]

    def take_restored_sidecar(self, seq_id: Hashable):
        """Move the restored sidecar (or hot checkpoint) out; valid for exactly
        ``cached_token_count`` tokens."""
        rows = self._rows
        row = rows.row(seq_id)
        sidecar, rows.sidecar[row] = rows.sidecar[row], None
        return sidecar

    # --- read-only views ------------------------------------------------------------------

    def num_tokens(self, seq_id: Hashable) -> int:
        return int(self._rows.num_tokens[self._row(seq_id)])

    def restored_block_count(self, seq_id: Hashable) -> int:
        """Blocks the cold tier restored for this request's lookup."""
        return int(self._rows.restored[self._row(seq_id)])

    def cached_token_count(self, seq_id: Hashable) -> int:
        return int(self._rows.cached[self._row(seq_id)])

    def request_tokens(self, seq_id: Hashable) -> np.ndarray:
        rows = self._rows
        row = rows.row(seq_id)
        return rows.tokens[row, :rows.num_tokens[row]].copy()

    def stats(self) -> dict[str, int]:
        """Counters since construction (lookups, hits, allocations, growth, hook failures)."""
        return dict(self._counters, live_sequences=len(self._rows))

    def check_invariants(self) -> None:
        """Every group's allocator and table invariants, and that each group backs each
        live row's cursor; ``InvariantViolation`` naming the break."""
        live = sorted(self._rows.row_of.values())
        for g in self._groups:
            g.check_invariants(live)
        for row in live:
            n = int(self._rows.num_tokens[row])
            for g in self._groups:
                if int(g.num_blocks[row]) * g.block_size < n:
                    raise InvariantViolation(
                        f"row {row}: {n} tokens but {g!r} holds {int(g.num_blocks[row])} "
                        "entries")
