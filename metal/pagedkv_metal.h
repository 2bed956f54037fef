// pagedkv_metal.h: what metal/ kernels need on top of the shared headers.
//
// The Metal counterpart of hip/pagedkv_compat.h. The per-element math (code
// unpacking, f16 widening and rounding, affine decode, sign tables, butterflies,
// KV q8 codes) is pagedkv/quant.h and pagedkv/kvquant.h, the text the CPU codecs
// and the hip/ kernels compile; the .metal files only decide which thread reads
// which bytes. pagedkv.kernels.mlx passes this file, those headers and the
// kernel source as one text to mlx.core.fast.metal_kernel (`header=`); the
// build compiles the same files with `xcrun metal` on macOS and with a C++
// compiler against metal/shim/ elsewhere (docs/kernels.md, "Metal").
#ifndef PAGEDKV_METAL_H
#define PAGEDKV_METAL_H

#include <metal_stdlib>
#include <pagedkv/quant.h>
#include <pagedkv/kvquant.h>

using namespace metal;

// Apple GPUs run simdgroups of 32 threads; the kernels' lane arithmetic assumes it.
#define PKV_SIMD 32

// Weight layouts the kernel templates take (FAMILY): quant.h's affine families,
// and the Q8F16 blocks, which are not affine (signed codes, no offset).
#define PKV_LAYOUT_Q8F16 4

// The running max of a softmax starts at the lowest finite float, not -INFINITY: Metal
// compiles with fast math, which may assume no infinities (exp of it is still 0).
#define PKV_LOWEST_FLOAT (-3.40282347e38f)

// Threadgroup arrays are declared at kernel scope (Metal allows them nowhere else);
// the Linux shim turns them into statics shared by the emulated threads.
#ifndef PKV_SHARED
#define PKV_SHARED(T, name, n) threadgroup T name[n]
#endif

// Hardware conversions on raw bits: exact widening (the same values as quant.h's
// pkv_f16_to_f32), round-to-nearest-even narrowing.
inline float pkv_half_bits_to_float(uint16_t h) { return float(as_type<half>(h)); }
inline float pkv_bf16_bits_to_float(uint16_t b) { return as_type<float>(uint32_t(b) << 16); }

// Bytes of one weight group and the offset of its codes.
template <int FAMILY, int BITS, int G>
struct PkvWeightLayout {
  static constant constexpr int HEADER = FAMILY == PKV_LAYOUT_Q8F16 ? 2 : 8;
  static constant constexpr int BYTES = HEADER + BITS * G / 8;
};

// (scale, offset) and the codes as floats of weights [e0, e0 + N) of the group at
// blk (N a multiple of 8; a span never crosses a group or a V2 half).
template <int FAMILY, int BITS, int G, int N>
inline void pkv_weight_span(const device uint8_t* blk, uint32_t e0, thread float* scale,
                            thread float* offset, thread float* codes) {
  thread uint8_t q[N];
  pkv_unpack_codes(blk + PkvWeightLayout<FAMILY, BITS, G>::HEADER + e0 * BITS / 8, N, BITS, q);
  if (FAMILY == PKV_LAYOUT_Q8F16) {
    *scale = pkv_f16_to_f32(pkv_load_u16le(blk));
    *offset = 0.0f;
    for (int i = 0; i < N; ++i) codes[i] = float(int8_t(q[i]));
  } else {
    pkv_affine_params(blk, FAMILY, e0, scale, offset);
    for (int i = 0; i < N; ++i) codes[i] = float(q[i]);
  }
}

#endif  // PAGEDKV_METAL_H
