"""``PagedKVCacheAdapter``: the request lifecycle over one allocator and one pool
(docs/adapter.md).

Many sequences share one :class:`~pagedkv.allocator.BlockAllocator` and one
:class:`~pagedkv.pool.LayerKVPool`. Per-sequence state lives in flat NumPy arrays indexed
by a *row*; a ``seq_id -> row`` dict is the only per-sequence Python structure, and nothing
is kept per block. A decode step for many sequences (:meth:`record_decode_tokens` then
:meth:`prepare_decode`) is a handful of vectorized NumPy operations.

This is :class:`~pagedkv.adapter.lifecycle.RequestLifecycle` with one full-attention group,
plus what only a single-group cache has: the block-table views of that group, K/V I/O by
physical layer, and the multi-turn helpers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from pagedkv.adapter import kv_io, turns
from pagedkv.adapter.arguments import as_count
from pagedkv.adapter.group_blocks import GroupBlocks
from pagedkv.adapter.lifecycle import RequestLifecycle
from pagedkv.adapter.results import DecodeBatch, TurnPlan
from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["PagedKVCacheAdapter"]


class PagedKVCacheAdapter(RequestLifecycle):
    """Per-sequence block tables over a shared allocator and pool (docs/adapter.md).

    Parameters
    ----------
    allocator, pool:
        Must agree on ``block_size``, ``num_blocks`` and ``max_num_blocks`` (else
        ``InvalidArgument``). The pool grows before the allocator.
    cold:
        ``None`` or the cold-tier hooks, an object with ``capture(...)`` and ``restore(...)``
        such as ``pagedkv.cold.ColdTierContext`` (docs/adapter.md, "Cold-tier hooks"). A
        failing hook is logged and counted, never raised into inference.
    requires_aux_confirmation:
        The model family keeps state outside the pool: enables the aux latch.
    growth:
        Grow the pool on demand; ``False`` keeps it at its current size.
    initial_rows:
        Sequence rows allocated up front (the tables double when more are live).
    checkpoints:
        ``None`` or a :class:`~pagedkv.coordinator.StateCheckpointStore` for a model with
        recurrent layers: hot hits stop at the deepest boundary with a checkpoint, which the
        lookup returns as ``PrefixLookup.sidecar``.
    """

    def __init__(self, allocator, pool, *, cold=None, requires_aux_confirmation: bool = False,
                 growth: bool = True, initial_rows: int = 8, checkpoints=None) -> None:
        counters: dict[str, int] = {}
        group = GroupBlocks(allocator, pool, growth=growth, rows=initial_rows,
                            counters=counters)
        super().__init__([group], cold=cold, checkpoints=checkpoints,
                         requires_aux_confirmation=requires_aux_confirmation,
                         initial_rows=initial_rows, counters=counters)
        self._group = group
        self.allocator = allocator
        self.pool = pool
        self.block_size = group.block_size

    def __repr__(self) -> str:
        return (f"PagedKVCacheAdapter(live={len(self._rows)}, block_size={self.block_size}, "
                f"pool_blocks={self.pool.num_blocks}/{self.pool.max_num_blocks}, "
                f"generation={self.pool.generation}, growth={self.growth}, "
                f"cold={'on' if self._cold is not None else 'off'})")

    @property
    def cold_tier(self):
        """The cold-tier hooks (the ``cold=`` argument), or ``None``."""
        return self._cold

    @property
    def growth(self) -> bool:
        return self._group.growth

    @growth.setter
    def growth(self, value: bool) -> None:
        self._group.growth = bool(value)

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence can ever hold: ``max_num_blocks * block_size``."""
        return self.allocator.max_num_blocks * self.block_size

    # --- decode ---------------------------------------------------------------------------

    def prepare_decode(self, seq_ids: Sequence[Hashable]) -> DecodeBatch:
        """The kernel inputs of one decode step, after its :meth:`record_decode_tokens`."""
        return self._decode_batches(seq_ids)[0]

    def check_batch(self, batch: DecodeBatch) -> None:
        """``StaleBlockTable`` unless ``batch`` (or a ``block_tables_array`` result's
        generation) belongs to the pool's current generation: a grow between
        :meth:`prepare_decode` and the kernel call makes every handed-out table stale.
        ``InvalidArgument`` for a batch another adapter's pool built (its
        ``pool_instance`` is not this pool's ``instance_id``; ``None``: not bound).
        ``InvalidArgumentType`` for an object without a ``generation``."""
        if not hasattr(batch, "generation"):
            raise InvalidArgumentType(
                f"batch must be a DecodeBatch (what prepare_decode returns), got "
                f"{type(batch).__name__}; to check a bare generation call "
                f"pool.check_generation(generation)")
        other = getattr(batch, "pool_instance", None)
        if other is not None and other != self.pool.instance_id:
            raise InvalidArgument(
                f"batch: built by the adapter of pool instance {other}, this adapter's pool "
                f"is instance {self.pool.instance_id} (pool_id {self.pool.pool_id!r}); build "
                f"the batch with the adapter of the pool you pass")
        self.pool.check_generation(batch.generation)

    # --- K/V ------------------------------------------------------------------------------

    def write_kv(self, seq_id: Hashable, layer: int, k, v, *, start: int | None = None,
                 generation: int | None = None) -> None:
        """Scatter K/V ``[n, kv_heads, head_dim]`` of positions ``[start, start + n)`` into
        the sequence's slots (``start`` defaults to ``num_tokens - n``: call it after
        :meth:`record_tokens`). Bad shape, dtype, layer or positions change nothing; a
        ``generation`` other than the pool's raises ``StaleBlockTable``."""
        row = self._row(seq_id)
        kv_io.write_positions(self._group, row, seq_id, int(self._rows.num_tokens[row]), layer,
                              k, v, start, generation)

    def write_kv_layers(self, seq_id: Hashable, k_layers, v_layers) -> None:
        """All layers at once: ``[num_layers, n, kv_heads, head_dim]`` each, default ``start``."""
        kv_io.check_layers_shape(self._group, k_layers, v_layers)
        row = self._row(seq_id)
        kv_io.write_layers(self._group, row, seq_id, int(self._rows.num_tokens[row]),
                           k_layers, v_layers)

    def gather_kv(self, seq_id: Hashable, layer: int, *, generation: int | None = None):
        """Copies of the sequence's K and V, ``[num_tokens, kv_heads, head_dim]``, in order."""
        row = self._row(seq_id)
        return kv_io.gather_positions(self._group, row, seq_id, int(self._rows.num_tokens[row]),
                                      layer, 0, generation)

    def gather_kv_layers(self, seq_id: Hashable, *, generation: int | None = None):
        """All layers at once: ``(k_layers, v_layers)``, ``[num_layers, num_tokens, kv_heads,
        head_dim]`` each, every layer's slice C-contiguous (one gather per array)."""
        row = self._row(seq_id)
        return kv_io.gather_layers(self._group, row, seq_id, int(self._rows.num_tokens[row]),
                                   generation)

    # --- turns ----------------------------------------------------------------------------

    def prepare_turn(self, seq_id: Hashable, prompt, *, total_tokens: int, reuse_live: bool = True,
                     extra_keys: Sequence[int] = (), extra_keys_per_block=None,
                     cache_salt: int = 0, skip_lookup: bool = False,
                     max_cached_tokens: int | None = None) -> TurnPlan:
        """Continue the live table when the prompt extends it, else reset + lookup + allocate
        (:func:`pagedkv.adapter.turns.prepare_turn`)."""
        return turns.prepare_turn(
            self, seq_id, prompt, total_tokens=total_tokens, reuse_live=reuse_live,
            extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
            cache_salt=cache_salt, skip_lookup=skip_lookup, max_cached_tokens=max_cached_tokens)

    def restart_prepared_turn_cold(self, seq_id: Hashable, prompt, total_tokens: int) -> int:
        """Discard a prepared hit: release, reset, forced miss, allocate. Returns new blocks.
        Throwing away a hit that the cold tier restored tells the tier (it counts
        ``restore_suppressed``)."""
        return turns.restart_prepared_turn_cold(self, seq_id, prompt, total_tokens)

    # --- read-only views ------------------------------------------------------------------

    def num_table_blocks(self, seq_id: Hashable) -> int:
        return int(self._group.num_blocks[self._row(seq_id)])

    def physical_revision(self, seq_id: Hashable) -> int:
        return int(self._group.revision[self._row(seq_id)])

    def block_table(self, seq_id: Hashable) -> np.ndarray:
        """A copy of the row's used entries (int32)."""
        row = self._row(seq_id)
        return self._group.table[row, :self._group.num_blocks[row]].copy()

    def block_tables_array(self, seq_ids: Sequence[Hashable], width: int | None = None
                           ) -> tuple[np.ndarray, int]:
        """``int32[len(seq_ids), width]`` tables padded with -1, and the pool generation."""
        rows = self._rows.rows(seq_ids)
        table = self._group.table
        need = int(self._group.num_blocks[rows].max(initial=0))
        width = need if width is None else as_count(width, "width")
        if width < need:
            raise InvalidArgument(f"width = {width} is narrower than the widest table ({need})")
        out = np.full((len(rows), width), -1, np.int32)
        w = min(width, table.shape[1])
        out[:, :w] = table[rows, :w]
        return out, self.pool.generation
