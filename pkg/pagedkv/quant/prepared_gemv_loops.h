/* Int8 GEMV over the prepared layout of pagedkv/cpu_gemv.h, one kernel per ISA.
 *
 * y[b][r] = sum over spans s of r:  (float)isum * (scale_rs * dx_bs) + min'_rs * xsum_bs
 * where isum = sum_i (code_i - c) * xq_i is an exact int32 dot product of the
 * stored codes, centred on c = 2^(bits-1), with x quantized to int8 per span,
 * and min' = min + scale * c (docs/formats/cpu-gemv.md). Centring costs nothing
 * (the accumulator starts at -c * sum(xq)) and cuts the error that x's rounding
 * brings in about threefold: it is multiplied by (code - c), not by code. Lanes of
 * the integer and float vectors are tile rows, so every ISA computes the same
 * exact isum per (row, span) and then the same float operations in the same
 * order, unfused: the scalar baseline, AVX2 (vpmaddubsw), AVX-VNNI and AVX-512
 * VNNI (vpdpbusd) and NEON (sdot) give identical bits.
 *
 * Overflow: |xq| <= 127. vpmaddubsw sums two u8*s8 products into int16 with
 * saturation; nibble codes (<= 15) allow 8 of them per lane (<= 30480), 6-bit
 * codes 2 (<= 32004); Q8F16 goes through |w| * sign(x, w) (<= 32512) one at a
 * time. vpdpbusd takes u8 * s8 only, so Q8F16 codes are biased by 128 and the
 * accumulator starts at -128 * sum(xq). Every int32 sum stays below 2^24, so its
 * float conversion is exact.
 */
#ifndef PAGEDKV_QUANT_PREPARED_GEMV_LOOPS_H
#define PAGEDKV_QUANT_PREPARED_GEMV_LOOPS_H

#include <string.h>
#include "pagedkv/cpu_gemv.h"
#include "pagedkv/quant.h"
#include "cpu_simd.h"

#define PKV_PG_TR PKV_PGEMV_TILE_ROWS
#define PKV_PG_MAX_NB 8          /* x rows per pass over a tile (registers) */

/* Kernels, in increasing preference; pkv_pgemv_isa_name gives their Python names. */
enum {
    PKV_ISA_SCALAR = 0,
    PKV_ISA_AVX2 = 1,
    PKV_ISA_AVXVNNI = 2,
    PKV_ISA_AVX512VNNI = 3,
    PKV_ISA_NEON_DOTPROD = 4,
    PKV_ISA_COUNT = 5,
};

static const char *const pkv_pgemv_isa_names[PKV_ISA_COUNT] = {
    "scalar", "avx2", "avx-vnni", "avx512-vnni", "neon-dotprod",
};

/* How the scales and minimums of a prepared GEMV are stored, [tiles][spans][16] each:
 * f32; f16 bits; or (Q4K) a uint8 per span times an f32 factor per 8 spans,
 * [tiles][spans / 8][16] (a super-block's d or -dmin: the product is the one ggml's
 * decode makes, exact in f32, so each parameter is the same float as stored whole). */
enum { PKV_PG_PARAM_F32 = 0, PKV_PG_PARAM_F16 = 1, PKV_PG_PARAM_U8X8 = 2 };

/* The weights of one prepared GEMV (arrays as cpu_gemv.h lays them out). */
typedef struct {
    const uint8_t *codes;
    const void *scales;         /* as `param` says, [tiles][spans][16] */
    const void *mins;           /* same type; NULL for Q8F16 */
    const float *scale_factors; /* PKV_PG_PARAM_U8X8: [tiles][spans / 8][16]; else NULL */
    const float *min_factors;
    ptrdiff_t m, k, n_tiles, n_spans;
    uint32_t span;
    int kind;                   /* PKV_PGEMV_NIBBLE / NIBBLE32 / UBYTE / SBYTE */
    int param;                  /* PKV_PG_PARAM_* */
    int32_t center;             /* 2^(bits-1) for unsigned codes, 0 for Q8F16 */
} pkv_pgemv_w;

/* The factor of parameter element idx (= span block x 16 + row) in PKV_PG_PARAM_U8X8. */
static inline size_t pkv_pg_factor_index(size_t idx) {
    return idx / (8u * PKV_PGEMV_TILE_ROWS) * PKV_PGEMV_TILE_ROWS + idx % PKV_PGEMV_TILE_ROWS;
}

/* x quantized per span (pkv_pgemv_quantize_x), nb rows. */
typedef struct {
    const int8_t *xq;           /* [nb][ldx]: row b at xq + b * ldx, k bytes used */
    const float *dx;            /* [nb][n_spans] */
    const float *xsum;          /* [nb][n_spans] */
    const int32_t *xqsum;       /* [nb][n_spans] */
    ptrdiff_t nb;
    ptrdiff_t ldx;              /* bytes from one xq row to the next: pkv_pgemv_x_stride(k) */
} pkv_pgemv_x;

/* The xq row stride for K = k: k rounded up to 64 bytes, plus 64 when that is a multiple
 * of 1 KiB. The kernels read up to 8 x rows at the same offset in step: rows a multiple
 * of 4 KiB apart (K = 4096) share one L1 set (2 KiB: two sets, K = 14336), which an
 * 8-way L1 (Zen 4's 32 KiB) cannot hold beside the code stream. */
static inline ptrdiff_t pkv_pgemv_x_stride(ptrdiff_t k) {
    ptrdiff_t s = (k + 63) & ~(ptrdiff_t)63;
    return (s & 1023) == 0 ? s + 64 : s;
}

/* ---------------------------------------------------------------------------
 * x: int8 per span
 * ------------------------------------------------------------------------- */

typedef float pkv_pg_v16f __attribute__((vector_size(64)));

/* Quantize one row of k floats (k % span == 0, span % 16 == 0) per span:
 *   amax = max |x|, dx = amax / 127, xq = rne(x * (127 / amax)) (0 where amax == 0;
 *          where amax < 2^-118, x and amax are first multiplied by 2^64 and dx by 2^-64),
 *   xsum = the f32 sum of x over the span: 16 lanes (lane l adds x[16t + l] in
 *          order of t), then halved 16 -> 8 -> 4 -> 2 -> 1 (lane l + lane l + h),
 *   xqsum = the int sum of xq.
 * Returns -1, or the index of the first bad value (nothing else is then defined): a NaN/Inf,
 * or, in a span whose amax is 2^127 / span or more, the first value of that magnitude
 * (that span's f32 sum could overflow, and with it every output: refused, not computed). */
