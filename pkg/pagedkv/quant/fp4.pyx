# cython: freethreading_compatible = True
"""FP4 row codecs: HFP4G32 (qt 21), MFP4G32 (qt 24, rotated per 256), MFP4G32P (qt 33,
rotated, E4M3 block scales). docs/formats/quant.md, "HFP4G32, MFP4G32, MFP4G32P".

Flat in, flat out: ``len(x) / K`` rows of K weights (K % 32 == 0; K % 256 == 0 for the
rotated kinds), each stored as a 16-byte header and K/32 blocks of 17 bytes.
"""

cimport numpy as cnp
from libc.stdint cimport uint8_t, uint32_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from pagedkv.quant.fwht cimport rotate256, unrotate256
from pagedkv.quant.group_encode_loop cimport encode_groups
from pagedkv.quant.cpu_pool cimport check_thread_count
from pagedkv.quant.span_decode_loop cimport decode_spans
from pagedkv.quant.quant_header cimport (
    PKV_ENCODE_OK, PKV_FP4_FLAGS_PLAIN, PKV_FP4_FLAGS_ROTATED, PKV_FP4_UE8M0_RESERVED,
    pkv_first_nonfinite, pkv_fp4_decode_row,
)

cnp.import_array()

from pagedkv.errors import CorruptPayload, InvalidArgument, SizeMismatch


cdef extern from "fp4_loops.h" nogil:
    int pkv_fp4_encode_row(const float *x, uint32_t K, uint32_t flags, int e4m3, uint8_t *row)

#: kind: 0 = HFP4G32, 1 = MFP4G32, 2 = MFP4G32P
KINDS = ("hfp4g32", "mfp4g32", "mfp4g32p")


