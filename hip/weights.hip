// Weight kernels: dequantize HFQ4G256 / MQ4G256 / MQ4G256V2 / HFQ6G256 / Q8F16 to
// f32 or f16, fused dequant-GEMV y = W x for a batch of 1-8 activations, and the
// FWHT-256 rotation of activations (MQ formats: rotate x once, then run the plain
// affine GEMV on the stored rotated weights, hfqm-and-quant.md §3.6).
//
// The per-element math (field layout, code unpacking, f16 widening, affine decode,
// sign tables, butterflies) is pagedkv/quant.h's; this file only decides which
// thread reads which bytes. Raw tensors are one stream of groups (row-major, groups
// of G weights, B bytes each), at an 8-byte aligned device address.
//
// Parameters: inputs, outputs, then scalars.
#include "pagedkv_compat.h"
#include <pagedkv/quant.h>

// ---------------------------------------------------------------------------
// Formats. A thread decodes "chunks" of 8 consecutive weights of one group: the
// group header gives (scale, offset) for the chunk, the codes give 8 integers,
// and w = code * scale + offset (Q8F16: offset 0, signed codes).

enum WeightFormat { HFQ4G256 = 0, MQ4G256V2 = 1, HFQ6G256 = 2, Q8F16 = 3 };

template <int F>
struct Format;

template <>
struct Format<HFQ4G256> {  // also MQ4G256 (qt 13): the same bytes, rotated weights
  static constexpr int G = 256, B = 136, BITS = 4, HEADER = 8;
};
template <>
struct Format<MQ4G256V2> {
  static constexpr int G = 256, B = 136, BITS = 4, HEADER = 8;
};
template <>
struct Format<HFQ6G256> {
  static constexpr int G = 256, B = 200, BITS = 6, HEADER = 8;
};
template <>
struct Format<Q8F16> {
  static constexpr int G = PKV_Q8F16_GROUP, B = PKV_Q8F16_GROUP_BYTES, BITS = 8, HEADER = 2;
};

// Copy n bytes at p (2-byte aligned, n even) into registers with the widest loads
// the alignment allows; quant.h's byte-wise readers then run on the copy.
template <int N, int ALIGN>
PKV_DEV void load_bytes(const uint8_t* p, uint8_t (&out)[N]) {
  static_assert(N % 2 == 0, "even byte counts only");
  if (ALIGN % 8 == 0 && N % 8 == 0) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      const uint2 v = ((const uint2*)p)[i];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        out[8 * i + b] = (uint8_t)(v.x >> (8 * b));
        out[8 * i + 4 + b] = (uint8_t)(v.y >> (8 * b));
      }
    }
  } else if (ALIGN % 4 == 0 && N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint32_t v = ((const uint32_t*)p)[i];
#pragma unroll
      for (int b = 0; b < 4; ++b) out[4 * i + b] = (uint8_t)(v >> (8 * b));
    }
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const uint16_t v = ((const uint16_t*)p)[i];
      out[2 * i] = (uint8_t)v;
      out[2 * i + 1] = (uint8_t)(v >> 8);
    }
  }
}

// (scale, offset) of the chunk starting at weight `elem` of the group at grp.
template <int F>
PKV_DEV void chunk_affine(const uint8_t* grp, int elem, float& scale, float& offset) {
  uint8_t hdr[Format<F>::HEADER];
  load_bytes<Format<F>::HEADER, (F == Q8F16 ? 2 : 8)>(grp, hdr);
  if (F == Q8F16) {
    scale = pkv_f16_to_f32(pkv_load_u16le(hdr));
    offset = 0.0f;
  } else if (F == MQ4G256V2) {
    // The half comes from the weight index; both are read with constant indices so
    // the header copy stays in registers.
    const bool upper = elem >= 128;
    scale = upper ? pkv_mqv2_scale(hdr, 1u) : pkv_mqv2_scale(hdr, 0u);
    offset = upper ? pkv_mqv2_zero(hdr, 1u) : pkv_mqv2_zero(hdr, 0u);
  } else {
    scale = pkv_hfq_scale(hdr);
    offset = pkv_hfq_min(hdr);
  }
}

// Weights [elem, elem + 8*CHUNKS) of the group at grp (elem a multiple of 8).
template <int F, int CHUNKS>
PKV_DEV void decode_chunks(const uint8_t* grp, int elem, float (&w)[8 * CHUNKS]) {
  constexpr int NB = Format<F>::BITS * CHUNKS;  // code bytes
  float scale, offset;
  chunk_affine<F>(grp, elem, scale, offset);
  uint8_t bytes[NB];
  const uint8_t* codes = grp + Format<F>::HEADER + elem * Format<F>::BITS / 8;
  // Codes start at 8 + NB*k in a group (groups are 8-byte multiples): aligned to
  // gcd(8, NB); Q8F16 codes at 2 + 8k in 34-byte groups: 2.
  constexpr int ALIGN = F == Q8F16 ? 2 : (NB % 8 == 0 ? 8 : (NB % 4 == 0 ? 4 : 2));
  load_bytes<NB, ALIGN>(codes, bytes);
  uint8_t q[8 * CHUNKS];
  pkv_unpack_codes(bytes, 8 * CHUNKS, Format<F>::BITS, q);
#pragma unroll
  for (int i = 0; i < 8 * CHUNKS; ++i) {
    const float code = F == Q8F16 ? (float)(int8_t)q[i] : (float)q[i];
    w[i] = code * scale + offset;
  }
}

