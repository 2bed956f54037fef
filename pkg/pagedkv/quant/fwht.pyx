# cython: freethreading_compatible = True
"""FWHT-256 rotation and the sign tables of the MQ formats (docs/contracts/hfqm-and-quant.md, '3.5
Sign tables' to '3.6 FWHT rotation').

``R = D2 . H . D1 / 16``: SIGNS1 (LCG seed 42), Walsh-Hadamard butterflies in
ascending strides, scale 1/16, SIGNS2 (seed 1042). ``fwht_rows`` applies R (or
its transpose, the inverse) to each row of a float32 ``[n, 256]`` array; the
math is ``pkv_fwht_with_tables`` of ``pagedkv/quant.h``, the text the GPU
kernels include.
"""

import numpy as np

cimport numpy as cnp
from libc.stdint cimport uint32_t
from libc.string cimport memcpy, memset

from pagedkv.quant.quant_header cimport (
    pkv_first_nonfinite, pkv_sign_lcg_next, pkv_signs1_word, pkv_signs2_word, pkv_signs_generate,
)

cnp.import_array()

from pagedkv.errors import InvalidArgument

cdef extern from "fwht_loops.h" nogil:
    void pkv_cpu_fwht256_rows(const float *x, float *y, Py_ssize_t n_rows,
                              const float *pre, const float *post_scaled)

# Generated once at import from the LCG (the header's packed words are checked
# against them in the tests); read-only afterwards, so safe from any thread.
# The post tables carry the 1/16 scale (c·(±1) is exact, so the product is the same bits).
cdef float SIGNS1[256]
cdef float SIGNS2[256]
cdef float SIGNS1_SCALED[256]
cdef float SIGNS2_SCALED[256]
pkv_signs_generate(42, 256, SIGNS1)
pkv_signs_generate(1042, 256, SIGNS2)
for _i in range(256):
    SIGNS1_SCALED[_i] = SIGNS1[_i] * <float>0.0625
    SIGNS2_SCALED[_i] = SIGNS2[_i] * <float>0.0625


cdef void rotate256(const float *x, float *y, Py_ssize_t n_rows) noexcept nogil:
    pkv_cpu_fwht256_rows(x, y, n_rows, SIGNS1, SIGNS2_SCALED)


cdef void unrotate256(const float *x, float *y, Py_ssize_t n_rows) noexcept nogil:
    pkv_cpu_fwht256_rows(x, y, n_rows, SIGNS2, SIGNS1_SCALED)


cdef bint group256(const float *x, Py_ssize_t count, float *y, bint rotate) noexcept nogil:
    memcpy(y, x, count * sizeof(float))
    if count < 256:
        memset(&y[count], 0, (256 - count) * sizeof(float))
    if not rotate:
        return True
    rotate256(y, y, 1)
    return pkv_first_nonfinite(y, 256) < 0


def fwht_rows(const float[:, ::1] x, float[:, ::1] out, bint inverse=False):
    """Rotate each row of ``x`` (float32 ``[n, 256]``) into ``out`` (same shape; may be ``x``'s
    own buffer only if ``x`` was passed writable). ``inverse`` applies Rᵀ."""
    cdef Py_ssize_t n = x.shape[0]
    if x.shape[1] != 256 or out.shape[0] != n or out.shape[1] != 256:
        raise InvalidArgument("fwht_rows needs [n, 256] float32 input and output of equal shape")
    if n == 0:
        return
    with nogil:
        if inverse:
            unrotate256(&x[0, 0], &out[0, 0], n)
        else:
            rotate256(&x[0, 0], &out[0, 0], n)


def header_sign_words(int table):
    """The packed sign words of ``pagedkv/quant.h`` (table 1 = SIGNS1, 2 = SIGNS2), uint32[8]."""
    cdef cnp.ndarray[cnp.uint32_t, ndim=1] out
    cdef uint32_t w
    if table != 1 and table != 2:
        raise InvalidArgument(f"table = {table}: 1 (SIGNS1) or 2 (SIGNS2)")
    out = np.empty(8, dtype=np.uint32)
    for w in range(8):
        out[w] = pkv_signs1_word(w) if table == 1 else pkv_signs2_word(w)
    return out


def lcg_states(uint32_t seed, Py_ssize_t n):
    """The first ``n`` states of the sign generator for ``seed`` (uint32), for tests and docs."""
    cdef cnp.ndarray[cnp.uint32_t, ndim=1] out = np.empty(n, dtype=np.uint32)
    cdef uint32_t state = seed
    cdef Py_ssize_t i
    for i in range(n):
        state = pkv_sign_lcg_next(state)
        out[i] = state
    return out


def sign_table(uint32_t seed, Py_ssize_t n=256):
    """``signs(seed, n)`` of docs/contracts/hfqm-and-quant.md, '3.5 Sign tables' as float32 (+1.0 /
    -1.0)."""
    cdef cnp.ndarray[cnp.float32_t, ndim=1] out = np.empty(n, dtype=np.float32)
    if n > 0:
        pkv_signs_generate(seed, <uint32_t>n, <float *>cnp.PyArray_DATA(out))
    return out
