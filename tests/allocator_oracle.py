"""Pure-Python oracle for the hot hashes and the BlockAllocator (docs/contracts/paged-kv.md, '2.
Block hashing' to '4. BlockAllocator').

This module is the executable reading of the spec: it keeps the *logical* state of
docs/contracts/paged-kv.md, '4.2 State'
literally (a ``deque`` free list, a refcount dict, an ``OrderedDict`` prefix table whose order
is the LRU order, an identity per entry and a reverse map) and implements every contract of
docs/contracts/paged-kv.md, '4. BlockAllocator' on it, step by step, with no attempt at speed. The
Cython core (``pagedkv.hashing``,
``pagedkv.allocator``) must agree with it on every observable; the differential test
``tests/test_allocator_stateful.py`` drives both with random operation sequences.

Readings of the spec that the text leaves open are decided here once, and both
implementations follow them:

* A caller can only free references it holds. The cache's own reference on a cached block is
  not the caller's: freeing a block whose only references are the cache's (a cache-only
  block), or more references than the caller holds in ``free_many``, is a refcount underflow
  and raises :class:`~pagedkv.errors.InvariantViolation` with nothing changed. Without this a
  free could put a block that still has a prefix entry on the free list (docs/contracts/paged-kv.md,
  '4.3 Invariants' items 1–2).
* ``register_prefix``, ``cache_full_blocks`` and ``publish_restored_batch`` need allocated
  blocks (``InvariantViolation`` otherwise); an alias move is refcount-neutral and never sends
  the block through the free list.
* Inside ``cache_full_blocks`` a hash already held by the *same* block with an identical
  identity is a refresh (touched, not new); held with a different identity by any block it
  stops the chain and counts in ``collisions_rejected``. A new entry (including an alias
  move) is inserted through ``register_prefix`` (so it is MRU when inserted and may
  capacity-evict), and at the end the accepted chain is touched deepest first.
* ``collisions_rejected`` counts every identity mismatch on a present hash: a
  ``lookup_prefix`` miss, a stopped ``find_longest_cache_hit`` walk, a stopped chain.
* Hash 0 is reserved (docs/contracts/paged-kv.md, '2.1 Hot block hash'):
``register_prefix``/``lookup_prefix``/``publish_restored_batch``
  reject ``block_hash`` outside ``[1, 2**64)`` with ``InvalidArgument``.
* Argument checks follow the Cython core's order (see pkg/pagedkv/allocator.pyi), so a
  call with several faults raises the same exception in both; ``extra_keys=None`` is no keys.
* Block events: one call per kind per operation, ``"removed"`` before ``"stored"``;
  ``purge_prefix_cache`` always sends ``"cleared"`` (even when the table was empty).
* ``grow_by`` resets the capacity override even when it adds no block (its steps in
docs/contracts/paged-kv.md,
  '4.7 Free-list order and grow_by' run unconditionally); ``stats()['grows']`` counts only calls that added blocks.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import xxhash

from pagedkv.errors import InvalidArgument, InvalidArgumentType, InvariantViolation
from pagedkv.identity import BlockIdentity, RestoredBlock, extra_keys_digest

__all__ = [
    "BlockAllocator",
    "chain_hashes",
    "hot_block_hash",
    "salt_domain_id",
]

_log = logging.getLogger(__name__)

_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1
#: Longest accepted salt in UTF-8 bytes (docs/contracts/paged-kv.md, '3. cache_salt domain id',
# upstream's server limit).
MAX_SALT_BYTES = 256

STATS_KEYS = ("query_tokens", "hit_tokens", "pressure_evictions", "capacity_evictions",
              "collisions_rejected", "grows")


# --- argument checks ----------------------------------------------------------------------


def _check_int(value, name: str, lo: int, hi: int) -> int:
    """An integer in ``[lo, hi]``; bools and non-integers are a type error."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentType(
            f"{name} must be an int in [{lo}, {hi}], got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise InvalidArgument(f"{name} = {value} is outside [{lo}, {hi}]")
    return value


def _check_u64(value, name: str) -> int:
    if isinstance(value, str):
        raise InvalidArgumentType(
            f"{name} must be a u64 domain id, got str {value!r}: "
            "turn a salt string into one with pagedkv.hashing.salt_domain_id(salt)")
    return _check_int(value, name, 0, _U64_MAX)


def _check_domain_id(value, name: str = "cache_salt") -> int:
    """A ``cache_salt`` u64 domain id; ``None`` is the shared domain 0, as for
    ``salt_domain_id(None)`` (pagedkv.hashing.as_domain_id)."""
    return 0 if value is None else _check_u64(value, name)


