/* Decode loops of the Q8F16 blocks and the raw half types, compiled per ISA level
 * (cpu_simd.h); the per-element math is pagedkv/quant.h's, so every clone gives the
 * reference bits. */
#ifndef PAGEDKV_QUANT_RAW_DECODE_LOOPS_H
#define PAGEDKV_QUANT_RAW_DECODE_LOOPS_H

#include "pagedkv/quant.h"
#include "cpu_simd.h"

/* n_blocks whole Q8F16 blocks (34 bytes, 32 weights each) into out[32 * n_blocks]. */
PKV_CPU_CLONES
static void pkv_cpu_q8f16_decode_blocks(const uint8_t *raw, ptrdiff_t n_blocks, float *out) {
    for (ptrdiff_t b = 0; b < n_blocks; ++b)
        pkv_q8f16_decode_group(raw + (size_t)b * PKV_Q8F16_GROUP_BYTES, out + (size_t)b * PKV_Q8F16_GROUP);
}

/* f16 and bf16 bit patterns widened to f32, exactly (NaN payloads kept as they are). */
PKV_CPU_CLONES
static void pkv_cpu_f16_to_f32(const uint16_t *h, ptrdiff_t n, float *out) {
    for (ptrdiff_t i = 0; i < n; ++i) out[i] = pkv_f16_to_f32(h[i]);
}

PKV_CPU_CLONES
static void pkv_cpu_bf16_to_f32(const uint16_t *h, ptrdiff_t n, float *out) {
    for (ptrdiff_t i = 0; i < n; ++i) out[i] = pkv_bf16_to_f32(h[i]);
}

#endif /* PAGEDKV_QUANT_RAW_DECODE_LOOPS_H */
