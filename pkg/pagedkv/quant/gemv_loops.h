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
static inline __attribute__((always_inline)) float pkv_dot_f32(const float *a, const float *b, uint32_t n) {
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
static inline __attribute__((always_inline)) float pkv_dot_nibbles(const uint8_t *payload, const float *x, uint32_t n_chunks) {
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

/* Codes per unit in plane order: 2- and 6-bit codes come 4 to a unit of 1 or 3
 * bytes, 3- and 5-bit codes 8 to a unit of 3 or 5 bytes. */
#define PKV_PLANE_UNIT_CODES(bits) (((bits) == 2u || (bits) == 6u) ? 4u : 8u)

/* Codes of one group (2, 3, 5 or 6 bits) as floats in PLANE order, per block of
 * 128 codes: with U codes per unit and n_u = 128/U units, qf[k*n_u + u] is code
 * U*u + k of the block (the caller permutes x the same way). Units are gathered
 * into integer lanes first, then every plane is one shift-and-mask over all
 * lanes: loops GCC vectorizes, unlike a code-by-code bit stream walk. */
static inline __attribute__((always_inline)) void pkv_codes_to_f32(const uint8_t *payload,
                                                                   uint32_t bits, uint32_t G,
                                                                   uint8_t *q, float *qf) {
    const uint32_t U = PKV_PLANE_UNIT_CODES(bits), unit_bytes = bits * U / 8u;
    const uint32_t n_u = 128u / U, mask = (1u << bits) - 1u;
    (void)q;
    for (uint32_t blk = 0; blk < G / 128u; ++blk) {
        const uint8_t *p = payload + blk * 16u * bits;     /* 128 codes = 16*bits bytes */
        float *o = qf + 128u * blk;
        if (unit_bytes <= 3u) {                            /* 2, 3, 6 bits: 32-bit lanes */
            int32_t lanes[64] __attribute__((aligned(64)));
            for (uint32_t u = 0; u < n_u; ++u) {
                uint32_t w = 0u;
                for (uint32_t j = 0; j < unit_bytes; ++j) w |= (uint32_t)p[unit_bytes * u + j] << (8u * j);
                lanes[u] = (int32_t)w;          /* < 2^24: shifts stay non-negative */
            }
            /* 16 lanes at a time as vectors: 64-byte stores that the 64-byte loads of
             * the dot product can forward from */
            for (uint32_t k = 0; k < U; ++k) {
                for (uint32_t u = 0; u < n_u; u += 16u) {
                    pkv_v16i32 l;
                    memcpy(&l, lanes + u, 64);
                    pkv_v16f f = __builtin_convertvector((l >> (int32_t)(bits * k)) & (int32_t)mask,
                                                         pkv_v16f);
                    memcpy(o + k * n_u + u, &f, 64);
                }
            }
        } else {                                           /* 5 bits: a unit is 40 bits */
            uint32_t lo[16], hi[16];
            for (uint32_t u = 0; u < n_u; ++u) {
                const uint8_t *b = p + unit_bytes * u;
                lo[u] = (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) |
                        ((uint32_t)b[3] << 24);
                hi[u] = b[4];
            }
            for (uint32_t k = 0; k < U; ++k) {
                uint32_t sh = bits * k;
                for (uint32_t u = 0; u < n_u; ++u) {
                    uint32_t v = sh < 32u ? (lo[u] >> sh) | (sh ? hi[u] << (32u - sh) : 0u)
                                          : hi[u] >> (sh - 32u);
                    o[k * n_u + u] = (float)(int32_t)(v & mask);
                }
            }
        }
    }
}

/* W: m rows of k weights (k % G == 0), groups of G at `bits` bits, `family` layout.
 * xp: nb prepared rows of k floats; xsum: nb rows of k/span sums (span = 128 for
 * V2, G otherwise); y: nb rows of m outputs. */
/* always_inline: a body left out of line would be compiled for the baseline ISA
 * only and called from every clone (5x slower on AVX-512). */
static inline __attribute__((always_inline)) void pkv_gemv_affine_body_(const uint8_t *w, ptrdiff_t m, ptrdiff_t k,
                                         uint32_t bits, uint32_t G, int family, const float *xp,
                                         const float *xsum, ptrdiff_t nb, float *y) {
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

/* The dispatcher: each common (family, bits, G) gets the body inlined with
 * constants, so unpacking and dots unroll and vectorize for that width. */
#define PKV_GEMV_CASE_(FAMILY, BITS, G_) \
    pkv_gemv_affine_body_(w, m, k, BITS, G_, FAMILY, xp, xsum, nb, y)
#define PKV_GEMV_WIDTHS_(FAMILY) do { \
        switch (bits) { \
        case 2: PKV_GEMV_CASE_(FAMILY, 2u, 256u); return; \
        case 3: PKV_GEMV_CASE_(FAMILY, 3u, 256u); return; \
        case 4: PKV_GEMV_CASE_(FAMILY, 4u, 256u); return; \
        case 5: PKV_GEMV_CASE_(FAMILY, 5u, 256u); return; \
        case 6: PKV_GEMV_CASE_(FAMILY, 6u, 256u); return; \
        default: break; \
        } \
    } while (0)

PKV_CPU_CLONES
static void pkv_cpu_gemv_affine(const uint8_t *w, ptrdiff_t m, ptrdiff_t k, uint32_t bits,
                                uint32_t G, int family, const float *xp, const float *xsum,
                                ptrdiff_t nb, float *y) {
    int v1 = family == PKV_FAMILY_HFQ || family == PKV_FAMILY_MQ_V1;
    int v2 = family == PKV_FAMILY_MQ_V2;
    if (v1 && G == 256u) {
        PKV_GEMV_WIDTHS_(PKV_FAMILY_HFQ);
    } else if (v2) {
        PKV_GEMV_WIDTHS_(PKV_FAMILY_MQ_V2);
    } else if (family == PKV_FAMILY_MQ4C) {
        PKV_GEMV_CASE_(PKV_FAMILY_MQ4C, 4u, 256u);
        return;
    }
    pkv_gemv_affine_body_(w, m, k, bits, G, family, xp, xsum, nb, y);   /* G128 and the rest */
}

#undef PKV_GEMV_WIDTHS_
#undef PKV_GEMV_CASE_

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
