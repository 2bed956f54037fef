"""The hybrid model's paged KV path: one sequence of a
:class:`~pagedkv.coordinator.GroupedKVCoordinator` seen as a
:class:`~pagedkv.tiny_model.hybrid_kv.HybridKVPath` (docs/tiny-model.md, "The paged KV
path").

Full and sliding layers live in the coordinator's groups (one group per kind; the KV-shared
alias routes to its anchor); the gated delta net's conv and recurrent states are the
sequence's own, outside the pool, exactly as an engine keeps them. The same forward pass
runs over this path and over :class:`~pagedkv.tiny_model.hybrid_kv.HybridFlatKV`, so the
two give bit-identical logits.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.tiny_model.hybrid_config import FULL_ATTENTION, LINEAR_ATTENTION, HybridConfig
from pagedkv.tiny_model.hybrid_kv import LinearStateHolder
from pagedkv.tiny_model.hybrid_state import HybridSnapshot

__all__ = ["HybridPagedKV", "build_hybrid_coordinator", "hybrid_layer_specs"]


def hybrid_layer_specs(config: HybridConfig, *, block_size: int, dtype: str = "float32"):
    """The coordinator's layer specs of ``config``: one per full or sliding layer (a
    KV-shared alias names its anchor), none for a linear layer (its state is not paged)."""
    from pagedkv.coordinator import AttentionKind, KVCachePhysicalLayout, LayerKVCacheSpec

    if not isinstance(config, HybridConfig):
        raise InvalidArgumentType(f"config must be a HybridConfig, got {type(config).__name__}")
    layout = KVCachePhysicalLayout(block_size, config.num_kv_heads, config.head_dim, dtype)
    specs = []
    for layer, kind in enumerate(config.layer_types):
        if kind == LINEAR_ATTENTION:
            continue
        attention = (AttentionKind.FULL if kind == FULL_ATTENTION
                     else AttentionKind.sliding(config.sliding_window))
        specs.append(LayerKVCacheSpec(layer, attention, layout,
                                      shared_kv_anchor=config.kv_anchor(layer)))
    return specs


def build_hybrid_coordinator(config: HybridConfig, *, block_size: int = 8,
                             blocks_per_group=None, max_blocks_per_group=None,
                             max_model_len: int | None = None, max_chunk: int = 32,
                             max_num_seqs: int = 8, memory_bytes: int | None = None,
                             backend: str = "numpy", hash_seed: int | None = None, cold=None,
                             checkpoints: bool | object = True, checkpoint_entries: int = 64,
                             checkpoint_retention=None, hot_reuse: bool = True):
    """A float32 :class:`~pagedkv.coordinator.GroupedKVCoordinator` for ``config``: a full
    group, a sliding group (the alias shares its anchor's), the aux latch on (the model keeps
    recurrent state) and, with ``checkpoints=True``, a state checkpoint store (hot hits stop
    at a boundary whose state was published; ``checkpoint_retention`` picks its victims). ``max_blocks_per_group`` larger than
    ``blocks_per_group`` makes those pools grow on demand."""
    from pagedkv.coordinator import GroupedKVCoordinator

    needs_state = bool(config.linear_attention_layers)
    return GroupedKVCoordinator.from_specs(
        hybrid_layer_specs(config, block_size=block_size),
        max_model_len=config.max_position if max_model_len is None else max_model_len,
        max_chunk=max_chunk, max_num_seqs=max_num_seqs, memory_bytes=memory_bytes,
        backend=backend, hash_seed=hash_seed, cold=cold,
        checkpoints=checkpoints if needs_state else False,
        checkpoint_entries=checkpoint_entries, checkpoint_retention=checkpoint_retention,
        requires_aux_confirmation=needs_state,
        hot_reuse=hot_reuse, blocks_per_group=blocks_per_group,
        max_blocks_per_group=max_blocks_per_group)


class HybridPagedKV(LinearStateHolder):
    """One sequence of a grouped coordinator as the hybrid model's KV path.

    ``extend`` records tokens in every group (after pointing the sliding entries no later
    query attends at the null block: the K/V of every recorded token is written by then);
    ``write``/``read`` go through the layer's route; the linear layers' states are held
    here, ``float32`` zeros before the first token (``mx.array`` on ``backend="mlx"``).
    """

    def __init__(self, cache, seq_id: Hashable, config: HybridConfig,
                 backend: str = "numpy") -> None:
        if not isinstance(config, HybridConfig):
            raise InvalidArgumentType(
                f"HybridPagedKV needs a HybridConfig, got {type(config).__name__}")
        if backend not in ("numpy", "mlx"):
            raise InvalidArgument(f"backend={backend!r}: expected 'numpy' or 'mlx'")
        self.cache = cache
        self.seq_id = seq_id
        self.config = config
        self._backend = backend
        self._sliding = tuple(config.physical_sliding_layers)
        #: Sliding blocks this path's prunes returned to the null sentinel.
        self.blocks_nulled = 0
        self._zero_linear_states()

    def __repr__(self) -> str:
        return (f"HybridPagedKV(seq_id={self.seq_id!r}, num_tokens={self.num_tokens}, "
                f"backend={self._backend!r})")

    # --- HybridKVPath ------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return self.cache.num_tokens(self.seq_id)

    def extend(self, tokens: np.ndarray) -> None:
        if self._sliding:
            self.blocks_nulled += self.cache.prune_sliding_all(self.seq_id, self.num_tokens)
        self.cache.record_tokens(self.seq_id, tokens)

    def write(self, layer: int, k: Any, v: Any) -> None:
        self.cache.write_kv(self.seq_id, layer, k, v)

    def read(self, layer: int, first: int = 0) -> tuple[Any, Any]:
        return self.cache.gather_kv(self.seq_id, layer, start=first)

    # --- state at a boundary -----------------------------------------------------------------

    def snapshot(self) -> HybridSnapshot:
        """The out-of-pool state at ``num_tokens = b`` (between forward calls): the linear
        states and the sliding rows ``[b - min(b, W), b)`` read back from the sliding group
        (heads-major). ``InvalidArgument`` when those rows were already pruned: take it
        right after the forward that ends at ``b``."""
        c = self.config
        b = self.num_tokens
        first = b - min(b, c.sliding_window)
        keys, values = [], []
        for layer in self._sliding:
            k, v = self.cache.gather_kv(self.seq_id, layer, start=first)
            keys.append(np.asarray(k).transpose(1, 0, 2))
            values.append(np.asarray(v).transpose(1, 0, 2))
        return HybridSnapshot.build(c, b, *self._linear_arrays(), keys, values)

    def install_linear_states(self, boundary_tokens: int, conv_states, recurrent_states
                              ) -> None:
        """Resume the linear layers at ``boundary_tokens``, which must be where the sequence
        stands (its hit): one ``[K - 1, conv_dim]`` and one ``[Hv, Dv, Dk]`` float32 array per
        linear layer, in ``linear_attention_layers`` order (copied). Confirms the coordinator's
        aux latch for that boundary. The sliding rows are the sliding group's blocks."""
        c = self.config
        b = self.num_tokens
        if int(boundary_tokens) != b:
            raise InvalidArgument(f"state at {boundary_tokens} tokens, but seq_id "
                                  f"{self.seq_id!r} stands at {b}")
        layers = c.linear_attention_layers
        convs, recs = list(conv_states), list(recurrent_states)
        if len(convs) != len(layers) or len(recs) != len(layers):
            raise InvalidArgument(f"{len(convs)} conv and {len(recs)} recurrent states for "
                                  f"the {len(layers)} linear layers {layers}")
        checked = []
        for layer, conv, rec in zip(layers, convs, recs, strict=True):
            conv, rec = np.asarray(conv), np.asarray(rec)
            if (conv.dtype, conv.shape) != (np.float32, c.conv_state_shape) or \
                    (rec.dtype, rec.shape) != (np.float32, c.recurrent_state_shape):
                raise InvalidArgument(
                    f"layer {layer}: states {conv.dtype}{conv.shape} / {rec.dtype}{rec.shape}, "
                    f"expected float32{c.conv_state_shape} / float32{c.recurrent_state_shape}")
            checked.append((layer, conv, rec))
        for layer, conv, rec in checked:
            self._install_linear_state(layer, conv, rec)
        self.cache.confirm_aux_prefix_primed(self.seq_id, b)

    def sliding_rows_live(self) -> bool:
        """Whether the sliding rows a snapshot at ``num_tokens`` needs are still held."""
        b = self.num_tokens
        first = b - min(b, self.config.sliding_window)
        return all(self.cache.first_live_position(self.seq_id, g) <= first
                   for g in self._sliding_group_ids())

    def _sliding_group_ids(self) -> set[int]:
        return {self.cache.route_for_layer(layer).group_id for layer in self._sliding}

