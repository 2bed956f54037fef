/* Fused dequant-GEMV loops for the CPU, compiled per ISA level (cpu_simd.h).
 *
 * y[b][r] = sum over groups g of row r:  scale_g * (q_g . x_b) + min_g * sum(x_b over g)
 * i.e. the affine decode is folded into the dot product, so the weights are
 * never written out as floats. The caller prepares x once per call:
 *   - rotated formats: each 256-segment already rotated by the forward FWHT;
 *   - 4-bit formats: each 32-element chunk permuted to "nibble order" (the 16
 *     even elements, then the 16 odd ones) so low and high nibbles of 16
 *     consecutive bytes meet 16 consecutive floats;
 *   - xsum[b][s]: the sum of x_b over each span that shares one (scale, min):
 *     the group (v1, MQ4C) or the 128-half (V2).
 * Lane arithmetic uses GCC vector extensions: element-wise semantics that do
 * not depend on the ISA, and a fixed reduction order, so every clone gives the
 * same bits (though not the bits of x @ dequantize(W).T: a different order).
 */
#ifndef PAGEDKV_QUANT_GEMV_LOOPS_H
#define PAGEDKV_QUANT_GEMV_LOOPS_H

#include <string.h>
#include "pagedkv/quant.h"
#include "affine_loops.h"   /* PKV_FAMILY_* */
#include "cpu_simd.h"

/* Codes are widened to floats with plain loops (GCC vectorizes them with one
 * pmovzx/pmovsx each), not __builtin_convertvector, which GCC 12 scalarizes. */
typedef uint8_t pkv_v16u8 __attribute__((vector_size(16)));
typedef int32_t pkv_v16i32 __attribute__((vector_size(64)));
typedef float pkv_v16f __attribute__((vector_size(64)));
/* 8 lanes where codes are widened through memory: 256-bit stores then loads of
 * the same width forward; a 512-bit load of two 256-bit stores stalls. */
typedef float pkv_v8f __attribute__((vector_size(32)));


/* Dot product of n floats (n a multiple of 32), two 16-lane accumulators. */
static inline float pkv_dot_f32(const float *a, const float *b, uint32_t n) {
    pkv_v16f acc0 = {0}, acc1 = {0};
    for (uint32_t i = 0; i < n; i += 32u) {
        pkv_v16f a0, a1, b0, b1;
        memcpy(&a0, a + i, 64); memcpy(&a1, a + i + 16u, 64);
        memcpy(&b0, b + i, 64); memcpy(&b1, b + i + 16u, 64);
        acc0 += a0 * b0;
        acc1 += a1 * b1;
    }
    acc0 += acc1;
    float s = 0.0f;
    for (int k = 0; k < 16; ++k) s += acc0[k];
    return s;
}

/* Dot product of 32*n_chunks 4-bit codes with x in nibble order, straight from
 * the packed bytes (no float copy of the codes in between). */
static inline float pkv_dot_nibbles(const uint8_t *payload, const float *x, uint32_t n_chunks) {
    pkv_v16f acc0 = {0}, acc1 = {0};
    for (uint32_t c = 0; c < n_chunks; ++c) {
        pkv_v16u8 b;
        pkv_v16f x0, x1;
        memcpy(&b, payload + 16u * c, 16);
        memcpy(&x0, x + 32u * c, 64);
        memcpy(&x1, x + 32u * c + 16u, 64);
        acc0 += __builtin_convertvector(__builtin_convertvector(b & 15, pkv_v16i32), pkv_v16f) * x0;
        acc1 += __builtin_convertvector(__builtin_convertvector(b >> 4, pkv_v16i32), pkv_v16f) * x1;
    }
    acc0 += acc1;
    float s = 0.0f;
    for (int k = 0; k < 16; ++k) s += acc0[k];
    return s;
}

/* Codes of one group (not 4-bit) as floats, in natural order. */
static inline void pkv_codes_to_f32(const uint8_t *payload, uint32_t bits, uint32_t G,
                                    uint8_t *q, float *qf) {
    pkv_unpack_codes(payload, G, bits, q);
    for (uint32_t i = 0; i < G; ++i) qf[i] = (float)q[i];
}

/* W: m rows of k weights (k % G == 0), groups of G at `bits` bits, `family` layout.
 * xp: nb prepared rows of k floats; xsum: nb rows of k/span sums (span = 128 for
 * V2, G otherwise); y: nb rows of m outputs. */
