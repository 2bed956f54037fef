/* 4-bit rotated groups (MQ4G256, MQ4G256V2, MQ4CG256) decoded to the original basis in
 * one pass: decode, Rᵀ = D1 · H · D2 / 16 in registers, one store per float.
 *
 * Same bits as pkv_*_decode_group followed by the inverse rotation of fwht_loops.h
 * (the two-pass path it replaces): every weight is q * s + z (two rounded
 * operations), then w * SIGNS2 (exact), the butterflies in ascending strides, then
 * * SIGNS1/16. A butterfly inside a vector is t + y * sg with t = y[l ^ h] and sg =
 * ±1: y * sg is exact, so computing it as one fused multiply-add rounds once, as
 * the reference's a + b or a - b does. The decode of 16 codes at one (s, z) is a
 * lookup in the 16 values q * s + z (vpermps), the same two operations per value.
 */
#ifndef PAGEDKV_QUANT_MQ_DECODE_LOOPS_H
#define PAGEDKV_QUANT_MQ_DECODE_LOOPS_H

#include <string.h>
#include "pagedkv/quant.h"
#include "affine_loops.h"   /* PKV_FAMILY_* */

/* The sign tables as floats: SIGNS2 (the inverse's pre-signs) and SIGNS1/16. */
static float pkv_mqd_pre[256] __attribute__((aligned(64)));
static float pkv_mqd_post[256] __attribute__((aligned(64)));

/* Fill the tables (once, at module import, before any thread can call a decoder). */
static inline void pkv_mqd_init_tables(void) {
    for (uint32_t i = 0; i < 256u; ++i) {
        pkv_mqd_pre[i] = pkv_sign2(i);
        pkv_mqd_post[i] = pkv_sign1(i) * PKV_FWHT_SCALE_256;
    }
}

/* The group's (s, z) per 128-half as floats. */
static inline void pkv_mqd_params(const uint8_t *blk, int family, float *s, float *z) {
    if (family == PKV_FAMILY_MQ_V2) {
        s[0] = pkv_mqv2_scale(blk, 0); z[0] = pkv_mqv2_zero(blk, 0);
        s[1] = pkv_mqv2_scale(blk, 1); z[1] = pkv_mqv2_zero(blk, 1);
    } else if (family == PKV_FAMILY_MQ4C) {
        s[0] = s[1] = pkv_mqv2_scale(blk, 0);
        z[0] = z[1] = pkv_mqv2_zero(blk, 0);
    } else {
        s[0] = s[1] = pkv_hfq_scale(blk);
        z[0] = z[1] = pkv_hfq_min(blk);
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include "cpu_features.h"
#define PKV_MQD_HAVE_X86 1

#define PKV_MQD_INLINE static inline __attribute__((always_inline))
#define PKV_TGT_MQD512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl")))
#define PKV_TGT_MQD256 __attribute__((target("avx2,fma")))

/* Butterflies between the N vectors v[0..N-1], v[j] and v[j + H] for H = 1, 2, .., N/2
 * (strides of 16 H floats on 512-bit vectors, 8 H on 256-bit ones), in ascending
 * order. */
/* (Pair p of a stage is v[j], v[j + H] with j = p's bits above log2 H shifted up one, the
 * rest kept: one loop of N/2 pairs per stage, whose trip count does not depend on H. Nested
 * loops over i and j had trip counts in H, and GCC 12 unrolled them before H was known,
 * leaving guarded copies past v[N - 1] that -Warray-bounds reported.) */
#define PKV_MQD_CROSS_STAGES_(V, v, N, ADD, SUB) do {                                   \
        _Pragma("GCC unroll 4")                                                         \
        for (int H = 1; H < (N); H <<= 1) {                                             \
            _Pragma("GCC unroll 8")                                                     \
            for (int p = 0; p < (N) / 2; ++p) {                                         \
                const int j = ((p & ~(H - 1)) << 1) | (p & (H - 1));                    \
                V a_ = (v)[j], c_ = (v)[j + H];                                         \
                (v)[j] = ADD(a_, c_);                                                   \
                (v)[j + H] = SUB(a_, c_);                                               \
            }                                                                           \
        }                                                                               \
    } while (0)

/* y = t + y * sg: one in-vector butterfly stage (see the file comment). */
#define PKV_MQD_LANE_STAGE512_(v, t, h) \
    (v) = _mm512_fmadd_ps((v), sg##h, (t))

PKV_TGT_MQD512 static void pkv_mqd_groups_avx512(const uint8_t *raw, ptrdiff_t n_groups, int family,
                                                 size_t group_bytes, float *out, int stream) {
    /* sg_h: +1 on lanes whose bit h is clear, -1 where it is set */
    const __m512 sg1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
    const __m512 sg2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
    const __m512 sg4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
    const __m512 sg8 = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (ptrdiff_t g = 0; g < n_groups; ++g) {
        const uint8_t *blk = raw + (size_t)g * group_bytes;
        const uint8_t *codes = blk + PKV_AFFINE_HEADER_BYTES;
        float s[2], z[2];
        pkv_mqd_params(blk, family, s, z);
        __m512 lut[2];
        for (int h = 0; h < 2; ++h)
            lut[h] = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(s[h])), _mm512_set1_ps(z[h]));
        __m512 v[16];
        _Pragma("GCC unroll 8")
        for (int a = 0; a < 16; a += 2) {
            /* bytes 8a..8a+7 hold codes 16a..16a+15, low nibble first */
            __m128i b = _mm_loadu_si128((const __m128i *)(codes + 8 * a));
            __m128i lo = _mm_and_si128(b, m4);
            __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
            __m512i q0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
            __m512i q1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi));
            v[a] = _mm512_mul_ps(_mm512_permutexvar_ps(q0, lut[a >= 8]),
                                 _mm512_load_ps(pkv_mqd_pre + 16 * a));
            v[a + 1] = _mm512_mul_ps(_mm512_permutexvar_ps(q1, lut[a >= 8]),
                                     _mm512_load_ps(pkv_mqd_pre + 16 * a + 16));
        }
        _Pragma("GCC unroll 16")
        for (int a = 0; a < 16; ++a) {
            PKV_MQD_LANE_STAGE512_(v[a], _mm512_permute_ps(v[a], 0xB1), 1);
            PKV_MQD_LANE_STAGE512_(v[a], _mm512_permute_ps(v[a], 0x4E), 2);
            PKV_MQD_LANE_STAGE512_(v[a], _mm512_shuffle_f32x4(v[a], v[a], 0xB1), 4);
            PKV_MQD_LANE_STAGE512_(v[a], _mm512_shuffle_f32x4(v[a], v[a], 0x4E), 8);
        }
        PKV_MQD_CROSS_STAGES_(__m512, v, 16, _mm512_add_ps, _mm512_sub_ps);   /* strides 16-128 */
        float *o = out + (size_t)g * 256u;
        _Pragma("GCC unroll 16")
        for (int a = 0; a < 16; ++a) {
            __m512 r = _mm512_mul_ps(v[a], _mm512_load_ps(pkv_mqd_post + 16 * a));
            if (stream) _mm512_stream_ps(o + 16 * a, r);
            else _mm512_storeu_ps(o + 16 * a, r);
        }
    }
    if (stream) _mm_sfence();       /* streaming stores are weakly ordered */
}

