/* HFP4G32 / MFP4G32 / MFP4G32P row encoder (qt 21, 24, 33), CPU only: the UE8M0
 * exponent takes a log2 (docs/formats/quant.md, "HFP4G32, MFP4G32, MFP4G32P").
 * The decoders are pagedkv/quant.h's (shared with the GPU). */
#ifndef PAGEDKV_QUANT_FP4_LOOPS_H
#define PAGEDKV_QUANT_FP4_LOOPS_H

#include <math.h>

#include "pagedkv/quant.h"

/* ceil(log2(y)) for y > 0 finite, with log2 rounded to f32 first: what hipfire's
 * `(y).log2().ceil()` on an f32 gives with a correctly rounded log2f. The double log2
 * is accurate far below the f32 rounding step, so its f32 rounding is the correctly
 * rounded one (a double-rounding tie would need log2(y) within 2^-53 of an f32
 * midpoint, which no f32 y reaches in practice). */
static inline int32_t pkv_fp4_ceil_log2(float y) {
    float l = (float)log2((double)y);
    return (int32_t)ceilf(l);
}

/* UE8M0 byte of a block whose largest normalized magnitude is bm (> 0). */
static inline uint32_t pkv_fp4_ue8m0_byte(float bm) {
    if (!(bm > 0.0f)) return 0u;
    int32_t e = pkv_fp4_ceil_log2(bm / 6.0f) + 127;
    return (uint32_t)(e < 0 ? 0 : (e > 254 ? 254 : e));
}

/* Encode one row of K weights (K % 32 == 0; already rotated for qt 24/33) into
 * PKV_FP4_ROW_BYTES(K) bytes. e4m3: block scales as unsigned E4M3 (qt 33), else UE8M0.
 * UNREPRESENTABLE when the f16 row scale saturates (max|x|/6 beyond 65504). */
static inline int pkv_fp4_encode_row(const float *x, uint32_t K, uint32_t flags, int e4m3,
                                     uint8_t *row) {
    float rmax = 0.0f;
    for (uint32_t i = 0; i < K; ++i) {
        float a = fabsf(x[i]);
        rmax = a > rmax ? a : rmax;
    }
    float ra = rmax > 0.0f ? rmax / 6.0f : 1.0f;
    float inv_r = rmax > 0.0f ? 1.0f / ra : 0.0f;
    uint32_t ra16 = pkv_f16_trunc(ra);
    for (uint32_t i = 0; i < PKV_FP4_ROW_HEADER_BYTES; ++i) row[i] = 0u;
    pkv_store_u16le(row, ra16);
    pkv_store_u16le(row + 4, K / PKV_FP4_BLOCK);
    row[6] = (uint8_t)flags;
    for (uint32_t b = 0; b < K / PKV_FP4_BLOCK; ++b) {
        const float *v = x + PKV_FP4_BLOCK * b;
        uint8_t *blk = row + PKV_FP4_ROW_HEADER_BYTES + PKV_FP4_BLOCK_BYTES * b;
        float bmax = 0.0f;
        for (uint32_t i = 0; i < PKV_FP4_BLOCK; ++i) {
            float a = fabsf(v[i]);
            bmax = a > bmax ? a : bmax;
        }
        float bm = bmax * inv_r;
        uint32_t byte;
        if (e4m3) byte = pkv_e4m3u_ceil(bm > 0.0f ? bm / 6.0f : 0.0f);
        else byte = pkv_fp4_ue8m0_byte(bm);
        float bs = pkv_fp4_block_scale(byte, e4m3);
        float inv_b = bs > 0.0f ? 1.0f / bs : 0.0f;
        blk[0] = (uint8_t)byte;
        for (uint32_t i = 0; i < 16u; ++i) {
            float lo = v[2u * i] * inv_r;
            float hi = v[2u * i + 1u] * inv_r;
            lo = lo * inv_b;
            hi = hi * inv_b;
            blk[1u + i] = (uint8_t)(pkv_e2m1_nearest(lo) | (pkv_e2m1_nearest(hi) << 4));
        }
    }
    return PKV_F16_IS_NONFINITE(ra16) ? PKV_ENCODE_UNREPRESENTABLE : PKV_ENCODE_OK;
}

#endif /* PAGEDKV_QUANT_FP4_LOOPS_H */