// ---------------------------------------------------------------------------
// Dequantize: one chunk of 8 weights per thread, over the flat weight stream
// (groups may straddle rows); a short last group writes only its real weights.

PKV_DEV void store8(float* out, int64_t i, int64_t n, const float (&w)[8]) {
  if (i + 8 <= n && (i & 3) == 0) {
    ((float4*)(out + i))[0] = make_float4(w[0], w[1], w[2], w[3]);
    ((float4*)(out + i))[1] = make_float4(w[4], w[5], w[6], w[7]);
  } else {
    for (int k = 0; k < 8 && i + k < n; ++k) out[i + k] = w[k];
  }
}

PKV_DEV void store8(uint16_t* out, int64_t i, int64_t n, const float (&w)[8]) {
  uint16_t h[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) h[k] = pkv_float_to_half_bits(w[k]);
  if (i + 8 <= n && (i & 7) == 0) {
    *(uint4*)(out + i) = make_uint4(h[0] | (uint32_t)h[1] << 16, h[2] | (uint32_t)h[3] << 16,
                                    h[4] | (uint32_t)h[5] << 16, h[6] | (uint32_t)h[7] << 16);
  } else {
    for (int k = 0; k < 8 && i + k < n; ++k) out[i + k] = h[k];
  }
}

template <int F, typename Out>
PKV_DEV void dequantize(const uint8_t* __restrict__ raw, Out* __restrict__ out, int64_t n) {
  using Fm = Format<F>;
  const int64_t chunk = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t i = chunk * 8;
  if (i >= n) return;
  const int64_t g = i / Fm::G;
  float w[8];
  decode_chunks<F, 1>(raw + g * Fm::B, (int)(i - g * Fm::G), w);
  store8(out, i, n, w);
}

#define PKV_DEQUANT_KERNELS(NAME, F)                                                         \
  PKV_KERNEL void pkv_dequant_##NAME##_f32(const uint8_t* raw, float* out, int64_t n) {     \
    dequantize<F, float>(raw, out, n);                                                      \
  }                                                                                         \
  PKV_KERNEL void pkv_dequant_##NAME##_f16(const uint8_t* raw, uint16_t* out, int64_t n) {  \
    dequantize<F, uint16_t>(raw, out, n);                                                   \
  }

PKV_DEQUANT_KERNELS(hfq4g256, HFQ4G256)
PKV_DEQUANT_KERNELS(mq4g256v2, MQ4G256V2)
PKV_DEQUANT_KERNELS(hfq6g256, HFQ6G256)
PKV_DEQUANT_KERNELS(q8f16, Q8F16)

// ---------------------------------------------------------------------------
// Fused dequant-GEMV: y[b, m] = sum_k W[m, k] x[b, k] for b < batch <= BMAX, with
// K % G == 0 (every row starts a group). A warp owns GEMV_ROWS rows; each lane takes
// slices of 32 weights (4 chunks: one header read per slice) strided over the row, so
// one x slice loaded from cache serves every row of the warp.

#define GEMV_THREADS 256
#define GEMV_ROWS 2
#define GEMV_SLICE 32

