"""``GroupedKVCoordinator``: the request lifecycle of a hybrid model, over one allocator and
one pool per KV-cache group (docs/coordinator.md).

One ``seq_id`` names a row in every group. Every all-groups operation follows the cursor rule
of :class:`~pagedkv.adapter.lifecycle.RequestLifecycle` (a row moves forward only when every
group backs the new count; a partial failure gives back what earlier groups took). Sliding
groups keep their absolute table width and point expired entries at their null block
(:meth:`prune_sliding`). K/V calls take a *layer index* and follow its route; a KV-shared
alias reads its anchor's K/V and owns no slot, so writing through it is an error.

Cross-request hot hits are valid up to the longest boundary every group backs (the full
groups every block, each sliding group its last window, a checkpoint store a state): see
"Hybrid hot prefix reuse" in docs/coordinator.md. ``hot_reuse=False`` gives the fail-closed
rule instead (no cross-request hot hit; same-owner continuation only).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from pagedkv.adapter import kv_io
from pagedkv.adapter.arguments import as_count, as_tokens
from pagedkv.adapter.group_blocks import GroupBlocks
from pagedkv.adapter.lifecycle import RequestLifecycle
from pagedkv.adapter.results import DecodeBatch
from pagedkv.argument_checks import int_argument, is_int
from pagedkv.coordinator.budget import PoolBudget, plan_pool_budget
from pagedkv.coordinator.grouping import group_layer_kv_cache_specs
from pagedkv.coordinator.sliding import SlidingGroupBlocks, expired_blocks
from pagedkv.coordinator.specs import LayerKVCacheSpec
from pagedkv.coordinator.topology import KVCacheCoordinator, LayerKVCacheRoute
from pagedkv.errors import (
    CapacityExceeded,
    ContextLengthExceeded,
    GroupManagerMismatch,
    InvalidArgument,
    InvalidArgumentType,
    InvariantViolation,
    PoolExhausted,
)

__all__ = ["GroupedKVCoordinator"]

_RESERVE = "paged cache could not reserve"

#: The largest cursor a row may reach (block tables and slots are int32/int64).
MAX_ROW_TOKENS = (1 << 31) - 1


def _check_manager(gid: int, group, manager) -> None:
    if not isinstance(manager, GroupBlocks):
        raise GroupManagerMismatch(gid, f"expected a GroupBlocks (or SlidingGroupBlocks), got "
                                        f"{type(manager).__name__}")
    sliding = isinstance(manager, SlidingGroupBlocks)
    if group.kind.is_sliding != sliding:
        raise GroupManagerMismatch(
            gid, f"the group is {group.kind!r} but its manager is a {type(manager).__name__}")
    if isinstance(manager, SlidingGroupBlocks) and manager.window != group.kind.window:
        raise GroupManagerMismatch(
            gid, f"the group's window is {group.kind.window} tokens, the manager's "
                 f"{manager.window}")
    want = group.layout.pool_geometry(len(group.physical_layer_indices))
    have = manager.pool.geometry
    for field in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"):
        if getattr(want, field) != getattr(have, field):
            raise GroupManagerMismatch(
                gid, f"its pool has {field} = {getattr(have, field)!r}, the group needs "
                     f"{getattr(want, field)!r}")


class GroupedKVCoordinator(RequestLifecycle):
    """The lifecycle of a hybrid model over ``topology`` (a
    :class:`~pagedkv.coordinator.KVCacheCoordinator` whose managers are
    :class:`~pagedkv.adapter.group_blocks.GroupBlocks` for full groups and
    :class:`~pagedkv.coordinator.sliding.SlidingGroupBlocks` for sliding ones, each matching
    its group's kind, window and pool geometry, else ``GroupManagerMismatch``).

    ``max_model_len`` bounds a row's tokens (``CapacityExceeded`` past it). Build the usual
    configuration with :meth:`from_specs`.
    """

    def __init__(self, topology: KVCacheCoordinator, *, max_model_len: int, cold=None,
                 checkpoints=None, requires_aux_confirmation: bool = False,
                 hot_reuse: bool = True, initial_rows: int = 8,
                 budget: PoolBudget | None = None) -> None:
        if not isinstance(topology, KVCacheCoordinator):
            raise InvalidArgument(f"topology must be a KVCacheCoordinator, got "
                                  f"{type(topology).__name__}")
        for gid, (group, manager) in enumerate(zip(topology.groups, topology.managers,
                                                   strict=True)):
            _check_manager(gid, group, manager)
        counters: dict[str, int] = {}
        for manager in topology.managers:
            manager.counters = counters
        self.max_model_len = self.max_row_tokens = as_count(max_model_len, "max_model_len")
        super().__init__(topology.managers, cold=cold, checkpoints=checkpoints,
                         requires_aux_confirmation=requires_aux_confirmation,
                         initial_rows=initial_rows, hot_reuse=hot_reuse, counters=counters)
        self.topology = topology
        self.budget = budget
        self._route_of = {r.layer_index: r for r in topology.routes}
        self._sliding = tuple(g for g in self._groups if isinstance(g, SlidingGroupBlocks))

    @classmethod
    def from_specs(cls, specs: Iterable[LayerKVCacheSpec], *, max_model_len: int,
                   max_chunk: int, max_num_seqs: int = 32, memory_bytes: int | None = None,
                   memory_mb: int | None = None, backend: str = "numpy",
                   hash_seed: int | None = None, cold=None, checkpoints: bool | object = False,
                   checkpoint_entries: int = 8, checkpoint_retention=None,
                   requires_aux_confirmation: bool = False,
                   hot_reuse: bool = True,
                   blocks_per_group: Sequence[int] | None = None,
                   max_blocks_per_group: Sequence[int] | None = None) -> GroupedKVCoordinator:
        """Group ``specs``, size every pool from one budget (docs/coordinator.md, "Pool budget
        and admission width"), and build one allocator, pool and manager per group (fixed
        size unless ``max_blocks_per_group`` says otherwise).

        ``checkpoints=True`` creates a :class:`~pagedkv.coordinator.StateCheckpointStore`
        keyed by the first group's allocator (``checkpoint_entries`` entries, retention
        ``checkpoint_retention``, e.g. ``pagedkv.cold.ladder.LadderRetention``) for a model
        with recurrent layers; a store object is used as given. ``blocks_per_group`` sizes
        the pools explicitly instead (a sliding group's count includes its null block; no
        budget, no admission width); ``max_blocks_per_group`` (with it) lets a group's pool
        grow on demand up to that many blocks (docs/adapter.md, "Growth")."""
        from pagedkv.allocator import BlockAllocator
        from pagedkv.coordinator.checkpoints import StateCheckpointStore
        from pagedkv.pool import LayerKVPool

        specs = list(specs)
        groups = group_layer_kv_cache_specs(specs, max_model_len, max_chunk)
        budget: PoolBudget | None = None
        if blocks_per_group is None:
            budget = plan_pool_budget(groups, max_num_seqs=max_num_seqs,
                                      memory_bytes=memory_bytes, memory_mb=memory_mb)
            sizes = budget.blocks_per_group
            rows = budget.admission_width
        else:
            sizes = tuple(as_count(b, f"blocks_per_group[{i}]")
                          for i, b in enumerate(blocks_per_group))
            if len(sizes) != len(groups):
                raise InvalidArgument(f"blocks_per_group has {len(sizes)} entries for "
                                      f"{len(groups)} groups")
            # Checked like plan_pool_budget's: 0 rows is no configuration, not a default.
            rows = min(int_argument("max_num_seqs", max_num_seqs, minimum=1), 1024)
        if max_blocks_per_group is None:
            limits = sizes
        else:
            if blocks_per_group is None:
                raise InvalidArgument("max_blocks_per_group needs blocks_per_group (the "
                                      "starting size of each pool)")
            limits = tuple(as_count(b, f"max_blocks_per_group[{i}]")
                           for i, b in enumerate(max_blocks_per_group))
            if len(limits) != len(groups):
                raise InvalidArgument(f"max_blocks_per_group has {len(limits)} entries for "
                                      f"{len(groups)} groups")
            for i, (blocks, top) in enumerate(zip(sizes, limits, strict=True)):
                if top < blocks:
                    raise InvalidArgument(f"max_blocks_per_group[{i}] = {top} is below "
                                          f"blocks_per_group[{i}] = {blocks}")
        managers: list[GroupBlocks] = []
        for g, blocks, top in zip(groups, sizes, limits, strict=True):
            allocator = BlockAllocator(blocks, top, g.block_size, hash_seed=hash_seed,
                                       reserve_null_block=g.kind.is_sliding)
            pool = LayerKVPool(g.layout.pool_geometry(len(g.physical_layer_indices)), blocks,
                               top, backend=backend)
            if g.kind.is_sliding:
                assert g.kind.window is not None
                managers.append(SlidingGroupBlocks(
                    allocator, pool, g.kind.window, growth=top > blocks, rows=rows,
                    max_admission_blocks=g.max_admission_blocks))
            else:
                managers.append(GroupBlocks(allocator, pool, growth=top > blocks, rows=rows))
        topology = KVCacheCoordinator.from_groups(specs, groups, managers)
        store = checkpoints
        if checkpoints is True:
            store = StateCheckpointStore(managers[0].allocator, max_entries=checkpoint_entries,
                                         retention=checkpoint_retention)
        elif checkpoints is False:
            store = None
        return cls(topology, max_model_len=max_model_len, cold=cold, checkpoints=store,
                   requires_aux_confirmation=requires_aux_confirmation, hot_reuse=hot_reuse,
                   initial_rows=rows, budget=budget)

    def __repr__(self) -> str:
        groups = "; ".join(
            f"{s.group_id}: {s.kind!r} bs {s.block_size} {len(s.physical_layer_indices)} "
            f"layers {g.allocator.free_or_evictable_blocks}/{g.usable_blocks()} free"
            for s, g in zip(self.topology.groups, self._groups, strict=True))
        return (f"GroupedKVCoordinator(live={len(self._rows)}, max_model_len="
                f"{self.max_model_len}, hot_reuse={self.hot_reuse}, groups [{groups}])")

    # --- structure ------------------------------------------------------------------------

    @property
    def groups(self) -> tuple[GroupBlocks, ...]:
        """Each group's manager (allocator, pool, tables), in group id order."""
        return self._groups

    @property
    def max_concurrent_sequences(self) -> int | None:
        """The admission width of the pool budget (``None`` when built without one)."""
        return None if self.budget is None else self.budget.admission_width

    def route_for_layer(self, layer: int) -> LayerKVCacheRoute:
        return self.topology.route_for_layer(layer)

    def manager_for_layer(self, layer: int) -> GroupBlocks:
        return self.topology.manager_for_layer(layer)

    def _group(self, group_id: int) -> GroupBlocks:
        if not is_int(group_id):
            raise InvalidArgumentType(f"group_id must be an int, got {type(group_id).__name__}")
        if not 0 <= group_id < len(self._groups):
            raise InvalidArgument(f"group_id = {group_id!r} is outside [0, {len(self._groups)})")
        return self._groups[group_id]

    # --- decode ---------------------------------------------------------------------------

    def prepare_decode(self, seq_ids: Sequence[Hashable]) -> tuple[DecodeBatch, ...]:
        """One :class:`~pagedkv.adapter.DecodeBatch` per group (group id order) for the
        step's kernels; ``seq_lens`` is the same array in each. A sliding group's tables
        hold its null block id for expired entries (the kernel masks by the window)."""
        return tuple(self._decode_batches(seq_ids))

    def prune_sliding(self, seq_ids: Sequence[Hashable], committed_tokens=None, *,
                      publish: bool = True) -> int:
        """After a step's forward: in every sliding group, point the entries no query can
        attend after ``committed_tokens`` (per sequence; default: each one's token count)
        at the null block and free their blocks, newest first. Use the committed frontier,
        never a speculative cursor: committed tokens are recorded *and* their K/V written in
        every layer (a dropped block is published for other requests as it is). O(blocks
        freed). Returns the blocks freed.

        ``publish=False`` drops the blocks without publishing them: for positions a host
        recorded but never wrote in the sliding layers (it kept only a window of them, e.g.
        mlx-lm's decode), whose blocks must never be served. The rows' publication chain
        then restarts from their tokens at the next publication."""
        rows = self._rows.rows(seq_ids)
        have = self._rows.num_tokens[rows]
        if committed_tokens is None:
            committed = have
        else:
            committed = np.asarray(committed_tokens).reshape(-1)
            if committed.dtype.kind not in "iu" or len(committed) != len(rows):
                raise InvalidArgument(
                    f"committed_tokens must be {len(rows)} ints, one per seq_id")
            wrong = (committed < 0) | (committed > have)
            if wrong.any():
                bad = int(np.flatnonzero(wrong)[0])
                raise InvalidArgument(
                    f"committed_tokens[{bad}] = {int(committed[bad])} is outside [0, "
                    f"{int(have[bad])}] (the tokens of seq_id {self._rows.seq_of[rows[bad]]!r})")
            committed = committed.astype(np.int32)
        freed = 0
        for g in self._sliding:
            freed += g.prune_many(rows, committed, self._rows, self.hot_reuse and publish)
            if not publish:
                g.parent_known[rows] = False  # the cached parent hash skips what was dropped
        return freed

    # --- K/V by layer ---------------------------------------------------------------------

    def _route(self, layer) -> LayerKVCacheRoute:
        # type() is int, not isinstance: True == 1 would find layer 1's route, and the
        # checked path refuses a bool (InvalidArgumentType).
        route = self._route_of.get(layer) if type(layer) is int else None
        return route if route is not None else self.topology.route_for_layer(layer)

    def write_kv(self, seq_id: Hashable, layer: int, k, v, *, start: int | None = None,
                 generation: int | None = None) -> None:
        """Scatter K/V ``[n, kv_heads, head_dim]`` of ``layer`` (a model layer index) for
        positions ``[start, start + n)`` (default: the last ``n`` recorded) into its group's
        pool. A KV-shared alias owns no slot: writing through it → ``InvalidArgument``,
        nothing changed; so do positions a sliding group already dropped."""
        route = self._route(layer)
        if route.shared_kv_anchor is not None:
            raise InvalidArgument(
                f"layer {route.layer_index} is a KV-shared alias of layer "
                f"{route.shared_kv_anchor}: it owns no K/V slot and reads its anchor's; write "
                f"layer {route.shared_kv_anchor}'s K/V instead")
        row = self._row(seq_id)
        kv_io.write_positions(self._groups[route.group_id], row, seq_id,
                              int(self._rows.num_tokens[row]), route.physical_layer_ordinal,
                              k, v, start, generation)

    def write_kv_layers(self, seq_id: Hashable, group_id: int, k_layers, v_layers) -> None:
        """All physical layers of one group at once (in the group's physical order):
        ``[num_layers, n, kv_heads, head_dim]`` each, the last ``n`` recorded positions."""
        group = self._group(group_id)
        kv_io.check_layers_shape(group, k_layers, v_layers)
        row = self._row(seq_id)
        kv_io.write_layers(group, row, seq_id, int(self._rows.num_tokens[row]), k_layers,
                           v_layers)

    def gather_kv(self, seq_id: Hashable, layer: int, *, start: int = 0,
                  generation: int | None = None):
        """Copies of ``layer``'s K and V for positions ``[start, num_tokens)``, each
        ``[num_tokens - start, kv_heads, head_dim]`` (an alias reads its anchor's). In a
        sliding group ``start`` must not reach into dropped blocks
        (:meth:`first_live_position`)."""
        route = self._route(layer)
        row = self._row(seq_id)
        return kv_io.gather_positions(self._groups[route.group_id], row, seq_id,
                                      int(self._rows.num_tokens[row]),
                                      route.physical_layer_ordinal, start, generation)

    # --- per-group views ------------------------------------------------------------------

    def block_table(self, seq_id: Hashable, group_id: int = 0) -> np.ndarray:
        """A copy of the row's entries in group ``group_id`` (int32; a sliding group's
        expired entries hold its null block id)."""
        group = self._group(group_id)
        row = self._row(seq_id)
        return group.table[row, :group.num_blocks[row]].copy()

    def num_table_blocks(self, seq_id: Hashable, group_id: int = 0) -> int:
        return int(self._group(group_id).num_blocks[self._row(seq_id)])

    def physical_revision(self, seq_id: Hashable, group_id: int = 0) -> int:
        return int(self._group(group_id).revision[self._row(seq_id)])

    def first_live_position(self, seq_id: Hashable, group_id: int) -> int:
        """The first position whose K/V group ``group_id`` still holds for the row."""
        return self._group(group_id).first_live_position(self._row(seq_id))

    # --- the all-groups names of docs/coordinator.md --------------------------------------

    def reset_request_all(self, seq_id: Hashable) -> None:
        """Release the row in every group, then give it empty tables in every group."""
        self.reset_for_new_request(seq_id)

    def reserve_rows_all(self, seq_id: Hashable, rows: int) -> int:
        """Make every group back ``rows`` more tokens than the cursor, checked in every group
        before any reserves: past ``max_model_len`` or a group's max pool →
        ``CapacityExceeded``; more new blocks than a group has free or evictable →
        ``PoolExhausted``. A reservation failing after that preflight is an
        ``InvariantViolation``. The cursor does not move. Returns the blocks allocated."""
        row = self._row(seq_id)
        rows = as_count(rows, "rows")
        total = int(self._rows.num_tokens[row]) + rows
        if total > MAX_ROW_TOKENS:
            raise InvalidArgument(f"reserve_rows_all: the cursor would reach {total} tokens, "
                                  f"past {MAX_ROW_TOKENS}")
        if total > self.max_model_len:
            raise CapacityExceeded(f"{_RESERVE}: requested {total} tokens, the model's "
                                   f"max_model_len is {self.max_model_len}")
        for g in self._groups:
            g.check_capacity(row, total, _RESERVE)
        for gid, g in enumerate(self._groups):
            need = g.blocks_needed(row, total)
            try:
                # Grows a growable pool now: a refused growth fails before any group takes
                # (and evicts) blocks.
                g.preflight(need, total, _RESERVE)
            except PoolExhausted:
                raise PoolExhausted(
                    f"{_RESERVE}: group {gid} needs {need} more blocks for {total} tokens, "
                    f"{g.allocator.free_or_evictable_blocks} are free or evictable") from None
        try:
            return self._extend_all(row, total, _RESERVE)
        except ContextLengthExceeded as exc:
            raise InvariantViolation(
                f"reserve_rows_all: a group failed after the preflight passed: {exc}") from exc

    def record_tokens_all(self, seq_id: Hashable, tokens) -> None:
        self.record_tokens(seq_id, tokens)

    def rollback_last_tokens_all(self, seq_id: Hashable, n: int) -> None:
        self.rollback_last_tokens(seq_id, n)

    def release_request_all(self, seq_id: Hashable) -> int:
        return self.release_request(seq_id)

    def request_token_count_all(self, seq_id: Hashable) -> int:
        """The row's token count, after checking every group backs it
        (``InvariantViolation`` otherwise)."""
        row = self._row(seq_id)
        n = int(self._rows.num_tokens[row])
        self._check_groups_back(row, n)
        return n

    def can_continue_all(self, seq_id: Hashable, prompt) -> bool:
        """Whether every group is live for a continuation that ``prompt`` extends."""
        if not self.is_live_for_continue(seq_id):
            return False
        row = self._row(seq_id)
        live = self._rows.tokens[row, :self._rows.num_tokens[row]]
        toks = as_tokens(prompt, "prompt")
        if len(toks) < len(live) or not np.array_equal(toks[:len(live)], live):
            return False
        self._check_groups_back(row, len(live))
        return True

    def continue_turn_all(self, seq_id: Hashable, prompt, total_tokens: int) -> tuple[int, int]:
        return self.continue_turn(seq_id, prompt, total_tokens)

    def finalize_keep_live_all(self, seq_id: Hashable, *, extra_keys: Sequence[int] = (),
                               extra_keys_per_block=None, cache_salt: int = 0) -> int:
        return self.finalize_turn_keep_live(seq_id, extra_keys=extra_keys,
                                            extra_keys_per_block=extra_keys_per_block,
                                            cache_salt=cache_salt)

    def prune_sliding_all(self, seq_id: Hashable, committed_tokens: int, *,
                          publish: bool = True) -> int:
        """:meth:`prune_sliding` for one sequence."""
        return self.prune_sliding((seq_id,), [as_count(committed_tokens, "committed_tokens")],
                                  publish=publish)

    def expired_blocks(self, committed_tokens: int, group_id: int) -> int:
        """Leading entries group ``group_id`` drops at ``committed_tokens`` (0 for a full
        group)."""
        g = self._group(group_id)
        if not isinstance(g, SlidingGroupBlocks):
            return 0
        return expired_blocks(as_count(committed_tokens, "committed_tokens"), g.window,
                              g.block_size)