def _tokens_u32(tokens, name: str = "tokens") -> np.ndarray:
    """Any 1-D integer array-like as a C-contiguous ``uint32`` array (docs/contracts/paged-kv.md,
    '2.1 Hot block hash' rules)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32 and tokens.ndim == 1:
        return np.ascontiguousarray(tokens)
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError) as exc:  # ragged or unconvertible input
        raise InvalidArgumentType(f"{name} must be a 1-D array-like of integers: {exc}") from None
    if arr.ndim != 1:
        raise InvalidArgument(f"{name} must be 1-D, got ndim={arr.ndim} (shape {arr.shape})")
    if arr.size == 0 and not isinstance(tokens, np.ndarray):
        return np.empty(0, dtype=np.uint32)  # [] is float64 to NumPy; an empty list is fine
    if arr.dtype == object:
        # Python ints too large for int64/uint64 land here: range, not type, is the problem
        # when one is out of range; an object array of in-range ints is still a type error.
        values = arr.tolist()
        if all(type(t) is int for t in values):
            for t in values:
                if not 0 <= t <= _U32_MAX:
                    raise InvalidArgument(f"{name} must satisfy 0 <= t < 2**32, got {t}")
        raise InvalidArgumentType(f"{name} must be integers, got dtype object")
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentType(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _U32_MAX):
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise InvalidArgument(f"{name} must satisfy 0 <= t < 2**32, got {bad}")
    return np.ascontiguousarray(arr, dtype=np.uint32)


def _ids_array(ids, name: str) -> list[int]:
    """A 1-D integer array-like of block ids as a Python list (range checked by the caller)."""
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError, OverflowError) as exc:  # ragged or unconvertible input
        raise InvalidArgumentType(f"{name} must be a 1-D array-like of block ids: {exc}") from None
    if arr.ndim != 1:
        raise InvalidArgument(f"{name} must be 1-D, got ndim={arr.ndim}")
    if arr.size == 0 and not isinstance(ids, np.ndarray):
        return []  # [] is float64 to NumPy; an empty list is fine, an empty float array not
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentType(f"{name} must be integers, got dtype {arr.dtype}")
    return [int(x) for x in arr.tolist()]


def _check_ids_in_range(ids: list[int], num_blocks: int) -> None:
    """Every id in ``[0, num_blocks)``, checked for the whole batch before anything else."""
    for i, block_id in enumerate(ids):
        if not 0 <= block_id < num_blocks:
            raise InvalidArgument(f"block_ids[{i}] = {block_id} is outside [0, {num_blocks})")


def _keys_tuple(keys, name: str) -> tuple[int, ...]:
    if isinstance(keys, (str, bytes)) or not hasattr(keys, "__iter__"):
        raise InvalidArgumentType(
            f"{name} must be a sequence of ints in [0, 2**64), got {type(keys).__name__}")
    out = []
    for i, k in enumerate(keys):
        out.append(_check_int(k, f"{name}[{i}]", 0, _U64_MAX))
    return tuple(out)


def _chain_keys(extra_keys, extra_keys_per_block
                ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...] | None]:
    """Validate the two extra-key forms of docs/contracts/paged-kv.md, '2.2 Chains':
    ``(uniform keys, per-block keys or None)``. ``extra_keys=None`` means no keys; with
    ``extra_keys_per_block`` given, ``extra_keys`` must be empty (only its length is read)."""
    if extra_keys_per_block is None:
        return (() if extra_keys is None else _keys_tuple(extra_keys, "extra_keys")), None
    if extra_keys is not None and len(_keys_tuple(extra_keys, "extra_keys")) > 0:
        raise InvalidArgument(
            "pass either extra_keys (same keys for every block) or extra_keys_per_block, "
            "not both")
    if isinstance(extra_keys_per_block, (str, bytes)) or not hasattr(extra_keys_per_block,
                                                                     "__len__"):
        raise InvalidArgumentType(
            "extra_keys_per_block must be a sequence of key sequences, got "
            f"{type(extra_keys_per_block).__name__}")
    return (), tuple(_keys_tuple(keys, f"extra_keys_per_block[{i}]")
                     for i, keys in enumerate(extra_keys_per_block))


# --- hashing (docs/contracts/paged-kv.md, '2. Block hashing' and '3. cache_salt domain id') -------


def _hot_hash_buffer(parent: int, tokens: np.ndarray, keys: tuple[int, ...], cache_salt: int,
                     block_index: int) -> bytes:
    buf = bytearray(parent.to_bytes(8, "little"))
    buf += tokens.astype("<u4", copy=False).tobytes()
    buf += len(keys).to_bytes(8, "little")
    for k in keys:
        buf += k.to_bytes(8, "little")
    if block_index == 0 and cache_salt != 0:
        buf += cache_salt.to_bytes(8, "little")
    return bytes(buf)


def hot_block_hash(parent: int, tokens, extra_keys: Sequence[int] = (), cache_salt: int = 0,
                   block_index: int = 0, *, seed: int = 0) -> int:
    """XXH3-64 of one full block (docs/contracts/paged-kv.md, '2.1 Hot block hash'); never 0 (0
    means "no parent")."""
    parent = _check_u64(parent, "parent")
    toks = _tokens_u32(tokens)
    keys = _keys_tuple(extra_keys, "extra_keys")
    cache_salt = _check_domain_id(cache_salt)
    block_index = _check_int(block_index, "block_index", 0, _U64_MAX)
    seed = _check_u64(seed, "seed")
    h = xxhash.xxh3_64_intdigest(_hot_hash_buffer(parent, toks, keys, cache_salt, block_index),
                                 seed)
    return h or 1


def _chain(tokens: np.ndarray, block_size: int, uniform: tuple[int, ...],
           per_block: tuple[tuple[int, ...], ...] | None, cache_salt: int, seed: int,
           hash_fn: Callable | None, parent: int = 0, first_block: int = 0) -> list[int]:
    """Hashes of the full blocks of ``tokens``, chain blocks ``first_block ..`` chaining from
    ``parent`` (a segment; the whole chain when both are 0). Keys are segment-relative."""
    n = len(tokens) // block_size if block_size else 0
    if per_block is not None:
        n = min(n, len(per_block))
    out: list[int] = []
    for i in range(n):
        block = tokens[i * block_size:(i + 1) * block_size]
        keys = per_block[i] if per_block is not None else uniform
        index = first_block + i
        if hash_fn is None:
            h = xxhash.xxh3_64_intdigest(
                _hot_hash_buffer(parent, block, keys, cache_salt, index), seed) or 1
        else:
            h = (int(hash_fn(parent, block.copy(), keys, cache_salt, index, seed))
                 & _U64_MAX) or 1
        out.append(h)
        parent = h
    return out


def chain_hashes(tokens, block_size: int, *, extra_keys: Sequence[int] = (),
                 extra_keys_per_block: Sequence[Sequence[int]] | None = None,
                 cache_salt: int = 0, seed: int = 0) -> np.ndarray:
    """``uint64`` hot hashes of the full blocks of ``tokens`` (docs/contracts/paged-kv.md, '2.2
    Chains')."""
    toks = _tokens_u32(tokens)
    block_size = _check_int(block_size, "block_size", 0, _U32_MAX)
    cache_salt = _check_domain_id(cache_salt)
    seed = _check_u64(seed, "seed")
    uniform, per_block = _chain_keys(extra_keys, extra_keys_per_block)
    return np.array(_chain(toks, block_size, uniform, per_block, cache_salt, seed, None),
                    dtype=np.uint64)


def salt_domain_id(salt: str | None) -> int:
    """The u64 domain id of a ``cache_salt`` string (docs/contracts/paged-kv.md, '3. cache_salt
    domain id'); ``None`` is the shared domain 0."""
    if salt is None:
        return 0
    if not isinstance(salt, str):
        raise InvalidArgumentType(
            f"salt must be a str or None, got {type(salt).__name__}")
    try:
        raw = salt.encode("utf-8", "strict")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"salt is not encodable as UTF-8: {exc}") from None
    if not raw:
        raise InvalidArgument("salt must not be empty: pass None for the shared domain")
    if len(raw) > MAX_SALT_BYTES:
        raise InvalidArgument(
            f"salt is {len(raw)} bytes in UTF-8, the limit is {MAX_SALT_BYTES}")
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "little") or 1