PKV_CPU_CLONES
static ptrdiff_t pkv_pgemv_quantize_x(const float *x, ptrdiff_t k, uint32_t span, int8_t *xq,
                                      float *dx, float *xsum, int32_t *xqsum) {
    for (ptrdiff_t s0 = 0, s = 0; s0 < k; s0 += span, ++s) {
        const float *xs = x + s0;
        uint32_t amax_bits = 0u;
        for (uint32_t i = 0; i < span; ++i) {
            uint32_t a;
            memcpy(&a, xs + i, 4);
            a &= 0x7FFFFFFFu;
            amax_bits = a > amax_bits ? a : amax_bits;
        }
        if (amax_bits >= 0x7F800000u) {
            for (uint32_t i = 0; i < span; ++i)
                if (pkv_f32_is_nonfinite(xs[i])) return s0 + (ptrdiff_t)i;
        }
        /* |xsum| <= span * amax * (1 + 2^-24)^span < FLT_MAX below this limit */
        const float limit = 0x1p127f / (float)span;
        uint32_t limit_bits;
        memcpy(&limit_bits, &limit, 4);
        if (amax_bits >= limit_bits) {
            for (uint32_t i = 0; i < span; ++i) {
                uint32_t a;
                memcpy(&a, xs + i, 4);
                if ((a & 0x7FFFFFFFu) >= limit_bits) return s0 + (ptrdiff_t)i;
            }
        }
        /* below 2^-118, 127 / amax would overflow: such a span is scaled by 2^64 first
         * (exact) and its dx by 2^-64 after */
        const int tiny = amax_bits < 0x04800000u;
        const float pre = tiny ? 0x1p64f : 1.0f;
        float amax = pkv_f32_from_bits(amax_bits) * pre;
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        dx[s] = tiny ? (amax / 127.0f) * 0x1p-64f : amax / 127.0f;
        int32_t qs = 0;
        for (uint32_t i = 0; i < span; ++i) {
            float v = (xs[i] * pre) * inv;
            /* round half to even: adding and subtracting 1.5 * 2^23 leaves the nearest
             * integer for |v| < 2^22 (default rounding mode, no -ffast-math) */
            float r = (v + 12582912.0f) - 12582912.0f;
            r = r > 127.0f ? 127.0f : r;
            r = r < -127.0f ? -127.0f : r;
            int32_t q = (int32_t)r;
            xq[s0 + i] = (int8_t)q;
            qs += q;
        }
        xqsum[s] = qs;
        pkv_pg_v16f lanes = {0};
        for (uint32_t i = 0; i < span; i += 16u) {
            pkv_pg_v16f v;
            memcpy(&v, xs + i, 64);
            lanes += v;
        }
        float l[16];
        memcpy(l, &lanes, 64);
        for (int h = 8; h >= 1; h >>= 1)
            for (int i = 0; i < h; ++i) l[i] = l[i] + l[i + h];
        xsum[s] = l[0];
    }
    return -1;
}

/* ---------------------------------------------------------------------------
 * Scalar baseline (any CPU): the definition the SIMD kernels reproduce.
 * ------------------------------------------------------------------------- */

/* Scale (or minimum) of tile row r at span block index sb = tile * n_spans + s. */
static inline float pkv_pgemv_param(const void *p, const float *factors, int param, size_t sb,
                                    uint32_t r) {
    const size_t i = sb * PKV_PG_TR + r;
    if (param == PKV_PG_PARAM_U8X8)
        return factors[pkv_pg_factor_index(i)] * (float)((const uint8_t *)p)[i];
    return param == PKV_PG_PARAM_F16 ? pkv_f16_to_f32(((const uint16_t *)p)[i])
                                     : ((const float *)p)[i];
}

/* Exact integer dot product of tile row r of one (tile, span) code block with xs. */
static inline int32_t pkv_pgemv_isum_scalar(const uint8_t *blk, int kind, uint32_t span,
                                            uint32_t r, const int8_t *xs) {
    int32_t acc = 0;
    const uint32_t row_bytes = pkv_pgemv_span_row_bytes(kind, span);
    const uint32_t half = pkv_pgemv_unit_codes(kind) / 2u;     /* nibbles: bytes per unit */
    for (uint32_t byte_in_row = 0; byte_in_row < row_bytes; ++byte_in_row) {
        uint32_t chunk = byte_in_row / PKV_PGEMV_CHUNK_BYTES, b = byte_in_row % PKV_PGEMV_CHUNK_BYTES;
        uint8_t v = blk[(chunk * PKV_PG_TR + r) * PKV_PGEMV_CHUNK_BYTES + b];
        if (pkv_pgemv_is_nibble(kind)) {
            uint32_t unit = byte_in_row / half, j = byte_in_row % half;
            const int8_t *xu = xs + unit * 2u * half;
            acc += (int32_t)(v & 15u) * xu[j] + (int32_t)(v >> 4) * xu[half + j];
        } else if (kind == PKV_PGEMV_UBYTE) {
            acc += (int32_t)v * xs[byte_in_row];
        } else {
            acc += (int32_t)(int8_t)v * xs[byte_in_row];
        }
    }
    return acc;
}

/* y_tile[b][r] for nb x rows of one tile (16 rows). */
static void pkv_pgemv_tile_scalar(const pkv_pgemv_w *w, const pkv_pgemv_x *x, ptrdiff_t b0,
                                  ptrdiff_t nb, ptrdiff_t t, float *y_tile) {
    const size_t blk_bytes = (size_t)PKV_PG_TR * pkv_pgemv_span_row_bytes(w->kind, w->span);
    for (ptrdiff_t b = 0; b < nb; ++b) {
        const ptrdiff_t xb = b0 + b;
        for (uint32_t r = 0; r < PKV_PG_TR; ++r) {
            float acc = 0.0f;
            for (ptrdiff_t s = 0; s < w->n_spans; ++s) {
                const size_t sb = (size_t)(t * w->n_spans + s);
                int32_t isum = pkv_pgemv_isum_scalar(w->codes + sb * blk_bytes, w->kind, w->span, r,
                                                     x->xq + xb * x->ldx + s * (ptrdiff_t)w->span) -
                               w->center * x->xqsum[xb * w->n_spans + s];
                float sc = pkv_pgemv_param(w->scales, w->scale_factors, w->param, sb, r);
                float sd = sc * x->dx[xb * w->n_spans + s];
                acc = acc + (float)isum * sd;
                if (w->kind != PKV_PGEMV_SBYTE) {
                    float mc = pkv_pgemv_param(w->mins, w->min_factors, w->param, sb, r) +
                               sc * (float)w->center;
                    acc = acc + mc * x->xsum[xb * w->n_spans + s];
                }
            }
            y_tile[b * PKV_PG_TR + r] = acc;
        }
    }
}

/* ---------------------------------------------------------------------------
 * x86-64
 * ------------------------------------------------------------------------- */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include "cpu_features.h"
#define PKV_PG_HAVE_X86 1

#define PKV_TGT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PKV_TGT_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define PKV_TGT_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define PKV_PG_INLINE static inline __attribute__((always_inline))

static inline int32_t pkv_pg_load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Arrays of vectors are sized by constants, never by NB: GCC keeps a fixed-size array
 * indexed by unrolled constants in registers, but a variable-length one in memory. */

/* Chunk loops are unrolled: a loop-carried vpdpbusd accumulator costs GCC 12 two
 * register copies per instruction. */
#define PKV_PG_UNROLL _Pragma("GCC unroll 16")

