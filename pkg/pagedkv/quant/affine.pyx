# cython: freethreading_compatible = True
"""Affine weight codecs (docs/contracts/hfqm-and-quant.md, '4.1 HFQ generic affine v1' to '4.4
MQ4CG256 (qt 45)'): HFQ v1, MQ v1, MQ V2, MQ4C.

Flat in, flat out: the tensor is flattened row-major and cut into consecutive
groups of ``group`` weights (groups may straddle rows, docs/contracts/hfqm-and-quant.md, '3.4 Bit
packing'); the last group
may be short. Per-group math is ``pagedkv/quant.h``; these loops only walk
groups, zero-pad the short last group and apply the FWHT-256 for the rotated
families.
"""

import os

cimport numpy as cnp
from libc.stdint cimport uint8_t
from libc.string cimport memcpy

from pagedkv.quant.fwht cimport group256, unrotate256
from pagedkv.quant.group_encode_loop cimport encode_groups, group_encoder
from pagedkv.quant.cpu_pool cimport check_thread_count
from pagedkv.quant.span_decode_loop cimport decode_spans
from pagedkv.quant.quant_header cimport (
    PKV_ENCODE_OK, pkv_hfq_encode_group, pkv_mq4c_encode_group, pkv_mqv1_encode_group,
    pkv_mqv2_encode_group, pkv_pack_codes, pkv_unpack_code,
)

cnp.import_array()

from pagedkv.errors import InvalidArgument, SizeMismatch


cdef int check_affine_geometry(int family, int bits, Py_ssize_t group) except -1:
    # The codecs' formats (docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register'): HFQ
    # G128/G256 at 2-6 bits, the rotated
    # families G256 only, MQ4C 4-bit only. Anything else would overrun the scratch buffers.
    if family < HFQ or family > MQ4C:
        raise InvalidArgument(f"family = {family}: valid 0-3 (AffineFamily.HFQ..MQ4C)")
    if bits < 2 or bits > 6:
        raise InvalidArgument(f"bits = {bits}: the affine codecs take 2 to 6 bits")
    if group != 256 and (group != 128 or family != HFQ):
        raise InvalidArgument(f"group = {group}: valid 256, or 128 for AffineFamily.HFQ")
    if family == MQ4C and bits != 4:
        raise InvalidArgument(f"bits = {bits}: AffineFamily.MQ4C is 4-bit only")
    return 0


cdef inline Py_ssize_t group_bytes(int bits, Py_ssize_t group) noexcept nogil:
    return 8 + bits * group // 8


cdef struct _EncodeJob:
    uint8_t *out
    Py_ssize_t B, group
    int family, bits


cdef bint _encode_hfq_group(const float *x, Py_ssize_t count, Py_ssize_t g,
                            void *ctx) noexcept nogil:
    cdef _EncodeJob *job = <_EncodeJob *>ctx
    cdef uint8_t q[256]
    return pkv_hfq_encode_group(x, <unsigned>count, job.bits, <unsigned>job.group, q,
                                &job.out[g * job.B]) == PKV_ENCODE_OK


cdef bint _encode_rotated_group(const float *x, Py_ssize_t count, Py_ssize_t g,
                                void *ctx) noexcept nogil:
    cdef _EncodeJob *job = <_EncodeJob *>ctx
    cdef uint8_t q[256]
    cdef float buf[256]
    cdef uint8_t *blk = &job.out[g * job.B]
    # zero-pad BEFORE rotating (docs/contracts/hfqm-and-quant.md, '4.2 MQ v1 — rotated HFQ
    # (qt 13, 15, 17, 18, 31)'), then min/max over all 256; finite weights near 3.4e38 can
    # rotate to inf
    if not group256(x, count, buf, True):
        return False
    if job.family == MQ_V1:
        return pkv_mqv1_encode_group(buf, job.bits, q, blk) == PKV_ENCODE_OK
    if job.family == MQ_V2:
        return pkv_mqv2_encode_group(buf, job.bits, q, blk) == PKV_ENCODE_OK
    return pkv_mq4c_encode_group(buf, q, blk) == PKV_ENCODE_OK


def encode(const float[::1] x, uint8_t[::1] out, int family, int bits, Py_ssize_t group):
    """Encode ``x`` into ``out`` (``ceil(len(x)/group)`` groups of ``8 + bits*group/8`` bytes).

    Returns -1 when every group is stored; ``i >= 0``, the index of the first NaN/Inf
    in ``x``; or ``-2 - g`` when group ``g`` has finite inputs that the format cannot
    store with finite values (an f32 range or FWHT output that overflows, an f16
    scale or zero beyond 65504). Nothing is guaranteed about ``out`` unless -1.
    Raises InvalidArgument for a geometry no format uses (rotated families need
    group 256) or an ``out`` of the wrong size.
    """
    cdef Py_ssize_t n = x.shape[0], B, bad, n_groups
    cdef _EncodeJob job
    cdef group_encoder encode_group = _encode_rotated_group
    check_affine_geometry(family, bits, group)  # before dividing by group
    B = group_bytes(bits, group)
    n_groups = (n + group - 1) // group
    if out.shape[0] != n_groups * B:
        raise InvalidArgument(f"out has {out.shape[0]} bytes, the encoding needs {n_groups * B}")
    if n == 0:
        return -1
    job.out = &out[0]
    job.B = B
    job.group = group
    job.family = family
    job.bits = bits
    if family == HFQ:
        encode_group = _encode_hfq_group
    with nogil:
        bad = encode_groups(&x[0], n, group, encode_group, &job)
    return bad


