# cython: language_level=3
"""C-level interface of pagedkv.hashing, cimported by pagedkv.allocator."""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t


cdef class ChainKeys:
    """Validated extra keys of one chain: uniform (the same keys on every block) or per
    block (the chain stops where the list ends). Keys are held flat as uint64, so the
    hash loop reads them without Python objects."""
    cdef readonly object flat_keys          # uint64[total]
    cdef readonly object key_offsets        # intp[n + 1] for per-block keys, else None
    cdef readonly Py_ssize_t max_blocks     # chain-length limit; -1 when unbounded
    cdef readonly bint per_block
    cdef const uint64_t* keys_ptr
    cdef const Py_ssize_t* offsets_ptr
    cdef Py_ssize_t uniform_count
    cdef readonly object digests            # uint8[m, 16]: m = 1 (uniform) or blocks
    cdef readonly object digest_lens        # uint32[m]: 0 (no keys) or 16
    cdef const uint8_t* digests_ptr
    cdef const uint32_t* digest_lens_ptr
    cdef list block_tuples                  # tuple per block (for _hash_fn), or None
    cdef object uniform_tuple

    cdef inline Py_ssize_t key_count(self, Py_ssize_t block) noexcept nogil:
        if self.offsets_ptr == NULL:
            return self.uniform_count
        return self.offsets_ptr[block + 1] - self.offsets_ptr[block]

    cdef inline const uint64_t* keys_of(self, Py_ssize_t block) noexcept nogil:
        if self.offsets_ptr == NULL:
            return self.keys_ptr
        return self.keys_ptr + self.offsets_ptr[block]

    cdef inline const uint8_t* digest_of(self, Py_ssize_t block) noexcept nogil:
        """The block's extra-keys digest (BLAKE2b-128 or unused when digest_len is 0)."""
        if self.offsets_ptr == NULL:
            return self.digests_ptr
        return self.digests_ptr + 16 * block

    cdef inline uint32_t digest_len(self, Py_ssize_t block) noexcept nogil:
        if self.offsets_ptr == NULL:
            return self.digest_lens_ptr[0]
        return self.digest_lens_ptr[block]

    cdef object tuple_of(self, Py_ssize_t block)
    cdef Py_ssize_t blocks_for(self, Py_ssize_t full_blocks) noexcept


cdef size_t hot_buffer_bytes(Py_ssize_t block_size, Py_ssize_t key_count) noexcept nogil

cdef bint xxh3_native() noexcept nogil

cdef uint64_t hash_block_native(uint64_t parent, const uint32_t* tokens, Py_ssize_t block_size,
                                const uint64_t* keys, Py_ssize_t key_count, uint64_t cache_salt,
                                int64_t block_index, uint64_t seed,
                                uint8_t* scratch) noexcept nogil

cdef uint64_t hash_block(uint64_t parent, const uint32_t* tokens, Py_ssize_t block_size,
                         const uint64_t* keys, Py_ssize_t key_count, uint64_t cache_salt,
                         int64_t block_index, uint64_t seed, uint8_t* scratch) except 0

cdef int chain_into(const uint32_t* tokens, Py_ssize_t n_blocks, Py_ssize_t block_size,
                    ChainKeys keys, uint64_t cache_salt, uint64_t seed,
                    uint64_t* out) except -1

cdef int chain_segment_into(const uint32_t* tokens, Py_ssize_t n_blocks, Py_ssize_t block_size,
                            ChainKeys keys, uint64_t cache_salt, uint64_t seed,
                            uint64_t parent, int64_t first_block, uint64_t* out) except -1

cpdef object as_token_array(object tokens, str name=*)
cpdef uint64_t as_domain_id(object cache_salt, str name=*) except? 0
cpdef uint64_t as_u64(object value, str name) except? 0
cpdef ChainKeys make_chain_keys(object extra_keys=*, object extra_keys_per_block=*)
