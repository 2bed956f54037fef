# cython: freethreading_compatible = True
"""Raw half-precision conversions (docs/contracts/hfqm-and-quant.md, '3.2 f32 to f16 by truncation'
and '4.6 Raw types (qt 1, 2, 16, 22)').

``f16_trunc``: f32 -> f16 by truncation toward zero, hipfire's conversion for F16
tensors from F32/BF16 sources (NOT numpy's round-to-nearest ``astype``).
``f16_rne``: round to nearest even (codebooks, KV cache). ``bf16_trunc``: f32 -> bf16
keeping the top 16 bits. Widening (``f16_to_f32``, ``bf16_to_f32``) is exact.
Half values travel as uint16 bit patterns.
"""

cimport numpy as cnp
from libc.stdint cimport uint16_t

from pagedkv.quant.quant_header cimport pkv_bf16_trunc, pkv_f16_rne, pkv_f16_trunc
from pagedkv.quant.cpu_pool cimport check_thread_count
from pagedkv.quant.span_decode_loop cimport decode_spans

cnp.import_array()

from pagedkv.errors import InvalidArgument


cdef inline int _check_aligned(const void *p, Py_ssize_t n, size_t align, str name) except -1:
    # A typed memoryview accepts any buffer, aligned or not; reading uint16/float through a
    # misaligned pointer is undefined behaviour in C (UBSan reports it, and vectorized loops
    # may use aligned loads), so a view at an odd file offset is refused here and callers
    # copy it (pagedkv.quant.dequantize does).
    if n and (<size_t>p) % align:
        raise InvalidArgument(f"{name} is not {align}-byte aligned; pass an aligned copy "
                              "(np.require(a, requirements=['C', 'A']))")
    return 0


cdef int _check_narrowing(const float[::1] x, uint16_t[::1] out) except -1:
    """f32 ``x`` -> 16-bit ``out``: as many elements, each aligned."""
    cdef Py_ssize_t n = x.shape[0]
    if out.shape[0] != n:
        raise InvalidArgument(f"out has {out.shape[0]} elements, x has {n}")
    _check_aligned(&x[0] if n else NULL, n, 4, "x")
    _check_aligned(&out[0] if n else NULL, n, 2, "out")
    return 0


cdef int _check_widening(const uint16_t[::1] h, float[::1] out) except -1:
    """16-bit ``h`` -> f32 ``out``: as many elements, each aligned."""
    cdef Py_ssize_t n = h.shape[0]
    if out.shape[0] != n:
        raise InvalidArgument(f"out has {out.shape[0]} elements, h has {n}")
    _check_aligned(&h[0] if n else NULL, n, 2, "h")
    _check_aligned(&out[0] if n else NULL, n, 4, "out")
    return 0


def f16_trunc(const float[::1] x, uint16_t[::1] out):
    cdef Py_ssize_t i, n = x.shape[0]
    _check_narrowing(x, out)
    with nogil:
        for i in range(n):
            out[i] = <uint16_t>pkv_f16_trunc(x[i])


def f16_rne(const float[::1] x, uint16_t[::1] out):
    cdef Py_ssize_t i, n = x.shape[0]
    _check_narrowing(x, out)
    with nogil:
        for i in range(n):
            out[i] = <uint16_t>pkv_f16_rne(x[i])


def bf16_trunc(const float[::1] x, uint16_t[::1] out):
    cdef Py_ssize_t i, n = x.shape[0]
    _check_narrowing(x, out)
    with nogil:
        for i in range(n):
            out[i] = <uint16_t>pkv_bf16_trunc(x[i])


cdef extern from "raw_decode_loops.h" nogil:
    void pkv_cpu_f16_to_f32(const uint16_t *h, Py_ssize_t n, float *out)
    void pkv_cpu_bf16_to_f32(const uint16_t *h, Py_ssize_t n, float *out)


cdef struct _WidenJob:
    const uint16_t *h
    float *out
    bint bf16


cdef void _widen_span(void *ctx, Py_ssize_t i0, Py_ssize_t i1) noexcept nogil:
    cdef _WidenJob *job = <_WidenJob *>ctx
    if job.bf16:
        pkv_cpu_bf16_to_f32(&job.h[i0], i1 - i0, &job.out[i0])
    else:
        pkv_cpu_f16_to_f32(&job.h[i0], i1 - i0, &job.out[i0])


cdef int _widen(const uint16_t[::1] h, float[::1] out, bint bf16, int threads) except -1:
    cdef Py_ssize_t n = h.shape[0]
    cdef _WidenJob job
    _check_widening(h, out)
    check_thread_count(threads)
    if n:
        job.h = &h[0]
        job.out = &out[0]
        job.bf16 = bf16
        with nogil:
            decode_spans(_widen_span, &job, n, 1, threads)
    return 0


def f16_to_f32(const uint16_t[::1] h, float[::1] out, int threads=1):
    """Widen f16 bit patterns to f32 (exact), split over ``threads`` threads."""
    _widen(h, out, False, threads)


def bf16_to_f32(const uint16_t[::1] h, float[::1] out, int threads=1):
    """Widen bf16 bit patterns to f32 (exact), split over ``threads`` threads."""
    _widen(h, out, True, threads)
