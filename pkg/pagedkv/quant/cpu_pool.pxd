# The process-wide worker pool of the CPU loops (cpu_pool.h): part 0 of a job on the
# caller, the others on pool workers; a busy pool runs the job on the caller alone.

ctypedef void (*pool_fn)(void *ctx, int part, int n_parts) noexcept nogil

# Call fn(ctx, p, n_parts) for every p in [0, n_parts); returns when all have finished.
cdef void pool_run(pool_fn fn, void *ctx, int n_parts) noexcept nogil
