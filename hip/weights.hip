// Weight kernels: dequantize HFQ4G256 / MQ4G256 / MQ4G256V2 / HFQ6G256 / Q8F16 (and the
// Lloyd codebook formats, qt 19/20/30/51, and the P2 formats: FP4, GL, MQ8, Q8HFQ,
// Q4F16G64, Q4K, TQ2/BQ1) to
// f32 or f16, fused dequant-GEMV y = W x for a batch of 1-8 activations, and the
// FWHT-256 rotation of activations (MQ formats: rotate x once, then run the plain
// affine GEMV on the stored rotated weights, docs/contracts/hfqm-and-quant.md, '3.6 FWHT
// rotation').
//
// The per-element math (field layout, code unpacking, f16 widening, affine decode,
// sign tables, butterflies) is pagedkv/quant.h's; this file only decides which
// thread reads which bytes. Raw tensors are one stream of groups (row-major, groups
// of G weights, B bytes each), at an 8-byte aligned device address.
//
// Parameters: inputs, outputs, then scalars.
#include "pagedkv_compat.h"
#include "mma_f16.h"
#include "mma_s8.h"
#include <pagedkv/quant.h>
#include <pagedkv/launch.h>
#include "gemv_prep_x.h"

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

// Bytes of one packed (16-row tile, 256-weight group) of the tensor-core GEMVs (Gemv.pack):
// 2176 (4-bit), 3200 (HFQ6), 4352 (Q8F16: 8 blocks of 34 bytes per row).
template <int F>
struct MmaTile {
  static constexpr int BYTES = PKV_GEMV_MMA_ROWS * Format<F>::B * (256 / Format<F>::G);
};

// Raw bytes travel in 32-bit words (registers); quant.h's byte-wise readers run on
// small byte copies of them made with constant indices, which the compiler turns
// into shifts. load_words reads N little-endian bytes at p (N % 4 == 0) with the
// widest loads the alignment allows.
template <int NW, int ALIGN>
PKV_DEV void load_words(const uint8_t* p, uint32_t (&out)[NW]) {
  if (ALIGN % 8 == 0 && NW % 2 == 0) {
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) {
      const uint2 v = ((const uint2*)p)[i];
      out[2 * i] = v.x;
      out[2 * i + 1] = v.y;
    }
  } else if (ALIGN % 4 == 0) {
#pragma unroll
    for (int i = 0; i < NW; ++i) out[i] = ((const uint32_t*)p)[i];
  } else {
#pragma unroll
    for (int i = 0; i < NW; ++i)
      out[i] = ((const uint16_t*)p)[2 * i] | ((uint32_t)((const uint16_t*)p)[2 * i + 1] << 16);
  }
}

template <int N, int NW>
PKV_DEV void bytes_of(const uint32_t (&w)[NW], int first, uint8_t (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = (uint8_t)(w[(first + i) / 4] >> (8 * ((first + i) % 4)));
}

// (scale, offset) for weights starting at index e0 of a group, from its header bytes.
template <int F>
PKV_DEV void group_affine(const uint8_t (&hdr)[8], int e0, float& scale, float& offset) {
  if (F == Q8F16) {
    scale = pkv_f16_to_f32(pkv_load_u16le(hdr));
    offset = 0.0f;
  } else if (F == MQ4G256V2) {
    // The half comes from the weight index (never the lane); both halves are read with
    // constant indices so the header stays in registers.
    const bool upper = e0 >= 128;
    scale = upper ? pkv_mqv2_scale(hdr, 1u) : pkv_mqv2_scale(hdr, 0u);
    offset = upper ? pkv_mqv2_zero(hdr, 1u) : pkv_mqv2_zero(hdr, 0u);
  } else {
    scale = pkv_hfq_scale(hdr);
    offset = pkv_hfq_min(hdr);
  }
}

// The raw bytes a thread needs for SPAN consecutive weights of one group (SPAN a
// multiple of 16; a span never crosses a group or a V2 half).
template <int F, int SPAN>
struct Span {
  static constexpr int NB = Format<F>::BITS * SPAN / 8;  // code bytes
  static constexpr int NW = NB / 4;
  // Codes start at HEADER + NB*k in a group; groups are 8-byte multiples except Q8F16's.
  static constexpr int ALIGN = F == Q8F16 ? 2 : (NB % 8 == 0 ? 8 : 4);
  uint32_t hdr[2];
  uint32_t codes[NW];

  __device__ __forceinline__ void load(const uint8_t* grp, int e0) {
    if (F == Q8F16) {
      hdr[0] = *(const uint16_t*)grp;
      hdr[1] = 0;
    } else {
      const uint2 h = *(const uint2*)grp;
      hdr[0] = h.x;
      hdr[1] = h.y;
    }
    load_words<NW, ALIGN>(grp + Format<F>::HEADER + e0 * Format<F>::BITS / 8, codes);
  }

  __device__ __forceinline__ void affine(int e0, float& scale, float& offset) const {
    if (F == MQ4G256V2) {
      // The half's (s, z) pair is the little-endian word at 4 * half (quant.h's
      // pkv_mqv2_scale/zero). Its two f16 fields are widened with the hardware
      // conversion: exact, the same values as pkv_f16_to_f32, a fraction of the
      // instructions (the header is re-read for every 8 weights of a row).
      const uint32_t w = e0 >= 128 ? hdr[1] : hdr[0];
      scale = pkv_half_bits_to_float((uint16_t)(w & 0xFFFFu));
      offset = pkv_half_bits_to_float((uint16_t)(w >> 16));
    } else if (F == Q8F16) {
      scale = pkv_half_bits_to_float((uint16_t)hdr[0]);  // exact, as pkv_f16_to_f32
      offset = 0.0f;
    } else {
      uint8_t h[8];
      bytes_of<8>(hdr, 0, h);
      group_affine<F>(h, e0, scale, offset);
    }
  }

  // Codes of weights [8c, 8c + 8) of the span, as exact floats (signed for Q8F16).
  __device__ __forceinline__ void codes8(int c, float (&q)[8]) const {
    uint8_t b[Format<F>::BITS], u[8];
    bytes_of<Format<F>::BITS>(codes, c * Format<F>::BITS, b);
    pkv_unpack_codes(b, 8, Format<F>::BITS, u);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      q[i] = F == Q8F16 ? pkv_signed_byte_to_float(u[i]) : pkv_code_to_float(u[i]);
  }
};

// ---------------------------------------------------------------------------
// Dequantize: PKV_DEQUANT_SPAN (16) weights per thread over the flat weight stream (groups
// may straddle rows); a short last group writes only its real weights.

// A thread decodes 16 consecutive weights; the block stages its outputs in shared memory
// and writes them back as consecutive 16-byte vectors (stores of one warp instruction
// then cover contiguous memory; threads storing their own 32-64 bytes directly ran at
// 40-58% of copy bandwidth instead of 82-93%).
PKV_DEV void stage_out(float* stage, int k, float v) { stage[k] = v; }
PKV_DEV void stage_out(uint16_t* stage, int k, float v) { stage[k] = pkv_float_to_half_bits(v); }

template <int F, typename Out>
PKV_DEV void dequantize(const uint8_t* __restrict__ raw, Out* __restrict__ out, int64_t n) {
  using Fm = Format<F>;
  constexpr int SPAN = PKV_DEQUANT_SPAN;
  constexpr int BLOCK_OUT = PKV_DEQUANT_THREADS * SPAN;
  const int64_t base = (int64_t)blockIdx.x * BLOCK_OUT;
  const int64_t i = base + (int64_t)threadIdx.x * SPAN;
  __shared__ __align__(16) Out stage[BLOCK_OUT];
  if (i < n) {
    const int64_t g = i / Fm::G;
    const int e0 = (int)(i - g * Fm::G);
    Span<F, SPAN> sp;
    sp.load(raw + g * Fm::B, e0);
    float scale, offset;
    sp.affine(e0, scale, offset);
#pragma unroll
    for (int c = 0; c < SPAN / 8; ++c) {
      float q[8];
      sp.codes8(c, q);
#pragma unroll
      for (int k = 0; k < 8; ++k)  // q*s + m, quant.h's decode
        stage_out(stage, threadIdx.x * SPAN + 8 * c + k, q[k] * scale + offset);
    }
  }
  __syncthreads();
  constexpr int PER_VEC = 16 / sizeof(Out);
  if (base + BLOCK_OUT <= n) {
    const uint4* src = (const uint4*)stage;
    uint4* dst = (uint4*)(out + base);
    for (int v = threadIdx.x; v < BLOCK_OUT / PER_VEC; v += PKV_DEQUANT_THREADS) dst[v] = src[v];
  } else {
    for (int64_t k = threadIdx.x; base + k < n; k += PKV_DEQUANT_THREADS) out[base + k] = stage[k];
  }
}

#define PKV_DEQUANT_KERNELS(NAME, F)                                                         \
  PKV_KERNEL void pkv_dequant_##NAME##_f32(const uint8_t* raw, float* out, int64_t n) {     \
    dequantize<F, float>(raw, out, n);                                                      \
  }                                                                                         \
  PKV_KERNEL void pkv_dequant_##NAME##_f16(const uint8_t* raw, uint16_t* out, int64_t n) {  \
    dequantize<F, uint16_t>(raw, out, n);                                                   \
  }

// Lloyd codebook formats (qt 19, 20, 30; 51 unrotated): w = cb[idx] in the stored basis,
// quant.h's pkv_lloyd_decode_group per 16-weight span (a span never leaves its group:
// 256 % PKV_DEQUANT_SPAN == 0). Same launch geometry as dequantize() above.
template <int BITS, typename Out>
PKV_DEV void dequantize_lloyd(const uint8_t* __restrict__ raw, Out* __restrict__ out, int64_t n) {
  constexpr int SPAN = PKV_DEQUANT_SPAN;
  static_assert(256 % SPAN == 0 && (SPAN * BITS) % 8 == 0, "a span is whole bytes of one group");
  const int64_t i = ((int64_t)blockIdx.x * PKV_DEQUANT_THREADS + threadIdx.x) * SPAN;
  if (i >= n) return;
  const int64_t g = i / 256;
  const int e0 = (int)(i - g * 256);
  const uint8_t* blk = raw + g * PKV_LLOYD_GROUP_BYTES(BITS);
  uint8_t q[SPAN];
  pkv_unpack_codes(blk + 2 * (1 << BITS) + e0 * BITS / 8, SPAN, BITS, q);
#pragma unroll
  for (int k = 0; k < SPAN; ++k)
    if (i + k < n) stage_out(out + i, k, pkv_f16_to_f32(pkv_load_u16le(blk + 2 * q[k])));
}

#define PKV_DEQUANT_LLOYD_KERNELS(BITS)                                                      \
  PKV_KERNEL void pkv_dequant_lloyd##BITS##_f32(const uint8_t* raw, float* out, int64_t n) { \
    dequantize_lloyd<BITS, float>(raw, out, n);                                             \
  }                                                                                         \
  PKV_KERNEL void pkv_dequant_lloyd##BITS##_f16(const uint8_t* raw, uint16_t* out,          \
                                                int64_t n) {                                \
    dequantize_lloyd<BITS, uint16_t>(raw, out, n);                                          \
  }

PKV_DEQUANT_LLOYD_KERNELS(2)
PKV_DEQUANT_LLOYD_KERNELS(3)
PKV_DEQUANT_LLOYD_KERNELS(4)

// P2 formats (docs/formats/quant.md, "P2 formats"): one quant.h *_decode_elem call per
// weight, SPAN consecutive weights per thread, stored basis, exact (the decoders round
// every product and sum on its own: pkv_mul_rn / pkv_add_rn). Row formats (FP4, Q8HFQ)
// take the row length K; GL finds its scales after all n/256 groups' indices. A simple
// gather, not tuned: these formats are for reading files, the hot formats above have
// the staged kernels.
enum P2Format { P2_HFP4 = 0, P2_MFP4P, P2_GL2, P2_GL3, P2_MQ8, P2_Q8HFQ, P2_Q4F16G64, P2_Q4K,
                P2_TQ2, P2_BQ1 };

template <int F>
PKV_DEV float p2_decode(const uint8_t* __restrict__ raw, int64_t i, int64_t n, int64_t K) {
  if (F == P2_HFP4 || F == P2_MFP4P) {
    const int64_t row = i / K;
    return pkv_fp4_decode_elem(raw + row * (int64_t)PKV_FP4_ROW_BYTES((uint64_t)K),
                               (uint32_t)(i - row * K), F == P2_MFP4P);
  } else if (F == P2_GL2 || F == P2_GL3) {
    return pkv_gl_decode_elem(raw, F == P2_GL2 ? 2u : 3u, (uint64_t)(n / 256), (uint64_t)(i / 256),
                              (uint32_t)(i % 256));
  } else if (F == P2_MQ8) {
    return pkv_mq8_decode_elem(raw + (i / 256) * PKV_MQ8_GROUP_BYTES, (uint32_t)(i % 256));
  } else if (F == P2_Q8HFQ) {
    const int64_t row = i / K;
    return pkv_q8hfq_decode_elem(raw + row * (int64_t)PKV_Q8HFQ_ROW_BYTES((uint64_t)K),
                                 (uint32_t)K, (uint32_t)(i - row * K));
  } else if (F == P2_Q4F16G64) {
    return pkv_q4f16g64_decode_elem(raw + (i / 64) * PKV_Q4F16G64_GROUP_BYTES, (uint32_t)(i % 64));
  } else if (F == P2_Q4K) {
    return pkv_q4k_decode_elem(raw + (i / 256) * PKV_Q4K_GROUP_BYTES, (uint32_t)(i % 256));
  } else if (F == P2_TQ2) {
    return pkv_tq2_decode_elem(raw + (i / 128) * PKV_TQ2_GROUP_BYTES, (uint32_t)(i % 128));
  } else {
    return pkv_bq1_decode_elem(raw + (i / 128) * PKV_BQ1_GROUP_BYTES, (uint32_t)(i % 128));
  }
}

template <int F, typename Out>
PKV_DEV void dequantize_p2(const uint8_t* __restrict__ raw, Out* __restrict__ out, int64_t n,
                           int64_t K) {
  constexpr int SPAN = PKV_DEQUANT_SPAN;
  const int64_t i = ((int64_t)blockIdx.x * PKV_DEQUANT_THREADS + threadIdx.x) * SPAN;
  for (int k = 0; k < SPAN; ++k)
    if (i + k < n) stage_out(out + i, k, p2_decode<F>(raw, i + k, n, K));
}

#define PKV_DEQUANT_P2_KERNELS(NAME, F)                                                       \
  PKV_KERNEL void pkv_dequant_##NAME##_f32(const uint8_t* raw, float* out, int64_t n,          \
                                           int64_t K) {                                       \
    dequantize_p2<F, float>(raw, out, n, K);                                                  \
  }                                                                                           \
  PKV_KERNEL void pkv_dequant_##NAME##_f16(const uint8_t* raw, uint16_t* out, int64_t n,       \
                                           int64_t K) {                                       \
    dequantize_p2<F, uint16_t>(raw, out, n, K);                                               \
  }