/* AVX2: a group is 32 vectors of 8, and AVX2 has 16 registers: each 64-float quarter
 * goes through strides 1 .. 32 in 8 of them (1, 2, 4 inside a vector, 8 .. 32 between
 * vectors; the sign vectors and the quarter's s and z take 5 more) and waits in an L1
 * buffer; strides 64 and 128 then combine the four quarters on the way out (halves of
 * 16 vectors, as in the 512-bit kernel, spilled about 30 vectors a group to the stack;
 * quarters spill none, 0-10% faster on Zen 4, within that VM's noise). The decode is
 * q * s + z on converted codes (an 8-entry vpermps table is too small for 16 codes);
 * the codes of a vector come from one 32-bit word broadcast and shifted per lane (two
 * vector operations; nibble unpacking through 128-bit registers and vpmovzxbd took
 * about three, and the decode 10% more time on Zen 4). */
PKV_TGT_MQD256 static void pkv_mqd_groups_avx2(const uint8_t *raw, ptrdiff_t n_groups, int family,
                                               size_t group_bytes, float *out, int stream) {
    const __m256 sg1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 sg2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 sg4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    const __m256i nibble_shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i m4 = _mm256_set1_epi32(0x0F);
    float quarter_buf[256] __attribute__((aligned(32)));
    for (ptrdiff_t g = 0; g < n_groups; ++g) {
        const uint8_t *blk = raw + (size_t)g * group_bytes;
        const uint8_t *codes = blk + PKV_AFFINE_HEADER_BYTES;
        float s[2], z[2];
        pkv_mqd_params(blk, family, s, z);
        _Pragma("GCC unroll 1")         /* unrolled, GCC 12 interleaves quarters and spills */
        for (int qt = 0; qt < 4; ++qt) {
            const __m256 sv = _mm256_set1_ps(s[qt >> 1]), zv = _mm256_set1_ps(z[qt >> 1]);
            __m256 v[8];
            _Pragma("GCC unroll 8")
            for (int a = 0; a < 8; ++a) {
                /* bytes 32 qt + 4a .. +3 hold codes 64 qt + 8a .. +7, low nibble first:
                 * the word in every lane, lane j shifted right by 4j */
                uint32_t word;
                memcpy(&word, codes + 32 * qt + 4 * a, sizeof word);
                const __m256i q = _mm256_and_si256(
                    _mm256_srlv_epi32(_mm256_set1_epi32((int)word), nibble_shift), m4);
                v[a] = _mm256_mul_ps(
                    _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), sv), zv),
                    _mm256_load_ps(pkv_mqd_pre + 64 * qt + 8 * a));
            }
            _Pragma("GCC unroll 8")
            for (int a = 0; a < 8; ++a) {
                v[a] = _mm256_fmadd_ps(v[a], sg1, _mm256_permute_ps(v[a], 0xB1));
                v[a] = _mm256_fmadd_ps(v[a], sg2, _mm256_permute_ps(v[a], 0x4E));
                v[a] = _mm256_fmadd_ps(v[a], sg4, _mm256_permute2f128_ps(v[a], v[a], 0x01));
            }
            PKV_MQD_CROSS_STAGES_(__m256, v, 8, _mm256_add_ps, _mm256_sub_ps);  /* strides 8-32 */
            _Pragma("GCC unroll 8")
            for (int a = 0; a < 8; ++a) _mm256_store_ps(quarter_buf + 64 * qt + 8 * a, v[a]);
        }
        float *o = out + (size_t)g * 256u;
        _Pragma("GCC unroll 1")
        for (int a = 0; a < 8; ++a) {          /* strides 64 and 128, then SIGNS1/16 */
            __m256 q0 = _mm256_load_ps(quarter_buf + 8 * a);
            __m256 q1 = _mm256_load_ps(quarter_buf + 64 + 8 * a);
            __m256 q2 = _mm256_load_ps(quarter_buf + 128 + 8 * a);
            __m256 q3 = _mm256_load_ps(quarter_buf + 192 + 8 * a);
            __m256 t0 = _mm256_add_ps(q0, q1), t1 = _mm256_sub_ps(q0, q1);
            __m256 t2 = _mm256_add_ps(q2, q3), t3 = _mm256_sub_ps(q2, q3);
            __m256 r[4] = {_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3),
                           _mm256_sub_ps(t0, t2), _mm256_sub_ps(t1, t3)};
            _Pragma("GCC unroll 4")
            for (int k = 0; k < 4; ++k) {
                r[k] = _mm256_mul_ps(r[k], _mm256_load_ps(pkv_mqd_post + 64 * k + 8 * a));
                if (stream) _mm256_stream_ps(o + 64 * k + 8 * a, r[k]);
                else _mm256_storeu_ps(o + 64 * k + 8 * a, r[k]);
            }
        }
    }
    if (stream) _mm_sfence();
}
#endif /* x86-64 */

