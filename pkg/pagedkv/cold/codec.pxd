# cython: language_level=3
from libc.stdint cimport uint64_t

cdef extern from "pagedkv/cold.h":
    enum pkv_cold_dtype:
        PKV_COLD_FLOAT16
        PKV_COLD_BFLOAT16
        PKV_COLD_FLOAT32
        PKV_COLD_Q8
    uint64_t pkv_cold_header_overhead(uint64_t n_tensors) nogil
    uint64_t pkv_cold_slab_bytes(uint64_t block_size, uint64_t num_kv_heads,
                                 uint64_t head_dim, int dtype) nogil
    uint64_t pkv_cold_block_bound(uint64_t block_size, uint64_t num_layers,
                                  uint64_t slab_bytes) nogil
    uint64_t pkv_cold_block_bound_kv(uint64_t block_size, uint64_t num_layers,
                                     uint64_t key_bytes, uint64_t value_bytes) nogil


cdef class BlockGeometry:
    cdef readonly Py_ssize_t block_size
    cdef readonly Py_ssize_t num_layers
    cdef readonly Py_ssize_t num_kv_heads
    cdef readonly Py_ssize_t head_dim
    cdef readonly str dtype
    cdef readonly str layout
    cdef readonly Py_ssize_t slab_bytes
    cdef readonly Py_ssize_t key_bytes
    cdef readonly Py_ssize_t value_bytes


cdef class DecodedBlock:
    cdef readonly BlockGeometry geometry
    cdef readonly object tokens
    cdef readonly object payload
    cdef readonly str checksum
    cdef readonly Py_ssize_t nbytes