cdef extern from "affine_loops.h" nogil:
    void pkv_cpu_affine_decode_groups(const uint8_t *raw, Py_ssize_t n_groups, int family,
                                      unsigned bits, unsigned G, float *out)

cdef extern from "mq_decode_loops.h" nogil:
    void pkv_mqd_init_tables()
    int pkv_cpu_mq4_decode_original(const uint8_t *raw, Py_ssize_t n_groups, int family,
                                    float *out, int max_level, size_t total_bytes)

pkv_mqd_init_tables()

cdef enum:
    DECODE_BATCH_GROUPS = 64    # groups decoded then un-rotated together (64 KiB, L2-resident)


cdef struct _DecodeJob:
    const uint8_t *raw
    float *out
    Py_ssize_t n_whole, B, group
    int family, bits, mq_level
    bint unrotate


# PAGEDKV_CPU_ISA (docs/formats/cpu-gemv.md) caps the one-pass MQ decoder too: no kernel
# for "scalar", the AVX2 one for the 256-bit kernels, else the best (same bits).
_MQ_LEVELS = {"scalar": 0, "neon-dotprod": 0, "avx2": 1, "avx-vnni": 1}


cdef int _mq_level():
    return _MQ_LEVELS.get(os.environ.get("PAGEDKV_CPU_ISA", ""), 2)


cdef void _decode_span(void *ctx, Py_ssize_t g0, Py_ssize_t g1) noexcept nogil:
    """Whole groups [g0, g1) of a decode job."""
    cdef _DecodeJob *job = <_DecodeJob *>ctx
    cdef Py_ssize_t g, count, B = job.B, group = job.group
    if job.unrotate and job.bits == 4 and group == 256 and pkv_cpu_mq4_decode_original(
            &job.raw[g0 * B], g1 - g0, job.family, &job.out[g0 * group], job.mq_level,
            job.n_whole * group * sizeof(float)):
        return
    g = g0
    while g < g1:
        count = min(<Py_ssize_t>DECODE_BATCH_GROUPS, g1 - g)
        pkv_cpu_affine_decode_groups(&job.raw[g * B], count, job.family, job.bits,
                                     <unsigned>group, &job.out[g * group])
        if job.unrotate:
            unrotate256(&job.out[g * group], &job.out[g * group], count)
        g += count


def decode(const uint8_t[::1] raw, float[::1] out, int family, int bits,
           Py_ssize_t group, bint rotated_basis=False, int threads=1):
    """Decode ``len(out)`` weights from ``raw``. For rotated families the result is in the
    original basis (Rᵀ applied per group) unless ``rotated_basis`` (the stored basis).
    ``threads``: split the groups over that many threads (same bits for any count)."""
    cdef Py_ssize_t n = out.shape[0], B, n_groups, n_whole
    cdef float buf[256]
    cdef _DecodeJob job
    cdef bint unrotate = family != HFQ and not rotated_basis
    check_affine_geometry(family, bits, group)  # before dividing by group
    check_thread_count(threads)
    B = group_bytes(bits, group)
    n_groups = (n + group - 1) // group
    n_whole = n // group
    if raw.shape[0] != n_groups * B:
        raise SizeMismatch(f"raw has {raw.shape[0]} bytes, {n} weights need {n_groups * B}")
    if n == 0:
        return
    job.raw = &raw[0]
    job.out = &out[0]
    job.n_whole = n_whole
    job.B = B
    job.group = group
    job.family = family
    job.bits = bits
    job.unrotate = unrotate
    job.mq_level = _mq_level()
    with nogil:
        decode_spans(_decode_span, &job, n_whole, group, threads)
        if n_whole < n_groups:              # the short last group
            pkv_cpu_affine_decode_groups(&raw[n_whole * B], 1, family, bits, <unsigned>group, buf)
            if unrotate:
                unrotate256(buf, buf, 1)
            memcpy(&out[n_whole * group], buf, (n - n_whole * group) * sizeof(float))


def pack_codes(const uint8_t[::1] q, int bits):
    """Pack codes (each < 2**bits) as the LSB-first stream of docs/contracts/hfqm-and-quant.md, '3.4
    Bit packing'; returns uint8 bytes."""
    cdef Py_ssize_t n = q.shape[0]
    cdef Py_ssize_t i
    if bits < 1 or bits > 8:
        raise InvalidArgument(f"bits = {bits}: codes are 1 to 8 bits wide")
    for i in range(n):
        if q[i] >> bits:
            raise InvalidArgument(f"code {q[i]} at index {i} does not fit in {bits} bits")
    out = bytearray((n * bits + 7) // 8)
    cdef uint8_t[::1] o = out
    if n:
        pkv_pack_codes(&q[0], <unsigned>n, bits, &o[0])
    return bytes(out)


def unpack_codes(const uint8_t[::1] payload, Py_ssize_t n, int bits):
    """The first ``n`` codes of an LSB-first stream (element by element, the kernels' accessor)."""
    if bits < 1 or bits > 8:
        raise InvalidArgument(f"bits = {bits}: codes are 1 to 8 bits wide")
    if n < 0:
        raise InvalidArgument(f"n = {n}: the code count must be >= 0")
    if (n * bits + 7) // 8 > payload.shape[0]:
        raise InvalidArgument(f"{n} codes of {bits} bits need {(n * bits + 7) // 8} bytes")
    out = bytearray(n)
    cdef uint8_t[::1] o = out
    cdef Py_ssize_t j
    for j in range(n):
        o[j] = <uint8_t>pkv_unpack_code(&payload[0], <unsigned>j, bits)
    return bytes(out)
