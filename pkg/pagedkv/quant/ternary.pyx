# cython: freethreading_compatible = True
"""Bonsai's passthrough formats, decode only: TQ2G128 (qt 40, ternary, ``w = (code - 1)·d``)
and BQ1G128 (qt 41, binary, ``w = ±d``). 128 weights per group, an f16 ``d`` then the
codes LSB-first. The bit order and BQ1's sign sense are unverified upstream; pagedkv's
choice is documented in docs/formats/quant.md, "TQ2G128 and BQ1G128".
"""

cimport numpy as cnp
from libc.stdint cimport uint8_t, uint32_t

from pagedkv.quant.quant_header cimport pkv_bq1_decode_elem, pkv_tq2_decode_elem
from pagedkv.quant.cpu_pool cimport check_thread_count
from pagedkv.quant.span_decode_loop cimport decode_spans

cnp.import_array()

from pagedkv.errors import InvalidArgument, SizeMismatch


cdef struct _DecodeJob:
    const uint8_t *raw
    float *out
    Py_ssize_t n, B
    int bits


cdef void _decode_span(void *ctx, Py_ssize_t g0, Py_ssize_t g1) noexcept nogil:
    """Groups [g0, g1) (the last one may be short)."""
    cdef _DecodeJob *job = <_DecodeJob *>ctx
    cdef Py_ssize_t i, end = min(g1 * 128, job.n)
    if job.bits == 2:
        for i in range(g0 * 128, end):
            job.out[i] = pkv_tq2_decode_elem(&job.raw[(i // 128) * job.B], <uint32_t>(i % 128))
    else:
        for i in range(g0 * 128, end):
            job.out[i] = pkv_bq1_decode_elem(&job.raw[(i // 128) * job.B], <uint32_t>(i % 128))


def decode(const uint8_t[::1] raw, float[::1] out, int bits, int threads=1):
    """Decode ``len(out)`` weights: ``bits`` = 2 (TQ2G128, 34 B per 128) or 1 (BQ1G128,
    18 B per 128); the groups split over ``threads`` threads (same bits for any count)."""
    if bits != 1 and bits != 2:
        raise InvalidArgument(f"bits = {bits}: 2 (tq2g128) or 1 (bq1g128)")
    cdef Py_ssize_t n = out.shape[0]
    cdef Py_ssize_t B = 2 + 16 * bits
    cdef Py_ssize_t n_groups = (n + 127) // 128
    cdef _DecodeJob job
    if raw.shape[0] != n_groups * B:
        raise SizeMismatch(f"raw has {raw.shape[0]} bytes, {n} weights need {n_groups * B}")
    check_thread_count(threads)
    if n == 0:
        return
    job.raw = &raw[0]
    job.out = &out[0]
    job.n = n
    job.B = B
    job.bits = bits
    with nogil:
        decode_spans(_decode_span, &job, n_groups, 128, threads)
