"""The restore walk and transactional block restore (cold-tier.md §8.4, §8.6).

Extends a hot hit with blocks from disk: stop at the first hole, verify every object
(checksum, geometry, fingerprint, tokens), write it into a freshly allocated block, and
publish the whole run at once with ``publish_restored_batch``. Nothing is published before
every block of the run was written; a refused publish frees everything it took.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass

import numpy as np

from pagedkv.cold.codec import BlockGeometry
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.keys import cold_key_chain
from pagedkv.cold.extra_keys import per_block_extra_keys
from pagedkv.hashing import as_token_array
from pagedkv.identity import BlockIdentity, RestoredBlock, extra_keys_digest

__all__ = ["RestoreDecline", "RestoreOutcome", "restore_walk", "EMPTY_BLOCKS"]

log = logging.getLogger("pagedkv.cold")

EMPTY_BLOCKS = np.empty(0, dtype=np.int32)


class RestoreDecline(enum.Enum):
    """Why a walk was refused before (or instead of) publishing."""

    PARENT_CHAIN_UNAVAILABLE = "parent_chain_unavailable"
    NO_BACKED_BOUNDARY = "no_backed_boundary"
    RESTORE_SHORT_OF_BOUNDARY = "restore_short_of_boundary"
    PUBLISH_REFUSED = "publish_refused"


@dataclass(frozen=True)
class RestoreOutcome:
    """``blocks``: restored and published; ``base``: the hot hit; ``limit``: where the
    index said the chain ends; ``decline``: why nothing was published, if refused."""

    blocks: int
    base: int
    limit: int
    elapsed_ms: float
    decline: RestoreDecline | None = None


def _restore_block(tier, key: bytes, fp_hex: str, geometry: BlockGeometry, want_tokens,
                   pool, allocator, buffer: bytearray):
    """Load, verify and upload one block into a new unpublished block.
    Returns ``(block_id, nbytes)`` or ``None`` after counting exactly one miss."""
    block = tier.store.load_block(key, fingerprint_hex=fp_hex, expected=geometry,
                                  buffer=buffer)
    if block is None:
        return None  # load_block counted the miss
    if not np.array_equal(block.tokens, want_tokens):
        tier.counters.add("misses")
        log.warning("cold tier: object %s holds other tokens than its key's chain",
                    key.hex()[:16])
        return None
    block_id = allocator.allocate()
    if block_id is None:
        tier.counters.add("misses")
        return None
    try:
        pool.write_block(int(block_id), block.payload)
    except Exception as exc:
        allocator.free(block_id)
        tier.counters.add("misses")
        log.warning("cold tier: upload of restored block failed: %s", exc)
        return None
    return int(block_id), block.nbytes


def restore_walk(tier, fingerprint: bytes, *, tokens, hot_blocks, cache_salt: int = 0,
                 extra_keys=(), extra_keys_per_block=None, pool, allocator
                 ) -> tuple[np.ndarray, RestoreOutcome]:
    """Restore the persisted blocks after the hot hit; returns the new block ids (one
    reference each, owned by the caller) and the outcome."""
    t0 = time.monotonic()
    toks = as_token_array(tokens)
    geometry = BlockGeometry.of(pool.geometry)
    bs = geometry.block_size
    base = hot_blocks if isinstance(hot_blocks, (int, np.integer)) else len(hot_blocks)
    base = int(base)
    full = len(toks) // bs
    if base >= full:
        return EMPTY_BLOCKS, RestoreOutcome(0, base, base, 0.0)
    lookup = toks[:full * bs]
    key_kwargs = ({"extra_keys_per_block": extra_keys_per_block}
                  if extra_keys_per_block is not None else {"extra_keys": tuple(extra_keys)})
    hashes = np.asarray(allocator.chain_hashes(lookup, cache_salt=cache_salt, **key_kwargs),
                        dtype=np.uint64)
    full = min(full, len(hashes))
    keys = cold_key_chain(tier.fmt, ColdGroup.KV, fingerprint, lookup, bs,
                          extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
                          cache_salt=cache_salt, max_blocks=full)
    if len(keys) < base:
        tier.counters.add("restore_declines")
        return EMPTY_BLOCKS, RestoreOutcome(0, base, base, 0.0,
                                            RestoreDecline.PARENT_CHAIN_UNAVAILABLE)
    ceiling = base
    while ceiling < len(keys) and tier.contains(keys[ceiling]):
        ceiling += 1
    if ceiling == base:
        return EMPTY_BLOCKS, RestoreOutcome(0, base, base, 0.0)
    limit = ceiling
    fp_hex = fingerprint.hex()
    buffer = bytearray(geometry.bound + 1)  # reused: each block is uploaded before the next load
    taken: list[tuple[int, int]] = []
    for idx in range(base, limit):
        got = _restore_block(tier, keys[idx], fp_hex, geometry, lookup[idx * bs:(idx + 1) * bs],
                             pool, allocator, buffer)
        if got is None:
            break
        taken.append(got)
    if not taken:
        return EMPTY_BLOCKS, RestoreOutcome(0, base, limit, (time.monotonic() - t0) * 1e3)
    keys_per_block = per_block_extra_keys(base + len(taken), extra_keys, extra_keys_per_block)
    entries = []
    for j, (block_id, _) in enumerate(taken):
        idx = base + j
        identity = BlockIdentity(lookup[idx * bs:(idx + 1) * bs],
                                 int(hashes[idx - 1]) if idx else 0,
                                 extra_keys_digest(keys_per_block[idx]), int(cache_salt), idx)
        entries.append(RestoredBlock(block_id, int(hashes[idx]), identity))
    ids = np.fromiter((b for b, _ in taken), dtype=np.int32, count=len(taken))
    try:
        published = bool(allocator.publish_restored_batch(entries))
    except Exception as exc:
        log.warning("cold tier: publish_restored_batch raised: %s", exc)
        published = False
    elapsed_ms = (time.monotonic() - t0) * 1e3
    if not published:
        allocator.free_many(ids)
        tier.counters.add("restore_declines")
        return EMPTY_BLOCKS, RestoreOutcome(0, base, limit, elapsed_ms,
                                            RestoreDecline.PUBLISH_REFUSED)
    tier.counters.add("hits", len(taken))
    tier.counters.add("bytes_restored", sum(n for _, n in taken))
    log.debug("cold_restore_walk blocks=%d base=%d limit=%d elapsed_ms=%.3f "
              "per_block_ms=%.4f", len(taken), base, limit, elapsed_ms,
              elapsed_ms / len(taken))
    return ids, RestoreOutcome(len(taken), base, limit, elapsed_ms)
