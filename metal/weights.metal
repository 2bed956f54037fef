// Weight kernels: dequantize every P1 quantized format (HFQ, MQ v1, MQ V2, MQ4C,
// Q8F16) to f32 or f16, the fused dequant-GEMV y = W x for a batch of 1-8
// activations, and the FWHT-256 rotation of activations (MQ formats: rotate x once,
// then run the plain affine GEMV on the stored rotated weights).
//
// The pkv_*_thread functions are the kernels' bodies: pagedkv.kernels.mlx calls them
// from the one-line sources it hands mlx.core.fast.metal_kernel, and the [[kernel]]
// entry points below (compiled into pagedkv.metallib on macOS, and by the Linux
// compile check) call them with the same arguments. Index arrays and parameters take
// any pointer type: MLX passes inputs of fewer than 8 elements in the constant
// address space, larger ones in device memory.
//
// Raw tensors are one stream of groups (row-major, groups of G weights, B bytes
// each); groups may straddle rows, a short last group writes only its real weights.
#ifndef PAGEDKV_METAL_WEIGHTS
#define PAGEDKV_METAL_WEIGHTS

#include "pagedkv_metal.h"

// ---------------------------------------------------------------------------
// Dequantize: 8 consecutive weights of one group per thread, in the stored basis.
// params: [numel_lo, numel_hi] (numel = lo + hi * 2^31, int32 halves).

template <typename P>
inline int64_t pkv_param_i64(P params, int i) {
  return int64_t(params[i]) + (int64_t(params[i + 1]) << 31);
}

template <int FAMILY, int BITS, int G, typename Out, typename P>
inline void pkv_dequant_thread(const device uint8_t* raw, device Out* out, P params,
                               uint64_t chunk) {
  using L = PkvWeightLayout<FAMILY, BITS, G>;
  const int64_t numel = pkv_param_i64(params, 0);
  const int64_t i0 = int64_t(chunk) * 8;
  if (i0 >= numel) return;
  const int64_t g = i0 / G;
  const uint32_t e0 = uint32_t(i0 - g * G);
  float scale, offset, q[8];
  pkv_weight_span<FAMILY, BITS, G, 8>(raw + g * L::BYTES, e0, &scale, &offset, q);
  for (int k = 0; k < 8; ++k) {
    if (i0 + k < numel) {
      // quant.h's decode: q * scale + offset (Q8F16: d * q)
      out[i0 + k] = Out(FAMILY == PKV_LAYOUT_Q8F16 ? q[k] * scale : q[k] * scale + offset);
    }
  }
}

// ---------------------------------------------------------------------------
// FWHT-256 of activations: one simdgroup per 256-group, 8 consecutive values per
// lane. Strides 1-4 are quant.h's butterflies in registers; strides 8-128 pair lane
// with lane ^ (stride / 8): the lower lane of a pair computes a + b, the upper a - b,
// as the CPU loop does, so the result is bit for bit pkv_fwht's.

inline void pkv_fwht256_simd(thread float* v, uint32_t lane) {
  const uint32_t e0 = lane * 8;
  const uint32_t s1 = pkv_signs1_word(e0 >> 5) >> (e0 & 31);
  const uint32_t s2 = pkv_signs2_word(e0 >> 5) >> (e0 & 31);
  for (int i = 0; i < 8; ++i) v[i] = v[i] * (((s1 >> i) & 1u) ? 1.0f : -1.0f);
  pkv_fwht_butterflies(v, 8u);
  for (uint32_t lane_stride = 1; lane_stride < PKV_SIMD; lane_stride <<= 1) {
    const bool upper = (lane & lane_stride) != 0;
    for (int i = 0; i < 8; ++i) {
      const float other = simd_shuffle_xor(v[i], ushort(lane_stride));
      v[i] = upper ? other - v[i] : v[i] + other;
    }
  }
  for (int i = 0; i < 8; ++i)  // c * (+-1) is exact, as in pkv_fwht
    v[i] = v[i] * (PKV_FWHT_SCALE_256 * (((s2 >> i) & 1u) ? 1.0f : -1.0f));
}

