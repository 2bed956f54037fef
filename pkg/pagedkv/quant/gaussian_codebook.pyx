# cython: freethreading_compatible = True
"""GL codecs (qt 38 = MQ2G256GL, 39 = MQ3G256GL): docs/formats/quant.md,
"GL: Gaussian codebooks (qt 38, 39)".

Groups of 256 rotated weights, each index the nearest entry of a fixed Gaussian
Lloyd-Max codebook to ``r / s`` with ``s`` the group's RMS as an f16. The tensor is
structure-of-arrays: every group's packed indices, then every group's f16 scale.
"""

cimport numpy as cnp
from libc.stdint cimport uint8_t, uint32_t

from pagedkv.quant.fwht cimport rotate256, unrotate256
from pagedkv.quant.group_encode_loop cimport encode_groups
from pagedkv.quant.cpu_pool cimport check_thread_count
from pagedkv.quant.span_decode_loop cimport decode_spans
from pagedkv.quant.quant_header cimport (
    PKV_F16_IS_NONFINITE, pkv_first_nonfinite, pkv_gl_decode_group, pkv_store_u16le,
)

cnp.import_array()

from pagedkv.errors import InvalidArgument, SizeMismatch


cdef extern from "gaussian_codebook_loops.h" nogil:
    uint32_t pkv_gl_encode_group(const float *r, uint32_t bits, uint8_t *q, uint8_t *idx)


cdef Py_ssize_t _groups(Py_ssize_t n, int bits) except -1:
    if bits != 2 and bits != 3:
        raise InvalidArgument(f"bits = {bits}: the GL codecs are 2 or 3 bits")
    if n % 256:
        raise InvalidArgument(f"GL tensors hold whole groups of 256 weights, got {n}")
    return n // 256


cdef struct _GlJob:
    uint8_t *out
    Py_ssize_t n_groups, idx_bytes
    int bits


cdef bint _encode_gl_group(const float *x, Py_ssize_t count, Py_ssize_t g,
                           void *ctx) noexcept nogil:
    """Group g's indices at ``out[g * idx_bytes]``, its f16 scale after every group's
    indices (the structure-of-arrays layout)."""
    cdef _GlJob *job = <_GlJob *>ctx
    cdef uint8_t q[256]
    cdef float buf[256]
    cdef uint32_t s16
    rotate256(x, buf, 1)
    if pkv_first_nonfinite(buf, 256) >= 0:
        return False
    s16 = pkv_gl_encode_group(buf, <uint32_t>job.bits, q, &job.out[g * job.idx_bytes])
    pkv_store_u16le(&job.out[job.n_groups * job.idx_bytes + 2 * g], s16)
    return not PKV_F16_IS_NONFINITE(s16)


def encode(const float[::1] x, uint8_t[::1] out, int bits):
    """Encode ``x`` (a multiple of 256 weights) into ``out`` (``len(x)/256 * (32*bits + 2)``
    bytes). Returns -1; the index of the first NaN/Inf in ``x``; or ``-2 - g`` when group
    ``g``'s rotation overflows or its f16 scale would be beyond 65504."""
    cdef Py_ssize_t n_groups = _groups(x.shape[0], bits), bad
    cdef Py_ssize_t idx_bytes = 32 * bits
    cdef _GlJob job
    if out.shape[0] != n_groups * (idx_bytes + 2):
        raise InvalidArgument(f"out has {out.shape[0]} bytes, the encoding needs "
                              f"{n_groups * (idx_bytes + 2)}")
    job.out = &out[0]
    job.n_groups = n_groups
    job.idx_bytes = idx_bytes
    job.bits = bits
    with nogil:
        bad = encode_groups(&x[0], x.shape[0], 256, _encode_gl_group, &job)
    return bad


cdef struct _DecodeJob:
    const uint8_t *raw
    float *out
    Py_ssize_t n_groups
    uint32_t bits
    bint unrotate


cdef void _decode_span(void *ctx, Py_ssize_t g0, Py_ssize_t g1) noexcept nogil:
    cdef _DecodeJob *job = <_DecodeJob *>ctx
    cdef uint8_t q[256]
    cdef Py_ssize_t g
    for g in range(g0, g1):
        pkv_gl_decode_group(job.raw, job.bits, job.n_groups, g, q, &job.out[g * 256])
        if job.unrotate:
            unrotate256(&job.out[g * 256], &job.out[g * 256], 1)


def decode(const uint8_t[::1] raw, float[::1] out, int bits, bint rotated_basis=False,
           int threads=1):
    """Decode ``len(out)`` weights (a multiple of 256), un-rotated per group unless
    ``rotated_basis``; the groups split over ``threads`` threads (same bits for any
    count)."""
    cdef Py_ssize_t n_groups = _groups(out.shape[0], bits)
    cdef _DecodeJob job
    if raw.shape[0] != n_groups * (32 * bits + 2):
        raise SizeMismatch(f"raw has {raw.shape[0]} bytes, {out.shape[0]} weights need "
                           f"{n_groups * (32 * bits + 2)}")
    check_thread_count(threads)
    if n_groups == 0:
        return
    job.raw = &raw[0]
    job.out = &out[0]
    job.n_groups = n_groups
    job.bits = <uint32_t>bits
    job.unrotate = not rotated_basis
    with nogil:
        decode_spans(_decode_span, &job, n_groups, 256, threads)
