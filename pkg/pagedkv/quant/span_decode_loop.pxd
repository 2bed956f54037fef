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


cdef enum:
    # Fewest floats a part writes: less work (64 KiB of output) costs more in a worker's
    # wake-up than it saves, so a small tensor runs on fewer threads than asked.
    SPAN_PART_MIN_VALUES = 16384


# Decode units [0, units) of `values_per_unit` floats each on up to `threads` threads, in
# parts of at least SPAN_PART_MIN_VALUES floats (or one unit); returns when every unit is
# decoded.
cdef inline void decode_spans(span_decoder decode, void *ctx, Py_ssize_t units,
                              Py_ssize_t values_per_unit, int threads) noexcept nogil:
    cdef SpanJob job
    cdef Py_ssize_t units_per_part = max(SPAN_PART_MIN_VALUES // max(values_per_unit, 1), 1)
    if units <= 0:
        return
    job.decode = decode
    job.ctx = ctx
    job.units = units
    pool_run(_decode_span_part, &job, job_parts(units // units_per_part, threads), threads)