// params: [n_groups]. The grid is whole simdgroups (32 * n_groups threads).
template <typename P>
inline void pkv_fwht256_thread(const device float* x, device float* y, P params, uint32_t gid,
                               uint32_t lane) {
  const uint32_t g = gid / PKV_SIMD;
  if (g >= uint32_t(params[0])) return;  // whole simdgroups leave together
  const device float* src = x + int64_t(g) * PKV_FWHT_N + lane * 8;
  float v[8];
  for (int i = 0; i < 8; ++i) v[i] = src[i];
  pkv_fwht256_simd(v, lane);
  device float* dst = y + int64_t(g) * PKV_FWHT_N + lane * 8;
  for (int i = 0; i < 8; ++i) dst[i] = v[i];
}

// ---------------------------------------------------------------------------
// Fused dequant-GEMV: y[b, m] = sum_k W[m, k] x[b, k] for b < batch <= BMAX, K % G == 0.
// A simdgroup owns PKV_GEMV_ROWS rows; its lanes take 16-weight spans of K in turn
// (consecutive lanes, consecutive spans: a simdgroup's loads of codes and of x are
// contiguous), each span's x serving all the rows. Within a span the affine map is one
// (scale, offset): its dot product is scale * sum(q x) + offset * sum(x), sum(x) shared
// by the rows. Lane sums meet in simd_sum. params: [M, K, batch].

#define PKV_GEMV_ROWS 4
#define PKV_GEMV_SIMDGROUPS 2  // per threadgroup: 64 threads, 8 rows
#define PKV_GEMV_SPAN 16

template <int FAMILY, int BITS, int G, int BMAX, typename P>
inline void pkv_gemv_thread(const device uint8_t* w, const device float* x, device float* y,
                            P params, uint32_t simdgroup, uint32_t lane) {
  using L = PkvWeightLayout<FAMILY, BITS, G>;
  const int M = params[0], K = params[1], batch = params[2];
  const int row0 = int(simdgroup) * PKV_GEMV_ROWS;
  const int64_t row_bytes = int64_t(K / G) * L::BYTES;
  const int slices = K / PKV_GEMV_SPAN;
  float acc[PKV_GEMV_ROWS][BMAX];
  for (int r = 0; r < PKV_GEMV_ROWS; ++r)
    for (int b = 0; b < BMAX; ++b) acc[r][b] = 0.0f;
  for (int s = int(lane); s < slices; s += PKV_SIMD) {
    const int k0 = s * PKV_GEMV_SPAN;
    const int g = k0 / G;
    const uint32_t e0 = uint32_t(k0 - g * G);
    float xv[BMAX][PKV_GEMV_SPAN], sx[BMAX];
    for (int b = 0; b < BMAX; ++b) {
      sx[b] = 0.0f;
      for (int i = 0; i < PKV_GEMV_SPAN; ++i) {
        xv[b][i] = b < batch ? x[int64_t(b) * K + k0 + i] : 0.0f;
        sx[b] += xv[b][i];
      }
    }
    for (int r = 0; r < PKV_GEMV_ROWS; ++r) {
      const int row = min(row0 + r, M - 1);  // missing last rows re-read a real one, unstored
      float scale, offset, q[PKV_GEMV_SPAN];
      pkv_weight_span<FAMILY, BITS, G, PKV_GEMV_SPAN>(w + row * row_bytes + g * L::BYTES, e0,
                                                      &scale, &offset, q);
      for (int b = 0; b < BMAX; ++b) {
        float qx = 0.0f;
        for (int i = 0; i < PKV_GEMV_SPAN; ++i) qx += q[i] * xv[b][i];
        acc[r][b] += scale * qx + offset * sx[b];
      }
    }
  }
  for (int r = 0; r < PKV_GEMV_ROWS; ++r) {
    for (int b = 0; b < BMAX; ++b) {
      const float v = simd_sum(acc[r][b]);
      if (lane == 0 && b < batch && row0 + r < M) y[int64_t(b) * M + row0 + r] = v;
    }
  }
}

#ifndef PKV_MLX_JIT  // MLX generates its own kernels around the same calls

// ---------------------------------------------------------------------------
// Entry points for pagedkv.metallib and the compile checks (MLX generates its own
// signatures around the same calls). Buffers: inputs, outputs, then params.

