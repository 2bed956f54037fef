"""``ColdTier``: one opened cold root with its writer, counters and walks
(docs/contracts/cold-tier.md, '1. Components').

The adapter holds a tier bound to a model fingerprint (``ColdTier.open_at(...,
fingerprint=...)`` or ``tier.for_model(fp)``) and calls :meth:`capture` after registering
full blocks and :meth:`restore` after a hot hit. Neither ever raises into inference.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Self

import numpy as np

from pagedkv.adapter.cold_hooks import ColdRestore, per_block_keys
from pagedkv.cold.backend import ColdBackend
from pagedkv.cold.capture import (
    CaptureOutcome,
    CaptureStop,
    capture_and_enqueue_before,
    capture_walk,
)
from pagedkv.cold.codec import BlockGeometry
from pagedkv.cold.fingerprint import ModeFingerprints
from pagedkv.cold.format import DEFAULT_FORMAT, ColdFormat
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.knobs import (
    capture_budget_from_env,
    cold_backend_url,
    cold_cache_base,
    install_default_capture_budget,
)
from pagedkv.cold.redis_store import RedisColdStore
from pagedkv.cold.restore import EMPTY_BLOCKS, RestoreOutcome, restore_walk
from pagedkv.cold.root import MANAGED_CHILD, open_managed_root
from pagedkv.cold.sidecar_bundle import SidecarBundle
from pagedkv.cold.sidecar_capture import SidecarCaptureOutcome, capture_sidecar
from pagedkv.cold.stats import ColdCacheStats, ColdCounters, sidecar_counters
from pagedkv.cold.store import DURABILITY_MODES, ColdStore, auto_limits
from pagedkv.cold.tiered_store import TieredColdStore
from pagedkv.cold.writer import ColdWriter
from pagedkv.errors import ColdBackendError, InvalidArgument, InvalidArgumentType, PagedKVError

__all__ = [
    "ColdRestore",
    "ColdTier",
    "ColdTierContext",
    "cold_cache_stats",
    "cold_tier_for_model",
    "install_capture_budget",
]

log = logging.getLogger("pagedkv.cold")


class ColdTier:
    """One opened root: index, writer thread, bounded queue, quota and loads."""

    def __init__(self, store: ColdBackend, writer: ColdWriter, counters: ColdCounters, *,
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
        if isinstance(store, TieredColdStore):  # remote hits are written back through us
            store.fill_enqueue = writer.enqueue

    # --- opening -------------------------------------------------------------------------

    @classmethod
    def open_at(cls, root, *, quota_bytes: int | None = None, reserve_bytes: int | None = 0,
                queue_depth: int = 8, durability: str = "fsync",
                fmt: ColdFormat = DEFAULT_FORMAT, fingerprint: bytes | None = None,
                blocks_per_turn: int | None = None, budget_ms: int | None = None,
                remote: str | None = None, _child: str | None = None) -> ColdTier:
        """Open ``root`` itself as the managed directory (nothing appended).

        ``quota_bytes`` (``None``: automatic) and ``reserve_bytes`` (free disk space kept, in
        bytes; default 0, ``None``: automatic) follow docs/contracts/cold-tier.md, '10. Quota and
        eviction' and '5.1 Root': the explicit form keeps no reserve unless asked, because the
        automatic one (at least 5 GiB) refuses every write on a disk with less free space;
        ``shared()`` uses the automatic limits;
        ``durability`` is ``"fsync"`` or ``"full"`` (docs/contracts/cold-tier.md, '7.3 Durability').
        Raises ``InvalidArgument`` when
        the root is refused (symlink, not a directory, owned by someone else).

        ``remote``: a ``redis://host:port/db`` (``rediss://``, ``unix://``) URL puts the
        fleet's Redis/Valkey behind the directory (docs/cold.md, "Two levels"); raises a
        ``ColdBackendError`` when it cannot be opened.
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
            backend: ColdBackend = store
            if remote is not None:
                backend = TieredColdStore(store, RedisColdStore.open(remote, counters,
                                                                     fmt=fmt))
        except BaseException:
            os.close(root_fd)
            raise
        writer = ColdWriter(backend, counters, queue_depth=queue_depth)
        return cls(backend, writer, counters, fingerprint=fingerprint,
                   blocks_per_turn=blocks_per_turn, budget_ms=budget_ms)

    @classmethod
    def open_remote(cls, url: str, *, queue_depth: int = 8, fmt: ColdFormat = DEFAULT_FORMAT,
                    fingerprint: bytes | None = None, blocks_per_turn: int | None = None,
                    budget_ms: int | None = None) -> ColdTier:
        """A tier on one Redis/Valkey server alone (``redis://[:password@]host:port/db``,
        ``rediss://`` for TLS, ``unix://path?db=N``): docs/cold.md, "A fleet on Redis or
        Valkey". Raises ``ColdBackendAuthError``/``ColdBackendTLSError``/
        ``ColdBackendError`` when the server refuses or cannot be reached."""
        if int(queue_depth) <= 0:
            raise InvalidArgument(f"queue_depth = {queue_depth} must be > 0")
        if fingerprint is not None and (not isinstance(fingerprint, bytes)
                                        or len(fingerprint) != 32):
            raise InvalidArgument("fingerprint must be 32 bytes (model_fingerprint's result)")
        counters = ColdCounters()
        store = RedisColdStore.open(url, counters, fmt=fmt)
        writer = ColdWriter(store, counters, queue_depth=queue_depth)
        return cls(store, writer, counters, fingerprint=fingerprint,
                   blocks_per_turn=blocks_per_turn, budget_ms=budget_ms)

    @classmethod
    def shared(cls, base: str | None = None) -> ColdTier | None:
        """The process-wide tier at ``<base>/pagedkv-v1`` (base: ``PAGEDKV_COLD_CACHE_DIR``
        or ``~/.pagedkv/cache``), opened once, lazily; ``None`` (one WARNING) if refused.
        With ``PAGEDKV_COLD_BACKEND=redis://...`` the fleet's Redis/Valkey sits behind the
        directory; one that cannot be opened leaves the directory alone (one WARNING).
        A shared tier someone closed is opened again rather than handed out dead."""
        base = base if base is not None else cold_cache_base()
        real = os.path.realpath(base)
        remote = cold_backend_url()
        slot = real if remote is None else f"{real} + {remote}"
        with _shared_lock:
            if slot in _shared_tiers:
                cached = _shared_tiers[slot]
                if cached is None or not cached.writer.closed:
                    return cached
            try:
                try:
                    tier = cls.open_at(real, reserve_bytes=None, _child=MANAGED_CHILD, remote=remote)
                except (ColdBackendError, InvalidArgument) as exc:  # a malformed URL too
                    log.warning("cold tier: the fleet's store (PAGEDKV_COLD_BACKEND) is not "
                                "used: %s", exc)
                    tier = cls.open_at(real, reserve_bytes=None, _child=MANAGED_CHILD)
            except (PagedKVError, OSError) as exc:
                log.warning("cold tier disabled: %s", exc)
                tier = None
            _shared_tiers[slot] = tier
            global _last_shared
            _last_shared = tier
            return tier

    def for_model(self, fingerprint: bytes, *, sidecar=None,
                  checkpoints: Callable[..., Mapping[int, Any]] | None = None,
                  geometry=None) -> ColdTierContext:
        """What an adapter holds: this tier bound to one model's fingerprint, with the
        family's sidecar codec and checkpoint source when it keeps out-of-pool state.
        ``geometry``: the pool geometry ``fingerprint`` was computed for; the binding then
        follows the pool's KV mode (:class:`ColdTierContext`)."""
        return ColdTierContext(self, fingerprint, sidecar, checkpoints, geometry)

    def __repr__(self) -> str:
        return (f"ColdTier(root={self.store.root_path!r}, objects={len(self.store.index)}, "
                f"total_bytes={self.store.index.total_bytes}, "
                f"quota_bytes={self.store.quota_bytes}, {self.writer!r})")

    # --- index, queue, lifecycle ---------------------------------------------------------

    @property
    def root(self) -> str:
        return self.store.root_path

    @property
    def local_root_fd(self) -> int:
        """The local directory's fd (the weight-digest cache lives there). Raises
        ``InvalidArgument`` for a tier on Redis alone, which has no directory."""
        fd = getattr(self.store, "root_fd", None)
        if fd is None:
            raise InvalidArgument(f"{self!r} has no local directory: open it with "
                                  "ColdTier.open_at(root, remote=url) to keep one")
        return int(fd)

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
                fingerprint: bytes | None = None, geometry=None) -> CaptureOutcome:
        """The budgeted capture walk over a request's registered full blocks. Never raises:
        any failure ends the walk (``stop=ERROR``) and is logged. ``geometry``: the pool
        geometry ``fingerprint`` belongs to (default: the pool's now); a block read after
        the pool left it (a kv_adaptive step) ends the walk, nothing enqueued for it."""
        try:
            outcome = capture_walk(
                self, fingerprint if fingerprint is not None else self._fingerprint(),
                tokens=tokens, block_ids=block_ids, cache_salt=cache_salt,
                extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
                pool=pool, allocator=allocator, blocks_per_turn=self.blocks_per_turn,
                budget_ms=self.budget_ms, geometry=geometry)
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
        return self.restore_backed(
            tokens=tokens, hot_blocks=hot_blocks, cache_salt=cache_salt, extra_keys=extra_keys,
            extra_keys_per_block=extra_keys_per_block, pool=pool, allocator=allocator,
            fingerprint=fingerprint).block_ids

    def restore_backed(self, *, tokens, hot_blocks, cache_salt: int = 0, extra_keys=(),
                       extra_keys_per_block=None, pool, allocator, policy=None,
                       exact_boundary: bool = False,
                       fingerprint: bytes | None = None, geometry=None) -> ColdRestore:
        """:meth:`restore` under a sidecar ``policy`` (a ``ColdSidecarPolicy``): the K/V
        chain is reconciled down to the deepest boundary a validated sidecar backs, and
        that sidecar comes back with the blocks (docs/cold.md, "Reconcile-down").
        ``geometry``: the pool geometry ``fingerprint`` belongs to (default: the pool's
        now), the geometry every loaded block must have. Never raises."""
        try:
            ids, outcome, sidecar = restore_walk(
                self, fingerprint if fingerprint is not None else self._fingerprint(),
                tokens=tokens, hot_blocks=hot_blocks, cache_salt=cache_salt,
                extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
                pool=pool, allocator=allocator, policy=policy, exact_boundary=exact_boundary,
                geometry=geometry)
        except Exception as exc:  # noqa: BLE001 - the cold tier never raises into inference
            log.warning("cold tier: restore walk failed: %s", exc)
            return ColdRestore(EMPTY_BLOCKS, None)
        self.last_restore = outcome
        return ColdRestore(ids, sidecar)

    def restore_discarded(self, *, blocks: int) -> None:
        """The lifecycle threw away a restored hit of ``blocks`` blocks unused
        (``restart_prepared_turn_cold``): counts ``restore_suppressed``."""
        if blocks > 0:
            sidecar_counters().add("restore_suppressed")