PKV_DEQUANT_P2_KERNELS(hfp4, P2_HFP4)
PKV_DEQUANT_P2_KERNELS(mfp4p, P2_MFP4P)
PKV_DEQUANT_P2_KERNELS(gl2, P2_GL2)
PKV_DEQUANT_P2_KERNELS(gl3, P2_GL3)
PKV_DEQUANT_P2_KERNELS(mq8, P2_MQ8)
PKV_DEQUANT_P2_KERNELS(q8hfq, P2_Q8HFQ)
PKV_DEQUANT_P2_KERNELS(q4f16g64, P2_Q4F16G64)
PKV_DEQUANT_P2_KERNELS(q4k, P2_Q4K)
PKV_DEQUANT_P2_KERNELS(tq2, P2_TQ2)
PKV_DEQUANT_P2_KERNELS(bq1, P2_BQ1)

PKV_DEQUANT_KERNELS(hfq4g256, HFQ4G256)
PKV_DEQUANT_KERNELS(mq4g256v2, MQ4G256V2)
PKV_DEQUANT_KERNELS(hfq6g256, HFQ6G256)
PKV_DEQUANT_KERNELS(q8f16, Q8F16)

// ---------------------------------------------------------------------------
// Fused dequant-GEMV: y[b, m] = sum_k W[m, k] x[b, k] for b < batch <= BMAX, with
// K % G == 0 (every row starts a group). A thread block owns GEMV_ROWS rows and its
// threads split K into spans (8 or 16 weights, see SPAN), consecutive threads taking
// consecutive spans: a warp's loads of codes and of x are then contiguous (x is what
// limits a GEMV at batch 1: every weight needs its activation from cache), one x span
// serves all the block's rows, and a 4096-long row spreads over the block's 128
// threads. Within a span the affine map is one (scale, offset): its dot product is
// scale * sum(q x) + offset * sum(x), sum(x) shared by the rows. The next span's
// bytes are loaded before the current one is computed; partial sums meet through the
// warps' shuffles and shared memory.

// Threads and rows per block (PKV_GEMV_ROWS_B2 at batch 1-2, PKV_GEMV_ROWS_B8 at 3-8):
// pagedkv/launch.h.
#define GEMV_ROWS_FOR(BMAX) ((BMAX) <= 2 ? PKV_GEMV_ROWS_B2 : PKV_GEMV_ROWS_B8)

template <int F, int BMAX>
PKV_DEV void gemv(const uint8_t* __restrict__ w_raw, const float* __restrict__ x,
                  float* __restrict__ y, int M, int K, int batch) {
  using Fm = Format<F>;
  constexpr int GEMV_ROWS = GEMV_ROWS_FOR(BMAX);
  const int lane = threadIdx.x % PKV_WARP_SIZE, warp = threadIdx.x / PKV_WARP_SIZE;
  const int row0 = blockIdx.x * GEMV_ROWS;
  const int64_t row_bytes = (int64_t)(K / Fm::G) * Fm::B;
  const uint8_t* rows[GEMV_ROWS];
#pragma unroll
  for (int r = 0; r < GEMV_ROWS; ++r)  // missing last rows re-read a real one, unstored
    rows[r] = w_raw + (int64_t)min(row0 + r, M - 1) * row_bytes;
  // 4-bit: 16 weights (8 code bytes) per span at batch 1-2, more bytes in flight per
  // load; 8 at batch 4-8, where the x registers are the limit (both measured). 6-bit: 16
  // (whole 32-bit words of codes). Q8F16: 8.
  constexpr int SPAN = Fm::BITS == 8 ? 8 : (Fm::BITS == 4 && BMAX > 2 ? 8 : 16);
  const int slices = K / SPAN;

  float acc[GEMV_ROWS][BMAX];
#pragma unroll
  for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
    for (int b = 0; b < BMAX; ++b) acc[r][b] = 0.0f;

  using SliceSpan = Span<F, SPAN>;
  SliceSpan cur[GEMV_ROWS], nxt[GEMV_ROWS];
  auto load = [&](SliceSpan (&sp)[GEMV_ROWS], int k0) {
    const int g = k0 / Fm::G;
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) sp[r].load(rows[r] + (int64_t)g * Fm::B, k0 - g * Fm::G);
  };
  // x of a span (batches past `batch` read as zeros), prefetched like the weights.
  float4 xcur[BMAX][SPAN / 4], xnxt[BMAX][SPAN / 4];
  auto load_x = [&](float4 (&xs)[BMAX][SPAN / 4], int k0) {
#pragma unroll
    for (int b = 0; b < BMAX; ++b)
#pragma unroll
      for (int v = 0; v < SPAN / 4; ++v)
        xs[b][v] = b < batch ? ((const float4*)(x + (int64_t)b * K + k0))[v]
                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  };
  // Prefetching x too needs BMAX * SPAN more registers: only where they fit.
  constexpr bool PREFETCH_X = BMAX * SPAN <= 32;
  int s = threadIdx.x;
  if (s < slices) {
    load(cur, s * SPAN);
    if (PREFETCH_X) load_x(xcur, s * SPAN);
  }
  for (; s < slices; s += PKV_GEMV_THREADS) {
    const int k0 = s * SPAN;
    if (s + PKV_GEMV_THREADS < slices) {
      load(nxt, k0 + PKV_GEMV_THREADS * SPAN);
      if (PREFETCH_X) load_x(xnxt, k0 + PKV_GEMV_THREADS * SPAN);
    }
    if (!PREFETCH_X) load_x(xcur, k0);
    float qx[GEMV_ROWS][BMAX], sx[BMAX];
#pragma unroll
    for (int b = 0; b < BMAX; ++b) {
      sx[b] = 0.0f;
#pragma unroll
      for (int r = 0; r < GEMV_ROWS; ++r) qx[r][b] = 0.0f;
    }
#pragma unroll
    for (int c = 0; c < SPAN / 8; ++c) {
      float xv[BMAX][8];
#pragma unroll
      for (int b = 0; b < BMAX; ++b) {
        const float4 lo = xcur[b][2 * c], hi = xcur[b][2 * c + 1];
        xv[b][0] = lo.x; xv[b][1] = lo.y; xv[b][2] = lo.z; xv[b][3] = lo.w;
        xv[b][4] = hi.x; xv[b][5] = hi.y; xv[b][6] = hi.z; xv[b][7] = hi.w;
#pragma unroll
        for (int i = 0; i < 8; ++i) sx[b] += xv[b][i];
      }
#pragma unroll
      for (int r = 0; r < GEMV_ROWS; ++r) {
        float q[8];
        if (Fm::BITS == 4) {
          // 4-bit: f = 1 + q/16 exactly, by moving code i (bits [4i, 4i+4) of the chunk's
          // little-endian word: quant.h's LSB-first order) under the exponent of 1.0f:
          // two integer ops, no conversion. sum(q x) = 16 (sum(f x) - sum(x)) below.
          const uint32_t word = cur[r].codes[c];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const uint32_t at19 = i <= 4 ? word << (19 - 4 * i) : word >> (4 * i - 19);
            q[i] = __uint_as_float(0x3F800000u | (at19 & 0x00780000u));
          }
        } else {
          cur[r].codes8(c, q);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int b = 0; b < BMAX; ++b) qx[r][b] += q[i] * xv[b][i];
      }
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
      float scale, offset;
      cur[r].affine(k0 % Fm::G, scale, offset);
#pragma unroll
      for (int b = 0; b < BMAX; ++b) {
        const float sum_qx = Fm::BITS == 4 ? 16.0f * (qx[r][b] - sx[b]) : qx[r][b];
        acc[r][b] += scale * sum_qx + offset * sx[b];
      }
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) cur[r] = nxt[r];
    if (PREFETCH_X) {
#pragma unroll
      for (int b = 0; b < BMAX; ++b)
#pragma unroll
        for (int v = 0; v < SPAN / 4; ++v) xcur[b][v] = xnxt[b][v];
    }
  }
  __shared__ float partial[PKV_GEMV_THREADS / PKV_WARP_SIZE][GEMV_ROWS * BMAX];
#pragma unroll
  for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
    for (int b = 0; b < BMAX; ++b) {
      float v = acc[r][b];
      for (int o = PKV_WARP_SIZE / 2; o > 0; o >>= 1) v += pkv_shfl_xor(v, o);
      if (lane == 0) partial[warp][r * BMAX + b] = v;
    }
  __syncthreads();
  if (threadIdx.x < GEMV_ROWS * BMAX) {
    const int r = threadIdx.x / BMAX, b = threadIdx.x % BMAX;
    float v = 0.0f;
    for (int w = 0; w < PKV_GEMV_THREADS / PKV_WARP_SIZE; ++w) v += partial[w][threadIdx.x];
    if (b < batch && row0 + r < M) y[(int64_t)b * M + row0 + r] = v;
  }
}

#define PKV_GEMV_KERNEL(NAME, F, BMAX)                                                      \
  PKV_KERNEL void __launch_bounds__(PKV_GEMV_THREADS)                                      \
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

// fwht256_lanes: hip/gemv_prep_x.h (shared with the decode-step kernels).

// The whole warp's rotation (pkv_fwht256_f32).
PKV_DEV void fwht256_warp(float (&v)[FWHT_PER_LANE], int lane) { fwht256_lanes<PKV_WARP_SIZE>(v, lane); }

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
    v[i] = t.x; v[i + 1] = t.y; v[i + 2] = t.z; v[i + 3] = t.w;
  }
  fwht256_warp(v, lane);
  float* dst = y + g * PKV_FWHT_N + e0;
#pragma unroll
  for (int i = 0; i < FWHT_PER_LANE; i += 4)
    *(float4*)(dst + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
}

// ---------------------------------------------------------------------------
// Tensor-core GEMV for the 4-bit formats (NVIDIA sm_80+; AMD runs the GEMV above).
//
// At batch 1 a 4-bit GEMV reads 4.6 weights per byte, and the H200 moves ~4.3 TB/s:
// decoding each weight to f32 and multiplying it costs ~3 instructions a weight, the
// whole issue rate of the chip. Here weights stay integers: x is quantized per
// 256-group to 22-bit integers (a power-of-two step, so |x| / step <= 2^22 and the
// rounding error is at most step / 2 = 2^-23 of the group's largest |x|), split into
// three signed bytes x = p2 * 2^16 + p1 * 2^8 + p0, and the codes meet the byte planes
// in int8 mma (m16n8k32, exact int32 sums). A weight then costs 3/8 of an integer
// instruction (two masks and a shift unpack 8 codes into two int8x4 registers).
//
// pkv_gemv_prep_x (once per x, shared by every GEMV on it; it rotates x first for the
// MQ formats) writes the byte planes already in the mma's B-fragment order, and per
// (group, batch) the step and the sums of x over each 128-half (the affine offset's
// term: w = q * s + m gives sum w x = s * sum q x + m * sum x).
//
// Weights are packed once for this kernel (Gemv.pack, at load time): per 16-row tile
// and group, the 16 group headers (128 bytes, row order), then the 2048 code bytes in
// the order the lanes load them, 16 bytes per lane and load. A block owns one tile;
// its W warps take contiguous ranges of groups and add their partial sums in shared
// memory. A warp streams each (tile, group) as one contiguous 2176-byte run, 512 bytes
// per load instruction (the row-major layout, read in place, gave 32-byte pieces of 8
// rows per load and ran 10-15% slower on the H200; docs/performance.md).
//
// Lane (gid = lane / 4, t = lane % 4) holds rows gid and gid + 8: its load i is row
// gid + 8 (i / 2), code chunks 4j + t and 4(j + 1) + t (8 bytes each) for j = 2 (i % 2).
// Word h of chunk j is mma m = 2j + h (m < 4: the first 128 weights, the V2 format's
// first half); its low nibbles are the A register paired with B's b0, its high nibbles
// with b1 (the k order inside an mma is free as long as A and B agree, and the prep
// kernel writes x in exactly this order). B column n = 3 * batch + plane; n-tiles of
// 8 columns: 1 for batch 1-2, 2 for 3-5, 3 for 6-8.

// Rows per block, most warps, most n-tiles and prepared-x words: pagedkv/launch.h.


// The prep and the header decode serve both the NVIDIA mma kernels and the AMD matrix-core
// ones (gemv_amd_mc below): one prepared-x layout, one packed weight layout, one host path.
#if defined(__CUDACC__) || defined(PKV_MFMA_I8) || defined(PKV_WMMA_I8)

// One warp per (group, batch row), 256 threads per block; the planes and sums are
// gemv_prep_x_warp's (hip/gemv_prep_x.h), which the decode-step kernels that produce x
// call too.
PKV_KERNEL void pkv_gemv_prep_x(const float* x, uint32_t* xq, float4* xs, int K, int batch,
                                int n_tiles, int rotate) {
  pkv_grid_dependency_wait();  // PDL: x is the previous kernel's output
  pkv_launch_dependents();
  const int lane = threadIdx.x % 32;
  const int64_t wid = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int groups = K / 256;
  if (wid >= (int64_t)groups * batch) return;  // whole warps leave together
  const int g = (int)(wid % groups), b = (int)(wid / groups);
  const float* src = x + (int64_t)b * K + (int64_t)g * 256 + 8 * lane;
  float v[8];
  const float4 lo = ((const float4*)src)[0], hi = ((const float4*)src)[1];
  v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
  v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
  gemv_prep_x_warp(v, lane, g, b, xq, xs, batch, n_tiles, rotate != 0);
}

// (scale, offset) of a row's group (HFQ4: f32 pair) or of one of its halves (V2: f16 pairs).
template <int F>
PKV_DEV void header_affine(uint2 hdr, int half, float& scale, float& offset) {
  if (F == MQ4G256V2) {
    const uint32_t w = half ? hdr.y : hdr.x;
    scale = pkv_half_bits_to_float((uint16_t)(w & 0xFFFFu));
    offset = pkv_half_bits_to_float((uint16_t)(w >> 16));
  } else {
    scale = __uint_as_float(hdr.x);  // pkv_hfq_scale / pkv_hfq_min: little-endian f32
    offset = __uint_as_float(hdr.y);
  }
}

// The weight of prepared-x plane p (column 3b + p) in a batch row's value: 2^(8p). Times the
// step, step * 2^(8p) * c is exact (c < 2^24).
PKV_DEV float x_plane_weight(int p) { return p == 0 ? 1.0f : p == 1 ? 256.0f : 65536.0f; }

// Two A words of 6-bit codes: the low / high nibbles of n joined with the high-bit pairs in
// bits 0-1 / 2-3 of each byte of hb (a0 / a2 from n0 and hb; a1 / a3 from n1 and hb >> 4).
PKV_DEV void hfq6_join(uint32_t n, uint32_t hb, uint32_t& lo, uint32_t& hi) {
  lo = (n & 0x0F0F0F0Fu) | (hb & 0x03030303u) << 4;
  hi = (n >> 4 & 0x0F0F0F0Fu) | (hb & 0x0C0C0C0Cu) << 2;
}

#endif  // __CUDACC__ || PKV_MFMA_I8 || PKV_WMMA_I8

#if defined(__CUDACC__)
// One lane's share of one (16-row tile, group) of packed weights: the headers of rows gid
// and gid + 8, and its four 16-byte code loads (the layout above).
struct MmaWeights {
  uint2 hdr[2];
  uint4 code[4];

  __device__ __forceinline__ void load(const uint8_t* base, int lane) {
    const int gid = lane / 4;
    hdr[0] = *(const uint2*)(base + 8 * gid);
    hdr[1] = *(const uint2*)(base + 8 * (gid + 8));
#pragma unroll
    for (int i = 0; i < 4; ++i) code[i] = ((const uint4*)(base + 128))[32 * i + lane];
  }
};

