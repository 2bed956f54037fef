/* Per-element quantization math of the HFQ / MQ / Q8 weight codecs.
 *
 * Source: docs/contracts/hfqm-and-quant.md, '3. Shared primitives' (primitives) and
 * docs/contracts/hfqm-and-quant.md, '4. Weight codecs' (codecs).
 * One text for every consumer: the Cython codecs (pagedkv.quant), the HIP/CUDA
 * kernels (hip/, through nvcc or hipcc) and the Metal kernels (passed as text).
 * Hence: every function is PKV_FN, pointers into device buffers are PKV_DEVPTR,
 * pointers to a thread's own scratch PKV_THREAD (Metal names every address space),
 * no libc, no statics that need initialising, only integer and f32 arithmetic.
 *
 * Bit-exactness. Encoders reproduce hipfire's bytes: each step below is one
 * rounded f32 operation, in the order written (docs/contracts/hfqm-and-quant.md, '3.1 Arithmetic
 * discipline'); the project compiles C
 * with -ffp-contract=off so no a*b+c is fused. The decoders are exact on the
 * CPU for the same reason; GPU builds may fuse (tolerance: 1 ulp of the group's
 * largest magnitude, docs/development.md, 'Kernel design').
 *
 * Byte order. Multi-byte fields are little-endian and groups start at any
 * byte (a 34-byte Q8F16 block, a tensor at an odd file offset), so fields are
 * read and written byte by byte; compilers merge these into single moves.
 */
#ifndef PAGEDKV_QUANT_H
#define PAGEDKV_QUANT_H

#include "portability.h"

/* ---------------------------------------------------------------------------
 * Constants
 * ------------------------------------------------------------------------- */

#define PKV_FWHT_N               256        /* rotation length of every MQ format */
#define PKV_FWHT_SCALE_256       0.0625f    /* 1/sqrt(256), exact */
#define PKV_FWHT_SCALE_128       0.0883883461356163f  /* f32(1/sqrt(128)) = 0x3DB504F3 */
#define PKV_SIGNS1_SEED          42u        /* D1, applied before the butterflies */
#define PKV_SIGNS2_SEED          1042u      /* D2, applied after */

#define PKV_AFFINE_HEADER_BYTES  8u         /* v1: f32 scale, f32 min; V2/MQ4C: 4 x f16 */
#define PKV_Q8F16_GROUP          32u
#define PKV_Q8F16_GROUP_BYTES    34u        /* f16 scale + 32 x int8 (GGML Q8_0 layout) */

/* Bytes of one affine group of G weights at `bits` bits: 8 B header + packed codes. */
#define PKV_AFFINE_GROUP_BYTES(bits, G) (PKV_AFFINE_HEADER_BYTES + ((bits) * (G)) / 8u)

/* What a group encoder returns. UNREPRESENTABLE: the group's finite inputs need a
 * stored field or a decoded value that is not finite (an f32 range that overflows,
 * an f16 scale or zero beyond +-65504); the bytes are written anyway, as hipfire
 * would write them, and the caller refuses the tensor (docs/formats/quant.md,
 * "Groups the codecs refuse"). */
#define PKV_ENCODE_OK              0
#define PKV_ENCODE_UNREPRESENTABLE 1

/* True when the f16 bit pattern h is +-inf or NaN (exponent all ones). */
#define PKV_F16_IS_NONFINITE(h) (((h) & 0x7C00u) == 0x7C00u)

/* ---------------------------------------------------------------------------
 * Bit casts and little-endian field access
 * ------------------------------------------------------------------------- */

PKV_FN uint32_t pkv_f32_bits(float x) {
#if defined(PKV_METAL)
    return as_type<uint32_t>(x);
#else
    union { float f; uint32_t u; } v;
    v.f = x;
    return v.u;
#endif
}

PKV_FN float pkv_f32_from_bits(uint32_t u) {
#if defined(PKV_METAL)
    return as_type<float>(u);
#else
    union { float f; uint32_t u; } v;
    v.u = u;
    return v.f;
#endif
}

PKV_FN uint32_t pkv_load_u16le(const PKV_DEVPTR uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8);
}

PKV_FN uint32_t pkv_load_u32le(const PKV_DEVPTR uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

PKV_FN void pkv_store_u16le(PKV_DEVPTR uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v & 0xFFu);
    p[1] = (uint8_t)((v >> 8) & 0xFFu);
}

PKV_FN void pkv_store_u32le(PKV_DEVPTR uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v & 0xFFu);
    p[1] = (uint8_t)((v >> 8) & 0xFFu);
    p[2] = (uint8_t)((v >> 16) & 0xFFu);
    p[3] = (uint8_t)((v >> 24) & 0xFFu);
}

PKV_FN float pkv_load_f32le(const PKV_DEVPTR uint8_t *p) { return pkv_f32_from_bits(pkv_load_u32le(p)); }
PKV_FN void pkv_store_f32le(PKV_DEVPTR uint8_t *p, float x) { pkv_store_u32le(p, pkv_f32_bits(x)); }

/* True for NaN and +-Inf (exponent all ones): encoders refuse them
 * (docs/contracts/hfqm-and-quant.md, '3.1 Arithmetic discipline'). */
PKV_FN int pkv_f32_is_nonfinite(float x) { return (pkv_f32_bits(x) & 0x7F800000u) == 0x7F800000u; }

/* True for NaN, by its bits: unlike x != x it survives a fast-math compile (Metal's default). */
PKV_FN int pkv_f32_is_nan(float x) { return (pkv_f32_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }

/* Index of the first NaN/Inf in x[0..n), or -1. The first pass is branch-free
 * (it vectorizes); only a group that holds one is scanned again. */
PKV_FN ptrdiff_t pkv_first_nonfinite(const PKV_THREAD float *x, ptrdiff_t n) {
    int bad = 0;
    for (ptrdiff_t i = 0; i < n; ++i) bad |= pkv_f32_is_nonfinite(x[i]);
    if (!bad) return -1;
    for (ptrdiff_t i = 0; i < n; ++i)
        if (pkv_f32_is_nonfinite(x[i])) return i;
    return -1;
}

/* Index of the first Inf/NaN among n float16 bit patterns (exponent all ones), or -1. */
PKV_FN ptrdiff_t pkv_first_nonfinite_f16(const uint16_t *h, ptrdiff_t n) {
    int bad = 0;
    for (ptrdiff_t i = 0; i < n; ++i) bad |= (h[i] & 0x7C00u) == 0x7C00u;
    if (!bad) return -1;
    for (ptrdiff_t i = 0; i < n; ++i)
        if ((h[i] & 0x7C00u) == 0x7C00u) return i;
    return -1;
}

/* ---------------------------------------------------------------------------
 * Half precision (docs/contracts/hfqm-and-quant.md, '3.2 f32 to f16 by truncation')
 * ------------------------------------------------------------------------- */

/* f32 -> f16 by truncation toward zero: what hipfire's quantizer does for F16
 * tensors, Q8F16/MQ8 scales and V2/MQ4C headers. NOT round-to-nearest: numpy's
 * astype(float16) differs on about half of all inputs (0x3F801FFF -> 0x3C00 here,
 * 0x3C01 there). */
PKV_FN uint32_t pkv_f16_trunc(float x) {
    uint32_t b = pkv_f32_bits(x);
    uint32_t s = (b >> 16) & 0x8000u;
    int32_t e = (int32_t)((b >> 23) & 0xFFu);
    uint32_t m = b & 0x7FFFFFu;
    if (e == 0xFF) return s | 0x7C00u | (m == 0u ? 0u : ((m >> 13) | 1u));
    int32_t e16 = e - 112;
    if (e16 >= 31) return s | 0x7C00u;
    if (e16 <= 0) {
        if (e16 < -10) return s;
        return s | ((m | 0x800000u) >> (uint32_t)(14 - e16));
    }
    return s | ((uint32_t)e16 << 10) | (m >> 13);
}

/* f32 -> f16 rounding to nearest, ties to even (Lloyd/GL codebooks, KV cache). */
PKV_FN uint32_t pkv_f16_rne(float x) {
    uint32_t b = pkv_f32_bits(x);
    uint32_t s = (b >> 16) & 0x8000u;
    int32_t e = (int32_t)((b >> 23) & 0xFFu);
    uint32_t m = b & 0x7FFFFFu;
    if (e == 0xFF) return s | 0x7C00u | (m == 0u ? 0u : (0x200u | (m >> 13)));
    int32_t e16 = e - 112;
    if (e16 >= 31) return s | 0x7C00u;
    if (e16 <= 0) {
        if (e16 < -10) return s;
        uint32_t mant = m | 0x800000u;
        uint32_t shift = (uint32_t)(14 - e16);            /* 14 .. 24 */
        uint32_t r = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) r += 1u;
        return s | r;
    }
    uint32_t r = ((uint32_t)e16 << 10) | (m >> 13);
    uint32_t rem = m & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r += 1u;  /* a carry into the exponent is right, up to inf */
    return s | r;
}

