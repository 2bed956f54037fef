# cython: freethreading_compatible = True
"""The symmetric int8 weight codecs.

* Q8F16 (qt 3, docs/contracts/hfqm-and-quant.md, '4.5 Q8F16 (qt 3)'): per 32 weights,
  ``f16_trunc(amax/127)`` then 32 int8 codes rounded half away from zero with the f32
  scale. GGML Q8_0 layout. The tensor is flattened; blocks may straddle rows and the
  last one is zero-padded.
* Q8HFQ (qt 5): Q8F16's math per row of K (K % 32 == 0), the row's K/32 scales first,
  then its K codes, zero-padded to a multiple of 128 bytes (docs/formats/quant.md, "Q8HFQ").
* MQ8G256 (qt 14): per 256 rotated weights, ``f16_trunc(amax/127)`` then 256 int8 codes
  of ``r·(127/amax)`` (docs/formats/quant.md, "MQ8G256").
"""

cimport numpy as cnp
from libc.stdint cimport uint8_t, uint32_t
from libc.string cimport memcpy

from pagedkv.quant.fwht cimport group256, unrotate256
from pagedkv.quant.group_encode_loop cimport encode_groups
from pagedkv.quant.cpu_pool cimport check_thread_count
from pagedkv.quant.span_decode_loop cimport decode_spans
from pagedkv.quant.quant_header cimport (
    PKV_ENCODE_OK, pkv_mq8_decode_group, pkv_mq8_encode_group,
    pkv_q8f16_decode_group, pkv_q8f16_encode_group, pkv_q8hfq_decode_elem, pkv_q8hfq_encode_row,
)

cnp.import_array()

from pagedkv.errors import InvalidArgument, SizeMismatch

cdef extern from "pagedkv/quant.h":
    enum:
        BLOCK "PKV_Q8F16_GROUP"              # weights per block
        BLOCK_BYTES "PKV_Q8F16_GROUP_BYTES"  # f16 scale + BLOCK int8


cdef bint _encode_q8f16_block(const float *x, Py_ssize_t count, Py_ssize_t g,
                              void *out) noexcept nogil:
    return pkv_q8f16_encode_group(x, <unsigned>count,
                                  &(<uint8_t *>out)[g * BLOCK_BYTES]) == PKV_ENCODE_OK


def encode(const float[::1] x, uint8_t[::1] out):
    """Encode ``x`` into ``out`` (``ceil(len(x)/32) * 34`` bytes). Returns -1; ``i >= 0``,
    the index of the first NaN/Inf in ``x``; or ``-2 - g`` when block ``g``'s scale
    ``max|x|/127`` does not fit an f16 (beyond 65504)."""
    cdef Py_ssize_t n = x.shape[0], bad
    cdef Py_ssize_t n_blocks = (n + BLOCK - 1) // BLOCK
    if out.shape[0] != n_blocks * BLOCK_BYTES:
        raise InvalidArgument(f"out has {out.shape[0]} bytes, the encoding needs "
                              f"{n_blocks * BLOCK_BYTES}")
    with nogil:
        bad = encode_groups(&x[0], n, BLOCK, _encode_q8f16_block, &out[0])
    return bad


cdef extern from "raw_decode_loops.h" nogil:
    void pkv_cpu_q8f16_decode_blocks(const uint8_t *raw, Py_ssize_t n_blocks, float *out)


cdef struct _DecodeJob:
    const uint8_t *raw
    float *out
    Py_ssize_t K, B              # Q8HFQ: weights and bytes per row
    bint unrotate               # MQ8G256: to the original basis


cdef void _decode_q8f16_span(void *ctx, Py_ssize_t g0, Py_ssize_t g1) noexcept nogil:
    cdef _DecodeJob *job = <_DecodeJob *>ctx
    pkv_cpu_q8f16_decode_blocks(&job.raw[g0 * BLOCK_BYTES], g1 - g0, &job.out[g0 * BLOCK])


def decode(const uint8_t[::1] raw, float[::1] out, int threads=1):
    """Decode ``len(out)`` weights from ``raw`` (``ceil(len(out)/32) * 34`` bytes), the
    blocks split over ``threads`` threads (same bits for any count)."""
    cdef Py_ssize_t n = out.shape[0]
    cdef Py_ssize_t n_blocks = (n + BLOCK - 1) // BLOCK, n_whole = n // BLOCK
    cdef float buf[BLOCK]
    cdef _DecodeJob job
    if raw.shape[0] != n_blocks * BLOCK_BYTES:
        raise SizeMismatch(f"raw has {raw.shape[0]} bytes, {n} weights need "
                           f"{n_blocks * BLOCK_BYTES}")
    check_thread_count(threads)
    if n == 0:
        return
    job.raw = &raw[0]
    job.out = &out[0]
    with nogil:
        decode_spans(_decode_q8f16_span, &job, n_whole, BLOCK, threads)
        if n_whole < n_blocks:              # the zero-padded last block
            pkv_q8f16_decode_group(&raw[n_whole * BLOCK_BYTES], buf)
            memcpy(&out[n_whole * BLOCK], buf, (n - n_whole * BLOCK) * sizeof(float))


# ---------------------------------------------------------------------------
# Q8HFQ (qt 5)