/* The integer part of one span for the vpdpbusd kernels: fills ia[VPL][CH][NB] with the
 * exact sums of (q - c) * xq, c folded into the start value. A chunk line of 64 bytes
 * (16 rows x 4 bytes) is VPL vectors (2 of 256 bits, 1 of 512), loaded together so one
 * x broadcast serves all 16 rows. CH accumulators per (vector, x row) keep enough
 * vpdpbusd chains (latency 5) in flight: nibbles split low/high (and, for CH 4, chunk
 * parity), bytes split chunk parity; the int32 sums are exact, so how they are split
 * changes no result. V: the vector type; LOAD, AND, SRL4, XOR, BCAST, DP: its
 * operations. */
#define PKV_PG_VNNI_SPAN_(V, VPL, LOAD, AND, SRL4, XOR, BCAST, DP, ZERO)                   \
    const int8_t *xs[PKV_PG_MAX_NB];                                                        \
    for (int b = 0; b < NB; ++b) {                                                          \
        xs[b] = x->xq + (b0 + b) * x->ldx + s * (ptrdiff_t)span;                            \
        for (int v = 0; v < VPL; ++v) {                                                     \
            ia[v][0][b] = BCAST(-c0 * x->xqsum[(b0 + b) * ns + s]);  /* every row's lane */ \
            for (int j = 1; j < CH; ++j) ia[v][j][b] = ZERO();                              \
        }                                                                                   \
    }                                                                                       \
    if (pkv_pgemv_is_nibble(KIND)) {                                                        \
        for (uint32_t u = 0; u < span / U; ++u) {                                           \
            const uint8_t *cu = cw + (size_t)u * 16u * (U / 2u);                            \
            PKV_PG_UNROLL                                                                   \
            for (uint32_t c = 0; c < U / 8u; c += (uint32_t)CH / 2u) {                      \
                for (int j = 0; j < CH / 2; ++j) {                                          \
                    V lo[VPL], hi[VPL];                                                     \
                    for (int v = 0; v < VPL; ++v) {                                         \
                        V wv = LOAD(cu + 64u * (c + j) + (64u / VPL) * v);                  \
                        lo[v] = AND(wv, m4);                                                \
                        hi[v] = AND(SRL4(wv), m4);                                          \
                    }                                                                       \
                    for (int b = 0; b < NB; ++b) {                                          \
                        const int8_t *xu = xs[b] + u * U + 4u * (c + j);                    \
                        V xl = BCAST(pkv_pg_load_i32(xu)), xh = BCAST(pkv_pg_load_i32(xu + U / 2u)); \
                        for (int v = 0; v < VPL; ++v) {                                     \
                            ia[v][2 * j][b] = DP(ia[v][2 * j][b], lo[v], xl);               \
                            ia[v][2 * j + 1][b] = DP(ia[v][2 * j + 1][b], hi[v], xh);       \
                        }                                                                   \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    } else {                                                                                \
        PKV_PG_UNROLL                                                                       \
        for (uint32_t c = 0; c < span / 4u; c += (uint32_t)CH) {                            \
            for (int j = 0; j < CH; ++j) {                                                  \
                V wv[VPL];                                                                  \
                for (int v = 0; v < VPL; ++v) {                                             \
                    wv[v] = LOAD(cw + 64u * (c + j) + (64u / VPL) * v);                     \
                    if (KIND == PKV_PGEMV_SBYTE) wv[v] = XOR(wv[v], bias);                  \
                }                                                                           \
                for (int b = 0; b < NB; ++b) {                                              \
                    V xb = BCAST(pkv_pg_load_i32(xs[b] + 4u * (c + j)));                    \
                    for (int v = 0; v < VPL; ++v) ia[v][j][b] = DP(ia[v][j][b], wv[v], xb); \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }

#define PKV_PG_LOAD256_(p) _mm256_loadu_si256((const __m256i *)(p))
#define PKV_PG_SRL4_256_(v) _mm256_srli_epi16((v), 4)
#define PKV_PG_LOAD512_(p) _mm512_loadu_si512((const void *)(p))
#define PKV_PG_SRL4_512_(v) _mm512_srli_epi16((v), 4)

/* The code stream `ahead` bytes (PKV_PG_AHEAD_BYTES, or two blocks for the AVX2 kernel's
 * 5-8 rows) past the block at byte `at` (of `blk`, in a stream of `end` bytes), one line
 * per `stride` bytes, into L2. With the weights from
 * DRAM (a model's decode step) the kernels ran ahead of the hardware prefetcher. At
 * 4096x4096 from DRAM (C harness, Zen 4, 256-code spans): AVX-512 batch 1, a line per
 * 512 bytes, 0.39 -> 0.35 ms (128-code spans 0.42 -> 0.32), batches 2 / 4 / 8, every
 * line, 0.49 / 0.64 / 1.17 -> 0.38 / 0.43 / 0.71; AVX2, every line, batch 1 0.39 ->
 * 0.34, 2 0.50 -> 0.39, 4 0.81 -> 0.62. The price, with the weights in L3: 6-13%
 * (AVX-512), 5-20% (AVX2). Every line for AVX-512 batch 1, one per 512 bytes for the
 * others, or 2-8 KiB ahead were no faster from DRAM. always_inline: a function of
 * prefetches alone has no effect GCC must keep, and its out-of-line calls are deleted. */
#define PKV_PG_AHEAD_BYTES ((size_t)16 << 10)

PKV_PG_INLINE void pkv_pg_prefetch_ahead_(const uint8_t *base, size_t end, size_t at,
                                          size_t blk, size_t ahead, size_t stride) {
    for (size_t p = (at + stride - 1) & ~(stride - 1); p < at + blk && p + ahead < end;
         p += stride)
        _mm_prefetch((const char *)(base + p + ahead), _MM_HINT_T1);
}

/* ---- 256-bit kernels (AVX2, AVX-VNNI): rows 0-7 and 8-15 of a chunk line are two
 * vectors, loaded together; 1-2 x rows per pass. The float sums live in y_tile (zeroed
 * by the caller): the 16 ymm registers hold the integer accumulators. ---- */

PKV_TGT_AVX2 PKV_PG_INLINE __m256 pkv_pg_load8_avx2(const void *p, const float *factors,
                                                    int param, size_t idx) {
    if (param == PKV_PG_PARAM_U8X8)
        return _mm256_mul_ps(_mm256_loadu_ps(factors + pkv_pg_factor_index(idx)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                 _mm_loadl_epi64((const __m128i *)((const uint8_t *)p + idx)))));
    return param == PKV_PG_PARAM_F16
        ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + idx)))
        : _mm256_loadu_ps((const float *)p + idx);
}

/* y_tile[b][8h..8h+7] += (float)isum * (scale * dx) + min' * xsum, in that order. */
PKV_TGT_AVX2 PKV_PG_INLINE void pkv_pg_float_stage8_(const pkv_pgemv_w *w, const pkv_pgemv_x *x,
                                                    ptrdiff_t b0, ptrdiff_t t, ptrdiff_t s,
                                                    uint32_t h, float *y_tile, const __m256i *isum,
                                                    const int KIND, const int NB) {
    const ptrdiff_t ns = w->n_spans;
    const size_t sb = (size_t)(t * ns + s) * PKV_PG_TR + 8u * h;
    __m256 sc = pkv_pg_load8_avx2(w->scales, w->scale_factors, w->param, sb);
    __m256 mn = KIND != PKV_PGEMV_SBYTE
        ? _mm256_add_ps(pkv_pg_load8_avx2(w->mins, w->min_factors, w->param, sb),
                        _mm256_mul_ps(sc, _mm256_set1_ps((float)w->center))) : sc;
    for (int b = 0; b < NB; ++b) {
        float *yb = y_tile + b * PKV_PG_TR + 8u * h;
        __m256 sd = _mm256_mul_ps(sc, _mm256_set1_ps(x->dx[(b0 + b) * ns + s]));
        __m256 acc = _mm256_add_ps(_mm256_loadu_ps(yb), _mm256_mul_ps(_mm256_cvtepi32_ps(isum[b]), sd));
        if (KIND != PKV_PGEMV_SBYTE)
            acc = _mm256_add_ps(acc, _mm256_mul_ps(mn, _mm256_set1_ps(x->xsum[(b0 + b) * ns + s])));
        _mm256_storeu_ps(yb, acc);
    }
}

/* An empty asm that takes v in a register: GCC 12 otherwise reassociates the int16 adds
 * of the unrolled chunks into trees and hoists every vpmaddubsw ahead of them, which
 * needs more than 16 registers and spills most of them (measured: 1.4x slower). */
#define PKV_PG_IN_REGISTER_(v) __asm__("" : "+x"(v))

/* AVX2: vpmaddubsw into int16, vpmaddwd to int32. Nibbles (1 or 2 x rows, both halves of
 * the tile at once) sum 4 chunks in int16 before widening: with 2 rows the 2 x 2 int16 and
 * 2 x 2 int32 accumulators, the 4 unpacked vectors, the mask and the x broadcasts take 15
 * of the 16 registers, which holds only with the int16 sums pinned (PKV_PG_IN_REGISTER_). */
PKV_TGT_AVX2 PKV_PG_INLINE void pkv_pg_body_avx2_(const pkv_pgemv_w *w, const pkv_pgemv_x *x,
                                                 ptrdiff_t b0, ptrdiff_t t, float *y_tile,
                                                 const int KIND, const int NB) {
    const uint32_t span = w->span;
    const ptrdiff_t ns = w->n_spans;
    const size_t blk = (size_t)PKV_PG_TR * pkv_pgemv_span_row_bytes(KIND, span);
    const uint8_t *cw = w->codes + (size_t)t * (size_t)ns * blk;
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int WIDEN = 4;
    const uint32_t U = pkv_pgemv_unit_codes(KIND);
    const size_t stream_bytes = (size_t)w->n_tiles * (size_t)ns * blk;
    for (ptrdiff_t s = 0; s < ns; ++s, cw += blk) {
        __m256i i32[2][2];
        const int8_t *xs[2];
        pkv_pg_prefetch_ahead_(w->codes, stream_bytes, (size_t)(cw - w->codes), blk,
                               PKV_PG_AHEAD_BYTES, 64u);
        for (int b = 0; b < NB; ++b) {
            xs[b] = x->xq + (b0 + b) * x->ldx + s * (ptrdiff_t)span;
            i32[0][b] = _mm256_set1_epi32(-w->center * x->xqsum[(b0 + b) * ns + s]);
            i32[1][b] = i32[0][b];
        }
        if (pkv_pgemv_is_nibble(KIND)) {
            for (uint32_t u = 0; u < span / U; ++u) {
                const uint8_t *cu = cw + (size_t)u * 16u * (U / 2u);
                for (uint32_t c0 = 0; c0 < U / 8u; c0 += (uint32_t)WIDEN) {
                    __m256i i16[2][2];
                    for (int b = 0; b < NB; ++b) i16[0][b] = i16[1][b] = _mm256_setzero_si256();
                    for (uint32_t c = c0; c < c0 + (uint32_t)WIDEN; ++c) {
                        __m256i lo[2], hi[2];
                        for (int h = 0; h < 2; ++h) {
                            __m256i wv = PKV_PG_LOAD256_(cu + 64u * c + 32u * h);
                            lo[h] = _mm256_and_si256(wv, m4);
                            hi[h] = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
                        }
                        for (int b = 0; b < NB; ++b) {
                            const int8_t *xu = xs[b] + u * U + 4u * c;
                            __m256i xl = _mm256_set1_epi32(pkv_pg_load_i32(xu));
                            __m256i xh = _mm256_set1_epi32(pkv_pg_load_i32(xu + U / 2u));
                            for (int h = 0; h < 2; ++h) {
                                i16[h][b] = _mm256_add_epi16(i16[h][b], _mm256_maddubs_epi16(lo[h], xl));
                                i16[h][b] = _mm256_add_epi16(i16[h][b], _mm256_maddubs_epi16(hi[h], xh));
                                PKV_PG_IN_REGISTER_(i16[h][b]);
                            }
                        }
                    }
                    for (int b = 0; b < NB; ++b)
                        for (int h = 0; h < 2; ++h)
                            i32[h][b] = _mm256_add_epi32(i32[h][b], _mm256_madd_epi16(i16[h][b], ones));
                }
            }
        } else {
            for (uint32_t c = 0; c < span / 4u; c += 2u) {
                __m256i wv[2][2], av[2][2];
                for (int h = 0; h < 2; ++h)
                    for (int j = 0; j < 2; ++j) {
                        wv[h][j] = PKV_PG_LOAD256_(cw + 64u * (c + j) + 32u * h);
                        /* Q8F16: |w| * sign(x, w), a u8 * s8 product */
                        av[h][j] = KIND == PKV_PGEMV_SBYTE ? _mm256_sign_epi8(wv[h][j], wv[h][j])
                                                           : wv[h][j];
                    }
                for (int b = 0; b < NB; ++b) {
                    __m256i x0 = _mm256_set1_epi32(pkv_pg_load_i32(xs[b] + 4u * c));
                    __m256i x1 = _mm256_set1_epi32(pkv_pg_load_i32(xs[b] + 4u * c + 4u));
                    for (int h = 0; h < 2; ++h) {
                        if (KIND == PKV_PGEMV_UBYTE) {      /* 2 x 63 x 127 x 2 fits int16 */
                            __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(av[h][0], x0),
                                                         _mm256_maddubs_epi16(av[h][1], x1));
                            i32[h][b] = _mm256_add_epi32(i32[h][b], _mm256_madd_epi16(p, ones));
                        } else {
                            __m256i p0 = _mm256_maddubs_epi16(av[h][0], _mm256_sign_epi8(x0, wv[h][0]));
                            __m256i p1 = _mm256_maddubs_epi16(av[h][1], _mm256_sign_epi8(x1, wv[h][1]));
                            i32[h][b] = _mm256_add_epi32(i32[h][b], _mm256_add_epi32(
                                _mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones)));
                        }
                    }
                }
            }
        }
        for (int h = 0; h < 2; ++h) pkv_pg_float_stage8_(w, x, b0, t, s, (uint32_t)h, y_tile, i32[h], KIND, NB);
    }
}

/* AVX2, nibble codes, 3-8 x rows: the unpacking of each code vector (and, shift, and) is
 * done once for a group of up to 4 x rows, which then cost 2 vpmaddubsw + 2 int16 adds
 * per 64 codes each. One half-tile (8 rows, one 256-bit vector per chunk line) at a time,
 * so the int16 and int32 accumulators of 4 x rows (2 per row), the unpacked codes, the
 * mask and the x broadcasts fit the 16 ymm registers; 5-8 x rows are two groups in the
 * same span, whose 2 KiB of codes the second group then reads from L1. Each int16 lane
 * sums 4 chunks (8 vpmaddubsw lanes of at most 2 x 15 x 127: 30480 <= 32767) before one
 * vpmaddwd widens it. The sums are exact, so the split changes no bit: the float stage
 * then runs per half exactly as the one-row kernel does. */

/* i32[g] = start[g] + sum of (code) * xq over half h of one span's code block cw, for the
 * G x rows xs[0..G-1]. */
PKV_TGT_AVX2 PKV_PG_INLINE void pkv_pg_nib_group_avx2_(const uint8_t *cw, uint32_t span, uint32_t h,
                                                      const int8_t *const *xs,
                                                      const int32_t *start, __m256i *i32,
                                                      const int KIND, const int G) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const uint32_t U = pkv_pgemv_unit_codes(KIND);
    for (int g = 0; g < G; ++g) i32[g] = _mm256_set1_epi32(start[g]);
    for (uint32_t u = 0; u < span / U; ++u) {
        const uint8_t *cu = cw + (size_t)u * 16u * (U / 2u) + 32u * h;
        for (uint32_t c0 = 0; c0 < U / 8u; c0 += 4u) {
            __m256i i16[4];
            for (int g = 0; g < G; ++g) i16[g] = _mm256_setzero_si256();
            for (uint32_t c = c0; c < c0 + 4u; ++c) {
                __m256i wv = PKV_PG_LOAD256_(cu + 64u * c);
                __m256i lo = _mm256_and_si256(wv, m4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
                for (int g = 0; g < G; ++g) {
                    const int8_t *xu = xs[g] + u * U + 4u * c;
                    i16[g] = _mm256_add_epi16(i16[g], _mm256_maddubs_epi16(
                        lo, _mm256_set1_epi32(pkv_pg_load_i32(xu))));
                    i16[g] = _mm256_add_epi16(i16[g], _mm256_maddubs_epi16(
                        hi, _mm256_set1_epi32(pkv_pg_load_i32(xu + U / 2u))));
                    PKV_PG_IN_REGISTER_(i16[g]);
                }
            }
            for (int g = 0; g < G; ++g)
                i32[g] = _mm256_add_epi32(i32[g], _mm256_madd_epi16(i16[g], ones));
        }
    }
}

PKV_TGT_AVX2 PKV_PG_INLINE void pkv_pg_body_avx2_nib_(const pkv_pgemv_w *w, const pkv_pgemv_x *x,
                                                     ptrdiff_t b0, ptrdiff_t t, float *y_tile,
                                                     const int KIND, const int NB) {
    const int G0 = NB > 4 ? 4 : NB, G1 = NB - G0;      /* x rows of the two groups */
    const uint32_t span = w->span;
    const ptrdiff_t ns = w->n_spans;
    const size_t blk = (size_t)PKV_PG_TR * pkv_pgemv_span_row_bytes(KIND, span);
    const uint8_t *cw = w->codes + (size_t)t * (size_t)ns * blk;
    for (ptrdiff_t s = 0; s < ns; ++s, cw += blk) {
        const int8_t *xs[PKV_PG_MAX_NB];
        int32_t start[PKV_PG_MAX_NB];
        /* two groups walk each block four times, twice backwards, which the hardware
         * prefetcher does not follow: fetch the block two ahead (in memory order, across
         * tiles) into L2. Into L1 and one ahead, as first written, the 32 lines of a
         * 256-code span overran the L1's misses in flight: from DRAM batch 8 at 4096^2
         * took 1.84 ms against 1.20 now (HFQ4G256; MQ V2's 1 KiB blocks 1.40 -> 1.31; in
         * L3 1.20 -> 1.15 and 1.29 -> 1.27; C harness, Zen 4). One group (3-4 rows)
         * walks each block twice, forwards: it takes the usual lead. */
        pkv_pg_prefetch_ahead_(w->codes, (size_t)w->n_tiles * (size_t)ns * blk,
                               (size_t)(cw - w->codes), blk,
                               G1 > 0 ? 2 * blk : PKV_PG_AHEAD_BYTES, 64u);
        for (int b = 0; b < NB; ++b) {
            xs[b] = x->xq + (b0 + b) * x->ldx + s * (ptrdiff_t)span;
            start[b] = -w->center * x->xqsum[(b0 + b) * ns + s];
        }
        for (uint32_t h = 0; h < 2u; ++h) {
            __m256i i32[4];
            pkv_pg_nib_group_avx2_(cw, span, h, xs, start, i32, KIND, G0);
            pkv_pg_float_stage8_(w, x, b0, t, s, h, y_tile, i32, KIND, G0);
            if (G1 > 0) {
                pkv_pg_nib_group_avx2_(cw, span, h, xs + G0, start + G0, i32, KIND, G1);
                pkv_pg_float_stage8_(w, x, b0 + G0, t, s, h, y_tile + G0 * PKV_PG_TR, i32,
                                     KIND, G1);
            }
        }
    }
}

/* AVX-VNNI: vpdpbusd on 256-bit vectors; Q8F16 codes biased by 128 (accumulator starts
 * at -128 * sum(xq)). */
PKV_TGT_AVXVNNI PKV_PG_INLINE void pkv_pg_body_avxvnni_(const pkv_pgemv_w *w, const pkv_pgemv_x *x,
                                                       ptrdiff_t b0, ptrdiff_t t, float *y_tile,
                                                       const int KIND, const int NB) {
    const int CH = 2;
    const uint32_t span = w->span;
    const ptrdiff_t ns = w->n_spans;
    const size_t blk = (size_t)PKV_PG_TR * pkv_pgemv_span_row_bytes(KIND, span);
    const uint8_t *cw = w->codes + (size_t)t * (size_t)ns * blk;
    const __m256i m4 = _mm256_set1_epi8(0x0F), bias = _mm256_set1_epi8((char)0x80);
    const int32_t c0 = KIND == PKV_PGEMV_SBYTE ? 128 : w->center;
    const uint32_t U = pkv_pgemv_unit_codes(KIND);
    for (ptrdiff_t s = 0; s < ns; ++s, cw += blk) {
        __m256i ia[2][2][2];
        PKV_PG_VNNI_SPAN_(__m256i, 2, PKV_PG_LOAD256_, _mm256_and_si256, PKV_PG_SRL4_256_,
                          _mm256_xor_si256, _mm256_set1_epi32, _mm256_dpbusd_avx_epi32,
                          _mm256_setzero_si256)
        for (int h = 0; h < 2; ++h) {
            __m256i isum[2];
            for (int b = 0; b < NB; ++b) isum[b] = _mm256_add_epi32(ia[h][0][b], ia[h][1][b]);
            pkv_pg_float_stage8_(w, x, b0, t, s, (uint32_t)h, y_tile, isum, KIND, NB);
        }
    }
}

/* ---- 512-bit kernel (AVX-512 VNNI): a whole tile per vector, up to 8 x rows ---- */

PKV_TGT_AVX512 PKV_PG_INLINE __m512 pkv_pg_load16_avx512(const void *p, const float *factors,
                                                        int param, size_t idx) {
    if (param == PKV_PG_PARAM_U8X8)
        return _mm512_mul_ps(_mm512_loadu_ps(factors + pkv_pg_factor_index(idx)),
                             _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                 _mm_loadu_si128((const __m128i *)((const uint8_t *)p + idx)))));
    return param == PKV_PG_PARAM_F16
        ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + idx)))
        : _mm512_loadu_ps((const float *)p + idx);
}

