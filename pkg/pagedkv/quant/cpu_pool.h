/* A process-wide pool of worker threads for the CPU loops (GEMV, dequantize).
 *
 * pkv_pool_run(fn, ctx, n) calls fn(ctx, p, n) for every part p in [0, n): part 0
 * on the calling thread, parts 1.. on pool workers, and returns when all have
 * finished. Workers start on first use and then sleep on a condition variable
 * between jobs (a few microseconds to wake). One job runs at a time: a caller
 * that finds the pool busy (another thread's job) runs all its parts itself, so
 * concurrent callers never wait on each other and results never depend on who
 * ran a part. After fork() the child starts with an empty pool.
 *
 * Only cpu_pool.pyx includes this file; other modules call it through
 * pagedkv.quant.cpu_pool (a cimport), so the process has one pool.
 */
#ifndef PAGEDKV_QUANT_CPU_POOL_H
#define PAGEDKV_QUANT_CPU_POOL_H

#include <pthread.h>
#include <stddef.h>

#define PKV_POOL_MAX_THREADS 64

typedef void (*pkv_pool_fn)(void *ctx, int part, int n_parts);

static struct {
    pthread_mutex_t job_lock;       /* held by the caller for the whole job */
    pthread_mutex_t lock;           /* guards the fields below */
    pthread_cond_t wake;            /* a new generation */
    pthread_cond_t done;            /* remaining reached 0 */
    int n_workers;
    unsigned long generation;
    int remaining;
    pkv_pool_fn fn;
    void *ctx;
    int n_parts;
    int atfork_registered;
    unsigned long start_generation[PKV_POOL_MAX_THREADS];  /* as each worker was created */
} pkv_pool = {
    PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
    PTHREAD_COND_INITIALIZER, 0, 0ul, 0, NULL, NULL, 0, 0, {0ul},
};

static void pkv_pool_after_fork_child(void) {
    /* the child has no workers, whatever the parent had, and no lock is held */
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    pkv_pool.job_lock = m;
    pkv_pool.lock = m;
    pkv_pool.wake = c;
    pkv_pool.done = c;
    pkv_pool.n_workers = 0;
    pkv_pool.remaining = 0;
}

static void *pkv_pool_worker(void *arg) {
    const int part = (int)(ptrdiff_t)arg;       /* worker i runs part i + 1 */
    pthread_mutex_lock(&pkv_pool.lock);
    /* the generation when it was created, not now: the job that created it may
     * already have been posted by the time this thread runs */
    unsigned long seen = pkv_pool.start_generation[part];
    for (;;) {
        while (pkv_pool.generation == seen) pthread_cond_wait(&pkv_pool.wake, &pkv_pool.lock);
        seen = pkv_pool.generation;
        if (part < pkv_pool.n_parts) {
            pkv_pool_fn fn = pkv_pool.fn;
            void *ctx = pkv_pool.ctx;
            int n = pkv_pool.n_parts;
            pthread_mutex_unlock(&pkv_pool.lock);
            fn(ctx, part, n);
            pthread_mutex_lock(&pkv_pool.lock);
            if (--pkv_pool.remaining == 0) pthread_cond_signal(&pkv_pool.done);
        }
    }
    return NULL;
}

/* Start workers until n_parts - 1 exist (under job_lock). Returns how many parts the
 * pool can run now (fewer if a thread could not be created). */
static int pkv_pool_grow(int n_parts) {
    if (!pkv_pool.atfork_registered) {
        pthread_atfork(NULL, NULL, pkv_pool_after_fork_child);
        pkv_pool.atfork_registered = 1;
    }
    while (pkv_pool.n_workers < n_parts - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pkv_pool.start_generation[pkv_pool.n_workers + 1] = pkv_pool.generation;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &attr, pkv_pool_worker, (void *)(ptrdiff_t)(pkv_pool.n_workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pkv_pool.n_workers++;
    }
    return pkv_pool.n_workers + 1 < n_parts ? pkv_pool.n_workers + 1 : n_parts;
}

/* Run fn(ctx, p, n_parts) for p in [0, n_parts) (n_parts is capped at
 * PKV_POOL_MAX_THREADS); see the file comment. */
static void pkv_pool_run(pkv_pool_fn fn, void *ctx, int n_parts) {
    if (n_parts > PKV_POOL_MAX_THREADS) n_parts = PKV_POOL_MAX_THREADS;
    if (n_parts <= 1 || pthread_mutex_trylock(&pkv_pool.job_lock) != 0) {
        for (int p = 0; p < (n_parts < 1 ? 1 : n_parts); ++p) fn(ctx, p, n_parts < 1 ? 1 : n_parts);
        return;
    }
    int pooled = pkv_pool_grow(n_parts);
    pthread_mutex_lock(&pkv_pool.lock);
    pkv_pool.fn = fn;
    pkv_pool.ctx = ctx;
    pkv_pool.n_parts = n_parts;
    pkv_pool.remaining = pooled - 1;
    pkv_pool.generation++;
    pthread_cond_broadcast(&pkv_pool.wake);
    pthread_mutex_unlock(&pkv_pool.lock);
    fn(ctx, 0, n_parts);
    for (int p = pooled; p < n_parts; ++p) fn(ctx, p, n_parts);   /* parts no worker took */
    pthread_mutex_lock(&pkv_pool.lock);
    while (pkv_pool.remaining > 0) pthread_cond_wait(&pkv_pool.done, &pkv_pool.lock);
    pthread_mutex_unlock(&pkv_pool.lock);
    pthread_mutex_unlock(&pkv_pool.job_lock);
}

#endif /* PAGEDKV_QUANT_CPU_POOL_H */
