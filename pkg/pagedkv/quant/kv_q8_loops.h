/* KV q8 encode loop for the CPU, compiled per ISA level (cpu_simd.h); math from
 * pagedkv/kvquant.h (docs/contracts/hfqm-and-quant.md, '6.3 q8 (K and V)'), the same bytes as its
 * scalar helpers.
 *
 * Per 32 values: amax as the max of the magnitude bits (integer order is float order for
 * finite values, and an integer max vectorizes), the scale and its f16 bits from
 * kvquant.h, and codes rounded half to even by the 1.5 * 2^23 trick: adding and
 * subtracting it leaves the nearest integer, ties to even, for |t| < 2^22 (here |t| <=
 * 127.x), exactly what pkv_round_q8_kv computes with a branch; then the ±127 clamp.
 * Input is float32, or float16 bits widened exactly (half_vectors.h). Finite input only.
 */
#ifndef PAGEDKV_QUANT_KV_Q8_LOOPS_H
#define PAGEDKV_QUANT_KV_Q8_LOOPS_H

#include <string.h>
#include "pagedkv/kvquant.h"
#include "cpu_simd.h"
#include "half_vectors.h"

/* Returns the first record whose scale is past float16 (|value| above ~127 * 65504: it would
 * decode to Inf and NaN), or -1; the caller refuses such input. */
PKV_CPU_CLONES
static ptrdiff_t pkv_cpu_kvq8_encode(const float *x32, const uint16_t *x16, ptrdiff_t n_records,
                                     uint8_t *out) {
    ptrdiff_t over = -1;
    for (ptrdiff_t r = 0; r < n_records; ++r) {
        float v[PKV_KVQ8_BLOCK];
#if defined(__GNUC__) && !defined(__clang__)
        if (x16) {
            pkv_fwht_v16f w[2];
            pkv_kv_f16_to_f32_v_(x16 + r * PKV_KVQ8_BLOCK, w);
            pkv_kv_f16_to_f32_v_(x16 + r * PKV_KVQ8_BLOCK + 16, w + 1);
            memcpy(v, w, sizeof v);
        } else
#endif
        if (x16) {
            for (int i = 0; i < PKV_KVQ8_BLOCK; ++i) v[i] = pkv_f16_to_f32(x16[r * PKV_KVQ8_BLOCK + i]);
        } else {
            memcpy(v, x32 + r * PKV_KVQ8_BLOCK, sizeof v);
        }
        uint32_t amax_bits = 0u;
        for (int i = 0; i < PKV_KVQ8_BLOCK; ++i) {
            uint32_t a = pkv_f32_bits(v[i]) & 0x7FFFFFFFu;
            amax_bits = a > amax_bits ? a : amax_bits;
        }
        const float amax = pkv_f32_from_bits(amax_bits);
        const float inv = pkv_kvq8_inv_scale(amax);
        int8_t codes[PKV_KVQ8_BLOCK];
        for (int i = 0; i < PKV_KVQ8_BLOCK; ++i) {
            float t = v[i] * inv;
            t = (t + 12582912.0f) - 12582912.0f;     /* nearest integer, ties to even */
            t = t < -127.0f ? -127.0f : t;
            t = t > 127.0f ? 127.0f : t;
            codes[i] = (int8_t)(int32_t)t;
        }
        uint8_t *o = out + r * PKV_KVQ8_RECORD_BYTES;
        const uint16_t scale = pkv_kvq8_scale_bits(amax);
        if (over < 0 && (scale & 0x7FFFu) == 0x7C00u) over = r;
        pkv_store_u16le(o, scale);
        memcpy(o + 2, codes, sizeof codes);
    }
    return over;
}

#endif /* PAGEDKV_QUANT_KV_Q8_LOOPS_H */
