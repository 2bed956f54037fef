/* Row loops of the rotated KV modes (fwhtN K, lloydN V) for the CPU, compiled per
 * ISA level (cpu_simd.h); the math is pagedkv/kvquant.h's pkv_kv_encode_row.
 *
 * A row of 128 or 256 values lives in 8 or 16 vectors of 16 lanes. Every step does
 * what the scalar reference does to each element, in the same order: the norm's 16
 * partial sums are the 16 lanes (element i into lane i % 16, rows of vectors in
 * index order) and are folded 8, 4, 2, 1 as in pkv_kv_sumsq; the rotation is
 * fwht_loops.h's (bit-exact with pkv_fwht); a code is a binary search over the
 * thresholds (the same count) and C[code] a lane permute (a selection, so exact). Tests
 * compare these loops with the scalar reference and the NumPy oracle byte for byte.
 */
#ifndef PAGEDKV_QUANT_KV_ROTATED_LOOPS_H
#define PAGEDKV_QUANT_KV_ROTATED_LOOPS_H

#include <string.h>
#include "pagedkv/kvquant.h"
#include "cpu_simd.h"
#include "fwht_loops.h"
#include "half_vectors.h"

#if defined(__GNUC__)
#  define PKV_KV_LOOP_ static __attribute__((unused))
#else
#  define PKV_KV_LOOP_ static
#endif

/* Input rows are float32, or float16 bit patterns widened exactly. */
static inline float pkv_kv_load_(const float *x32, const uint16_t *x16, size_t i) {
    return x32 ? x32[i] : pkv_f16_to_f32(x16[i]);
}

#if defined(__GNUC__) && !defined(__clang__)

/* Rotation sign tables as vectors: pre = SIGNS1, post = c * SIGNS2 (c = 1/sqrt(n)). */
typedef struct {
    pkv_fwht_v16f pre[16], post128[8], post256[16];
} pkv_kv_signs_;

static inline __attribute__((always_inline)) void pkv_kv_signs_init_(pkv_kv_signs_ *s) {
    float pre[256], post[256];
    pkv_signs_generate(PKV_SIGNS1_SEED, 256u, pre);
    pkv_signs_generate(PKV_SIGNS2_SEED, 256u, post);
    memcpy(s->pre, pre, sizeof s->pre);
    for (int i = 0; i < 256; ++i) post[i] = post[i] * PKV_FWHT_SCALE_256;
    memcpy(s->post256, post, sizeof s->post256);
    pkv_signs_generate(PKV_SIGNS2_SEED, 128u, post);
    for (int i = 0; i < 128; ++i) post[i] = post[i] * PKV_FWHT_SCALE_128;
    memcpy(s->post128, post, sizeof s->post128);
}

static inline __attribute__((always_inline)) void pkv_kv_load_row_(const float *x32,
        const uint16_t *x16, size_t base, int nvec, pkv_fwht_v16f *v) {
    if (x32) {
        memcpy(v, x32 + base, (size_t)nvec * sizeof *v);
        return;
    }
    for (int i = 0; i < nvec; ++i) pkv_kv_f16_to_f32_v_(x16 + base + 16 * (size_t)i, v + i);
}

/* pkv_kv_sumsq over nvec vectors: lane l holds partial l, folded 8, 4, 2, 1 in registers
 * (lane j + lane j + w, the reference's order: the same bits). Folding through a float[16]
 * copy instead cost the AVX2 clone a sixth of its encode time. */
static inline __attribute__((always_inline)) float pkv_kv_sumsq_v_(const pkv_fwht_v16f *v, int nvec) {
    pkv_fwht_v16f acc = v[0] * v[0];
    for (int i = 1; i < nvec; ++i) acc = acc + v[i] * v[i];
    const pkv_fwht_v16i f8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                        f4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                        f2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                        f1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    acc = acc + __builtin_shuffle(acc, f8);
    acc = acc + __builtin_shuffle(acc, f4);
    acc = acc + __builtin_shuffle(acc, f2);
    acc = acc + __builtin_shuffle(acc, f1);
    return acc[0];
}

typedef float pkv_kv_v8f_ __attribute__((vector_size(32)));
typedef int32_t pkv_kv_v8i_ __attribute__((vector_size(32)));

/* -1 in the lanes where a > b, else 0, from the sign of b - a (exact for finite values:
 * a rounded difference is 0 only for equal operands and never changes sign). Written
 * as arithmetic because GCC scalarizes vector comparisons wider than the ISA. */
#define PKV_KV_GT_(a, b) ((pkv_kv_v8i_)((b) - (a)) >> 31)

/* 8 codes of `bits` bits -> the 8*bits-bit LSB-first word (quant.h's order): code j
 * shifted to bit bits*j, then an OR across the lanes; `bits` bytes are stored. */
