"""Two cold levels at once: a local directory in front of a shared Redis/Valkey
(docs/cold.md, "Two levels").

Read-through: a block indexed on the local disk loads from there; anything else (or a
local failure) loads from the fleet's store, and a verified remote object is written back
to the local directory through the tier's writer queue, so a replica that restarted hits
its own disk first and the fleet second. Write-through: every captured object is committed
to both levels; it counts as persisted only when both acknowledged it.

Both levels count into the tier's counters: a local failure served by the fleet counts its
miss (and corruption) and then the hit; ``bytes_written`` and ``write_errors`` count each
level's commits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.cold.codec import BlockGeometry, DecodedBlock
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.redis_store import FetchedChain, RedisColdStore
from pagedkv.cold.store import ColdStore

__all__ = ["TieredColdStore"]


class TieredColdStore:
    """A :class:`ColdStore` (first level, owned) in front of a :class:`RedisColdStore`
    (second level, owned): a :class:`~pagedkv.cold.backend.ColdBackend`."""

    def __init__(self, local: ColdStore, remote: RedisColdStore) -> None:
        self.local = local
        self.remote = remote
        self.counters = local.counters
        remote.counters = local.counters
        self.fmt = local.fmt
        self.payload_tag = local.payload_tag
        self.index = local.index
        self.quota_bytes = local.quota_bytes
        self.batch_objects = remote.batch_objects
        #: Set by the tier: offers a ``FillJob`` to its writer (``False``: dropped).
        self.fill_enqueue: Callable[[object], bool] | None = None
        remote.fill_sink = self._fill

    def __repr__(self) -> str:
        return f"TieredColdStore({self.local!r} in front of {self.remote!r})"

    @property
    def root_path(self) -> str:
        return f"{self.local.root_path} + {self.remote.url}"

    @property
    def root_fd(self) -> int:
        """The local directory's fd (the weight-digest cache lives there)."""
        return self.local.root_fd

    # --- probes --------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self.local.contains(key) or self.remote.contains(key)

    def contains_in(self, key: bytes, group: ColdGroup) -> bool:
        return self.local.contains_in(key, group) or self.remote.contains_in(key, group)

    def present_run(self, keys: Sequence[bytes], start: int) -> int:
        run = self.local.present_run(keys, start)
        while run < len(keys):
            further = self.remote.present_run(keys, run)
            further = self.local.present_run(keys, further)
            if further == run:
                break
            run = further
        return run

    def learn_presence(self, keys: Sequence[bytes], group: ColdGroup = ColdGroup.KV) -> None:
        self.remote.learn_presence([k for k in keys if not self.local.contains_in(k, group)],
                                   group)

    # --- loads ---------------------------------------------------------------------------

    def chain_source(self, keys: Sequence[bytes], start: int, stop: int,
                     bound: int) -> _TieredChain:
        remote_keys = [k for k in keys[start:stop] if not self.local.contains(k)]
        return _TieredChain(self, FetchedChain(self.remote, remote_keys, bound))

    def load_block(self, key: bytes, *, fingerprint_hex: str, expected: BlockGeometry,
                   buffer: bytearray | None = None) -> DecodedBlock | None:
        if self.local.contains(key):
            block = self.local.load_block(key, fingerprint_hex=fingerprint_hex,
                                          expected=expected, buffer=buffer)
            if block is not None:
                return block
        return self.remote.load_block(key, fingerprint_hex=fingerprint_hex, expected=expected)

    def load_sidecar(self, key: bytes, layout, *, fingerprint_hex: str,
                     buffer: bytearray | None = None):
        if self.local.contains_in(key, layout.group):
            found = self.local.load_sidecar(key, layout, fingerprint_hex=fingerprint_hex,
                                            buffer=buffer)
            if found is not None:
                return found
        return self.remote.load_sidecar(key, layout, fingerprint_hex=fingerprint_hex)

    def _fill(self, key: bytes, group: ColdGroup, data: bytes) -> None:
        """A verified remote object: queue its bytes for the local directory."""
        from pagedkv.cold.writer import FillJob
        if self.fill_enqueue is None or self.local.contains_in(key, group):
            return
        try:
            self.fill_enqueue(FillJob(key, group, data))
        except Exception:  # noqa: BLE001 - a closed tier skips the fill; the load stands
            return

    # --- writes (writer thread) ----------------------------------------------------------

    def commit(self, key: bytes, group: ColdGroup, chunks: Sequence, size: int) -> bool:
        return self.commit_many([(key, group, chunks, size)])[0]

    def commit_many(self, items: Sequence) -> list[bool]:
        """Each object to the local directory, then all of them to Redis in one pipelined
        round trip; persisted = both acknowledged it."""
        local = [self.local.commit(*item) for item in items]
        remote = self.remote.commit_many(items)
        return [a and b for a, b in zip(local, remote, strict=True)]

    def fill(self, key: bytes, group: ColdGroup, chunks: Sequence, size: int) -> bool:
        """A remote object written back to the local directory only."""
        return self.local.commit(key, group, chunks, size)

    # --- maintenance and lifecycle -------------------------------------------------------

    def evict_to(self, target_bytes: int) -> int:
        """The local directory's eviction (the fleet's store is trimmed by its server, or
        by ``pagedkv cold evict redis://...``)."""
        return self.local.evict_to(target_bytes)

    def remove_quarantine(self) -> int:
        return self.local.remove_quarantine()

    def close(self) -> None:
        self.local.close()
        self.remote.close()


class _TieredChain:
    """A restore walk's loads: the local disk first, then the remote chain fetch."""

    def __init__(self, store: TieredColdStore, remote: FetchedChain) -> None:
        self.store = store
        self.remote = remote

    def load_block(self, key: bytes, *, fingerprint_hex: str, expected: BlockGeometry,
                   buffer: bytearray | None = None) -> DecodedBlock | None:
        local = self.store.local
        if local.contains(key):
            block = local.load_block(key, fingerprint_hex=fingerprint_hex,
                                     expected=expected, buffer=buffer)
            if block is not None:
                return block
        return self.remote.load_block(key, fingerprint_hex=fingerprint_hex, expected=expected)
