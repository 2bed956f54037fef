"""Type stubs for pagedkv.allocator (Cython). Contracts: docs/contracts/paged-kv.md, '4.
BlockAllocator'.

Observable API shared with the pure-Python oracle ``BlockAllocator`` of tests/allocator_oracle.py
(the differential test compares these after every step):

* ``stats()`` → dict with exactly the keys of ``STATS_KEYS``: query_tokens, hit_tokens,
  pressure_evictions, capacity_evictions, collisions_rejected, grows (ints).
  ``query_tokens`` grows by ``len(tokens)`` on every valid ``find_longest_cache_hit`` call
  (partial blocks included); ``hit_tokens`` by the returned token count;
  ``collisions_rejected`` by one per verified-identity mismatch in
  ``find_longest_cache_hit``, ``lookup_prefix`` and ``cache_full_blocks`` (a
  ``register_prefix`` of a held hash under another block returns False and is not
  counted); ``capacity_evictions`` by one per entry that ``register_prefix``,
  ``cache_full_blocks``, ``publish_restored_batch`` or ``set_prefix_cache_capacity``
  dropped for capacity; ``pressure_evictions`` by one per cache-only block that
  ``allocate``/``allocate_many`` took over; ``grows`` by one per ``grow_by`` that added ids.
* ``lru_hashes()`` → ``list[int]``, least recently used first.
* ``ref_count(block_id)`` → int, 0 for a free block (and the null block); an id outside
  ``[0, num_blocks)`` → InvalidArgument.
* Chain segments: ``chain_hashes``, ``cached_block_ids`` and ``cache_full_blocks`` take
  ``parent_hash`` / ``first_block``: ``tokens`` (and ``block_ids``) start at chain block
  ``first_block``, which chains from ``parent_hash`` (the hash of block ``first_block - 1``;
  0 exactly when ``first_block`` is 0, else InvalidArgument); per-block keys are
  segment-relative. A segment hashes, registers and verifies exactly as the same blocks of
  the whole chain. ``cached_block_ids`` is a pure probe (no refcount, LRU or counter change).
* ``find_longest_cache_hit`` → ``(np.ndarray[int32], int)``; ``allocate_many`` → int32
  array or None; ``check_invariants()`` → None or InvariantViolation.

Choices where docs/contracts/paged-kv.md, '4. BlockAllocator' is silent (both allocators follow
them):

* A caller holds ``refcount - 1`` references on a cached block (the cache owns one). So
  ``free`` of a cache-only block, or a ``free_many`` freeing an id more often than that,
  is InvariantViolation with nothing changed.
* ``incref``, ``register_prefix`` and ``cache_full_blocks`` of a block that is not
  allocated (refcount 0, including the null block) → InvariantViolation.
* Hash 0 is reserved (docs/contracts/paged-kv.md, '2.1 Hot block hash'): ``register_prefix``,
``lookup_prefix`` and
  ``publish_restored_batch`` reject a ``block_hash`` outside ``[1, 2**64)`` with
  InvalidArgument. A ``_hash_fn`` result is taken modulo 2**64, then 0 → 1.
* An identity whose tokens are not exactly ``block_size`` long → InvalidArgument in
  ``register_prefix``, ``lookup_prefix`` and ``publish_restored_batch``.
* ``register_prefix`` refresh (same block, same hash) keeps the stored identity and only
  touches. Inside ``cache_full_blocks`` any present hash is verified first: a different
  identity stops the chain (counted), an identical one held by the same block is a
  refresh, by another block a replay that is skipped.
* ``cache_full_blocks`` with prefix capacity 0 returns 0 with nothing changed.
* Arguments are checked in one order, so a call with several faults reports the same one:
  ``tokens``, then ``block_ids``' shape and dtype, ``cache_salt``, the extra keys, the
  segment, the sizes, every id's range (the whole batch before any allocation check), then
  allocation. ``extra_keys=None`` is no keys. An empty list of ids is fine, an empty
  non-integer ndarray is InvalidArgumentType (as for tokens); an object ndarray of tokens is
  InvalidArgumentType unless a value is out of range (InvalidArgument).
* Block events: one call per kind per operation, "removed" before "stored";
  ``purge_prefix_cache`` always sends "cleared" (even when the table was empty).
"""

from collections.abc import Callable, Sequence
from typing import Final, TypeAlias, final

import numpy as np
import numpy.typing as npt

from pagedkv.identity import BlockIdentity as BlockIdentity
from pagedkv.identity import RestoredBlock as RestoredBlock

__all__ = [
    "BLOCK_DTYPE",
    "PREFIX_SLOT_DTYPE",
    "STATS_KEYS",
    "BlockAllocator",
    "BlockIdentity",
    "RestoredBlock",
]