/* f16 -> f32, exact for every input (subnormals, inf, NaN payloads). */
PKV_FN float pkv_f16_to_f32(uint32_t h) {
    uint32_t s = (h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu;
    uint32_t m = h & 0x3FFu;
    if (e == 0x1Fu) return pkv_f32_from_bits(s | 0x7F800000u | (m << 13));
    if (e == 0u) {
        /* subnormal (or zero): m * 2^-24, exact in f32 */
        float v = (float)m * 5.9604644775390625e-08f;
        return s ? -v : v;
    }
    return pkv_f32_from_bits(s | ((e + 112u) << 23) | (m << 13));
}

/* bf16 widens exactly (the top half of an f32); narrowing truncates (hipfire's choice,
 * docs/contracts/hfqm-and-quant.md, '3.2 f32 to f16 by truncation'). */
PKV_FN float pkv_bf16_to_f32(uint32_t h) { return pkv_f32_from_bits((h & 0xFFFFu) << 16); }
PKV_FN uint32_t pkv_bf16_trunc(float x) { return pkv_f32_bits(x) >> 16; }

/* ---------------------------------------------------------------------------
 * Rounding to integer codes (docs/contracts/hfqm-and-quant.md, '3.3 Rounding to integers')
 *
 * Written with compares and truncating conversions (no floorf/roundf) so they
 * vectorize and run on devices without libm. min(L, floor(v)) == floor(min(v, L))
 * for integer L, and on [0, L] floor == truncation.
 * ------------------------------------------------------------------------- */

/* Affine codes, every family (docs/contracts/hfqm-and-quant.md, '3.3 Rounding to integers'): q =
 * clamp(floor((x - base)*inv + 0.5), 0, L),
 * base = the group minimum (v1) or the stored zero (V2, MQ4C; it can exceed the
 * minimum, so the lower clamp matters there). floor and truncation agree after
 * clamping to [0, L]. A NaN argument is code 0, as in hipfire, whose encoders
 * convert with Rust's saturating `as u8` (NaN -> 0) before `.min(L)`: NaN arises
 * in a v1 group whose range is subnormal, where 1/scale overflows to inf and
 * (mn - mn)*inf is NaN for the group minimum. */
PKV_FN uint32_t pkv_round_affine(float x, float base, float inv, float L) {
    float v = (x - base) * inv;
    v = v + 0.5f;
    v = v > 0.0f ? v : 0.0f;           /* also NaN -> 0 */
    v = v < L ? v : L;
    return (uint32_t)(int32_t)v;
}

/* Q8F16 / MQ8 / Q8HFQ: round half away from zero, clamp to [-128, 127].
 * (a + 0.5 then truncate is wrong for a = 0.49999997, hence the fraction test.)
 * Float selects only, no branches: signs and halves of real weights are
 * unpredictable, and this form vectorizes. */
PKV_FN int32_t pkv_round_q8(float v) {
    uint32_t bits = pkv_f32_bits(v);
    float a = pkv_f32_from_bits(bits & 0x7FFFFFFFu);
    a = a < 256.0f ? a : 256.0f;                      /* keep the conversion in range */
    float t = (float)(int32_t)a;
    float r = t + ((a - t) >= 0.5f ? 1.0f : 0.0f);    /* a - t is exact below 2^23 */
    r = pkv_f32_from_bits(pkv_f32_bits(r) | (bits & 0x80000000u));
    r = r < -128.0f ? -128.0f : r;
    r = r > 127.0f ? 127.0f : r;
    /* NaN (0 * inf when 1/scale overflowed) is -128, as hipfire's
     * `round().max(-128.0).min(127.0) as i8` gives (f32::max returns the non-NaN
     * operand); without this the result would follow the NaN's sign bit, which
     * differs between x86 (negative default NaN) and ARM (positive). */
    r = v == v ? r : -128.0f;
    return (int32_t)r;
}

/* KV q8 (docs/contracts/hfqm-and-quant.md, '6.3 q8 (K and V)'): round half to even, clamp to [-127,
 * 127]. */
PKV_FN int32_t pkv_round_q8_kv(float v) {
    float a = v < 0.0f ? -v : v;
    a = a < 256.0f ? a : 256.0f;
    int32_t t = (int32_t)a;
    float frac = a - (float)t;
    if (frac > 0.5f || (frac == 0.5f && (t & 1))) t += 1;
    t = v < 0.0f ? -t : t;
    t = t < -127 ? -127 : t;
    return t > 127 ? 127 : t;
}

/* ---------------------------------------------------------------------------
 * Bit packing (docs/contracts/hfqm-and-quant.md, '3.4 Bit packing'): code j occupies bits [b*j, b*j
 * + b) of the payload read
 * as one little-endian integer (LSB first), for every width b in 1..8.
 * ------------------------------------------------------------------------- */

/* Code j of an LSB-first stream of `bits`-bit codes. Reads the second byte only
 * when the code straddles it, so it never reads past the payload. */
PKV_FN uint32_t pkv_unpack_code(const PKV_DEVPTR uint8_t *payload, uint32_t j, uint32_t bits) {
    uint32_t bit = bits * j;
    uint32_t byte = bit >> 3, shift = bit & 7u;
    uint32_t v = (uint32_t)payload[byte] >> shift;
    if (shift + bits > 8u) v |= (uint32_t)payload[byte + 1u] << (8u - shift);
    return v & ((1u << bits) - 1u);
}

/* Pack n codes (each < 2^bits) into ceil(n*bits/8) bytes; a partial last byte is
 * zero-filled. Whole groups of 8 codes take exactly `bits` bytes. */
PKV_FN void pkv_pack_codes(const PKV_THREAD uint8_t *q, uint32_t n, uint32_t bits, PKV_DEVPTR uint8_t *out) {
    uint32_t acc = 0u, filled = 0u, o = 0u;
    for (uint32_t j = 0; j < n; ++j) {
        acc |= (uint32_t)q[j] << filled;
        filled += bits;
        while (filled >= 8u) {
            out[o++] = (uint8_t)(acc & 0xFFu);
            acc >>= 8;
            filled -= 8u;
        }
    }
    if (filled) out[o] = (uint8_t)(acc & 0xFFu);
}

/* Width-specialised unpackers for whole groups (n a multiple of 8): the decode
 * loops call these on a byte array, then convert codes to floats in a second,
 * vectorizable pass. Same bit order as pkv_unpack_code. */
PKV_FN void pkv_unpack_codes(const PKV_DEVPTR uint8_t *payload, uint32_t n, uint32_t bits, PKV_THREAD uint8_t *q) {
    if (bits == 4u) {
        for (uint32_t i = 0; i < n / 2u; ++i) {
            uint32_t b = payload[i];
            q[2u * i] = (uint8_t)(b & 0x0Fu);
            q[2u * i + 1u] = (uint8_t)(b >> 4);
        }
    } else if (bits == 2u) {
        for (uint32_t i = 0; i < n / 4u; ++i) {
            uint32_t b = payload[i];
            q[4u * i] = (uint8_t)(b & 3u);
            q[4u * i + 1u] = (uint8_t)((b >> 2) & 3u);
            q[4u * i + 2u] = (uint8_t)((b >> 4) & 3u);
            q[4u * i + 3u] = (uint8_t)(b >> 6);
        }
    } else if (bits == 6u) {
        for (uint32_t i = 0; i < n / 4u; ++i) {
            uint32_t w = (uint32_t)payload[3u * i] | ((uint32_t)payload[3u * i + 1u] << 8) |
                         ((uint32_t)payload[3u * i + 2u] << 16);
            q[4u * i] = (uint8_t)(w & 63u);
            q[4u * i + 1u] = (uint8_t)((w >> 6) & 63u);
            q[4u * i + 2u] = (uint8_t)((w >> 12) & 63u);
            q[4u * i + 3u] = (uint8_t)(w >> 18);
        }
    } else if (bits == 8u) {
        for (uint32_t i = 0; i < n; ++i) q[i] = payload[i];
    } else {
        /* 1, 3, 5, 7 bits: 8 codes per `bits` bytes, read as one 64-bit word. */
        uint32_t mask = (1u << bits) - 1u;
        for (uint32_t i = 0; i < n / 8u; ++i) {
            uint64_t w = 0u;
            for (uint32_t k = 0; k < bits; ++k) w |= (uint64_t)payload[bits * i + k] << (8u * k);
            for (uint32_t k = 0; k < 8u; ++k) q[8u * i + k] = (uint8_t)((w >> (bits * k)) & mask);
        }
    }
}

/* ---------------------------------------------------------------------------
 * Sign tables (docs/contracts/hfqm-and-quant.md, '3.5 Sign tables'): a 31-bit LCG; sign i is bit 16
 * of the state after i+1 steps.
 * SIGNS1 = signs(42, 256), SIGNS2 = signs(1042, 256); the 128-wide tables are
 * their first 128 entries.
 * ------------------------------------------------------------------------- */

PKV_FN uint32_t pkv_sign_lcg_next(uint32_t state) {
    return (state * 1103515245u + 12345u) & 0x7FFFFFFFu;   /* u32 wrap, then 31 bits */
}

/* +1.0f or -1.0f for one LCG state. */
PKV_FN float pkv_sign_of_state(uint32_t state) { return ((state >> 16) & 1u) ? 1.0f : -1.0f; }

/* Fill out[0..n) with signs(seed, n). */
PKV_FN void pkv_signs_generate(uint32_t seed, uint32_t n, PKV_THREAD float *out) {
    uint32_t state = seed;
    for (uint32_t i = 0; i < n; ++i) {
        state = pkv_sign_lcg_next(state);
        out[i] = pkv_sign_of_state(state);
    }
}

/* The same tables precomputed, bit-packed: bit (i % 32) of word (i / 32) is set
 * where sign i is +1 (the docs/contracts/hfqm-and-quant.md, '5.1 Sign tables and FWHT' byte strings
 * read as little-endian u32 words).
 * A switch, not an array, so device code needs no __constant__ declaration. */
PKV_FN uint32_t pkv_signs1_word(uint32_t w) {
    switch (w & 7u) {
    case 0: return 0x7E1F436Fu; case 1: return 0x7DCCA4DBu;
    case 2: return 0x656132F7u; case 3: return 0x3461EA31u;
    case 4: return 0x3F8FF8ACu; case 5: return 0x57873038u;
    case 6: return 0x3F939D88u; default: return 0x408E25A3u;
    }
}

PKV_FN uint32_t pkv_signs2_word(uint32_t w) {
    switch (w & 7u) {
    case 0: return 0x615EB361u; case 1: return 0x8EAB84A4u;
    case 2: return 0x2481C03Bu; case 3: return 0x511CC661u;
    case 4: return 0x3AD419B8u; case 5: return 0xBEF3EC93u;
    case 6: return 0xEE3A4271u; default: return 0x390FAFE9u;
    }
}

PKV_FN float pkv_sign1(uint32_t i) { return ((pkv_signs1_word(i >> 5) >> (i & 31u)) & 1u) ? 1.0f : -1.0f; }
PKV_FN float pkv_sign2(uint32_t i) { return ((pkv_signs2_word(i >> 5) >> (i & 31u)) & 1u) ? 1.0f : -1.0f; }

/* ---------------------------------------------------------------------------
 * FWHT (docs/contracts/hfqm-and-quant.md, '3.6 FWHT rotation'): R = D2 . H . D1 / sqrt(n), n in
 * {128, 256}.
 * The stage order (ascending strides) is part of the contract: vectorizing
 * within a stage keeps the bits, reordering stages does not.
 * ------------------------------------------------------------------------- */

/* Unnormalized Walsh-Hadamard butterflies over y[0..n), in place. */
PKV_FN void pkv_fwht_butterflies(PKV_THREAD float *y, uint32_t n) {
    for (uint32_t h = 1u; h < n; h <<= 1) {
        for (uint32_t i = 0; i < n; i += 2u * h) {
            for (uint32_t j = i; j < i + h; ++j) {
                float a = y[j], b = y[j + h];
                y[j] = a + b;
                y[j + h] = a - b;
            }
        }
    }
}

/* The same butterflies for n = 256, scheduled for SIMD: strides 1 and 2 fused
 * into one radix-4 pass, then one loop per constant stride. Each element sees
 * the same operations in the same order as pkv_fwht_butterflies (only
 * independent operations are reordered), so the bits are identical. */
PKV_FN void pkv_fwht256_stage_(PKV_THREAD float *y, uint32_t h) {
    for (uint32_t i = 0; i < 256u; i += 2u * h) {
        for (uint32_t j = i; j < i + h; ++j) {
            float a = y[j], b = y[j + h];
            y[j] = a + b;
            y[j + h] = a - b;
        }
    }
}

PKV_FN void pkv_fwht256_butterflies(PKV_THREAD float *y) {
    for (uint32_t i = 0; i < 256u; i += 4u) {
        float a0 = y[i], a1 = y[i + 1u], a2 = y[i + 2u], a3 = y[i + 3u];
        float b0 = a0 + a1, b1 = a0 - a1, b2 = a2 + a3, b3 = a2 - a3;
        y[i] = b0 + b2;
        y[i + 2u] = b0 - b2;
        y[i + 1u] = b1 + b3;
        y[i + 3u] = b1 - b3;
    }
    pkv_fwht256_stage_(y, 4u);
    pkv_fwht256_stage_(y, 8u);
    pkv_fwht256_stage_(y, 16u);
    pkv_fwht256_stage_(y, 32u);
    pkv_fwht256_stage_(y, 64u);
    pkv_fwht256_stage_(y, 128u);
}

/* Forward rotation with the sign tables as floats (pre = SIGNS1, post = SIGNS2
 * for the forward transform; swap them for the inverse). y may alias x. */
PKV_FN void pkv_fwht_with_tables(const PKV_THREAD float *x, PKV_THREAD float *y, uint32_t n,
                                 const PKV_THREAD float *pre, const PKV_THREAD float *post) {
    float c = n == 256u ? PKV_FWHT_SCALE_256 : PKV_FWHT_SCALE_128;
    for (uint32_t i = 0; i < n; ++i) y[i] = x[i] * pre[i];
    if (n == 256u) pkv_fwht256_butterflies(y); else pkv_fwht_butterflies(y, n);
    for (uint32_t i = 0; i < n; ++i) y[i] = y[i] * (c * post[i]);   /* c*(+-1) is exact */
}

/* fwht(x, n) and ifwht(x, n) with the packed tables (no setup; device-friendly). */
PKV_FN void pkv_fwht(const PKV_THREAD float *x, PKV_THREAD float *y, uint32_t n) {
    float c = n == 256u ? PKV_FWHT_SCALE_256 : PKV_FWHT_SCALE_128;
    for (uint32_t i = 0; i < n; ++i) y[i] = x[i] * pkv_sign1(i);
    pkv_fwht_butterflies(y, n);
    for (uint32_t i = 0; i < n; ++i) y[i] = y[i] * (c * pkv_sign2(i));
}

PKV_FN void pkv_ifwht(const PKV_THREAD float *x, PKV_THREAD float *y, uint32_t n) {
    float c = n == 256u ? PKV_FWHT_SCALE_256 : PKV_FWHT_SCALE_128;
    for (uint32_t i = 0; i < n; ++i) y[i] = x[i] * pkv_sign2(i);
    pkv_fwht_butterflies(y, n);
    for (uint32_t i = 0; i < n; ++i) y[i] = y[i] * (c * pkv_sign1(i));
}

/* ---------------------------------------------------------------------------
 * Affine v1 groups: HFQ (qt 6-12) and, after the rotation, MQ v1 (13, 15, 17,
 * 18, 31). Layout: [0,4) f32 scale, [4,8) f32 min, [8, 8 + bits*G/8) codes.
 * ------------------------------------------------------------------------- */

PKV_FN float pkv_hfq_scale(const PKV_DEVPTR uint8_t *blk) { return pkv_load_f32le(blk); }
PKV_FN float pkv_hfq_min(const PKV_DEVPTR uint8_t *blk) { return pkv_load_f32le(blk + 4); }

/* Element i of a v1 group: q*scale + min (two rounded ops, in that order). */
PKV_FN float pkv_hfq_decode_elem(const PKV_DEVPTR uint8_t *blk, uint32_t bits, uint32_t i) {
    float q = (float)pkv_unpack_code(blk + PKV_AFFINE_HEADER_BYTES, i, bits);
    return q * pkv_hfq_scale(blk) + pkv_hfq_min(blk);
}

/* Encode x[0..n) (n <= G; codes n..G are 0) into one v1 group. `q` is scratch
 * of G bytes. min/max run over the n real elements only (docs/contracts/hfqm-and-quant.md, '4.1 HFQ
 * generic affine v1'). Decoded values
 * run from mn (code 0) to L*scale + mn (code L): UNREPRESENTABLE when the latter
 * overflows, which covers a range mx - mn that overflows (scale = inf). */
PKV_FN int pkv_hfq_encode_group(const PKV_THREAD float *x, uint32_t n, uint32_t bits, uint32_t G,
                                 PKV_THREAD uint8_t *q, PKV_DEVPTR uint8_t *blk) {
    float L = (float)((1u << bits) - 1u);
    float mn = x[0], mx = x[0];
    for (uint32_t i = 1; i < n; ++i) {
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
    }
    float rng = mx - mn;
    float scale = 1.0f, inv = 0.0f;
    if (rng > 0.0f) {
        scale = rng / L;
        inv = 1.0f / scale;            /* 1/scale, not L/rng: part of the bytes */
    }
    for (uint32_t i = 0; i < n; ++i) q[i] = (uint8_t)pkv_round_affine(x[i], mn, inv, L);
    for (uint32_t i = n; i < G; ++i) q[i] = 0u;
    pkv_store_f32le(blk, scale);
    pkv_store_f32le(blk + 4, mn);
    pkv_pack_codes(q, G, bits, blk + PKV_AFFINE_HEADER_BYTES);
    float top = L * scale;
    top = top + mn;
    return pkv_f32_is_nonfinite(top) ? PKV_ENCODE_UNREPRESENTABLE : PKV_ENCODE_OK;
}

/* Largest magnitude an MQ v1 group may store: the inverse FWHT-256 adds 256 stored
 * values before its 1/16 scaling, and 256 * 2^119 = 2^127 keeps every partial sum
 * finite. (V2/MQ4C store f16 fields, far below this.) */
#define PKV_MQV1_MAX_STORED_MAGNITUDE 6.646139978924579e35f   /* 2^119 */

/* MQ v1 (qt 13, 15, 17, 18, 31): one v1 group over the 256 ROTATED weights r, plus
 * the bound above on the decoded values mn .. L*scale + mn. */
PKV_FN int pkv_mqv1_encode_group(const PKV_THREAD float *r, uint32_t bits, PKV_THREAD uint8_t *q, PKV_DEVPTR uint8_t *blk) {
    if (pkv_hfq_encode_group(r, 256u, bits, 256u, q, blk) != PKV_ENCODE_OK)
        return PKV_ENCODE_UNREPRESENTABLE;
    float L = (float)((1u << bits) - 1u);
    float mn = pkv_hfq_min(blk), top = L * pkv_hfq_scale(blk);
    top = top + mn;
    float lo = mn < 0.0f ? -mn : mn, hi = top < 0.0f ? -top : top;
    return lo > PKV_MQV1_MAX_STORED_MAGNITUDE || hi > PKV_MQV1_MAX_STORED_MAGNITUDE
               ? PKV_ENCODE_UNREPRESENTABLE : PKV_ENCODE_OK;
}

/* Decode a whole v1 group of G weights (G a multiple of 8). `q` is G bytes of scratch. */
PKV_FN void pkv_hfq_decode_group(const PKV_DEVPTR uint8_t *blk, uint32_t bits, uint32_t G,
                                 PKV_THREAD uint8_t *q, PKV_THREAD float *out) {
    float scale = pkv_hfq_scale(blk), mn = pkv_hfq_min(blk);
    pkv_unpack_codes(blk + PKV_AFFINE_HEADER_BYTES, G, bits, q);
    for (uint32_t i = 0; i < G; ++i) out[i] = (float)q[i] * scale + mn;
}

/* ---------------------------------------------------------------------------
 * MQ V2 family (qt 44, 47-50) and MQ4C (qt 45), 256 rotated weights per group.
 * V2:   [0,2) s0 [2,4) z0 (weights 0-127), [4,6) s1 [6,8) z1 (128-255), f16 each.
 * MQ4C: [0,2) s, [2,4) z, [4,8) zero.   Codes at [8, ...), v1 packing.
 * Decode: w_rot[i] = q[i]*f32(s) + f32(z), the half taken from the element index.
 * ------------------------------------------------------------------------- */

/* Quantize v[0..n) against one stored (s, z) pair; writes the two f16 fields
 * at hdr. The codes use the STORED (truncated) step and zero, not the f32 ones.
 * UNREPRESENTABLE when either field saturates to f16 inf (|lo| or the step
 * beyond 65504); with both finite every decoded value is finite. */
PKV_FN int pkv_v2_encode_span(const PKV_THREAD float *v, uint32_t n, uint32_t bits,
                               PKV_THREAD uint8_t *q, PKV_DEVPTR uint8_t *hdr) {
    float L = (float)((1u << bits) - 1u);
    float lo = v[0], hi = v[0];
    for (uint32_t i = 1; i < n; ++i) {
        lo = v[i] < lo ? v[i] : lo;
        hi = v[i] > hi ? v[i] : hi;
    }
    float step = hi > lo ? (hi - lo) / L : 0.0f;
    uint32_t sb = hi == lo ? 0u : pkv_f16_trunc(step);
    uint32_t zb = pkv_f16_trunc(lo);
    float st = pkv_f16_to_f32(sb), z = pkv_f16_to_f32(zb);
    if (hi == lo || step == 0.0f || st == 0.0f) {
        for (uint32_t i = 0; i < n; ++i) q[i] = 0u;
    } else {
        float inv = 1.0f / st;
        for (uint32_t i = 0; i < n; ++i) q[i] = (uint8_t)pkv_round_affine(v[i], z, inv, L);
    }
    pkv_store_u16le(hdr, sb);
    pkv_store_u16le(hdr + 2, zb);
    return PKV_F16_IS_NONFINITE(sb) || PKV_F16_IS_NONFINITE(zb) ? PKV_ENCODE_UNREPRESENTABLE
                                                                : PKV_ENCODE_OK;
}

/* r: the 256 ROTATED weights of one group. `q`: 256 bytes of scratch. */
PKV_FN int pkv_mqv2_encode_group(const PKV_THREAD float *r, uint32_t bits, PKV_THREAD uint8_t *q, PKV_DEVPTR uint8_t *blk) {
    int status = pkv_v2_encode_span(r, 128u, bits, q, blk);
    status |= pkv_v2_encode_span(r + 128, 128u, bits, q + 128, blk + 4);
    pkv_pack_codes(q, 256u, bits, blk + PKV_AFFINE_HEADER_BYTES);
    return status;
}

PKV_FN int pkv_mq4c_encode_group(const PKV_THREAD float *r, PKV_THREAD uint8_t *q, PKV_DEVPTR uint8_t *blk) {
    int status = pkv_v2_encode_span(r, 256u, 4u, q, blk);
    pkv_store_u32le(blk + 4, 0u);
    pkv_pack_codes(q, 256u, 4u, blk + PKV_AFFINE_HEADER_BYTES);
    return status;
}

PKV_FN float pkv_mqv2_scale(const PKV_DEVPTR uint8_t *blk, uint32_t half) { return pkv_f16_to_f32(pkv_load_u16le(blk + 4u * half)); }
PKV_FN float pkv_mqv2_zero(const PKV_DEVPTR uint8_t *blk, uint32_t half) { return pkv_f16_to_f32(pkv_load_u16le(blk + 4u * half + 2u)); }

PKV_FN float pkv_mqv2_decode_elem(const PKV_DEVPTR uint8_t *blk, uint32_t bits, uint32_t i) {
    uint32_t h = i >> 7;
    float q = (float)pkv_unpack_code(blk + PKV_AFFINE_HEADER_BYTES, i, bits);
    return q * pkv_mqv2_scale(blk, h) + pkv_mqv2_zero(blk, h);
}

PKV_FN float pkv_mq4c_decode_elem(const PKV_DEVPTR uint8_t *blk, uint32_t i) {
    float q = (float)pkv_unpack_code(blk + PKV_AFFINE_HEADER_BYTES, i, 4u);
    return q * pkv_mqv2_scale(blk, 0u) + pkv_mqv2_zero(blk, 0u);
}

/* Whole group in the rotated basis; `q` is 256 bytes of scratch. */
PKV_FN void pkv_mqv2_decode_group(const PKV_DEVPTR uint8_t *blk, uint32_t bits, PKV_THREAD uint8_t *q, PKV_THREAD float *out) {
    pkv_unpack_codes(blk + PKV_AFFINE_HEADER_BYTES, 256u, bits, q);
    for (uint32_t h = 0; h < 2u; ++h) {
        float s = pkv_mqv2_scale(blk, h), z = pkv_mqv2_zero(blk, h);
        for (uint32_t i = 128u * h; i < 128u * h + 128u; ++i) out[i] = (float)q[i] * s + z;
    }
}

PKV_FN void pkv_mq4c_decode_group(const PKV_DEVPTR uint8_t *blk, PKV_THREAD uint8_t *q, PKV_THREAD float *out) {
    float s = pkv_mqv2_scale(blk, 0u), z = pkv_mqv2_zero(blk, 0u);
    pkv_unpack_codes(blk + PKV_AFFINE_HEADER_BYTES, 256u, 4u, q);
    for (uint32_t i = 0; i < 256u; ++i) out[i] = (float)q[i] * s + z;
}

/* ---------------------------------------------------------------------------
 * Lloyd codebook groups (qt 19, 20, 30 rotated; 51 not): 2^bits f16 (RNE)
 * centroids in ascending order, then 256 LSB-first `bits`-wide indices;
 * w = cb[idx]. docs/formats/quant.md, "Lloyd codebooks (qt 19, 20, 30, 51)".
 * The encoder (Lloyd iterations, f64 means) is CPU-only: quant/codebook_loops.h.
 * ------------------------------------------------------------------------- */

#define PKV_LLOYD_MAX_ITER 8u
#define PKV_LLOYD_GROUP_BYTES(bits) (2u * (1u << (bits)) + 32u * (bits))

PKV_FN float pkv_lloyd_decode_elem(const PKV_DEVPTR uint8_t *blk, uint32_t bits, uint32_t i) {
    uint32_t k = pkv_unpack_code(blk + 2u * (1u << bits), i, bits);
    return pkv_f16_to_f32(pkv_load_u16le(blk + 2u * k));
}

/* Whole group in the stored basis; `q` is 256 bytes of scratch. */
PKV_FN void pkv_lloyd_decode_group(const PKV_DEVPTR uint8_t *blk, uint32_t bits, PKV_THREAD uint8_t *q, PKV_THREAD float *out) {
    float cb[16];
    uint32_t n_cb = 1u << bits;
    for (uint32_t k = 0; k < n_cb; ++k) cb[k] = pkv_f16_to_f32(pkv_load_u16le(blk + 2u * k));
    pkv_unpack_codes(blk + 2u * n_cb, 256u, bits, q);
    for (uint32_t i = 0; i < 256u; ++i) out[i] = cb[q[i]];
}

/* ---------------------------------------------------------------------------
 * Any affine group: the header families of pagedkv.quant.affine.AffineFamily
 * (HFQ and MQ v1 share the v1 header), for kernels that take the family as a
 * parameter (metal/, the generic dequant of pagedkv.kernels.mlx).
 * ------------------------------------------------------------------------- */

enum { PKV_FAMILY_HFQ = 0, PKV_FAMILY_MQ_V1 = 1, PKV_FAMILY_MQ_V2 = 2, PKV_FAMILY_MQ4C = 3 };

/* (scale, offset) of the weights from index e0 of an affine group on, up to the end
 * of the group or of its V2 half: w = q * scale + offset. */
PKV_FN void pkv_affine_params(const PKV_DEVPTR uint8_t *blk, int family, uint32_t e0,
                              PKV_THREAD float *scale, PKV_THREAD float *offset) {
    if (family == PKV_FAMILY_MQ_V2) {
        *scale = pkv_mqv2_scale(blk, e0 >> 7);
        *offset = pkv_mqv2_zero(blk, e0 >> 7);
    } else if (family == PKV_FAMILY_MQ4C) {
        *scale = pkv_mqv2_scale(blk, 0u);
        *offset = pkv_mqv2_zero(blk, 0u);
    } else {
        *scale = pkv_hfq_scale(blk);
        *offset = pkv_hfq_min(blk);
    }
}

/* ---------------------------------------------------------------------------
 * Q8F16 (qt 3), 32 weights: [0,2) f16_trunc(scale), [2,34) int8 codes.
 * Codes use the f32 scale amax/127; the stored f16 is truncated (<= 1 ulp smaller).
 * ------------------------------------------------------------------------- */

/* Encode x[0..n) (n <= 32; codes n..31 are 0, the zero-padded last block).
 * UNREPRESENTABLE when the stored f16 scale saturates (amax/127 beyond 65504). */
/* The Q8F16 math of one 32-weight block, shared by Q8F16 and Q8HFQ (which stores
 * the scales and codes of a row apart): writes 32 int8 codes (codes n..31 are 0)
 * and returns the f16_trunc scale bits. */
PKV_FN uint32_t pkv_q8_block_codes(const PKV_THREAD float *x, uint32_t n, PKV_DEVPTR uint8_t *codes_out) {
    /* max |x| on the magnitude bits: for finite floats integer order is float
     * order, and an integer max reduction vectorizes (a float one may not). */
    uint32_t amax_bits = 0u;
    for (uint32_t i = 0; i < n; ++i) {
        uint32_t a = pkv_f32_bits(x[i]) & 0x7FFFFFFFu;
        amax_bits = a > amax_bits ? a : amax_bits;
    }
    float amax = pkv_f32_from_bits(amax_bits);
    float scale = amax / 127.0f;
    float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    /* codes go to a local array first: it cannot alias x, so the loop vectorizes */
    uint8_t codes[PKV_Q8F16_GROUP];
    for (uint32_t i = 0; i < n; ++i) codes[i] = (uint8_t)(pkv_round_q8(x[i] * inv) & 0xFF);
    for (uint32_t i = n; i < PKV_Q8F16_GROUP; ++i) codes[i] = 0u;
    for (uint32_t i = 0; i < PKV_Q8F16_GROUP; ++i) codes_out[i] = codes[i];
    return pkv_f16_trunc(scale);
}

PKV_FN int pkv_q8f16_encode_group(const PKV_THREAD float *x, uint32_t n, PKV_DEVPTR uint8_t *blk) {
    uint32_t scale16 = pkv_q8_block_codes(x, n, blk + 2u);
    pkv_store_u16le(blk, scale16);
    return PKV_F16_IS_NONFINITE(scale16) ? PKV_ENCODE_UNREPRESENTABLE : PKV_ENCODE_OK;
}

PKV_FN float pkv_q8f16_decode_elem(const PKV_DEVPTR uint8_t *blk, uint32_t i) {
    return pkv_f16_to_f32(pkv_load_u16le(blk)) * (float)(int8_t)blk[2u + i];
}

PKV_FN void pkv_q8f16_decode_group(const PKV_DEVPTR uint8_t *blk, PKV_THREAD float *out) {
    float d = pkv_f16_to_f32(pkv_load_u16le(blk));
    for (uint32_t i = 0; i < PKV_Q8F16_GROUP; ++i) out[i] = d * (float)(int8_t)blk[2u + i];
}

/* ===========================================================================
 * P2 formats (docs/formats/quant.md, "P2 formats"): the decoders of every one
 * (CPU and GPU share them) and the encoders that need no libm. The encoders that
 * take a log2 or a square root (HFP4/MFP4, GL) are CPU-only: quant/fp4_loops.h,
 * quant/gaussian_codebook_loops.h.
 * ========================================================================= */

/* a*b and a+b rounded on their own, never fused into an FMA: the P2 decoders that add
 * a product (Q4F16G64, Q4K) give the CPU's bits on the GPU too, whatever the compiler's
 * contraction setting (host C is built with -ffp-contract=off already). */
PKV_FN float pkv_mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

PKV_FN float pkv_add_rn(float a, float b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

/* ---------------------------------------------------------------------------
 * HFP4G32 (qt 21), MFP4G32 (24, rotated per 256), MFP4G32P (33, rotated, E4M3
 * block scales). A row of K weights (K % 32 == 0) is a 16-byte header
 *   [0,2) f16_trunc(row scale)  [2,4) 0  [4,6) u16 K/32  [6] flags  [7,16) 0
 * then K/32 blocks of 17 bytes: [0] block scale byte, [1,17) 32 E2M1 nibbles
 * (low nibble = even index). w = f32(row scale) * block_scale(byte) * E2M1[n].
 * ------------------------------------------------------------------------- */

#define PKV_FP4_ROW_HEADER_BYTES 16u
#define PKV_FP4_BLOCK            32u
#define PKV_FP4_BLOCK_BYTES      17u
#define PKV_FP4_FLAGS_PLAIN      0x00u      /* HFP4G32 */
#define PKV_FP4_FLAGS_ROTATED    0x05u      /* MFP4G32, MFP4G32P: bit 0 rotation, bits 2-3 = 01 offline FWHT */
#define PKV_FP4_UE8M0_RESERVED   255u       /* the UE8M0 NaN byte: never written */
#define PKV_FP4_E4M3_MAX_CODE    0x7Eu      /* 448, the largest finite unsigned E4M3 */
#define PKV_FP4_ROW_BYTES(K)     (PKV_FP4_ROW_HEADER_BYTES + PKV_FP4_BLOCK_BYTES * ((K) / PKV_FP4_BLOCK))

/* E2M1 code n (0..15): 0, .5, 1, 1.5, 2, 3, 4, 6, then the same negated (-0 first). */
PKV_FN float pkv_e2m1_value(uint32_t n) {
    float mag;
    switch (n & 7u) {
    case 0: mag = 0.0f; break; case 1: mag = 0.5f; break; case 2: mag = 1.0f; break;
    case 3: mag = 1.5f; break; case 4: mag = 2.0f; break; case 5: mag = 3.0f; break;
    case 6: mag = 4.0f; break; default: mag = 6.0f; break;
    }
    return (n & 8u) ? -mag : mag;
}

/* Nearest E2M1 code to v, ties to the lowest code index (so +0 beats -0, and a
 * value halfway between two magnitudes takes the smaller one's index). A NaN v is code 0. */
PKV_FN uint32_t pkv_e2m1_nearest(float v) {
    uint32_t best = 0u;
    float d0 = v - pkv_e2m1_value(0u);
    float best_d = d0 < 0.0f ? -d0 : d0;
    for (uint32_t n = 1u; n < 16u; ++n) {
        float d = pkv_e2m1_value(n) - v;
        d = d < 0.0f ? -d : d;
        if (d < best_d) { best_d = d; best = n; }
    }
    return best;
}

/* UE8M0 byte e -> 2^(e - 127), exact (e = 0 is the subnormal 2^-127; 255 gives +inf,
 * the reserved byte, which decoders refuse before they get here). */
PKV_FN float pkv_ue8m0_value(uint32_t e) {
    return pkv_f32_from_bits(e == 0u ? 0x00400000u : (e & 0xFFu) << 23);
}

/* Unsigned E4M3 byte (4-bit exponent, bias 7, 3-bit mantissa) -> f32, exact.
 * 0x7F (E4M3's NaN) decodes to 448, the largest finite value, as upstream's decoder. */
PKV_FN float pkv_e4m3u_value(uint32_t b) {
    uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
    if (e == 0u) return (float)m * 0.001953125f;              /* 2^-6 * m/8, subnormal */
    if (e == 15u && m == 7u) return 448.0f;
    return pkv_f32_from_bits(((e + 120u) << 23) | (m << 20)); /* 2^(e-7) * (1 + m/8) */
}

/* Smallest unsigned E4M3 code (<= 0x7E) whose value is >= s; 0 for s <= 0 (or NaN). */
PKV_FN uint32_t pkv_e4m3u_ceil(float s) {
    if (!(s > 0.0f)) return 0u;
    for (uint32_t c = 0u; c <= PKV_FP4_E4M3_MAX_CODE; ++c)
        if (pkv_e4m3u_value(c) >= s) return c;
    return PKV_FP4_E4M3_MAX_CODE;
}

/* Block scale of a stored byte: UE8M0 (qt 21, 24) or unsigned E4M3 (qt 33). */
PKV_FN float pkv_fp4_block_scale(uint32_t byte, int e4m3) {
    return e4m3 ? pkv_e4m3u_value(byte) : pkv_ue8m0_value(byte);
}

/* Weight j of a row (row points at its 16-byte header): (row scale * block scale) * E2M1. */
PKV_FN float pkv_fp4_decode_elem(const PKV_DEVPTR uint8_t *row, uint32_t j, int e4m3) {
    const PKV_DEVPTR uint8_t *blk = row + PKV_FP4_ROW_HEADER_BYTES + PKV_FP4_BLOCK_BYTES * (j >> 5);
    float scale = pkv_f16_to_f32(pkv_load_u16le(row)) * pkv_fp4_block_scale(blk[0], e4m3);
    uint32_t k = j & 31u;
    uint32_t n = (blk[1u + (k >> 1)] >> (4u * (k & 1u))) & 0xFu;
    return scale * pkv_e2m1_value(n);
}

/* A whole row of K weights (stored basis). */
PKV_FN void pkv_fp4_decode_row(const PKV_DEVPTR uint8_t *row, uint32_t K, int e4m3, PKV_THREAD float *out) {
    float ra = pkv_f16_to_f32(pkv_load_u16le(row));
    for (uint32_t b = 0; b < K / PKV_FP4_BLOCK; ++b) {
        const PKV_DEVPTR uint8_t *blk = row + PKV_FP4_ROW_HEADER_BYTES + PKV_FP4_BLOCK_BYTES * b;
        float scale = ra * pkv_fp4_block_scale(blk[0], e4m3);
        for (uint32_t i = 0; i < 16u; ++i) {
            uint32_t byte = blk[1u + i];
            out[32u * b + 2u * i] = scale * pkv_e2m1_value(byte & 0xFu);
            out[32u * b + 2u * i + 1u] = scale * pkv_e2m1_value(byte >> 4);
        }
    }
}

/* ---------------------------------------------------------------------------
 * GL (qt 38 = 2-bit, 39 = 3-bit): 256 rotated weights per group against a fixed
 * Gaussian Lloyd-Max codebook scaled by the group's RMS. The tensor (K % 256 == 0)
 * is stored structure-of-arrays: the packed indices of every group in order
 * (bits*32 bytes each), then every group's f16 (RNE) scale. w = f32(s) * CB[idx].
 * ------------------------------------------------------------------------- */

#define PKV_GL_INDEX_BYTES(bits) (32u * (bits))
#define PKV_GL_GROUP_BYTES(bits) (PKV_GL_INDEX_BYTES(bits) + 2u)

/* Codebook entry k (ascending) of the 2- or 3-bit GL codebook. */
PKV_FN float pkv_gl_codebook(uint32_t bits, uint32_t k) {
    if (bits == 2u) {
        switch (k & 3u) {
        case 0: return -1.5104f; case 1: return -0.4528f;
        case 2: return 0.4528f; default: return 1.5104f;
        }
    }
    switch (k & 7u) {
    case 0: return -2.1520f; case 1: return -1.3439f; case 2: return -0.7560f; case 3: return -0.2451f;
    case 4: return 0.2451f; case 5: return 0.7560f; case 6: return 1.3439f; default: return 2.1520f;
    }
}

/* Nearest codebook index to v (strict <: the lowest index wins ties). */
PKV_FN uint32_t pkv_gl_nearest(uint32_t bits, float v) {
    uint32_t best = 0u, n = 1u << bits;
    float d0 = v - pkv_gl_codebook(bits, 0u);
    float best_d = d0 < 0.0f ? -d0 : d0;
    for (uint32_t k = 1u; k < n; ++k) {
        float d = v - pkv_gl_codebook(bits, k);
        d = d < 0.0f ? -d : d;
        if (d < best_d) { best_d = d; best = k; }
    }
    return best;
}

/* Weight i of group g of a GL tensor of n_groups groups (stored basis). */
PKV_FN float pkv_gl_decode_elem(const PKV_DEVPTR uint8_t *raw, uint32_t bits, uint64_t n_groups,
                                uint64_t g, uint32_t i) {
    float s = pkv_f16_to_f32(pkv_load_u16le(raw + n_groups * PKV_GL_INDEX_BYTES(bits) + 2u * g));
    uint32_t k = pkv_unpack_code(raw + g * PKV_GL_INDEX_BYTES(bits), i, bits);
    return s * pkv_gl_codebook(bits, k);
}

/* A whole group; `q` is 256 bytes of scratch. */
PKV_FN void pkv_gl_decode_group(const PKV_DEVPTR uint8_t *raw, uint32_t bits, uint64_t n_groups,
                                uint64_t g, PKV_THREAD uint8_t *q, PKV_THREAD float *out) {
    float s = pkv_f16_to_f32(pkv_load_u16le(raw + n_groups * PKV_GL_INDEX_BYTES(bits) + 2u * g));
    pkv_unpack_codes(raw + g * PKV_GL_INDEX_BYTES(bits), 256u, bits, q);
    for (uint32_t i = 0; i < 256u; ++i) out[i] = s * pkv_gl_codebook(bits, q[i]);
}

/* ---------------------------------------------------------------------------
 * MQ8G256 (qt 14): 256 rotated weights, [0,2) f16_trunc(amax/127), [2,258) int8.
 * Codes q = round_half_away(r * (127/amax)) (127/amax, not 1/scale: part of the bytes).
 * ------------------------------------------------------------------------- */

#define PKV_MQ8_GROUP_BYTES 258u

PKV_FN int pkv_mq8_encode_group(const PKV_THREAD float *r, PKV_DEVPTR uint8_t *blk) {
    float amax = 0.0f;
    for (uint32_t i = 0; i < 256u; ++i) {
        float a = r[i] < 0.0f ? -r[i] : r[i];
        amax = a > amax ? a : amax;
    }
    float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (uint32_t i = 0; i < 256u; ++i) blk[2u + i] = (uint8_t)(pkv_round_q8(r[i] * inv) & 0xFF);
    uint32_t scale16 = pkv_f16_trunc(scale);
    pkv_store_u16le(blk, scale16);
    return PKV_F16_IS_NONFINITE(scale16) ? PKV_ENCODE_UNREPRESENTABLE : PKV_ENCODE_OK;
}

PKV_FN float pkv_mq8_decode_elem(const PKV_DEVPTR uint8_t *blk, uint32_t i) {
    return pkv_f16_to_f32(pkv_load_u16le(blk)) * (float)(int8_t)blk[2u + i];
}

PKV_FN void pkv_mq8_decode_group(const PKV_DEVPTR uint8_t *blk, PKV_THREAD float *out) {
    float d = pkv_f16_to_f32(pkv_load_u16le(blk));
    for (uint32_t i = 0; i < 256u; ++i) out[i] = d * (float)(int8_t)blk[2u + i];
}

/* ---------------------------------------------------------------------------
 * Q8HFQ (qt 5): per row of K weights (K % 32 == 0), the K/32 f16_trunc scales,
 * then the K int8 codes (Q8F16's math per 32), zero padding to a multiple of 128 B.
 * ------------------------------------------------------------------------- */

#define PKV_Q8HFQ_ROW_ALIGN 128u
#define PKV_Q8HFQ_ROW_BYTES(K) \
    ((((K) / 32u * 2u + (K)) + PKV_Q8HFQ_ROW_ALIGN - 1u) / PKV_Q8HFQ_ROW_ALIGN * PKV_Q8HFQ_ROW_ALIGN)

/* Encode one row into PKV_Q8HFQ_ROW_BYTES(K) bytes; UNREPRESENTABLE when a scale saturates. */
PKV_FN int pkv_q8hfq_encode_row(const PKV_THREAD float *x, uint32_t K, PKV_DEVPTR uint8_t *row) {
    int status = PKV_ENCODE_OK;
    uint32_t n_blocks = K / 32u, stride = PKV_Q8HFQ_ROW_BYTES(K);
    for (uint32_t b = 0; b < n_blocks; ++b) {
        uint32_t s16 = pkv_q8_block_codes(x + 32u * b, 32u, row + 2u * n_blocks + 32u * b);
        pkv_store_u16le(row + 2u * b, s16);
        if (PKV_F16_IS_NONFINITE(s16)) status = PKV_ENCODE_UNREPRESENTABLE;
    }
    for (uint32_t i = 2u * n_blocks + K; i < stride; ++i) row[i] = 0u;
    return status;
}

PKV_FN float pkv_q8hfq_decode_elem(const PKV_DEVPTR uint8_t *row, uint32_t K, uint32_t j) {
    return pkv_f16_to_f32(pkv_load_u16le(row + 2u * (j >> 5))) * (float)(int8_t)row[K / 16u + j];
}

/* ---------------------------------------------------------------------------
 * Q4F16G64 (qt 0, legacy): 64 weights, [0,2) f16_trunc(scale), [2,4) f16_trunc(min),
 * [4,36) nibbles pairing i with i + 32 (byte i = q[i] | q[i+32] << 4, the one
 * exception to LSB-first packing). Codes use the f32 scale and minimum (v1 rule),
 * decode the stored f16 ones: w = q * f32(scale16) + f32(min16).
 * ------------------------------------------------------------------------- */

#define PKV_Q4F16G64_GROUP_BYTES 36u

/* Encode x[0..n) (n <= 64; the padding takes the minimum, code 0). */
PKV_FN int pkv_q4f16g64_encode_group(const PKV_THREAD float *x, uint32_t n, PKV_DEVPTR uint8_t *blk) {
    float mn = x[0], mx = x[0];
    for (uint32_t i = 1; i < n; ++i) {
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
    }
    float rng = mx - mn;
    float scale = rng > 0.0f ? rng / 15.0f : 1.0f;
    float inv = rng > 0.0f ? 1.0f / scale : 0.0f;
    uint8_t q[64];
    for (uint32_t i = 0; i < 64u; ++i) q[i] = i < n ? (uint8_t)pkv_round_affine(x[i], mn, inv, 15.0f) : 0u;
    uint32_t s16 = pkv_f16_trunc(scale), m16 = pkv_f16_trunc(mn);
    pkv_store_u16le(blk, s16);
    pkv_store_u16le(blk + 2, m16);
    for (uint32_t i = 0; i < 32u; ++i) blk[4u + i] = (uint8_t)(q[i] | (q[i + 32u] << 4));
    return PKV_F16_IS_NONFINITE(s16) || PKV_F16_IS_NONFINITE(m16) ? PKV_ENCODE_UNREPRESENTABLE
                                                                  : PKV_ENCODE_OK;
}

PKV_FN float pkv_q4f16g64_decode_elem(const PKV_DEVPTR uint8_t *blk, uint32_t i) {
    uint32_t q = (blk[4u + (i & 31u)] >> (i < 32u ? 0u : 4u)) & 0xFu;
    return pkv_add_rn(pkv_mul_rn((float)q, pkv_f16_to_f32(pkv_load_u16le(blk))),
                      pkv_f16_to_f32(pkv_load_u16le(blk + 2)));
}

PKV_FN void pkv_q4f16g64_decode_group(const PKV_DEVPTR uint8_t *blk, PKV_THREAD float *out) {
    float s = pkv_f16_to_f32(pkv_load_u16le(blk)), m = pkv_f16_to_f32(pkv_load_u16le(blk + 2));
    for (uint32_t i = 0; i < 32u; ++i) {
        uint32_t b = blk[4u + i];
        out[i] = (float)(b & 0xFu) * s + m;
        out[i + 32u] = (float)(b >> 4) * s + m;
    }
}

/* ---------------------------------------------------------------------------
 * Q4K (qt 4) = GGML Q4_K, 256 weights in 144 bytes: [0,2) f16 d, [2,4) f16 dmin,
 * [4,16) eight 6-bit (scale, min) pairs, [16,144) 4-bit codes: chunk c (64 weights)
 * is 32 bytes, low nibbles = sub-block 2c, high nibbles = 2c + 1.
 * w = (d * sc) * q - (dmin * m), ggml's dequantize_row_q4_K (and gguf-py's), exactly.
 * The gguf import decodes Q4_K tensors with this too (one definition).
 * ------------------------------------------------------------------------- */

#define PKV_Q4K_GROUP       256u
#define PKV_Q4K_GROUP_BYTES 144u

/* ggml's get_scale_min_k4: 6-bit scale and min of sub-block j (0..7). */
PKV_FN void pkv_q4k_scale_min(const PKV_DEVPTR uint8_t *sc, uint32_t j, PKV_THREAD uint32_t *s,
                              PKV_THREAD uint32_t *m) {
    if (j < 4u) {
        *s = sc[j] & 63u;
        *m = sc[j + 4u] & 63u;
    } else {
        *s = (sc[j + 4u] & 0xFu) | ((sc[j - 4u] >> 6) << 4);
        *m = (sc[j + 4u] >> 4) | ((sc[j] >> 6) << 4);
    }
}

PKV_FN float pkv_q4k_decode_elem(const PKV_DEVPTR uint8_t *blk, uint32_t i) {
    uint32_t sub = i >> 5, s, m;
    pkv_q4k_scale_min(blk + 4, sub, &s, &m);
    float d = pkv_f16_to_f32(pkv_load_u16le(blk)) * (float)s;
    float dm = pkv_f16_to_f32(pkv_load_u16le(blk + 2)) * (float)m;
    uint32_t q = (blk[16u + 32u * (i >> 6) + (i & 31u)] >> (4u * (sub & 1u))) & 0xFu;
    return pkv_add_rn(pkv_mul_rn(d, (float)q), -dm);
}

PKV_FN void pkv_q4k_decode_group(const PKV_DEVPTR uint8_t *blk, PKV_THREAD float *out) {
    float d = pkv_f16_to_f32(pkv_load_u16le(blk)), dmin = pkv_f16_to_f32(pkv_load_u16le(blk + 2));
    for (uint32_t c = 0; c < 4u; ++c) {
        uint32_t s0, m0, s1, m1;
        pkv_q4k_scale_min(blk + 4, 2u * c, &s0, &m0);
        pkv_q4k_scale_min(blk + 4, 2u * c + 1u, &s1, &m1);
        float d0 = d * (float)s0, dm0 = dmin * (float)m0, d1 = d * (float)s1, dm1 = dmin * (float)m1;
        for (uint32_t l = 0; l < 32u; ++l) {
            uint32_t b = blk[16u + 32u * c + l];
            out[64u * c + l] = d0 * (float)(b & 0xFu) - dm0;
            out[64u * c + 32u + l] = d1 * (float)(b >> 4) - dm1;
        }
    }
}

/* ---------------------------------------------------------------------------
 * TQ2G128 (qt 40) and BQ1G128 (qt 41), Bonsai passthrough formats, 128 weights:
 * [0,2) f16 d, then 2-bit codes (TQ2, 32 B) or sign bits (BQ1, 16 B), LSB-first.
 * TQ2: w = (code - 1) * d (code 3, never written by a ternary encoder, is 2d).
 * BQ1: w = +d for a set bit, -d for a clear one.
 * Bit order and sign sense are unverified upstream; these are pagedkv's choices.
 * ------------------------------------------------------------------------- */

#define PKV_TQ2_GROUP_BYTES 34u
#define PKV_BQ1_GROUP_BYTES 18u

PKV_FN float pkv_tq2_decode_elem(const PKV_DEVPTR uint8_t *blk, uint32_t i) {
    float d = pkv_f16_to_f32(pkv_load_u16le(blk));
    return (float)((int32_t)pkv_unpack_code(blk + 2, i, 2u) - 1) * d;
}

PKV_FN float pkv_bq1_decode_elem(const PKV_DEVPTR uint8_t *blk, uint32_t i) {
    float d = pkv_f16_to_f32(pkv_load_u16le(blk));
    return pkv_unpack_code(blk + 2, i, 1u) ? d : -d;
}

#endif /* PAGEDKV_QUANT_H */
