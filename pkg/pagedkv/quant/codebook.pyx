# cython: freethreading_compatible = True
"""Lloyd codebook codecs (qt 19, 20, 30 rotated; 51 unrotated): docs/formats/quant.md,
"Lloyd codebooks (qt 19, 20, 30, 51)".

Flat in, flat out, like :mod:`pagedkv.quant.affine`: groups of 256 weights (groups may
straddle rows; the short last group is zero-padded before the rotation), each stored
as ``2**bits`` f16 centroids and 256 packed indices.
"""

cimport numpy as cnp
from libc.stdint cimport uint8_t
from libc.string cimport memcpy

from pagedkv.quant.fwht cimport group256, unrotate256
from pagedkv.quant.group_encode_loop cimport encode_groups
from pagedkv.quant.cpu_pool cimport check_thread_count
from pagedkv.quant.span_decode_loop cimport decode_spans

cnp.import_array()

from pagedkv.errors import InvalidArgument, SizeMismatch


cdef extern from "pagedkv/quant.h" nogil:
    void pkv_lloyd_decode_group(const uint8_t *blk, unsigned bits, uint8_t *q, float *out)

cdef extern from "codebook_loops.h" nogil:
    void pkv_lloyd_encode_group(const float *r, unsigned bits, uint8_t *q, uint8_t *blk)


cdef Py_ssize_t lloyd_group_bytes(int bits) except -1:
    if bits < 2 or bits > 4:
        raise InvalidArgument(f"bits = {bits}: the Lloyd codecs are 2, 3 or 4 bits")
    return 2 * (1 << bits) + 32 * bits


cdef inline bint _beyond_f16(const float *buf) noexcept nogil:
    """Whether a (rotated) group holds a value its f16 codebook cannot store finite: a
    centroid is a mean of group values, so |x| <= 65504 everywhere keeps every entry finite
    (NaN, from a rotation that overflowed, fails the comparison too)."""
    cdef int i
    for i in range(256):
        if not (buf[i] <= 65504.0 and buf[i] >= -65504.0):
            return True
    return False


cdef struct _LloydJob:
    uint8_t *out
    Py_ssize_t B
    int bits
    bint rotated


cdef bint _encode_lloyd_group(const float *x, Py_ssize_t count, Py_ssize_t g,
                              void *ctx) noexcept nogil:
    cdef _LloydJob *job = <_LloydJob *>ctx
    cdef uint8_t q[256]
    cdef float buf[256]
    if not group256(x, count, buf, job.rotated) or _beyond_f16(buf):
        return False
    pkv_lloyd_encode_group(buf, <unsigned>job.bits, q, &job.out[g * job.B])
    return True


def encode(const float[::1] x, uint8_t[::1] out, int bits, bint rotated):
    """Encode ``x`` into ``out`` (``ceil(len(x)/256)`` groups). Returns -1; the index of
    the first NaN/Inf in ``x``; or ``-2 - g`` when group ``g`` is finite but beyond what its
    f16 codebook can store (``out`` is then unspecified)."""
    cdef Py_ssize_t B = lloyd_group_bytes(bits)
    cdef Py_ssize_t n = x.shape[0], bad
    cdef Py_ssize_t n_groups = (n + 255) // 256
    cdef _LloydJob job
    if out.shape[0] != n_groups * B:
        raise InvalidArgument(f"out has {out.shape[0]} bytes, the encoding needs {n_groups * B}")
    job.out = &out[0]
    job.B = B
    job.bits = bits
    job.rotated = rotated
    with nogil:
        bad = encode_groups(&x[0], n, 256, _encode_lloyd_group, &job)
    return bad


cdef struct _DecodeJob:
    const uint8_t *raw
    float *out
    Py_ssize_t B
    unsigned bits
    bint unrotate


cdef void _decode_span(void *ctx, Py_ssize_t g0, Py_ssize_t g1) noexcept nogil:
    """Whole groups [g0, g1), straight into the output."""
    cdef _DecodeJob *job = <_DecodeJob *>ctx
    cdef uint8_t q[256]
    cdef Py_ssize_t g
    for g in range(g0, g1):
        pkv_lloyd_decode_group(&job.raw[g * job.B], job.bits, q, &job.out[g * 256])
        if job.unrotate:
            unrotate256(&job.out[g * 256], &job.out[g * 256], 1)


def decode(const uint8_t[::1] raw, float[::1] out, int bits, bint rotated,
           bint rotated_basis=False, int threads=1):
    """Decode ``len(out)`` weights; a rotated format is un-rotated per group unless
    ``rotated_basis`` (the stored basis). The whole groups split over ``threads`` threads
    (same bits for any count)."""
    cdef Py_ssize_t B = lloyd_group_bytes(bits)
    cdef Py_ssize_t n = out.shape[0], n_whole = n // 256
    cdef Py_ssize_t n_groups = (n + 255) // 256
    cdef uint8_t q[256]
    cdef float buf[256]
    cdef bint unrotate = rotated and not rotated_basis
    cdef _DecodeJob job
    if raw.shape[0] != n_groups * B:
        raise SizeMismatch(f"raw has {raw.shape[0]} bytes, {n} weights need {n_groups * B}")
    check_thread_count(threads)
    if n == 0:
        return
    job.raw = &raw[0]
    job.out = &out[0]
    job.B = B
    job.bits = <unsigned>bits
    job.unrotate = unrotate
    with nogil:
        decode_spans(_decode_span, &job, n_whole, 256, threads)
        if n_whole < n_groups:              # the short last group
            pkv_lloyd_decode_group(&raw[n_whole * B], <unsigned>bits, q, buf)
            if unrotate:
                unrotate256(buf, buf, 1)
            memcpy(&out[n_whole * 256], buf, (n - n_whole * 256) * sizeof(float))