template <int F>
struct MmaHalves {  // affine maps per group
  static constexpr int value = F == MQ4G256V2 ? 2 : 1;
};

// The exact int32 sums of one group for CH n-tiles and TPW 16-row tiles: c[u][hv][i] = tile
// u's 16 rows times n-tile i's 8 columns over affine half hv (V2: one (scale, zero) per 128
// weights). w_code(u, k) gives tile u's 16-byte code load k (MmaWeights::code), x_words(i,
// j) the lane's prepared-x 16-byte word j (mmas 2j and 2j + 1) of n-tile i; each is asked
// for once, where it is first needed (a tile's loads jj and 2 + jj serve mmas 4 jj .. 4 jj
// + 3), and each x word feeds the mmas of all TPW tiles (the pipelined kernel's 2 tiles per
// warp halve its x reads per mma).
template <int F, int CH, int TPW, typename WCode, typename XWords>
PKV_DEV void mma_group_tiles(int (&c)[TPW][MmaHalves<F>::value][CH][4], WCode w_code,
                             XWords x_words) {
  constexpr int HALVES = MmaHalves<F>::value;
#pragma unroll
  for (int u = 0; u < TPW; ++u)
#pragma unroll
    for (int hv = 0; hv < HALVES; ++hv)
#pragma unroll
      for (int i = 0; i < CH; ++i) c[u][hv][i][0] = c[u][hv][i][1] = c[u][hv][i][2] = c[u][hv][i][3] = 0;
#pragma unroll
  for (int jj = 0; jj < 2; ++jj) {
    uint4 pa[TPW], pb[TPW];  // chunks 2 jj and 2 jj + 1 of rows gid (pa) and gid + 8 (pb)
#pragma unroll
    for (int u = 0; u < TPW; ++u) {
      pa[u] = w_code(u, jj);
      pb[u] = w_code(u, 2 + jj);
    }
#pragma unroll
    for (int j = 2 * jj; j < 2 * jj + 2; ++j) {
      uint4 q[CH];
#pragma unroll
      for (int i = 0; i < CH; ++i) q[i] = x_words(i, j);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // mma m = 2j + h: word h of chunk j of rows gid and gid + 8
        const int m = 2 * j + h, hv = HALVES == 2 ? m / 4 : 0;
        uint32_t a[TPW][4];
#pragma unroll
        for (int u = 0; u < TPW; ++u) {
          const uint32_t wa = j % 2 ? (h ? pa[u].w : pa[u].z) : (h ? pa[u].y : pa[u].x);
          const uint32_t wb = j % 2 ? (h ? pb[u].w : pb[u].z) : (h ? pb[u].y : pb[u].x);
          a[u][0] = wa & 0x0F0F0F0Fu;
          a[u][1] = wb & 0x0F0F0F0Fu;
          a[u][2] = (wa >> 4) & 0x0F0F0F0Fu;
          a[u][3] = (wb >> 4) & 0x0F0F0F0Fu;
        }
#pragma unroll
        for (int i = 0; i < CH; ++i) {
          const uint32_t b0 = h ? q[i].z : q[i].x, b1 = h ? q[i].w : q[i].y;
#pragma unroll
          for (int u = 0; u < TPW; ++u)
            mma_s8_16x8x32(c[u][hv][i], a[u][0], a[u][1], a[u][2], a[u][3], b0, b1);
        }
      }
    }
  }
}

// One tile's sums from its fragments in registers (gemv_mma, gemv_mma_staged).
template <int F, int CH, typename XWords>
PKV_DEV void mma_group(int (&c)[MmaHalves<F>::value][CH][4], const MmaWeights& w, XWords x_words) {
  using C1 = int[1][MmaHalves<F>::value][CH][4];
  mma_group_tiles<F, CH, 1>(reinterpret_cast<C1&>(c), [&](int, int k) { return w.code[k]; },
                            x_words);
}

// acc[r][i0 + i][e] += one group's f32 epilogue of the sums c of n-tiles i0 .. i0 + CH:
// lane (gid, t) holds rows gid + 8r, columns 8 (i0 + i) + 2t + e. x_sums(i, e) gives the
// column's batch-row (step, sum of the first 128, of the second, of all 256), zeros for
// batch rows past `batch`.
template <int F, int CH, int NT, typename XSums>
PKV_DEV void add_group(float (&acc)[2][NT][2], const int (&c)[MmaHalves<F>::value][CH][4],
                       const uint2 (&hdr)[2], int i0, int t, XSums x_sums) {
  constexpr int HALVES = MmaHalves<F>::value;
  float scale[HALVES][2], offset[HALVES][2];
#pragma unroll
  for (int hv = 0; hv < HALVES; ++hv)
#pragma unroll
    for (int r = 0; r < 2; ++r) header_affine<F>(hdr[r], hv, scale[hv][r], offset[hv][r]);
#pragma unroll
  for (int i = 0; i < CH; ++i)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int p = (8 * (i0 + i) + 2 * t + e) % 3;
      const float4 s = x_sums(i, e);
      // step * 2^(8p) * c is exact (c < 2^24); the sums of x join plane 0's column.
      const float f = s.x * x_plane_weight(p);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // Every rounding explicit: the fused-x, two-launch, staged and pipelined kernels
        // inline this epilogue into different code, and a*b + c*d left to the compiler may
        // be contracted into an FMA on either product (RMSNorm's sum of squares was,
        // differently per kernel: add_squares, hip/decode.hip). The order is the one nvcc
        // 13 chose for every kernel on sm_90, so the outputs keep their bits.
        const float fc0 = f * (float)c[0][i][2 * r + e];
        float v;
        if (HALVES == 2)
          v = fmaf(scale[0][r], fc0,
                   pkv_mul_rn(scale[HALVES - 1][r], f * (float)c[HALVES - 1][i][2 * r + e]));
        else
          v = pkv_mul_rn(scale[0][r], fc0);
        if (p == 0)
          v = HALVES == 2
                  ? pkv_add_rn(v, fmaf(offset[0][r], s.y, pkv_mul_rn(offset[HALVES - 1][r], s.z)))
                  : fmaf(offset[0][r], s.w, v);
        acc[r][i0 + i][e] = pkv_add_rn(acc[r][i0 + i][e], v);
      }
    }
}

// Q8F16 on the same int8 tensor cores (batch 1-8, opt-in; docs/kernels.md, "HFQ6 and Q8F16 on
// tensor cores"): the prepared x of the 4-bit kernels, and codes that are int8 already. The
// prep puts dims 8L .. 8L + 7 of prep lane L = 8(m/2) + 2t + m%2 in B quad t of mma m (even
// dims in b0, odd in b1), so within mma m lanes t < 2 carry dims of 32-weight block 2(m/2)
// and lanes t >= 2 of block 2(m/2) + 1: each mma runs twice, once with the other lanes'
// A zeroed per block, so every block's int32 sum stays apart for its own f16 scale (blocks
// 2p and 2p + 1 are mmas 2p and 2p + 1 together). Packed per 16-row tile and group: the 16
// rows' 8 block scales (256 bytes, row order), then per mma m and lane the 16 bytes of its A
// registers {a0, a1, a2, a3} (rows gid / gid + 8, even / odd dims of L): 4352 bytes.
struct MmaWeightsQ8 {
  uint4 d[2];     // rows gid, gid + 8: the group's 8 block scales (f16)
  uint4 code[8];  // mma m: a0, a1, a2, a3

  __device__ __forceinline__ void load(const uint8_t* base, int lane) {
    const int gid = lane / 4;
    d[0] = ((const uint4*)base)[gid];
    d[1] = ((const uint4*)base)[gid + 8];
#pragma unroll
    for (int m = 0; m < 8; ++m) code[m] = ((const uint4*)(base + 256))[32 * m + lane];
  }
};

// acc[r][i0 + i][e] += the group's sum for rows gid + 8r, columns 8 (i0 + i) + 2t + e of
// n-tiles i0 .. i0 + CH: block by block, its int32 sums times the row's block scale and the
// column's step * 2^(8 plane) (x_sums' .x, as add_group). x_words(i, j) and x_sums(i, e)
// take the chunk's n-tile i, as mma_group's and add_group's do.
template <int CH, int NT, typename XWords, typename XSums>
PKV_DEV void mma_group_q8(float (&acc)[2][NT][2], const MmaWeightsQ8& w, int i0, int t,
                          XWords x_words, XSums x_sums) {
  const bool upper = t >= 2;
  float f[CH][2];
#pragma unroll
  for (int i = 0; i < CH; ++i)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int p = (8 * (i0 + i) + 2 * t + e) % 3;
      f[i][e] = x_sums(i, e).x * x_plane_weight(p);
    }
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // x word j: mmas 2j, 2j + 1, blocks 2j, 2j + 1
    int c[2][CH][4];
#pragma unroll
    for (int bk = 0; bk < 2; ++bk)
#pragma unroll
      for (int i = 0; i < CH; ++i) c[bk][i][0] = c[bk][i][1] = c[bk][i][2] = c[bk][i][3] = 0;
    uint4 q[CH];  // asked for once (a shared-memory load in the staged kernel)
#pragma unroll
    for (int i = 0; i < CH; ++i) q[i] = x_words(i, j);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 a = w.code[2 * j + h];
#pragma unroll
      for (int bk = 0; bk < 2; ++bk) {
        const bool mine = (bk == 1) == upper;  // this lane's k slots are block 2j + bk's
        const uint32_t a0 = mine ? a.x : 0u, a1 = mine ? a.y : 0u;
        const uint32_t a2 = mine ? a.z : 0u, a3 = mine ? a.w : 0u;
#pragma unroll
        for (int i = 0; i < CH; ++i)
          mma_s8_16x8x32(c[bk][i], a0, a1, a2, a3, h ? q[i].z : q[i].x, h ? q[i].w : q[i].y);
      }
    }
#pragma unroll
    for (int bk = 0; bk < 2; ++bk) {
      const int b = 2 * j + bk;  // block b's scale: half b % 2 of word b / 2
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint4 dw = w.d[r];
        const uint32_t word = b / 2 == 0 ? dw.x : b / 2 == 1 ? dw.y : b / 2 == 2 ? dw.z : dw.w;
        const float d = pkv_half_bits_to_float((uint16_t)(b % 2 ? word >> 16 : word & 0xFFFFu));
#pragma unroll
        for (int i = 0; i < CH; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            acc[r][i0 + i][e] += d * (f[i][e] * (float)c[bk][i][2 * r + e]);
      }
    }
  }
}

// HFQ6G256 on the same tensor cores (batch 1-8, opt-in with Q8F16's switch): one affine
// map per 256-group as HFQ4 (add_group), 6-bit codes packed so a lane rebuilds its four A
// registers of mma m from three words: n0 holds the low nibbles of a0's (bits 0-3 of each
// byte) and a2's (bits 4-7) four codes, n1 those of a1 and a3, hb the high two bits of all
// sixteen (byte k: a0 bits 0-1, a2 bits 2-3, a1 bits 4-5, a3 bits 6-7). Packed per 16-row
// tile and group: the 16 headers (128 bytes, row order), then per lane 24 words (mma m:
// words 3m .. 3m + 2), word 4k + v of a lane in 16-byte load k at 128 + 16 (32k + lane):
// 3200 bytes, the stored size.
struct MmaWeights6 {
  uint2 hdr[2];
  uint4 code[6];

  __device__ __forceinline__ void load(const uint8_t* base, int lane) {
    const int gid = lane / 4;
    hdr[0] = *(const uint2*)(base + 8 * gid);
    hdr[1] = *(const uint2*)(base + 8 * (gid + 8));
#pragma unroll
    for (int k = 0; k < 6; ++k) code[k] = ((const uint4*)(base + 128))[32 * k + lane];
  }

  __device__ __forceinline__ uint32_t word(int x) const {  // x is a constant after unrolling
    const uint4 v = code[x / 4];
    return x % 4 == 0 ? v.x : x % 4 == 1 ? v.y : x % 4 == 2 ? v.z : v.w;
  }
};

// The exact int32 sums of one HFQ6 group for NT n-tiles (mma_group's, from 6-bit codes).
template <int NT, typename XWords>
PKV_DEV void mma_group6(int (&c)[1][NT][4], const MmaWeights6& w, XWords x_words) {
#pragma unroll
  for (int i = 0; i < NT; ++i) c[0][i][0] = c[0][i][1] = c[0][i][2] = c[0][i][3] = 0;
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    const uint32_t n0 = w.word(3 * m), n1 = w.word(3 * m + 1), hb = w.word(3 * m + 2);
    uint32_t a0, a1, a2, a3;
    hfq6_join(n0, hb, a0, a2);
    hfq6_join(n1, hb >> 4, a1, a3);
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const uint4 q = x_words(i, m / 2);
      mma_s8_16x8x32(c[0][i], a0, a1, a2, a3, m % 2 ? q.z : q.x, m % 2 ? q.w : q.y);
    }
  }
}

template <int F>
struct MmaWeightsOf {  // one lane's share of one (16-row tile, group) of packed weights
  using type = MmaWeights;
};
template <>
struct MmaWeightsOf<Q8F16> {
  using type = MmaWeightsQ8;
};
template <>
struct MmaWeightsOf<HFQ6G256> {
  using type = MmaWeights6;
};

// acc += one (tile, group)'s products with n-tiles i0 .. i0 + CH, any format: its int32 sums
// and f32 epilogue (gemv_mma: one chunk of all NT; gemv_mma_staged: chunks of 3). x_words(i,
// v) and x_sums(i, e) take the chunk's n-tile i.
template <int F, int CH, int NT, typename XWords, typename XSums>
PKV_DEV void mma_group_add(float (&acc)[2][NT][2], const typename MmaWeightsOf<F>::type& w,
                           int i0, int t, XWords x_words, XSums x_sums) {
  if constexpr (F == Q8F16) {
    mma_group_q8<CH, NT>(acc, w, i0, t, x_words, x_sums);
  } else if constexpr (F == HFQ6G256) {
    int c[1][CH][4];
    mma_group6<CH>(c, w, x_words);
    add_group<F, CH, NT>(acc, c, w.hdr, i0, t, x_sums);
  } else {
    int c[MmaHalves<F>::value][CH][4];
    mma_group<F, CH>(c, w, x_words);
    add_group<F, CH, NT>(acc, c, w.hdr, i0, t, x_sums);
  }
}

// The fused-x GEMV's source (pkv_gemv_mma_x_*, batch 1-2: one n-tile): the warp prepares
// each of its groups' x itself, from the float32 x, with pkv_gemv_prep_x's own functions,
// through a stage of one group in shared memory (the 2 KiB pkv_gemv_prep_x would write at
// xq[g]), so the mmas get the same words and y is bit for bit the two-launch GEMV's. Every
// block prepares the x of its warps' groups again (1 KiB of x from L2 per group and row,
// ~100 instructions, ~200 with the rotation): that replaces a launch and the prepared x's
// round trip through memory, which is what pays at batch 1-2 (docs/kernels.md, "Fused x").
struct FusedXSource {
  static constexpr int ROWS = 2;  // batch rows one n-tile holds (3 byte planes each)
  const float* __restrict__ x;
  uint32_t* stage;  // this warp's PKV_GEMV_X_WORDS x 32 words
  int K, batch, lane;
  bool rotate;
  float v[ROWS][8];  // the next group's x, loaded ahead of its mmas

