"""Shared builders and state snapshots for the grouped-coordinator tests
(docs/coordinator.md)."""

from __future__ import annotations

import numpy as np

from allocator_implementations import observables
from pagedkv.coordinator import (
    AttentionKind,
    GroupedKVCoordinator,
    KVCachePhysicalLayout,
    LayerKVCacheSpec,
)

FULL = AttentionKind.FULL


def layout(block_size: int = 4) -> KVCachePhysicalLayout:
    return KVCachePhysicalLayout(block_size, 1, 2, "float32")


def full_sliding_alias(*, window: int = 8, block_size: int = 4, blocks=(64, 64),
                       max_model_len: int = 256, max_chunk: int = 8, hot_reuse: bool = True,
                       checkpoints=False, alias: bool = True, **kwargs) -> GroupedKVCoordinator:
    """Layer 0 full, layer 1 sliding(window), layer 2 a KV-shared alias of layer 0."""
    lay = layout(block_size)
    specs = [LayerKVCacheSpec(0, FULL, lay), LayerKVCacheSpec(1, AttentionKind.sliding(window), lay)]
    if alias:
        specs.append(LayerKVCacheSpec(2, FULL, lay, shared_kv_anchor=0))
    return GroupedKVCoordinator.from_specs(
        specs, max_model_len=max_model_len, max_chunk=max_chunk, blocks_per_group=blocks,
        hash_seed=0, hot_reuse=hot_reuse, checkpoints=checkpoints, **kwargs)


def state(cache: GroupedKVCoordinator) -> dict:
    """Everything observable: each group's allocator, pool bytes and tables, every row's
    tokens and counts, the counters."""
    out: dict = {"stats": cache.stats(), "groups": []}
    for g in cache.groups:
        out["groups"].append({
            "allocator": observables(g.allocator),
            "pool": [g.pool.read_block(b).tobytes() for b in range(g.pool.num_blocks)],
            "generation": g.pool.generation,
        })
    out["rows"] = {
        s: (cache.request_tokens(s).tolist(), cache.cached_token_count(s),
            [cache.block_table(s, gid).tolist() for gid in range(len(cache.groups))],
            [cache.physical_revision(s, gid) for gid in range(len(cache.groups))])
        for s in cache.live_seq_ids()}
    return out


def prefill(cache, seq, tokens, *, chunk: int = 8, start: int = 0, value=None) -> None:
    """Record ``tokens[start:]`` in chunks, write each physical layer's K/V (position-coded
    unless ``value``), and prune after each chunk."""
    tokens = np.asarray(tokens, np.uint32)
    for lo in range(start, len(tokens), chunk):
        part = tokens[lo:lo + chunk]
        cache.record_tokens(seq, part)
        pos = np.arange(lo, lo + len(part), dtype=np.float32)
        for route in cache.topology.routes:
            if route.is_alias:
                continue
            kv = np.repeat((pos if value is None else np.full(len(part), value, np.float32))
                           [:, None, None] + route.layer_index, 2, axis=2).astype(np.float32)
            cache.write_kv(seq, route.layer_index, kv, kv + 0.5)
        cache.prune_sliding_all(seq, cache.num_tokens(seq))
