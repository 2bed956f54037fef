# cython: freethreading_compatible = True
"""The worker pool behind ``threads=`` of the CPU GEMV and dequantize (``cpu_pool.h``).

One pool per process, started on first use: a job of ``n`` parts runs part 0 on the
calling thread and parts 1.. on up to 63 sleeping workers. Results never depend on
which thread ran a part (each part owns a fixed slice of the output).
"""

from libc.stdint cimport int32_t
from libc.stdlib cimport free, malloc

from pagedkv.errors import InvalidArgument

cdef extern from "cpu_pool.h" nogil:
    const int PKV_POOL_MAX_THREADS
    ctypedef void (*pkv_pool_fn)(void *ctx, int part, int n_parts) noexcept nogil
    void pkv_pool_run(pkv_pool_fn fn, void *ctx, int n_parts)

#: Most parts (threads) one job runs on.
MAX_THREADS = PKV_POOL_MAX_THREADS


cdef void pool_run(pool_fn fn, void *ctx, int n_parts) noexcept nogil:
    pkv_pool_run(<pkv_pool_fn>fn, ctx, n_parts)


cdef void _record_part(void *ctx, int part, int n_parts) noexcept nogil:
    cdef int32_t *seen = <int32_t *>ctx
    seen[part] += 1
    seen[PKV_POOL_MAX_THREADS + part] = n_parts


def run_parts(int n_parts):
    """Run a job of ``n_parts`` parts that records itself; returns, per part, how many
    times it ran and the part count it was given (``list[tuple[int, int]]``)."""
    if n_parts < 1 or n_parts > PKV_POOL_MAX_THREADS:
        raise InvalidArgument(f"n_parts = {n_parts}: valid 1 to {PKV_POOL_MAX_THREADS}")
    cdef int32_t *seen = <int32_t *>malloc(2 * PKV_POOL_MAX_THREADS * sizeof(int32_t))
    cdef int i
    if seen == NULL:
        raise MemoryError()
    try:
        for i in range(2 * PKV_POOL_MAX_THREADS):
            seen[i] = 0
        with nogil:
            pool_run(_record_part, seen, n_parts)
        return [(seen[i], seen[PKV_POOL_MAX_THREADS + i]) for i in range(n_parts)]
    finally:
        free(seen)
