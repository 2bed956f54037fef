/* Q4K (qt 4) = GGML Q4_K encoder, CPU only: llama.cpp's quantize_row_q4_K_ref (no
 * importance matrix), ported operation for operation so that every block is ggml's bytes
 * (docs/formats/quant.md, "Q4K (qt 4) = GGML Q4_K, encode and decode"). The layout and the
 * decoder are pagedkv/quant.h's (shared with the GPU); this file needs libm (sqrtf), hence
 * its own header.
 *
 * Bit-exactness. ggml compiles this code into ggml-base, which gets no -march flags: on
 * x86-64 it is SSE2 without FMA, so every a*b+c below is two rounded f32 operations, as
 * the project's -ffp-contract=off makes them here. The order of each expression is ggml's
 * (C evaluates left to right: w*l*x is (w*l)*x); integers convert to float where ggml's
 * do. A ggml built with contraction (GCC's default -ffp-contract=fast on a target with
 * FMA, e.g. aarch64) can differ from this in the last bit of a sum, hence in a code.
 */
#ifndef PAGEDKV_QUANT_Q4K_LOOPS_H
#define PAGEDKV_QUANT_Q4K_LOOPS_H

#include <math.h>

#include "pagedkv/quant.h"

#define PKV_Q4K_SUB      32     /* weights per sub-block (one 6-bit scale and min) */
#define PKV_Q4K_NSUB      8     /* sub-blocks per 256-weight super-block */
#define PKV_Q4K_NMAX     15     /* largest 4-bit code */
#define PKV_Q4K_SC_MAX   63     /* largest 6-bit scale or min */

/* ggml's nearest_int: round half to even through the 1.5 * 2^23 trick. Exact for
 * |v| <= 4194303; beyond, the same modular result ggml gets (its assert is compiled
 * out with NDEBUG). */
static inline int pkv_q4k_nearest_int(float v) {
    float t = v + 12582912.0f;
    return (int)(pkv_f32_bits(t) & 0x007FFFFFu) - 0x00400000;
}

static inline int pkv_q4k_clamp_code(int l) {
    return l < 0 ? 0 : (l > PKV_Q4K_NMAX ? PKV_Q4K_NMAX : l);
}

/* ggml's make_qkx2_quants(32, 15, x, weights, L, &the_min, Laux, -1.f, 0.1f, 20, false):
 * the affine fit min + scale * L of one sub-block that minimizes the weighted squared
 * error over 21 trial inverse scales (a weighted least-squares refit each). Returns the
 * scale, *the_min = -min (>= 0). */
static inline float pkv_q4k_fit_sub_block(const float *x, const float *weights, uint8_t *L,
                                          float *the_min) {
    const int n = PKV_Q4K_SUB, nmax = PKV_Q4K_NMAX, nstep = 20;
    const float rmin = -1.0f, rdelta = 0.1f;
    uint8_t Laux[PKV_Q4K_SUB];
    float min = x[0];
    float max = x[0];
    float sum_w = weights[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        *the_min = -min;
        return 0.0f;
    }
    float iscale = (float)nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; ++i) {
        int l = pkv_q4k_nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)pkv_q4k_clamp_code(l);
        float diff = scale * (float)L[i] + min - x[i];
        diff = diff * diff;
        float w = weights[i];
        best_error += w * diff;
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * (float)is + (float)nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            int l = pkv_q4k_clamp_code(pkv_q4k_nearest_int(iscale * (x[i] - min)));
            Laux[i] = (uint8_t)l;
            float w = weights[i];
            sum_l += w * (float)l;
            sum_l2 += w * (float)l * (float)l;
            sum_xl += w * (float)l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; ++i) {
                float diff = this_scale * (float)Laux[i] + this_min - x[i];
                diff = diff * diff;
                float w = weights[i];
                cur_error += w * diff;
            }
            if (cur_error < best_error) {
                for (int i = 0; i < n; ++i) L[i] = Laux[i];
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

/* Encode one super-block of 256 finite weights into PKV_Q4K_GROUP_BYTES bytes, ggml's
 * quantize_row_q4_K_ref for k = 256. UNREPRESENTABLE when the f16 d or dmin is not
 * finite (a sub-block scale or minimum beyond 63 * 65504): the bytes are ggml's anyway. */
static inline int pkv_q4k_encode_group(const float *x, uint8_t *blk) {
    uint8_t L[PKV_Q4K_GROUP];
    float weights[PKV_Q4K_SUB], mins[PKV_Q4K_NSUB], scales[PKV_Q4K_NSUB];
    uint8_t *sc = blk + 4;
    float max_scale = 0;     /* as ggml deducts the min, scales are (nearly) always positive */
    float max_min = 0;
    for (int j = 0; j < PKV_Q4K_NSUB; ++j) {
        const float *xj = x + PKV_Q4K_SUB * j;
        float sum_x2 = 0;
        for (int l = 0; l < PKV_Q4K_SUB; ++l) sum_x2 += xj[l] * xj[l];
        float av_x = sqrtf(sum_x2 / (float)PKV_Q4K_SUB);
        for (int l = 0; l < PKV_Q4K_SUB; ++l) weights[l] = av_x + fabsf(xj[l]);
        scales[j] = pkv_q4k_fit_sub_block(xj, weights, L + PKV_Q4K_SUB * j, &mins[j]);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
    float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    for (int j = 0; j < PKV_Q4K_NSUB; ++j) {
        /* ggml stores nearest_int's int in a uint8_t before the MIN: a negative one wraps */
        uint8_t ls = (uint8_t)pkv_q4k_nearest_int(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)pkv_q4k_nearest_int(inv_min * mins[j]);
        ls = ls < PKV_Q4K_SC_MAX ? ls : PKV_Q4K_SC_MAX;
        lm = lm < PKV_Q4K_SC_MAX ? lm : PKV_Q4K_SC_MAX;
        /* get_scale_min_k4's packing (pkv_q4k_scale_min reads it back) */
        if (j < 4) {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (uint8_t)((ls & 0xFu) | ((lm & 0xFu) << 4));
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    uint32_t d16 = pkv_f16_rne(max_scale / 63.0f), dmin16 = pkv_f16_rne(max_min / 63.0f);
    pkv_store_u16le(blk, d16);
    pkv_store_u16le(blk + 2, dmin16);
    for (uint32_t j = 0; j < PKV_Q4K_NSUB; ++j) {
        uint32_t s, m;
        pkv_q4k_scale_min(sc, j, &s, &m);
        const float d = pkv_f16_to_f32(d16) * (float)s;
        if (!d) continue;        /* ggml keeps the sub-block's fitted codes then */
        const float dm = pkv_f16_to_f32(dmin16) * (float)m;
        for (uint32_t i = 0; i < PKV_Q4K_SUB; ++i) {
            int l = pkv_q4k_nearest_int((x[PKV_Q4K_SUB * j + i] + dm) / d);
            L[PKV_Q4K_SUB * j + i] = (uint8_t)pkv_q4k_clamp_code(l);
        }
    }
    uint8_t *q = blk + 16;
    for (uint32_t j = 0; j < PKV_Q4K_GROUP; j += 64u) {
        for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
        q += 32;
    }
    return PKV_F16_IS_NONFINITE(d16) || PKV_F16_IS_NONFINITE(dmin16)
               ? PKV_ENCODE_UNREPRESENTABLE : PKV_ENCODE_OK;
}

#endif /* PAGEDKV_QUANT_Q4K_LOOPS_H */
