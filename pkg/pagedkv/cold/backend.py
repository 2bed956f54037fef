"""The cold-store backend interface: what a ``ColdTier`` and its writer own of a store
(docs/cold.md, "Backends").

Three implementations: :class:`~pagedkv.cold.store.ColdStore` (the local directory, the
embedded default), :class:`~pagedkv.cold.redis_store.RedisColdStore` (one Redis or Valkey
shared by a fleet) and :class:`~pagedkv.cold.tiered_store.TieredColdStore` (a local directory
in front of Redis: read-through, write-through). All three store the same object bytes
under the same names and decode them with the same fail-closed codec: a backend is trusted
for nothing, every load is verified.

Ownership (vLLM v1/core style): the tier owns the store and the writer; the writer thread
is the only caller of :meth:`commit`/:meth:`commit_many`; inference and loader threads call
the probes and loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from pagedkv.cold.groups import ColdGroup

if TYPE_CHECKING:
    from pagedkv.cold.codec import BlockGeometry, DecodedBlock
    from pagedkv.cold.format import ColdFormat
    from pagedkv.cold.index import ColdIndex
    from pagedkv.cold.stats import ColdCounters

__all__ = ["BlockSource", "ColdBackend", "CommitItem"]

#: ``(key, group, chunks, size)``: one encoded object for :meth:`ColdBackend.commit_many`.
CommitItem = tuple[bytes, ColdGroup, Sequence, int]


class BlockSource(Protocol):
    """Where a restore walk loads one chain's KV blocks from (:meth:`ColdBackend.chain_source`)."""

    def load_block(self, key: bytes, *, fingerprint_hex: str, expected: BlockGeometry,
                   buffer: bytearray | None = None) -> DecodedBlock | None: ...


class ColdBackend(Protocol):
    """A cold store: probes, verified loads, atomic commits, quota."""

    counters: ColdCounters
    fmt: ColdFormat
    payload_tag: bytes
    index: ColdIndex
    quota_bytes: int
    #: Objects the writer may hand :meth:`commit_many` at once (1: one at a time).
    batch_objects: int

    @property
    def root_path(self) -> str:
        """Where the objects live: a directory, or a ``redis://`` URL without its password."""
        ...

    def contains(self, key: bytes) -> bool:
        """Index probe only: no I/O, no counters."""
        ...

    def contains_in(self, key: bytes, group: ColdGroup) -> bool: ...

    def present_run(self, keys: Sequence[bytes], start: int) -> int:
        """The first index ``>= start`` whose key is not stored (the restore ceiling). A
        remote backend asks the server in one round trip; the directory probes its index."""
        ...

    def learn_presence(self, keys: Sequence[bytes], group: ColdGroup = ColdGroup.KV) -> None:
        """Before a walk probes ``keys`` (objects of ``group``) one by one: a remote backend
        learns in one round trip which of them the fleet already stored (the directory:
        nothing to do)."""
        ...

    def chain_source(self, keys: Sequence[bytes], start: int, stop: int,
                     bound: int) -> BlockSource:
        """The loads of blocks ``keys[start:stop]`` (each at most ``bound`` bytes) for one
        restore walk. A remote backend fetches them in pipelined round trips."""
        ...

    def load_block(self, key: bytes, *, fingerprint_hex: str, expected: BlockGeometry,
                   buffer: bytearray | None = None) -> DecodedBlock | None: ...

    def load_sidecar(self, key: bytes, layout, *, fingerprint_hex: str,
                     buffer: bytearray | None = None): ...

    def commit(self, key: bytes, group: ColdGroup, chunks: Sequence, size: int) -> bool:
        """Store one encoded object atomically; ``True`` once it is acknowledged durable.
        Errors are counted (``write_errors``) and logged, never raised."""
        ...

    def commit_many(self, items: Sequence[CommitItem]) -> list[bool]:
        """:meth:`commit` of several objects (one pipelined round trip on a remote)."""
        ...

    def evict_to(self, target_bytes: int) -> int: ...

    def remove_quarantine(self) -> int: ...

    def close(self) -> None: ...