PKV_TGT_AVX512 PKV_PG_INLINE void pkv_pg_body_avx512_(const pkv_pgemv_w *w, const pkv_pgemv_x *x,
                                                     ptrdiff_t b0, ptrdiff_t t, float *y_tile,
                                                     const int KIND, const int NB) {
    const int CH = NB <= 2 ? 4 : 2;         /* vpdpbusd chains per x row */
    const uint32_t span = w->span;
    const ptrdiff_t ns = w->n_spans;
    const size_t blk = (size_t)PKV_PG_TR * pkv_pgemv_span_row_bytes(KIND, span);
    const uint8_t *cw = w->codes + (size_t)t * (size_t)ns * blk;
    const __m512i m4 = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8((char)0x80);
    const int32_t c0 = KIND == PKV_PGEMV_SBYTE ? 128 : w->center;
    const uint32_t U = pkv_pgemv_unit_codes(KIND);
    __m512 acc[PKV_PG_MAX_NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm512_setzero_ps();
    const size_t stream_bytes = (size_t)w->n_tiles * (size_t)ns * blk;
    for (ptrdiff_t s = 0; s < ns; ++s, cw += blk) {
        __m512i ia[1][4][PKV_PG_MAX_NB];
        /* a line per 512 bytes at batch 1 (the hardware fetches the rest), except for
         * Q4K's 256-byte span blocks, whose float epilogue per 32 codes leaves the stream
         * behind: every line there (from DRAM, 4096²: 0.58 -> 0.48 ms) */
        pkv_pg_prefetch_ahead_(w->codes, stream_bytes, (size_t)(cw - w->codes), blk,
                               PKV_PG_AHEAD_BYTES,
                               NB == 1 && KIND != PKV_PGEMV_NIBBLE32 ? 512u : 64u);
        PKV_PG_VNNI_SPAN_(__m512i, 1, PKV_PG_LOAD512_, _mm512_and_si512, PKV_PG_SRL4_512_,
                          _mm512_xor_si512, _mm512_set1_epi32, _mm512_dpbusd_epi32,
                          _mm512_setzero_si512)
        const size_t sb = (size_t)(t * ns + s) * PKV_PG_TR;
        __m512 sc = pkv_pg_load16_avx512(w->scales, w->scale_factors, w->param, sb);
        __m512 mn = KIND != PKV_PGEMV_SBYTE
            ? _mm512_add_ps(pkv_pg_load16_avx512(w->mins, w->min_factors, w->param, sb),
                            _mm512_mul_ps(sc, _mm512_set1_ps((float)w->center))) : sc;
        for (int b = 0; b < NB; ++b) {
            __m512i isum = ia[0][0][b];
            for (int j = 1; j < CH; ++j) isum = _mm512_add_epi32(isum, ia[0][j][b]);
            __m512 sd = _mm512_mul_ps(sc, _mm512_set1_ps(x->dx[(b0 + b) * ns + s]));
            acc[b] = _mm512_add_ps(acc[b], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), sd));
            if (KIND != PKV_PGEMV_SBYTE)
                acc[b] = _mm512_add_ps(acc[b], _mm512_mul_ps(mn, _mm512_set1_ps(x->xsum[(b0 + b) * ns + s])));
        }
    }
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(y_tile + b * PKV_PG_TR, acc[b]);
}