static inline __attribute__((always_inline)) void pkv_kv_pack8_(const pkv_kv_v8i_ *idx, int bits,
                                                                uint8_t *out) {
    const pkv_kv_v8i_ lane = { 0, 1, 2, 3, 4, 5, 6, 7 };
    pkv_kv_v8i_ w = *idx << (lane * bits);
    const pkv_kv_v8i_ p4 = { 4, 5, 6, 7, 0, 1, 2, 3 }, p2 = { 2, 3, 0, 1, 6, 7, 4, 5 },
                      p1 = { 1, 0, 3, 2, 5, 4, 7, 6 };
    w = w | __builtin_shuffle(w, p4);
    w = w | __builtin_shuffle(w, p2);
    w = w | __builtin_shuffle(w, p1);
    const uint32_t word = (uint32_t)w[0];
    for (int b = 0; b < bits; ++b) out[b] = (uint8_t)(word >> (8 * b));
}

/* Codes of nvec 16-lane vectors against NT = 2^bits - 1 ascending thresholds, packed
 * into out; v is replaced by C[code]. A code is a branch-free binary search, 8 lanes
 * at a time, one bit per step from the top: at step k a lane whose top k bits are c
 * compares with T[(2c + 1) * 2^(bits-1-k) - 1], the middle of the thresholds its code
 * can still reach, and appends 1 when it is greater; that counts the thresholds
 * strictly exceeded. The threshold is a lane permute of the 2^k (at most 8) entries
 * step k can reach, indexed by c: one vpermps on AVX2 (a 16-entry table is two and a
 * blend), and no shift of the code on the way. C[code] is a lane permute too: a
 * selection, so exact. */
static inline __attribute__((always_inline)) void pkv_kv_codes_v_(pkv_fwht_v16f *v, int nvec,
        const float *C, const float *T, int NT, int bits, uint8_t *out) {
    pkv_kv_v8f_ tab[4], clo, chi;
    for (int k = 0; k < bits; ++k) {
        const int step = 1 << (bits - 1 - k);
        for (int c = 0; c < 8; ++c) {
            const int t = (2 * c + 1) * step - 1;
            /* past the 2^k entries step k reaches, or past the table: never exceeded */
            tab[k][c] = c < (1 << k) && t < NT ? T[t] : 3.0e38f;
        }
    }
    for (int j = 0; j < 8; ++j) {
        clo[j] = C[j <= NT ? j : NT];
        chi[j] = C[j + 8 <= NT ? j + 8 : NT];
    }
    for (int i = 0; i < nvec; ++i) {
        pkv_kv_v8f_ half[2];
        memcpy(half, v + i, sizeof half);
        for (int h = 0; h < 2; ++h) {
            pkv_kv_v8i_ idx = { 0 };
            for (int k = 0; k < bits; ++k)
                idx = idx + idx - PKV_KV_GT_(half[h], __builtin_shuffle(tab[k], idx));
            half[h] = __builtin_shuffle(clo, chi, idx);
            pkv_kv_pack8_(&idx, bits, out + bits * (2 * i + h));
        }
        memcpy(v + i, half, sizeof half);
    }
}

/* One mode and head_dim, all constants: the compiler unrolls the threshold chain. */
static inline __attribute__((always_inline)) void pkv_kv_encode_rows_(
        const float *x32, const uint16_t *x16, ptrdiff_t n_rows, uint32_t hd, uint32_t mode,
        const pkv_kv_signs_ *sg, uint8_t *out) {
    const int bits = (int)pkv_kv_mode_bits(mode), rot = (int)pkv_kv_mode_rotation(mode);
    const int nvec = (int)hd / 16, NT = (1 << bits) - 1;
    const float *C = pkv_kv_centroids + pkv_kv_centroid_offset((uint32_t)bits, (uint32_t)rot);
    const float *T = pkv_kv_thresholds + pkv_kv_threshold_offset((uint32_t)bits, (uint32_t)rot);
    const uint32_t row_bytes = pkv_kv_row_bytes(mode, hd);
    for (ptrdiff_t r = 0; r < n_rows; ++r) {
        pkv_fwht_v16f v[16];
        uint8_t *o = out + (size_t)r * row_bytes;
        pkv_kv_load_row_(x32, x16, (size_t)r * hd, nvec, v);
        float norm = sqrtf(pkv_kv_sumsq_v_(v, nvec));
        float inv = norm > PKV_KV_NORM_EPS ? 1.0f / norm : 0.0f;
        for (int i = 0; i < nvec; ++i) v[i] = v[i] * inv;
        if (rot == 256) {
            pkv_fwht_vecs_(v, 16, sg->pre, sg->post256);
        } else {
            for (int h = 0; h < nvec; h += 8) pkv_fwht_vecs_(v + h, 8, sg->pre, sg->post128);
        }
        pkv_kv_codes_v_(v, nvec, C, T, NT, bits, o + PKV_KV_CNORM_BYTES);
        pkv_store_f32le(o, pkv_kv_cnorm(norm, pkv_kv_sumsq_v_(v, nvec)));
    }
}

