/* Whole-group affine decode, compiled per ISA level (cpu_simd.h); math from pagedkv/quant.h. */
#ifndef PAGEDKV_QUANT_AFFINE_LOOPS_H
#define PAGEDKV_QUANT_AFFINE_LOOPS_H

#include "pagedkv/quant.h"
#include "cpu_simd.h"

/* Affine families, as pagedkv.quant.affine.AffineFamily numbers them. */
enum { PKV_FAMILY_HFQ = 0, PKV_FAMILY_MQ_V1 = 1, PKV_FAMILY_MQ_V2 = 2, PKV_FAMILY_MQ4C = 3 };

/* Decode n_groups whole groups of G weights (stored basis) into out[n_groups * G]. */
PKV_CPU_CLONES
static void pkv_cpu_affine_decode_groups(const uint8_t *raw, ptrdiff_t n_groups, int family,
                                         uint32_t bits, uint32_t G, float *out) {
    const size_t B = PKV_AFFINE_GROUP_BYTES(bits, G);
    uint8_t q[256];
    for (ptrdiff_t g = 0; g < n_groups; ++g) {
        const uint8_t *blk = raw + (size_t)g * B;
        float *o = out + (size_t)g * G;
        if (family == PKV_FAMILY_MQ_V2) pkv_mqv2_decode_group(blk, bits, q, o);
        else if (family == PKV_FAMILY_MQ4C) pkv_mq4c_decode_group(blk, q, o);
        else pkv_hfq_decode_group(blk, bits, G, q, o);
    }
}

#endif /* PAGEDKV_QUANT_AFFINE_LOOPS_H */
