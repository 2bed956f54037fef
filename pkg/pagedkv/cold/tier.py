"""``ColdTier``: one opened cold root with its writer, counters and walks (cold-tier.md §1).

The adapter holds a tier bound to a model fingerprint (``ColdTier.open_at(...,
fingerprint=...)`` or ``tier.for_model(fp)``) and calls :meth:`capture` after registering
full blocks and :meth:`restore` after a hot hit. Neither ever raises into inference.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Self

import numpy as np

from pagedkv.cold.capture import (
    CaptureOutcome,
    CaptureStop,
    capture_and_enqueue_before,
    capture_walk,
)
from pagedkv.cold.codec import BlockGeometry
from pagedkv.cold.format import DEFAULT_FORMAT, ColdFormat
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.knobs import (
    capture_budget_from_env,
    cold_cache_base,
    install_default_capture_budget,
)
from pagedkv.cold.restore import EMPTY_BLOCKS, RestoreOutcome, restore_walk
from pagedkv.cold.root import MANAGED_CHILD, open_managed_root
from pagedkv.cold.stats import ColdCacheStats, ColdCounters
from pagedkv.cold.store import DURABILITY_MODES, ColdStore, auto_limits
from pagedkv.cold.writer import ColdWriter
from pagedkv.errors import InvalidArgument, InvalidArgumentType, PagedKVError

__all__ = [
    "ColdTier",
    "ColdTierContext",
    "cold_cache_stats",
    "cold_tier_for_model",
    "install_capture_budget",
]

log = logging.getLogger("pagedkv.cold")


class ColdTier:
    """One opened root: index, writer thread, bounded queue, quota and loads."""

    def __init__(self, store: ColdStore, writer: ColdWriter, counters: ColdCounters, *,
                 fingerprint: bytes | None = None, blocks_per_turn: int | None = None,
                 budget_ms: int | None = None) -> None:
        self.store = store
        self.writer = writer
        self.counters = counters
        self.fmt = store.fmt
        self.payload_tag = store.payload_tag
        self.fingerprint = fingerprint
        self.blocks_per_turn, self.budget_ms = capture_budget_from_env(blocks_per_turn,
                                                                       budget_ms)
        self.last_capture: CaptureOutcome | None = None
        self.last_restore: RestoreOutcome | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._loader_lock = threading.Lock()

    # --- opening -------------------------------------------------------------------------

    @classmethod
    def open_at(cls, root, *, quota_bytes: int | None = None, reserve_bytes: int | None = None,
                queue_depth: int = 8, durability: str = "fsync",
                fmt: ColdFormat = DEFAULT_FORMAT, fingerprint: bytes | None = None,
                blocks_per_turn: int | None = None, budget_ms: int | None = None,
                _child: str | None = None) -> ColdTier:
        """Open ``root`` itself as the managed directory (nothing appended).

        ``quota_bytes``/``reserve_bytes`` default to the automatic limits of §10;
        ``durability`` is ``"fsync"`` or ``"full"`` (§7.3). Raises ``InvalidArgument`` when
        the root is refused (symlink, not a directory, owned by someone else).
        """
        if quota_bytes is not None and int(quota_bytes) <= 0:
            raise InvalidArgument(f"quota_bytes = {quota_bytes} must be > 0")
        if reserve_bytes is not None and int(reserve_bytes) < 0:
            raise InvalidArgument(f"reserve_bytes = {reserve_bytes} must be >= 0")
        if int(queue_depth) <= 0:
            raise InvalidArgument(f"queue_depth = {queue_depth} must be > 0")
        if durability not in DURABILITY_MODES:
            raise InvalidArgument(f"durability = {durability!r}; valid: {DURABILITY_MODES}")
        if fingerprint is not None and (not isinstance(fingerprint, bytes)
                                        or len(fingerprint) != 32):
            raise InvalidArgument("fingerprint must be 32 bytes (model_fingerprint's result)")
        root_fd = open_managed_root(root, _child)
        try:
            auto_quota, auto_reserve = auto_limits(root_fd)
            path = os.path.join(os.path.realpath(root), _child) if _child \
                else os.path.realpath(root)
            counters = ColdCounters()
            store = ColdStore(root_fd, path, counters,
                              quota_bytes=int(quota_bytes) if quota_bytes else auto_quota,
                              reserve_bytes=auto_reserve if reserve_bytes is None
                              else int(reserve_bytes),
                              durability=durability, fmt=fmt)
            store.scan()
        except BaseException:
            os.close(root_fd)
            raise
        writer = ColdWriter(store, counters, queue_depth=queue_depth)
        return cls(store, writer, counters, fingerprint=fingerprint,
                   blocks_per_turn=blocks_per_turn, budget_ms=budget_ms)

    @classmethod
    def shared(cls, base: str | None = None) -> ColdTier | None:
        """The process-wide tier at ``<base>/pagedkv-v1`` (base: ``PAGEDKV_COLD_CACHE_DIR``
        or ``~/.pagedkv/cache``), opened once, lazily; ``None`` (one WARNING) if refused.
        A shared tier someone closed is opened again rather than handed out dead."""
        base = base if base is not None else cold_cache_base()
        real = os.path.realpath(base)
        with _shared_lock:
            if real in _shared_tiers:
                cached = _shared_tiers[real]
                if cached is None or not cached.writer.closed:
                    return cached
            try:
                tier = cls.open_at(real, _child=MANAGED_CHILD)
            except (PagedKVError, OSError) as exc:
                log.warning("cold tier disabled: %s", exc)
                tier = None
            _shared_tiers[real] = tier
            global _last_shared
            _last_shared = tier
            return tier

    def for_model(self, fingerprint: bytes) -> ColdTierContext:
        """What an adapter holds: this tier bound to one model's fingerprint."""
        return ColdTierContext(self, fingerprint)

    def __repr__(self) -> str:
        return (f"ColdTier(root={self.store.root_path!r}, objects={len(self.store.index)}, "
                f"total_bytes={self.store.index.total_bytes}, "
                f"quota_bytes={self.store.quota_bytes}, {self.writer!r})")

    # --- index, queue, lifecycle ---------------------------------------------------------

    @property
    def root(self) -> str:
        return self.store.root_path

    def contains(self, key: bytes) -> bool:
        """Index probe only (no I/O, no counters)."""
        return self.store.contains(key)

    def persisted_or_queued(self, key: bytes) -> bool:
        """On disk, or accepted by the writer and not yet committed: a capture walk has
        nothing to do for ``key`` (index probe and a set lookup; no I/O, no counters)."""
        return self.store.contains(key) or self.writer.is_queued(key)

    def contains_in(self, key: bytes, group: ColdGroup) -> bool:
        return self.store.contains_in(key, group)

    def load_block(self, key: bytes, geometry, fingerprint: bytes | None = None):
        """Bounded, verified load of one block (a ``DecodedBlock``), or ``None`` (a miss)."""
        fp = fingerprint if fingerprint is not None else self._fingerprint()
        return self.store.load_block(key, fingerprint_hex=fp.hex(),
                                     expected=BlockGeometry.of(geometry))

    def load_sidecar(self, key: bytes, layout, fingerprint: bytes | None = None):
        """Bounded, verified load of a sidecar of exactly ``layout``, or ``None`` (a miss)."""
        fp = fingerprint if fingerprint is not None else self._fingerprint()
        return self.store.load_sidecar(key, layout, fingerprint_hex=fp.hex())

    def enqueue(self, job) -> bool:
        return self.writer.enqueue(job)

    def enqueue_before(self, job, deadline: float) -> bool:
        return self.writer.enqueue_before(job, deadline)

    def capture_and_enqueue_before(self, pool, allocator, block_id: int, key: bytes, tokens,
                                   deadline: float, fingerprint: bytes | None = None) -> bool:
        fp = fingerprint if fingerprint is not None else self._fingerprint()
        return capture_and_enqueue_before(self, pool, allocator, block_id, key,
                                          np.asarray(tokens, dtype=np.uint32), deadline,
                                          fingerprint_hex=fp.hex(),
                                          geometry=BlockGeometry.of(pool.geometry))

    def drain(self, timeout: float = 5.0) -> bool:
        return self.writer.drain(timeout)

    def loader(self) -> ThreadPoolExecutor:
        """The restore walk's load-ahead threads (``pagedkv-cold-restore``), made on first
        use."""
        with self._loader_lock:
            if self._loader is None:
                from pagedkv.cold.restore import LOADER_THREADS
                self._loader = ThreadPoolExecutor(LOADER_THREADS,
                                                  thread_name_prefix="pagedkv-cold-restore")
            return self._loader

    def close(self, timeout: float = 5.0) -> None:
        """Persist what is queued (up to ``timeout``), stop the writer, close the root."""
        ended = self.writer.close(timeout)
        with self._loader_lock:
            if self._loader is not None:
                self._loader.shutdown(wait=True)
                self._loader = None
        if ended:
            self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def install_capture_budget(self, blocks: int, budget_ms: int) -> bool:
        """Test hook: set the capture budget; ``True`` iff the setting now equals it."""
        if int(blocks) > 0 and int(budget_ms) > 0:
            self.blocks_per_turn, self.budget_ms = int(blocks), int(budget_ms)
        return (self.blocks_per_turn, self.budget_ms) == (int(blocks), int(budget_ms))

    def stats(self) -> ColdCacheStats:
        return ColdCacheStats(**self.counters.values(), enabled=not self.writer.closed,
                              root=self.store.root_path, quota_bytes=self.store.quota_bytes)

    # --- the adapter protocol ------------------------------------------------------------

    def _fingerprint(self) -> bytes:
        if self.fingerprint is None:
            raise InvalidArgument("this ColdTier has no model fingerprint: open it with "
                                  "fingerprint= or use tier.for_model(fingerprint)")
        return self.fingerprint

    def capture(self, *, tokens, block_ids, hashes=None, cache_salt: int = 0,
                extra_keys=(), extra_keys_per_block=None, pool, allocator,
                fingerprint: bytes | None = None) -> CaptureOutcome:
        """The budgeted capture walk over a request's registered full blocks. Never raises:
        any failure ends the walk (``stop=ERROR``) and is logged."""
        try:
            outcome = capture_walk(
                self, fingerprint if fingerprint is not None else self._fingerprint(),
                tokens=tokens, block_ids=block_ids, cache_salt=cache_salt,
                extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
                pool=pool, allocator=allocator, blocks_per_turn=self.blocks_per_turn,
                budget_ms=self.budget_ms)
        except Exception as exc:  # noqa: BLE001 - the cold tier never raises into inference
            log.warning("cold tier: capture walk failed: %s", exc)
            outcome = CaptureOutcome(0, 0, 0.0, CaptureStop.ERROR)
        self.last_capture = outcome
        return outcome

    def restore(self, *, tokens, hot_blocks, cache_salt: int = 0, extra_keys=(),
                extra_keys_per_block=None, pool, allocator,
                fingerprint: bytes | None = None) -> np.ndarray:
        """Extend a hot hit from disk; returns the restored block ids (``int32``, one
        reference each owned by the caller), empty on a miss. Never raises."""
        try:
            ids, outcome = restore_walk(
                self, fingerprint if fingerprint is not None else self._fingerprint(),
                tokens=tokens, hot_blocks=hot_blocks, cache_salt=cache_salt,
                extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
                pool=pool, allocator=allocator)
        except Exception as exc:  # noqa: BLE001 - the cold tier never raises into inference
            log.warning("cold tier: restore walk failed: %s", exc)
            return EMPTY_BLOCKS
        self.last_restore = outcome
        return ids


