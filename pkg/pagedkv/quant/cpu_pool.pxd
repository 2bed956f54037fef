# The process-wide worker pool of the CPU loops (cpu_pool.h): a job's parts are claimed
# one at a time by the caller and up to threads - 1 pool workers; a busy pool runs the
# job on the caller alone.

ctypedef void (*pool_fn)(void *ctx, int part, int n_parts) noexcept nogil

# Call fn(ctx, p, n_parts) once for every p in [0, n_parts), on up to n_threads threads;
# returns when all have finished.
cdef void pool_run(pool_fn fn, void *ctx, int n_parts, int n_threads) noexcept nogil

# How many parts to cut a job of `units` (tiles, groups, rows) into for `threads`
# threads: a few per thread, so a thread that starts late takes fewer, never more
# parts than units.
cdef int job_parts(Py_ssize_t units, int threads) noexcept nogil

# Raise InvalidArgument unless threads >= 1 (the decoders' check, before anything is
# written).
cdef int check_thread_count(int threads) except -1
