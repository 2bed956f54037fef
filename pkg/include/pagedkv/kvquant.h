/* KV-cache quantization: per-element math of every KV mode (docs/kv-quant.md).
 *
 * q8 (docs/contracts/hfqm-and-quant.md, '6.3 q8 (K and V)'):
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

#if defined(PKV_HOST)
#  include <math.h>
#endif
#if defined(PKV_METAL)
#  define PKV_SQRTF(x) sqrt(x)
#else
#  define PKV_SQRTF(x) sqrtf(x)
#endif

#define PKV_KVQ8_BLOCK 32        /* values per record */
#define PKV_KVQ8_RECORD_BYTES 34 /* f16 scale + 32 x int8 */

/* Bytes of one q8 row of head_dim values (head_dim % 32 == 0). */
PKV_FN uint32_t pkv_kvq8_row_bytes(uint32_t head_dim) {
  return head_dim / PKV_KVQ8_BLOCK * PKV_KVQ8_RECORD_BYTES;
}

/* The scale stored (before its f16 rounding): d = amax / 127. */
PKV_FN float pkv_kvq8_scale(float amax) { return amax / 127.0f; }

/* The larger of two record maxima of |v|, NaN winning: a record holding a NaN stores a NaN
 * scale (and decodes to NaN), as the NumPy and MLX writers store it. A plain fmaxf drops
 * the NaN, and the device writers stored a finite scale that decoded the record's other
 * values as if nothing were wrong. */
PKV_FN float pkv_kvq8_amax(float a, float b) {
  return pkv_f32_is_nan(a) ? a : (pkv_f32_is_nan(b) ? b : (a > b ? a : b));
}

/* The factor the codes use: 127 / amax, 0 for an all-zero block and for one whose
 * 127 / amax overflows float32 (amax below ~3.7e-37): an infinite factor made a zero
 * value's code 0 * inf = NaN, which each implementation turned into another byte. Such a
 * block's float16 scale is 0, so its values decode to 0 whatever the codes. */
PKV_FN float pkv_kvq8_inv_scale(float amax) {
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  return inv <= 3.40282347e38f ? inv : 0.0f;
}

/* One code: v * (127/amax), half to even, clamped to [-127, 127]. */
PKV_FN int32_t pkv_kvq8_code(float v, float inv_scale) { return pkv_round_q8_kv(v * inv_scale); }

/* The stored scale field: f16 bits of d, round to nearest even; a NaN d (a record holding
 * a NaN) is the quiet NaN 0x7E00 whatever its payload, as the NumPy and MLX writers store
 * it. pkv_f16_rne keeps a NaN's payload, and NVIDIA's arithmetic turns every NaN into
 * 0x7FFFFFFF, so the CUDA writers stored 0x7FFF (H200, 2026-12-07). */
PKV_FN uint32_t pkv_kvq8_scale_bits(float amax) {
  const float d = pkv_kvq8_scale(amax);
  return pkv_f32_is_nan(d) ? 0x7E00u : pkv_f16_rne(d);
}

/* Decoded value from the widened f16 scale and a code. */
PKV_FN float pkv_kvq8_value(float scale, int32_t code) { return scale * (float)code; }

/* ---------------------------------------------------------------------------
 * KV-cache modes (docs/kv-quant.md, "Modes" and "Record layouts").
 *
 * A mode id names how one (token, kv-head) row of head_dim values is stored:
 *   q8        K or V   hd/32 records of [f16 scale][32 x int8]          (above)
 *   fwht4/3/2 K        [f32 cnorm][hd*b/8 B codes], FWHT-rotated Lloyd-Max
 *   lloyd4/3/2 V       [f32 cnorm][hd*b/8 B codes], R256, 256-family tables
 * fwht4/fwht2 rotate each 128-half with R128 and use the 128-family tables
 * (hd 128 or 256); fwht3 and lloyd* rotate with R256 and use the 256-family
 * tables (hd 256 only). Codes are LSB-first (quant.h pkv_pack_codes).
 * ------------------------------------------------------------------------- */

#define PKV_KV_MODE_Q8      0u
#define PKV_KV_MODE_FWHT4   1u
#define PKV_KV_MODE_FWHT3   2u
#define PKV_KV_MODE_FWHT2   3u
#define PKV_KV_MODE_LLOYD4  4u
#define PKV_KV_MODE_LLOYD3  5u
#define PKV_KV_MODE_LLOYD2  6u
#define PKV_KV_MODE_COUNT   7u

#define PKV_KV_CNORM_BYTES  4u        /* the f32 corrected norm that opens a rotated record */
#define PKV_KV_NORM_EPS     1e-10f    /* norms at or below this count as zero */
#define PKV_KV_SUMSQ_LANES  16u       /* partial sums of the norm reduction (its order) */