template <int F, int BMAX>
PKV_DEV void gemv(const uint8_t* __restrict__ w_raw, const float* __restrict__ x,
                  float* __restrict__ y, int M, int K, int batch) {
  using Fm = Format<F>;
  constexpr int CHUNKS = F == Q8F16 ? 4 : GEMV_SLICE / 8;  // Q8F16: one 32-weight group
  const int lane = threadIdx.x % PKV_WARP_SIZE;
  const int warp = (blockIdx.x * GEMV_THREADS + threadIdx.x) / PKV_WARP_SIZE;
  const int row0 = warp * GEMV_ROWS;
  if (row0 >= M) return;  // whole warps leave together
  const int64_t groups_per_row = K / Fm::G;
  const int slices = K / GEMV_SLICE;

  float acc[GEMV_ROWS][BMAX];
#pragma unroll
  for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
    for (int b = 0; b < BMAX; ++b) acc[r][b] = 0.0f;

  for (int s = lane; s < slices; s += PKV_WARP_SIZE) {
    const int k0 = s * GEMV_SLICE;
    const int g = k0 / Fm::G, e0 = k0 - g * Fm::G;
    float w[GEMV_ROWS][GEMV_SLICE];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
      const int row = min(row0 + r, M - 1);  // a missing last row re-reads a real one
      decode_chunks<F, CHUNKS>(w_raw + ((int64_t)row * groups_per_row + g) * Fm::B, e0, w[r]);
    }
#pragma unroll
    for (int b = 0; b < BMAX; ++b) {
      if (b < batch) {
        const float4* xb = (const float4*)(x + (int64_t)b * K + k0);
#pragma unroll
        for (int v = 0; v < GEMV_SLICE / 4; ++v) {
          const float4 xv = xb[v];
#pragma unroll
          for (int r = 0; r < GEMV_ROWS; ++r) {
            acc[r][b] += w[r][4 * v] * xv.x;
            acc[r][b] += w[r][4 * v + 1] * xv.y;
            acc[r][b] += w[r][4 * v + 2] * xv.z;
            acc[r][b] += w[r][4 * v + 3] * xv.w;
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
    for (int b = 0; b < BMAX; ++b) {
      float v = acc[r][b];
      for (int o = PKV_WARP_SIZE / 2; o > 0; o >>= 1) v += pkv_shfl_xor(v, o);
      if (lane == 0 && b < batch && row0 + r < M) y[(int64_t)b * M + row0 + r] = v;
    }
}

#define PKV_GEMV_KERNEL(NAME, F, BMAX)                                                      \
  PKV_KERNEL void __launch_bounds__(GEMV_THREADS)                                          \
      pkv_gemv_##NAME##_b##BMAX(const uint8_t* w, const float* x, float* y, int M, int K,  \
                                int batch) {                                               \
    gemv<F, BMAX>(w, x, y, M, K, batch);                                                   \
  }
#define PKV_GEMV_KERNELS(NAME, F) \
  PKV_GEMV_KERNEL(NAME, F, 1)     \
  PKV_GEMV_KERNEL(NAME, F, 2)     \
  PKV_GEMV_KERNEL(NAME, F, 4)     \
  PKV_GEMV_KERNEL(NAME, F, 8)

PKV_GEMV_KERNELS(hfq4g256, HFQ4G256)
PKV_GEMV_KERNELS(mq4g256v2, MQ4G256V2)
PKV_GEMV_KERNELS(hfq6g256, HFQ6G256)
PKV_GEMV_KERNELS(q8f16, Q8F16)

// ---------------------------------------------------------------------------
// FWHT-256 of activations: one warp per 256-group, each lane holding 256/warp_size
// consecutive values. Strides below that are quant.h's butterflies in registers;
// larger strides pair lanes lane ^ (h / per_lane). The lower element of a pair
// computes a + b and the upper a - b, as in the CPU loop, so the result is bit
// for bit pkv_fwht's.

#define FWHT_PER_LANE (PKV_FWHT_N / PKV_WARP_SIZE)

PKV_KERNEL void pkv_fwht256_f32(const float* x, float* y, int64_t n_groups) {
  const int lane = threadIdx.x % PKV_WARP_SIZE;
  const int64_t g = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / PKV_WARP_SIZE;
  if (g >= n_groups) return;  // whole warps leave together
  const int e0 = lane * FWHT_PER_LANE;
  const float* src = x + g * PKV_FWHT_N + e0;
  float v[FWHT_PER_LANE];
#pragma unroll
  for (int i = 0; i < FWHT_PER_LANE; i += 4) {
    const float4 t = *(const float4*)(src + i);
    v[i] = t.x * pkv_sign1(e0 + i);
    v[i + 1] = t.y * pkv_sign1(e0 + i + 1);
    v[i + 2] = t.z * pkv_sign1(e0 + i + 2);
    v[i + 3] = t.w * pkv_sign1(e0 + i + 3);
  }
  pkv_fwht_butterflies(v, FWHT_PER_LANE);
#pragma unroll
  for (int lane_stride = 1; lane_stride < PKV_WARP_SIZE; lane_stride <<= 1) {
    const bool upper = (lane & lane_stride) != 0;
#pragma unroll
    for (int i = 0; i < FWHT_PER_LANE; ++i) {
      const float other = pkv_shfl_xor(v[i], lane_stride);
      v[i] = upper ? other - v[i] : v[i] + other;
    }
  }
  float* dst = y + g * PKV_FWHT_N + e0;
#pragma unroll
  for (int i = 0; i < FWHT_PER_LANE; i += 4) {
    float4 t;
    t.x = v[i] * (PKV_FWHT_SCALE_256 * pkv_sign2(e0 + i));
    t.y = v[i + 1] * (PKV_FWHT_SCALE_256 * pkv_sign2(e0 + i + 1));
    t.z = v[i + 2] * (PKV_FWHT_SCALE_256 * pkv_sign2(e0 + i + 2));
    t.w = v[i + 3] * (PKV_FWHT_SCALE_256 * pkv_sign2(e0 + i + 3));
    *(float4*)(dst + i) = t;
  }
}
