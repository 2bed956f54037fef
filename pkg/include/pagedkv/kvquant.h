/* KV-cache q8 quantization: per-element math (docs/contracts/hfqm-and-quant.md, '6.3 q8 (K and
 * V)').
 *
 * A q8 K or V row of head_dim values is head_dim/32 records of 34 bytes:
 * the f16 (round to nearest even) scale d, then 32 int8 codes. Unlike the
 * Q8F16 weight format, the codes use id = 127/amax (not 1/d) and round half
 * to even, clamped to [-127, 127]. The same text serves the CPU codec (C),
 * the hip/ kernels (HIP/CUDA) and Metal; the f16 conversion of d is the
 * caller's, with its platform's round-to-nearest-even conversion.
 */
#ifndef PAGEDKV_KVQUANT_H
#define PAGEDKV_KVQUANT_H

#include "portability.h"
#include "quant.h"

#define PKV_KVQ8_BLOCK 32        /* values per record */
#define PKV_KVQ8_RECORD_BYTES 34 /* f16 scale + 32 x int8 */

/* Bytes of one q8 row of head_dim values (head_dim % 32 == 0). */
PKV_FN uint32_t pkv_kvq8_row_bytes(uint32_t head_dim) {
  return head_dim / PKV_KVQ8_BLOCK * PKV_KVQ8_RECORD_BYTES;
}

/* The scale stored (before its f16 rounding): d = amax / 127. */
PKV_FN float pkv_kvq8_scale(float amax) { return amax / 127.0f; }

/* The factor the codes use: 127 / amax, 0 for an all-zero block. */
PKV_FN float pkv_kvq8_inv_scale(float amax) {
  return amax > 0.0f ? 127.0f / amax : 0.0f;
}

/* One code: v * (127/amax), half to even, clamped to [-127, 127]. */
PKV_FN int32_t pkv_kvq8_code(float v, float inv_scale) { return pkv_round_q8_kv(v * inv_scale); }

/* The stored scale field: f16 bits of d, round to nearest even. */
PKV_FN uint32_t pkv_kvq8_scale_bits(float amax) { return pkv_f16_rne(pkv_kvq8_scale(amax)); }

/* Decoded value from the widened f16 scale and a code. */
PKV_FN float pkv_kvq8_value(float scale, int32_t code) { return scale * (float)code; }

#endif /* PAGEDKV_KVQUANT_H */