/* Lloyd-Max centroids (ascending) and decision thresholds for N(0, 1/128) ("128
 * family") and N(0, 1/256) ("256 family"), as upstream ships them. The 128
 * thresholds are centroid midpoints; the 256 ones differ from the midpoints by up
 * to 2e-5 and are kept as listed. Each consumer instantiates the lists once in
 * its own address space (host arrays below, __constant__ in hip/kvcache.hip). */
#define PKV_KV_C2_128 -0.133466f, -0.040022f, 0.040022f, 0.133466f
#define PKV_KV_C3_128 -0.190685f, -0.117832f, -0.065717f, -0.021460f, \
                       0.021460f,  0.065717f,  0.117832f,  0.190685f
#define PKV_KV_C4_128 -0.241565f, -0.182875f, -0.143012f, -0.111016f, \
                      -0.083262f, -0.057983f, -0.034295f, -0.011225f, \
                       0.011225f,  0.034295f,  0.057983f,  0.083262f, \
                       0.111016f,  0.143012f,  0.182875f,  0.241565f
#define PKV_KV_C2_256 -0.094376f, -0.028300f, 0.028300f, 0.094376f
#define PKV_KV_C3_256 -0.134860f, -0.083320f, -0.046469f, -0.015176f, \
                       0.015176f,  0.046469f,  0.083320f,  0.134860f
#define PKV_KV_C4_256 -0.170807f, -0.129321f, -0.101134f, -0.078505f, \
                      -0.058869f, -0.041003f, -0.024249f, -0.007938f, \
                       0.007938f,  0.024249f,  0.041003f,  0.058869f, \
                       0.078505f,  0.101134f,  0.129321f,  0.170807f
#define PKV_KV_T2_128 -0.086744f, 0.0f, 0.086744f
#define PKV_KV_T3_128 -0.154258f, -0.091775f, -0.043589f, 0.0f, 0.043589f, 0.091775f, 0.154258f
#define PKV_KV_T4_128 -0.212220f, -0.162944f, -0.127014f, -0.097139f, -0.070622f, \
                      -0.046139f, -0.022760f,  0.0f,       0.022760f,  0.046139f, \
                       0.070622f,  0.097139f,  0.127014f,  0.162944f,  0.212220f
#define PKV_KV_T2_256 -0.061352f, 0.0f, 0.061352f
#define PKV_KV_T3_256 -0.109068f, -0.064903f, -0.030827f, 0.0f, 0.030827f, 0.064903f, 0.109068f
#define PKV_KV_T4_256 -0.150086f, -0.115239f, -0.089815f, -0.068691f, -0.049935f, \
                      -0.032626f, -0.016096f,  0.0f,       0.016096f,  0.032626f, \
                       0.049935f,  0.068691f,  0.089815f,  0.115239f,  0.150086f

/* All centroid tables in one list (56 floats) and all threshold tables in one
 * (50 floats), 128 family first, bits 2, 3, 4 within a family; the offsets below
 * index them. */
#define PKV_KV_CENTROIDS PKV_KV_C2_128, PKV_KV_C3_128, PKV_KV_C4_128, \
                         PKV_KV_C2_256, PKV_KV_C3_256, PKV_KV_C4_256
#define PKV_KV_THRESHOLDS PKV_KV_T2_128, PKV_KV_T3_128, PKV_KV_T4_128, \
                          PKV_KV_T2_256, PKV_KV_T3_256, PKV_KV_T4_256
#define PKV_KV_CENTROID_COUNT 56u
#define PKV_KV_THRESHOLD_COUNT 50u

#if defined(PKV_HOST)
#  if defined(__GNUC__)
#    define PKV_KV_TABLE_ static const __attribute__((unused))
#  else
#    define PKV_KV_TABLE_ static const
#  endif
PKV_KV_TABLE_ float pkv_kv_centroids[PKV_KV_CENTROID_COUNT] = { PKV_KV_CENTROIDS };
PKV_KV_TABLE_ float pkv_kv_thresholds[PKV_KV_THRESHOLD_COUNT] = { PKV_KV_THRESHOLDS };
#  undef PKV_KV_TABLE_
#endif

/* Code width of a mode: 8 (q8), 4, 3 or 2; 0 for an unknown id. */
PKV_FN uint32_t pkv_kv_mode_bits(uint32_t mode) {
    switch (mode) {
    case PKV_KV_MODE_Q8: return 8u;
    case PKV_KV_MODE_FWHT4: case PKV_KV_MODE_LLOYD4: return 4u;
    case PKV_KV_MODE_FWHT3: case PKV_KV_MODE_LLOYD3: return 3u;
    case PKV_KV_MODE_FWHT2: case PKV_KV_MODE_LLOYD2: return 2u;
    default: return 0u;
    }
}

