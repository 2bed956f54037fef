"""The paged layout of an mlx-lm model: its K/V geometry, its layer specs and the grouped
coordinator that serves them (docs/integrations/mlx-lm.md, "How it works").

mlx-lm has no uniform geometry API (config field names differ per architecture), so the
geometry is read from one 1-token forward through mlx-lm's own caches: the K/V shape and dtype
of every ``KVCache`` / ``RotatingKVCache`` entry and the arrays of every ``ArraysCache``. Each
K/V entry becomes a :class:`~pagedkv.coordinator.LayerKVCacheSpec` (full, or sliding with its
window; a KV-shared layer an alias of its anchor); the coordinator groups them by kind and
layout, one allocator and one MLX pool per group, each growing on demand up to its max.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.argument_checks import is_int
from pagedkv.errors import InvalidArgument, TopologyError, UnsupportedModel
from pagedkv.integrations.mlx_lm.layer_kinds import LayerKind, LayerSpec

__all__ = [
    "POOL_DTYPES",
    "KVGeometry",
    "ModelLayout",
    "build_coordinator",
    "dtype_name",
    "layer_kv_specs",
    "model_layout",
    "plan_groups",
]

#: Unquantized pool dtypes a paged prompt cache stores; it also stores every KV mode
#: (``"q8"``, ``"fwht4/q8"``, ``"fwht4/fwht4"``, ``"fwht4/lloyd4"``, ...: docs/kv-quant.md).
POOL_DTYPES = ("float16", "bfloat16", "float32")
#: Blocks a group's pool starts with when neither ``initial_blocks`` nor the env knob says.
DEFAULT_INITIAL_BLOCKS = 64
#: Prefill chunk (tokens) a sliding group's admission blocks assume: mlx-lm's
#: ``prefill_step_size`` default.
PREFILL_CHUNK_TOKENS = 2048
#: The coordinator's row limit in tokens (block tables and slots are int32/int64).
_MAX_ROW_TOKENS = (1 << 31) - 1


def dtype_name(dtype) -> str:
    """An ``mx.Dtype``, NumPy dtype or name as one of the pool dtype names, or a KV mode
    (``"q8"``, ``"<K mode>/<V mode>"``) normalized as the pool spells it."""
    from pagedkv.quant import kv as kv_modes

    text = str(dtype)
    name = text.rsplit(".", 1)[-1]
    if name in POOL_DTYPES:
        return name
    try:
        return kv_modes.join_kv_dtype(*kv_modes.split_kv_dtype(text))
    except InvalidArgument as exc:
        raise InvalidArgument(
            f"dtype: {dtype!r} is not a paged prompt-cache dtype; use one of "
            f"{list(POOL_DTYPES)} or a KV mode such as 'q8', 'fwht4/q8', 'fwht4/fwht4' or "
            f"'fwht4/lloyd4' (docs/kv-quant.md; the KV-mode check says: {exc})") from None


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """One K/V entry of the cache list: ``num_kv_heads`` x ``head_dim`` of ``dtype`` (the
    model's K/V dtype name)."""

    num_kv_heads: int
    head_dim: int
    dtype: str


@dataclass(frozen=True)
class ModelLayout:
    """What a model's cache list holds: ``layers`` (every entry, then the KV-shared layers),
    the K/V geometry of each K/V entry (``kv``, by entry index) and the array shapes and
    dtypes of each recurrent entry (``states``: entry index -> ``((shape, dtype name),
    ...)``, batch axis included)."""

    model_type: str
    layers: tuple[LayerSpec, ...]
    kv: dict[int, KVGeometry]
    states: dict[int, tuple[tuple[tuple[int, ...], str], ...]]

    @property
    def num_caches(self) -> int:
        """Entries of the cache list (``prompt_cache=`` has this many)."""
        return sum(1 for s in self.layers if s.kind is not LayerKind.SHARED)

    def of_kind(self, kind: LayerKind) -> tuple[LayerSpec, ...]:
        return tuple(s for s in self.layers if s.kind is kind)


def model_layout(model, specs: tuple[LayerSpec, ...], model_type: str) -> ModelLayout:
    """Read the K/V geometry of every K/V entry and the state arrays of every recurrent entry
    from one 1-token forward through ``make_prompt_cache(model)``. ``UnsupportedModel`` when
    an entry's K and V have different head dims or dtypes (MLA-style caches)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    kv: dict[int, KVGeometry] = {}
    states: dict[int, tuple[tuple[tuple[int, ...], str], ...]] = {}
    for spec in specs:
        if spec.kind in (LayerKind.FULL, LayerKind.SLIDING):
            c = caches[spec.index]
            k, v = c.keys, c.values
            if k.shape[3] != v.shape[3] or k.dtype != v.dtype:
                raise UnsupportedModel(
                    f"model_type {model_type!r}: {spec}: K is [.., {k.shape[3]}] {k.dtype} and "
                    f"V [.., {v.shape[3]}] {v.dtype}; a pool stores K and V of one head_dim "
                    "and dtype (MLA-style caches are not paged)", layer=spec.index,
                    kind=spec.kind.value, missing="K and V of one head_dim")
            kv[spec.index] = KVGeometry(int(k.shape[1]), int(k.shape[3]), dtype_name(k.dtype))
        elif spec.kind is LayerKind.RECURRENT:
            arrays = caches[spec.index].cache
            if any(a is None for a in arrays):
                raise UnsupportedModel(
                    f"model_type {model_type!r}: {spec} kept no state after a forward, so "
                    "there is nothing to checkpoint", layer=spec.index, kind="recurrent",
                    missing="recurrent state arrays")
            states[spec.index] = tuple((tuple(int(d) for d in a.shape), str(a.dtype).rsplit(
                ".", 1)[-1]) for a in arrays)
    return ModelLayout(model_type, specs, kv, states)


def layer_kv_specs(layout: ModelLayout, block_size: int, pool_dtype: str | None):
    """One :class:`~pagedkv.coordinator.LayerKVCacheSpec` per K/V entry (indexed by its
    position in the cache list) and one alias per KV-shared layer."""
    from pagedkv.coordinator import AttentionKind, KVCachePhysicalLayout, LayerKVCacheSpec

    out = []
    for spec in layout.layers:
        if spec.kind in (LayerKind.FULL, LayerKind.SLIDING):
            g = layout.kv[spec.index]
            if spec.kind is LayerKind.FULL:
                kind = AttentionKind.FULL
            else:
                assert spec.window is not None  # layer_specs gives every sliding one
                kind = AttentionKind.sliding(spec.window)
            out.append(LayerKVCacheSpec(spec.index, kind, KVCachePhysicalLayout(
                block_size, g.num_kv_heads, g.head_dim, pool_dtype or g.dtype)))
    by_index = {s.layer_index: s for s in out}
    for spec in layout.of_kind(LayerKind.SHARED):
        assert spec.anchor is not None  # layer_specs gives every shared one
        anchor = by_index[spec.anchor]
        out.append(LayerKVCacheSpec(spec.index, anchor.kind, anchor.layout,
                                    shared_kv_anchor=spec.anchor))
    return out


def _block_counts(groups, config, context_tokens: int, max_blocks: int | None,
                  initial_blocks: int | None) -> tuple[int, int]:
    """``(initial, max)`` blocks of every group's pool. One group: the pool sizing rules
    (docs/pool.md, "Sizing"); several: the same block count for each, sized so that all of
    them together hold one full context (or ``PAGEDKV_PAGED_CACHE_MEMORY_MB``)."""
    from pagedkv.sizing import MIB, resolve_pool_sizing

    if len(groups) == 1:
        g = groups[0]
        # environ={}: the caller's config already carries the env (with_env), and applying
        # it again logged a second WARNING for each unparseable knob.
        sizing = resolve_pool_sizing(g.layout.pool_geometry(g.num_physical_layers), config,
                                     max_model_len=context_tokens, environ={})
        top, initial = sizing.max_blocks, (
            sizing.initial_blocks if config.initial_memory_mb is not None else None)
    else:
        per_block = sum(g.bytes_per_block for g in groups)
        if config.memory_mb is not None:
            top = config.memory_mb * MIB // per_block
            if top < 2:
                raise InvalidArgument(
                    f"PAGEDKV_PAGED_CACHE_MEMORY_MB: {config.memory_mb} MiB holds {top} blocks "
                    f"of {per_block} bytes over the model's {len(groups)} groups; it needs 2")
        else:
            top = math.ceil(context_tokens / groups[0].block_size) + 1  # + a null block
        initial = None
        if config.initial_memory_mb is not None:
            initial = min(config.initial_memory_mb * MIB // per_block, top)
            if initial == 0:  # as initial_pool_blocks: an explicit 0 is a load error
                raise InvalidArgument(
                    f"initial pool cannot hold one block: initial_memory_mb="
                    f"{config.initial_memory_mb} (PAGEDKV_PAGED_CACHE_INITIAL_MB) < {per_block} "
                    f"bytes per block over the model's {len(groups)} groups; unset it for a "
                    "fixed pool or raise it")
    if max_blocks is not None:
        if not is_int(max_blocks) or max_blocks < 2:
            raise InvalidArgument(f"max_blocks: {max_blocks!r} must be an int >= 2")
        top = int(max_blocks)
    if initial_blocks is not None:
        initial = int(initial_blocks)
    if initial is None:
        initial = DEFAULT_INITIAL_BLOCKS
    return max(2, min(int(initial), top)), top


def plan_groups(layout: ModelLayout, block_size: int, pool_dtype: str | None,
                context_tokens: int):
    """``(layer specs, KV-cache groups)`` of the model (docs/coordinator.md, "Grouping and
    admission blocks"). A layout the coordinator refuses raises ``UnsupportedModel`` naming
    the model and the topology error."""
    from pagedkv.coordinator import group_layer_kv_cache_specs

    specs = layer_kv_specs(layout, block_size, pool_dtype)
    try:
        groups = group_layer_kv_cache_specs(specs, context_tokens, PREFILL_CHUNK_TOKENS)
    except TopologyError as exc:
        raise UnsupportedModel(
            f"model_type {layout.model_type!r}: its layers cannot be paged as one topology: "
            f"{exc} (docs/coordinator.md, 'Topology errors')") from exc
    return specs, groups


def build_coordinator(specs, groups, *, block_size: int, context_tokens: int, config,
                      max_blocks: int | None, initial_blocks: int | None, cold=None,
                      checkpoints=None):
    """The :class:`~pagedkv.coordinator.GroupedKVCoordinator` of the model's
    :func:`plan_groups`: one allocator and one MLX pool per group, growing on demand, the
    KV-shared layers as aliases; ``checkpoints(hasher)`` builds the state checkpoint store of
    a model with recurrent layers."""
    from pagedkv.adapter.group_blocks import GroupBlocks
    from pagedkv.allocator import BlockAllocator
    from pagedkv.coordinator import GroupedKVCoordinator, KVCacheCoordinator, SlidingGroupBlocks
    from pagedkv.pool import LayerKVPool

    initial, top = _block_counts(groups, config, context_tokens, max_blocks, initial_blocks)
    managers: list[GroupBlocks | SlidingGroupBlocks] = []
    for g in groups:
        allocator = BlockAllocator(initial, top, block_size,
                                   reserve_null_block=g.kind.is_sliding)
        pool = LayerKVPool(g.layout.pool_geometry(g.num_physical_layers), initial, top,
                           backend="mlx")
        if g.kind.is_sliding:
            managers.append(SlidingGroupBlocks(allocator, pool, g.kind.window,
                                               growth=top > initial,
                                               max_admission_blocks=g.max_admission_blocks))
        else:
            managers.append(GroupBlocks(allocator, pool, growth=top > initial))
    topology = KVCacheCoordinator.from_groups(specs, groups, managers)
    store = None
    if checkpoints is not None:
        store = checkpoints(managers[0].allocator)
    # No token limit of its own: the pools' max bounds a row, as mlx-lm's caches have none.
    return GroupedKVCoordinator(topology, max_model_len=_MAX_ROW_TOKENS, cold=cold, checkpoints=store,
                                requires_aux_confirmation=store is not None)
