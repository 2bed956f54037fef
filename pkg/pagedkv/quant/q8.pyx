# cython: freethreading_compatible = True
"""Q8F16 (qt 3, docs/contracts/hfqm-and-quant.md, '4.5 Q8F16 (qt 3)'): per 32 weights,
``f16_trunc(amax/127)`` then 32
int8 codes rounded half away from zero with the f32 scale. GGML Q8_0 layout.
The tensor is flattened; blocks may straddle rows and the last one is zero-padded."""

cimport numpy as cnp
from libc.stdint cimport uint8_t
from libc.string cimport memcpy

from pagedkv.quant.cpu_pool cimport pool_run
from pagedkv.quant.quant_header cimport (
    PKV_ENCODE_OK, pkv_first_nonfinite, pkv_q8f16_decode_group, pkv_q8f16_encode_group,
)

cnp.import_array()

from pagedkv.errors import InvalidArgument, SizeMismatch

cdef extern from "pagedkv/quant.h":
    enum:
        BLOCK "PKV_Q8F16_GROUP"              # weights per block
        BLOCK_BYTES "PKV_Q8F16_GROUP_BYTES"  # f16 scale + BLOCK int8


def encode(const float[::1] x, uint8_t[::1] out):
    """Encode ``x`` into ``out`` (``ceil(len(x)/32) * 34`` bytes). Returns -1; ``i >= 0``,
    the index of the first NaN/Inf in ``x``; or ``-2 - g`` when block ``g``'s scale
    ``max|x|/127`` does not fit an f16 (beyond 65504)."""
    cdef Py_ssize_t n = x.shape[0], g, start, count, bad = -1
    cdef Py_ssize_t n_blocks = (n + BLOCK - 1) // BLOCK
    if out.shape[0] != n_blocks * BLOCK_BYTES:
        raise InvalidArgument(f"out has {out.shape[0]} bytes, the encoding needs "
                              f"{n_blocks * BLOCK_BYTES}")
    with nogil:
        for g in range(n_blocks):
            start = g * BLOCK
            count = min(BLOCK, n - start)
            bad = pkv_first_nonfinite(&x[start], count)
            if bad >= 0:
                bad += start
                break
            if pkv_q8f16_encode_group(&x[start], <unsigned>count,
                                      &out[g * BLOCK_BYTES]) != PKV_ENCODE_OK:
                bad = -2 - g
                break
    return bad


cdef extern from "raw_decode_loops.h" nogil:
    void pkv_cpu_q8f16_decode_blocks(const uint8_t *raw, Py_ssize_t n_blocks, float *out)


cdef struct _DecodeJob:
    const uint8_t *raw
    float *out
    Py_ssize_t n_whole


cdef void _decode_part(void *ctx, int part, int n_parts) noexcept nogil:
    cdef _DecodeJob *job = <_DecodeJob *>ctx
    cdef Py_ssize_t g0 = job.n_whole * part // n_parts, g1 = job.n_whole * (part + 1) // n_parts
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
    if threads < 1:
        raise InvalidArgument(f"threads = {threads}: pass 1 or more")
    if n == 0:
        return
    job.raw = &raw[0]
    job.out = &out[0]
    job.n_whole = n_whole
    with nogil:
        if n_whole > 0:
            # at least 2048 blocks (256 KiB of floats) per thread
            pool_run(_decode_part, &job, max(1, min(threads, n_whole // 2048)))
        if n_whole < n_blocks:              # the zero-padded last block
            pkv_q8f16_decode_group(&raw[n_whole * BLOCK_BYTES], buf)
            memcpy(&out[n_whole * BLOCK], buf, (n - n_whole * BLOCK) * sizeof(float))
