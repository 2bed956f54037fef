/* A process-wide pool of worker threads for the CPU loops (GEMV, dequantize).
 *
 * pkv_pool_run(fn, ctx, n_parts, n_threads) calls fn(ctx, p, n_parts) once for every
 * part p in [0, n_parts), on the calling thread and up to n_threads - 1 pool workers,
 * and returns when all have finished. Parts are claimed one at a time from a shared
 * counter, so a thread that starts late (a worker still waking, a vCPU the hypervisor
 * descheduled) takes fewer parts instead of holding up the job: callers cut a job into
 * a few parts per thread. Results never depend on which thread ran a part.
 *
 * Between jobs a worker spins for spin_us microseconds (pkv_pool_set_spin_us; the
 * pause instruction, no syscalls), then sleeps on a condition variable; a caller that
 * has run out of parts waits for the others' the same way. A back-to-back
 * job (a model's GEMVs one after another) finds its workers spinning and starts them
 * in well under a microsecond; waking a sleeping one is a futex call, tens of
 * microseconds on a VM, which is what a 0.3 ms GEMV on two threads could not afford.
 *
 * One job runs at a time: a caller that finds the pool busy (another thread's job)
 * runs all its parts itself, so concurrent callers never wait on each other. After
 * fork() the child starts with an empty pool.
 *
 * Only cpu_pool.pyx includes this file; other modules call it through
 * pagedkv.quant.cpu_pool (a cimport), so the process has one pool.
 */
#ifndef PAGEDKV_QUANT_CPU_POOL_H
#define PAGEDKV_QUANT_CPU_POOL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#define PKV_POOL_MAX_THREADS 64
#define PKV_POOL_MAX_PARTS 65535    /* the ticket's 16-bit part count */
#define PKV_POOL_SPIN_US_DEFAULT 200u
#define PKV_POOL_PARTS_PER_THREAD 8   /* what callers cut a job into (cpu_pool.pyx's job_parts) */

typedef void (*pkv_pool_fn)(void *ctx, int part, int n_parts);

static struct {
    pthread_mutex_t job_lock;       /* held by the caller for the whole job */
    pthread_mutex_t lock;           /* with wake and done: threads going to sleep */
    pthread_cond_t wake;            /* a new generation */
    pthread_cond_t done;            /* the last part of a job finished */
    /* the job's ticket: generation << 32 | part count << 16 | next unclaimed part. The
     * fields below it are written before a new generation is published (release) and
     * read after it is seen (acquire). A part claimed by compare-and-swap on a ticket
     * whose next part is below its own count proves they were that generation's: the
     * job cannot end, nor the next caller write them, while a part is unclaimed. (The
     * count lives in the ticket, not in a field, for that reason: a field could already
     * hold the next job's count while the ticket still shows the finished job.) */
    uint64_t ticket;
    pkv_pool_fn fn;
    void *ctx;
    int n_threads;
    int parts_done;
    unsigned spin_us;
    int n_workers;
    int atfork_registered;
    uint32_t start_generation[PKV_POOL_MAX_THREADS];  /* as each worker was created */
} pkv_pool = {
    PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
    PTHREAD_COND_INITIALIZER, 0u, NULL, NULL, 0, 0, PKV_POOL_SPIN_US_DEFAULT, 0, 0, {0u},
};

#define PKV_LOAD(p, order) __atomic_load_n((p), __ATOMIC_##order)
#define PKV_STORE(p, v, order) __atomic_store_n((p), (v), __ATOMIC_##order)

static inline void pkv_pool_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline uint64_t pkv_pool_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint32_t pkv_pool_generation(void) {
    return (uint32_t)(PKV_LOAD(&pkv_pool.ticket, ACQUIRE) >> 32);
}

/* Spin (pause, no syscalls) until ready(arg) or spin_us have passed, then sleep on cv
 * until it holds. Whoever makes it hold broadcasts cv under pkv_pool.lock, so a check
 * made under the lock cannot miss the wake-up: the broadcast waits for cond_wait to
 * release the lock. Workers wait for a job this way, callers for their job's last part. */
static inline void pkv_pool_wait_(int (*ready)(const void *), const void *arg, pthread_cond_t *cv) {
    uint64_t deadline = 0;
    for (unsigned spins = 0; !ready(arg); ++spins) {
        if ((spins & 63u) != 0) {
            pkv_pool_pause();
            continue;
        }
        uint64_t now = pkv_pool_now_ns();
        if (deadline == 0) deadline = now + 1000u * (uint64_t)PKV_LOAD(&pkv_pool.spin_us, RELAXED);
        if (now < deadline) continue;
        pthread_mutex_lock(&pkv_pool.lock);
        while (!ready(arg)) pthread_cond_wait(cv, &pkv_pool.lock);
        pthread_mutex_unlock(&pkv_pool.lock);
    }
}

static int pkv_pool_new_generation_(const void *seen) {
    return pkv_pool_generation() != *(const uint32_t *)seen;
}

static int pkv_pool_all_done_(const void *n_parts) {
    return PKV_LOAD(&pkv_pool.parts_done, ACQUIRE) >= *(const int *)n_parts;
}

static void pkv_pool_after_fork_child(void) {
    /* the child has no workers, whatever the parent had, and no lock is held */
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    pkv_pool.job_lock = m;
    pkv_pool.lock = m;
    pkv_pool.wake = c;
    pkv_pool.done = c;
    pkv_pool.n_workers = 0;
}