  __device__ __forceinline__ void load(int g) {
#pragma unroll
    for (int b = 0; b < ROWS; ++b) {
      if (b >= batch) break;
      const float4* src = (const float4*)(x + (int64_t)b * K + (int64_t)g * 256 + 8 * lane);
      const float4 lo = __ldg(src), hi = __ldg(src + 1);
      v[b][0] = lo.x; v[b][1] = lo.y; v[b][2] = lo.z; v[b][3] = lo.w;
      v[b][4] = hi.x; v[b][5] = hi.y; v[b][6] = hi.z; v[b][7] = hi.w;
    }
  }
  template <int NT>
  __device__ __forceinline__ void get(uint4 (&xb)[NT][4], float4 (&xsv)[NT][2]) {
    static_assert(NT == 1, "the fused-x kernels take one n-tile (batch 1-2)");
    float4 sums[ROWS];
    __syncwarp();  // every lane has read the previous group's stage
#pragma unroll
    for (int b = 0; b < ROWS; ++b) {
      sums[b] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (b >= batch) continue;
      float inv_step;
      const float step = gemv_x_step(v[b], lane, rotate, GEMV_X_RANGE, inv_step);
      float sum = 0.0f;  // pkv_add_rn: as gemv_prep_x_warp's sum (gemv_prep_x.h)
#pragma unroll
      for (int i = 0; i < 8; ++i) sum = pkv_add_rn(sum, v[b][i]);
      float half, other;  // lanes 16-31: the second half's sum, then the first's
      gemv_x_half_sums(sum, half, other);
      gemv_x_store_planes22(v[b], inv_step, lane, stage, 0, 1, b);
      sums[b] = lane < 16 ? make_float4(step, half, other, half + other)
                          : make_float4(step, other, half, other + half);
    }
    __syncwarp();
    const int gid = lane / 4, t = lane % 4;
    const uint4* src = (const uint4*)(stage + lane * PKV_GEMV_X_WORDS);
#pragma unroll
    for (int w = 0; w < 4; ++w) xb[0][w] = gid < 3 * batch ? src[w] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // columns 2t + e: batch row (2t + e) / 3 of 0, 1, 2
      const int b = (2 * t + e) / 3;
      xsv[0][e] = b == 0 ? sums[0] : b == 1 ? sums[1] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
};

// FUSED: x from the warp's FusedXSource `fused` (xq / xs unused), else the prepared x in
// xq / xs (written by pkv_gemv_prep_x or a decode-step kernel; `fused` unused).
// RT: 16-row tiles per block, 1 or 2 (the fused-x kernels: PKV_GEMV_X_ROW_TILES), each
// warp running every tile of the block on the x it prepared once for them. Where M leaves
// the last block one tile, its second reads the first again (tile_step 0) and its rows
// are never written.
template <int F, int NT, bool FUSED = false, int RT = 1>
PKV_DEV void gemv_mma(const uint8_t* __restrict__ packed, const uint32_t* __restrict__ xq,
                      const float4* __restrict__ xs, float* __restrict__ y, int M, int K,
                      int batch, FusedXSource* fused = nullptr) {
  constexpr int TILE_BYTES = MmaTile<F>::BYTES;
  constexpr int ROWS = PKV_GEMV_MMA_ROWS * RT;  // the block's rows
  static_assert(RT == 1 || RT == 2, "tile_step covers blocks of one or two tiles");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const int gid = lane / 4, t = lane % 4;
  const int row0 = blockIdx.x * ROWS;
  const int groups = K / 256;
  const int g_begin = warp * groups / n_warps, g_end = (warp + 1) * groups / n_warps;
  const uint8_t* tile = packed + (int64_t)(blockIdx.x * RT) * groups * TILE_BYTES;
  // bytes from one of the block's tiles to the next (0 where the block has one tile)
  const int64_t tile_step = row0 + PKV_GEMV_MMA_ROWS < M ? (int64_t)groups * TILE_BYTES : 0;

  float acc[RT][2][NT][2];
#pragma unroll
  for (int u = 0; u < RT; ++u)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int i = 0; i < NT; ++i) acc[u][r][i][0] = acc[u][r][i][1] = 0.0f;

  typename MmaWeightsOf<F>::type cur[RT], nxt[RT];
  // weights only: issued before the PDL wait (no kernel before this one writes them)
  if (g_begin < g_end) {
#pragma unroll
    for (int u = 0; u < RT; ++u) cur[u].load(tile + u * tile_step + (int64_t)g_begin * TILE_BYTES, lane);
  }
  pkv_grid_dependency_wait();  // PDL: x (prepared or not) and y's readers are done from here
  pkv_launch_dependents();
  if constexpr (FUSED) {
    if (g_begin < g_end) fused->load(g_begin);
  }
  for (int g = g_begin; g < g_end; ++g) {
    if (g + 1 < g_end) {
#pragma unroll
      for (int u = 0; u < RT; ++u) nxt[u].load(tile + u * tile_step + (int64_t)(g + 1) * TILE_BYTES, lane);
    }
    uint4 xb[NT][4];
    float4 xsv[NT][2];
    if constexpr (FUSED) {
      fused->get(xb, xsv);
      if (g + 1 < g_end) fused->load(g + 1);
    } else {
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const uint4* xsrc =
            (const uint4*)(xq + (((int64_t)g * NT + i) * 32 + lane) * PKV_GEMV_X_WORDS);
        const bool live = 8 * i + gid < 3 * batch;
#pragma unroll
        for (int v = 0; v < 4; ++v) xb[i][v] = live ? xsrc[v] : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int b = (8 * i + 2 * t + e) / 3;
          xsv[i][e] = b < batch ? xs[(int64_t)g * batch + b] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
#pragma unroll
    for (int u = 0; u < RT; ++u) {
      mma_group_add<F, NT, NT>(acc[u], cur[u], 0, t, [&](int i, int v) { return xb[i][v]; },
                               [&](int i, int e) { return xsv[i][e]; });
      cur[u] = nxt[u];
    }
  }
  __shared__ float red[PKV_GEMV_MMA_MAX_WARPS][ROWS][8 * PKV_GEMV_MMA_MAX_TILES];
#pragma unroll
  for (int u = 0; u < RT; ++u)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          red[warp][PKV_GEMV_MMA_ROWS * u + gid + 8 * r][8 * i + 2 * t + e] = acc[u][r][i][e];
  __syncthreads();
  for (int k = threadIdx.x; k < ROWS * batch; k += blockDim.x) {
    const int r = k % ROWS, b = k / ROWS;
    float v = 0.0f;
    for (int w = 0; w < n_warps; ++w) v += red[w][r][3 * b] + red[w][r][3 * b + 1] + red[w][r][3 * b + 2];
    if (row0 + r < M) y[(int64_t)b * M + row0 + r] = v;
  }
}

#define PKV_GEMV_MMA_KERNEL(NAME, F, NT)                                                    \
  PKV_KERNEL void __launch_bounds__(32 * PKV_GEMV_MMA_MAX_WARPS)                            \
      pkv_gemv_mma_##NAME##_n##NT(                                                          \
      const uint8_t* w, const uint32_t* xq, const float4* xs, float* y, int M, int K,       \
      int batch) {                                                                          \
    gemv_mma<F, NT>(w, xq, xs, y, M, K, batch);                                             \
  }
// The fused-x kernel of batch 1-2 (FusedXSource): x float32 [batch, K], rotated first where
// `rotate` (the MQ formats), as pkv_gemv_prep_x would; RT 16-row tiles per block
// (PKV_GEMV_X_ROW_TILES, _WIDE for HFQ6G256 / Q8F16).
#define PKV_GEMV_MMA_X_KERNEL(NAME, F, RT)                                                  \
  PKV_KERNEL void __launch_bounds__(32 * PKV_GEMV_MMA_MAX_WARPS)                            \
      pkv_gemv_mma_x_##NAME##_n1(const uint8_t* w, const float* x, float* y, int M, int K,  \
                                 int batch, int rotate) {                                   \
    __shared__ uint4 stage[PKV_GEMV_MMA_MAX_WARPS][32 * PKV_GEMV_X_WORDS / 4];              \
    FusedXSource fused{x, (uint32_t*)stage[threadIdx.x / 32], K, batch,                     \
                       (int)(threadIdx.x % 32), rotate != 0};                               \
    gemv_mma<F, 1, true, RT>(w, nullptr, nullptr, y, M, K, batch, &fused);                  \
  }
#define PKV_GEMV_MMA_KERNELS(NAME, F, RT) \
  PKV_GEMV_MMA_KERNEL(NAME, F, 1)         \
  PKV_GEMV_MMA_KERNEL(NAME, F, 2)         \
  PKV_GEMV_MMA_KERNEL(NAME, F, 3)         \
  PKV_GEMV_MMA_X_KERNEL(NAME, F, RT)

PKV_GEMV_MMA_KERNELS(hfq4g256, HFQ4G256, PKV_GEMV_X_ROW_TILES)
PKV_GEMV_MMA_KERNELS(mq4g256v2, MQ4G256V2, PKV_GEMV_X_ROW_TILES)
PKV_GEMV_MMA_KERNELS(hfq6g256, HFQ6G256, PKV_GEMV_X_ROW_TILES_WIDE)
PKV_GEMV_MMA_KERNELS(q8f16, Q8F16, PKV_GEMV_X_ROW_TILES_WIDE)


// ---------------------------------------------------------------------------
// Staged tensor-core GEMV for batch 9-32 (the decode step at batch 32; docs/kernels.md,
// "Staged tensor-core GEMV"). gemv_mma's weight layout, prepared x and per-group math
// (mma_group, add_group), arranged so that x crosses from L2 once per block, not once per
// 16-row tile: at batch 32 a group's prepared x is 24 KiB against 2,176 bytes of a tile's
// weights, so re-reading it per tile (the earlier tiled kernel) made x, not the weights,
// the traffic.
//
// A block of W warps owns W consecutive 16-row tiles (warp w: tile W * blockIdx.x + w)
// and one contiguous split of the groups (blockIdx.y of gridDim.y; the launcher picks the
// split count that keeps the SMs busy). Per group, the block's threads copy the group's
// prepared x (NT n-tiles x 32 lanes x 64 bytes) into shared memory with cp.async, the
// next group's copy in flight while this one is computed (two buffers); each warp reads
// its n-tiles' B fragments from there, its tile's weights from global (the next group's
// loaded before this one is computed), and runs NT / 3 chunks of 3 n-tiles (24 columns
// = the 3 planes of 8 batch rows) into f32 accumulators acc[2][NT][2]. Traffic per
// group and block: W x 2,176 bytes of weights from DRAM, NT x 2 KiB of x from L2 (1.4x
// the weights at W = 8 and batch 32, against 11x before).
//
// Shared layout of the staged x: 16-byte unit v of lane L of n-tile i sits at unit
// 4 (32 i + L) + (v ^ ((L / 2) % 4)): a 128-bit shared load is served 8 lanes at a time,
// and those 8 lanes then hit 8 different 16-byte bank groups (without the swizzle, lanes
// 64 bytes apart would share 2 of them: 4-way conflicts).
//
// The end: the warps' sums meet in shared memory (the x buffers, free by then), a row's 3
// plane columns are added (gemv_mma's order), and with one split the block writes y.
// With S splits each block writes its sums to partial[S][batch][M]; the last of a row
// block's S blocks to arrive (a counter per row block, reset by that block for the next
// launch) adds the S partials in split order and writes y: the result does not depend on
// which block finishes first.
PKV_DEV int x_stage_unit(int tile, int lane, int v) {
  return 4 * (32 * tile + lane) + (v ^ ((lane >> 1) & 3));
}

// One 16-byte cp.async from global to shared (sm_80+; the launcher checks the arch).
PKV_DEV void cp_async16(void* smem_dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint64_t dst;  // the shared-window address (PTX, not __cvta_generic_to_shared: NVRTC too)
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(dst) : "l"(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)dst), "l"(src)
               : "memory");
#else
  __trap();
#endif
}