BLOCK_DTYPE: Final[np.dtype]
PREFIX_SLOT_DTYPE: Final[np.dtype]
BLOCK_FREE: Final[int]
BLOCK_CACHED: Final[int]
BLOCK_NULL: Final[int]
STATS_KEYS: Final[tuple[str, ...]]

# Stub-only aliases (underscored: they do not exist at runtime).
_BlockEventHook: TypeAlias = Callable[[str, npt.NDArray[np.uint64]], object]
_HashFn: TypeAlias = Callable[[int, npt.NDArray[np.uint32], tuple, int, int, int], int]

def _c_layout() -> dict[str, dict[str, int]]: ...

@final
class BlockAllocator:
    def __init__(
        self,
        num_blocks: int,
        max_num_blocks: int | None = None,
        block_size: int = 16,
        *,
        hash_seed: int | None = None,
        reserve_null_block: bool = False,
        on_block_event: _BlockEventHook | None = None,
        _hash_fn: _HashFn | None = None,
    ) -> None: ...

    # sizes and O(1) counters
    @property
    def num_blocks(self) -> int: ...
    @property
    def max_num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_allocated_blocks(self) -> int: ...
    @property
    def num_evictable_blocks(self) -> int: ...
    @property
    def free_or_evictable_blocks(self) -> int: ...
    @property
    def prefix_cache_len(self) -> int: ...
    @property
    def prefix_cache_capacity(self) -> int: ...
    @property
    def null_block_id(self) -> int | None: ...
    @property
    def hash_seed(self) -> int: ...
    on_block_event: _BlockEventHook | None

    # read-only views of the physical tables
    @property
    def block_records(self) -> np.ndarray: ...
    @property
    def token_ids(self) -> npt.NDArray[np.uint32]: ...
    @property
    def prefix_slots(self) -> np.ndarray: ...

    # allocation
    def can_allocate(self, n: int) -> bool: ...
    def allocate(self) -> int | None: ...
    def allocate_many(self, n: int) -> npt.NDArray[np.int32] | None: ...
    def incref(self, block_id: int) -> None: ...
    def free(self, block_id: int) -> None: ...
    def free_many(self, block_ids: npt.ArrayLike) -> None: ...
    def ref_count(self, block_id: int) -> int: ...

    # prefix cache
    def chain_hashes(
        self,
        tokens: npt.ArrayLike,
        *,
        extra_keys: Sequence[int] = (),
        extra_keys_per_block: Sequence[Sequence[int]] | None = None,
        cache_salt: int | None = 0,
        parent_hash: int = 0,
        first_block: int = 0,
    ) -> npt.NDArray[np.uint64]: ...
    def cached_block_ids(
        self,
        tokens: npt.ArrayLike,
        *,
        extra_keys: Sequence[int] = (),
        extra_keys_per_block: Sequence[Sequence[int]] | None = None,
        cache_salt: int | None = 0,
        parent_hash: int = 0,
        first_block: int = 0,
    ) -> npt.NDArray[np.int32]: ...
    def incref_many(self, block_ids: npt.ArrayLike) -> None: ...
    def register_prefix(self, block_id: int, block_hash: int, identity: BlockIdentity) -> bool: ...
    def lookup_prefix(self, block_hash: int, identity: BlockIdentity) -> int | None: ...
    def find_longest_cache_hit(
        self,
        tokens: npt.ArrayLike,
        *,
        extra_keys: Sequence[int] = (),
        extra_keys_per_block: Sequence[Sequence[int]] | None = None,
        cache_salt: int | None = 0,
    ) -> tuple[npt.NDArray[np.int32], int]: ...
    def cache_full_blocks(
        self,
        tokens: npt.ArrayLike,
        block_ids: npt.ArrayLike,
        *,
        extra_keys: Sequence[int] = (),
        extra_keys_per_block: Sequence[Sequence[int]] | None = None,
        cache_salt: int | None = 0,
        parent_hash: int = 0,
        first_block: int = 0,
    ) -> int: ...
    def publish_restored_batch(self, entries: Sequence[RestoredBlock]) -> bool: ...
    def purge_prefix_cache(self) -> int: ...
    def set_prefix_cache_capacity(self, n: int) -> None: ...
    def grow_by(self, k: int) -> int: ...

    # diagnostics
    def stats(self) -> dict[str, int]: ...
    def lru_hashes(self) -> list[int]: ...
    def free_list(self) -> list[int]:
        """Free ids in pop order (front, the next one allocated, first)."""
    def check_invariants(self) -> None: ...