cdef Py_ssize_t row_bytes(Py_ssize_t K):
    return 16 + 17 * (K // 32)


cdef int _check(Py_ssize_t n, Py_ssize_t K, int kind) except -1:
    if kind < 0 or kind > 2:
        raise InvalidArgument(f"kind = {kind}: 0 (hfp4g32), 1 (mfp4g32) or 2 (mfp4g32p)")
    cdef Py_ssize_t multiple = 32 if kind == 0 else 256
    if K <= 0 or K % multiple or K // 32 > 65535:
        raise InvalidArgument(
            f"{KINDS[kind]} needs rows of K weights with K a positive multiple of {multiple} "
            f"(and K/32 <= 65535, the header's block count), got K = {K}")
    if n % K:
        raise InvalidArgument(f"{n} weights are not whole rows of K = {K}")
    return 0


cdef struct _Fp4Job:
    uint8_t *out
    float *buf              # K floats: the row, rotated or copied
    Py_ssize_t K, B
    uint32_t flags
    int kind


cdef bint _encode_fp4_row(const float *x, Py_ssize_t count, Py_ssize_t r,
                          void *ctx) noexcept nogil:
    cdef _Fp4Job *job = <_Fp4Job *>ctx
    cdef Py_ssize_t K = job.K
    if job.kind != 0:
        rotate256(x, job.buf, K // 256)
        if pkv_first_nonfinite(job.buf, K) >= 0:
            return False
    else:
        memcpy(job.buf, x, K * sizeof(float))
    return pkv_fp4_encode_row(job.buf, <uint32_t>K, job.flags, job.kind == 2,
                              &job.out[r * job.B]) == PKV_ENCODE_OK


def encode(const float[::1] x, uint8_t[::1] out, Py_ssize_t K, int kind):
    """Encode rows of ``K`` weights. Returns -1; the index of the first NaN/Inf in ``x``; or
    ``-2 - r`` when row ``r``'s scale does not fit an f16 (max|x|/6 beyond 65504) or its
    rotation overflows (``out`` is then unspecified)."""
    _check(x.shape[0], K, kind)
    cdef Py_ssize_t n_rows = x.shape[0] // K, bad
    cdef Py_ssize_t B = row_bytes(K)
    cdef _Fp4Job job
    if out.shape[0] != n_rows * B:
        raise InvalidArgument(f"out has {out.shape[0]} bytes, the encoding needs {n_rows * B}")
    job.buf = <float *>malloc(K * sizeof(float))
    if job.buf == NULL:
        raise MemoryError()
    job.out = &out[0]
    job.K = K
    job.B = B
    job.flags = PKV_FP4_FLAGS_ROTATED if kind != 0 else PKV_FP4_FLAGS_PLAIN
    job.kind = kind
    try:
        with nogil:
            bad = encode_groups(&x[0], x.shape[0], K, _encode_fp4_row, &job)
    finally:
        free(job.buf)
    return bad


cdef struct _DecodeJob:
    const uint8_t *raw
    float *out
    Py_ssize_t K, B
    bint e4m3, unrotate


cdef void _decode_span(void *ctx, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """Rows [r0, r1), already validated."""
    cdef _DecodeJob *job = <_DecodeJob *>ctx
    cdef Py_ssize_t r, K = job.K
    for r in range(r0, r1):
        pkv_fp4_decode_row(&job.raw[r * job.B], <uint32_t>K, job.e4m3, &job.out[r * K])
        if job.unrotate:
            unrotate256(&job.out[r * K], &job.out[r * K], K // 256)


def decode(const uint8_t[::1] raw, float[::1] out, Py_ssize_t K, int kind,
           bint rotated_basis=False, int threads=1):
    """Decode ``len(out)`` weights (rows of ``K``); the rotated kinds are un-rotated per
    256-segment unless ``rotated_basis``; the rows split over ``threads`` threads (same
    bits for any count). A row whose header does not say K/32 blocks and
    this kind's flags, or a UE8M0 block byte of 255 (reserved), raises
    :class:`~pagedkv.errors.CorruptPayload` before anything is written."""
    _check(out.shape[0], K, kind)
    cdef Py_ssize_t n_rows = out.shape[0] // K, r, b, bad_row = -1
    cdef Py_ssize_t B = row_bytes(K)
    cdef uint32_t flags = PKV_FP4_FLAGS_PLAIN if kind == 0 else PKV_FP4_FLAGS_ROTATED
    cdef uint32_t blocks
    cdef int why = 0
    cdef _DecodeJob job
    check_thread_count(threads)
    if raw.shape[0] != n_rows * B:
        raise SizeMismatch(f"raw has {raw.shape[0]} bytes, {n_rows} rows of K = {K} need "
                           f"{n_rows * B} (16 + 17*K/32 per row)")
    with nogil:
        for r in range(n_rows):
            blocks = raw[r * B + 4] | (<uint32_t>raw[r * B + 5] << 8)
            if blocks != <uint32_t>(K // 32):
                bad_row, why = r, 1
                break
            if raw[r * B + 6] != flags:
                bad_row, why = r, 2
                break
            if kind != 2:
                for b in range(K // 32):
                    if raw[r * B + 16 + 17 * b] == PKV_FP4_UE8M0_RESERVED:
                        bad_row, why = r, 3
                        break
                if bad_row >= 0:
                    break
    if bad_row >= 0:
        row = bytes(raw[bad_row * B:bad_row * B + 16])
        reason = {1: f"its header says {row[4] | row[5] << 8} blocks, K = {K} needs {K // 32}",
                  2: f"its flags byte is 0x{row[6]:02x}, {KINDS[kind]} rows carry 0x{flags:02x}",
                  3: "a block scale byte is 255, the reserved UE8M0 value"}[why]
        raise CorruptPayload(f"{KINDS[kind]} row {bad_row} is corrupt: {reason} (header "
                             f"{row.hex(' ')})")
    if n_rows == 0:
        return
    job.raw = &raw[0]
    job.out = &out[0]
    job.K = K
    job.B = B
    job.e4m3 = kind == 2
    job.unrotate = kind != 0 and not rotated_basis
    with nogil:
        decode_spans(_decode_span, &job, n_rows, K, threads)