PKV_DEV void cp_async_commit() {  // close this thread's group of copies
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int PENDING>
PKV_DEV void cp_async_wait() {  // wait until at most PENDING of this thread's groups are open
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#endif
}

template <int PENDING>
PKV_DEV void cp_async_commit_wait() {  // close this thread's group; wait until PENDING remain
  cp_async_commit();
  cp_async_wait<PENDING>();
}

// Split-K arrival (the staged, pipelined and f16 kernels' ends): after the block's threads
// stored their partial sums, true in every thread of the last of the row block's `splits`
// blocks to arrive (counters[blockIdx.x]; that block resets it for the next launch). One
// fence per block, not per thread: the barrier orders every thread's partial stores before
// thread 0's gpu-scope fence, which is cumulative, and thread 0's atomic counts the block
// after it (the release pattern of CUTLASS's split-K semaphore); the last block's thread 0
// fences again after its atomic (acquire) before the barrier that lets its threads read the
// other blocks' partials (with __ldcg: L2, never a stale L1 line). A fence by each of 256
// threads and the last block's element-at-a-time loads cost 7 of the f16 kernel's 67 µs at
// 28672×4096, batch 32 (H200, 2026-12-03).
PKV_DEV bool split_arrived_last(unsigned* __restrict__ counters, int splits) {
  __syncthreads();  // every thread's partials are issued before thread 0 releases them
  bool arrived_last = false;
  if (threadIdx.x == 0) {
    __threadfence();  // release, cumulative over the barrier above
    arrived_last = atomicAdd(&counters[blockIdx.x], 1u) == splits - 1u;
    if (arrived_last) __threadfence();  // acquire: the other blocks' released partials
  }
  return __syncthreads_or(arrived_last);
}

// The end of the staged and pipelined kernels: red holds the block's f32 sums, row r (of
// `rows`, the block's tiles in order) at red + r * cols, its column 3b + p batch row b's
// plane p. A row's 3 plane columns are added from 0 (gemv_mma's order); with one split the
// block writes y, otherwise its sums go to partial[split][batch][M] and the last block to
// arrive (split_arrived_last) adds the splits in split order: the result does not depend
// on which block finishes first, nor on how many rows a block holds. The last block issues
// FINISH_LOADS loads per thread per split together (one L2 round trip for all of them, not
// one per element).
PKV_DEV void gemv_split_finish(const float* red, int cols, int rows, int M, int batch,
                               float* __restrict__ y, float* __restrict__ partial,
                               unsigned* __restrict__ counters, int split, int splits) {
  const int row0 = blockIdx.x * rows, n = rows * batch;
  for (int k = threadIdx.x; k < n; k += blockDim.x) {
    const int r = k % rows, b = k / rows;
    const float* c = red + r * cols + 3 * b;
    const float v = 0.0f + (c[0] + c[1] + c[2]);
    if (row0 + r < M) {
      if (splits == 1)
        y[(int64_t)b * M + row0 + r] = v;
      else
        partial[((int64_t)split * batch + b) * M + row0 + r] = v;
    }
  }
  if (splits == 1 || !split_arrived_last(counters, splits)) return;
  constexpr int FINISH_LOADS = 16;  // per thread per split: one round trip for all of them
  for (int k0 = threadIdx.x; k0 < n; k0 += FINISH_LOADS * (int)blockDim.x) {
    float v[FINISH_LOADS];
#pragma unroll
    for (int j = 0; j < FINISH_LOADS; ++j) v[j] = 0.0f;
    for (int s = 0; s < splits; ++s) {  // split order: independent of the arrival order
      float p[FINISH_LOADS];
#pragma unroll
      for (int j = 0; j < FINISH_LOADS; ++j) {
        const int k = k0 + j * (int)blockDim.x, r = k % rows, b = k / rows;
        p[j] = k < n && row0 + r < M
                   ? __ldcg(&partial[((int64_t)s * batch + b) * M + row0 + r])
                   : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < FINISH_LOADS; ++j) v[j] += p[j];
    }
#pragma unroll
    for (int j = 0; j < FINISH_LOADS; ++j) {
      const int k = k0 + j * (int)blockDim.x, r = k % rows, b = k / rows;
      if (k < n && row0 + r < M) y[(int64_t)b * M + row0 + r] = v[j];
    }
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0u;  // ready for the next launch
}

template <int F, int NT>
PKV_DEV void gemv_mma_staged(const uint8_t* __restrict__ packed, const uint32_t* __restrict__ xq,
                             const float4* __restrict__ xs, float* __restrict__ y,
                             float* __restrict__ partial, unsigned* __restrict__ counters, int M,
                             int K, int batch) {
  constexpr int CH = PKV_GEMV_MMA_MAX_TILES;
  static_assert(NT % CH == 0 && (8 * CH) % 3 == 0, "chunks hold whole batch rows");
  static_assert(PKV_GEMV_X_WORDS == 16, "a lane's x of one n-tile is four 16-byte units");
  constexpr int UNITS = NT * 32 * 4;  // 16-byte units of one group's prepared x
  constexpr int TILE_BYTES = MmaTile<F>::BYTES;
  // 2 x NT x 2 KiB: 48 KiB at NT = 12, the static limit. The end's reduction reuses it:
  // W x 16 rows x 8 NT f32 fits for W <= 8 (PKV_GEMV_MMA_MAX_WARPS).
  __shared__ __align__(16) uint4 stage[2][UNITS];
  static_assert(PKV_GEMV_MMA_MAX_WARPS * PKV_GEMV_MMA_ROWS * 8 * NT * 4 <= sizeof(stage),
                "the reduction fits in the x buffers");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const int gid = lane / 4, t = lane % 4;
  const int row_tiles = (M + PKV_GEMV_MMA_ROWS - 1) / PKV_GEMV_MMA_ROWS;
  const int tile = blockIdx.x * n_warps + warp;
  const bool active = tile < row_tiles;  // warps past the last tile only copy x
  const int groups = K / 256, splits = gridDim.y, split = blockIdx.y;
  const int g_begin = split * groups / splits, g_end = (split + 1) * groups / splits;
  const uint8_t* wtile = packed + (int64_t)min(tile, row_tiles - 1) * groups * TILE_BYTES;

  auto stage_x = [&](int buf, int g) {
    const uint4* src = (const uint4*)xq + (int64_t)g * UNITS;  // (n-tile, lane, v) order
    for (int u = threadIdx.x; u < UNITS; u += blockDim.x)
      cp_async16(&stage[buf][x_stage_unit(u / 128, (u / 4) % 32, u % 4)], src + u);
  };

  float acc[2][NT][2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int i = 0; i < NT; ++i) acc[r][i][0] = acc[r][i][1] = 0.0f;

  // The next group's weights are loaded before this one is computed where the registers
  // allow it (NT = 6); at NT = 12 the accumulators take them (prefetching spilled 36-80
  // bytes on sm_90) and the load waits with the next group's x copy in flight. Q8F16's 40
  // registers of weights a group never prefetch (at NT = 6 that spilled 36 bytes, without
  // it 4; its NT = 12 spills 32 bytes either way, as MQ4G256V2's NT = 12 spills 20-44).
  constexpr bool PREFETCH = NT <= PKV_GEMV_MMA_PREFETCH_TILES && F != Q8F16;
  typename MmaWeightsOf<F>::type cur, nxt;
  if (g_begin < g_end) stage_x(0, g_begin);
  cp_async_commit();  // group 0's x is its own group: the first wait<1> below waits for it
  if (active && g_begin < g_end) cur.load(wtile + (int64_t)g_begin * TILE_BYTES, lane);
  for (int g = g_begin; g < g_end; ++g) {
    const int buf = (g - g_begin) & 1;
    if (g + 1 < g_end) {
      stage_x(buf ^ 1, g + 1);
      if (PREFETCH && active) nxt.load(wtile + (int64_t)(g + 1) * TILE_BYTES, lane);
    }
    cp_async_commit_wait<1>();  // this group's x has landed (the next one's may be in flight)
    __syncthreads();            // ... for every thread's copies
    if (active) {
#pragma unroll
      for (int i0 = 0; i0 < NT; i0 += CH)
        mma_group_add<F, CH, NT>(
            acc, cur, i0, t,
            [&](int i, int v) {
              const bool live = 8 * (i0 + i) + gid < 3 * batch;  // past the batch: not written
              return live ? stage[buf][x_stage_unit(i0 + i, lane, v)]
                          : make_uint4(0u, 0u, 0u, 0u);
            },
            [&](int i, int e) {
              const int b = (8 * (i0 + i) + 2 * t + e) / 3;
              return b < batch ? xs[(int64_t)g * batch + b] : make_float4(0.f, 0.f, 0.f, 0.f);
            });
    }
    __syncthreads();  // buffer `buf` is read before the next iteration copies into it
    if (PREFETCH)
      cur = nxt;
    else if (active && g + 1 < g_end)
      cur.load(wtile + (int64_t)(g + 1) * TILE_BYTES, lane);
  }
  cp_async_commit_wait<0>();  // nothing in flight into the buffers the reduction reuses
  __syncthreads();

  float* red = (float*)&stage[0][0];  // [warp][16 rows][8 NT columns]
  constexpr int COLS = 8 * NT;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        red[(warp * PKV_GEMV_MMA_ROWS + gid + 8 * r) * COLS + 8 * i + 2 * t + e] = acc[r][i][e];
  __syncthreads();
  gemv_split_finish(red, COLS, n_warps * PKV_GEMV_MMA_ROWS, M, batch, y, partial, counters,
                    split, splits);
}

#define PKV_GEMV_MMA_STAGED_KERNEL(NAME, F, NT)                                             \
  PKV_KERNEL void __launch_bounds__(32 * PKV_GEMV_MMA_MAX_WARPS)                            \
      pkv_gemv_mma_staged_##NAME##_n##NT(                                                   \
      const uint8_t* w, const uint32_t* xq, const float4* xs, float* y, float* partial,     \
      unsigned* counters, int M, int K, int batch) {                                        \
    gemv_mma_staged<F, NT>(w, xq, xs, y, partial, counters, M, K, batch);                   \
  }
PKV_GEMV_MMA_STAGED_KERNEL(hfq4g256, HFQ4G256, 6)
PKV_GEMV_MMA_STAGED_KERNEL(hfq4g256, HFQ4G256, 12)
PKV_GEMV_MMA_STAGED_KERNEL(mq4g256v2, MQ4G256V2, 6)
PKV_GEMV_MMA_STAGED_KERNEL(mq4g256v2, MQ4G256V2, 12)
PKV_GEMV_MMA_STAGED_KERNEL(hfq6g256, HFQ6G256, 6)
PKV_GEMV_MMA_STAGED_KERNEL(hfq6g256, HFQ6G256, 12)
PKV_GEMV_MMA_STAGED_KERNEL(q8f16, Q8F16, 6)
PKV_GEMV_MMA_STAGED_KERNEL(q8f16, Q8F16, 12)

// ---------------------------------------------------------------------------
// Pipelined tensor-core GEMV for batch 9-32 (docs/kernels.md, "Pipelined tensor-core GEMV"):
// the staged kernel's math (mma_group_tiles, add_group, gemv_split_finish: per output the
// same exact int32 sums and the same f32 operations in the same order, so with the same
// group splits the outputs are the staged kernel's, bit for bit), with what limited that
// kernel removed: one block of 8 warps per SM spent its time waiting on each group's
// weight loads (issued one group ahead into registers at n6, not at all at n12) and ran 3
// dependent mma chains per warp.
//
// - A ring of PKV_GEMV_PIPE_STAGES stages in dynamic shared memory, one group per stage:
//   the group's prepared x (NT n-tiles, x_stage_unit's swizzle), its batch rows' (step,
//   sums) and the weights of all the block's tiles, all copied with cp.async
//   STAGES - 1 groups ahead of the one computed. The weights no longer pass through
//   registers before they are needed, so the n12 kernel prefetches them too.
// - PKV_GEMV_PIPE_TILES_PER_WARP (TPW) consecutive 16-row tiles per warp: each x fragment
//   read from shared memory feeds TPW mmas, and a warp has TPW x 3 (x2 affine halves for
//   V2) independent accumulator chains per mma step instead of 3.
// - A block of W warps owns W x TPW tiles (256 rows at 8 x 2) and one contiguous split of
//   the groups (blockIdx.y of up to 8, the launcher's _pipe_splits).
//
// Stage layout (16-byte units): [NT x 128 units of x][8 NT / 3 units of (step, sums)]
// [W x TPW tiles x 136 units of weights, the packed tile-group as in global memory].
// The ring is also the end's reduction buffer ([W x TPW x 16 rows][8 NT] f32).
// n6 / n9 / n12 at W = 8, TPW = 2, 3 stages: 142,080 / 160,896 / 179,712 bytes, above the
// 48 KiB a block gets without opting in (Kernel.reserve_shared).
template <int NT>
struct PipeStage {
  static constexpr int X_UNITS = NT * 32 * 4;
  static constexpr int XS_UNITS = 8 * NT / 3;  // batch rows the n-tiles hold
  static constexpr int TILE_UNITS = PKV_GEMV_MMA_ROWS * 136 / 16;  // both 4-bit formats
  __device__ static int units(int block_tiles) {
    return X_UNITS + XS_UNITS + block_tiles * TILE_UNITS;
  }
};

PKV_DEV int opaque_int(int v) {  // v, as a value the compiler cannot move out of a loop
  int r;
  asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(v));
  return r;
}

PKV_DEV uint32_t dynamic_smem_bytes() {
  uint32_t n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}

template <int F, int NT>
PKV_DEV void gemv_mma_pipe(const uint8_t* __restrict__ packed, const uint32_t* __restrict__ xq,
                           const float4* __restrict__ xs, float* __restrict__ y,
                           float* __restrict__ partial, unsigned* __restrict__ counters, int M,
                           int K, int batch) {
  constexpr int CH = PKV_GEMV_MMA_MAX_TILES, TPW = PKV_GEMV_PIPE_TILES_PER_WARP;
  constexpr int STAGES = PKV_GEMV_PIPE_STAGES, HALVES = MmaHalves<F>::value;
  static_assert(NT % CH == 0 && STAGES >= 2 && TPW >= 1, "whole chunks, a ring of 2+ stages");
  static_assert(Format<F>::B == 136, "the stage layout's tile size");
  using St = PipeStage<NT>;
  extern __shared__ __align__(16) uint4 ring[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const int gid = lane / 4, t = lane % 4;
  const int block_tiles = n_warps * TPW, stage_units = St::units(block_tiles);
  constexpr int COLS = 8 * NT;
  // the launcher's shared bytes must hold the ring and the end's reduction: a wrong launch
  // traps instead of writing past the block's shared memory
  if (dynamic_smem_bytes() < 16u * max(STAGES * stage_units, block_tiles * 4 * COLS))
    __trap();
  const int row_tiles = (M + PKV_GEMV_MMA_ROWS - 1) / PKV_GEMV_MMA_ROWS;
  const int first_tile = blockIdx.x * block_tiles;
  const bool active = first_tile + warp * TPW < row_tiles;  // warps past the last tile copy only
  const int groups = K / 256, splits = gridDim.y, split = blockIdx.y;
  const int g_begin = split * groups / splits, g_end = (split + 1) * groups / splits;
  const uint4* wsrc = (const uint4*)packed;

  // Weights: the packed tile-groups of the block's tiles (past the last tile, the last
  // one again: computed, never stored). Read-only, so copied before the PDL wait.
  auto stage_w = [&](int slot, int g) {
    uint4* dst = ring + slot * stage_units + St::X_UNITS + St::XS_UNITS;
    for (int u = threadIdx.x; u < block_tiles * St::TILE_UNITS; u += blockDim.x) {
      const int tile = min(first_tile + u / St::TILE_UNITS, row_tiles - 1);
      cp_async16(dst + u, wsrc + ((int64_t)tile * groups + g) * St::TILE_UNITS + u % St::TILE_UNITS);
    }
  };
  auto stage_x = [&](int slot, int g) {
    uint4* dst = ring + slot * stage_units;
    const uint4* src = (const uint4*)xq + (int64_t)g * St::X_UNITS;  // (n-tile, lane, v) order
    for (int u = threadIdx.x; u < St::X_UNITS; u += blockDim.x)
      cp_async16(dst + x_stage_unit(u / 128, (u / 4) % 32, u % 4), src + u);
    for (int b = threadIdx.x; b < batch; b += blockDim.x)
      cp_async16(dst + St::X_UNITS + b, xs + (int64_t)g * batch + b);
  };

  float acc[TPW][2][NT][2];
#pragma unroll
  for (int u = 0; u < TPW; ++u)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int i = 0; i < NT; ++i) acc[u][r][i][0] = acc[u][r][i][1] = 0.0f;

  // (step, sums) of batch rows past `batch` are zeros in every slot (the copies never write
  // there): a dead column's epilogue reads them unconditionally, without a per-column test.
  for (int k = threadIdx.x; k < STAGES * (St::XS_UNITS - batch); k += blockDim.x)
    ring[(k / (St::XS_UNITS - batch)) * stage_units + St::X_UNITS + batch +
         k % (St::XS_UNITS - batch)] = make_uint4(0u, 0u, 0u, 0u);

  // Prologue: groups g_begin .. g_begin + STAGES - 2 in flight, one commit group each (the
  // weights of all of them join the first).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (g_begin + s < g_end) stage_w(s, g_begin + s);
  pkv_grid_dependency_wait();  // PDL: the prepared x, y, partial and counters from here
  pkv_launch_dependents();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (g_begin + s < g_end) stage_x(s, g_begin + s);
    cp_async_commit();
  }
  for (int g = g_begin; g < g_end; ++g) {
    const int k = g - g_begin;
    cp_async_wait<STAGES - 2>();  // this thread's copies of group g have landed ...
    __syncthreads();  // ... and every thread's; every warp is done with group g - 1's slot
    if (g + STAGES - 1 < g_end) {  // refill that slot, STAGES - 1 groups ahead
      stage_w((k + STAGES - 1) % STAGES, g + STAGES - 1);
      stage_x((k + STAGES - 1) % STAGES, g + STAGES - 1);
    }
    cp_async_commit();  // (empty at the end: the wait count above stays uniform)
    const uint4* st = ring + (k % STAGES) * stage_units;
    if (active) {
      const float4* sums = (const float4*)(st + St::X_UNITS);
#pragma unroll
      for (int i0 = 0; i0 < NT; i0 += CH) {
        // A compiler barrier per chunk: the chunk's weight fragments are read from shared
        // memory again, where they are used, rather than kept live across the chunks from
        // the first chunk's read (40 registers; the n9/n12 kernels spilled).
        asm volatile("" ::: "memory");
        const uint4* wt = st + St::X_UNITS + St::XS_UNITS + warp * TPW * St::TILE_UNITS;
        int c[TPW][HALVES][CH][4];
        // Columns past the batch are read as they are (whatever the prepared x's unused
        // columns hold, not zeros as in the staged kernel): an mma's output column depends
        // on its own B column only, add_group gives such a column zero sums and the end
        // reads live columns only, so no output changes, and the loads stay unpredicated
        // 128-bit ones without a zero select (the select's registers spilled n9/n12).
        mma_group_tiles<F, CH, TPW>(
            c, [&](int u, int k) { return wt[u * St::TILE_UNITS + 8 + 32 * k + lane]; },
            [&](int i, int v) { return st[x_stage_unit(i0 + i, lane, v)]; });
        // t through a volatile move: the column planes and batch rows derived from it are
        // recomputed per chunk (a few integer ops) instead of hoisted out of the group loop
        // as 12 more live registers, which spilled n12
        const int tc = opaque_int(t);
#pragma unroll
        for (int u = 0; u < TPW; ++u) {
          // batch row (8 (i0 + i) + 2t + e) / 3 = 8 ((i0 + i) / 3) + (8 ((i0 + i) % 3) + 2t +
          // e) / 3; rows past the batch read the zeros put there at the start
          const uint2* hdrs = (const uint2*)(wt + u * St::TILE_UNITS);  // rows gid, gid + 8
          const uint2 hdr[2] = {hdrs[gid], hdrs[gid + 8]};
          add_group<F, CH, NT>(acc[u], c[u], hdr, i0, tc, [&](int i, int e) {
            return (sums + 8 * ((i0 + i) / 3))[(8 * ((i0 + i) % 3) + 2 * tc + e) / 3];
          });
        }
      }
    }
  }
  cp_async_wait<0>();  // nothing in flight into the ring the reduction reuses
  __syncthreads();

  float* red = (float*)ring;  // [block tile][16 rows][8 NT columns]