#define PKV_DEQUANT_ENTRY(NAME, FAMILY, BITS, G)                                              \
  [[kernel]] void pkv_dequant_##NAME##_f32(const device uint8_t* raw [[buffer(0)]],          \
                                           const device int32_t* params [[buffer(1)]],       \
                                           device float* out [[buffer(2)]],                  \
                                           uint3 tid [[thread_position_in_grid]]) {          \
    pkv_dequant_thread<FAMILY, BITS, G, float>(raw, out, params, tid.x);                    \
  }                                                                                          \
  [[kernel]] void pkv_dequant_##NAME##_f16(const device uint8_t* raw [[buffer(0)]],          \
                                           const device int32_t* params [[buffer(1)]],       \
                                           device half* out [[buffer(2)]],                   \
                                           uint3 tid [[thread_position_in_grid]]) {          \
    pkv_dequant_thread<FAMILY, BITS, G, half>(raw, out, params, tid.x);                     \
  }

PKV_DEQUANT_ENTRY(hfq4g256, PKV_FAMILY_HFQ, 4, 256)
PKV_DEQUANT_ENTRY(hfq4g128, PKV_FAMILY_HFQ, 4, 128)
PKV_DEQUANT_ENTRY(hfq6g256, PKV_FAMILY_HFQ, 6, 256)
PKV_DEQUANT_ENTRY(hfq3g256, PKV_FAMILY_HFQ, 3, 256)
PKV_DEQUANT_ENTRY(hfq2g256, PKV_FAMILY_HFQ, 2, 256)
PKV_DEQUANT_ENTRY(mq5g256, PKV_FAMILY_MQ_V1, 5, 256)
PKV_DEQUANT_ENTRY(mq4g256v2, PKV_FAMILY_MQ_V2, 4, 256)
PKV_DEQUANT_ENTRY(mq6g256v2, PKV_FAMILY_MQ_V2, 6, 256)
PKV_DEQUANT_ENTRY(mq4cg256, PKV_FAMILY_MQ4C, 4, 256)
PKV_DEQUANT_ENTRY(q8f16, PKV_LAYOUT_Q8F16, 8, 32)

[[kernel]] void pkv_fwht256_f32(const device float* x [[buffer(0)]],
                                const device int32_t* params [[buffer(1)]],
                                device float* y [[buffer(2)]],
                                uint3 tid [[thread_position_in_grid]],
                                uint lane [[thread_index_in_simdgroup]]) {
  pkv_fwht256_thread(x, y, params, tid.x, lane);
}

#define PKV_GEMV_ENTRY(NAME, FAMILY, BITS, G, BMAX)                                             \
  [[kernel]] void pkv_gemv_##NAME##_b##BMAX(                                                  \
      const device uint8_t* w [[buffer(0)]], const device float* x [[buffer(1)]],              \
      const device int32_t* params [[buffer(2)]], device float* y [[buffer(3)]],               \
      uint3 tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],   \
      uint lane [[thread_index_in_simdgroup]]) {                                               \
    pkv_gemv_thread<FAMILY, BITS, G, BMAX>(w, x, y, params, tg.x * PKV_GEMV_SIMDGROUPS + sg,   \
                                           lane);                                              \
  }
#define PKV_GEMV_ENTRIES(NAME, FAMILY, BITS, G) \
  PKV_GEMV_ENTRY(NAME, FAMILY, BITS, G, 1)      \
  PKV_GEMV_ENTRY(NAME, FAMILY, BITS, G, 2)      \
  PKV_GEMV_ENTRY(NAME, FAMILY, BITS, G, 4)      \
  PKV_GEMV_ENTRY(NAME, FAMILY, BITS, G, 8)

PKV_GEMV_ENTRIES(hfq4g256, PKV_FAMILY_HFQ, 4, 256)
PKV_GEMV_ENTRIES(mq4g256v2, PKV_FAMILY_MQ_V2, 4, 256)
PKV_GEMV_ENTRIES(hfq6g256, PKV_FAMILY_HFQ, 6, 256)
PKV_GEMV_ENTRIES(q8f16, PKV_LAYOUT_Q8F16, 8, 32)

#endif  // PKV_MLX_JIT
#endif  // PAGEDKV_METAL_WEIGHTS
