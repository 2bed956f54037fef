/* CPU builds of the hot loops for several x86-64 levels, picked at load time.
 *
 * Wheels target baseline x86-64 (SSE2), which leaves most of a modern core
 * idle in these loops. GCC's target_clones compiles a function once per listed
 * ISA and binds the best one through an ifunc when the module loads. The
 * clones run the same C with -ffp-contract=off (no FMA contraction), and the
 * loops only vectorize independent element operations or use GCC vector
 * extensions whose lane semantics do not depend on the ISA, so every clone
 * gives the same bits for finite data (tests/test_quant_header.py builds each
 * level and compares; a NaN in a stored header could propagate another payload). Elsewhere (clang, arm64, macOS) only `unused` remains: a
 * module includes the loop headers it needs and may not call every loop in them.
 */
#ifndef PAGEDKV_QUANT_CPU_SIMD_H
#define PAGEDKV_QUANT_CPU_SIMD_H

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && (__GNUC__ >= 11)
#  define PKV_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), unused))
#elif defined(__GNUC__)
#  define PKV_CPU_CLONES __attribute__((unused))
#else
#  define PKV_CPU_CLONES
#endif

#endif /* PAGEDKV_QUANT_CPU_SIMD_H */