/* Rotation block of a mode: 0 (q8, none), 128 (R128 per 128-half) or 256 (R256).
 * It is also the table family the codes index. */
PKV_FN uint32_t pkv_kv_mode_rotation(uint32_t mode) {
    if (mode == PKV_KV_MODE_FWHT4 || mode == PKV_KV_MODE_FWHT2) return 128u;
    if (mode == PKV_KV_MODE_Q8 || mode >= PKV_KV_MODE_COUNT) return 0u;
    return 256u;
}

/* Bytes of one (token, kv-head) row; 0 when the mode cannot store that head_dim
 * (q8: hd % 32 == 0; fwht4/fwht2: hd 128 or 256; fwht3, lloyd*: hd 256). */
PKV_FN uint32_t pkv_kv_row_bytes(uint32_t mode, uint32_t head_dim) {
    uint32_t rot = pkv_kv_mode_rotation(mode);
    if (mode == PKV_KV_MODE_Q8)
        return head_dim > 0u && head_dim % PKV_KVQ8_BLOCK == 0u ? pkv_kvq8_row_bytes(head_dim) : 0u;
    if (rot == 0u || (head_dim != 256u && !(rot == 128u && head_dim == 128u))) return 0u;
    return PKV_KV_CNORM_BYTES + head_dim * pkv_kv_mode_bits(mode) / 8u;
}

/* Offsets of a (bits, family) table in PKV_KV_CENTROIDS / PKV_KV_THRESHOLDS. */
PKV_FN uint32_t pkv_kv_centroid_offset(uint32_t bits, uint32_t family) {
    return (family == 256u ? 28u : 0u) + (1u << bits) - 4u;
}
PKV_FN uint32_t pkv_kv_threshold_offset(uint32_t bits, uint32_t family) {
    return (family == 256u ? 25u : 0u) + (1u << bits) - bits - 2u;
}

/* Sum of squares in the order every encoder uses (CPU loops, NumPy oracle, GPU):
 * PKV_KV_SUMSQ_LANES running partials, element i into partial i % 16, in index
 * order; then partial j += partial j + w for w = 8, 4, 2, 1. n % 16 == 0. */
PKV_FN float pkv_kv_sumsq(const float *x, uint32_t n) {
    float s[PKV_KV_SUMSQ_LANES];
    for (uint32_t j = 0; j < PKV_KV_SUMSQ_LANES; ++j) s[j] = 0.0f;
    for (uint32_t i = 0; i < n; ++i) {
        float sq = x[i] * x[i];
        s[i % PKV_KV_SUMSQ_LANES] = s[i % PKV_KV_SUMSQ_LANES] + sq;
    }
    for (uint32_t w = PKV_KV_SUMSQ_LANES / 2u; w > 0u; w >>= 1)
        for (uint32_t j = 0; j < w; ++j) s[j] = s[j] + s[j + w];
    return s[0];
}

/* A code: how many of the n ascending thresholds r strictly exceeds. */
PKV_FN uint32_t pkv_kv_code(float r, const PKV_CONST float *thresholds, uint32_t n) {
    uint32_t c = 0u;
    for (uint32_t t = 0; t < n; ++t) c += r > thresholds[t] ? 1u : 0u;
    return c;
}

/* The corrected norm: norm / ||C[idx]|| (norm itself when that length is ~0). */
PKV_FN float pkv_kv_cnorm(float norm, float centroid_sumsq) {
    float rn = PKV_SQRTF(centroid_sumsq);
    return rn > PKV_KV_NORM_EPS ? norm / rn : norm;
}

/* Rotate r[0..hd) in place for a rotated mode: R256, or R128 on each 128-half. */
PKV_FN void pkv_kv_rotate(float *r, uint32_t hd, uint32_t rot) {
    if (rot == 256u) {
        pkv_fwht(r, r, 256u);
    } else {
        for (uint32_t h = 0; h < hd; h += 128u) pkv_fwht(r + h, r + h, 128u);
    }
}

PKV_FN void pkv_kv_unrotate(float *r, uint32_t hd, uint32_t rot) {
    if (rot == 256u) {
        pkv_ifwht(r, r, 256u);
    } else {
        for (uint32_t h = 0; h < hd; h += 128u) pkv_ifwht(r + h, r + h, 128u);
    }
}