#pragma unroll
  for (int u = 0; u < TPW; ++u)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          red[((warp * TPW + u) * PKV_GEMV_MMA_ROWS + gid + 8 * r) * COLS + 8 * i + 2 * t + e] =
              acc[u][r][i][e];
  __syncthreads();
  gemv_split_finish(red, COLS, block_tiles * PKV_GEMV_MMA_ROWS, M, batch, y, partial, counters,
                    split, splits);
}

#define PKV_GEMV_MMA_PIPE_KERNEL(NAME, F, NT)                                               \
  PKV_KERNEL void __launch_bounds__(32 * PKV_GEMV_MMA_MAX_WARPS, 1)                         \
      pkv_gemv_mma_pipe_##NAME##_n##NT(                                                     \
      const uint8_t* w, const uint32_t* xq, const float4* xs, float* y, float* partial,     \
      unsigned* counters, int M, int K, int batch) {                                        \
    gemv_mma_pipe<F, NT>(w, xq, xs, y, partial, counters, M, K, batch);                     \
  }
#define PKV_GEMV_MMA_PIPE_KERNELS(NAME, F) \
  PKV_GEMV_MMA_PIPE_KERNEL(NAME, F, 6)     \
  PKV_GEMV_MMA_PIPE_KERNEL(NAME, F, 9)     \
  PKV_GEMV_MMA_PIPE_KERNEL(NAME, F, 12)
PKV_GEMV_MMA_PIPE_KERNELS(hfq4g256, HFQ4G256)
PKV_GEMV_MMA_PIPE_KERNELS(mq4g256v2, MQ4G256V2)

// ---------------------------------------------------------------------------
// f16-activation tensor-core GEMV for batch 1-32 (docs/kernels.md, "f16-activation GEMV";
// NVIDIA sm_80+, opt-in per Gemv). Where the int8 kernels above carry x exactly as three
// byte planes (3 B columns per batch row, 12 n-tiles at batch 32), this one carries x
// rounded once to f16 (gemv_prep_x.h, n_tiles == 0: scaled per (group, batch row) by a
// power of two, error at most 2^-11 of |x|) and turns the 4-bit codes into exact f16
// integers 0..15: one B column per batch row, NT = ceil(batch / 8) n-tiles, m16n8k16 f16
// mma with f32 sums, a third of the tensor work and of the accumulators at batch 32.
//
// Weights: gemv_mma's packed 16-row tiles unchanged (Gemv.pack). Lane (gid, t)'s 32-bit
// code word of mma m (= 2j + h: code load j / 2 (rows gid) or 2 + j / 2 (rows gid + 8),
// component 2 (j % 2) + h) is the raw bytes of weights e0 .. e0 + 7 of its row, e0 = 64 j
// + 8 h + 16 t. Its nibble pairs (bits 4s and 16 + 4s, s = 0..3) are weights (e0 + s,
// e0 + 4 + s): OR-ed into f16 1024 and less 1024, exact. Two k16 mmas per word: k-step 0
// takes pairs s = 0 (A's k 2t, 2t + 1) and 1 (k 8 + 2t, 9 + 2t), k-step 1 pairs 2 and 3;
// the k order inside an mma is free as long as B agrees, and the prepared x unit of (m, t)
// holds x[e0 ..] as (x0 x4)(x1 x5)(x2 x6)(x3 x7): b0, b1 of k-step 0, then of k-step 1.
//
// A block of W warps owns W x TPW consecutive 16-row tiles (TPW per warp: each x fragment
// read from shared memory feeds TPW tiles' mmas) and one contiguous split of the groups
// (blockIdx.y). Per group its threads copy the batch rows' prepared x (batch x 512 bytes)
// and (step, sums) into a ring of PKV_GEMV_F16_X_STAGES slots of shared memory with
// cp.async, XS - 1 groups ahead, one barrier per group; the weights go to a register ring
// PKV_GEMV_F16_PREFETCH half groups (128 weights each) deep. Per half group the mma sums start at
// zero and the f32 epilogue adds scale x step x sum + offset x (sum of that half's x):
// the affine map per half (MQ4G256V2's two, HFQ4's one twice). Shared layout: unit k of
// batch row n at 32 n + (k ^ 4 (n % 2)), so the 8 lanes (two rows, t = 0..3) of a 128-bit
// load's phase hit 8 different 16-byte bank groups. Rows from `batch` to 8 NT are zeros
// (written once; the copies never reach them). The end stores from the registers (below).
PKV_DEV int xh_stage_unit(int row, int unit) { return 32 * row + (unit ^ (4 * (row & 1))); }

// Nibbles s and 4 + s of a code word as an f16 pair of exact integers 0..15 (s a constant
// after unrolling). One lop3 puts a nibble pair under the exponent of 1024 (mask and OR in
// one instruction: written as C, nvcc emitted an AND and an OR, two immediates being one
// more than a LOP3 encodes). Even s: the nibbles at bits 4s and 16 + 4s give 1024 + q, less
// 1024. Odd s: taken in place at bits 4s (masked from w >> 4 (s - 1), the shift the even
// pair below needed anyway) they give 1024 + 16q, and q = that / 16 - 64, one f16x2 fma.
// Every step is exact in f16, so the pairs are those of shift, mask, OR and subtract, with
// 9 instructions per word instead of 15 (Marlin's dequantization does the same).
PKV_DEV uint32_t nibble_pair_f16(uint32_t w, int s) {
  const uint32_t v = s >= 2 ? w >> 8 : w;
  uint32_t biased, r;
  if (s % 2 == 0) {
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;"  // (v & 0x000F000F) | 0x64006400
        : "=r"(biased) : "r"(v), "n"(0x000F000F), "n"(0x64006400));
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(biased), "r"(0x64006400u));  // - 1024
  } else {
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;"  // (v & 0x00F000F0) | 0x64006400
        : "=r"(biased) : "r"(v), "n"(0x00F000F0), "n"(0x64006400));
    asm("fma.rn.f16x2 %0, %1, %2, %3;"  // x 1/16 - 64
        : "=r"(r) : "r"(biased), "r"(0x2C002C00u), "r"(0xD400D400u));
  }
  return r;
}

template <int F, int NT, int TPW>
PKV_DEV void gemv_f16(const uint8_t* __restrict__ packed, const uint4* __restrict__ xh,
                      const float4* __restrict__ xs, float* __restrict__ y,
                      float* __restrict__ partial, unsigned* __restrict__ counters, int M, int K,
                      int batch) {
  constexpr int ROWS = 8 * NT, UNITS = ROWS * 32;  // staged batch rows, their 16-byte units
  constexpr int TILE_BYTES = MmaTile<F>::BYTES;
  constexpr int HALVES = MmaHalves<F>::value;
  // A ring of XS slots, one group each: its batch rows' f16 x, then their (step, sums); in
  // dynamic shared memory (gemv_f16_shared_bytes: XS x 8 NT x 528 bytes, 33 KiB at XS = 2,
  // NT = 4). The end needs none (it stores from the registers).
  constexpr int XS = PKV_GEMV_F16_X_STAGES, SLOT = UNITS + ROWS;
  static_assert(XS >= 2, "a ring of 2+ slots");
  extern __shared__ __align__(16) uint4 x_ring[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  // a launch with less shared memory than the ring traps rather than writing past the
  // block's shared memory
  if (dynamic_smem_bytes() < 16u * XS * SLOT)
    __trap();
  const int gid = lane / 4, t = lane % 4;
  const int row_tiles = (M + PKV_GEMV_MMA_ROWS - 1) / PKV_GEMV_MMA_ROWS;
  const int tile0 = (blockIdx.x * n_warps + warp) * TPW;
  const bool active = tile0 < row_tiles;  // warps past the last tile only copy x
  const int groups = K / 256, splits = gridDim.y, split = blockIdx.y;
  const int g_begin = split * groups / splits, g_end = (split + 1) * groups / splits;
  const uint8_t* wt[TPW];  // past the last tile, the last one again: computed, never stored
#pragma unroll
  for (int u = 0; u < TPW; ++u)
    wt[u] = packed + (int64_t)min(tile0 + u, row_tiles - 1) * groups * TILE_BYTES;

  // rows past the batch: zero x and zero (step, sums) in every slot (never copied to)
  const int dead = (ROWS - batch) * 33;
  for (int k = threadIdx.x; k < XS * dead; k += blockDim.x) {
    uint4* slot = x_ring + (k / dead) * SLOT;
    const int j = k % dead;
    slot[j < (ROWS - batch) * 32 ? batch * 32 + j : UNITS + batch + j - (ROWS - batch) * 32] =
        make_uint4(0u, 0u, 0u, 0u);
  }
  auto stage_x = [&](int slot, int g) {
    uint4* dst = x_ring + slot * SLOT;
    const uint4* src = xh + (int64_t)g * batch * 32;  // (batch row, unit) order
    for (int u = threadIdx.x; u < batch * 32; u += blockDim.x)
      cp_async16(dst + xh_stage_unit(u / 32, u % 32), src + u);
    for (int b = threadIdx.x; b < batch; b += blockDim.x)
      cp_async16(dst + UNITS + b, xs + (int64_t)g * batch + b);
  };
  // half hv of group g: code loads hv (rows gid) and 2 + hv (rows gid + 8)
  auto load_half = [&](uint4 (&w)[TPW][2], int g, int hv) {
#pragma unroll
    for (int u = 0; u < TPW; ++u) {
      const uint4* code = (const uint4*)(wt[u] + (int64_t)g * TILE_BYTES + 128);
      w[u][0] = code[32 * hv + lane];
      w[u][1] = code[32 * (2 + hv) + lane];
    }
  };
  auto load_hdr = [&](uint2 (&h)[TPW][2], int g) {
#pragma unroll
    for (int u = 0; u < TPW; ++u) {
      const uint2* hdr = (const uint2*)(wt[u] + (int64_t)g * TILE_BYTES);
      h[u][0] = hdr[gid];
      h[u][1] = hdr[gid + 8];
    }
  };

  float acc[TPW][2][NT][2];
#pragma unroll
  for (int u = 0; u < TPW; ++u)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int i = 0; i < NT; ++i) acc[u][r][i][0] = acc[u][r][i][1] = 0.0f;

  // The weights stream through a ring of D half-groups in registers, D - 1 of them in
  // flight ahead of the one computed (a half group is 1 KiB per tile: with one half ahead
  // the warps waited out a DRAM latency per half). Step s = 2 (g - g_begin) + hv; the loop
  // runs D steps per round, unrolled, so every ring index is a constant. A group's headers
  // load with its first half and are copied out when that half is computed (its ring slot
  // is refilled while the second half still needs them).
  constexpr int D = PKV_GEMV_F16_PREFETCH;
  static_assert(D >= 2 && D % 2 == 0, "whole groups in the ring");
  uint4 ring[D][TPW][2];
  uint2 ring_hdr[D][TPW][2], hdr[TPW][2];
  const int steps = 2 * (g_end - g_begin);
  // The mma sums of one affine span: a half group (MQ4G256V2), or a whole group (HFQ4G256:
  // one scale and offset for both halves, so the epilogue runs once per group, not twice)
  float c[TPW][NT][4];
  auto load_step = [&](int s, uint4 (&w)[TPW][2], uint2 (&h)[TPW][2]) {
    load_half(w, g_begin + s / 2, s % 2);
    if (s % 2 == 0) load_hdr(h, g_begin + s / 2);
  };
  if (active) {  // read-only weights: before the PDL wait
#pragma unroll
    for (int d = 0; d < D - 1; ++d)
      if (d < steps) load_step(d, ring[d], ring_hdr[d]);
  }
  pkv_grid_dependency_wait();  // PDL: the prepared x, y, partial and counters from here
  pkv_launch_dependents();
#pragma unroll
  for (int k = 0; k < XS - 1; ++k) {  // groups g_begin .. + XS - 2 in flight, a commit each
    if (g_begin + k < g_end) stage_x(k, g_begin + k);
    cp_async_commit();
  }
  for (int s0 = 0; s0 < steps; s0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int s = s0 + d, hv = d % 2;  // s0 is even: the half is a constant
      if (s >= steps) break;  // uniform over the block
      const int g = g_begin + s / 2, slot = (s / 2) % XS;
      const uint4* st = x_ring + slot * SLOT;
      if (active && s + D - 1 < steps)  // into the slot step s - 1 left
        load_step(s + D - 1, ring[(d + D - 1) % D], ring_hdr[(d + D - 1) % D]);
      if (hv == 0) {
        cp_async_wait<XS - 2>();  // this thread's copies of group g have landed ...
        __syncthreads();  // ... and every thread's; every warp is done with group g - 1's slot
        if (g + XS - 1 < g_end) stage_x((slot + XS - 1) % XS, g + XS - 1);  // into that slot
        cp_async_commit();  // (empty at the end: the wait count above stays uniform)
#pragma unroll
        for (int u = 0; u < TPW; ++u) hdr[u][0] = ring_hdr[d][u][0], hdr[u][1] = ring_hdr[d][u][1];
      }
      if (active) {
        if (HALVES == 2 || hv == 0) {
#pragma unroll
          for (int u = 0; u < TPW; ++u)
#pragma unroll
            for (int i = 0; i < NT; ++i)
              c[u][i][0] = c[u][i][1] = c[u][i][2] = c[u][i][3] = 0.0f;
        }
#pragma unroll
        for (int mm = 0; mm < 4; ++mm) {  // mma m = 4 hv + mm: component mm of the loads
          uint4 xv[NT];
#pragma unroll
          for (int i = 0; i < NT; ++i)
            xv[i] = st[xh_stage_unit(8 * i + gid, 4 * (4 * hv + mm) + t)];
#pragma unroll
          for (int u = 0; u < TPW; ++u) {
            const uint4& w0 = ring[d][u][0];
            const uint4& w1 = ring[d][u][1];
            const uint32_t wa = mm == 0 ? w0.x : mm == 1 ? w0.y : mm == 2 ? w0.z : w0.w;
            const uint32_t wb = mm == 0 ? w1.x : mm == 1 ? w1.y : mm == 2 ? w1.z : w1.w;
            const uint32_t a0[4] = {nibble_pair_f16(wa, 0), nibble_pair_f16(wb, 0),
                                    nibble_pair_f16(wa, 1), nibble_pair_f16(wb, 1)};
            const uint32_t a1[4] = {nibble_pair_f16(wa, 2), nibble_pair_f16(wb, 2),
                                    nibble_pair_f16(wa, 3), nibble_pair_f16(wb, 3)};
#pragma unroll
            for (int i = 0; i < NT; ++i) {
              mma_f16_16x8x16(c[u][i], a0, xv[i].x, xv[i].y);
              mma_f16_16x8x16(c[u][i], a1, xv[i].z, xv[i].w);
            }
          }
        }
        // epilogue of the span that ends with half hv: lane (gid, t) holds rows gid + 8r,
        // batch rows 8i + 2t + e
#pragma unroll
        for (int i = 0; i < NT && (HALVES == 2 || hv == 1); ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float4 sx = ((const float4*)(st + UNITS))[8 * i + 2 * t + e];  // 0 past batch
            const float xsum = HALVES == 1 ? sx.w : hv ? sx.z : sx.y;
#pragma unroll
            for (int u = 0; u < TPW; ++u)
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                float scale, offset;
                header_affine<F>(hdr[u][r], HALVES == 2 ? hv : 0, scale, offset);
                // explicit roundings (add_group's reason), in the order nvcc 13 chose on
                // sm_90: the t1 and t2 kernels must give the same bits
                const float sc = pkv_mul_rn(sx.x, c[u][i][2 * r + e]);
                const float v = HALVES == 1 ? fmaf(scale, sc, pkv_mul_rn(offset, xsum))
                                            : fmaf(offset, xsum, pkv_mul_rn(scale, sc));
                acc[u][r][i][e] = pkv_add_rn(acc[u][r][i][e], v);
              }
          }
      }
    }
  }
  cp_async_wait<0>();  // no copy outlives the block (the last commits are empty)

  // The end, from the registers: lane (gid, t) holds rows 16 (tile0 + u) + gid + 8 r and
  // batch rows 8 i + 2 t + e, so one store instruction of the warp covers 8 consecutive
  // rows (a 32-byte sector) of 4 batch rows: y and the partials are written in whole
  // sectors without a transpose through shared memory. (gemv_split_finish's transpose read
  // its [rows][8 NT] buffer down a column, a 32-way bank conflict per load, and split each
  // index by two runtime divides: with the last block's loads, 29% of the warp-stall
  // samples at 4096², batch 32, Nsight Compute; docs/performance.md, "The split-K end,
  // rewritten".) With splits, the last
  // of the row block's blocks to arrive (split_arrived_last) adds each element from 0 in
  // split order: the result does not depend on which block finishes first. It re-reads its
  // own split from L2 as well (its own stores, program order): taking those from the
  // registers made each load conditional, and the kernel waited out one L2 round trip per
  // element instead of one per split: 1.6x the whole kernel's time at 4096², batch 32.
  auto each_output = [&](auto&& f) {  // f(u, r, i, e, index in [batch][M]) for rows < M
#pragma unroll
    for (int u = 0; u < TPW; ++u)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = (tile0 + u) * PKV_GEMV_MMA_ROWS + gid + 8 * r;
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int b = 8 * i + 2 * t + e;
            if (row < M && b < batch) f(u, r, i, e, (int64_t)b * M + row);
          }
      }
  };
  if (splits == 1) {
    each_output([&](int u, int r, int i, int e, int64_t at) { y[at] = acc[u][r][i][e]; });
    return;
  }
  float* mine = partial + (int64_t)split * batch * M;
  each_output([&](int u, int r, int i, int e, int64_t at) { mine[at] = acc[u][r][i][e]; });
  if (!split_arrived_last(counters, splits)) return;
  float sum[TPW][2][NT][2];