/* Dispatch on (kind, x rows) so each body is compiled with both as constants. */
#define PKV_PG_KIND_SWITCH_(BODY, N) do { \
        if (w->kind == PKV_PGEMV_NIBBLE) BODY(PKV_PGEMV_NIBBLE, N); \
        else if (w->kind == PKV_PGEMV_NIBBLE32) BODY(PKV_PGEMV_NIBBLE32, N); \
        else if (w->kind == PKV_PGEMV_UBYTE) BODY(PKV_PGEMV_UBYTE, N); \
        else BODY(PKV_PGEMV_SBYTE, N); \
    } while (0)
/* The 256-bit kernels take 1-2 x rows per pass (their registers hold no more): a
 * further pass over the tile reads its codes from L1/L2 again. */
#define PKV_PG_NB2_SWITCH_(BODY, n) do { \
        if ((n) == 1) PKV_PG_KIND_SWITCH_(BODY, 1); \
        else PKV_PG_KIND_SWITCH_(BODY, 2); \
    } while (0)

#define PKV_PG_AVX2_(KIND, N) pkv_pg_body_avx2_(w, x, b0 + bb, t, y_tile + bb * PKV_PG_TR, KIND, N)
#define PKV_PG_AVX2_NIB_(N) pkv_pg_body_avx2_nib_(w, x, b0, t, y_tile, KIND, N)
/* Nibble codes: all x rows of the tile in one pass: 1-2 rows in the body that runs both
 * halves at once, 3-8 in the half-tile body (groups of up to 4). Byte codes: 1-2 rows per
 * pass (they have no unpacking to share). */
