/* Which x86-64 vector extensions this CPU and OS run, from CPUID and XGETBV.
 *
 * For the loops that pick a kernel at run time (prepared_gemv_loops.h,
 * mq_decode_loops.h). Read directly rather than through __builtin_cpu_supports,
 * whose feature names differ between compilers (clang 15 knows neither "f16c" nor
 * "avxvnni"). An extension counts only when the OS saves its registers (XCR0).
 * Read once per process and kept: under a hypervisor every CPUID traps to it (about
 * 5 us each on the dev VM), and the MQ decoder asks per part of a dequantize.
 */
#ifndef PAGEDKV_QUANT_CPU_FEATURES_H
#define PAGEDKV_QUANT_CPU_FEATURES_H

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <stdint.h>

enum {
    PKV_CPU_AVX2 = 1 << 0,          /* with FMA and F16C (x86-64-v3's vector part) */
    PKV_CPU_AVXVNNI = 1 << 1,       /* VEX vpdpbusd */
    PKV_CPU_AVX512 = 1 << 2,        /* F, BW, VL */
    PKV_CPU_AVX512VNNI = 1 << 3,
};

static inline unsigned pkv_cpu_features_read(void) {
    unsigned a, b, c, d, f = 0u;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0u;
    const int osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u;
    const int fma = (c >> 12) & 1u, f16c = (c >> 29) & 1u;
    if (!osxsave || !avx) return 0u;
    uint32_t xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    const int ymm_state = (xlo & 0x6u) == 0x6u;           /* SSE + AVX state */
    const int zmm_state = (xlo & 0xE6u) == 0xE6u;         /* + opmask, ZMM_Hi256, Hi16_ZMM */
    unsigned b7 = 0, c7 = 0, a71 = 0;
    if (__get_cpuid_count(7, 0, &a, &b7, &c7, &d)) {
        if (__get_cpuid_count(7, 1, &a71, &b, &c, &d) == 0) a71 = 0;
    }
    if (ymm_state && ((b7 >> 5) & 1u) && fma && f16c) f |= PKV_CPU_AVX2;
    if ((f & PKV_CPU_AVX2) && ((a71 >> 4) & 1u)) f |= PKV_CPU_AVXVNNI;
    if ((f & PKV_CPU_AVX2) && zmm_state && ((b7 >> 16) & 1u) && ((b7 >> 30) & 1u) &&
        ((b7 >> 31) & 1u))
        f |= PKV_CPU_AVX512;
    if ((f & PKV_CPU_AVX512) && ((c7 >> 11) & 1u)) f |= PKV_CPU_AVX512VNNI;
    return f;
}

/* The PKV_CPU_* bits of this CPU (read on the first call; threads racing on it store
 * the same value). */
static inline unsigned pkv_cpu_features(void) {
    static unsigned cached;                     /* bit 31: read */
    unsigned f = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (f == 0u) {
        f = pkv_cpu_features_read() | 0x80000000u;
        __atomic_store_n(&cached, f, __ATOMIC_RELAXED);
    }
    return f & 0x7FFFFFFFu;
}
#endif

#endif /* PAGEDKV_QUANT_CPU_FEATURES_H */
