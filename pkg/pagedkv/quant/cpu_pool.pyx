# cython: freethreading_compatible = True
"""The worker pool behind ``threads=`` of the CPU GEMV and dequantize (``cpu_pool.h``).

One pool per process, started on first use: a job's parts are claimed one at a time by
the calling thread and up to 63 workers, which spin for ``spin_us()`` microseconds after
a job before they sleep. Results never depend on which thread ran a part (each part
owns a fixed slice of the output). ``PAGEDKV_CPU_SPIN_US`` sets the spin at import.
"""

from libc.stdint cimport int32_t
from libc.stdlib cimport free, malloc

from pagedkv import env_knobs
from pagedkv.errors import InvalidArgument

cdef extern from "cpu_pool.h" nogil:
    const int PKV_POOL_MAX_THREADS
    const unsigned PKV_POOL_SPIN_US_DEFAULT
    const int PKV_POOL_PARTS_PER_THREAD
    ctypedef void (*pkv_pool_fn)(void *ctx, int part, int n_parts) noexcept nogil
    void pkv_pool_run(pkv_pool_fn fn, void *ctx, int n_parts, int n_threads)
    void pkv_pool_set_spin_us(unsigned spin_us)
    unsigned pkv_pool_get_spin_us()

#: Most threads one job runs on.
MAX_THREADS = PKV_POOL_MAX_THREADS
#: Parts per thread that ``job_parts`` aims at.
PARTS_PER_THREAD = PKV_POOL_PARTS_PER_THREAD
#: Workers' spin before they sleep, microseconds, unless ``PAGEDKV_CPU_SPIN_US`` says.
SPIN_US_DEFAULT = PKV_POOL_SPIN_US_DEFAULT


cdef void pool_run(pool_fn fn, void *ctx, int n_parts, int n_threads) noexcept nogil:
    pkv_pool_run(<pkv_pool_fn>fn, ctx, n_parts, n_threads)


cdef int job_parts(Py_ssize_t units, int threads) noexcept nogil:
    cdef Py_ssize_t parts = <Py_ssize_t>threads * PKV_POOL_PARTS_PER_THREAD if threads > 1 else 1
    if parts > units:
        parts = units
    return <int>parts if parts > 1 else 1


cdef int check_thread_count(int threads) except -1:
    if threads < 1:
        raise InvalidArgument(f"threads = {threads}: pass 1 or more")
    return 0


def spin_us():
    """Microseconds a worker spins for the next job before it sleeps (``int``)."""
    return pkv_pool_get_spin_us()


def set_spin_us(spin_us):
    """Set how long workers spin between jobs, in microseconds (0: sleep at once). A
    longer spin starts back-to-back jobs faster and burns that much CPU per worker
    after the last one."""
    if (not isinstance(spin_us, int) or isinstance(spin_us, bool)
            or not 0 <= spin_us <= env_knobs.U32_MAX):
        raise InvalidArgument(f"spin_us = {spin_us!r}: pass an int of microseconds, "
                              f"0 to {env_knobs.U32_MAX}")
    pkv_pool_set_spin_us(<unsigned>spin_us)


set_spin_us(env_knobs.env_u32("PAGEDKV_CPU_SPIN_US", SPIN_US_DEFAULT))


cdef void _record_part(void *ctx, int part, int n_parts) noexcept nogil:
    cdef int32_t *seen = <int32_t *>ctx
    seen[2 * part] += 1
    seen[2 * part + 1] = n_parts


def run_parts(int n_parts, threads=None):
    """Run a job of ``n_parts`` parts on ``threads`` threads (default: one per part, at
    most ``MAX_THREADS``) that records itself; returns, per part, how many times it ran
    and the part count it was given (``list[tuple[int, int]]``)."""
    cdef int n_threads = min(n_parts, PKV_POOL_MAX_THREADS) if threads is None else threads
    if n_parts < 1:
        raise InvalidArgument(f"n_parts = {n_parts}: pass 1 or more")
    if n_threads < 1 or n_threads > PKV_POOL_MAX_THREADS:
        raise InvalidArgument(f"threads = {n_threads}: valid 1 to {PKV_POOL_MAX_THREADS}")
    cdef int32_t *seen = <int32_t *>malloc(2 * n_parts * sizeof(int32_t))
    cdef int i
    if seen == NULL:
        raise MemoryError()
    try:
        for i in range(2 * n_parts):
            seen[i] = 0
        with nogil:
            pool_run(_record_part, seen, n_parts, n_threads)
        return [(seen[2 * i], seen[2 * i + 1]) for i in range(n_parts)]
    finally:
        free(seen)
