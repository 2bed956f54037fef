# cython: language_level=3
"""BlockAllocator: refcounted KV blocks with a verified, LRU-evicted prefix cache.

Contracts: docs/contracts/paged-kv.md, '4. BlockAllocator'. Physical representation:
docs/development.md, 'Core layouts'.

* ``block_records``: one ``BLOCK_DTYPE`` record per block id, ``max_num_blocks`` long
  and sized up front, so ``grow_by`` never reallocates. It carries the refcount, the
  cached identity (parent hash, salt, chain index, extra-key digest) and the links of
  two intrusive doubly-linked lists: the FIFO free queue and the prefix LRU.
* ``token_ids``: ``uint32[max_num_blocks, block_size]``, the token identity of each
  cached block, compared in full on every hash → block path.
* ``prefix_slots``: the prefix table, open addressing with linear probing over a
  power-of-two ``PREFIX_SLOT_DTYPE`` array at most half full; deletion shifts later
  entries back (no tombstones), so probe lengths stay short after any churn.

The allocator is not thread-safe: callers serialize access (the adapter holds a lock).
"""

import logging
import secrets

import numpy as np

cimport numpy as cnp
from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

from pagedkv.struct_fields cimport field_table, pkv_struct_field
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy, memset

from pagedkv.argument_checks import is_int
from pagedkv.c_struct_dtype import dtype_of_c_struct
from pagedkv.errors import InvalidArgument, InvalidArgumentType, InvariantViolation
from pagedkv.identity import BlockIdentity, RestoredBlock

from pagedkv.hashing cimport (
    ChainKeys,
    as_domain_id,
    as_token_array,
    as_u64,
    chain_segment_into,
    hash_block,
    hash_block_native,
    hot_buffer_bytes,
    make_chain_keys,
    xxh3_native,
)
from pagedkv.hashing import XXH3_SOURCE

cnp.import_array()

__all__ = ["BLOCK_DTYPE", "PREFIX_SLOT_DTYPE", "BlockAllocator", "BlockIdentity",
           "RestoredBlock", "STATS_KEYS"]

_log = logging.getLogger("pagedkv.allocator")

#: ``pkv_block_record.flags`` bits.
BLOCK_FREE = PKV_BLOCK_FREE
BLOCK_CACHED = PKV_BLOCK_CACHED
BLOCK_NULL = PKV_BLOCK_NULL

#: The keys of ``BlockAllocator.stats()``, in order.
STATS_KEYS = ("query_tokens", "hit_tokens", "pressure_evictions", "capacity_evictions",
              "collisions_rejected", "grows")

cdef extern from *:
    """
    #include "pagedkv/records.h"
    #include "pagedkv/struct_fields.h"
    /* The members the NumPy views carry, as this C compiler lays the records out. */
    static const pkv_struct_field pkv_block_record_fields[] = {
        PKV_STRUCT_FIELD(pkv_block_record, hot_hash),
        PKV_STRUCT_FIELD(pkv_block_record, parent_hash),
        PKV_STRUCT_FIELD(pkv_block_record, cache_salt),
        PKV_STRUCT_FIELD(pkv_block_record, block_index),
        PKV_STRUCT_FIELD(pkv_block_record, extra_keys_digest),
        PKV_STRUCT_FIELD(pkv_block_record, refcount),
        PKV_STRUCT_FIELD(pkv_block_record, token_count),
        PKV_STRUCT_FIELD(pkv_block_record, lru_prev),
        PKV_STRUCT_FIELD(pkv_block_record, lru_next),
        PKV_STRUCT_FIELD(pkv_block_record, free_prev),
        PKV_STRUCT_FIELD(pkv_block_record, free_next),
        PKV_STRUCT_FIELD(pkv_block_record, flags),
        PKV_STRUCT_FIELD(pkv_block_record, extra_keys_digest_len)};
    static const pkv_struct_field pkv_prefix_slot_fields[] = {
        PKV_STRUCT_FIELD(pkv_prefix_slot, key), PKV_STRUCT_FIELD(pkv_prefix_slot, block),
        PKV_STRUCT_FIELD(pkv_prefix_slot, _pad)};
    #define PKV_N_BLOCK_FIELDS PKV_COUNT_OF(pkv_block_record_fields)
    #define PKV_N_SLOT_FIELDS PKV_COUNT_OF(pkv_prefix_slot_fields)
    """
    const pkv_struct_field pkv_block_record_fields[]
    const pkv_struct_field pkv_prefix_slot_fields[]
    Py_ssize_t PKV_N_BLOCK_FIELDS
    Py_ssize_t PKV_N_SLOT_FIELDS


def _c_layout():
    """``sizeof``/``offsetof`` of the records.h structs as the C compiler laid them out:
    ``{struct: {"itemsize": n, member: offset, ...}}``."""
    out = {}
    for struct, size, fields in (
            ("pkv_block_record", sizeof(pkv_block_record),
             field_table(pkv_block_record_fields, PKV_N_BLOCK_FIELDS)),
            ("pkv_prefix_slot", sizeof(pkv_prefix_slot),
             field_table(pkv_prefix_slot_fields, PKV_N_SLOT_FIELDS))):
        out[struct] = {"itemsize": size, **{f[0]: f[1] for f in fields}}
    return out


#: NumPy view of ``pkv_block_record`` (records.h), built from the struct as compiled: 80
#: bytes, natural alignment.
BLOCK_DTYPE = dtype_of_c_struct(sizeof(pkv_block_record),
                                field_table(pkv_block_record_fields, PKV_N_BLOCK_FIELDS),
                                align=True)

#: NumPy view of ``pkv_prefix_slot`` (records.h): 16 bytes.
PREFIX_SLOT_DTYPE = dtype_of_c_struct(sizeof(pkv_prefix_slot),
                                      field_table(pkv_prefix_slot_fields, PKV_N_SLOT_FIELDS),
                                      align=True)


cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define pkv_prefetch(p) __builtin_prefetch((const void *)(p))
    #else
    #define pkv_prefetch(p) ((void)(p))
    #endif
    """
    void pkv_prefetch(const void* p) noexcept nogil

# Blocks hashed and probed together by the longest-hit walk (bounds the wasted hashing
# past a miss and the memory accesses in flight).
cdef enum:
    _WALK_GROUP = 16

# Fibonacci hashing spreads caller-chosen keys (tests use 1, 2, 3) over the table.
cdef uint64_t _FIB = 0x9E3779B97F4A7C15ULL
cdef int32_t _NO = PKV_NO_BLOCK


cdef uint64_t _block_hash_arg(object block_hash, str name) except 0:
    """A caller-supplied hot hash: 0 is reserved (docs/contracts/paged-kv.md, '2.1 Hot block hash'),
    so the range is [1, 2**64)."""
    cdef uint64_t h = as_u64(block_hash, name)
    if h == 0:
        raise InvalidArgument(
            f"{name} = 0 is reserved (\"no parent\"); hot hashes are in [1, 2**64)")
    return h


cdef Py_ssize_t _count_arg(object n, str name) except -1:
    """A count in [0, 2**31): block counts never exceed the int32 id range."""
    if not is_int(n):
        raise InvalidArgumentType(f"{name} must be an int >= 0, got {type(n).__name__}")
    if not 0 <= n <= 0x7FFFFFFF:
        raise InvalidArgument(f"{name} = {n} is outside [0, 2**31)")
    return n


cdef cnp.ndarray _id_array(object ids, str name):
    is_array = isinstance(ids, np.ndarray)
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgumentType(f"{name} must be a 1-D array-like of block ids ({exc})") from None
    if arr.ndim != 1:
        raise InvalidArgument(f"{name} must be 1-D, got ndim={arr.ndim} (shape {arr.shape})")
    if arr.size == 0 and not is_array:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentType(
            f"{name} must hold integer block ids, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > 0x7FFFFFFFFFFFFFFF:
        raise InvalidArgument(f"{name} contains {int(arr.max())}, not a block id")
    return np.ascontiguousarray(arr, dtype=np.int64)


cdef tuple _segment_args(object parent_hash, object first_block):
    """Validated ``(parent_hash, first_block)`` of a chain segment: block 0 chains from 0,
    any later block from a real (never 0) hash."""
    cdef uint64_t parent = as_u64(parent_hash, "parent_hash")
    if not is_int(first_block):
        raise InvalidArgumentType(
            f"first_block must be an int >= 0, got {type(first_block).__name__}")
    if not 0 <= first_block < (1 << 62):
        raise InvalidArgument(f"first_block = {first_block} must be >= 0")
    if first_block == 0 and parent != 0:
        raise InvalidArgument(
            f"parent_hash = {parent:#x} with first_block = 0: block 0 chains from 0; pass "
            "first_block = the index of the segment's first block")
    if first_block > 0 and parent == 0:
        raise InvalidArgument(
            f"first_block = {first_block} needs parent_hash = the hash of block "
            f"{first_block - 1} (chain_hashes(...)[{first_block - 1}]), got 0")
    return parent, <int64_t>first_block


def _fail(str message):
    raise InvariantViolation("check_invariants: " + message)


cdef class BlockAllocator:
    """Refcounted KV block ids with a content-addressed, verified prefix cache.

    ``BlockAllocator(num_blocks, max_num_blocks=None, block_size=16, *, hash_seed=None,
    reserve_null_block=False, on_block_event=None, _hash_fn=None)``; see docs/contracts/paged-kv.md,
    '4. BlockAllocator'
    and allocator.pyi for every method's contract.
    """

    def __cinit__(self):
        self.scratch = NULL
        self.scratch_bytes = 0

    def __dealloc__(self):
        if self.scratch != NULL:
            free(self.scratch)

    def __init__(self, num_blocks, max_num_blocks=None, block_size=16, *, hash_seed=None,
                 reserve_null_block=False, on_block_event=None, _hash_fn=None):
        cdef Py_ssize_t i, table_size
        cdef cnp.ndarray rec, tok, slots, mult
        if not is_int(num_blocks):
            raise InvalidArgumentType(
                f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if max_num_blocks is None:
            max_num_blocks = num_blocks
        if not is_int(max_num_blocks):
            raise InvalidArgumentType(
                f"max_num_blocks must be an int, got {type(max_num_blocks).__name__}")
        if not is_int(block_size):
            raise InvalidArgumentType(
                f"block_size must be an int, got {type(block_size).__name__}")
        min_blocks = 2 if reserve_null_block else 1
        if num_blocks < min_blocks:
            raise InvalidArgument(
                f"num_blocks = {num_blocks} must be >= {min_blocks}"
                + (" (one block is the reserved null block)" if reserve_null_block else ""))
        if max_num_blocks < num_blocks:
            raise InvalidArgument(
                f"max_num_blocks = {max_num_blocks} must be >= num_blocks = {num_blocks}")
        if max_num_blocks > 0x7FFFFFFF - 1:
            raise InvalidArgument(
                f"max_num_blocks = {max_num_blocks} exceeds the int32 block-id range")
        if block_size < 1:
            raise InvalidArgument(f"block_size = {block_size} must be >= 1")
        if _hash_fn is not None and not callable(_hash_fn):
            raise InvalidArgumentType("_hash_fn must be callable or None")
        if on_block_event is not None and not callable(on_block_event):
            raise InvalidArgumentType("on_block_event must be callable or None")
        self._seed = secrets.randbits(64) if hash_seed is None else as_u64(hash_seed, "hash_seed")
        self._num_blocks = num_blocks
        self._max_num_blocks = max_num_blocks
        self._block_size = block_size
        self._capacity = num_blocks
        self._hash_fn = _hash_fn
        self._on_block_event = on_block_event

        rec = np.zeros(max_num_blocks, dtype=BLOCK_DTYPE)
        tok = np.zeros((max_num_blocks, block_size), dtype=np.uint32)
        # At most one entry per block, so 2 * max_num_blocks slots keep the load <= 1/2.
        table_size = 8
        self.slot_shift = 61
        while table_size < 2 * max_num_blocks:
            table_size *= 2
            self.slot_shift -= 1
        slots = np.zeros(table_size, dtype=PREFIX_SLOT_DTYPE)
        mult = np.zeros(max_num_blocks, dtype=np.int32)
        self._records = rec
        self._token_ids = tok
        self._slots = slots
        self._multiplicity = mult
        self.blocks = <pkv_block_record*>cnp.PyArray_DATA(rec)
        self.tokens = <uint32_t*>cnp.PyArray_DATA(tok)
        self.slots = <pkv_prefix_slot*>cnp.PyArray_DATA(slots)
        self.multiplicity = <int32_t*>cnp.PyArray_DATA(mult)
        self.slot_mask = <uint64_t>(table_size - 1)
        for i in range(table_size):
            self.slots[i].block = _NO
        for i in range(max_num_blocks):
            self.blocks[i].lru_prev = _NO
            self.blocks[i].lru_next = _NO
            self.blocks[i].free_prev = _NO
            self.blocks[i].free_next = _NO
        self.free_head = self.free_tail = _NO
        self.lru_head = self.lru_tail = _NO
        self.n_free = self.n_allocated = self.n_cached = self.n_evictable = 0
        self._null_block = _NO
        if reserve_null_block:
            self._null_block = 0
            self.blocks[0].flags = PKV_BLOCK_NULL
        for i in range(num_blocks):
            if i != self._null_block:
                self.fq_push_back(<int32_t>i)
        self.ev_stored = []
        self.ev_removed = []
        self.ensure_scratch(0)

    # --- intrusive lists ---------------------------------------------------------------

    cdef void fq_push_back(self, int32_t b) noexcept nogil:
        cdef pkv_block_record* r = &self.blocks[b]
        r.free_prev = self.free_tail
        r.free_next = _NO
        r.flags |= PKV_BLOCK_FREE
        if self.free_tail == _NO:
            self.free_head = b
        else:
            self.blocks[self.free_tail].free_next = b
        self.free_tail = b
        self.n_free += 1

    cdef int32_t fq_pop_front(self) noexcept nogil:
        cdef int32_t b = self.free_head
        cdef pkv_block_record* r = &self.blocks[b]
        self.free_head = r.free_next
        if self.free_head == _NO:
            self.free_tail = _NO
        else:
            self.blocks[self.free_head].free_prev = _NO
        r.free_next = _NO
        r.flags &= ~PKV_BLOCK_FREE
        self.n_free -= 1
        return b

    cdef void lru_append(self, int32_t b) noexcept nogil:
        cdef pkv_block_record* r = &self.blocks[b]
        r.lru_prev = self.lru_tail
        r.lru_next = _NO
        if self.lru_tail == _NO:
            self.lru_head = b
        else:
            self.blocks[self.lru_tail].lru_next = b
        self.lru_tail = b

    cdef void lru_unlink(self, int32_t b) noexcept nogil:
        cdef pkv_block_record* r = &self.blocks[b]
        if r.lru_prev == _NO:
            self.lru_head = r.lru_next
        else:
            self.blocks[r.lru_prev].lru_next = r.lru_next
        if r.lru_next == _NO:
            self.lru_tail = r.lru_prev
        else:
            self.blocks[r.lru_next].lru_prev = r.lru_prev
        r.lru_prev = _NO
        r.lru_next = _NO

    cdef void lru_touch(self, int32_t b) noexcept nogil:
        if self.lru_tail != b:
            self.lru_unlink(b)
            self.lru_append(b)

    # --- prefix table ------------------------------------------------------------------

    cdef Py_ssize_t pt_find(self, uint64_t key) noexcept nogil:
        cdef uint64_t i = (key * _FIB) >> self.slot_shift
        while self.slots[i].block != _NO:
            if self.slots[i].key == key:
                return <Py_ssize_t>i
            i = (i + 1) & self.slot_mask
        return -1

    cdef void pt_insert(self, uint64_t key, int32_t b) noexcept nogil:
        cdef uint64_t i = (key * _FIB) >> self.slot_shift
        while self.slots[i].block != _NO:
            i = (i + 1) & self.slot_mask
        self.slots[i].key = key
        self.slots[i].block = b

    cdef void pt_delete(self, Py_ssize_t slot) noexcept nogil:
        # Backward-shift deletion: pull each later entry of the probe run into the hole
        # when its home slot does not lie cyclically in (hole, entry].
        cdef uint64_t hole = <uint64_t>slot, j = <uint64_t>slot, home
        while True:
            j = (j + 1) & self.slot_mask
            if self.slots[j].block == _NO:
                break
            home = (self.slots[j].key * _FIB) >> self.slot_shift
            if ((j - home) & self.slot_mask) >= ((j - hole) & self.slot_mask):
                self.slots[hole] = self.slots[j]
                hole = j
        self.slots[hole].block = _NO
        self.slots[hole].key = 0

    # --- refcount / entry transitions -----------------------------------------------------

    cdef void incref_block(self, int32_t b) noexcept nogil:
        cdef pkv_block_record* r = &self.blocks[b]
        if (r.flags & PKV_BLOCK_CACHED) and r.refcount == 1:
            self.n_evictable -= 1
        r.refcount += 1

    cdef void decref_block(self, int32_t b) noexcept nogil:
        cdef pkv_block_record* r = &self.blocks[b]
        r.refcount -= 1
        if r.flags & PKV_BLOCK_CACHED:
            if r.refcount == 1:
                self.n_evictable += 1
        elif r.refcount == 0:
            self.n_allocated -= 1
            self.fq_push_back(b)

    cdef void entry_detach(self, int32_t b) noexcept nogil:
        """Drop b's prefix entry but keep the cache's reference on b (the caller moves it)."""
        cdef pkv_block_record* r = &self.blocks[b]
        self.pt_delete(self.pt_find(r.hot_hash))
        self.lru_unlink(b)
        if r.refcount == 1:
            self.n_evictable -= 1
        r.flags &= ~PKV_BLOCK_CACHED
        r.token_count = 0
        self.n_cached -= 1

    cdef void entry_attach(self, int32_t b, uint64_t key) noexcept nogil:
        """Install b under key at the MRU end; b already carries the cache's reference."""
        cdef pkv_block_record* r = &self.blocks[b]
        r.hot_hash = key
        r.flags |= PKV_BLOCK_CACHED
        r.token_count = <int32_t>self._block_size
        self.pt_insert(key, b)
        self.lru_append(b)
        self.n_cached += 1
        if r.refcount == 1:
            self.n_evictable += 1

    cdef void entry_remove(self, int32_t b) noexcept nogil:
        self.entry_detach(b)
        self.decref_block(b)

    cdef int32_t allocate_one(self, int32_t* cursor, uint64_t* evicted,
                              Py_ssize_t* n_evicted) noexcept nogil:
        """Free-queue front, else the LRU-oldest cache-only block (handed out directly with
        refcount 1). ``cursor`` resumes the eviction scan inside one batch: blocks it
        skipped are held by requests and stay so until the batch ends."""
        cdef int32_t b
        if self.n_free > 0:
            b = self.fq_pop_front()
            self.blocks[b].refcount = 1
            self.n_allocated += 1
            return b
        if self.n_evictable == 0:
            return _NO
        b = cursor[0] if cursor[0] != _NO else self.lru_head
        while self.blocks[b].refcount != 1:
            b = self.blocks[b].lru_next
        cursor[0] = self.blocks[b].lru_next
        if evicted != NULL:
            evicted[n_evicted[0]] = self.blocks[b].hot_hash
        n_evicted[0] += 1
        self.entry_detach(b)
        self.st_pressure_evictions += 1
        return b

    cdef int evict_to_capacity(self, Py_ssize_t limit) except -1:
        """Capacity eviction: drop LRU-front entries (any refcount) until <= limit remain."""
        cdef int32_t b
        while self.n_cached > limit:
            b = self.lru_head
            if self._on_block_event is not None:
                self.ev_removed.append(self.blocks[b].hot_hash)
            self.entry_remove(b)
            self.st_capacity_evictions += 1
        return 0

    cdef int insert_entry(self, int32_t b, uint64_t key) except -1:
        """register_prefix steps (2)-(3) for a hash known to be absent; b is allocated."""
        cdef pkv_block_record* r = &self.blocks[b]
        cdef bint moved = (r.flags & PKV_BLOCK_CACHED) != 0
        if moved:
            # Alias move: the cache's reference passes to the new entry (net refcount 0).
            if self._on_block_event is not None:
                self.ev_removed.append(r.hot_hash)
            self.entry_detach(b)
        self.evict_to_capacity(self._capacity - 1)
        if not moved:
            self.incref_block(b)
        self.entry_attach(b, key)
        if self._on_block_event is not None:
            self.ev_stored.append(key)
        return 0

    # --- identity ------------------------------------------------------------------------

    cdef bint identity_matches(self, int32_t b, const uint32_t* tokens, uint64_t parent,
                               uint64_t salt, int64_t index, const uint8_t* digest,
                               uint32_t digest_len) noexcept nogil:
        cdef pkv_block_record* r = &self.blocks[b]
        return (r.parent_hash == parent and r.cache_salt == salt and r.block_index == index
                and r.extra_keys_digest_len == digest_len
                and (digest_len == 0 or memcmp(r.extra_keys_digest, digest, digest_len) == 0)
                and memcmp(self.tokens + <Py_ssize_t>b * self._block_size, tokens,
                           4 * self._block_size) == 0)

    cdef void record_identity(self, int32_t b, const uint32_t* tokens, uint64_t parent,
                              uint64_t salt, int64_t index, const uint8_t* digest,
                              uint32_t digest_len) noexcept nogil:
        cdef pkv_block_record* r = &self.blocks[b]
        r.parent_hash = parent
        r.cache_salt = salt
        r.block_index = index
        r.extra_keys_digest_len = digest_len
        memset(r.extra_keys_digest, 0, PKV_EXTRA_KEYS_DIGEST_BYTES)
        if digest_len:
            memcpy(r.extra_keys_digest, digest, digest_len)
        memcpy(self.tokens + <Py_ssize_t>b * self._block_size, tokens, 4 * self._block_size)

    cdef int check_identity(self, object identity, IdentityView* out, list keep) except -1:
        try:
            toks = identity.tokens
            parent = identity.parent_hash
            digest = identity.extra_keys_digest
            salt = identity.cache_salt
            index = identity.block_index
        except AttributeError:
            raise InvalidArgumentType(
                f"identity must be a pagedkv.identity.BlockIdentity, got "
                f"{type(identity).__name__}") from None
        cdef cnp.ndarray arr = as_token_array(toks, "identity.tokens")
        if arr.shape[0] != self._block_size:
            raise InvalidArgument(
                f"identity.tokens has {arr.shape[0]} tokens; a block holds exactly "
                f"block_size = {self._block_size}")
        if not isinstance(digest, (bytes, bytearray)) or len(digest) not in (
                0, PKV_EXTRA_KEYS_DIGEST_BYTES):
            raise InvalidArgument(
                "identity.extra_keys_digest must be b'' or the 16-byte digest of "
                f"pagedkv.identity.extra_keys_digest, got {digest!r}")
        if not is_int(index):
            raise InvalidArgumentType(
                f"identity.block_index must be an int, got {type(index).__name__}")
        if not 0 <= index < (1 << 63):
            raise InvalidArgument(f"identity.block_index = {index} is outside [0, 2**63)")
        out.parent_hash = as_u64(parent, "identity.parent_hash")
        out.cache_salt = as_domain_id(salt, "identity.cache_salt")
        out.block_index = index
        out.digest_len = len(digest)
        memset(out.digest, 0, 16)
        cdef bytes raw = bytes(digest)
        if out.digest_len:
            memcpy(out.digest, <const char*>raw, out.digest_len)
        keep.append(arr)
        out.tokens = <const uint32_t*>cnp.PyArray_DATA(arr)
        return 0

    # --- hashing -------------------------------------------------------------------------

    cdef int ensure_scratch(self, Py_ssize_t key_count) except -1:
        cdef size_t need = hot_buffer_bytes(self._block_size, key_count)
        cdef uint8_t* p
        if need > self.scratch_bytes:
            p = <uint8_t*>malloc(need)
            if p == NULL:
                raise MemoryError("BlockAllocator hash scratch buffer")
            if self.scratch != NULL:
                free(self.scratch)
            self.scratch = p
            self.scratch_bytes = need
        return 0

    cdef uint64_t block_hash(self, uint64_t parent, const uint32_t* toks, ChainKeys keys,
                             Py_ssize_t index, uint64_t salt, int64_t block_index) except 0:
        """Hot hash of chain block ``block_index``, whose keys are ``keys`` entry ``index``
        (the two differ only for a chain segment that does not start at block 0)."""
        cdef Py_ssize_t nk = keys.key_count(index)
        cdef uint64_t h
        if self._hash_fn is None:
            return hash_block(parent, toks, self._block_size, keys.keys_of(index), nk, salt,
                              block_index, self._seed, self.scratch)
        row = np.empty(self._block_size, dtype=np.uint32)
        memcpy(cnp.PyArray_DATA(row), toks, 4 * self._block_size)
        res = self._hash_fn(parent, row, keys.tuple_of(index), salt, block_index, self._seed)
        h = <uint64_t>(int(res) & 0xFFFFFFFFFFFFFFFF)
        return h if h != 0 else 1

    cdef Py_ssize_t walk_verified(self, const uint32_t* t, Py_ssize_t n, ChainKeys keys,
                                  uint64_t salt, bint native, int32_t* out) except -1 nogil:
        """Length of the longest verified cached prefix of the n-block chain of ``t``; its
        blocks go to ``out``. A present hash with another identity ends the walk and counts
        as a collision. Works in groups of _WALK_GROUP blocks: hash the group, prefetch its
        prefix slots, resolve them and prefetch the blocks' records and token rows, then
        verify, so the random memory accesses of a group overlap instead of queueing.
        ``native``: hash through libxxhash without the GIL; otherwise each hash takes the
        GIL (the ``_hash_fn`` hook or the xxhash wheel)."""
        cdef Py_ssize_t bs = self._block_size, base = 0, m, j, found, slot, i
        cdef uint64_t parent = 0, verified_parent = 0
        cdef uint64_t hashes[_WALK_GROUP]
        cdef int32_t blocks[_WALK_GROUP]
        while base < n:
            m = min(<Py_ssize_t>_WALK_GROUP, n - base)
            for j in range(m):
                i = base + j
                if native:
                    parent = hash_block_native(parent, t + i * bs, bs, keys.keys_of(i),
                                               keys.key_count(i), salt, i, self._seed,
                                               self.scratch)
                else:
                    with gil:
                        parent = self.block_hash(parent, t + i * bs, keys, i, salt, i)
                hashes[j] = parent
                pkv_prefetch(&self.slots[(parent * _FIB) >> self.slot_shift])
            found = m
            for j in range(m):
                slot = self.pt_find(hashes[j])
                if slot < 0:
                    found = j
                    break
                blocks[j] = self.slots[slot].block
                pkv_prefetch(&self.blocks[blocks[j]])
                pkv_prefetch(self.tokens + <Py_ssize_t>blocks[j] * bs)
            for j in range(found):
                i = base + j
                if not self.identity_matches(blocks[j], t + i * bs, verified_parent, salt, i,
                                             keys.digest_of(i), keys.digest_len(i)):
                    self.st_collisions_rejected += 1
                    return i
                out[i] = blocks[j]
                verified_parent = hashes[j]
            if found < m:
                return base + found
            base += m
        return n

    cdef int32_t check_block_id(self, object block_id, str name) except -1:
        cdef int overflow = 0
        cdef long long v
        if type(block_id) is int:                 # the common case, without isinstance
            v = PyLong_AsLongLongAndOverflow(block_id, &overflow)
            if overflow == 0 and 0 <= v < self._num_blocks:
                return <int32_t>v
        if not is_int(block_id):
            raise InvalidArgumentType(
                f"{name} must be an int block id, got {type(block_id).__name__}")
        if not 0 <= block_id < self._num_blocks:
            raise InvalidArgument(
                f"{name} = {block_id} is outside [0, num_blocks={self._num_blocks})")
        return <int32_t>block_id

    cdef object flush_events(self):
        hook = self._on_block_event
        if hook is None:
            return None
        # The net change of the operation, so that applying "removed" then "stored"
        # reproduces the table: one operation may store a hash and evict it again (a chain
        # longer than the capacity), which in that order would leave it in a mirror.
        removed = [h for h in dict.fromkeys(self.ev_removed) if self.pt_find(h) < 0]
        stored = [h for h in dict.fromkeys(self.ev_stored) if self.pt_find(h) >= 0]
        self.ev_removed.clear()
        self.ev_stored.clear()
        for kind, hashes in (("removed", removed), ("stored", stored)):
            if hashes:
                arr = np.array(hashes, dtype=np.uint64)
                try:
                    hook(kind, arr)
                except Exception:
                    _log.exception("on_block_event hook raised on %r; the operation stands",
                                   kind)
        return None

    cdef _emit_cleared(self):
        hook = self._on_block_event
        if hook is not None:
            try:
                hook("cleared", np.zeros(0, dtype=np.uint64))
            except Exception:
                _log.exception("on_block_event hook raised on 'cleared'; the operation stands")

    # --- properties ----------------------------------------------------------------------

    @property
    def num_blocks(self):
        """Block ids in use by the pool now, ``[0, num_blocks)``."""
        return self._num_blocks

    @property
    def max_num_blocks(self):
        """Upper bound for ``grow_by``; the arrays are sized for it."""
        return self._max_num_blocks

    @property
    def block_size(self):
        """Tokens per block."""
        return self._block_size

    @property
    def num_free_blocks(self):
        """Blocks in the free queue (O(1))."""
        return self.n_free

    @property
    def num_allocated_blocks(self):
        """Blocks with refcount >= 1, cache-only ones included (O(1))."""
        return self.n_allocated

    @property
    def num_evictable_blocks(self):
        """Cache-only blocks: refcount 1 and a prefix entry (O(1))."""
        return self.n_evictable

    @property
    def free_or_evictable_blocks(self):
        """``num_free_blocks + num_evictable_blocks``: what allocation can hand out now."""
        return self.n_free + self.n_evictable

    @property
    def prefix_cache_len(self):
        """Prefix-table entries."""
        return self.n_cached

    @property
    def prefix_cache_capacity(self):
        """Most prefix entries kept (``num_blocks`` unless overridden)."""
        return self._capacity

    @property
    def null_block_id(self):
        """0 with ``reserve_null_block=True``, else None."""
        return None if self._null_block == _NO else self._null_block

    @property
    def hash_seed(self):
        """The XXH3 seed of this allocator's hot hashes (u64)."""
        return self._seed

    @property
    def on_block_event(self):
        """``hook(kind, hashes: uint64[k])`` after each operation that changed the table."""
        return self._on_block_event

    @on_block_event.setter
    def on_block_event(self, hook):
        if hook is not None and not callable(hook):
            raise InvalidArgumentType("on_block_event must be callable or None")
        self._on_block_event = hook

    @property
    def block_records(self):
        """Read-only ``BLOCK_DTYPE[max_num_blocks]`` view of the block metadata."""
        v = self._records.view()
        v.flags.writeable = False
        return v

    @property
    def token_ids(self):
        """Read-only ``uint32[max_num_blocks, block_size]`` view of the token identities."""
        v = self._token_ids.view()
        v.flags.writeable = False
        return v

    @property
    def prefix_slots(self):
        """Read-only ``PREFIX_SLOT_DTYPE[table_size]`` view of the prefix table."""
        v = self._slots.view()
        v.flags.writeable = False
        return v

    def __repr__(self):
        null = "" if self._null_block == _NO else ", null_block_id=0"
        return (f"BlockAllocator(num_blocks={self._num_blocks}, max_num_blocks="
                f"{self._max_num_blocks}, block_size={self._block_size}{null}; "
                f"free={self.n_free}, allocated={self.n_allocated}, cached={self.n_cached}, "
                f"evictable={self.n_evictable}, capacity={self._capacity}, "
                f"xxh3={'_hash_fn' if self._hash_fn is not None else XXH3_SOURCE})")

    # --- allocation ----------------------------------------------------------------------

    def can_allocate(self, n):
        """Whether ``n`` blocks can be handed out now (free + cache-only)."""
        if is_int(n) and n > 0x7FFFFFFF:
            return False                    # more than any pool can hold
        cdef Py_ssize_t k = _count_arg(n, "n")
        return self.n_free >= k or self.n_free + self.n_evictable >= k

    def allocate(self):
        """One block id with refcount 1, or None (then nothing changed)."""
        cdef int32_t cursor = _NO
        cdef uint64_t evicted = 0
        cdef Py_ssize_t n_evicted = 0
        cdef int32_t b = self.allocate_one(&cursor, &evicted, &n_evicted)
        if b == _NO:
            return None
        if n_evicted and self._on_block_event is not None:
            self.ev_removed.append(evicted)
            self.flush_events()
        return b

    def allocate_many(self, n):
        """``int32[n]`` ids (what n ``allocate()`` calls would return), or None with
        nothing changed."""
        cdef Py_ssize_t k = _count_arg(n, "n"), i
        cdef int32_t cursor = _NO
        cdef cnp.ndarray out
        cdef int32_t* o
        if self.n_free + self.n_evictable < k:
            return None
        cdef Py_ssize_t n_evicted = 0
        cdef cnp.ndarray evicted = np.empty(k if self._on_block_event is not None else 0,
                                            dtype=np.uint64)
        cdef uint64_t* ev = NULL
        if self._on_block_event is not None:
            ev = <uint64_t*>cnp.PyArray_DATA(evicted)
        out = np.empty(k, dtype=np.int32)
        o = <int32_t*>cnp.PyArray_DATA(out)
        with nogil:
            for i in range(k):
                o[i] = self.allocate_one(&cursor, ev, &n_evicted)
        if n_evicted and ev != NULL:
            self.ev_removed.extend(evicted[:n_evicted].tolist())
            self.flush_events()
        return out

    def incref(self, block_id):
        """Add a reference to an allocated block."""
        cdef int32_t b = self.check_block_id(block_id, "block_id")
        if self.blocks[b].refcount < 1:
            raise InvariantViolation(
                f"incref(block_id={b}): the block is not allocated; allocate it first")
        self.incref_block(b)

    def free(self, block_id):
        """Drop one reference; at 0 the id joins the back of the free queue."""
        cdef int32_t b = self.check_block_id(block_id, "block_id")
        cdef pkv_block_record* r = &self.blocks[b]
        cdef int32_t held = r.refcount - (1 if r.flags & PKV_BLOCK_CACHED else 0)
        if held < 1:
            raise InvariantViolation(self._not_held(b))
        self.decref_block(b)

    def _not_held(self, int32_t b):
        r = self.blocks[b]
        if r.flags & PKV_BLOCK_NULL:
            return f"free(block_id={b}): the null block is never allocated or freed"
        if r.flags & PKV_BLOCK_CACHED:
            return (f"free(block_id={b}): double free; the block is cache-only (refcount 1 "
                    f"is the prefix cache's own reference)")
        return f"free(block_id={b}): double free or never allocated (the block is free)"

    cdef cnp.ndarray checked_ids(self, cnp.ndarray arr):
        """An ``_id_array`` result as int32, every id in ``[0, num_blocks)`` (else
        InvalidArgument naming the first one out of range)."""
        cdef const int64_t* p = <const int64_t*>cnp.PyArray_DATA(arr)
        cdef Py_ssize_t n = arr.shape[0], i
        for i in range(n):
            if not 0 <= p[i] < self._num_blocks:
                raise InvalidArgument(
                    f"block_ids[{i}] = {p[i]} is outside [0, num_blocks={self._num_blocks})")
        return arr.astype(np.int32)

    def free_many(self, block_ids):
        """Free each id in order; validated as a whole first (nothing changes on error)."""
        cdef cnp.ndarray ids = self.checked_ids(_id_array(block_ids, "block_ids"))
        self.release_ids(<const int32_t*>cnp.PyArray_DATA(ids), ids.shape[0])

    cdef int release_ids(self, const int32_t* p, Py_ssize_t n) except -1:
        """free_many on in-range ids: every id must be held by the caller as often as it
        appears (else InvariantViolation, nothing freed); then decref each, in order."""
        cdef Py_ssize_t i, bad = -1
        cdef int32_t b
        cdef pkv_block_record* r
        with nogil:
            for i in range(n):
                b = p[i]
                r = &self.blocks[b]
                self.multiplicity[b] += 1
                if self.multiplicity[b] > r.refcount - (1 if r.flags & PKV_BLOCK_CACHED else 0):
                    bad = i
                    break
            for i in range(n):
                self.multiplicity[p[i]] = 0
        if bad >= 0:
            raise InvariantViolation(
                f"free_many: block_ids[{bad}] = {p[bad]} is freed more often than it is held "
                f"(refcount {self.blocks[p[bad]].refcount}"
                + (", one of them the prefix cache's" if self.blocks[p[bad]].flags
                   & PKV_BLOCK_CACHED else "") + "); nothing was freed")
        with nogil:
            for i in range(n):
                self.decref_block(p[i])
        return 0

    def ref_count(self, block_id):
        """References held on ``block_id`` (0 when free); InvalidArgument when out of range."""
        cdef int32_t b = self.check_block_id(block_id, "block_id")
        return self.blocks[b].refcount

    # --- prefix cache --------------------------------------------------------------------

    def chain_hashes(self, tokens, *, extra_keys=(), extra_keys_per_block=None, cache_salt=0,
                     parent_hash=0, first_block=0):
        """pagedkv.hashing.chain_hashes with this allocator's seed, block size and hook.

        ``first_block`` > 0 hashes a chain *segment*: ``tokens`` starts at chain block
        ``first_block`` and ``parent_hash`` is the hash of block ``first_block - 1``; the
        result equals the matching slice of the whole chain's hashes (per-block keys are
        segment-relative)."""
        cdef cnp.ndarray tok = as_token_array(tokens)
        cdef uint64_t salt = as_domain_id(cache_salt)
        cdef ChainKeys keys = make_chain_keys(extra_keys, extra_keys_per_block)
        cdef uint64_t parent
        cdef int64_t first
        parent, first = _segment_args(parent_hash, first_block)
        cdef Py_ssize_t n = keys.blocks_for(tok.shape[0] // self._block_size)
        cdef cnp.ndarray out = np.empty(n, dtype=np.uint64)
        cdef uint64_t* o = <uint64_t*>cnp.PyArray_DATA(out)
        self.hash_chain(<const uint32_t*>cnp.PyArray_DATA(tok), n, keys, salt, parent, first, o)
        return out

    cdef int hash_chain(self, const uint32_t* t, Py_ssize_t n, ChainKeys keys, uint64_t salt,
                        uint64_t parent, int64_t first_block, uint64_t* out) except -1:
        """Chain hashes of n full blocks of ``t`` (chain blocks ``first_block ..``, the first
        chaining from ``parent``) into ``out``, through the hook when one is set."""
        cdef Py_ssize_t i
        if self._hash_fn is None and xxh3_native():
            # The allocator's own scratch: no allocation per call (short segments are hashed
            # once per decode step by sliding groups).
            self.ensure_scratch(self.most_keys(keys, n))
            with nogil:
                for i in range(n):
                    parent = hash_block_native(parent, t + i * self._block_size,
                                               self._block_size, keys.keys_of(i),
                                               keys.key_count(i), salt, first_block + i,
                                               self._seed, self.scratch)
                    out[i] = parent
            return 0
        if self._hash_fn is None:
            return chain_segment_into(t, n, self._block_size, keys, salt, self._seed, parent,
                                      first_block, out)
        self.ensure_scratch(self.most_keys(keys, n))
        for i in range(n):
            parent = self.block_hash(parent, t + i * self._block_size, keys, i, salt,
                                     first_block + i)
            out[i] = parent
        return 0

    cdef Py_ssize_t most_keys(self, ChainKeys keys, Py_ssize_t n) noexcept:
        """The most extra keys any of the first n blocks has (sizes the hash scratch)."""
        cdef Py_ssize_t i, m = 0
        for i in range(n):
            if keys.key_count(i) > m:
                m = keys.key_count(i)
        return m

    def register_prefix(self, block_id, block_hash, identity):
        """Low-level insert of an allocated block under a caller-computed hash
        (docs/contracts/paged-kv.md, '4.4 Operations')."""
        cdef int32_t b = self.check_block_id(block_id, "block_id")
        cdef uint64_t key = _block_hash_arg(block_hash, "block_hash")
        cdef IdentityView idv
        keep = []
        self.check_identity(identity, &idv, keep)
        if self.blocks[b].refcount < 1:
            raise InvariantViolation(
                f"register_prefix(block_id={b}): the block is not allocated")
        if self._capacity == 0:
            return False
        cdef Py_ssize_t slot = self.pt_find(key)
        if slot >= 0:
            if self.slots[slot].block != b:
                return False
            self.lru_touch(b)
            return True
        self.record_identity(b, idv.tokens, idv.parent_hash, idv.cache_salt, idv.block_index,
                             idv.digest, idv.digest_len)
        self.insert_entry(b, key)
        self.flush_events()
        return True

    def lookup_prefix(self, block_hash, identity):
        """Verified hit: touch, incref and return the id; else None with nothing changed."""
        cdef uint64_t key = _block_hash_arg(block_hash, "block_hash")
        cdef IdentityView idv
        keep = []
        self.check_identity(identity, &idv, keep)
        cdef Py_ssize_t slot = self.pt_find(key)
        if slot < 0:
            return None
        cdef int32_t b = self.slots[slot].block
        if not self.identity_matches(b, idv.tokens, idv.parent_hash, idv.cache_salt,
                                     idv.block_index, idv.digest, idv.digest_len):
            self.st_collisions_rejected += 1
            return None
        self.lru_touch(b)
        self.incref_block(b)
        return b

    def find_longest_cache_hit(self, tokens, *, extra_keys=(), extra_keys_per_block=None,
                               cache_salt=0):
        """``(int32[k] block ids, k * block_size tokens)`` of the longest verified cached
        prefix. Every returned block is incref'd; the chain is touched deepest first."""
        cdef cnp.ndarray tok = as_token_array(tokens)
        cdef uint64_t salt = as_domain_id(cache_salt)
        cdef ChainKeys keys = make_chain_keys(extra_keys, extra_keys_per_block)
        cdef Py_ssize_t bs = self._block_size
        cdef Py_ssize_t n = keys.blocks_for(tok.shape[0] // bs), i, k = 0
        cdef const uint32_t* t = <const uint32_t*>cnp.PyArray_DATA(tok)
        cdef cnp.ndarray out = np.empty(n, dtype=np.int32)
        cdef int32_t* o = <int32_t*>cnp.PyArray_DATA(out)
        cdef Py_ssize_t n_tokens = tok.shape[0]
        cdef bint native
        if n == 0 or self.n_cached == 0:
            self.st_query_tokens += <uint64_t>n_tokens
            return out[:0], 0
        self.ensure_scratch(self.most_keys(keys, n))
        native = self._hash_fn is None and xxh3_native()
        with nogil:
            k = self.walk_verified(t, n, keys, salt, native, o)
            self.st_query_tokens += <uint64_t>n_tokens
            for i in range(k):
                self.incref_block(o[i])
            i = k - 1
            while i >= 0:
                self.lru_touch(o[i])
                i -= 1
        self.st_hit_tokens += <uint64_t>(k * bs)
        return out[:k], k * bs

    def cached_block_ids(self, tokens, *, extra_keys=(), extra_keys_per_block=None,
                         cache_salt=0, parent_hash=0, first_block=0):
        """``int32[k]``: for each full block ``i`` of ``tokens``, the id of the cached block
        that verifies as chain block ``i`` (identity compared in full, as in a hit), or -1.

        A pure probe: no reference, LRU position or counter changes, and a hole does not
        end the scan (sliding-window groups need every block of a window, not a prefix).
        ``parent_hash`` / ``first_block`` probe a chain segment as :meth:`chain_hashes`."""
        cdef cnp.ndarray tok = as_token_array(tokens)
        cdef uint64_t salt = as_domain_id(cache_salt)
        cdef ChainKeys keys = make_chain_keys(extra_keys, extra_keys_per_block)
        cdef uint64_t parent
        cdef int64_t first
        parent, first = _segment_args(parent_hash, first_block)
        cdef Py_ssize_t bs = self._block_size
        cdef Py_ssize_t n = keys.blocks_for(tok.shape[0] // bs), i, slot
        cdef const uint32_t* t = <const uint32_t*>cnp.PyArray_DATA(tok)
        cdef cnp.ndarray out = np.full(n, _NO, dtype=np.int32)
        cdef int32_t* o = <int32_t*>cnp.PyArray_DATA(out)
        cdef cnp.ndarray chain
        cdef uint64_t* ck
        cdef int32_t b
        if n == 0 or self.n_cached == 0:
            return out
        chain = np.empty(n, dtype=np.uint64)
        ck = <uint64_t*>cnp.PyArray_DATA(chain)
        self.hash_chain(t, n, keys, salt, parent, first, ck)
        with nogil:
            for i in range(n):
                slot = self.pt_find(ck[i])
                if slot >= 0:
                    b = self.slots[slot].block
                    if self.identity_matches(b, t + i * bs, parent, salt, first + i,
                                             keys.digest_of(i), keys.digest_len(i)):
                        o[i] = b
                parent = ck[i]
        return out

    def incref_many(self, block_ids):
        """Add one reference to each id (repeats add several); validated as a whole first:
        an id out of range (InvalidArgument) or not allocated (InvariantViolation, the null
        block included) changes nothing. LRU positions are not touched."""
        cdef cnp.ndarray ids = self.checked_ids(_id_array(block_ids, "block_ids"))
        cdef const int32_t* p = <const int32_t*>cnp.PyArray_DATA(ids)
        cdef Py_ssize_t n = ids.shape[0], i
        for i in range(n):
            if self.blocks[p[i]].refcount < 1:
                raise InvariantViolation(
                    f"incref_many: block_ids[{i}] = {p[i]} is not allocated; nothing was "
                    "incref'd")
        with nogil:
            for i in range(n):
                self.incref_block(p[i])

    def cache_full_blocks(self, tokens, block_ids, *, extra_keys=(), extra_keys_per_block=None,
                          cache_salt=0, parent_hash=0, first_block=0):
        """Register ``block_ids[i]`` as chain block ``i`` of ``tokens``; returns the number
        of new entries. A replayed identical block is skipped, a collision stops the chain.

        ``first_block`` > 0 registers a chain *segment* (as :meth:`chain_hashes`): ``tokens``
        and ``block_ids`` start at chain block ``first_block``, which chains from
        ``parent_hash``. Sliding-window groups publish the blocks they still hold this way."""
        cdef cnp.ndarray tok = as_token_array(tokens)
        cdef cnp.ndarray ids = _id_array(block_ids, "block_ids")
        cdef uint64_t salt = as_domain_id(cache_salt)
        cdef ChainKeys keys = make_chain_keys(extra_keys, extra_keys_per_block)
        cdef Py_ssize_t bs = self._block_size
        cdef Py_ssize_t n = ids.shape[0], i, added
        cdef const int32_t* p
        cdef const uint32_t* t = <const uint32_t*>cnp.PyArray_DATA(tok)
        cdef uint64_t parent
        cdef int64_t first
        parent, first = _segment_args(parent_hash, first_block)
        if n * bs > tok.shape[0]:
            raise InvalidArgument(
                f"cache_full_blocks: {n} block_ids need {n * bs} tokens at block_size {bs}, "
                f"but tokens has {tok.shape[0]}; register only the full blocks: "
                f"block_ids[:len(tokens) // block_size]")
        if keys.per_block and keys.max_blocks < n:
            raise InvalidArgument(
                f"cache_full_blocks: extra_keys_per_block has {keys.max_blocks} entries for "
                f"{n} block_ids; give one key tuple per block")
        ids = self.checked_ids(ids)
        p = <const int32_t*>cnp.PyArray_DATA(ids)
        for i in range(n):
            if self.blocks[p[i]].refcount < 1:
                raise InvariantViolation(
                    f"cache_full_blocks: block_ids[{i}] = {p[i]} is not allocated")
        if n == 0 or self._capacity == 0:
            return 0
        cdef cnp.ndarray chain = np.empty(n, dtype=np.uint64)
        added = self.register_chain(t, p, n, keys, salt, parent, first,
                                    <uint64_t*>cnp.PyArray_DATA(chain))
        self.flush_events()
        return added

    cdef Py_ssize_t register_chain(self, const uint32_t* t, const int32_t* ids, Py_ssize_t n,
                                   ChainKeys keys, uint64_t salt, uint64_t parent,
                                   int64_t first, uint64_t* chain) except -1:
        """The body of cache_full_blocks on checked arguments (every id allocated, capacity >
        0): hash the n blocks into ``chain`` first (a failing hook leaves no trace), then
        register them; returns new entries. Events are left for the caller to flush."""
        cdef Py_ssize_t bs = self._block_size, i, accepted = 0, added = 0, slot
        cdef uint64_t h
        cdef int32_t b
        cdef const uint8_t* dptr
        cdef uint32_t dlen
        self.hash_chain(t, n, keys, salt, parent, first, chain)
        # Every block of the chain is pinned for the walk: an insert's capacity eviction may
        # take a later block of this chain that only the cache holds; unpinned it would reach
        # refcount 0, join the free queue and then be registered there (free and cached at
        # once, handed to the next allocate while the table maps a hash to it).
        for i in range(n):
            self.incref_block(ids[i])
        try:
            for i in range(n):
                b = ids[i]
                h = chain[i]
                dptr = keys.digest_of(i)
                dlen = keys.digest_len(i)
                slot = self.pt_find(h)
                if slot >= 0:
                    if not self.identity_matches(self.slots[slot].block, t + i * bs, parent,
                                                 salt, first + i, dptr, dlen):
                        self.st_collisions_rejected += 1
                        break                   # nothing past a collision is registered
                    if self.slots[slot].block == b:
                        self.lru_touch(b)       # refresh of the same (block, hash)
                    # else: a replay of an already-cached block, skipped (touched below)
                else:
                    self.record_identity(b, t + i * bs, parent, salt, first + i, dptr, dlen)
                    self.insert_entry(b, h)
                    added += 1
                accepted += 1
                parent = h
            # Deepest first, so block 0 ends most recent and eviction takes tails first. The
            # touch follows the hash: an entry a later step capacity-evicted is skipped.
            i = accepted - 1
            while i >= 0:
                slot = self.pt_find(chain[i])
                if slot >= 0:
                    self.lru_touch(self.slots[slot].block)
                i -= 1
        finally:
            for i in range(n):
                self.decref_block(ids[i])
        return added

    def publish_restored_batch(self, entries):
        """All-or-nothing publish of restored blocks in chain order (docs/contracts/paged-kv.md,
        '4.9 Batch publish of restored blocks')."""
        try:
            it = iter(entries)
        except TypeError:
            raise InvalidArgumentType(f"entries must be an iterable of RestoredBlock, got "
                                      f"{type(entries).__name__}") from None
        cdef list items = list(it)
        cdef Py_ssize_t n = len(items), i
        cdef IdentityView* views
        cdef int32_t b
        keep = []
        ids = []
        keys = []
        if n == 0:
            return True
        views = <IdentityView*>malloc(n * sizeof(IdentityView))
        if views == NULL:
            raise MemoryError("publish_restored_batch")
        try:
            for i in range(n):
                e = items[i]
                try:
                    block_id, block_hash, identity = e.block_id, e.block_hash, e.identity
                except AttributeError:
                    raise InvalidArgumentType(
                        f"entries[{i}] must be a RestoredBlock, got {type(e).__name__}") from None
                self.check_identity(identity, &views[i], keep)
                keys.append(_block_hash_arg(block_hash, f"entries[{i}].block_hash"))
                ids.append(self.check_block_id(block_id, f"entries[{i}].block_id"))
            for i in range(n):
                if self.blocks[<int32_t>ids[i]].refcount < 1:
                    raise InvariantViolation(
                        f"publish_restored_batch: entries[{i}].block_id = {ids[i]} is not "
                        f"allocated; allocate the restore targets first")
            if len(set(ids)) != n or len(set(keys)) != n or n > self._capacity:
                return False
            for i in range(n):
                if self.blocks[<int32_t>ids[i]].flags & PKV_BLOCK_CACHED:
                    return False
                if self.pt_find(<uint64_t>keys[i]) >= 0:
                    return False
            for i in range(n):
                b = <int32_t>ids[i]
                self.record_identity(b, views[i].tokens, views[i].parent_hash,
                                     views[i].cache_salt, views[i].block_index,
                                     views[i].digest, views[i].digest_len)
                self.insert_entry(b, <uint64_t>keys[i])
            i = n - 1
            while i >= 0:
                b = <int32_t>ids[i]
                if (self.blocks[b].flags & PKV_BLOCK_CACHED
                        and self.blocks[b].hot_hash == <uint64_t>keys[i]):
                    self.lru_touch(b)
                i -= 1
        finally:
            free(views)
        self.flush_events()
        return True

    def purge_prefix_cache(self):
        """Drop every prefix entry (blocks reaching 0 refs join the free queue in LRU
        order); returns the number of entries dropped. Never fails."""
        cdef Py_ssize_t dropped = self.n_cached
        cdef int32_t b
        while self.lru_head != _NO:
            b = self.lru_head
            self.entry_remove(b)
        self._emit_cleared()
        return dropped

    def set_prefix_cache_capacity(self, n):
        """Override the entry limit (0 disables caching); evicts down to ``n`` now."""
        cdef Py_ssize_t k = _count_arg(n, "n")
        self._capacity = k
        self.evict_to_capacity(k)
        self.flush_events()

    def grow_by(self, k):
        """Add up to ``k`` ids (capped at max_num_blocks) to the back of the free queue;
        resets the prefix capacity to num_blocks. Returns the number added."""
        cdef Py_ssize_t add = _count_arg(k, "k"), i
        cdef Py_ssize_t old = self._num_blocks
        cdef Py_ssize_t target = min(old + add, self._max_num_blocks)
        for i in range(old, target):
            self.fq_push_back(<int32_t>i)
        self._num_blocks = target
        self._capacity = target
        if target > old:
            self.st_grows += 1
        return target - old

    # --- diagnostics ---------------------------------------------------------------------

    def stats(self):
        """Snapshot of the O(1) counters, keys exactly ``STATS_KEYS``."""
        return {
            "query_tokens": self.st_query_tokens,
            "hit_tokens": self.st_hit_tokens,
            "pressure_evictions": self.st_pressure_evictions,
            "capacity_evictions": self.st_capacity_evictions,
            "collisions_rejected": self.st_collisions_rejected,
            "grows": self.st_grows,
        }

    def lru_hashes(self):
        """Prefix-entry hashes, least recently used first."""
        out = []
        cdef int32_t b = self.lru_head
        while b != _NO:
            out.append(self.blocks[b].hot_hash)
            b = self.blocks[b].lru_next
        return out

    def free_list(self):
        """Free block ids in pop order (front, the next one allocated, first)."""
        out = []
        cdef int32_t b = self.free_head
        while b != _NO:
            out.append(b)
            b = self.blocks[b].free_next
        return out

    def check_invariants(self):
        """Verify docs/contracts/paged-kv.md, '4.3 Invariants' and the physical structures; raise
        InvariantViolation naming the break.

        Not checked: an orphaned block (refcount > 0 that no owner will ever free). Besides
        the prefix cache's one reference, references are anonymous counts: the allocator
        does not know which request, table or transient holder (a cold capture or restore)
        holds them, so it cannot tell a leaked reference from a held one. Whoever keeps the
        owners can (the adapter's group check compares table entries with refcounts)."""
        cdef Py_ssize_t i, count, free_seen = 0, alloc_seen = 0, cached_seen = 0, evict_seen = 0
        cdef int32_t b, prev
        cdef pkv_block_record* r
        cdef uint64_t j, home, size = self.slot_mask + 1
        cdef Py_ssize_t found
        nb = self._num_blocks

        for i in range(self._max_num_blocks):
            r = &self.blocks[i]
            if i >= nb:
                if r.flags or r.refcount:
                    _fail(f"block {i} beyond num_blocks={nb} has flags={r.flags} "
                          f"refcount={r.refcount}")
                continue
            if r.flags & PKV_BLOCK_NULL:
                if i != self._null_block or r.flags != PKV_BLOCK_NULL:
                    _fail(f"block {i} has the null flag with flags={r.flags}")
                continue
            if r.flags & PKV_BLOCK_FREE:
                free_seen += 1
                if r.refcount != 0 or r.flags & PKV_BLOCK_CACHED:
                    _fail(f"free block {i} has refcount {r.refcount}, flags {r.flags} "
                          f"(invariant 1: free xor allocated)")
            else:
                if r.refcount < 1:
                    _fail(f"block {i} is neither free nor allocated (refcount {r.refcount})")
                alloc_seen += 1
            if r.flags & PKV_BLOCK_CACHED:
                cached_seen += 1
                if r.refcount == 1:
                    evict_seen += 1
                if r.token_count != self._block_size:
                    _fail(f"cached block {i} has token_count {r.token_count}")
                found = self.pt_find(r.hot_hash)
                if found < 0 or self.slots[found].block != i:
                    _fail(f"cached block {i} (hash {r.hot_hash:#x}) is not what the prefix "
                          f"table maps its hash to (invariant 4)")
        if free_seen != self.n_free:
            _fail(f"{free_seen} blocks flagged free but num_free_blocks={self.n_free}")
        if alloc_seen != self.n_allocated:
            _fail(f"{alloc_seen} blocks allocated but num_allocated_blocks={self.n_allocated}")
        if cached_seen != self.n_cached:
            _fail(f"{cached_seen} blocks cached but prefix_cache_len={self.n_cached}")
        if evict_seen != self.n_evictable:
            _fail(f"{evict_seen} cache-only blocks but num_evictable_blocks={self.n_evictable}")
        usable = nb - (0 if self._null_block == _NO else 1)
        if self.n_free + self.n_allocated != usable:
            _fail(f"free {self.n_free} + allocated {self.n_allocated} != {usable} (invariant 6)")
        if self.n_cached > self._capacity:
            _fail(f"{self.n_cached} entries exceed capacity {self._capacity} (invariant 5)")
        # free queue
        count = 0
        prev = _NO
        b = self.free_head
        while b != _NO:
            if count > nb or not 0 <= b < nb:
                _fail(f"free queue is corrupt at block {b} (cycle or out of range)")
            r = &self.blocks[b]
            if not (r.flags & PKV_BLOCK_FREE) or r.free_prev != prev:
                _fail(f"free queue link of block {b} is inconsistent")
            prev = b
            b = r.free_next
            count += 1
        if count != self.n_free or prev != self.free_tail:
            _fail(f"free queue holds {count} blocks, num_free_blocks={self.n_free}")
        # LRU
        count = 0
        prev = _NO
        b = self.lru_head
        while b != _NO:
            if count > nb or not 0 <= b < nb:
                _fail(f"LRU list is corrupt at block {b} (cycle or out of range)")
            r = &self.blocks[b]
            if not (r.flags & PKV_BLOCK_CACHED) or r.lru_prev != prev:
                _fail(f"LRU link of block {b} is inconsistent")
            prev = b
            b = r.lru_next
            count += 1
        if count != self.n_cached or prev != self.lru_tail:
            _fail(f"LRU holds {count} entries, prefix_cache_len={self.n_cached}")
        # prefix table: live slots only, each reachable from its home slot without a gap
        count = 0
        for j in range(size):
            if self.slots[j].block == _NO:
                continue
            count += 1
            b = self.slots[j].block
            if not 0 <= b < nb or not (self.blocks[b].flags & PKV_BLOCK_CACHED) or \
                    self.blocks[b].hot_hash != self.slots[j].key:
                _fail(f"prefix slot {j} (hash {self.slots[j].key:#x} -> block {b}) has no "
                      f"matching cached block (invariant 4)")
            home = (self.slots[j].key * _FIB) >> self.slot_shift
            while home != j:
                if self.slots[home].block == _NO:
                    _fail(f"prefix slot {j} is unreachable: empty slot {home} on its probe run")
                home = (home + 1) & self.slot_mask
        if count != self.n_cached:
            _fail(f"prefix table holds {count} entries, prefix_cache_len={self.n_cached}")
        return None
