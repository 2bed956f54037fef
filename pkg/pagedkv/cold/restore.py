"""The restore walk and transactional block restore (docs/contracts/cold-tier.md, '8.4 Restore walk
and reconcile-down' and '8.6 Transactional block restore'; docs/cold.md,
"Capture and restore" and "Reconcile-down").

Extends a hot hit with blocks from disk: stop at the first hole, verify every object
(checksum, geometry, fingerprint, tokens), write it into a freshly allocated block, and
publish the whole run at once with ``publish_restored_batch``. Nothing is published before
every block of the run was written; a refused publish frees everything it took.

With a sidecar policy the K/V chain only *proposes* a length: the walk reconciles it down to
the deepest boundary whose sidecar loads and validates, restores nothing when none does,
and never publishes K/V without the sidecar that backs it.
"""

from __future__ import annotations

import enum
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from pagedkv.cold.codec import BlockGeometry, DecodedBlock
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.keys import cold_key_chain
from pagedkv.cold.sidecar import RestoredSidecar
from pagedkv.cold.sidecar_bundle import RestoredSidecars, policies_of, restored_for
from pagedkv.hashing import as_token_array, per_block_extra_keys
from pagedkv.identity import BlockIdentity, RestoredBlock, extra_keys_digest

__all__ = [
    "EMPTY_BLOCKS",
    "LOADER_THREADS",
    "LOAD_AHEAD_BLOCKS",
    "RestoreDecline",
    "RestoreOutcome",
    "deepest_backed_boundary",
    "restore_walk",
]

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
    walk aimed (the index's ceiling, or the deepest backed boundary under a policy, in
    blocks); ``decline``: why nothing was published, if refused; ``sidecar_tokens``: the
    boundary of the sidecar returned with the blocks (0: none)."""

    blocks: int
    base: int
    limit: int
    elapsed_ms: float
    decline: RestoreDecline | None = None
    sidecar_tokens: int = 0


#: Blocks loaded and verified ahead of the one being uploaded, on the tier's loader threads
#: (``LOADER_THREADS``). Reading and SHA-256 release the GIL, so several blocks verify in
#: parallel; results are still consumed in chain order and the walk stops at the first
#: failure. 0 loads on the calling thread.
LOAD_AHEAD_BLOCKS = 4
LOADER_THREADS = 2


class _LoadAhead:
    """Loads ``keys[idx]`` for ``idx`` in ``[start, stop)`` in order, up to
    ``LOAD_AHEAD_BLOCKS`` ahead, each into its own buffer. A buffer is reused only after the
    walk is done with the block that used it."""

    def __init__(self, tier, keys, start: int, stop: int, fp_hex: str,
                 geometry: BlockGeometry) -> None:
        self.tier, self.keys, self.stop, self.fp_hex, self.geometry = \
            tier, keys, stop, fp_hex, geometry
        self.buffers = [bytearray(geometry.bound + 1) for _ in range(LOAD_AHEAD_BLOCKS + 1)]
        # The directory loads each block from its file; a remote backend fetches the run in
        # pipelined round trips and verifies each object here, on the loader threads.
        self.source = tier.store.chain_source(keys, start, stop, geometry.bound)
        self.pending: dict[int, Future[DecodedBlock | None]] = {}
        self.next = start
        self.ahead = LOAD_AHEAD_BLOCKS
        self.executor = tier.loader() if self.ahead else None

    def _load(self, idx: int) -> DecodedBlock | None:
        return self.source.load_block(self.keys[idx], fingerprint_hex=self.fp_hex,
                                      expected=self.geometry,
                                      buffer=self.buffers[idx % len(self.buffers)])

    def get(self, idx: int) -> DecodedBlock | None:
        """The verified block ``idx`` (a ``DecodedBlock``) or ``None`` (a counted miss)."""
        if self.executor is None:  # LOAD_AHEAD_BLOCKS == 0: load on the calling thread
            return self._load(idx)
        while self.next < min(idx + self.ahead, self.stop):
            self.pending[self.next] = self.executor.submit(self._load, self.next)
            self.next += 1
        return self.pending.pop(idx).result()

    def close(self) -> None:
        """Wait for loads already running (their counters settle before the walk returns)
        and drop the rest."""
        for fut in self.pending.values():
            if not fut.cancel():
                fut.result()
        self.pending.clear()


def _upload(tier, block, want_tokens, pool, allocator):
    """Check the tokens, allocate and write one verified block, unpublished.
    Returns the block id or ``None`` after counting exactly one miss."""
    if not np.array_equal(block.tokens, want_tokens):
        tier.counters.add("misses")
        log.warning("cold tier: an object holds other tokens than its key's chain")
        return None
    block_id = allocator.allocate()
    if block_id is None:
        tier.counters.add("misses")
        return None
    try:
        pool.write_block(int(block_id), block.payload)
    except Exception as exc:  # noqa: BLE001 - any upload failure is one counted miss
        allocator.free(block_id)
        tier.counters.add("misses")
        log.warning("cold tier: upload of restored block failed: %s", exc)
        return None
    return int(block_id)


def deepest_backed_boundary(tier, policy, sidecar_keys, floor: int, ceiling: int,
                            block_size: int, fingerprint_hex: str
                            ) -> tuple[int, RestoredSidecar | RestoredSidecars] | None:
    """``(count, sidecar)`` for the largest ``count`` in ``(floor, ceiling]`` (blocks) whose
    sidecar (key ``sidecar_keys[count - 1]``) is indexed and loads with exactly
    ``policy.expected_at(count * block_size)``; ``None`` when no boundary is backed. Each
    failed load is a counted miss (a corrupt one also a corruption, pruned); never a hit.

    ``policy`` may be a bundle's tuple of policies (``sidecar_keys`` then one key chain per
    policy): a boundary is backed only when every part's sidecar there loads, and the
    result is a :class:`~pagedkv.cold.sidecar_bundle.RestoredSidecars`."""
    policies = policies_of(policy)
    chains = [sidecar_keys] if len(policies) == 1 else list(sidecar_keys)
    # Another replica's sidecars are in no local index yet: a remote backend asks for the
    # whole range in one round trip per part.
    for chain, p in zip(chains, policies, strict=True):
        tier.store.learn_presence(list(chain[int(floor):int(ceiling)]), p.group)
    for count in range(int(ceiling), int(floor), -1):
        keys = [chain[count - 1] for chain in chains]
        if not all(tier.contains_in(k, p.group) for k, p in zip(keys, policies, strict=True)):
            continue
        found = []
        for key, p in zip(keys, policies, strict=True):
            layout = p.expected_at(count * block_size)
            assert layout is not None  # count >= 1
            payload = tier.store.load_sidecar(key, layout, fingerprint_hex=fingerprint_hex)
            if payload is None:
                break
            found.append(RestoredSidecar(layout, payload, key))
        if len(found) == len(policies):
            return count, restored_for(policies, found)
    return None


def _declined(tier, base, limit, t0, decline):
    tier.counters.add("restore_declines")
    log.debug("cold_restore_walk declined: %s base=%d limit=%d", decline.value, base, limit)
    return EMPTY_BLOCKS, RestoreOutcome(0, base, limit, (time.monotonic() - t0) * 1e3,
                                        decline), None


def restore_walk(tier, fingerprint: bytes, *, tokens, hot_blocks, cache_salt: int = 0,
                 extra_keys=(), extra_keys_per_block=None, pool, allocator, policy=None,
                 exact_boundary: bool = False, geometry=None
                 ) -> tuple[np.ndarray, RestoreOutcome,
                            RestoredSidecar | RestoredSidecars | None]:
    """Restore the persisted blocks after the hot hit; returns the new block ids (one
    reference each, owned by the caller), the outcome and, with a ``policy`` (a
    ``ColdSidecarPolicy``, or a ``SidecarBundle``'s tuple of them), the sidecar backing the
    result: whenever blocks are returned, ``sidecar.boundary_tokens == (base + blocks) *
    block_size``.

    ``exact_boundary`` (prefixes whose inputs cannot be rebuilt from token ids): the backed
    boundary must be the K/V chain's whole proposal, else nothing is restored.

    ``geometry``: the pool geometry ``fingerprint`` belongs to (default: the pool's now);
    every loaded block must have it.
    """
    t0 = time.monotonic()
    toks = as_token_array(tokens)
    geometry = BlockGeometry.of(pool.geometry if geometry is None else geometry)
    bs = geometry.block_size
    base = hot_blocks if isinstance(hot_blocks, (int, np.integer)) else len(hot_blocks)
    base = int(base)
    full = len(toks) // bs
    if base >= full:
        return EMPTY_BLOCKS, RestoreOutcome(0, base, base, 0.0), None
    lookup = toks[:full * bs]
    key_kwargs = ({"extra_keys_per_block": extra_keys_per_block}
                  if extra_keys_per_block is not None else {"extra_keys": tuple(extra_keys)})
    hashes = np.asarray(allocator.chain_hashes(lookup, cache_salt=cache_salt, **key_kwargs),
                        dtype=np.uint64)
    full = min(full, len(hashes))
    chain_kwargs = {"extra_keys": extra_keys, "extra_keys_per_block": extra_keys_per_block,
                    "cache_salt": cache_salt}
    keys = cold_key_chain(tier.fmt, ColdGroup.KV, fingerprint, lookup, bs, max_blocks=full,
                          **chain_kwargs)
    if len(keys) < base:
        return _declined(tier, base, base, t0, RestoreDecline.PARENT_CHAIN_UNAVAILABLE)
    ceiling = tier.store.present_run(keys, base)
    if ceiling == base:
        return EMPTY_BLOCKS, RestoreOutcome(0, base, base, 0.0), None
    fp_hex = fingerprint.hex()
    sidecar = None
    sidecar_keys: list = []
    limit = ceiling
    if policy is not None:
        chains = [cold_key_chain(tier.fmt, p.group, fingerprint, lookup, bs,
                                 max_blocks=ceiling, **chain_kwargs)
                  for p in policies_of(policy)]
        sidecar_keys = chains[0] if len(chains) == 1 else chains
        backed = deepest_backed_boundary(tier, policy, sidecar_keys, base, ceiling, bs, fp_hex)
        if backed is None or (exact_boundary and backed[0] != ceiling):
            return _declined(tier, base, ceiling, t0, RestoreDecline.NO_BACKED_BOUNDARY)
        limit, sidecar = backed
    taken: list[tuple[int, int]] = []
    loads = _LoadAhead(tier, keys, base, limit, fp_hex, geometry)
    try:
        for idx in range(base, limit):
            block = loads.get(idx)
            if block is None:
                break  # load_block counted the miss
            block_id = _upload(tier, block, lookup[idx * bs:(idx + 1) * bs], pool, allocator)
            if block_id is None:
                break
            taken.append((block_id, block.nbytes))
    except Exception as exc:  # noqa: BLE001 - never leak what was taken, never raise into inference
        log.warning("cold tier: restore walk stopped: %s", exc)
        tier.counters.add("misses")
    finally:
        loads.close()
    ids = np.fromiter((b for b, _ in taken), dtype=np.int32, count=len(taken))
    if policy is not None and base + len(taken) < limit:
        # Reconcile down again: keep only what a validated sidecar backs, never K/V alone.
        sidecar = None
        backed = None if exact_boundary else deepest_backed_boundary(
            tier, policy, sidecar_keys, base, base + len(taken), bs, fp_hex)
        keep = 0 if backed is None else backed[0] - base
        if keep < len(taken):
            allocator.free_many(ids[keep:])
            ids, taken = ids[:keep], taken[:keep]
        if backed is None:
            return _declined(tier, base, limit, t0, RestoreDecline.RESTORE_SHORT_OF_BOUNDARY)
        sidecar = backed[1]
    if not taken:
        return EMPTY_BLOCKS, RestoreOutcome(0, base, limit,
                                            (time.monotonic() - t0) * 1e3), None
    try:
        keys_per_block = per_block_extra_keys(base + len(taken), extra_keys,
                                              extra_keys_per_block)
        entries = []
        for j, block_id in enumerate(ids):
            idx = base + j
            identity = BlockIdentity(lookup[idx * bs:(idx + 1) * bs],
                                     int(hashes[idx - 1]) if idx else 0,
                                     extra_keys_digest(keys_per_block[idx]), int(cache_salt),
                                     idx)
            entries.append(RestoredBlock(int(block_id), int(hashes[idx]), identity))
        published = bool(allocator.publish_restored_batch(entries))
    except Exception as exc:  # noqa: BLE001 - an allocator failure unpublishes, never raises
        log.warning("cold tier: publish_restored_batch raised: %s", exc)
        published = False
    if not published:
        allocator.free_many(ids)
        return _declined(tier, base, limit, t0, RestoreDecline.PUBLISH_REFUSED)
    elapsed_ms = (time.monotonic() - t0) * 1e3
    tier.counters.add("hits", len(taken))
    tier.counters.add("bytes_restored", sum(n for _, n in taken))
    log.debug("cold_restore_walk blocks=%d base=%d limit=%d elapsed_ms=%.3f "
              "per_block_ms=%.4f", len(taken), base, limit, elapsed_ms,
              elapsed_ms / len(taken))
    return ids, RestoreOutcome(len(taken), base, limit, elapsed_ms,
                               sidecar_tokens=0 if sidecar is None
                               else sidecar.boundary_tokens), sidecar
