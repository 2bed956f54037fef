/* float16 -> float32 widening of 16-lane GCC vectors, exact, for the CPU codec loops.
 *
 * GCC scalarizes a _Float16 vector conversion (one vcvtph2ps per lane), so the widening is
 * written in integer vector ops that every ISA level vectorizes: shift the exponent and
 * mantissa into place and rebias; subnormals (exponent 0) through one exact float
 * subtraction of 2^-14; Inf/NaN keep an all-ones exponent. Masks come from signed shifts,
 * not comparisons (GCC scalarizes comparisons of vectors wider than the ISA).
 */
#ifndef PAGEDKV_QUANT_HALF_VECTORS_H
#define PAGEDKV_QUANT_HALF_VECTORS_H

#include <stdint.h>
#include <string.h>
#include "fwht_loops.h"

#if defined(__GNUC__) && !defined(__clang__)

typedef uint16_t pkv_kv_v16u16_ __attribute__((vector_size(32)));
typedef uint32_t pkv_kv_v16u32_ __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) void pkv_kv_f16_to_f32_v_(const uint16_t *src,
                                                                         pkv_fwht_v16f *dst) {
    pkv_kv_v16u16_ h16;
    memcpy(&h16, src, sizeof h16);
    const pkv_kv_v16u32_ h = __builtin_convertvector(h16, pkv_kv_v16u32_);
    pkv_kv_v16u32_ o = (h & 0x7FFFu) << 13;
    const pkv_kv_v16u32_ e = o & 0x0F800000u;
    o = o + (112u << 23);
    /* e is 0 .. 0x0F800000: all ones exponent, exponent 0 */
    o = o + ((pkv_kv_v16u32_)((pkv_fwht_v16i)(0x0F7FFFFFu - e) >> 31) & (112u << 23));
    const pkv_kv_v16u32_ den = (pkv_kv_v16u32_)((pkv_fwht_v16i)(e - 1u) >> 31);
    o = o + (den & (1u << 23));
    const pkv_fwht_v16f f = (pkv_fwht_v16f)o;
    const pkv_fwht_v16f fd = f - 6.103515625e-05f;   /* 2^-14: the subnormal bias, exact */
    o = ((pkv_kv_v16u32_)f & ~den) | ((pkv_kv_v16u32_)fd & den);
    *dst = (pkv_fwht_v16f)(o | ((h & 0x8000u) << 16));
}

#endif

#endif /* PAGEDKV_QUANT_HALF_VECTORS_H */