#define PKV_PG_AVX2_NIB_SWITCH_(KIND_) do { \
        const int KIND = (KIND_); \
        switch (nb) { \
        case 1: { const ptrdiff_t bb = 0; PKV_PG_AVX2_(KIND, 1); break; } \
        case 2: { const ptrdiff_t bb = 0; PKV_PG_AVX2_(KIND, 2); break; } \
        case 3: PKV_PG_AVX2_NIB_(3); break; \
        case 4: PKV_PG_AVX2_NIB_(4); break; \
        case 5: PKV_PG_AVX2_NIB_(5); break; \
        case 6: PKV_PG_AVX2_NIB_(6); break; \
        case 7: PKV_PG_AVX2_NIB_(7); break; \
        default: PKV_PG_AVX2_NIB_(8); break; \
        } \
    } while (0)
PKV_TGT_AVX2 static void pkv_pgemv_tile_avx2(const pkv_pgemv_w *w, const pkv_pgemv_x *x,
                                             ptrdiff_t b0, ptrdiff_t nb, ptrdiff_t t, float *y_tile) {
    if (w->kind == PKV_PGEMV_NIBBLE) {
        PKV_PG_AVX2_NIB_SWITCH_(PKV_PGEMV_NIBBLE);
        return;
    }
    if (w->kind == PKV_PGEMV_NIBBLE32) {
        PKV_PG_AVX2_NIB_SWITCH_(PKV_PGEMV_NIBBLE32);
        return;
    }
    for (ptrdiff_t bb = 0; bb < nb; bb += 2) PKV_PG_NB2_SWITCH_(PKV_PG_AVX2_, nb - bb);
}