# --- allocator (docs/contracts/paged-kv.md, '4. BlockAllocator') ----------------------------------


class BlockAllocator:
    """Reference BlockAllocator: the logical state of docs/contracts/paged-kv.md, '4.2 State' kept
    literally.

    Sizes are in blocks; ``block_size`` is in tokens. See the module docstring for the
    readings of the spec this oracle fixes.
    """

    def __init__(self, num_blocks: int, max_num_blocks: int | None = None,
                 block_size: int = 16, *, hash_seed: int | None = None,
                 reserve_null_block: bool = False,
                 on_block_event: Callable[[str, np.ndarray], None] | None = None,
                 _hash_fn: Callable | None = None) -> None:
        min_blocks = 2 if reserve_null_block else 1
        num_blocks = _check_int(num_blocks, "num_blocks", min_blocks, (1 << 31) - 1)
        if max_num_blocks is None:
            max_num_blocks = num_blocks
        max_num_blocks = _check_int(max_num_blocks, "max_num_blocks", 1, (1 << 31) - 1)
        if max_num_blocks < num_blocks:
            raise InvalidArgument(
                f"max_num_blocks = {max_num_blocks} is below num_blocks = {num_blocks}; "
                "it must be >= num_blocks")
        block_size = _check_int(block_size, "block_size", 1, 1 << 20)
        self._seed = secrets.randbits(64) if hash_seed is None else _check_u64(hash_seed,
                                                                                "hash_seed")
        self._num_blocks = num_blocks
        self._max_num_blocks = max_num_blocks
        self._block_size = block_size
        self._null_block_id = 0 if reserve_null_block else None
        self._hash_fn = _hash_fn
        self.on_block_event = on_block_event

        first = 1 if reserve_null_block else 0
        self._free: deque[int] = deque(range(first, num_blocks))
        self._refcount: dict[int, int] = {}
        # hash -> block id; iteration order is LRU order, oldest first.
        self._prefix: OrderedDict[int, int] = OrderedDict()
        self._identity: dict[int, BlockIdentity] = {}
        self._block_hash: dict[int, int] = {}
        self._capacity = num_blocks
        self._num_evictable = 0
        self._stats = dict.fromkeys(STATS_KEYS, 0)

    # -- counters ------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def max_num_blocks(self) -> int:
        return self._max_num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def hash_seed(self) -> int:
        return self._seed

    @property
    def null_block_id(self) -> int | None:
        return self._null_block_id

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_allocated_blocks(self) -> int:
        return len(self._refcount)

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable

    @property
    def free_or_evictable_blocks(self) -> int:
        return len(self._free) + self._num_evictable

    @property
    def prefix_cache_len(self) -> int:
        return len(self._prefix)

    @property
    def prefix_cache_capacity(self) -> int:
        return self._capacity

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def lru_hashes(self) -> list[int]:
        return list(self._prefix)

    def free_list(self) -> list[int]:
        """The free queue, front (next to be allocated) first."""
        return list(self._free)

    def ref_count(self, block_id: int) -> int:
        block_id = self._check_id(block_id, "block_id")
        return self._refcount.get(block_id, 0)

    def __repr__(self) -> str:
        return (f"<oracle BlockAllocator {self._num_blocks}/{self._max_num_blocks} blocks "
                f"of {self._block_size} tokens: {len(self._free)} free, "
                f"{len(self._refcount)} allocated, {len(self._prefix)} cached "
                f"({self._num_evictable} cache-only), capacity {self._capacity}>")

    # -- internal helpers ----------------------------------------------------------------

    def _check_id(self, block_id, name: str) -> int:
        return _check_int(block_id, name, 0, self._num_blocks - 1)

    def _check_allocated(self, block_id: int, name: str) -> None:
        if block_id not in self._refcount:
            what = "the null block" if block_id == self._null_block_id else "free"
            raise InvariantViolation(
                f"{name} = {block_id} is not allocated ({what}); only allocated blocks "
                "can be used here")

    def _check_hash(self, block_hash, name: str = "block_hash") -> int:
        return _check_int(block_hash, name, 1, _U64_MAX)

    def _check_identity(self, identity, name: str = "identity") -> BlockIdentity:
        if not isinstance(identity, BlockIdentity):
            raise InvalidArgumentType(
                f"{name} must be a pagedkv.identity.BlockIdentity, got "
                f"{type(identity).__name__}")
        toks = _tokens_u32(identity.tokens, f"{name}.tokens")
        if len(toks) != self._block_size:
            raise InvalidArgument(
                f"{name}.tokens has {len(toks)} tokens; a block holds exactly "
                f"block_size = {self._block_size}")
        digest = identity.extra_keys_digest
        if not isinstance(digest, (bytes, bytearray)) or len(digest) not in (0, 16):
            raise InvalidArgument(
                f"{name}.extra_keys_digest must be b'' or 16 bytes "
                "(pagedkv.identity.extra_keys_digest)")
        return BlockIdentity(toks.copy(), _check_u64(identity.parent_hash, f"{name}.parent_hash"),
                             bytes(digest), _check_domain_id(identity.cache_salt, f"{name}.cache_salt"),
                             _check_int(identity.block_index, f"{name}.block_index", 0,
                                        _U64_MAX))

    def _is_cached(self, block_id: int) -> bool:
        return block_id in self._block_hash

    def _incref(self, block_id: int) -> None:
        rc = self._refcount[block_id]
        if rc == 1 and self._is_cached(block_id):
            self._num_evictable -= 1
        self._refcount[block_id] = rc + 1

    def _decref(self, block_id: int) -> None:
        """Drop one reference; at 0 the block joins the back of the free list."""
        rc = self._refcount[block_id] - 1
        if rc == 0:
            del self._refcount[block_id]
            self._free.append(block_id)
        else:
            self._refcount[block_id] = rc
            if rc == 1 and self._is_cached(block_id):
                self._num_evictable += 1

    def _remove_entry(self, block_hash: int) -> int:
        """Drop an entry, its identity and reverse mapping; return its block (not decref'd)."""
        block_id = self._prefix.pop(block_hash)
        del self._identity[block_hash]
        del self._block_hash[block_id]
        if self._refcount[block_id] == 1:
            self._num_evictable -= 1
        return block_id

    def _insert_entry(self, block_hash: int, block_id: int, identity: BlockIdentity) -> None:
        """New MRU entry holding one reference on ``block_id``."""
        self._prefix[block_hash] = block_id
        self._identity[block_hash] = identity
        self._block_hash[block_id] = block_hash
        self._refcount[block_id] += 1
        if self._refcount[block_id] == 1:  # an alias move of a cache-only block
            self._num_evictable += 1

    def _evict_front(self, removed: list[int]) -> None:
        """Capacity eviction of the LRU-oldest entry, whatever its refcount."""
        block_hash = next(iter(self._prefix))
        block_id = self._remove_entry(block_hash)
        self._decref(block_id)
        self._stats["capacity_evictions"] += 1
        removed.append(block_hash)

    def _emit(self, kind: str, hashes: Iterable[int]) -> None:
        hook = self.on_block_event
        if hook is None:
            return
        try:
            hook(kind, np.array(list(hashes), dtype=np.uint64))
        except Exception:  # noqa: BLE001 - the hook never undoes an operation (docs/contracts/paged-kv.md, '4.10 Stats and block events')
            _log.exception("on_block_event hook raised for %r; ignored", kind)

    def _emit_changes(self, removed: list[int], stored: list[int]) -> None:
        """The operation's net change: removed hashes no longer in the table, stored ones
        still in it (a hash stored and evicted by one operation is only removed)."""
        removed = [h for h in dict.fromkeys(removed) if h not in self._prefix]
        stored = [h for h in dict.fromkeys(stored) if h in self._prefix]
        if removed:
            self._emit("removed", removed)
        if stored:
            self._emit("stored", stored)

    def _touch_deepest_first(self, chain: list[int]) -> None:
        for block_hash in reversed(chain):
            if block_hash in self._prefix:
                self._prefix.move_to_end(block_hash)

    def _register(self, block_id: int, block_hash: int, identity: BlockIdentity,
                  removed: list[int], stored: list[int]) -> bool:
        """``register_prefix`` steps (0)–(4) on validated arguments."""
        if self._capacity == 0:
            return False
        holder = self._prefix.get(block_hash)
        if holder is not None and holder != block_id:
            return False
        if holder == block_id:  # refresh: touch only
            self._prefix.move_to_end(block_hash)
            return True
        old_hash = self._block_hash.get(block_id)
        if old_hash is not None:
            # Alias move: the cache's reference carries over to the new entry, so the block
            # never passes through 0 (it may be cache-only).
            self._remove_entry(old_hash)
            self._refcount[block_id] -= 1
            removed.append(old_hash)
        while len(self._prefix) >= self._capacity:
            self._evict_front(removed)
        self._insert_entry(block_hash, block_id, identity)
        stored.append(block_hash)
        return True

    def _block_identities(self, toks: np.ndarray, hashes: list[int],
                          keys_of: Callable[[int], tuple[int, ...]],
                          cache_salt: int, parent: int = 0,
                          first_block: int = 0) -> list[BlockIdentity]:
        bs = self._block_size
        out = []
        for i, h in enumerate(hashes):
            out.append(BlockIdentity(toks[i * bs:(i + 1) * bs].copy(), parent,
                                     extra_keys_digest(keys_of(i)), cache_salt,
                                     first_block + i))
            parent = h
        return out

    def _chain_args(self, tokens, extra_keys, extra_keys_per_block, cache_salt):
        toks = _tokens_u32(tokens)
        cache_salt = _check_domain_id(cache_salt)
        uniform, per_block = _chain_keys(extra_keys, extra_keys_per_block)
        return toks, uniform, per_block, cache_salt

    @staticmethod
    def _segment_args(parent_hash, first_block) -> tuple[int, int]:
        """A chain segment's start: block 0 chains from 0, a later block from a real hash."""
        parent = _check_u64(parent_hash, "parent_hash")
        first = _check_int(first_block, "first_block", 0, (1 << 62) - 1)
        if first == 0 and parent != 0:
            raise InvalidArgument(
                f"parent_hash = {parent:#x} with first_block = 0: block 0 chains from 0")
        if first > 0 and parent == 0:
            raise InvalidArgument(
                f"first_block = {first} needs parent_hash = the hash of block {first - 1}")
        return parent, first

    # -- allocation ----------------------------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        n = _check_int(n, "n", 0, _U64_MAX)
        return len(self._free) >= n or len(self._free) + self._num_evictable >= n

    def _allocate_one(self, removed: list[int]) -> int | None:
        if self._free:
            block_id = self._free.popleft()
            self._refcount[block_id] = 1
            return block_id
        for block_hash, block_id in self._prefix.items():
            if self._refcount[block_id] == 1:
                self._remove_entry(block_hash)
                # The cache's reference becomes the caller's: refcount stays 1.
                self._stats["pressure_evictions"] += 1
                removed.append(block_hash)
                return block_id
        return None

    def allocate(self) -> int | None:
        removed: list[int] = []
        block_id = self._allocate_one(removed)
        self._emit_changes(removed, [])
        return block_id

    def allocate_many(self, n: int) -> np.ndarray | None:
        n = _check_int(n, "n", 0, (1 << 31) - 1)
        if not self.can_allocate(n):
            return None
        removed: list[int] = []
        out = np.empty(n, dtype=np.int32)
        for i in range(n):
            block_id = self._allocate_one(removed)
            assert block_id is not None, "can_allocate passed but allocate failed"
            out[i] = block_id
        self._emit_changes(removed, [])
        return out

    def incref(self, block_id: int) -> None:
        block_id = self._check_id(block_id, "block_id")
        self._check_allocated(block_id, "block_id")
        self._incref(block_id)

    def _caller_refs(self, block_id: int) -> int:
        """References a caller may free: all but the cache's own."""
        return self._refcount.get(block_id, 0) - (1 if self._is_cached(block_id) else 0)

    def free(self, block_id: int) -> None:
        block_id = self._check_id(block_id, "block_id")
        self._check_allocated(block_id, "block_id")
        if self._caller_refs(block_id) < 1:
            raise InvariantViolation(
                f"block_id = {block_id} is held only by the prefix cache (refcount 1, "
                "cache-only): freeing it would underflow the caller's references")
        self._decref(block_id)

    def free_many(self, block_ids) -> None:
        ids = _ids_array(block_ids, "block_ids")
        _check_ids_in_range(ids, self._num_blocks)
        counts: dict[int, int] = {}
        for block_id in ids:
            counts[block_id] = counts.get(block_id, 0) + 1
        for block_id, times in counts.items():
            held = self._caller_refs(block_id)
            if held < times:
                raise InvariantViolation(
                    f"block_ids frees block {block_id} {times} time(s) but the caller holds "
                    f"{max(held, 0)} reference(s) on it (refcount "
                    f"{self._refcount.get(block_id, 0)}"
                    f"{', one is the prefix cache' if self._is_cached(block_id) else ''})")
        for block_id in ids:
            self._decref(block_id)

    # -- prefix table --------------------------------------------------------------------

    def register_prefix(self, block_id: int, block_hash: int, identity: BlockIdentity) -> bool:
        block_id = self._check_id(block_id, "block_id")
        block_hash = self._check_hash(block_hash)
        identity = self._check_identity(identity)
        self._check_allocated(block_id, "block_id")
        removed: list[int] = []
        stored: list[int] = []
        ok = self._register(block_id, block_hash, identity, removed, stored)
        self._emit_changes(removed, stored)
        return ok

    def lookup_prefix(self, block_hash: int, identity: BlockIdentity) -> int | None:
        block_hash = self._check_hash(block_hash)
        identity = self._check_identity(identity)
        block_id = self._prefix.get(block_hash)
        if block_id is None:
            return None
        if not self._identity[block_hash].same_as(identity):
            self._stats["collisions_rejected"] += 1
            return None
        self._prefix.move_to_end(block_hash)
        self._incref(block_id)
        return block_id

    def _segment_chain(self, tokens, extra_keys, extra_keys_per_block, cache_salt,
                       parent_hash, first_block):
        """Checked arguments of a chain segment and its hashes."""
        toks, uniform, per_block, cache_salt = self._chain_args(
            tokens, extra_keys, extra_keys_per_block, cache_salt)
        parent, first = self._segment_args(parent_hash, first_block)
        hashes = _chain(toks, self._block_size, uniform, per_block, cache_salt, self._seed,
                        self._hash_fn, parent, first)
        return toks, uniform, per_block, cache_salt, parent, first, hashes

    def chain_hashes(self, tokens, *, extra_keys: Sequence[int] = (),
                     extra_keys_per_block: Sequence[Sequence[int]] | None = None,
                     cache_salt: int = 0, parent_hash: int = 0,
                     first_block: int = 0) -> np.ndarray:
        hashes = self._segment_chain(tokens, extra_keys, extra_keys_per_block, cache_salt,
                                     parent_hash, first_block)[-1]
        return np.array(hashes, dtype=np.uint64)

    def cached_block_ids(self, tokens, *, extra_keys: Sequence[int] = (),
                         extra_keys_per_block: Sequence[Sequence[int]] | None = None,
                         cache_salt: int = 0, parent_hash: int = 0,
                         first_block: int = 0) -> np.ndarray:
        """Per full block, the verified cached id or -1; changes nothing."""
        toks, uniform, per_block, cache_salt, parent, first, hashes = self._segment_chain(
            tokens, extra_keys, extra_keys_per_block, cache_salt, parent_hash, first_block)
        keys_of = (lambda i: per_block[i]) if per_block is not None else (lambda i: uniform)
        out = np.full(len(hashes), -1, np.int32)
        for i, (block_hash, identity) in enumerate(zip(
                hashes, self._block_identities(toks, hashes, keys_of, cache_salt, parent,
                                               first), strict=True)):
            block_id = self._prefix.get(block_hash)
            if block_id is not None and self._identity[block_hash].same_as(identity):
                out[i] = block_id
        return out

    def incref_many(self, block_ids) -> None:
        ids = _ids_array(block_ids, "block_ids")
        _check_ids_in_range(ids, self._num_blocks)
        for i, block_id in enumerate(ids):
            self._check_allocated(block_id, f"block_ids[{i}]")
        for block_id in ids:
            self._incref(block_id)

    def find_longest_cache_hit(self, tokens, *, extra_keys: Sequence[int] = (),
                               extra_keys_per_block: Sequence[Sequence[int]] | None = None,
                               cache_salt: int = 0) -> tuple[np.ndarray, int]:
        toks, uniform, per_block, cache_salt = self._chain_args(
            tokens, extra_keys, extra_keys_per_block, cache_salt)
        self._stats["query_tokens"] += len(toks)
        hashes = _chain(toks, self._block_size, uniform, per_block, cache_salt, self._seed,
                        self._hash_fn)
        keys_of = (lambda i: per_block[i]) if per_block is not None else (lambda i: uniform)
        hits: list[int] = []
        hit_hashes: list[int] = []
        for block_hash, identity in zip(hashes,
                                        self._block_identities(toks, hashes, keys_of,
                                                               cache_salt), strict=True):
            block_id = self._prefix.get(block_hash)
            if block_id is None:
                break
            if not self._identity[block_hash].same_as(identity):
                self._stats["collisions_rejected"] += 1
                break
            hits.append(block_id)
            hit_hashes.append(block_hash)
        for block_id in hits:
            self._incref(block_id)
        self._touch_deepest_first(hit_hashes)
        n_tokens = len(hits) * self._block_size
        self._stats["hit_tokens"] += n_tokens
        return np.array(hits, dtype=np.int32), n_tokens

    def cache_full_blocks(self, tokens, block_ids, *, extra_keys: Sequence[int] = (),
                          extra_keys_per_block: Sequence[Sequence[int]] | None = None,
                          cache_salt: int = 0, parent_hash: int = 0,
                          first_block: int = 0) -> int:
        # checked in the Cython core's order: tokens, ids, salt, keys, segment, then sizes
        toks = _tokens_u32(tokens)
        ids = _ids_array(block_ids, "block_ids")
        toks, uniform, per_block, cache_salt = self._chain_args(
            toks, extra_keys, extra_keys_per_block, cache_salt)
        parent, first = self._segment_args(parent_hash, first_block)
        bs = self._block_size
        if len(ids) * bs > len(toks):
            raise InvalidArgument(
                f"block_ids has {len(ids)} blocks ({len(ids) * bs} tokens at block_size "
                f"{bs}) but tokens has only {len(toks)}; register only the full blocks: "
                "block_ids[:len(tokens) // block_size]")
        if per_block is not None and len(per_block) < len(ids):
            raise InvalidArgument(
                f"extra_keys_per_block has {len(per_block)} entries for {len(ids)} blocks; "
                "it needs one per registered block")
        _check_ids_in_range(ids, self._num_blocks)
        for i, block_id in enumerate(ids):
            self._check_allocated(block_id, f"block_ids[{i}]")
        hashes = _chain(toks[:len(ids) * bs], bs, uniform, per_block, cache_salt, self._seed,
                        self._hash_fn, parent, first)
        keys_of = (lambda i: per_block[i]) if per_block is not None else (lambda i: uniform)
        identities = self._block_identities(toks, hashes, keys_of, cache_salt, parent, first)

        removed: list[int] = []
        stored: list[int] = []
        accepted: list[int] = []
        new_entries = 0
        # pinned for the walk: an insert's capacity eviction must not free a later block of
        # the chain that only the cache holds (it would then be registered while free)
        for block_id in ids:
            self._incref(block_id)
        for block_id, block_hash, identity in zip(ids, hashes, identities, strict=True):
            holder = self._prefix.get(block_hash)
            if holder is not None:
                if not self._identity[block_hash].same_as(identity):
                    self._stats["collisions_rejected"] += 1
                    break  # nothing past a collision is registered
                if holder != block_id:
                    accepted.append(block_hash)  # replay of an already-cached block: skip
                    continue
            if self._register(block_id, block_hash, identity, removed, stored):
                accepted.append(block_hash)
                if holder is None:
                    new_entries += 1
        self._touch_deepest_first(accepted)
        for block_id in ids:
            self._decref(block_id)
        self._emit_changes(removed, stored)
        return new_entries

    def publish_restored_batch(self, entries: Sequence[RestoredBlock]) -> bool:
        try:
            entries = list(iter(entries))
        except TypeError:
            raise InvalidArgumentType(f"entries must be an iterable of RestoredBlock, got "
                                      f"{type(entries).__name__}") from None
        checked: list[tuple[int, int, BlockIdentity]] = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, RestoredBlock):
                raise InvalidArgumentType(
                    f"entries[{i}] must be a pagedkv.identity.RestoredBlock, got "
                    f"{type(entry).__name__}")
            identity = self._check_identity(entry.identity, f"entries[{i}].identity")
            block_hash = self._check_hash(entry.block_hash, f"entries[{i}].block_hash")
            block_id = self._check_id(entry.block_id, f"entries[{i}].block_id")
            checked.append((block_id, block_hash, identity))
        for i, (block_id, _, _) in enumerate(checked):
            self._check_allocated(block_id, f"entries[{i}].block_id")
        ids = [c[0] for c in checked]
        hashes = [c[1] for c in checked]
        if len(set(ids)) != len(ids) or len(set(hashes)) != len(hashes):
            return False
        if any(b in self._block_hash for b in ids) or any(h in self._prefix for h in hashes):
            return False
        if len(checked) > self._capacity:
            return False
        removed: list[int] = []
        stored: list[int] = []
        for block_id, block_hash, identity in checked:
            while len(self._prefix) >= self._capacity:
                self._evict_front(removed)
            self._insert_entry(block_hash, block_id, identity)
            stored.append(block_hash)
        self._touch_deepest_first(hashes)
        self._emit_changes(removed, stored)
        return True

    def purge_prefix_cache(self) -> int:
        dropped = 0
        while self._prefix:
            block_hash = next(iter(self._prefix))
            self._decref(self._remove_entry(block_hash))
            dropped += 1
        self._emit("cleared", ())
        return dropped

    def set_prefix_cache_capacity(self, n: int) -> None:
        n = _check_int(n, "n", 0, (1 << 31) - 1)
        self._capacity = n
        removed: list[int] = []
        while len(self._prefix) > n:
            self._evict_front(removed)
        self._emit_changes(removed, [])

    def grow_by(self, k: int) -> int:
        k = _check_int(k, "k", 0, (1 << 31) - 1)
        old = self._num_blocks
        target = min(old + k, self._max_num_blocks)
        self._free.extend(range(old, target))
        self._num_blocks = target
        self._capacity = target
        if target > old:
            self._stats["grows"] += 1
        return target - old

    # -- diagnostics ---------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise :class:`InvariantViolation` naming the first broken rule of
        docs/contracts/paged-kv.md, '4.3 Invariants'. An orphaned block (a reference no
        owner will free) is not detectable here: references other than the cache's are
        anonymous counts, as in the Cython allocator (its check_invariants says why)."""
        def fail(msg: str) -> None:
            raise InvariantViolation(f"oracle allocator invariant broken: {msg}")

        free = list(self._free)
        if len(set(free)) != len(free):
            fail("a block id appears twice in the free list")
        for b in free:
            if not 0 <= b < self._num_blocks or b == self._null_block_id:
                fail(f"free list holds invalid id {b}")
            if b in self._refcount:
                fail(f"block {b} is both free and allocated")
        for b, rc in self._refcount.items():
            if not 0 <= b < self._num_blocks or b == self._null_block_id:
                fail(f"refcount table holds invalid id {b}")
            if rc < 1:
                fail(f"allocated block {b} has refcount {rc}")
        usable = self._num_blocks - (1 if self._null_block_id is not None else 0)
        if len(free) + len(self._refcount) != usable:
            fail(f"free {len(free)} + allocated {len(self._refcount)} != {usable}")
        if set(self._identity) != set(self._prefix):
            fail("identities and prefix entries differ")
        if len(self._block_hash) != len(self._prefix):
            fail("reverse map and prefix table sizes differ")
        evictable = 0
        for h, b in self._prefix.items():
            if self._block_hash.get(b) != h:
                fail(f"prefix entry {h:#x} -> {b} has no matching reverse entry")
            if b not in self._refcount:
                fail(f"cached block {b} is not allocated")
            evictable += self._refcount[b] == 1
        if evictable != self._num_evictable:
            fail(f"cache-only count {self._num_evictable} != {evictable} counted")
        if len(self._prefix) > self._capacity:
            fail(f"{len(self._prefix)} entries exceed capacity {self._capacity}")