#pragma unroll
  for (int u = 0; u < TPW; ++u)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int i = 0; i < NT; ++i) sum[u][r][i][0] = sum[u][r][i][1] = 0.0f;
  for (int s = 0; s < splits; ++s) {  // split order; a split's loads are issued together
    const float* p = partial + (int64_t)s * batch * M;
    each_output([&](int u, int r, int i, int e, int64_t at) {
      sum[u][r][i][e] += __ldcg(p + at);  // its own split too: see above
    });
  }
  each_output([&](int u, int r, int i, int e, int64_t at) { y[at] = sum[u][r][i][e]; });
  if (threadIdx.x == 0) counters[blockIdx.x] = 0u;  // ready for the next launch
}

#if PKV_GEMV_F16_MIN_BLOCKS > 0
#define PKV_GEMV_F16_BOUNDS __launch_bounds__(32 * PKV_GEMV_MMA_MAX_WARPS, PKV_GEMV_F16_MIN_BLOCKS)
#else  // no minimum: not the same as a minimum of 1 to nvcc (launch.h)
#define PKV_GEMV_F16_BOUNDS __launch_bounds__(32 * PKV_GEMV_MMA_MAX_WARPS)
#endif
#define PKV_GEMV_F16_KERNEL(NAME, F, NT, TPW)                                               \
  PKV_KERNEL void PKV_GEMV_F16_BOUNDS                                                       \
      pkv_gemv_f16_##NAME##_n##NT##_t##TPW(                                                 \
      const uint8_t* w, const uint4* xh, const float4* xs, float* y, float* partial,        \
      unsigned* counters, int M, int K, int batch) {                                        \
    gemv_f16<F, NT, TPW>(w, xh, xs, y, partial, counters, M, K, batch);                     \
  }
#define PKV_GEMV_F16_KERNELS(NAME, F) \
  PKV_GEMV_F16_KERNEL(NAME, F, 1, 1)  \
  PKV_GEMV_F16_KERNEL(NAME, F, 1, 2)  \
  PKV_GEMV_F16_KERNEL(NAME, F, 2, 1)  \
  PKV_GEMV_F16_KERNEL(NAME, F, 2, 2)  \
  PKV_GEMV_F16_KERNEL(NAME, F, 3, 1)  \
  PKV_GEMV_F16_KERNEL(NAME, F, 3, 2)  \
  PKV_GEMV_F16_KERNEL(NAME, F, 4, 1)  \
  PKV_GEMV_F16_KERNEL(NAME, F, 4, 2)
PKV_GEMV_F16_KERNELS(hfq4g256, HFQ4G256)
PKV_GEMV_F16_KERNELS(mq4g256v2, MQ4G256V2)

#endif  // __CUDACC__

// ---------------------------------------------------------------------------
// AMD matrix-core GEMV (CDNA MFMA: gfx908, gfx90a, gfx940-942, PKV_MFMA_I8; RDNA3 WMMA:
// gfx11, PKV_WMMA_I8; pagedkv_compat.h): the same prepared x (pkv_gemv_prep_x above), the
// same packed weight tiles (Gemv.pack), the same kernel names and arguments as gemv_mma and
// the batch 9-32 pkv_gemv_mma_tiled_* (the NVIDIA batch 9-32 kernel is gemv_mma_staged, with
// its own launch), one host path. Only the fragment mapping differs, and it lives in the
// two fragment types below; the kernel body is one.
//
// A 16x16 int8 tile product per k-32 step of gemv_mma (its mma m = 2j + h): A row i is
// tile row i, B column i is prepared-x column 16 T + i. gemv_mma's lane (gid, t) holds
// "k-quad" t of a row: the low nibbles of word h of chunk 4j + t (a_lo, 4 codes) and the
// high ones (a_hi), against prepared-x words b_lo / b_hi of NVIDIA lane 4 n + t, the
// pairing the prep wrote. The k order inside one product is free as long as A and B agree,
// so any grouping of the 4 quads x 2 halves x 4 bytes into instructions gives the same
// exact int32 sums, and the epilogue, the order over groups and the reduction over
// wavefronts are gemv_mma's: the outputs are the NVIDIA kernel's, bit for bit, up to the
// compilers' fused multiply-adds.
//
// MfmaI8 (wavefront of 64): lane l, i = l % 16, q = l / 16 holds quad q of row / column i
// (AMD matrix instruction calculator; CDNA2/CDNA3 ISA, "Matrix fused multiply-add": A byte
// b of k-16 is A[i][4q + b], B byte b is B[4q + b][i]; k-32 (registers v): A[i][8q + 4v +
// b]); D register r is D[4q + r][i]. v_mfma_i32_16x16x16i8 on gfx90a (two per step: lo,
// then hi), v_mfma_i32_16x16x32_i8 on CDNA3 (one).
// WmmaI8 (wave32, v_wmma_i32_16x16x16_iu8): lane l, i = l % 16 holds all 16 k-bytes of row
// / column i, register w byte b = A[i][4w + b] (RDNA3 ISA, "Wave Matrix Multiply
// Accumulate", A/B VGPR view for wave32; GPUOpen "WMMA on RDNA 3"), and lanes 16-31 must
// hold what lanes 0-15 do; D register r is D[2r + l / 16][l % 16]. So a lane loads the 4
// quads of its row and column (the half-waves load the same bytes) and runs two
// instructions per step: quads 0-3 of the low nibbles, then of the high ones.
//
// An NT of 8-column n-tiles runs ceil(NT / 2) 16-column tiles, in chunks of up to 3 (48
// columns = 16 batch rows; the shared-memory reduction holds one chunk). A block is W
// wavefronts (the host launches warp_size x warps threads); columns past 3 * batch read
// zeros.
//
// HFQ6G256 and Q8F16 (n1-n3, as on NVIDIA): the same body, their A words rebuilt from their
// own packings (AmdCodes: mma_group6's nibble and high-bit words, mma_group_q8's registers).
// HFQ6 keeps HFQ4's affine epilogue. Q8F16's quads 0-1 of an mma carry one 32-weight block
// and quads 2-3 the next (gemv_mma's t < 2 / t >= 2), each block with its own f16 scale:
// the fragment type's product_blocks keeps the two blocks' sums apart (MFMA: twice, the
// other block's lanes zeroed; WMMA: one instruction per block of its two quads), and each
// pair of blocks is scaled as mma_group_q8 does, in its order.
//
// Compile-checked only (hipcc for gfx90a and gfx940; gfx1100 through hip/gfx11_codegen.py,
// LLVM 22 from llvmlite, since Debian's HIP 5.2 cannot generate gfx11 code) and emulated
// lane by lane in NumPy (tests/test_gemv_amd_simulated.py): no AMD GPU has run it.
#if defined(PKV_MFMA_I8) || defined(PKV_WMMA_I8)

typedef int pkv_i32x4 __attribute__((ext_vector_type(4)));
typedef int pkv_i32x8 __attribute__((ext_vector_type(8)));

#if defined(PKV_MFMA_I8)
struct MfmaI8 {
  static constexpr int WAVE = 64, QUADS = 1, D_ROWS = 4;
  typedef pkv_i32x4 Acc;
  PKV_DEV int quad(int lane, int) { return lane / 16; }
  PKV_DEV int d_row(int lane, int r) { return 4 * (lane / 16) + r; }
  // c += the k-32 product: a_lo / b_lo are the lane's low-nibble quad (k-octet half 0, or
  // gfx90a's first k-16 instruction), a_hi / b_hi the high one.
  PKV_DEV void product(Acc& c, const uint32_t (&a_lo)[QUADS], const uint32_t (&a_hi)[QUADS],
                       const uint32_t (&b_lo)[QUADS], const uint32_t (&b_hi)[QUADS]) {
#if PKV_MFMA_I8 == 32
    const long a = (long)(((uint64_t)a_hi[0] << 32) | a_lo[0]);
    const long b = (long)(((uint64_t)b_hi[0] << 32) | b_lo[0]);
    c = __builtin_amdgcn_mfma_i32_16x16x32_i8(a, b, c, 0, 0, 0);
#else
    c = __builtin_amdgcn_mfma_i32_16x16x16i8((int)a_lo[0], (int)b_lo[0], c, 0, 0, 0);
    c = __builtin_amdgcn_mfma_i32_16x16x16i8((int)a_hi[0], (int)b_hi[0], c, 0, 0, 0);
#endif
  }
  // Q8F16: c[bk] += block 2j + bk's part of the product, whose dims quads 2bk, 2bk + 1 hold
  // (gemv_mma's t < 2 / t >= 2). A lane holds one quad, so the product runs once per block
  // with the other block's lanes zeroed, as mma_group_q8 does: 2x the MFMAs.
  PKV_DEV void product_blocks(Acc (&c)[2], int lane, const uint32_t (&a_lo)[QUADS],
                              const uint32_t (&a_hi)[QUADS], const uint32_t (&b_lo)[QUADS],
                              const uint32_t (&b_hi)[QUADS]) {
#pragma unroll
    for (int bk = 0; bk < 2; ++bk) {
      const bool mine = lane / 32 == bk;
      const uint32_t lo[QUADS] = {mine ? a_lo[0] : 0u}, hi[QUADS] = {mine ? a_hi[0] : 0u};
      product(c[bk], lo, hi, b_lo, b_hi);
    }
  }
};
typedef MfmaI8 AmdI8Frag;
#else
struct WmmaI8 {
  static constexpr int WAVE = 32, QUADS = 4, D_ROWS = 8;
  typedef pkv_i32x8 Acc;
  PKV_DEV int quad(int, int qq) { return qq; }
  PKV_DEV int d_row(int lane, int r) { return 2 * r + lane / 16; }
  // c += the k-32 product: register w of the first instruction is quad w's low nibbles
  // (codes unsigned, x planes signed; both flags say signed: codes are below 128).
  PKV_DEV void product(Acc& c, const uint32_t (&a_lo)[QUADS], const uint32_t (&a_hi)[QUADS],
                       const uint32_t (&b_lo)[QUADS], const uint32_t (&b_hi)[QUADS]) {
    const pkv_i32x4 al = {(int)a_lo[0], (int)a_lo[1], (int)a_lo[2], (int)a_lo[3]};
    const pkv_i32x4 bl = {(int)b_lo[0], (int)b_lo[1], (int)b_lo[2], (int)b_lo[3]};
    const pkv_i32x4 ah = {(int)a_hi[0], (int)a_hi[1], (int)a_hi[2], (int)a_hi[3]};
    const pkv_i32x4 bh = {(int)b_hi[0], (int)b_hi[1], (int)b_hi[2], (int)b_hi[3]};
    c = __builtin_amdgcn_wmma_i32_16x16x16_iu8_w32(true, al, true, bl, c, false);
    c = __builtin_amdgcn_wmma_i32_16x16x16_iu8_w32(true, ah, true, bh, c, false);
  }
  // Q8F16: c[bk] += block 2j + bk's part of the product (quads 2bk, 2bk + 1, MfmaI8's). A
  // lane holds every quad, so one instruction per block takes its two quads' low and high
  // halves (the k order inside a product is free as long as A and B agree): no zeroed
  // operands, as many WMMAs as the 4-bit formats.
  PKV_DEV void product_blocks(Acc (&c)[2], int, const uint32_t (&a_lo)[QUADS],
                              const uint32_t (&a_hi)[QUADS], const uint32_t (&b_lo)[QUADS],
                              const uint32_t (&b_hi)[QUADS]) {
#pragma unroll
    for (int bk = 0; bk < 2; ++bk) {
      const int q0 = 2 * bk, q1 = 2 * bk + 1;
      const pkv_i32x4 a = {(int)a_lo[q0], (int)a_lo[q1], (int)a_hi[q0], (int)a_hi[q1]};
      const pkv_i32x4 b = {(int)b_lo[q0], (int)b_lo[q1], (int)b_hi[q0], (int)b_hi[q1]};
      c[bk] = __builtin_amdgcn_wmma_i32_16x16x16_iu8_w32(true, a, true, b, c[bk], false);
    }
  }
};
typedef WmmaI8 AmdI8Frag;
#endif