#define PKV_PG_AVXVNNI_(KIND, N) \
    pkv_pg_body_avxvnni_(w, x, b0 + bb, t, y_tile + bb * PKV_PG_TR, KIND, N)
PKV_TGT_AVXVNNI static void pkv_pgemv_tile_avxvnni(const pkv_pgemv_w *w, const pkv_pgemv_x *x,
                                                   ptrdiff_t b0, ptrdiff_t nb, ptrdiff_t t,
                                                   float *y_tile) {
    for (ptrdiff_t bb = 0; bb < nb; bb += 2) PKV_PG_NB2_SWITCH_(PKV_PG_AVXVNNI_, nb - bb);
}

#define PKV_PG_AVX512_(KIND, N) pkv_pg_body_avx512_(w, x, b0, t, y_tile, KIND, N)
PKV_TGT_AVX512 static void pkv_pgemv_tile_avx512(const pkv_pgemv_w *w, const pkv_pgemv_x *x,
                                                 ptrdiff_t b0, ptrdiff_t nb, ptrdiff_t t,
                                                 float *y_tile) {
    switch (nb) {
    case 1: PKV_PG_KIND_SWITCH_(PKV_PG_AVX512_, 1); break;
    case 2: PKV_PG_KIND_SWITCH_(PKV_PG_AVX512_, 2); break;
    case 3: PKV_PG_KIND_SWITCH_(PKV_PG_AVX512_, 3); break;
    case 4: PKV_PG_KIND_SWITCH_(PKV_PG_AVX512_, 4); break;
    case 5: PKV_PG_KIND_SWITCH_(PKV_PG_AVX512_, 5); break;
    case 6: PKV_PG_KIND_SWITCH_(PKV_PG_AVX512_, 6); break;
    case 7: PKV_PG_KIND_SWITCH_(PKV_PG_AVX512_, 7); break;
    default: PKV_PG_KIND_SWITCH_(PKV_PG_AVX512_, 8); break;
    }
}

#endif /* x86-64 */

/* ---------------------------------------------------------------------------
 * arm64 with the dot-product extension (sdot): four rows per 128-bit vector
 * ------------------------------------------------------------------------- */
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#include <arm_neon.h>
#define PKV_PG_HAVE_NEON 1
#if defined(__clang__)
#  define PKV_TGT_DOTPROD __attribute__((target("dotprod")))
#else
#  define PKV_TGT_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#endif
#define PKV_PG_INLINE_ARM static inline __attribute__((always_inline))

PKV_TGT_DOTPROD PKV_PG_INLINE_ARM float32x4_t pkv_pg_load4_neon(const void *p, const float *factors,
                                                              int param, size_t idx) {
    if (param == PKV_PG_PARAM_U8X8) {
        uint32_t four;                          /* 4 bytes: the last block ends there */
        memcpy(&four, (const uint8_t *)p + idx, sizeof four);
        const uint16x8_t wide = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(four)));
        return vmulq_f32(vld1q_f32(factors + pkv_pg_factor_index(idx)),
                         vcvtq_f32_u32(vmovl_u16(vget_low_u16(wide))));
    }
    return param == PKV_PG_PARAM_F16
        ? vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p + idx)))
        : vld1q_f32((const float *)p + idx);
}

/* acc += sdot(a, b). GCC's arm_neon.h enables vdotq_s32 per function; clang's (up to
 * 15 at least) only when the whole file is built with +dotprod, so clang gets the
 * instruction as inline assembly. */
PKV_TGT_DOTPROD PKV_PG_INLINE_ARM int32x4_t pkv_pg_sdot(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__clang__) && !defined(__ARM_FEATURE_DOTPROD)
    __asm__("sdot %0.4s, %1.16b, %2.16b" : "+w"(acc) : "w"(a), "w"(b));
    return acc;
#else
    return vdotq_s32(acc, a, b);
#endif
}

PKV_TGT_DOTPROD PKV_PG_INLINE_ARM int8x16_t pkv_pg_bcast4_neon(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return vreinterpretq_s8_s32(vdupq_n_s32(v));
}

/* Row quad q (rows 4q..4q+3) of one tile. sdot multiplies signed bytes: codes of up to
 * 6 bits and Q8F16 codes go in as they are, so no bias is needed. */
PKV_TGT_DOTPROD PKV_PG_INLINE_ARM void pkv_pg_body_neon_(const pkv_pgemv_w *w, const pkv_pgemv_x *x,
                                                        ptrdiff_t b0, ptrdiff_t t, uint32_t q,
                                                        float *y_tile, const int KIND, const int NB) {
    const uint32_t span = w->span;
    const ptrdiff_t ns = w->n_spans;
    const size_t blk = (size_t)PKV_PG_TR * pkv_pgemv_span_row_bytes(KIND, span);
    const uint8_t *cw = w->codes + (size_t)t * (size_t)ns * blk + 16u * q;
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    float32x4_t acc[PKV_PG_MAX_NB];
    for (int b = 0; b < NB; ++b) acc[b] = vdupq_n_f32(0.0f);
    for (ptrdiff_t s = 0; s < ns; ++s, cw += blk) {
        int32x4_t i0[PKV_PG_MAX_NB], i1[PKV_PG_MAX_NB];
        const int8_t *xs[PKV_PG_MAX_NB];
        for (int b = 0; b < NB; ++b) {
            xs[b] = x->xq + (b0 + b) * x->ldx + s * (ptrdiff_t)span;
            i0[b] = vdupq_n_s32(-w->center * x->xqsum[(b0 + b) * ns + s]);
            i1[b] = vdupq_n_s32(0);
        }
        if (pkv_pgemv_is_nibble(KIND)) {
            const uint32_t U = pkv_pgemv_unit_codes(KIND);
            for (uint32_t u = 0; u < span / U; ++u) {
                const uint8_t *cu = cw + (size_t)u * 16u * (U / 2u);
                for (uint32_t c = 0; c < U / 8u; ++c) {
                    uint8x16_t wv = vld1q_u8(cu + 64u * c);
                    int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(wv, m4));
                    int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(wv, 4));
                    for (int b = 0; b < NB; ++b) {
                        const int8_t *xu = xs[b] + u * U + 4u * c;
                        i0[b] = pkv_pg_sdot(i0[b], lo, pkv_pg_bcast4_neon(xu));
                        i1[b] = pkv_pg_sdot(i1[b], hi, pkv_pg_bcast4_neon(xu + U / 2u));
                    }
                }
            }
        } else {
            for (uint32_t c = 0; c < span / 4u; c += 2u) {
                int8x16_t w0 = vreinterpretq_s8_u8(vld1q_u8(cw + 64u * c));
                int8x16_t w1 = vreinterpretq_s8_u8(vld1q_u8(cw + 64u * c + 64u));
                for (int b = 0; b < NB; ++b) {
                    i0[b] = pkv_pg_sdot(i0[b], w0, pkv_pg_bcast4_neon(xs[b] + 4u * c));
                    i1[b] = pkv_pg_sdot(i1[b], w1, pkv_pg_bcast4_neon(xs[b] + 4u * c + 4u));
                }
            }
        }
        const size_t sb = (size_t)(t * ns + s) * PKV_PG_TR + 4u * q;
        float32x4_t sc = pkv_pg_load4_neon(w->scales, w->scale_factors, w->param, sb);
        float32x4_t mn = KIND != PKV_PGEMV_SBYTE
            ? vaddq_f32(pkv_pg_load4_neon(w->mins, w->min_factors, w->param, sb),
                        vmulq_f32(sc, vdupq_n_f32((float)w->center))) : sc;
        for (int b = 0; b < NB; ++b) {
            float32x4_t sd = vmulq_f32(sc, vdupq_n_f32(x->dx[(b0 + b) * ns + s]));
            float32x4_t f = vcvtq_f32_s32(vaddq_s32(i0[b], i1[b]));
            acc[b] = vaddq_f32(acc[b], vmulq_f32(f, sd));
            if (KIND != PKV_PGEMV_SBYTE)
                acc[b] = vaddq_f32(acc[b], vmulq_f32(mn, vdupq_n_f32(x->xsum[(b0 + b) * ns + s])));
        }
    }
    for (int b = 0; b < NB; ++b) vst1q_f32(y_tile + b * PKV_PG_TR + 4u * q, acc[b]);
}