/* Outputs of at least this many bytes, aligned to the vector, bypass the caches
 * (streaming stores): they do not fit them anyway, and a store that misses the cache
 * otherwise reads the line first (MQ4G256V2 4096x14336, thread CPU time: 32 -> 20 ms on
 * AVX-512, 54 -> 34 ms on AVX2). NumPy's large arrays are only 16-byte aligned
 * (malloc's 16 bytes past a page), where streaming 128-bit pieces measured no faster
 * than plain stores on AVX-512: dequantize allocates its own output 64-byte aligned. */
#define PKV_MQD_STREAM_BYTES ((size_t)8 << 20)

/* Decode n_groups whole 4-bit rotated groups (family MQ_V1, MQ_V2 or MQ4C) into the
 * original basis, out[256 * n_groups], with the best one-pass kernel this CPU runs up to
 * max_level (0: none, 1: AVX2, 2: AVX-512). total_bytes: the whole output of the call
 * (of which this is a part), to choose streaming stores. Returns 0 when no kernel runs:
 * the caller then decodes and un-rotates in two passes (same bits). */
static inline int pkv_cpu_mq4_decode_original(const uint8_t *raw, ptrdiff_t n_groups, int family,
                                              float *out, int max_level, size_t total_bytes) {
#if defined(PKV_MQD_HAVE_X86)
    const size_t group_bytes = PKV_AFFINE_GROUP_BYTES(4u, 256u);
    const unsigned features = pkv_cpu_features();
    const int big = total_bytes >= PKV_MQD_STREAM_BYTES;
    if (max_level >= 2 && (features & PKV_CPU_AVX512)) {
        pkv_mqd_groups_avx512(raw, n_groups, family, group_bytes, out,
                              big && ((uintptr_t)out & 63u) == 0);
        return 1;
    }
    if (max_level >= 1 && (features & PKV_CPU_AVX2)) {
        pkv_mqd_groups_avx2(raw, n_groups, family, group_bytes, out,
                            big && ((uintptr_t)out & 31u) == 0);
        return 1;
    }
#endif
    (void)raw; (void)n_groups; (void)family; (void)out; (void)max_level; (void)total_bytes;
    return 0;
}

#endif /* PAGEDKV_QUANT_MQ_DECODE_LOOPS_H */
