/* Whole-group affine decode, compiled per ISA level (cpu_simd.h); math from pagedkv/quant.h. */
#ifndef PAGEDKV_QUANT_AFFINE_LOOPS_H
#define PAGEDKV_QUANT_AFFINE_LOOPS_H

#include "pagedkv/quant.h"
#include "cpu_simd.h"

/* Affine families (PKV_FAMILY_*, AffineFamily's numbers): pagedkv/quant.h. */

/* One group; inlined with constant bits/G below, so each common case gets its
 * own fully unrolled, vectorized loop. */
static inline __attribute__((always_inline)) void pkv_affine_decode_one_(const uint8_t *blk, int family, uint32_t bits,
                                          uint32_t G, uint8_t *q, float *o) {
    if (family == PKV_FAMILY_MQ_V2) pkv_mqv2_decode_group(blk, bits, q, o);
    else if (family == PKV_FAMILY_MQ4C) pkv_mq4c_decode_group(blk, q, o);
    else pkv_hfq_decode_group(blk, bits, G, q, o);
}

#define PKV_AFFINE_DECODE_LOOP_(FAMILY, BITS, G_) \
    for (ptrdiff_t g = 0; g < n_groups; ++g) \
        pkv_affine_decode_one_(raw + (size_t)g * PKV_AFFINE_GROUP_BYTES(BITS, G_), FAMILY, BITS, G_, \
                               q, out + (size_t)g * (G_))

/* Decode n_groups whole groups of G weights (stored basis) into out[n_groups * G]. */
PKV_CPU_CLONES
static void pkv_cpu_affine_decode_groups(const uint8_t *raw, ptrdiff_t n_groups, int family,
                                         uint32_t bits, uint32_t G, float *out) {
    uint8_t q[256];
    int v1 = family == PKV_FAMILY_HFQ || family == PKV_FAMILY_MQ_V1;
    if (v1 && bits == 4u && G == 256u) PKV_AFFINE_DECODE_LOOP_(PKV_FAMILY_HFQ, 4u, 256u);
    else if (v1 && bits == 4u && G == 128u) PKV_AFFINE_DECODE_LOOP_(PKV_FAMILY_HFQ, 4u, 128u);
    else if (v1 && bits == 6u && G == 256u) PKV_AFFINE_DECODE_LOOP_(PKV_FAMILY_HFQ, 6u, 256u);
    else if (family == PKV_FAMILY_MQ_V2 && bits == 4u) PKV_AFFINE_DECODE_LOOP_(PKV_FAMILY_MQ_V2, 4u, 256u);
    else if (family == PKV_FAMILY_MQ4C) PKV_AFFINE_DECODE_LOOP_(PKV_FAMILY_MQ4C, 4u, 256u);
    else PKV_AFFINE_DECODE_LOOP_(family, bits, G);
}

#undef PKV_AFFINE_DECODE_LOOP_

#endif /* PAGEDKV_QUANT_AFFINE_LOOPS_H */