/* kv_encode of one row (fwhtN / lloydN; docs/kv-quant.md "Encoding and decoding"), the scalar
 * reference of every encoder: x[hd] f32 in, row_bytes out. Scratch: r[hd], q[hd].
 * centroids / thresholds: the full PKV_KV_CENTROIDS / PKV_KV_THRESHOLDS lists. */
PKV_FN void pkv_kv_encode_row(const float *x, uint32_t hd, uint32_t mode,
                              const PKV_CONST float *centroids, const PKV_CONST float *thresholds,
                              float *r, uint8_t *q, PKV_DEVPTR uint8_t *out) {
    uint32_t bits = pkv_kv_mode_bits(mode), rot = pkv_kv_mode_rotation(mode);
    const PKV_CONST float *C = centroids + pkv_kv_centroid_offset(bits, rot);
    const PKV_CONST float *T = thresholds + pkv_kv_threshold_offset(bits, rot);
    uint32_t nt = (1u << bits) - 1u;
    float norm = PKV_SQRTF(pkv_kv_sumsq(x, hd));
    float inv = norm > PKV_KV_NORM_EPS ? 1.0f / norm : 0.0f;
    for (uint32_t d = 0; d < hd; ++d) r[d] = x[d] * inv;
    pkv_kv_rotate(r, hd, rot);
    for (uint32_t d = 0; d < hd; ++d) {
        q[d] = (uint8_t)pkv_kv_code(r[d], T, nt);
        r[d] = C[q[d]];
    }
    pkv_store_f32le(out, pkv_kv_cnorm(norm, pkv_kv_sumsq(r, hd)));
    pkv_pack_codes(q, hd, bits, out + PKV_KV_CNORM_BYTES);
}

/* Decode one rotated row: out[d] = cnorm * (R^T C[idx])[d], or cnorm * C[idx[d]] in
 * the rotated basis (what attention over compressed KV multiplies). q: hd scratch. */
PKV_FN void pkv_kv_decode_row(const PKV_DEVPTR uint8_t *rec, uint32_t hd, uint32_t mode,
                              const PKV_CONST float *centroids, int rotated_basis,
                              uint8_t *q, float *out) {
    uint32_t bits = pkv_kv_mode_bits(mode), rot = pkv_kv_mode_rotation(mode);
    const PKV_CONST float *C = centroids + pkv_kv_centroid_offset(bits, rot);
    float cnorm = pkv_load_f32le(rec);
    pkv_unpack_codes(rec + PKV_KV_CNORM_BYTES, hd, bits, q);
    for (uint32_t d = 0; d < hd; ++d) out[d] = C[q[d]];
    if (!rotated_basis) pkv_kv_unrotate(out, hd, rot);
    for (uint32_t d = 0; d < hd; ++d) out[d] = out[d] * cnorm;
}

/* Downshift one rotated row within its table family (kv_adaptive): fwht4 -> fwht2,
 * lloyd4 -> lloyd3 -> lloyd2. idx_new = idx >> (b_old - b_new);
 * norm = cnorm_old * ||C_old[idx]||, cnorm_new = norm / ||C_new[idx_new]||.
 * Scratch: q[hd] codes, v[hd] floats. */
PKV_FN void pkv_kv_downshift_row(const PKV_DEVPTR uint8_t *src, uint32_t src_mode,
                                 PKV_DEVPTR uint8_t *dst, uint32_t dst_mode, uint32_t hd,
                                 const PKV_CONST float *centroids, uint8_t *q, float *v) {
    uint32_t b0 = pkv_kv_mode_bits(src_mode), b1 = pkv_kv_mode_bits(dst_mode);
    uint32_t fam = pkv_kv_mode_rotation(src_mode);
    const PKV_CONST float *C0 = centroids + pkv_kv_centroid_offset(b0, fam);
    const PKV_CONST float *C1 = centroids + pkv_kv_centroid_offset(b1, fam);
    float cnorm = pkv_load_f32le(src);
    pkv_unpack_codes(src + PKV_KV_CNORM_BYTES, hd, b0, q);
    for (uint32_t d = 0; d < hd; ++d) v[d] = C0[q[d]];
    float norm = cnorm * PKV_SQRTF(pkv_kv_sumsq(v, hd));
    for (uint32_t d = 0; d < hd; ++d) {
        q[d] = (uint8_t)(q[d] >> (b0 - b1));
        v[d] = C1[q[d]];
    }
    pkv_store_f32le(dst, pkv_kv_cnorm(norm, pkv_kv_sumsq(v, hd)));
    pkv_pack_codes(q, hd, b1, dst + PKV_KV_CNORM_BYTES);
}

#endif /* PAGEDKV_KVQUANT_H */