#define PKV_PG_NB_SWITCH_(CALL) \
    switch (nb) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; \
    case 7: CALL(7); break; default: CALL(8); break; \
    }
#define PKV_PG_NEON_NIB(N) for (uint32_t q = 0; q < 4u; ++q) pkv_pg_body_neon_(w, x, b0, t, q, y_tile, PKV_PGEMV_NIBBLE, N)
#define PKV_PG_NEON_NIB32(N) for (uint32_t q = 0; q < 4u; ++q) pkv_pg_body_neon_(w, x, b0, t, q, y_tile, PKV_PGEMV_NIBBLE32, N)
#define PKV_PG_NEON_UB(N) for (uint32_t q = 0; q < 4u; ++q) pkv_pg_body_neon_(w, x, b0, t, q, y_tile, PKV_PGEMV_UBYTE, N)
#define PKV_PG_NEON_SB(N) for (uint32_t q = 0; q < 4u; ++q) pkv_pg_body_neon_(w, x, b0, t, q, y_tile, PKV_PGEMV_SBYTE, N)

PKV_TGT_DOTPROD static void pkv_pgemv_tile_neon(const pkv_pgemv_w *w, const pkv_pgemv_x *x, ptrdiff_t b0,
                                                ptrdiff_t nb, ptrdiff_t t, float *y_tile) {
    if (w->kind == PKV_PGEMV_NIBBLE) {
        PKV_PG_NB_SWITCH_(PKV_PG_NEON_NIB)
    } else if (w->kind == PKV_PGEMV_NIBBLE32) {
        PKV_PG_NB_SWITCH_(PKV_PG_NEON_NIB32)
    } else if (w->kind == PKV_PGEMV_UBYTE) {
        PKV_PG_NB_SWITCH_(PKV_PG_NEON_UB)
    } else {
        PKV_PG_NB_SWITCH_(PKV_PG_NEON_SB)
    }
}

#if defined(__linux__)
#  include <sys/auxv.h>
#  ifndef HWCAP_ASIMDDP
#    define HWCAP_ASIMDDP (1 << 20)
#  endif
#elif defined(__APPLE__)
#  include <sys/sysctl.h>
#endif
#endif /* aarch64 */

/* ---------------------------------------------------------------------------
 * Dispatch
 * ------------------------------------------------------------------------- */

/* Whether this CPU (and OS) runs kernel `isa`. */
static inline int pkv_pgemv_isa_supported(int isa) {
    switch (isa) {
    case PKV_ISA_SCALAR:
        return 1;
#if defined(PKV_PG_HAVE_X86)
    case PKV_ISA_AVX2:
        return (pkv_cpu_features() & PKV_CPU_AVX2) != 0;
    case PKV_ISA_AVXVNNI:
        return (pkv_cpu_features() & PKV_CPU_AVXVNNI) != 0;
    case PKV_ISA_AVX512VNNI:
        return (pkv_cpu_features() & PKV_CPU_AVX512VNNI) != 0;
#endif
#if defined(PKV_PG_HAVE_NEON)
    case PKV_ISA_NEON_DOTPROD: {
#  if defined(__linux__)
        return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#  elif defined(__APPLE__)
        int v = 0;
        size_t len = sizeof v;
        if (sysctlbyname("hw.optional.arm.FEAT_DotProd", &v, &len, NULL, 0) != 0) return 0;
        return v != 0;
#  else
        return 0;
#  endif
    }
#endif
    default:
        return 0;
    }
}

/* The most capable supported kernel. */
static inline int pkv_pgemv_best_isa(void) {
    for (int isa = PKV_ISA_COUNT - 1; isa > PKV_ISA_SCALAR; --isa)
        if (pkv_pgemv_isa_supported(isa)) return isa;
    return PKV_ISA_SCALAR;
}

/* y[b][r] (row stride ldy) for tiles [t0, t1) and all nb rows of x, with kernel `isa`
 * (which must be supported). x rows go 8 at a time over each tile, so a tile's codes
 * are read from memory once and from cache for the next 8 rows. */
static void pkv_pgemv_tiles(const pkv_pgemv_w *w, const pkv_pgemv_x *x, float *y, ptrdiff_t ldy,
                            ptrdiff_t t0, ptrdiff_t t1, int isa) {
    float y_tile[PKV_PG_MAX_NB * PKV_PG_TR];
    for (ptrdiff_t t = t0; t < t1; ++t) {
        for (ptrdiff_t b0 = 0; b0 < x->nb; b0 += PKV_PG_MAX_NB) {
            ptrdiff_t nb = x->nb - b0 < PKV_PG_MAX_NB ? x->nb - b0 : PKV_PG_MAX_NB;
            memset(y_tile, 0, sizeof y_tile);       /* the 256-bit kernels add into it */
            switch (isa) {
#if defined(PKV_PG_HAVE_X86)
            case PKV_ISA_AVX2: pkv_pgemv_tile_avx2(w, x, b0, nb, t, y_tile); break;
            case PKV_ISA_AVXVNNI: pkv_pgemv_tile_avxvnni(w, x, b0, nb, t, y_tile); break;
            case PKV_ISA_AVX512VNNI: pkv_pgemv_tile_avx512(w, x, b0, nb, t, y_tile); break;
#endif
#if defined(PKV_PG_HAVE_NEON)
            case PKV_ISA_NEON_DOTPROD: pkv_pgemv_tile_neon(w, x, b0, nb, t, y_tile); break;
#endif
            default: pkv_pgemv_tile_scalar(w, x, b0, nb, t, y_tile); break;
            }
            ptrdiff_t r0 = t * (ptrdiff_t)PKV_PG_TR;
            ptrdiff_t rows = w->m - r0 < (ptrdiff_t)PKV_PG_TR ? w->m - r0 : (ptrdiff_t)PKV_PG_TR;
            for (ptrdiff_t b = 0; b < nb; ++b)
                memcpy(y + (b0 + b) * ldy + r0, y_tile + b * PKV_PG_TR, (size_t)rows * sizeof(float));
        }
    }
}

#endif /* PAGEDKV_QUANT_PREPARED_GEMV_LOOPS_H */