PKV_CPU_CLONES
static void pkv_cpu_gemv_affine(const uint8_t *w, ptrdiff_t m, ptrdiff_t k, uint32_t bits,
                                uint32_t G, int family, const float *xp, const float *xsum,
                                ptrdiff_t nb, float *y) {
    const ptrdiff_t groups_per_row = k / G;
    const size_t B = PKV_AFFINE_GROUP_BYTES(bits, G);
    const ptrdiff_t spans_per_row = family == PKV_FAMILY_MQ_V2 ? k / 128 : groups_per_row;
    uint8_t q[256];
    float qf[256] __attribute__((aligned(64)));
    float acc[8];
    for (ptrdiff_t r = 0; r < m; ++r) {
        for (ptrdiff_t b = 0; b < nb; ++b) acc[b] = 0.0f;
        for (ptrdiff_t g = 0; g < groups_per_row; ++g) {
            const uint8_t *blk = w + (size_t)(r * groups_per_row + g) * B;
            const uint8_t *payload = blk + PKV_AFFINE_HEADER_BYTES;
            if (bits != 4u) pkv_codes_to_f32(payload, bits, G, q, qf);
            const ptrdiff_t x0 = g * (ptrdiff_t)G;
            if (family == PKV_FAMILY_MQ_V2) {
                float s0 = pkv_mqv2_scale(blk, 0), z0 = pkv_mqv2_zero(blk, 0);
                float s1 = pkv_mqv2_scale(blk, 1), z1 = pkv_mqv2_zero(blk, 1);
                for (ptrdiff_t b = 0; b < nb; ++b) {
                    const float *xb = xp + b * k + x0;
                    const float *sb = xsum + b * spans_per_row + 2 * g;
                    float d0, d1;
                    if (bits == 4u) {
                        d0 = pkv_dot_nibbles(payload, xb, 4u);
                        d1 = pkv_dot_nibbles(payload + 64, xb + 128, 4u);
                    } else {
                        d0 = pkv_dot_f32(qf, xb, 128u);
                        d1 = pkv_dot_f32(qf + 128, xb + 128, 128u);
                    }
                    acc[b] += (s0 * d0 + z0 * sb[0]) + (s1 * d1 + z1 * sb[1]);
                }
            } else {
                float s, z;
                if (family == PKV_FAMILY_MQ4C) {
                    s = pkv_mqv2_scale(blk, 0);
                    z = pkv_mqv2_zero(blk, 0);
                } else {
                    s = pkv_hfq_scale(blk);
                    z = pkv_hfq_min(blk);
                }
                for (ptrdiff_t b = 0; b < nb; ++b) {
                    const float *xb = xp + b * k + x0;
                    float d = bits == 4u ? pkv_dot_nibbles(payload, xb, G / 32u) : pkv_dot_f32(qf, xb, G);
                    acc[b] += s * d + z * xsum[b * spans_per_row + g];
                }
            }
        }
        for (ptrdiff_t b = 0; b < nb; ++b) y[b * m + r] = acc[b];
    }
}

/* Q8F16: W m rows of k weights (k % 32 == 0); x plain (no permutation, no sums).
 * One block is only 32 weights, so the scale goes into the lanes (d * (q * x))
 * and each row reduces its 16 lanes once, not once per block. */
PKV_CPU_CLONES
static void pkv_cpu_gemv_q8f16(const uint8_t *w, ptrdiff_t m, ptrdiff_t k, const float *x,
                               ptrdiff_t nb, float *y) {
    const ptrdiff_t blocks_per_row = k / 32;
    for (ptrdiff_t r = 0; r < m; ++r) {
        const uint8_t *row = w + (size_t)(r * blocks_per_row) * PKV_Q8F16_GROUP_BYTES;
        /* one x row at a time keeps the accumulator in a register; the 34-byte
         * blocks of this row stay in L1 for the next x row */
        for (ptrdiff_t b = 0; b < nb; ++b) {
            const float *xb = x + b * k;
            pkv_v8f acc0 = {0}, acc1 = {0};
            for (ptrdiff_t g = 0; g < blocks_per_row; ++g) {
                const uint8_t *blk = row + (size_t)g * PKV_Q8F16_GROUP_BYTES;
                float d = pkv_f16_to_f32(pkv_load_u16le(blk));
                float qf[32] __attribute__((aligned(32)));
                for (uint32_t i = 0; i < 32u; ++i) qf[i] = (float)(int8_t)blk[2u + i];
                pkv_v8f q[4], xv[4];
                memcpy(q, qf, sizeof q);
                memcpy(xv, xb + g * 32, sizeof xv);
                acc0 += d * (q[0] * xv[0] + q[1] * xv[1]);
                acc1 += d * (q[2] * xv[2] + q[3] * xv[3]);
            }
            pkv_v8f acc = acc0 + acc1;
            float s = 0.0f;
            for (int l = 0; l < 8; ++l) s += acc[l];
            y[b * m + r] = s;
        }
    }
}

#endif /* PAGEDKV_QUANT_GEMV_LOOPS_H */