@dataclass(frozen=True)
class ColdTierContext:
    """A tier bound to one model: what ``PagedKVCacheAdapter(cold_tier=...)`` holds."""

    tier: ColdTier
    fingerprint: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.tier, ColdTier):
            raise InvalidArgumentType(f"tier must be a ColdTier, got {type(self.tier).__name__}")
        if not isinstance(self.fingerprint, bytes) or len(self.fingerprint) != 32:
            raise InvalidArgument("fingerprint must be 32 bytes (model_fingerprint's result)")

    @property
    def fmt(self) -> ColdFormat:
        return self.tier.fmt

    def capture(self, **kwargs) -> CaptureOutcome:
        return self.tier.capture(fingerprint=self.fingerprint, **kwargs)

    def restore(self, **kwargs) -> np.ndarray:
        return self.tier.restore(fingerprint=self.fingerprint, **kwargs)

    def drain(self, timeout: float = 5.0) -> bool:
        return self.tier.drain(timeout)

    def stats(self) -> ColdCacheStats:
        return self.tier.stats()

    def __repr__(self) -> str:
        return f"ColdTierContext(fingerprint={self.fingerprint.hex()[:16]}..., {self.tier!r})"


_shared_lock = threading.Lock()
_shared_tiers: dict[str, ColdTier | None] = {}
_last_shared: ColdTier | None = None


