# cython: language_level=3
"""C-level interface of pagedkv.adapter.table_ops (block-table row loops)."""

cimport numpy as cnp

cdef int _check(cnp.ndarray a, int typenum, int ndim, str name) except -1