@dataclass(frozen=True)
class ColdTierContext:
    """A tier bound to one model: what ``PagedKVCacheAdapter(cold=...)`` holds.

    ``sidecar``: the family's sidecar codec (``RecurrentStateCodec`` from
    ``gdn_state_codec``/``conv_state_codec``, a ``SlidingWindowCodec``, or a
    ``SidecarBundle`` of several) when it keeps state outside the pool; its ``policy``
    reconciles every restore down to a backed boundary. ``checkpoints``: called as
    ``checkpoints(tokens, cache_salt=..., extra_keys_per_block=...)`` after each K/V capture
    walk, it returns the request lineage's retained in-memory checkpoints (boundary tokens →
    state in the codec's form; a bundle's: ``{ColdGroup: state}``); the deepest one under
    the walk's reach is persisted (docs/cold.md, "Sidecar capture").

    ``geometry``: the pool geometry ``fingerprint`` was computed for (``cold_tier_for_model``
    passes it). With it the binding follows the pool's KV mode: every capture and restore
    reads the pool's geometry once and runs under :meth:`fingerprint_at` of it, so after a
    kv_adaptive step (docs/kv-quant.md) blocks of the new mode are stored and looked up
    under a fingerprint of their own and objects of the bound mode stay on disk for a
    process that runs at it (docs/cold.md, "KV mode steps"). ``None``: ``fingerprint``
    serves every pool as it is (a pool that changes mode then collides with its old
    objects).
    """

    tier: ColdTier
    fingerprint: bytes
    sidecar: Any = None
    checkpoints: Callable[..., Mapping[int, Any]] | None = None
    geometry: Any = None
    _modes: ModeFingerprints | None = field(default=None, init=False, repr=False,
                                            compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tier, ColdTier):
            raise InvalidArgumentType(f"tier must be a ColdTier, got {type(self.tier).__name__}")
        if not isinstance(self.fingerprint, bytes) or len(self.fingerprint) != 32:
            raise InvalidArgument("fingerprint must be 32 bytes (model_fingerprint's result)")
        if self.sidecar is not None and not isinstance(self.sidecar, SidecarBundle) and not (
                hasattr(self.sidecar, "policy") and hasattr(self.sidecar, "pack")):
            raise InvalidArgumentType(
                f"sidecar must be a sidecar codec (gdn_state_codec, conv_state_codec, "
                f"SlidingWindowCodec, SidecarBundle), got {type(self.sidecar).__name__}")
        if self.checkpoints is not None and not callable(self.checkpoints):
            raise InvalidArgumentType("checkpoints must be callable(tokens, cache_salt=..., "
                                      "extra_keys_per_block=...) -> {boundary: state}")
        if self.geometry is not None:
            object.__setattr__(self, "_modes",
                               ModeFingerprints(self.tier.fmt, self.fingerprint, self.geometry))

    def fingerprint_at(self, geometry) -> bytes:
        """The fingerprint of a pool holding ``geometry``: ``fingerprint`` at the bound
        geometry (or without one), else :func:`~pagedkv.cold.fingerprint.kv_mode_fingerprint`
        of it."""
        return self.fingerprint if self._modes is None else self._modes.at(geometry)

    def _binding(self, pool) -> tuple[bytes, Any]:
        # One read of the pool's geometry: the walk's fingerprint, keys, expected object
        # geometry and pool reads all belong to it (a step after this read makes the
        # walk's next pool read or write fail, never mix modes).
        geometry = pool.geometry
        return self.fingerprint_at(geometry), geometry

    @property
    def fmt(self) -> ColdFormat:
        return self.tier.fmt

    @property
    def policy(self):
        """The sidecar codec's ``ColdSidecarPolicy`` (a bundle's: a tuple of them), or
        ``None`` (K/V-only family)."""
        return None if self.sidecar is None else self.sidecar.policy

    def capture(self, **kwargs) -> CaptureOutcome:
        """The K/V capture walk, then (with a codec and a checkpoint source) the sidecar
        capture anchored under its reach; its outcome is ``result.sidecar``. Never raises."""
        fingerprint, geometry = self._binding(kwargs["pool"])
        outcome = self.tier.capture(fingerprint=fingerprint, geometry=geometry, **kwargs)
        if self.sidecar is None or self.checkpoints is None:
            return outcome
        tokens = kwargs["tokens"]
        salt = kwargs.get("cache_salt", 0)
        per_block = kwargs.get("extra_keys_per_block")
        extra = kwargs.get("extra_keys", ())
        try:
            # The checkpoint source keys by per-block keys only: a request's uniform keys
            # must reach it too, or a keyless lineage's state answers for a keyed one.
            bs = int(kwargs["pool"].block_size)
            found = self.checkpoints(
                tokens, cache_salt=salt,
                extra_keys_per_block=per_block_keys(extra, per_block, len(tokens) // bs)) \
                if outcome.blocks else {}
            side = self.capture_sidecar(found, tokens=tokens, captured_blocks=outcome.blocks,
                                        block_size=bs,
                                        cache_salt=salt, extra_keys=extra,
                                        extra_keys_per_block=per_block, geometry=geometry)
        except Exception as exc:  # noqa: BLE001 - the cold tier never raises into inference
            log.warning("cold tier: sidecar capture failed: %s", exc)
            return outcome
        outcome = replace(outcome, sidecar=side)
        self.tier.last_capture = outcome
        return outcome

    def capture_sidecar(self, checkpoints: Mapping[int, Any], *, tokens, captured_blocks: int,
                        block_size: int, cache_salt: int = 0, extra_keys=(),
                        extra_keys_per_block=None, geometry=None
                        ) -> SidecarCaptureOutcome | tuple[SidecarCaptureOutcome, ...]:
        """Sidecar capture alone (docs/cold.md, "Sidecar capture"): for hosts that run the
        K/V walk elsewhere. Waits for a queue slot up to the tier's capture budget. A
        bundle captures each part at its own deepest anchor (the same one when every part
        has state at the same boundaries) and returns one outcome per part. ``geometry``:
        the pool geometry the K/V walk ran at (its fingerprint is the sidecar's; default:
        the bound one)."""
        if self.sidecar is None:
            raise InvalidArgument("this ColdTierContext has no sidecar codec")
        fingerprint = self.fingerprint if geometry is None else self.fingerprint_at(geometry)
        deadline = time.monotonic() + self.tier.budget_ms / 1000.0

        def one(codec, found):
            return capture_sidecar(self.tier, fingerprint, codec, found, tokens=tokens,
                                   captured_blocks=captured_blocks, block_size=block_size,
                                   deadline=deadline, cache_salt=cache_salt,
                                   extra_keys=extra_keys,
                                   extra_keys_per_block=extra_keys_per_block)

        if isinstance(self.sidecar, SidecarBundle):
            return tuple(one(codec, self.sidecar.split(checkpoints, codec.group))
                         for codec in self.sidecar.parts)
        return one(self.sidecar, checkpoints)

    def restore(self, **kwargs) -> ColdRestore:
        """Restore under this context's policy: ``ColdRestore(block_ids, sidecar)``."""
        fingerprint, geometry = self._binding(kwargs["pool"])
        return self.tier.restore_backed(fingerprint=fingerprint, geometry=geometry,
                                        policy=self.policy, **kwargs)

    def restore_grouped(self, **kwargs):
        """Full + sliding restore (docs/cold.md, "Grouped restore"): see
        :func:`pagedkv.cold.grouped_restore.restore_grouped`."""
        from pagedkv.cold.grouped_restore import restore_grouped
        return restore_grouped(self, **kwargs)

    def restore_discarded(self, *, blocks: int) -> None:
        self.tier.restore_discarded(blocks=blocks)

    def drain(self, timeout: float = 5.0) -> bool:
        return self.tier.drain(timeout)

    def stats(self) -> ColdCacheStats:
        return self.tier.stats()

    def __repr__(self) -> str:
        side = "" if self.sidecar is None else f", sidecar={self.sidecar!r}"
        return f"ColdTierContext(fingerprint={self.fingerprint.hex()[:16]}...{side}, {self.tier!r})"


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
    """Test hook (docs/contracts/cold-tier.md, '8.1 Capture budget'): set the shared tier's (or
    ``tier``'s) capture budget; ``True`` iff
    the effective setting equals the request. Without a tier it sets what tiers open with."""
    tier = tier if tier is not None else _last_shared
    if tier is None:
        if int(blocks) > 0 and int(budget_ms) > 0:
            install_default_capture_budget(blocks, budget_ms)
        return capture_budget_from_env() == (int(blocks), int(budget_ms))
    return tier.install_capture_budget(blocks, budget_ms)


def cold_tier_for_model(model_dir: str, family: str, geometry, *,
                        persist_paged_cache: bool | None = None, base: str | None = None,
                        provenance=None, hfqm_file: str | None = None, sidecar=None,
                        checkpoints: Callable[..., Mapping[int, Any]] | None = None,
                        compute: str = ""
                        ) -> ColdTierContext | None:
    """What an engine passes as ``PagedKVCacheAdapter(cold=...)``, or ``None``.

    Persistence resolves per docs/contracts/cold-tier.md, '2.2 Persist resolution' (the family gate,
    then ``PAGEDKV_PERSIST_PAGED_CACHE``,
    then ``persist_paged_cache``); the tier is the shared one at ``<base>/pagedkv-v1``; the
    fingerprint covers the model, ``geometry`` and ``compute`` (the compute identity, see
    ``model_fingerprint``; weight digests cached in the root). A
    refused root or a model without weight bytes turns persistence off (logged), never
    raises for those. ``checkpoints``: a hybrid family's checkpoint source (see
    :class:`ColdTierContext`).

    A family with out-of-pool state gets its sidecar codec from its profile's
    ``sidecar_policy`` and the model's ``config.json`` (docs/cold.md, "Family profiles and
    sidecars"); ``sidecar`` (the engine's own codec) must equal it
    (``SidecarLayoutMismatch`` otherwise). A family declaring no out-of-pool state whose
    ``config.json`` lists sliding-window or recurrent ``layer_types`` is refused (persistence
    off, logged): its K/V alone would resume the model wrongly.
    """
    from pagedkv.cold.digest_cache import WeightDigestCache
    from pagedkv.cold.fingerprint import model_fingerprint
    from pagedkv.cold.profiles import (
        OutOfPoolState,
        family_profile,
        family_sidecar_codec,
        resolve_persist,
        stateful_layer_kinds,
    )

    profile = family_profile(family)
    if not resolve_persist(profile, persist_paged_cache):
        return None
    assert profile is not None
    config = _read_config(model_dir)
    if config is None:
        return None
    stateful = stateful_layer_kinds(config)
    if stateful and profile.out_of_pool_state is OutOfPoolState.NONE:
        log.warning("cold tier: family %r declares no out-of-pool state but %s/config.json "
                    "has %s layers; persistence off (serve it under a family whose profile "
                    "has their sidecars)", family, model_dir, ", ".join(stateful))
        return None
    try:
        sidecar = family_sidecar_codec(profile, config, geometry, sidecar)
    except InvalidArgument:  # a ValueError: the caller's codec or family is wrong, say so
        raise
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("cold tier: family %r cannot build its sidecar codec from %s/config.json "
                    "(%s); persistence off", family, model_dir, exc)
        return None
    tier = ColdTier.shared(base)
    if tier is None:
        return None
    fp = model_fingerprint(tier.fmt, model_dir, profile, geometry, provenance,
                           WeightDigestCache(tier.local_root_fd), hfqm_file=hfqm_file,
                           compute=compute)
    if fp is None:
        return None
    return tier.for_model(fp, sidecar=sidecar, checkpoints=checkpoints, geometry=geometry)


def _read_config(model_dir: str) -> dict | None:
    """``config.json`` of ``model_dir`` as a dict, or ``None`` (logged): persistence off."""
    import json

    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            config = json.loads(f.read())
    except (OSError, ValueError) as exc:
        log.warning("cold tier: cannot read %s/config.json (%s); persistence off", model_dir,
                    exc)
        return None
    if not isinstance(config, dict):
        log.warning("cold tier: %s/config.json is not an object; persistence off", model_dir)
        return None
    return config