// One lane's A words of one (16-row tile, group): a(qq, m, lo, hi) gives k-quad qq's words
// of gemv_mma's mma m for row i, lo the low k-octet half (a0 / a1 there; gfx90a's first k-16
// instruction) and hi the high one (a2 / a3). They are what NVIDIA lane L = 4 (i % 8) + quad
// holds for its row gid (i < 8: a0, a2) or gid + 8 (a1, a3), read from the format's own
// packing (MmaWeights, MmaWeights6, MmaWeightsQ8). The HFQ6 and Q8F16 words are loaded one
// by one (16 a quad), not as the NVIDIA lane's 16-byte loads, a third (HFQ6) or half (Q8F16)
// of which is the other row half's: WMMA holds four quads.
template <int F, int QUADS>
struct AmdCodes {  // 4-bit: word m % 4 of load 2 (i / 8) + m / 4 (gemv_mma's chunk 4j + t)
  uint4 code[QUADS][2];

  __device__ __forceinline__ void load(const uint8_t* base, int i, const int (&L)[QUADS]) {
#pragma unroll
    for (int qq = 0; qq < QUADS; ++qq)
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
        code[qq][jj] = ((const uint4*)(base + 128))[32 * (2 * (i / 8) + jj) + L[qq]];
  }
  __device__ __forceinline__ void a(int qq, int m, uint32_t& lo, uint32_t& hi) const {
    const uint4 pa = code[qq][m / 4];
    const uint32_t wa = m % 4 == 0 ? pa.x : m % 4 == 1 ? pa.y : m % 4 == 2 ? pa.z : pa.w;
    lo = wa & 0x0F0F0F0Fu;
    hi = (wa >> 4) & 0x0F0F0F0Fu;
  }
};

template <int QUADS>
struct AmdCodes<HFQ6G256, QUADS> {  // mma_group6's words 3m + i / 8 (n0 / n1) and 3m + 2 (hb)
  const uint32_t* w[QUADS];  // MmaWeights6's words of lane L: word x at 4 (32 (x / 4)) + x % 4
  int half;                  // i / 8

  __device__ __forceinline__ void load(const uint8_t* base, int i, const int (&L)[QUADS]) {
#pragma unroll
    for (int qq = 0; qq < QUADS; ++qq) w[qq] = (const uint32_t*)(base + 128) + 4 * L[qq];
    half = i / 8;
  }
  __device__ __forceinline__ uint32_t word(int qq, int x) const {
    return w[qq][4 * 32 * (x / 4) + x % 4];
  }
  __device__ __forceinline__ void a(int qq, int m, uint32_t& lo, uint32_t& hi) const {
    const uint32_t n = half ? word(qq, 3 * m + 1) : word(qq, 3 * m);
    // rows 8-15 (a1, a3) keep their high bits in bits 4-7 of each byte, rows 0-7 (a0, a2) in
    // bits 0-3: shifted to the same place, one rebuild serves both
    hfq6_join(n, word(qq, 3 * m + 2) >> 4 * half, lo, hi);
  }
};

template <int QUADS>
struct AmdCodes<Q8F16, QUADS> {  // MmaWeightsQ8::code[m]'s a0 / a1 (lo) and a2 / a3 (hi)
  const uint32_t* w[QUADS];      // lane L's word i / 8 of mma 0

  __device__ __forceinline__ void load(const uint8_t* base, int i, const int (&L)[QUADS]) {
#pragma unroll
    for (int qq = 0; qq < QUADS; ++qq) w[qq] = (const uint32_t*)(base + 256) + 4 * L[qq] + i / 8;
  }
  __device__ __forceinline__ void a(int qq, int m, uint32_t& lo, uint32_t& hi) const {
    lo = w[qq][4 * 32 * m];
    hi = w[qq][4 * 32 * m + 2];
  }
};

template <int F, int NT, typename MC>
PKV_DEV void gemv_amd_mc(const uint8_t* __restrict__ packed, const uint32_t* __restrict__ xq,
                         const float4* __restrict__ xs, float* __restrict__ y, int M, int K,
                         int batch) {
  constexpr int T16 = (NT + 1) / 2;        // 16-column tiles
  constexpr int CH = T16 < 3 ? T16 : 3;    // tiles per chunk of the reduction
  static_assert(T16 % CH == 0, "whole chunks");
  constexpr int ROWS_PER_CHUNK = 16 * CH / 3;  // exact when there are several chunks
  constexpr int TILE_BYTES = MmaTile<F>::BYTES;
  constexpr int HALVES = F == MQ4G256V2 ? 2 : 1;
  // int32 sums per tile and group: one per affine map (V2: two halves), Q8F16 one per block
  // of the current pair (mma_group_q8's c[bk])
  constexpr int SUMS = F == Q8F16 ? 2 : HALVES;
  constexpr int QUADS = MC::QUADS, D_ROWS = MC::D_ROWS;
  // the wave's index is uniform across it: said so, its group range and loop live in
  // scalar registers and the loop branches on SCC instead of the exec mask
  const int lane = threadIdx.x % MC::WAVE;
  const int wave = __builtin_amdgcn_readfirstlane(threadIdx.x / MC::WAVE);
  const int n_waves = blockDim.x / MC::WAVE;
  const int i = lane % 16;
  const int row0 = blockIdx.x * PKV_GEMV_MMA_ROWS;
  int L[QUADS];  // per quad of row i, the NVIDIA lane that holds its A words
#pragma unroll
  for (int qq = 0; qq < QUADS; ++qq) L[qq] = 4 * (i % 8) + MC::quad(lane, qq);
  const int groups = K / 256;
  const int g_begin = wave * groups / n_waves, g_end = (wave + 1) * groups / n_waves;
  const uint8_t* tile = packed + (int64_t)blockIdx.x * groups * TILE_BYTES;
  __shared__ float red[PKV_GEMV_MMA_MAX_WARPS][PKV_GEMV_MMA_ROWS][16 * CH];

  // One 16-column tile at a time over the wave's groups (the tile's sums in D_ROWS
  // registers; the codes re-read per tile, from cache after the first): with every tile in
  // flight at once, WMMA's replicated operands (64 registers of x and 64 of cut codes per
  // tile and group) spilled in the batch 6-32 kernels. Each (row, column) still adds its
  // groups in ascending order.
#pragma unroll 1
  for (int T = 0; T < T16; ++T) {
    const int col = 16 * T + i, n = col % 8, p = col % 3, b = col / 3;
    // columns past 3 * batch take zeros; their loads stay inside the prepared x (n-tile
    // NT - 1 at most) and always run (a guarded load is a branch the loads cannot be
    // scheduled across)
    const bool live = col < 3 * batch;
    const int nt = min(col / 8, NT - 1);
    float acc[D_ROWS];
#pragma unroll
    for (int r = 0; r < D_ROWS; ++r) acc[r] = 0.0f;
    for (int g = g_begin; g < g_end; ++g) {
      const uint8_t* base = tile + (int64_t)g * TILE_BYTES;
      AmdCodes<F, QUADS> codes;
      codes.load(base, i, L);
      // the column's batch-row (step, sums); read where the epilogue needs it
      const auto x_sums = [&] {
        return b < batch ? xs[(int64_t)g * batch + b] : make_float4(0.f, 0.f, 0.f, 0.f);
      };
      const auto plane_step = [&](float4 s) {  // step * 2^(8p): gemv_mma's f
        return s.x * x_plane_weight(p);
      };
      // Q8F16's blocks are scaled as each pair's sums are done; the affine formats read the
      // sums after their group's products (the load, up front for them, took 10 more VGPRs)
      const float f_blocks = F == Q8F16 ? plane_step(x_sums()) : 0.0f;
      typename MC::Acc c[SUMS];
#pragma unroll
      for (int k = 0; k < SUMS; ++k) c[k] = typename MC::Acc{};
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // prepared-x word j serves mmas 2j and 2j + 1
        uint4 xw[QUADS];
#pragma unroll
        for (int qq = 0; qq < QUADS; ++qq) {
          const uint4 w = ((const uint4*)(xq + (((int64_t)g * NT + nt) * 32 + 4 * n +
                                                MC::quad(lane, qq)) * PKV_GEMV_X_WORDS))[j];
          xw[qq] = make_uint4(live ? w.x : 0u, live ? w.y : 0u, live ? w.z : 0u, live ? w.w : 0u);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = 2 * j + h;  // gemv_mma's mma m
          uint32_t a_lo[QUADS], a_hi[QUADS], b_lo[QUADS], b_hi[QUADS];
#pragma unroll
          for (int qq = 0; qq < QUADS; ++qq) {
            codes.a(qq, m, a_lo[qq], a_hi[qq]);
            b_lo[qq] = h ? xw[qq].z : xw[qq].x;
            b_hi[qq] = h ? xw[qq].w : xw[qq].y;
          }
          if constexpr (F == Q8F16) {
            MC::product_blocks(c, lane, a_lo, a_hi, b_lo, b_hi);
          } else {
            MC::product(c[HALVES == 2 ? m / 4 : 0], a_lo, a_hi, b_lo, b_hi);
          }
        }
        if constexpr (F == Q8F16) {
#pragma unroll
          for (int bk = 0; bk < 2; ++bk)
#pragma unroll
            for (int r = 0; r < D_ROWS; ++r) {  // mma_group_q8's epilogue, block 2j + bk
              // the row's block scales: half bk of word j of its 16 bytes
              const uint32_t word = ((const uint32_t*)(base + 16 * MC::d_row(lane, r)))[j];
              const float d = pkv_half_bits_to_float((uint16_t)(bk ? word >> 16 : word & 0xFFFFu));
              acc[r] += d * (f_blocks * (float)c[bk][r]);
            }
#pragma unroll
          for (int k = 0; k < SUMS; ++k) c[k] = typename MC::Acc{};
          // WMMA: the scheduler hoisted all the group's loads (64 code, 64 x, 32 scale
          // words) above the first product and the n3 kernel spilled (40 scratch bytes);
          // blocks 4-7's loads wait for blocks 0-3's products (164-193 VGPRs, gfx1100)
          if (QUADS == 4 && j == 1) __builtin_amdgcn_sched_barrier(0);
        }
      }
      if constexpr (F != Q8F16) {
        const float4 s = x_sums();
        const float f = plane_step(s);
#pragma unroll
        for (int r = 0; r < D_ROWS; ++r) {  // gemv_mma's epilogue, row d_row(r), column col
          float scale[HALVES], offset[HALVES];
          const uint2 hdr = *(const uint2*)(base + 8 * MC::d_row(lane, r));
#pragma unroll
          for (int hv = 0; hv < HALVES; ++hv) header_affine<F>(hdr, hv, scale[hv], offset[hv]);
          float v = scale[0] * (f * (float)c[0][r]);
          if (HALVES == 2) v += scale[HALVES - 1] * (f * (float)c[HALVES - 1][r]);
          if (p == 0) v += HALVES == 2 ? offset[0] * s.y + offset[HALVES - 1] * s.z : offset[0] * s.w;
          acc[r] += v;
        }
      }
    }
    // the waves' sums meet in shared memory, a chunk of CH tiles at a time
    if (T % CH == 0 && T) __syncthreads();  // the previous chunk's sums are read
#pragma unroll
    for (int r = 0; r < D_ROWS; ++r) red[wave][MC::d_row(lane, r)][16 * (T % CH) + i] = acc[r];
    if (T % CH == CH - 1) {
      __syncthreads();
      const int b0 = T / CH * ROWS_PER_CHUNK;
      const int nb = min(ROWS_PER_CHUNK, batch - b0);
      for (int k = threadIdx.x; k < PKV_GEMV_MMA_ROWS * nb; k += blockDim.x) {
        const int r = k % PKV_GEMV_MMA_ROWS, bl = k / PKV_GEMV_MMA_ROWS;
        float v = 0.0f;
        for (int w = 0; w < n_waves; ++w)
          v += red[w][r][3 * bl] + red[w][r][3 * bl + 1] + red[w][r][3 * bl + 2];
        if (row0 + r < M) y[(int64_t)(b0 + bl) * M + row0 + r] = v;
      }
    }
  }
}

// The NVIDIA kernels' names and arguments (gemv_mma: n1-n3; tiled: n6, n12).
#define PKV_GEMV_AMD_MC_KERNEL(PREFIX, NAME, F, NT)                                       \
  PKV_KERNEL void __launch_bounds__(AmdI8Frag::WAVE * PKV_GEMV_MMA_MAX_WARPS)             \
      pkv_gemv_mma_##PREFIX##NAME##_n##NT(                                                \
      const uint8_t* w, const uint32_t* xq, const float4* xs, float* y, int M, int K,     \
      int batch) {                                                                        \
    gemv_amd_mc<F, NT, AmdI8Frag>(w, xq, xs, y, M, K, batch);                             \
  }
#define PKV_GEMV_AMD_MC_KERNELS(NAME, F)          \
  PKV_GEMV_AMD_MC_KERNEL(, NAME, F, 1)            \
  PKV_GEMV_AMD_MC_KERNEL(, NAME, F, 2)            \
  PKV_GEMV_AMD_MC_KERNEL(, NAME, F, 3)
#define PKV_GEMV_AMD_MC_TILED_KERNELS(NAME, F)    \
  PKV_GEMV_AMD_MC_KERNEL(tiled_, NAME, F, 6)      \
  PKV_GEMV_AMD_MC_KERNEL(tiled_, NAME, F, 12)

PKV_GEMV_AMD_MC_KERNELS(hfq4g256, HFQ4G256)
PKV_GEMV_AMD_MC_TILED_KERNELS(hfq4g256, HFQ4G256)
PKV_GEMV_AMD_MC_KERNELS(mq4g256v2, MQ4G256V2)
PKV_GEMV_AMD_MC_TILED_KERNELS(mq4g256v2, MQ4G256V2)
// HFQ6G256 and Q8F16, batch 1-32 as the 4-bit formats (docs/kernels.md, "HFQ6 and Q8F16 on
// tensor cores")
PKV_GEMV_AMD_MC_KERNELS(hfq6g256, HFQ6G256)
PKV_GEMV_AMD_MC_TILED_KERNELS(hfq6g256, HFQ6G256)
PKV_GEMV_AMD_MC_KERNELS(q8f16, Q8F16)
PKV_GEMV_AMD_MC_TILED_KERNELS(q8f16, Q8F16)

#endif  // PKV_MFMA_I8 || PKV_WMMA_I8
