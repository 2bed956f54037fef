# The one threaded loop of the weight decoders (affine, q8, legacy, codebook,
# gaussian_codebook, fp4, ternary, half): a decode of `units` whole units (groups, rows or
# elements, the format's choice) cut into spans on the process's worker pool
# (cpu_pool.h). Every unit is decoded by exactly one span, with the same arithmetic
# whichever thread runs it, so the bits do not depend on the thread count. Inline, so each
# module's copy calls its own span decoder.
from pagedkv.quant.cpu_pool cimport job_parts, pool_run

# Decode units [u0, u1) of the format's job ctx (raw bytes in, floats out).
ctypedef void (*span_decoder)(void *ctx, Py_ssize_t u0, Py_ssize_t u1) noexcept nogil


cdef struct SpanJob:
    span_decoder decode
    void *ctx
    Py_ssize_t units


cdef inline void _decode_span_part(void *job, int part, int n_parts) noexcept nogil:
    cdef SpanJob *j = <SpanJob *>job
    j.decode(j.ctx, j.units * part // n_parts, j.units * (part + 1) // n_parts)


# Decode units [0, units) on up to `threads` threads, in parts of at least
# `units_per_part` units (less work than ~64 KiB of floats per part costs more in the
# wake-up than it saves); returns when every unit is decoded.
cdef inline void decode_spans(span_decoder decode, void *ctx, Py_ssize_t units,
                              Py_ssize_t units_per_part, int threads) noexcept nogil:
    cdef SpanJob job
    if units <= 0:
        return
    job.decode = decode
    job.ctx = ctx
    job.units = units
    pool_run(_decode_span_part, &job, job_parts(units // max(units_per_part, 1), threads),
             threads)
