# cython: freethreading_compatible = True
"""The legacy weight codecs: Q4F16G64 (qt 0) and Q4K (qt 4 = GGML Q4_K), encode and
decode. docs/formats/quant.md, "Q4F16G64" and "Q4K".

Flat in, flat out: groups of 64 (Q4F16G64, may straddle rows, the short last one padded)
or 256 (Q4K) weights. The Q4K encoder takes whole super-blocks only (ggml's rows are).
"""

cimport numpy as cnp
from libc.stdint cimport uint8_t
from libc.string cimport memcpy

from pagedkv.quant.group_encode_loop cimport encode_groups
from pagedkv.quant.cpu_pool cimport check_thread_count
from pagedkv.quant.span_decode_loop cimport decode_spans
from pagedkv.quant.quant_header cimport (
    PKV_ENCODE_OK, pkv_q4f16g64_decode_group, pkv_q4f16g64_encode_group, pkv_q4k_decode_group,
)

cnp.import_array()

from pagedkv.errors import InvalidArgument, SizeMismatch


cdef extern from "q4k_loops.h" nogil:
    int pkv_q4k_encode_group(const float *x, uint8_t *blk)

cdef enum:
    Q4F16G64_GROUP = 64
    Q4F16G64_BYTES = 36
    Q4K_GROUP = 256
    Q4K_BYTES = 144


cdef bint _encode_q4f16g64_group(const float *x, Py_ssize_t count, Py_ssize_t g,
                                 void *out) noexcept nogil:
    return pkv_q4f16g64_encode_group(x, <unsigned>count,
                                     &(<uint8_t *>out)[g * Q4F16G64_BYTES]) == PKV_ENCODE_OK


def q4f16g64_encode(const float[::1] x, uint8_t[::1] out):
    """Encode ``x`` into ``ceil(len(x)/64) * 36`` bytes. Returns -1; the index of the first
    NaN/Inf; or ``-2 - g`` when group ``g``'s f16 scale or minimum saturates."""
    cdef Py_ssize_t n = x.shape[0], bad
    cdef Py_ssize_t n_groups = (n + Q4F16G64_GROUP - 1) // Q4F16G64_GROUP
    if out.shape[0] != n_groups * Q4F16G64_BYTES:
        raise InvalidArgument(f"out has {out.shape[0]} bytes, the encoding needs "
                              f"{n_groups * Q4F16G64_BYTES}")
    with nogil:
        bad = encode_groups(&x[0], n, Q4F16G64_GROUP, _encode_q4f16g64_group, &out[0])
    return bad


cdef bint _encode_q4k_group(const float *x, Py_ssize_t count, Py_ssize_t g,
                            void *out) noexcept nogil:
    return pkv_q4k_encode_group(x, &(<uint8_t *>out)[g * Q4K_BYTES]) == PKV_ENCODE_OK


def q4k_encode(const float[::1] x, uint8_t[::1] out):
    """Encode ``x`` (a multiple of 256 weights) into ``len(x)/256 * 144`` bytes of GGML
    Q4_K super-blocks, byte for byte ggml's ``quantize_row_q4_K_ref``. Returns -1; the
    index of the first NaN/Inf; or ``-2 - g`` when super-block ``g``'s f16 d or dmin
    saturates."""
    cdef Py_ssize_t n = x.shape[0], bad
    if n % Q4K_GROUP:
        raise InvalidArgument(f"q4k encodes whole super-blocks of {Q4K_GROUP} weights, got {n}")
    if out.shape[0] != n // Q4K_GROUP * Q4K_BYTES:
        raise InvalidArgument(f"out has {out.shape[0]} bytes, the encoding needs "
                              f"{n // Q4K_GROUP * Q4K_BYTES}")
    if n == 0:
        return -1
    with nogil:
        bad = encode_groups(&x[0], n, Q4K_GROUP, _encode_q4k_group, &out[0])
    return bad


ctypedef void (*_group_decoder)(const uint8_t *blk, float *out) noexcept nogil


cdef struct _DecodeJob:
    const uint8_t *raw
    float *out
    Py_ssize_t G, B
    _group_decoder decode_group


cdef void _decode_span(void *ctx, Py_ssize_t g0, Py_ssize_t g1) noexcept nogil:
    """Whole groups [g0, g1), straight into the output."""
    cdef _DecodeJob *job = <_DecodeJob *>ctx
    cdef Py_ssize_t g
    for g in range(g0, g1):
        job.decode_group(&job.raw[g * job.B], &job.out[g * job.G])


cdef int _decode_groups(const uint8_t[::1] raw, float[::1] out, Py_ssize_t G, Py_ssize_t B,
                        _group_decoder decode_group, int threads) except -1:
    """``len(out)`` weights from ``ceil(len(out)/G) * B`` bytes, the whole groups split over
    ``threads`` threads (the short last group decoded into scratch and cut)."""
    cdef Py_ssize_t n = out.shape[0], n_whole = n // G
    cdef Py_ssize_t n_groups = (n + G - 1) // G
    cdef float buf[Q4K_GROUP]
    cdef _DecodeJob job
    if raw.shape[0] != n_groups * B:
        raise SizeMismatch(f"raw has {raw.shape[0]} bytes, {n} weights need {n_groups * B}")
    check_thread_count(threads)
    if n == 0:
        return 0
    job.raw = &raw[0]
    job.out = &out[0]
    job.G = G
    job.B = B
    job.decode_group = decode_group
    with nogil:
        decode_spans(_decode_span, &job, n_whole, G, threads)
        if n_whole < n_groups:
            decode_group(&raw[n_whole * B], buf)
            memcpy(&out[n_whole * G], buf, (n - n_whole * G) * sizeof(float))
    return 0


def q4f16g64_decode(const uint8_t[::1] raw, float[::1] out, int threads=1):
    """Decode ``len(out)`` weights from ``ceil(len(out)/64) * 36`` bytes on ``threads``
    threads (same bits for any count)."""
    _decode_groups(raw, out, Q4F16G64_GROUP, Q4F16G64_BYTES, pkv_q4f16g64_decode_group, threads)


def q4k_decode(const uint8_t[::1] raw, float[::1] out, int threads=1):
    """Decode ``len(out)`` weights from ``ceil(len(out)/256) * 144`` bytes of GGML Q4_K
    super-blocks (bit for bit ggml's ``dequantize_row_q4_K``) on ``threads`` threads."""
    _decode_groups(raw, out, Q4K_GROUP, Q4K_BYTES, pkv_q4k_decode_group, threads)