def cold_cache_stats(tier: ColdTier | None = None) -> ColdCacheStats:
    """Counters of ``tier`` (default: the shared tier); all zero with ``enabled=False``
    when no tier is open."""
    tier = tier if tier is not None else _last_shared
    if tier is None:
        return ColdCacheStats()
    return tier.stats()


def install_capture_budget(blocks: int, budget_ms: int, tier: ColdTier | None = None) -> bool:
    """Test hook (§8.1): set the shared tier's (or ``tier``'s) capture budget; ``True`` iff
    the effective setting equals the request. Without a tier it sets what tiers open with."""
    tier = tier if tier is not None else _last_shared
    if tier is None:
        if int(blocks) > 0 and int(budget_ms) > 0:
            install_default_capture_budget(blocks, budget_ms)
        return capture_budget_from_env() == (int(blocks), int(budget_ms))
    return tier.install_capture_budget(blocks, budget_ms)


def cold_tier_for_model(model_dir: str, family: str, geometry, *,
                        persist_paged_cache: bool | None = None, base: str | None = None,
                        provenance=None, hfqm_file: str | None = None, compute: str = ""
                        ) -> ColdTierContext | None:
    """What an engine passes as ``PagedKVCacheAdapter(cold_tier=...)``, or ``None``.

    Persistence resolves per §2.2 (the family gate, then ``PAGEDKV_PERSIST_PAGED_CACHE``,
    then ``persist_paged_cache``); the tier is the shared one at ``<base>/pagedkv-v1``; the
    fingerprint covers the model, ``geometry`` and ``compute`` (the compute identity, see
    ``model_fingerprint``; weight digests cached in the root). A
    refused root or a model without weight bytes turns persistence off (logged), never
    raises.
    """
    from pagedkv.cold.digest_cache import WeightDigestCache
    from pagedkv.cold.fingerprint import model_fingerprint
    from pagedkv.cold.profiles import family_profile, resolve_persist

    profile = family_profile(family)
    if not resolve_persist(profile, persist_paged_cache):
        return None
    tier = ColdTier.shared(base)
    if tier is None:
        return None
    fp = model_fingerprint(tier.fmt, model_dir, profile, geometry, provenance,
                           WeightDigestCache(tier.store.root_fd), hfqm_file=hfqm_file,
                           compute=compute)
    return tier.for_model(fp) if fp is not None else None