/* Claim and run parts of generation g until none is left (thread = 0 is the caller,
 * worker i is thread i; a worker beyond the job's thread count takes none). */
static void pkv_pool_claim_parts(uint32_t g, int thread) {
    for (;;) {
        uint64_t t = PKV_LOAD(&pkv_pool.ticket, ACQUIRE);
        const uint32_t n_parts = (uint32_t)(t >> 16) & 0xFFFFu, part = (uint32_t)t & 0xFFFFu;
        if ((uint32_t)(t >> 32) != g || part >= n_parts) return;
        pkv_pool_fn fn = PKV_LOAD(&pkv_pool.fn, RELAXED);
        void *ctx = PKV_LOAD(&pkv_pool.ctx, RELAXED);
        if (thread >= PKV_LOAD(&pkv_pool.n_threads, RELAXED)) return;
        if (__atomic_compare_exchange_n(&pkv_pool.ticket, &t, t + 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            fn(ctx, (int)part, (int)n_parts);
            if (__atomic_add_fetch(&pkv_pool.parts_done, 1, __ATOMIC_ACQ_REL) == (int)n_parts) {
                /* the caller may be asleep on done (see pkv_pool_run) */
                pthread_mutex_lock(&pkv_pool.lock);
                pthread_cond_broadcast(&pkv_pool.done);
                pthread_mutex_unlock(&pkv_pool.lock);
            }
        }
    }
}

static void *pkv_pool_worker(void *arg) {
    const int thread = (int)(ptrdiff_t)arg;     /* worker i is thread i */
    /* the generation when it was created, not now: the job that created it may
     * already have been posted by the time this thread runs */
    uint32_t seen = PKV_LOAD(&pkv_pool.start_generation[thread], ACQUIRE);
    for (;;) {
        pkv_pool_wait_(pkv_pool_new_generation_, &seen, &pkv_pool.wake);
        seen = pkv_pool_generation();
        pkv_pool_claim_parts(seen, thread);
    }
    return NULL;
}

/* Start workers until n_threads - 1 exist (under job_lock). */
static void pkv_pool_grow(int n_threads) {
    if (!pkv_pool.atfork_registered) {
        pthread_atfork(NULL, NULL, pkv_pool_after_fork_child);
        pkv_pool.atfork_registered = 1;
    }
    while (pkv_pool.n_workers < n_threads - 1) {
        pthread_t th;
        pthread_attr_t attr;
        int thread = pkv_pool.n_workers + 1;
        PKV_STORE(&pkv_pool.start_generation[thread], pkv_pool_generation(), RELEASE);
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &attr, pkv_pool_worker, (void *)(ptrdiff_t)thread);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;         /* fewer threads: the caller claims what is left */
        pkv_pool.n_workers++;
    }
}

/* Run fn(ctx, p, n_parts) for p in [0, n_parts) on up to n_threads threads (capped
 * at PKV_POOL_MAX_THREADS; up to PKV_POOL_MAX_PARTS parts share them); see the file
 * comment. */
static void pkv_pool_run(pkv_pool_fn fn, void *ctx, int n_parts, int n_threads) {
    if (n_parts < 1) n_parts = 1;
    if (n_threads > PKV_POOL_MAX_THREADS) n_threads = PKV_POOL_MAX_THREADS;
    if (n_threads > n_parts) n_threads = n_parts;
    /* more parts than a ticket counts: the caller alone (callers cut jobs into at most
     * PKV_POOL_PARTS_PER_THREAD x PKV_POOL_MAX_THREADS parts) */
    if (n_threads <= 1 || n_parts > PKV_POOL_MAX_PARTS ||
        pthread_mutex_trylock(&pkv_pool.job_lock) != 0) {
        for (int p = 0; p < n_parts; ++p) fn(ctx, p, n_parts);
        return;
    }
    pkv_pool_grow(n_threads);
    PKV_STORE(&pkv_pool.fn, fn, RELAXED);
    PKV_STORE(&pkv_pool.ctx, ctx, RELAXED);
    PKV_STORE(&pkv_pool.n_threads, n_threads, RELAXED);
    PKV_STORE(&pkv_pool.parts_done, 0, RELAXED);
    uint32_t g = pkv_pool_generation() + 1u;
    PKV_STORE(&pkv_pool.ticket, (uint64_t)g << 32 | (uint64_t)n_parts << 16, RELEASE);
    pthread_mutex_lock(&pkv_pool.lock);         /* sleepers: see pkv_pool_worker */
    pthread_cond_broadcast(&pkv_pool.wake);
    pthread_mutex_unlock(&pkv_pool.lock);
    pkv_pool_claim_parts(g, 0);
    /* the parts still running are at most one per worker; the thread that finishes the
     * last one broadcasts done */
    pkv_pool_wait_(pkv_pool_all_done_, &n_parts, &pkv_pool.done);
    pthread_mutex_unlock(&pkv_pool.job_lock);
}

/* How long a worker spins for the next job before it sleeps (microseconds). */
static void pkv_pool_set_spin_us(unsigned spin_us) {
    PKV_STORE(&pkv_pool.spin_us, spin_us, RELAXED);
}

static unsigned pkv_pool_get_spin_us(void) {
    return PKV_LOAD(&pkv_pool.spin_us, RELAXED);
}

#endif /* PAGEDKV_QUANT_CPU_POOL_H */