#define PKV_KV_ENCODE_CASE_(MODE, HD) \
    if (mode == (MODE) && hd == (HD)) { \
        pkv_kv_encode_rows_(x32, x16, n_rows, HD, MODE, &sg, out); return; }

/* Encode n_rows rows of hd values (x32, or f16 bits x16 when x32 is NULL) in a
 * rotated mode into row_bytes records each. Finite input only (checked by the caller). */
PKV_CPU_CLONES
static void pkv_cpu_kv_encode_rows(const float *x32, const uint16_t *x16, ptrdiff_t n_rows,
                                   uint32_t hd, uint32_t mode, uint8_t *out) {
    pkv_kv_signs_ sg;
    pkv_kv_signs_init_(&sg);
    PKV_KV_ENCODE_CASE_(PKV_KV_MODE_FWHT4, 128u)
    PKV_KV_ENCODE_CASE_(PKV_KV_MODE_FWHT2, 128u)
    PKV_KV_ENCODE_CASE_(PKV_KV_MODE_FWHT4, 256u)
    PKV_KV_ENCODE_CASE_(PKV_KV_MODE_FWHT2, 256u)
    PKV_KV_ENCODE_CASE_(PKV_KV_MODE_FWHT3, 256u)
    PKV_KV_ENCODE_CASE_(PKV_KV_MODE_LLOYD4, 256u)
    PKV_KV_ENCODE_CASE_(PKV_KV_MODE_LLOYD3, 256u)
    PKV_KV_ENCODE_CASE_(PKV_KV_MODE_LLOYD2, 256u)
}

#undef PKV_KV_ENCODE_CASE_

#else  /* other compilers: the scalar reference per row (below) */

static void pkv_cpu_kv_encode_rows_reference(const float *x32, const uint16_t *x16,
                                             ptrdiff_t n_rows, uint32_t hd, uint32_t mode,
                                             uint8_t *out);

PKV_KV_LOOP_ void pkv_cpu_kv_encode_rows(const float *x32, const uint16_t *x16, ptrdiff_t n_rows,
                                         uint32_t hd, uint32_t mode, uint8_t *out) {
    pkv_cpu_kv_encode_rows_reference(x32, x16, n_rows, hd, mode, out);
}

#endif

/* The scalar reference over rows (tests compare the loops above with it). */
PKV_KV_LOOP_ void pkv_cpu_kv_encode_rows_reference(const float *x32, const uint16_t *x16,
                                             ptrdiff_t n_rows, uint32_t hd, uint32_t mode,
                                             uint8_t *out) {
    float x[256], r[256];
    uint8_t q[256];
    const uint32_t row_bytes = pkv_kv_row_bytes(mode, hd);
    for (ptrdiff_t row = 0; row < n_rows; ++row) {
        for (uint32_t d = 0; d < hd; ++d) x[d] = pkv_kv_load_(x32, x16, (size_t)row * hd + d);
        pkv_kv_encode_row(x, hd, mode, pkv_kv_centroids, pkv_kv_thresholds, r, q,
                          out + (size_t)row * row_bytes);
    }
}

/* Decode n_rows records (original basis, or rotated when rotated_basis != 0). */
PKV_KV_LOOP_ void pkv_cpu_kv_decode_rows(const uint8_t *rec, ptrdiff_t n_rows, uint32_t hd,
                                   uint32_t mode, int rotated_basis, float *out) {
    uint8_t q[256];
    const uint32_t row_bytes = pkv_kv_row_bytes(mode, hd);
    for (ptrdiff_t row = 0; row < n_rows; ++row)
        pkv_kv_decode_row(rec + (size_t)row * row_bytes, hd, mode, pkv_kv_centroids,
                          rotated_basis, q, out + (size_t)row * hd);
}

/* Downshift n_rows records from src_mode to dst_mode (same table family). */
PKV_KV_LOOP_ void pkv_cpu_kv_downshift_rows(const uint8_t *src, ptrdiff_t n_rows, uint32_t hd,
                                      uint32_t src_mode, uint32_t dst_mode, uint8_t *dst) {
    uint8_t q[256];
    float v[256];
    const uint32_t sb = pkv_kv_row_bytes(src_mode, hd), db = pkv_kv_row_bytes(dst_mode, hd);
    for (ptrdiff_t row = 0; row < n_rows; ++row)
        pkv_kv_downshift_row(src + (size_t)row * sb, src_mode, dst + (size_t)row * db, dst_mode,
                             hd, pkv_kv_centroids, q, v);
}

#endif /* PAGEDKV_QUANT_KV_ROTATED_LOOPS_H */
