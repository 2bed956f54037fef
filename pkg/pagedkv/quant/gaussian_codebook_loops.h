/* GL group encoder (qt 38, 39), CPU only: the RMS scale takes an f64 sum and a
 * square root (docs/formats/quant.md, "GL: Gaussian codebooks (qt 38, 39)"). */
#ifndef PAGEDKV_QUANT_GAUSSIAN_CODEBOOK_LOOPS_H
#define PAGEDKV_QUANT_GAUSSIAN_CODEBOOK_LOOPS_H

#include <math.h>

#include "pagedkv/quant.h"

/* One group of 256 ROTATED weights: writes its packed indices at idx and returns
 * the f16 (RNE) scale bits. q: 256 bytes of scratch. The scale is
 * f16_rne(f32(sqrt(sum(r^2) / 256))) with the sum in f64 in index order; a scale
 * that rounds to 0 (an all-zero group) gives every weight the index nearest 0. */
static inline uint32_t pkv_gl_encode_group(const float *r, uint32_t bits, uint8_t *q, uint8_t *idx) {
    double ss = 0.0;
    for (uint32_t i = 0; i < 256u; ++i) ss += (double)r[i] * (double)r[i];
    float rms = (float)sqrt(ss / 256.0);
    uint32_t s16 = pkv_f16_rne(rms);
    float s = pkv_f16_to_f32(s16);
    for (uint32_t i = 0; i < 256u; ++i)
        q[i] = (uint8_t)pkv_gl_nearest(bits, s != 0.0f ? r[i] / s : 0.0f);
    pkv_pack_codes(q, 256u, bits, idx);
    return s16;
}

#endif /* PAGEDKV_QUANT_GAUSSIAN_CODEBOOK_LOOPS_H */
