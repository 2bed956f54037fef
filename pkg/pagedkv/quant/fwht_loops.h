/* FWHT-256 over rows for the CPU, compiled per ISA level (cpu_simd.h).
 *
 * Same operations per element as pagedkv/quant.h's pkv_fwht_with_tables (the
 * portable text the kernels use), scheduled for registers: a row is 16 vectors
 * of 16 lanes; strides 1-8 run inside each vector (lane l pairs with l ^ h),
 * strides 16-128 between vectors (plain vector adds and subtracts). Stages stay in ascending order, so the bits
 * match the reference (tested against a stage-by-stage transcription).
 */
#ifndef PAGEDKV_QUANT_FWHT_LOOPS_H
#define PAGEDKV_QUANT_FWHT_LOOPS_H

#include <string.h>
#include "pagedkv/quant.h"
#include "cpu_simd.h"

typedef float pkv_fwht_v16f __attribute__((vector_size(64)));
typedef int32_t pkv_fwht_v16i __attribute__((vector_size(64)));

#if defined(__GNUC__) && !defined(__clang__)

/* One in-vector stage of stride h (1, 2, 4 or 8): t = y[l ^ h] (one shuffle), then
 * y' = t + s·y with s = +1 where bit h of l is clear (b + a = a + b exactly) and
 * s = −1 where it is set (t + (−1·y) = a − b exactly): the same rounded result
 * as the scalar butterfly, for one shuffle per stage. */
#define PKV_FWHT_LANE_STAGE_(y, h) do { \
        const pkv_fwht_v16i px_ = { 0 ^ (h), 1 ^ (h), 2 ^ (h), 3 ^ (h), 4 ^ (h), 5 ^ (h), \
            6 ^ (h), 7 ^ (h), 8 ^ (h), 9 ^ (h), 10 ^ (h), 11 ^ (h), 12 ^ (h), 13 ^ (h), \
            14 ^ (h), 15 ^ (h) }; \
        const pkv_fwht_v16f sg_ = { (0 & (h)) ? -1.f : 1.f, (1 & (h)) ? -1.f : 1.f, \
            (2 & (h)) ? -1.f : 1.f, (3 & (h)) ? -1.f : 1.f, (4 & (h)) ? -1.f : 1.f, \
            (5 & (h)) ? -1.f : 1.f, (6 & (h)) ? -1.f : 1.f, (7 & (h)) ? -1.f : 1.f, \
            (8 & (h)) ? -1.f : 1.f, (9 & (h)) ? -1.f : 1.f, (10 & (h)) ? -1.f : 1.f, \
            (11 & (h)) ? -1.f : 1.f, (12 & (h)) ? -1.f : 1.f, (13 & (h)) ? -1.f : 1.f, \
            (14 & (h)) ? -1.f : 1.f, (15 & (h)) ? -1.f : 1.f }; \
        (y) = __builtin_shuffle((y), px_) + (y) * sg_; \
    } while (0)

typedef pkv_fwht_v16f pkv_fwht_table_[16];  /* a sign table, as pkv_fwht256_row_ takes it */

/* In place on nvec vectors in registers (nvec * 16 = n in {128, 256}): y = D_post · H ·
 * D_pre · y, tables as nvec vectors (post carries the scale). Also used by the KV
 * codec loops (kv_rotated_loops.h) for its R128 and R256 rows. */
static inline __attribute__((always_inline)) void pkv_fwht_vecs_(pkv_fwht_v16f *v, int nvec,
                                    const pkv_fwht_v16f *s_pre, const pkv_fwht_v16f *s_post) {
    for (int i = 0; i < nvec; ++i) {
        v[i] = v[i] * s_pre[i];
        PKV_FWHT_LANE_STAGE_(v[i], 1);
        PKV_FWHT_LANE_STAGE_(v[i], 2);
        PKV_FWHT_LANE_STAGE_(v[i], 4);
        PKV_FWHT_LANE_STAGE_(v[i], 8);
    }
    /* unrolled, so that v stays in registers (nvec is a constant at every call; as
     * loops, GCC 12 kept v in memory and spent 60% of an AVX2 row on indexing) */
    _Pragma("GCC unroll 4")
    for (int h = 1; h < nvec; h <<= 1) {        /* strides 16, 32, ... floats */
        _Pragma("GCC unroll 16")
        for (int i = 0; i < nvec; i += 2 * h) {
            _Pragma("GCC unroll 8")
            for (int j = i; j < i + h; ++j) {
                pkv_fwht_v16f a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
        }
    }
    for (int i = 0; i < nvec; ++i) v[i] = v[i] * s_post[i];
}

/* One row: y = D_post · H · (D_pre · x), tables as 16 vectors (post carries the 1/16). */
static inline __attribute__((always_inline)) void pkv_fwht256_row_(const float *x, float *y, const pkv_fwht_v16f *s_pre,
                                    const pkv_fwht_v16f *s_post) {
    pkv_fwht_v16f v[16];
    memcpy(v, x, sizeof v);
    pkv_fwht_vecs_(v, 16, s_pre, s_post);
    memcpy(y, v, sizeof v);
}

/* y[r] = D_post · H · D_pre · x[r] / 16 for n_rows rows of 256 floats (y may equal x).
 * pre: SIGNS1 and post_scaled: SIGNS2/16 for R; swapped for Rᵀ. */
PKV_CPU_CLONES
static void pkv_cpu_fwht256_rows(const float *x, float *y, ptrdiff_t n_rows,
                                 const float *pre, const float *post_scaled) {
    pkv_fwht_table_ s_pre, s_post;
    memcpy(s_pre, pre, sizeof s_pre);
    memcpy(s_post, post_scaled, sizeof s_post);
    for (ptrdiff_t r = 0; r < n_rows; ++r) pkv_fwht256_row_(x + 256 * r, y + 256 * r, s_pre, s_post);
}

#else  /* other compilers: the portable header loop */

typedef float pkv_fwht_table_[256];     /* a sign table, as pkv_fwht256_row_ takes it */

static inline void pkv_fwht256_row_(const float *x, float *y, const float *pre,
                                    const float *post_scaled) {
    for (uint32_t i = 0; i < 256u; ++i) y[i] = x[i] * pre[i];
    pkv_fwht256_butterflies(y);
    for (uint32_t i = 0; i < 256u; ++i) y[i] = y[i] * post_scaled[i];
}

static void pkv_cpu_fwht256_rows(const float *x, float *y, ptrdiff_t n_rows,
                                 const float *pre, const float *post_scaled) {
    for (ptrdiff_t r = 0; r < n_rows; ++r) pkv_fwht256_row_(x + 256 * r, y + 256 * r, pre, post_scaled);
}

#endif

#endif /* PAGEDKV_QUANT_FWHT_LOOPS_H */
