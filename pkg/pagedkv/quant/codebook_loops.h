/* Lloyd codebook encoder (qt 19, 20, 30, 51), CPU only: f64 centroid means.
 * The rule is hipfire's, step for step (docs/formats/quant.md, "Lloyd codebooks"). */
#ifndef PAGEDKV_QUANT_CODEBOOK_LOOPS_H
#define PAGEDKV_QUANT_CODEBOOK_LOOPS_H

#include "pagedkv/quant.h"

/* Stable ascending sort by `<` (so -0.0 and +0.0 keep their order, as the stable sort
 * upstream does): which of two equal-comparing zeros lands at a percentile is a byte. */
static inline void pkv_lloyd_sort256_(const float *x, float *s) {
    for (uint32_t i = 0; i < 256u; ++i) {
        float v = x[i];
        uint32_t j = i;
        while (j > 0 && v < s[j - 1]) { s[j] = s[j - 1]; --j; }
        s[j] = v;
    }
}

/* One group of 256 values (already rotated, short groups zero-padded) -> blk. */
static inline void pkv_lloyd_encode_group(const float *r, uint32_t bits, uint8_t *q,
                                          uint8_t *blk) {
    float sorted[256], cb[16], sorted_cb[16];
    double sums[16];
    uint32_t counts[16], order[16], inv[16];
    uint8_t prev[256];
    uint32_t n_cb = 1u << bits;
    pkv_lloyd_sort256_(r, sorted);
    for (uint32_t k = 0; k < n_cb; ++k) {
        /* f32 (2k+1)/(2K)*255 is never a tie for K = 4, 8, 16: +0.5 then truncate == round. */
        float frac = (float)(2u * k + 1u) / (float)(2u * n_cb);
        uint32_t idx = (uint32_t)(frac * 255.0f + 0.5f);
        cb[k] = sorted[idx < 255u ? idx : 255u];
    }
    for (uint32_t i = 0; i < 256u; ++i) q[i] = 0;
    if (sorted[255] - sorted[0] > 0.0f) {
        for (uint32_t it = 0; it < PKV_LLOYD_MAX_ITER; ++it) {
            uint32_t changed = 0;
            for (uint32_t k = 0; k < n_cb; ++k) { sums[k] = 0.0; counts[k] = 0; }
            for (uint32_t i = 0; i < 256u; ++i) {
                float w = r[i], d0 = w - cb[0];
                float best_d = d0 < 0.0f ? -d0 : d0;
                uint32_t best = 0;
                for (uint32_t k = 1; k < n_cb; ++k) {
                    float d = w - cb[k];
                    d = d < 0.0f ? -d : d;
                    if (d < best_d) { best_d = d; best = k; }
                }
                if (it == 0 || prev[i] != best) ++changed;
                prev[i] = (uint8_t)best;
                q[i] = (uint8_t)best;
                sums[best] += (double)w;
                counts[best] += 1u;
            }
            if (it > 0 && changed == 0) break;
            for (uint32_t k = 0; k < n_cb; ++k)
                if (counts[k]) cb[k] = (float)(sums[k] / (double)counts[k]);
        }
    }
    /* Centroids ascending (stable on equal values), indices remapped. */
    for (uint32_t k = 0; k < n_cb; ++k) {
        uint32_t j = k;
        while (j > 0 && cb[k] < cb[order[j - 1]]) { order[j] = order[j - 1]; --j; }
        order[j] = k;
    }
    for (uint32_t k = 0; k < n_cb; ++k) { sorted_cb[k] = cb[order[k]]; inv[order[k]] = k; }
    for (uint32_t i = 0; i < 256u; ++i) q[i] = (uint8_t)inv[q[i]];
    for (uint32_t k = 0; k < n_cb; ++k) pkv_store_u16le(blk + 2u * k, pkv_f16_rne(sorted_cb[k]));
    pkv_pack_codes(q, 256u, bits, blk + 2u * n_cb);
}

#endif /* PAGEDKV_QUANT_CODEBOOK_LOOPS_H */
