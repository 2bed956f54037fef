# cython: freethreading_compatible = True
"""Fused dequant-GEMV: ``y = x · Wᵀ`` straight from the packed groups.

Prepares x once per call (forward FWHT for rotated formats, nibble order for
4-bit codes, per-span sums) and hands the row loop to ``gemv_loops.h``.
Callers (``pagedkv.quant.matvec``) validate shapes: ``k % group == 0`` and, for
rotated families, ``k % 256 == 0``; at most 8 rows of x.
"""

cimport numpy as cnp
from libc.stdint cimport uint8_t
from libc.stdlib cimport free, malloc

from pagedkv.quant.affine cimport check_affine_geometry
from pagedkv.quant.fwht cimport rotate256
from pagedkv.quant.quant_header cimport PKV_Q8F16_GROUP, PKV_Q8F16_GROUP_BYTES

cnp.import_array()

from pagedkv.errors import InvalidArgument

cdef extern from "gemv_loops.h" nogil:
    void pkv_cpu_gemv_affine(const uint8_t *w, Py_ssize_t m, Py_ssize_t k, unsigned bits,
                             unsigned G, int family, const float *xp, const float *xsum,
                             Py_ssize_t nb, float *y)
    void pkv_cpu_gemv_q8f16(const uint8_t *w, Py_ssize_t m, Py_ssize_t k, const float *x,
                            Py_ssize_t nb, float *y)

cdef enum:
    MAX_BATCH = 8
    FAMILY_HFQ = 0
    FAMILY_MQ_V2 = 2


cdef void _nibble_order(float *xp, Py_ssize_t n) noexcept nogil:
    """Permute each 32-float chunk to its 16 even elements, then its 16 odd ones."""
    cdef float tmp[32]
    cdef Py_ssize_t c, j
    for c in range(0, n, 32):
        for j in range(16):
            tmp[j] = xp[c + 2 * j]
            tmp[16 + j] = xp[c + 2 * j + 1]
        for j in range(32):
            xp[c + j] = tmp[j]


cdef void _plane_order(float *xp, Py_ssize_t n, int unit_codes) noexcept nogil:
    """Permute each 128-float block: element U*u + k goes to k*(128/U) + u."""
    cdef float tmp[128]
    cdef Py_ssize_t c, u, j, n_u = 128 // unit_codes
    for c in range(0, n, 128):
        for u in range(n_u):
            for j in range(unit_codes):
                tmp[j * n_u + u] = xp[c + unit_codes * u + j]
        for j in range(128):
            xp[c + j] = tmp[j]


def gemv_affine(const uint8_t[::1] w, Py_ssize_t m, Py_ssize_t k, int family, int bits,
                Py_ssize_t group, const float[:, ::1] x, float[:, ::1] y):
    """``y[b, r] = Σ_j x[b, j] · W[r, j]`` for an affine-family W (see module docstring)."""
    cdef Py_ssize_t nb = x.shape[0], b, j, s, span, n_spans
    cdef float *xp
    cdef float *xsum
    cdef float acc
    check_affine_geometry(family, bits, group)
    if nb < 1 or nb > MAX_BATCH or x.shape[1] != k or y.shape[0] != nb or y.shape[1] != m:
        raise InvalidArgument("gemv_affine: x must be [1..8, k] and y [len(x), m]")
    if k % group or (family != FAMILY_HFQ and k % 256):
        raise InvalidArgument(f"gemv_affine: k={k} must be a multiple of the group ({group})")
    if w.shape[0] != m * (k // group) * (8 + bits * group // 8):
        raise InvalidArgument("gemv_affine: w has the wrong size")
    span = 128 if family == FAMILY_MQ_V2 else group
    n_spans = k // span
    if m == 0:
        return
    xp = <float *>malloc(nb * k * sizeof(float))
    xsum = <float *>malloc(nb * n_spans * sizeof(float) + 1)
    if xp == NULL or xsum == NULL:
        free(xp)
        free(xsum)
        raise MemoryError()
    try:
        with nogil:
            for b in range(nb):
                if family == FAMILY_HFQ:
                    for j in range(k):
                        xp[b * k + j] = x[b, j]
                else:
                    rotate256(&x[b, 0], &xp[b * k], k // 256)
                for s in range(n_spans):
                    acc = 0.0
                    for j in range(s * span, (s + 1) * span):
                        acc = acc + xp[b * k + j]
                    xsum[b * n_spans + s] = acc
            if bits == 4:
                # 4-bit codes meet x in nibble order (gemv_loops.h)
                _nibble_order(xp, nb * k)
            else:
                # other widths meet x in plane order (gemv_loops.h, pkv_codes_to_f32)
                _plane_order(xp, nb * k, 4 if bits == 2 or bits == 6 else 8)
            if k > 0:
                pkv_cpu_gemv_affine(&w[0], m, k, bits, <unsigned>group, family, xp, xsum, nb,
                                    &y[0, 0])
            else:
                for b in range(nb):
                    for j in range(m):
                        y[b, j] = 0.0
    finally:
        free(xp)
        free(xsum)


def gemv_q8f16(const uint8_t[::1] w, Py_ssize_t m, Py_ssize_t k, const float[:, ::1] x,
               float[:, ::1] y):
    """``y = x · Wᵀ`` for a Q8F16 W of ``[m, k]`` (k a multiple of PKV_Q8F16_GROUP, 32)."""
    cdef Py_ssize_t nb = x.shape[0], b, r
    if nb < 1 or nb > MAX_BATCH or x.shape[1] != k or y.shape[0] != nb or y.shape[1] != m:
        raise InvalidArgument("gemv_q8f16: x must be [1..8, k] and y [len(x), m]")
    if k % PKV_Q8F16_GROUP or w.shape[0] != m * (k // PKV_Q8F16_GROUP) * PKV_Q8F16_GROUP_BYTES:
        raise InvalidArgument(f"gemv_q8f16: k must be a multiple of {PKV_Q8F16_GROUP} and w "
                              f"m*k/{PKV_Q8F16_GROUP}*{PKV_Q8F16_GROUP_BYTES} bytes")
    with nogil:
        if m > 0 and k > 0:
            pkv_cpu_gemv_q8f16(&w[0], m, k, &x[0, 0], nb, &y[0, 0])
        else:
            for b in range(nb):
                for r in range(m):
                    y[b, r] = 0.0
