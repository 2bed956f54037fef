# cython: language_level=3
"""C-level interface of pagedkv.allocator (records.h layouts and the BlockAllocator)."""

cimport cython
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

from pagedkv.hashing cimport ChainKeys


cdef extern from "pagedkv/records.h" nogil:
    enum:
        PKV_NO_BLOCK
        PKV_BLOCK_FREE
        PKV_BLOCK_CACHED
        PKV_BLOCK_NULL
        PKV_EXTRA_KEYS_DIGEST_BYTES

    ctypedef struct pkv_block_record:
        uint64_t hot_hash
        uint64_t parent_hash
        uint64_t cache_salt
        int64_t block_index
        uint8_t extra_keys_digest[16]
        int32_t refcount
        int32_t token_count
        int32_t lru_prev
        int32_t lru_next
        int32_t free_prev
        int32_t free_next
        uint32_t flags
        uint32_t extra_keys_digest_len

    ctypedef struct pkv_prefix_slot:
        uint64_t key
        int32_t block
        int32_t _pad


cdef struct IdentityView:
    # A validated identity argument, borrowed for one call (tokens point into a live array).
    const uint32_t* tokens
    uint64_t parent_hash
    uint64_t cache_salt
    int64_t block_index
    uint8_t digest[16]
    uint32_t digest_len


# final: subclasses cannot override the cdef methods, so calls are direct (no vtable) and
# the C compiler inlines the list and table primitives into the hot loops.
@cython.final
cdef class BlockAllocator:
    cdef object _records          # BLOCK_DTYPE[max_num_blocks]
    cdef object _token_ids        # uint32[max_num_blocks, block_size]
    cdef object _slots            # PREFIX_SLOT_DTYPE[table_size], power of two
    cdef object _multiplicity     # int32[max_num_blocks] free_many scratch, zero between calls
    cdef pkv_block_record* blocks
    cdef uint32_t* tokens
    cdef pkv_prefix_slot* slots
    cdef uint64_t slot_mask
    cdef int slot_shift
    cdef int32_t* multiplicity

    cdef Py_ssize_t _num_blocks
    cdef Py_ssize_t _max_num_blocks
    cdef Py_ssize_t _block_size
    cdef Py_ssize_t _capacity
    cdef int32_t _null_block

    cdef int32_t free_head, free_tail
    cdef int32_t lru_head, lru_tail
    cdef Py_ssize_t n_free, n_allocated, n_cached, n_evictable

    cdef uint64_t _seed
    cdef object _hash_fn
    cdef object _on_block_event

    cdef uint8_t* scratch
    cdef size_t scratch_bytes

    # stats (docs/contracts/paged-kv.md, '4.10 Stats and block events')
    cdef uint64_t st_query_tokens, st_hit_tokens, st_pressure_evictions
    cdef uint64_t st_capacity_evictions, st_collisions_rejected, st_grows

    # events of the operation in progress (only collected while a hook is set)
    cdef list ev_stored
    cdef list ev_removed

    # free queue and LRU: intrusive doubly-linked lists through the block records
    cdef void fq_push_back(self, int32_t b) noexcept nogil
    cdef int32_t fq_pop_front(self) noexcept nogil
    cdef void lru_append(self, int32_t b) noexcept nogil
    cdef void lru_unlink(self, int32_t b) noexcept nogil
    cdef void lru_touch(self, int32_t b) noexcept nogil

    # prefix table: open addressing, linear probing, backward-shift deletion
    cdef Py_ssize_t pt_find(self, uint64_t key) noexcept nogil
    cdef void pt_insert(self, uint64_t key, int32_t b) noexcept nogil
    cdef void pt_delete(self, Py_ssize_t slot) noexcept nogil

    # refcount and entry transitions that keep the O(1) counters exact
    cdef void incref_block(self, int32_t b) noexcept nogil
    cdef void decref_block(self, int32_t b) noexcept nogil
    cdef void entry_detach(self, int32_t b) noexcept nogil
    cdef void entry_attach(self, int32_t b, uint64_t key) noexcept nogil
    cdef void entry_remove(self, int32_t b) noexcept nogil
    cdef int32_t allocate_one(self, int32_t* cursor, uint64_t* evicted,
                              Py_ssize_t* n_evicted) noexcept nogil
    cdef int evict_to_capacity(self, Py_ssize_t limit) except -1

    cdef bint identity_matches(self, int32_t b, const uint32_t* tokens, uint64_t parent,
                               uint64_t salt, int64_t index, const uint8_t* digest,
                               uint32_t digest_len) noexcept nogil
    cdef void record_identity(self, int32_t b, const uint32_t* tokens, uint64_t parent,
                              uint64_t salt, int64_t index, const uint8_t* digest,
                              uint32_t digest_len) noexcept nogil
    cdef int insert_entry(self, int32_t b, uint64_t key) except -1
    cdef Py_ssize_t register_chain(self, const uint32_t* t, const int32_t* ids, Py_ssize_t n,
                                   ChainKeys keys, uint64_t salt, uint64_t parent,
                                   int64_t first, uint64_t* chain) except -1
    cdef int release_ids(self, const int32_t* p, Py_ssize_t n) except -1
    cdef cnp.ndarray checked_ids(self, cnp.ndarray arr)

    cdef uint64_t block_hash(self, uint64_t parent, const uint32_t* toks, ChainKeys keys,
                             Py_ssize_t index, uint64_t salt, int64_t block_index) except 0
    cdef int ensure_scratch(self, Py_ssize_t key_count) except -1
    cdef int hash_chain(self, const uint32_t* t, Py_ssize_t n, ChainKeys keys, uint64_t salt,
                        uint64_t parent, int64_t first_block, uint64_t* out) except -1
    cdef Py_ssize_t walk_verified(self, const uint32_t* t, Py_ssize_t n, ChainKeys keys,
                                  uint64_t salt, bint native, int32_t* out) except -1 nogil
    cdef int32_t check_block_id(self, object block_id, str name) except -1
    cdef int check_identity(self, object identity, IdentityView* out, list keep) except -1
    cdef Py_ssize_t most_keys(self, ChainKeys keys, Py_ssize_t n) noexcept
    cdef object flush_events(self)
    cdef _emit_cleared(self)