cdef Py_ssize_t q8hfq_row_bytes(Py_ssize_t K) except -1:
    if K <= 0 or K % 32:
        raise InvalidArgument(f"q8hfq needs rows of K weights with K a positive multiple of 32, "
                              f"got K = {K}")
    return (2 * (K // 32) + K + 127) // 128 * 128


cdef struct _Q8hfqJob:
    uint8_t *out
    Py_ssize_t K, B


cdef bint _encode_q8hfq_row(const float *x, Py_ssize_t count, Py_ssize_t r,
                            void *ctx) noexcept nogil:
    cdef _Q8hfqJob *job = <_Q8hfqJob *>ctx
    return pkv_q8hfq_encode_row(x, <uint32_t>job.K, &job.out[r * job.B]) == PKV_ENCODE_OK


def q8hfq_encode(const float[::1] x, uint8_t[::1] out, Py_ssize_t K):
    """Encode rows of ``K`` weights into ``out`` (``round_up(2*K/32 + K, 128)`` bytes per
    row). Returns -1; the index of the first NaN/Inf; or ``-2 - r`` when a block scale of
    row ``r`` does not fit an f16."""
    cdef Py_ssize_t B = q8hfq_row_bytes(K), n = x.shape[0], bad
    cdef _Q8hfqJob job
    if n % K:
        raise InvalidArgument(f"{n} weights are not whole rows of K = {K}")
    if out.shape[0] != n // K * B:
        raise InvalidArgument(f"out has {out.shape[0]} bytes, the encoding needs {n // K * B}")
    job.out = &out[0]
    job.K = K
    job.B = B
    with nogil:
        bad = encode_groups(&x[0], n, K, _encode_q8hfq_row, &job)
    return bad


cdef void _decode_q8hfq_span(void *ctx, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    cdef _DecodeJob *job = <_DecodeJob *>ctx
    cdef Py_ssize_t r, j, K = job.K
    for r in range(r0, r1):
        for j in range(K):
            job.out[r * K + j] = pkv_q8hfq_decode_elem(&job.raw[r * job.B], <uint32_t>K,
                                                       <uint32_t>j)


def q8hfq_decode(const uint8_t[::1] raw, float[::1] out, Py_ssize_t K, int threads=1):
    """Decode ``len(out)`` weights (rows of ``K``), the rows split over ``threads``
    threads (same bits for any count)."""
    cdef Py_ssize_t B = q8hfq_row_bytes(K), n = out.shape[0]
    cdef _DecodeJob job
    if n % K:
        raise InvalidArgument(f"{n} weights are not whole rows of K = {K}")
    if raw.shape[0] != n // K * B:
        raise SizeMismatch(f"raw has {raw.shape[0]} bytes, {n // K} rows of K = {K} need "
                           f"{n // K * B}")
    check_thread_count(threads)
    if n == 0:
        return
    job.raw = &raw[0]
    job.out = &out[0]
    job.K = K
    job.B = B
    with nogil:
        decode_spans(_decode_q8hfq_span, &job, n // K, K, threads)


# ---------------------------------------------------------------------------
# MQ8G256 (qt 14)

cdef enum:
    MQ8_GROUP_BYTES = 258


cdef bint _encode_mq8_group(const float *x, Py_ssize_t count, Py_ssize_t g,
                            void *out) noexcept nogil:
    cdef float buf[256]
    return group256(x, count, buf, True) and \
        pkv_mq8_encode_group(buf, &(<uint8_t *>out)[g * MQ8_GROUP_BYTES]) == PKV_ENCODE_OK


def mq8_encode(const float[::1] x, uint8_t[::1] out):
    """Encode ``x`` into ``ceil(len(x)/256) * 258`` bytes (the short last group is
    zero-padded before the rotation). Returns -1; the index of the first NaN/Inf; or
    ``-2 - g`` when group ``g``'s rotation overflows or its f16 scale saturates."""
    cdef Py_ssize_t n = x.shape[0], bad
    cdef Py_ssize_t n_groups = (n + 255) // 256
    if out.shape[0] != n_groups * MQ8_GROUP_BYTES:
        raise InvalidArgument(f"out has {out.shape[0]} bytes, the encoding needs "
                              f"{n_groups * MQ8_GROUP_BYTES}")
    with nogil:
        bad = encode_groups(&x[0], n, 256, _encode_mq8_group, &out[0])
    return bad


cdef void _decode_mq8_span(void *ctx, Py_ssize_t g0, Py_ssize_t g1) noexcept nogil:
    cdef _DecodeJob *job = <_DecodeJob *>ctx
    cdef Py_ssize_t g
    for g in range(g0, g1):
        pkv_mq8_decode_group(&job.raw[g * MQ8_GROUP_BYTES], &job.out[g * 256])
        if job.unrotate:
            unrotate256(&job.out[g * 256], &job.out[g * 256], 1)


def mq8_decode(const uint8_t[::1] raw, float[::1] out, bint rotated_basis=False,
               int threads=1):
    """Decode ``len(out)`` weights, un-rotated per group unless ``rotated_basis``; the
    whole groups split over ``threads`` threads (same bits for any count)."""
    cdef Py_ssize_t n = out.shape[0]
    cdef Py_ssize_t n_groups = (n + 255) // 256, n_whole = n // 256
    cdef float buf[256]
    cdef _DecodeJob job
    if raw.shape[0] != n_groups * MQ8_GROUP_BYTES:
        raise SizeMismatch(f"raw has {raw.shape[0]} bytes, {n} weights need "
                           f"{n_groups * MQ8_GROUP_BYTES}")
    check_thread_count(threads)
    if n == 0:
        return
    job.raw = &raw[0]
    job.out = &out[0]
    job.unrotate = not rotated_basis
    with nogil:
        decode_spans(_decode_mq8_span, &job, n_whole, 256, threads)
        if n_whole < n_groups:              # the short last group
            pkv_mq8_decode_group(&raw[n_whole * MQ8_GROUP_BYTES], buf)
            if not rotated_basis:
                unrotate256(buf, buf, 1)
            memcpy(&out[n_whole * 256], buf, (n - n_whole * 256) * sizeof(float))
