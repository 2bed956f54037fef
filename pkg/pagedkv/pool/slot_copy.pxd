# cython: language_level=3
"""C-level interface of pagedkv.pool.slot_copy (the NumPy pool's per-layer token copies)."""

cimport numpy as cnp


cdef class SlotCopier:
    cdef readonly object array          # the storage array; keeps `base` alive
    cdef char* base
    cdef char* end
    cdef cnp.PyArray_Descr* descr
    cdef int type_num
    cdef Py_ssize_t num_layers, num_blocks, block_size, num_slots
    cdef Py_ssize_t num_kv_heads, row_elements
    cdef Py_ssize_t token_bytes         # one token of one layer's K (or V)
    cdef Py_ssize_t kv_stride_bytes     # K of a layer -> V of the same layer
    cdef Py_ssize_t layer_stride_bytes

    cdef bint _is_tokens(self, object x, Py_ssize_t n)
    cdef Py_ssize_t _layer(self, object layer)
    cdef bint _scatter(self, Py_ssize_t layer, const Py_ssize_t* slots, Py_ssize_t n,
                       object k, object v)
    cdef object _table_slots(self, object block_ids, Py_ssize_t start, Py_ssize_t n)
