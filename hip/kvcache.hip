// KV-cache kernels: q8 quantize on write and dequantize on read (docs/contracts/hfqm-and-quant.md
// docs/contracts/hfqm-and-quant.md, '6.3 q8 (K and V)'), paged-attention decode over block tables
// (docs/contracts/paged-kv.md, '5.2 Layout') on f16/bf16/q8 KV
// and on compressed KV (fwhtN K with q8 or lloydN V, docs/kv-quant.md), and block
// copies between pools.
//
// Pool layout, per layer and side: [num_blocks, block_size, kv_heads, row] where a
// row is head_dim f16/bf16 values (2*head_dim bytes) or head_dim/32 q8 records of
// 34 bytes. A token's slot is block_id * block_size + offset.
//
// Parameters: inputs, outputs, then scalars.
#include "pagedkv_compat.h"
#include "attention_reduce.h"
#include "mma_f16.h"
#include "mma_s8.h"
#include <pagedkv/kvquant.h>
#include <pagedkv/launch.h>

// ---------------------------------------------------------------------------
// q8 write: one 32-value record per 32 consecutive lanes (a whole warp on 32-wide
// targets, half a wavefront on 64-wide ones: the xor offsets stay below 32).

// f32 or f16 (uint16_t bits) values in and out.
PKV_DEV float pkv_load_value(const float* p) { return *p; }
PKV_DEV float pkv_load_value(const uint16_t* p) { return pkv_half_bits_to_float(*p); }
PKV_DEV void pkv_store_value(float* p, float v) { *p = v; }
PKV_DEV void pkv_store_value(uint16_t* p, float v) { *p = pkv_float_to_half_bits(v); }

template <typename In>
PKV_DEV void kv_q8_write(const In* __restrict__ src, const int64_t* __restrict__ slots,
                         uint8_t* __restrict__ pool, int n_tokens, int kv_heads, int head_dim) {
  const int64_t gid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int j = (int)(gid & 31);
  const int64_t rec = gid >> 5;
  const int recs_per_row = head_dim / PKV_KVQ8_BLOCK;
  const int64_t n_recs = (int64_t)n_tokens * kv_heads * recs_per_row;
  const bool live = rec < n_recs;
  int64_t token = 0, slot = -1;
  float v = 0.0f;
  if (live) {
    token = rec / ((int64_t)kv_heads * recs_per_row);
    slot = slots[token];
    v = pkv_load_value(src + rec * PKV_KVQ8_BLOCK + j);
  }
  float amax = fabsf(v);
  for (int m = 16; m > 0; m >>= 1) amax = pkv_kvq8_amax(amax, pkv_shfl_xor(amax, m));
  if (!live || slot < 0) return;  // slot -1: a padding token, nothing to store
  const int64_t head_rec = rec - token * ((int64_t)kv_heads * recs_per_row);
  uint8_t* out = pool + (slot * kv_heads * recs_per_row + head_rec) * PKV_KVQ8_RECORD_BYTES;
  const float inv = pkv_kvq8_inv_scale(amax);
  out[2 + j] = (uint8_t)(int8_t)pkv_kvq8_code(v, inv);
  if (j == 0) {
    pkv_store_u16le(out, pkv_kvq8_scale_bits(amax));
  }
}

PKV_KERNEL void pkv_kv_q8_write_f32(const float* src, const int64_t* slots, uint8_t* pool,
                                    int n_tokens, int kv_heads, int head_dim) {
  kv_q8_write<float>(src, slots, pool, n_tokens, kv_heads, head_dim);
}
PKV_KERNEL void pkv_kv_q8_write_f16(const uint16_t* src, const int64_t* slots, uint8_t* pool,
                                    int n_tokens, int kv_heads, int head_dim) {
  kv_q8_write<uint16_t>(src, slots, pool, n_tokens, kv_heads, head_dim);
}

// q8 read: one output value per thread, gathered by slot.

template <typename Out>
PKV_DEV void kv_q8_read(const uint8_t* __restrict__ pool, const int64_t* __restrict__ slots,
                        Out* __restrict__ dst, int n_tokens, int kv_heads, int head_dim) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t row_vals = (int64_t)kv_heads * head_dim;
  if (i >= (int64_t)n_tokens * row_vals) return;
  const int64_t token = i / row_vals;
  const int64_t within = i - token * row_vals;  // head * head_dim + dim
  const int64_t rec = slots[token] * (row_vals / PKV_KVQ8_BLOCK) + within / PKV_KVQ8_BLOCK;
  const uint8_t* r = pool + rec * PKV_KVQ8_RECORD_BYTES;
  const float d = pkv_half_bits_to_float((uint16_t)(r[0] | (r[1] << 8)));
  pkv_store_value(dst + i, pkv_kvq8_value(d, (int8_t)r[2 + within % PKV_KVQ8_BLOCK]));
}

PKV_KERNEL void pkv_kv_q8_read_f32(const uint8_t* pool, const int64_t* slots, float* dst,
                                   int n_tokens, int kv_heads, int head_dim) {
  kv_q8_read<float>(pool, slots, dst, n_tokens, kv_heads, head_dim);
}
PKV_KERNEL void pkv_kv_q8_read_f16(const uint8_t* pool, const int64_t* slots, uint16_t* dst,
                                   int n_tokens, int kv_heads, int head_dim) {
  kv_q8_read<uint16_t>(pool, slots, dst, n_tokens, kv_heads, head_dim);
}

// ---------------------------------------------------------------------------
// Paged-attention decode (one query token per sequence, GQA).
//
// Split along the sequence ("flash decoding"): CTA (partition, kv_head, seq) scores a
// partition's tokens for the kv head's group of query heads, keeps the scores in
// shared memory (two passes: K then V, no running rescale), and writes the
// unnormalized partial output with its max and sum; pkv_paged_attention_reduce
// combines the partitions. Two implementations of the passes: f16 and bf16 KV with up
// to 4 query heads per KV head and head_dim 64/128 run both as f16 / bf16 tensor-core
// mma on NVIDIA sm_80+ (qk_scores_mma, pv_mma); everything else runs on CUDA cores / SIMD
// lanes, each lane holding 8 consecutive dims of a token row (a token takes
// head_dim/8 lanes and one 16-byte load per row for f16/bf16).

// Tokens per partition, threads and __launch_bounds__ minimum blocks per SM of each KV
// kind: pagedkv/launch.h (the one definition, read by every launcher too).
#ifndef PKV_ATTN_UNROLL
#define PKV_ATTN_UNROLL 4
#endif

enum KvKind { KV_F16 = 0, KV_BF16 = 1, KV_Q8 = 2 };
// A kind's launch.h values, picked by the kind's own name (F16, BF16, Q8) as the launchers
// do: a kind never borrows another kind's constant.
#define PKV_ATTN_OF_KIND(NAME, KIND) \
  ((KIND) == KV_F16 ? NAME##_F16 : (KIND) == KV_BF16 ? NAME##_BF16 : NAME##_Q8)

// A lane's 8 dims of one K or V row, as raw words: all of an iteration's loads are
// issued before any is converted (converting right after each load would wait for
// it and serialize the loads).
struct RawRow8 {
  uint32_t w[4];   // f16/bf16: 8 values; q8: 4 x (2 int8 codes) in the low 16 bits
  uint32_t scale;  // q8: the record's f16 scale
};

template <int KIND>
PKV_DEV void load_row8(const uint8_t* row, int d0, RawRow8& r) {
  if (KIND == KV_Q8) {
    const uint16_t* rec = (const uint16_t*)(row + (d0 / PKV_KVQ8_BLOCK) * PKV_KVQ8_RECORD_BYTES);
    r.scale = rec[0];  // records are 2-byte aligned
#pragma unroll
    for (int i = 0; i < 4; ++i) r.w[i] = rec[1 + (d0 % PKV_KVQ8_BLOCK) / 2 + i];
  } else {
    const uint4 raw = *(const uint4*)(row + 2 * d0);
    r.w[0] = raw.x; r.w[1] = raw.y; r.w[2] = raw.z; r.w[3] = raw.w;
    r.scale = 0;
  }
}

PKV_DEV void zero_row8(RawRow8& r) {
  r.w[0] = r.w[1] = r.w[2] = r.w[3] = 0;
  r.scale = 0;
}

template <int KIND>
PKV_DEV void convert_row8(const RawRow8& r, float out[8]) {
  const float d = KIND == KV_Q8 ? pkv_half_bits_to_float((uint16_t)r.scale) : 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = r.w[i] & 0xFFFF, hi = r.w[i] >> 16;
    if (KIND == KV_Q8) {
      out[2 * i] = pkv_kvq8_value(d, (int8_t)(lo & 0xFF));
      out[2 * i + 1] = pkv_kvq8_value(d, (int8_t)(lo >> 8));
    } else if (KIND == KV_F16) {
      out[2 * i] = pkv_half_bits_to_float((uint16_t)lo);
      out[2 * i + 1] = pkv_half_bits_to_float((uint16_t)hi);
    } else {
      out[2 * i] = pkv_bf16_bits_to_float((uint16_t)lo);
      out[2 * i + 1] = pkv_bf16_bits_to_float((uint16_t)hi);
    }
  }
}

// Pass 1 on NVIDIA tensor cores (sm_80+, f16 KV, head_dim <= 128): per warp, 8 tokens
// at a time, scores = q . K^T as m16n8k16 f16 mma with f32 sums. A rows 0-7 hold the
// group's queries rounded to f16, rows 8-15 their f16 remainders (q - hi: together 22
// bits of q), so a head's score is the sum of its two rows. Lane (gid, t) loads 16-byte
// chunks 4i + t of token gid's K row; word 2h / 2h + 1 of chunk i is B's b0 / b1 of
// k-step 2i + h, and the q fragments take the same dims (the k order inside an mma is
// free as long as A and B agree). Saves the f16 -> f32 conversion and GMAX FMAs per K
// element that the CUDA-core pass spends.
template <int KIND>
PKV_DEV void mma_16x8x16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if (KIND == KV_BF16) mma_bf16_16x8x16(c, a, b0, b1);
  else mma_f16_16x8x16(c, a, b0, b1);
}

// f32 -> the mma's 16-bit element (f16 or bf16 bits, round to nearest even) and back.
template <int KIND>
PKV_DEV uint32_t to_mma_bits(float v) {
  if (KIND != KV_BF16) return pkv_float_to_half_bits(v);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
#else
  return 0u;  // no bf16 mma below sm_80: never called
#endif
}
template <int KIND>
PKV_DEV float from_mma_bits(uint32_t h) {
  return KIND == KV_BF16 ? pkv_bf16_bits_to_float((uint16_t)h)
                         : pkv_half_bits_to_float((uint16_t)h);
}

#if defined(__CUDACC__) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
#define PKV_ATTN_MMA_QK 1
#else
#define PKV_ATTN_MMA_QK 0
#endif

// The A fragments of pass 1: k-step s holds dims 32(s/2) + 8t + 4(s%2) + 0..3 of the
// group's queries (times scale), rows 0-7 as 16-bit values, rows 8-15 their remainders.
template <int KIND>
PKV_DEV void q_fragments(const float* __restrict__ q_group, int group, int head_dim,
                         float scale, uint32_t (&qa)[8][4]) {
  const int lane = threadIdx.x % 32, gid = lane / 4, t = lane % 4;
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    qa[s][0] = qa[s][1] = qa[s][2] = qa[s][3] = 0u;
    if (s / 2 < head_dim / 32 && gid < group) {
      const float* qd = q_group + (int64_t)gid * head_dim + 32 * (s / 2) + 8 * t + 4 * (s % 2);
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float v = qd[e] * scale;
        hi[e] = to_mma_bits<KIND>(v);
        lo[e] = to_mma_bits<KIND>(v - from_mma_bits<KIND>(hi[e]));
      }
      qa[s][0] = hi[0] | hi[1] << 16;  // row gid, dims +0, +1 (with b0)
      qa[s][1] = lo[0] | lo[1] << 16;  // row gid + 8
      qa[s][2] = hi[2] | hi[3] << 16;  // row gid, dims +2, +3 (with b1)
      qa[s][3] = lo[2] | lo[3] << 16;
    }
  }
}

template <int KIND, int GMAX>
PKV_DEV void qk_scores_mma(const float* __restrict__ q_group, int group, int head_dim,
                           float scale, const uint8_t* __restrict__ k_pool,
                           const int64_t* rows, int64_t row_bytes, int n_tok, float* scores) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const int gid = lane / 4, t = lane % 4;
  const int n_loads = head_dim / 32;  // 16-byte chunks per lane and token, <= 4
  uint32_t qa[8][4];
  q_fragments<KIND>(q_group, group, head_dim, scale, qa);
  const int n_groups = (n_tok + 7) / 8;
  auto load = [&](uint4 (&kr)[4], int grp) {
    const int tok = 8 * grp + gid;
    const uint4* row = (const uint4*)(k_pool + rows[min(tok, n_tok - 1)] * row_bytes);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      kr[i] = i < n_loads && tok < n_tok ? row[4 * i + t] : make_uint4(0u, 0u, 0u, 0u);
  };
  uint4 cur[4], nxt[4];
  int grp = warp;
  if (grp < n_groups) load(cur, grp);
  for (; grp < n_groups; grp += n_warps) {  // uniform per warp: the mma sees a whole warp
    if (grp + n_warps < n_groups) load(nxt, grp + n_warps);
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (s / 2 < n_loads) {
        const uint4 k = cur[s / 2];
        mma_16x8x16<KIND>(c, qa[s], s % 2 ? k.z : k.x, s % 2 ? k.w : k.y);
      }
    }
    const int tok = 8 * grp + 2 * t;  // c0/c2: token 2t, rows gid / gid + 8; c1/c3: 2t + 1
    if (gid < GMAX) {
      if (tok < n_tok) scores[tok * GMAX + gid] = c[0] + c[2];
      if (tok + 1 < n_tok) scores[(tok + 1) * GMAX + gid] = c[1] + c[3];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) cur[i] = nxt[i];
  }
}

// Both passes on AMD matrix cores (CDNA: PKV_MFMA_I8's arches all have
// v_mfma_f32_16x16x16f16; bf16 needs v_mfma_f32_16x16x16bf16_1k, PKV_MFMA_BF16_1K: gfx90a,
// gfx940-942), f16 or bf16 KV, head_dim 64 or 128, GMAX <= 8, selected per kernel name
// (pkv_paged_attention_{f16,bf16}mfma_g*, PAGEDKV_ATTN_MFMA=1): compile-checked and emulated
// only (tests/test_attention_mfma_simulated.py), never run on an AMD GPU. 16x16x16 MFMAs
// with f32 sums, 16 tokens per wavefront step. Layouts (AMD matrix instruction calculator,
// CDNA2/CDNA3 v_mfma_f32_16x16x16[_]f16 and v_mfma_f32_16x16x16bf16_1k, the same for both):
// lane l, i = l % 16, q = l / 16; A element e is A[i][4q + e], B element e is B[4q + e][i],
// D register r is D[4q + r][i]; element e of a 4 x 16-bit operand is half e % 2 of word e / 2.
//
// Pass 1 (qk_scores_mfma): scores^T = Q . K^T. A row i is query head i % 8 times scale, as
// its 16-bit value (i < 8) or its remainder (i >= 8): f16 22 bits, bf16 16, as qk_scores_mma.
// K-step s takes dims 32(s/2) + 8q + 4(s%2) + 0..3 (q_fragments' order with t = q), so B
// column i, token 16 grp + i, is 4 values of that lane's 16-byte chunk s/2 of the token's
// row, chunk s/2 being row[4(s/2) + q]. Head g's score is D[g] + D[g + 8]: lanes q < 2 hold
// rows 4q + r, lanes q + 2 the remainders.
#if defined(PKV_MFMA_I8) || defined(PKV_WMMA_I8)
typedef uint32_t pkv_u32x2 __attribute__((ext_vector_type(2)));
typedef _Float16 pkv_f16x2 __attribute__((ext_vector_type(2)));

// f32 -> an AMD matrix instruction's 16-bit element, round to nearest even: f16 in hardware;
// bf16 by adding 0x7FFF plus the kept lowest bit (finite values; the attention's q and P are
// finite).
template <int KIND>
PKV_DEV uint32_t to_mfma_bits(float v) {
  if (KIND != KV_BF16) return pkv_float_to_half_bits(v);
  const uint32_t u = __float_as_uint(v);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

// Two tokens' 16-bit elements of one dim, from their words of two adjacent dims (V rows or
// code-table pairs): the low halves (upper false) or the high halves, token t0's in the low
// half of the result: an A word of the AMD pass 2s (k runs over tokens).
PKV_DEV uint32_t pair_halves(uint32_t t0, uint32_t t1, bool upper) {
  return upper ? (t0 >> 16 | (t1 & 0xFFFF0000u)) : ((t0 & 0xFFFFu) | t1 << 16);
}

// The q8 passes on AMD matrix cores take codes as f16, exactly: c ^ 0x80 under the exponent
// of 1024 is 1152 + c; subtracting 1152 (packed f16, exact) leaves c.
PKV_DEV pkv_u32x2 q8_codes_f16x4(uint32_t w) {  // bytes 0..3 of w -> elements 0..3
  const uint32_t x = w ^ 0x80808080u;
  const uint32_t b01 = (x & 0xFFu) | (x & 0xFF00u) << 8 | 0x64006400u;
  const uint32_t b23 = (x >> 16 & 0xFFu) | (x >> 8 & 0xFF0000u) | 0x64006400u;
  const pkv_f16x2 bias = {(_Float16)1152.0f, (_Float16)1152.0f};
  return pkv_u32x2{__builtin_bit_cast(uint32_t, __builtin_bit_cast(pkv_f16x2, b01) - bias),
                   __builtin_bit_cast(uint32_t, __builtin_bit_cast(pkv_f16x2, b23) - bias)};
}
#endif

#if defined(PKV_MFMA_I8)
#define PKV_ATTN_MFMA 1
typedef _Float16 pkv_f16x4 __attribute__((ext_vector_type(4)));
typedef short pkv_i16x4 __attribute__((ext_vector_type(4)));
typedef float pkv_f32x4 __attribute__((ext_vector_type(4)));

// D += A . B on 16x16x16 16-bit operands (4 elements per lane, as two words).
template <int KIND>
PKV_DEV pkv_f32x4 mfma_16x16x16(pkv_u32x2 a, pkv_u32x2 b, pkv_f32x4 c) {
  if constexpr (KIND == KV_BF16) {
#if defined(PKV_MFMA_BF16_1K)
    return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(pkv_i16x4, a),
                                                      __builtin_bit_cast(pkv_i16x4, b), c, 0, 0, 0);
#else
    __builtin_trap();  // no bf16 MFMA kernels are built without PKV_MFMA_BF16_1K
    return c;
#endif
  } else {
    return __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(pkv_f16x4, a),
                                                 __builtin_bit_cast(pkv_f16x4, b), c, 0, 0, 0);
  }
}

// Pass 1's A operands: k-step s holds dims 32(s/2) + 8q + 4(s%2) + 0..3 of query head i % 8
// (times scale), rows i < 8 as 16-bit values, rows i >= 8 their remainders.
template <int KIND>
PKV_DEV void q_fragments_mfma(const float* __restrict__ q_group, int group, int head_dim,
                              float scale, pkv_u32x2 (&qa)[8]) {
  const int lane = threadIdx.x % 64;
  const int i = lane % 16, q = lane / 16, head = i % 8;
  const int n_loads = head_dim / 32;
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    uint32_t bits[4] = {0u, 0u, 0u, 0u};
    if (s / 2 < n_loads && head < group) {
      const float* qd = q_group + (int64_t)head * head_dim + 32 * (s / 2) + 8 * q + 4 * (s % 2);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float v = qd[e] * scale;
        const uint32_t hi = to_mfma_bits<KIND>(v);
        bits[e] = i < 8 ? hi : to_mfma_bits<KIND>(v - from_mma_bits<KIND>(hi));
      }
    }
    qa[s] = pkv_u32x2{bits[0] | bits[1] << 16, bits[2] | bits[3] << 16};
  }
}

template <int KIND, int GMAX>
PKV_DEV void qk_scores_mfma(const float* __restrict__ q_group, int group, int head_dim,
                            float scale, const uint8_t* __restrict__ k_pool,
                            const int64_t* rows, int64_t row_bytes, int n_tok, float* scores) {
  const int lane = threadIdx.x % 64, wave = threadIdx.x / 64, n_waves = blockDim.x / 64;
  const int i = lane % 16, q = lane / 16;
  const int n_loads = head_dim / 32;  // 16-byte chunks per lane and token, <= 4
  pkv_u32x2 qa[8];
  q_fragments_mfma<KIND>(q_group, group, head_dim, scale, qa);
  const int n_groups = (n_tok + 15) / 16;
  auto load = [&](uint4 (&kr)[4], int grp) {
    const int tok = 16 * grp + i;
    const uint4* row = (const uint4*)(k_pool + rows[min(tok, n_tok - 1)] * row_bytes);
#pragma unroll
    for (int l = 0; l < 4; ++l)
      kr[l] = l < n_loads && tok < n_tok ? row[4 * l + q] : make_uint4(0u, 0u, 0u, 0u);
  };
  uint4 cur[4], nxt[4];
  int grp = wave;
  if (grp < n_groups) load(cur, grp);
  for (; grp < n_groups; grp += n_waves) {  // uniform per wavefront: the MFMA sees all of it
    if (grp + n_waves < n_groups) load(nxt, grp + n_waves);
    pkv_f32x4 c = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (s / 2 < n_loads) {
        const uint4 k = cur[s / 2];
        c = mfma_16x16x16<KIND>(qa[s], s % 2 ? pkv_u32x2{k.z, k.w} : pkv_u32x2{k.x, k.y}, c);
      }
    }
    const int tok = 16 * grp + i;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float rest = pkv_shfl_xor(c[r], 32);  // lane q + 2: row 4q + r + 8
      const int g = 4 * q + r;
      if (q < 2 && g < GMAX && tok < n_tok) scores[tok * GMAX + g] = c[r] + rest;
    }
#pragma unroll
    for (int l = 0; l < 4; ++l) cur[l] = nxt[l];
  }
}

// Pass 2 (pv_mfma): out^T = V^T . P^T. A is V^T: lane l reads the DPL = head_dim / 16
// consecutive dims DPL i .. DPL i + DPL - 1 (16 bytes at head_dim 128, 8 at 64: 16 lanes
// read a whole row) of tokens 16 st + 4q + e, e = 0..3, and m-tile j's row i is dim DPL i + j:
// A element e (token 4q + e) is half j % 2 of word j / 2 of token e's load, paired by masks
// as pv_mma's byte permutes. B is P^T: column i < 8 is head i's probability as its 16-bit
// value, column i + 8 its remainder (f16: 22 bits together, bf16 16, as pv_mma); zero past
// GMAX. o[j] register r is D row 4q + r, so dim DPL (4q + r) + j, column i: after the last
// step lane l adds the remainder column from lane l ^ 8, and lanes i < GMAX hold head i.
template <int KIND, int GMAX>
PKV_DEV void pv_mfma(const float* scores, const uint8_t* __restrict__ v_pool,
                     const int64_t* rows, int64_t row_bytes, int n_tok, int head_dim,
                     pkv_f32x4 (&o)[8]) {
  const int lane = threadIdx.x % 64, wave = threadIdx.x / 64, n_waves = blockDim.x / 64;
  const int i = lane % 16, q = lane / 16;
  const int n_words = head_dim / 32;  // 32-bit words (2 dims) per lane and token: 2 or 4
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = pkv_f32x4{0.0f, 0.0f, 0.0f, 0.0f};
  const int n_steps = (n_tok + 15) / 16;
  auto load = [&](uint32_t (&vr)[4][4], int st) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = 16 * st + 4 * q + e;
      const uint8_t* at = v_pool + rows[min(tok, n_tok - 1)] * row_bytes + 4 * n_words * i;
      uint4 w = make_uint4(0u, 0u, 0u, 0u);
      if (tok < n_tok && n_words == 4) {
        w = *(const uint4*)at;
      } else if (tok < n_tok) {
        const uint2 h = *(const uint2*)at;
        w.x = h.x, w.y = h.y;
      }
      vr[e][0] = w.x, vr[e][1] = w.y, vr[e][2] = w.z, vr[e][3] = w.w;
    }
  };
  const int head = i % 8;
  const bool rest = i >= 8, live = head < GMAX;
  auto p_bits = [&](int tok) {  // B element for token tok: column i of P^T
    const float p = live && tok < n_tok ? scores[tok * GMAX + (live ? head : 0)] : 0.0f;
    const uint32_t hi = to_mfma_bits<KIND>(p);
    return rest ? to_mfma_bits<KIND>(p - from_mma_bits<KIND>(hi)) : hi;
  };
  uint32_t cur[4][4], nxt[4][4];
  int st = wave;
  if (st < n_steps) load(cur, st);
  for (; st < n_steps; st += n_waves) {  // uniform per wavefront: the MFMA sees all of it
    if (st + n_waves < n_steps) load(nxt, st + n_waves);
    const int tok = 16 * st + 4 * q;
    const pkv_u32x2 b = {p_bits(tok) | p_bits(tok + 1) << 16,
                         p_bits(tok + 2) | p_bits(tok + 3) << 16};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < 2 * n_words) {
        const uint32_t w0 = cur[0][j / 2], w1 = cur[1][j / 2];
        const uint32_t w2 = cur[2][j / 2], w3 = cur[3][j / 2];
        const pkv_u32x2 a = {pair_halves(w0, w1, j % 2), pair_halves(w2, w3, j % 2)};
        o[j] = mfma_16x16x16<KIND>(a, b, o[j]);
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int w = 0; w < 4; ++w) cur[e][w] = nxt[e][w];
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) o[j][r] += pkv_shfl_xor(o[j][r], 8);
}
#else
#define PKV_ATTN_MFMA 0
#endif

// Both passes on RDNA3 matrix cores (gfx11 WMMA, wave32: PKV_WMMA_I8's arches), f16 or bf16
// KV, head_dim 64 or 128, GMAX <= 8: pkv_paged_attention_{f16,bf16}wmma_g*, opt-in
// (PAGEDKV_ATTN_WMMA=1); compiled for gfx1100 through hip/gfx11_codegen.py and emulated only
// (tests/test_attention_wmma_simulated.py), never run on an AMD GPU (q8 KV: below, after
// the MFMA q8 passes). v_wmma_f32_16x16x16_{f16,bf16}: lane l, i = l % 16, hw = l / 16
// holds all 16 k-elements of A row i and of B column i (element e is half e % 2 of word
// e / 2), lanes 16-31 the same operands as lanes 0-15; D register r is D[2r + hw][i] (the
// RDNA3 ISA's wave32 VGPR views). The 16-bit split of q and P is the MFMA passes': A or B
// rows / columns i < 8 hold head i % 8's 16-bit value, i >= 8 its remainder.
//
// Pass 1 (qk_scores_wmma): scores^T = Q . K^T, 16 tokens per wave step; k-step s is dims
// 16s .. 16s + 15, so B column i is 32 contiguous bytes of token 16 grp + i's row. Head g's
// score is D[g] + D[g + 8]: both in lane hw = g % 2, registers g / 2 and g / 2 + 4.
// Pass 2 (pv_wmma): out^T = V^T . P^T, 16 tokens per step. m-tile j's row i is dim
// DPL i + j (DPL = head_dim / 16): lane i reads DPL consecutive dims of each of the 16
// tokens (16 bytes at head_dim 128, 8 at 64), and m-tile j's A element k is half j % 2 of
// word j / 2 of token k's load. B column i is head i % 8's probability (or remainder) for
// the 16 tokens. o[j] register r is D row 2r + hw, dim DPL (2r + hw) + j; after the last
// step lane i adds the remainder column from lane i ^ 8, and lanes i < GMAX hold head i.
#if defined(PKV_WMMA_I8)
#define PKV_ATTN_WMMA 1
typedef _Float16 pkv_f16x16 __attribute__((ext_vector_type(16)));
typedef short pkv_i16x16 __attribute__((ext_vector_type(16)));
typedef float pkv_f32x8 __attribute__((ext_vector_type(8)));
typedef uint32_t pkv_u32x8 __attribute__((ext_vector_type(8)));

// D += A . B on 16x16x16 16-bit operands (16 elements per lane, as eight words).
template <int KIND>
PKV_DEV pkv_f32x8 wmma_16x16x16(pkv_u32x8 a, pkv_u32x8 b, pkv_f32x8 c) {
  if constexpr (KIND == KV_BF16)
    return __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(__builtin_bit_cast(pkv_i16x16, a),
                                                       __builtin_bit_cast(pkv_i16x16, b), c);
  else
    return __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(__builtin_bit_cast(pkv_f16x16, a),
                                                      __builtin_bit_cast(pkv_f16x16, b), c);
}

// Pass 1's A operands: k-step s holds dims 16s + 0..15 of query head i % 8 (times scale),
// rows i < 8 as 16-bit values, rows i >= 8 their remainders.
template <int KIND>
PKV_DEV void q_fragments_wmma(const float* __restrict__ q_group, int group, int head_dim,
                              float scale, pkv_u32x8 (&qa)[8]) {
  const int i = threadIdx.x % 16, head = i % 8;
  const int n_steps = head_dim / 16;  // 4 or 8
#pragma unroll
  for (int s = 0; s < 8; ++s) {
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      uint32_t bits[2] = {0u, 0u};
      if (s < n_steps && head < group) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float v = q_group[(int64_t)head * head_dim + 16 * s + 2 * w + e] * scale;
          const uint32_t hi = to_mfma_bits<KIND>(v);
          bits[e] = i < 8 ? hi : to_mfma_bits<KIND>(v - from_mma_bits<KIND>(hi));
        }
      }
      qa[s][w] = bits[0] | bits[1] << 16;
    }
  }
}

template <int KIND, int GMAX>
PKV_DEV void qk_scores_wmma(const float* __restrict__ q_group, int group, int head_dim,
                            float scale, const uint8_t* __restrict__ k_pool,
                            const int64_t* rows, int64_t row_bytes, int n_tok, float* scores) {
  const int lane = threadIdx.x % 32, wave = threadIdx.x / 32, n_waves = blockDim.x / 32;
  const int i = lane % 16, hw = lane / 16;
  const int n_steps = head_dim / 16;  // 4 or 8
  pkv_u32x8 qa[8];
  q_fragments_wmma<KIND>(q_group, group, head_dim, scale, qa);
  const int n_groups = (n_tok + 15) / 16;
  for (int grp = wave; grp < n_groups; grp += n_waves) {  // uniform per wave
    const int tok = 16 * grp + i;
    const uint4* row = (const uint4*)(k_pool + rows[min(tok, n_tok - 1)] * row_bytes);
    pkv_f32x8 c = {};
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (s < n_steps) {
        const uint4 lo = tok < n_tok ? row[2 * s] : make_uint4(0u, 0u, 0u, 0u);
        const uint4 up = tok < n_tok ? row[2 * s + 1] : make_uint4(0u, 0u, 0u, 0u);
        const pkv_u32x8 b = {lo.x, lo.y, lo.z, lo.w, up.x, up.y, up.z, up.w};
        c = wmma_16x16x16<KIND>(qa[s], b, c);
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // head g = 2r + hw: rows g (value) and g + 8 (remainder)
      const int g = 2 * r + hw;
      if (g < GMAX && tok < n_tok) scores[tok * GMAX + g] = c[r] + c[r + 4];
    }
  }
}

template <int KIND, int GMAX>
PKV_DEV void pv_wmma(const float* scores, const uint8_t* __restrict__ v_pool,
                     const int64_t* rows, int64_t row_bytes, int n_tok, int head_dim,
                     pkv_f32x8 (&o)[8]) {
  const int lane = threadIdx.x % 32, wave = threadIdx.x / 32, n_waves = blockDim.x / 32;
  const int i = lane % 16;
  const int n_words = head_dim / 32;  // 32-bit words (2 dims) per lane and token: 2 or 4
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = pkv_f32x8{};
  const int head = i % 8;
  const bool rest = i >= 8, live = head < GMAX;
  const int n_steps = (n_tok + 15) / 16;
  for (int st = wave; st < n_steps; st += n_waves) {  // uniform per wave
    uint32_t vr[16][4];  // token 16 st + k: dims DPL i .. DPL i + DPL - 1
    pkv_u32x8 b;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const int tok = 16 * st + k;
      const uint8_t* at = v_pool + rows[min(tok, n_tok - 1)] * row_bytes + 4 * n_words * i;
      uint4 w = make_uint4(0u, 0u, 0u, 0u);
      if (tok < n_tok && n_words == 4) {
        w = *(const uint4*)at;
      } else if (tok < n_tok) {
        const uint2 h = *(const uint2*)at;
        w.x = h.x, w.y = h.y;
      }
      vr[k][0] = w.x, vr[k][1] = w.y, vr[k][2] = w.z, vr[k][3] = w.w;
      const float p = live && tok < n_tok ? scores[tok * GMAX + (live ? head : 0)] : 0.0f;
      const uint32_t hi = to_mfma_bits<KIND>(p);
      const uint32_t bits = rest ? to_mfma_bits<KIND>(p - from_mma_bits<KIND>(hi)) : hi;
      if (k % 2 == 0) b[k / 2] = bits;
      else b[k / 2] |= bits << 16;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < 2 * n_words) {
        pkv_u32x8 a;
#pragma unroll
        for (int w = 0; w < 8; ++w) {  // tokens 2w, 2w + 1: half j % 2 of word j / 2
          const uint32_t t0 = vr[2 * w][j / 2], t1 = vr[2 * w + 1][j / 2];
          a[w] = pair_halves(t0, t1, j % 2);
        }
        o[j] = wmma_16x16x16<KIND>(a, b, o[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 8; ++r) o[j][r] += pkv_shfl_xor(o[j][r], 8);
}
#else
#define PKV_ATTN_WMMA 0
#endif

// Pass 2 on NVIDIA tensor cores (sm_80+, f16 KV, GMAX <= 4, head_dim 64 or 128):
// out^T = V^T . P^T as m16n8k16 f16 mma with f32 sums, 16 tokens per warp step. A is
// V^T: lane (gid, t) reads 16-byte chunks at dims 64l + 8 gid of tokens 4t .. 4t + 3
// (8 lanes read 128 contiguous bytes of a token) and pairs the same dim of two tokens
// with a byte permute: word j of chunk l gives m-tile 4l + j, rows gid (even dim) and
// gid + 8 (odd dim). B is P^T: columns 0-3 the group's probabilities rounded to f16,
// 4-7 their f16 remainders (22 bits together), added after the last step. Replaces
// the f16 -> f32 conversion and GMAX FMAs per V element by half a byte permute.
PKV_DEV uint32_t word_of(const uint4& v, int j) {  // j is a constant after unrolling
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

template <int KIND, int GMAX>
PKV_DEV void pv_mma(const float* scores, const uint8_t* __restrict__ v_pool,
                    const int64_t* rows, int64_t row_bytes, int n_tok, int head_dim,
                    float (&o)[8][4]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const int gid = lane / 4, t = lane % 4;
  const int n_chunks = head_dim / 64;  // 16-byte chunks per lane and token: 1 or 2
#pragma unroll
  for (int mt = 0; mt < 8; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
  const int n_steps = (n_tok + 15) / 16;
  auto load = [&](uint4 (&vr)[4][2], int st) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int tok = 16 * st + 4 * t + j;
      const uint4* row = (const uint4*)(v_pool + rows[min(tok, n_tok - 1)] * row_bytes);
#pragma unroll
      for (int l = 0; l < 2; ++l)
        vr[j][l] = l < n_chunks && tok < n_tok ? row[8 * l + gid] : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  // Column gid of P^T: head gid (f16) or head gid - 4 (remainder); zero past GMAX.
  const int head = gid % 4;
  const bool rest = gid >= 4, live = head < GMAX;
  auto p_pair = [&](int tok) {
    uint32_t bits = 0u;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float p = live && tok + e < n_tok ? scores[(tok + e) * GMAX + (live ? head : 0)] : 0.0f;
      const uint32_t hi = to_mma_bits<KIND>(p);
      const uint32_t h = rest ? to_mma_bits<KIND>(p - from_mma_bits<KIND>(hi)) : hi;
      bits |= (uint32_t)h << (16 * e);
    }
    return bits;
  };
  uint4 cur[4][2], nxt[4][2];
  int st = warp;
  if (st < n_steps) load(cur, st);
  for (; st < n_steps; st += n_warps) {  // uniform per warp: the mma sees a whole warp
    if (st + n_warps < n_steps) load(nxt, st + n_warps);
    const uint32_t b0 = p_pair(16 * st + 4 * t), b1 = p_pair(16 * st + 4 * t + 2);
#pragma unroll
    for (int l = 0; l < 2; ++l) {
      if (l < n_chunks) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t w0 = word_of(cur[0][l], j), w1 = word_of(cur[1][l], j);
          const uint32_t w2 = word_of(cur[2][l], j), w3 = word_of(cur[3][l], j);
          const uint32_t a[4] = {__byte_perm(w0, w1, 0x5410), __byte_perm(w0, w1, 0x7632),
                                 __byte_perm(w2, w3, 0x5410), __byte_perm(w2, w3, 0x7632)};
          mma_16x8x16<KIND>(o[4 * l + j], a, b0, b1);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) cur[j][0] = nxt[j][0], cur[j][1] = nxt[j][1];
  }
  // Columns 4-7 (remainders) live on lanes t + 2: add them to columns 0-3.
#pragma unroll
  for (int mt = 0; mt < 8; ++mt)
#pragma unroll
    for (int r = 0; r < 4; ++r) o[mt][r] += pkv_shfl_xor(o[mt][r], 2);
}

// q8 KV on the same tensor-core passes (sm_80+, head_dim 64 or 128, GMAX <= 4): the int8
// codes become f16 fragments exactly (1024 + 128 + c is an f16 with mantissa c + 128;
// subtracting 1152 leaves c), and the record's f16 scale d stays out of the f16 rounding.
// Pass 1 (qk_scores_mma_q8): k-steps 2i and 2i + 1 cover record i only (lane t holds its
// bytes 8t .. 8t + 7, the f16 pass's chunk i), so the two mmas of record i go to a zeroed
// accumulator that is scaled by each token's d_i in f32 and added. Pass 2 (pv_mma_q8):
// m-tiles 2l, 2l + 1 cover record l only (lane gid holds its bytes 4 gid .. 4 gid + 3; row
// gid of m-tile 2l + j is dim 32l + 4gid + 2j, row gid + 8 the next dim), so d_l(token)
// folds into B: P^T's column holds p_t * d_l(t) * pscale as f16 + f16 remainder (22 bits).
// pscale, a power of two, lifts the partition's largest V scale into [2^14, 2^15): the
// remainders stay f16 normals (p * d alone, with d ~ 1e-3, would leave them subnormal, a
// 2^-25 absolute floor that is 1e-5 of a term), and the output is scaled back exactly.
PKV_DEV uint32_t f16x2_sub(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  __builtin_trap();  // callers check PKV_ATTN_MMA_QK
  return a ^ b;
#endif
}

// Two floats as f16x2 (lo in the low half), each rounded to nearest even: one instruction
// (cvt.rn.f16x2.f32, sm_80+) where pkv_float_to_half_bits takes one per value and a pack.
PKV_DEV uint32_t f32x2_to_f16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (uint32_t)pkv_float_to_half_bits(lo) | (uint32_t)pkv_float_to_half_bits(hi) << 16;
#endif
}

// Code bytes with their sign bits flipped: each byte of q8_flip(w) is c + 128, unsigned.
PKV_DEV uint32_t q8_flip(uint32_t w) { return w ^ 0x80808080u; }

// Two flipped codes of x as f16x2, exactly: bytes SEL & 0xF (low half) and (SEL >> 8) & 0xF
// (high half) of x (__byte_perm's numbering), each under a byte 0x64 taken from the constant
// operand (byte 4): the f16 1024 + (c + 128), exact; one sub of 1152 leaves c. One PRMT and
// one HADD2 per two codes (and one XOR per four, q8_flip): the selector does the masking
// that two LOP3s did after a byte-extracting PRMT (SASS, sm_90: 4 instructions a pair before).
template <uint32_t SEL>
PKV_DEV uint32_t q8_codes_f16x2(uint32_t x) {
  return f16x2_sub(__byte_perm(x, 0x64646464u, SEL), 0x64806480u);
}

// Two tokens' code words interleaved and flipped: SEL 0x5140 gives bytes (a0 b0 a1 b1), 0x7362
// (a2 b2 a3 b3), so that q8_codes_f16x2 of it (selectors 0x4140, 0x4342) pairs token a's
// code with token b's (pass 2's k columns) at two instructions a pair.
template <uint32_t SEL>
PKV_DEV uint32_t q8_interleave(uint32_t a, uint32_t b) {
  return q8_flip(__byte_perm(a, b, SEL));
}

// 4 bytes as one little-endian word; ALIGNED4: the address is 4-byte aligned (else 2).
template <bool ALIGNED4>
PKV_DEV uint32_t load_word_a2(const uint8_t* p) {
  if (ALIGNED4) return *(const uint32_t*)p;
  const uint16_t* h = (const uint16_t*)p;
  return (uint32_t)h[0] | (uint32_t)h[1] << 16;
}

PKV_DEV uint32_t shfl_word(uint32_t v, int src_lane) {
#if defined(__HIPCC__)
  return __shfl(v, src_lane, PKV_WARP_SIZE);
#else
  return __shfl_sync(0xffffffffu, v, src_lane, PKV_WARP_SIZE);
#endif
}

// A q8 row is head_dim / 32 records of 34 bytes (a multiple of 4 bytes per row, so a row
// starts 4-byte aligned): record r's codes start at 34r + 2, 4-byte aligned for odd r.
template <int GMAX>
PKV_DEV void qk_scores_mma_q8(const float* __restrict__ q_group, int group, int head_dim,
                              float scale, const uint8_t* __restrict__ k_pool,
                              const int64_t* rows, int64_t row_bytes, int n_tok, float* scores) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const int gid = lane / 4, t = lane % 4;
  const int n_rec = head_dim / PKV_KVQ8_BLOCK;  // 2 or 4
  uint32_t qa[8][4];  // as qk_scores_mma: record i is k-steps 2i, 2i + 1
  q_fragments<KV_F16>(q_group, group, head_dim, scale, qa);
  struct Raw {
    uint32_t code[4][2];  // record i: codes 8t .. 8t + 3, 8t + 4 .. 8t + 7
    uint32_t d[4];        // record i's f16 scale bits (0 past the end: the score is 0)
  };
  const int n_groups = (n_tok + 7) / 8;
  auto load = [&](Raw& kr, int grp) {
    const int tok = 8 * grp + gid;
    const uint8_t* row = k_pool + rows[min(tok, n_tok - 1)] * row_bytes;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      kr.code[i][0] = kr.code[i][1] = kr.d[i] = 0u;
      if (i < n_rec && tok < n_tok) {
        const uint8_t* rec = row + i * PKV_KVQ8_RECORD_BYTES;
        kr.d[i] = *(const uint16_t*)rec;
        kr.code[i][0] = i % 2 ? load_word_a2<true>(rec + 2 + 8 * t) : load_word_a2<false>(rec + 2 + 8 * t);
        kr.code[i][1] = i % 2 ? load_word_a2<true>(rec + 6 + 8 * t) : load_word_a2<false>(rec + 6 + 8 * t);
      }
    }
  };
  Raw cur, nxt;
  int grp = warp;
  if (grp < n_groups) load(cur, grp);
  for (; grp < n_groups; grp += n_warps) {  // uniform per warp: the mma sees a whole warp
    if (grp + n_warps < n_groups) load(nxt, grp + n_warps);
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i < n_rec) {
        float r[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t x = q8_flip(cur.code[i][h]);
          mma_f16_16x8x16(r, qa[2 * i + h], q8_codes_f16x2<0x4140>(x),
                          q8_codes_f16x2<0x4342>(x));
        }
        // Column 2t / 2t + 1 is token 8 grp + 2t / + 1: its scale is on lane 8t / 8t + 4.
        const float d0 = pkv_half_bits_to_float((uint16_t)shfl_word(cur.d[i], 8 * t));
        const float d1 = pkv_half_bits_to_float((uint16_t)shfl_word(cur.d[i], 8 * t + 4));
        c[0] += d0 * r[0];
        c[1] += d1 * r[1];
        c[2] += d0 * r[2];
        c[3] += d1 * r[3];
      }
    }
    const int tok = 8 * grp + 2 * t;
    if (gid < GMAX) {
      if (tok < n_tok) scores[tok * GMAX + gid] = c[0] + c[2];
      if (tok + 1 < n_tok) scores[(tok + 1) * GMAX + gid] = c[1] + c[3];
    }
    cur = nxt;
  }
}

// q8 pass 1 on AMD matrix cores (qk_scores_mfma_q8, pkv_paged_attention_q8mfma_g*; pass 2:
// pv_mfma_q8 below): qk_scores_mfma's layout, whose k-steps 2l and 2l + 1 cover
// record l alone (dims 32l + 8q + 0..7: lane q's codes 8q .. 8q + 7 of the record, bytes
// 34l + 2 + 8q on, as qk_scores_mma_q8's lane t), so the two MFMAs of record l go to a
// zeroed accumulator that is multiplied by the record's f16 scale d_l in f32 and added, as
// on NVIDIA. D column i is token 16 grp + i, the lane's own token: it reads d_l itself. The
// codes become f16 exactly (q8_codes_f16x4).
#if PKV_ATTN_MFMA
template <int GMAX>
PKV_DEV void qk_scores_mfma_q8(const float* __restrict__ q_group, int group, int head_dim,
                               float scale, const uint8_t* __restrict__ k_pool,
                               const int64_t* rows, int64_t row_bytes, int n_tok,
                               float* scores) {
  const int lane = threadIdx.x % 64, wave = threadIdx.x / 64, n_waves = blockDim.x / 64;
  const int i = lane % 16, q = lane / 16;
  const int n_rec = head_dim / PKV_KVQ8_BLOCK;  // 2 or 4
  pkv_u32x2 qa[8];  // record l is k-steps 2l, 2l + 1
  q_fragments_mfma<KV_F16>(q_group, group, head_dim, scale, qa);
  struct Raw {
    uint32_t code[4][2];  // record l: codes 8q .. 8q + 3, 8q + 4 .. 8q + 7
    uint32_t d[4];        // record l's f16 scale bits (0 past the end: the score is 0)
  };
  const int n_groups = (n_tok + 15) / 16;
  auto load = [&](Raw& kr, int grp) {
    const int tok = 16 * grp + i;
    const uint8_t* row = k_pool + rows[min(tok, n_tok - 1)] * row_bytes;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      kr.code[l][0] = kr.code[l][1] = kr.d[l] = 0u;
      if (l < n_rec && tok < n_tok) {
        const uint8_t* rec = row + l * PKV_KVQ8_RECORD_BYTES;
        kr.d[l] = *(const uint16_t*)rec;
        kr.code[l][0] = l % 2 ? load_word_a2<true>(rec + 2 + 8 * q) : load_word_a2<false>(rec + 2 + 8 * q);
        kr.code[l][1] = l % 2 ? load_word_a2<true>(rec + 6 + 8 * q) : load_word_a2<false>(rec + 6 + 8 * q);
      }
    }
  };
  Raw cur, nxt;
  int grp = wave;
  if (grp < n_groups) load(cur, grp);
  for (; grp < n_groups; grp += n_waves) {  // uniform per wavefront: the MFMA sees all of it
    if (grp + n_waves < n_groups) load(nxt, grp + n_waves);
    pkv_f32x4 c = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      if (l < n_rec) {
        pkv_f32x4 r = {0.0f, 0.0f, 0.0f, 0.0f};
        r = mfma_16x16x16<KV_F16>(qa[2 * l], q8_codes_f16x4(cur.code[l][0]), r);
        r = mfma_16x16x16<KV_F16>(qa[2 * l + 1], q8_codes_f16x4(cur.code[l][1]), r);
        c += pkv_half_bits_to_float((uint16_t)cur.d[l]) * r;
      }
    }
    const int tok = 16 * grp + i;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float rest = pkv_shfl_xor(c[r], 32);  // lane q + 2: row 4q + r + 8
      const int g = 4 * q + r;
      if (q < 2 && g < GMAX && tok < n_tok) scores[tok * GMAX + g] = c[r] + rest;
    }
    cur = nxt;
  }
}

// q8 pass 2 on AMD matrix cores (pv_mfma_q8): out^T = V^T . P^T, as pv_mfma, but with
// record-pure m-tiles: a V element's scale d_l(t) depends on its record and its token, the
// k index, so it goes into B, which every row of an m-tile shares (as pv_mma_q8 on NVIDIA).
// m-tile 2l + h, row i is dim 32l + 2i + h: lane (i, q) reads codes 2i, 2i + 1 of record l
// (2 bytes at 34l + 2 + 2i, 2-byte aligned) and d_l of tokens 16 st + 4q + e, e = 0..3, and
// A's word is byte h of the four tokens' pairs (q8_codes_f16x4: exact f16). B's column i < 8
// is head i's p_t d_l(t) pscale as f16, column i + 8 its f16 remainder (22 bits together:
// pv_mma_q8's pd_pair; q8_pv_pscale keeps the largest below 2^15). o[2l + h]
// register r is D row 4q + r, so dim 32l + 2(4q + r) + h, column i: after the last step lane
// l adds the remainder column from lane l ^ 8, and lanes i < GMAX hold head i. The caller
// multiplies o by q8_pv_unscale.
template <int GMAX>
PKV_DEV void pv_mfma_q8(const float* scores, const uint8_t* __restrict__ v_pool,
                        const int64_t* rows, int64_t row_bytes, int n_tok, int head_dim,
                        float pscale, pkv_f32x4 (&o)[8]) {
  const int lane = threadIdx.x % 64, wave = threadIdx.x / 64, n_waves = blockDim.x / 64;
  const int i = lane % 16, q = lane / 16;
  const int n_rec = head_dim / PKV_KVQ8_BLOCK;  // 2 or 4
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = pkv_f32x4{0.0f, 0.0f, 0.0f, 0.0f};
  struct Raw {
    uint32_t code[4][4];  // [token 4q + e][record l]: codes 2i (low byte), 2i + 1
    uint32_t d[4][4];     // [token 4q + e][record l]: f16 scale bits (0 past the end)
  };
  const int n_steps = (n_tok + 15) / 16;
  auto load = [&](Raw& vr, int st) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = 16 * st + 4 * q + e;
      const uint8_t* row = v_pool + rows[min(tok, n_tok - 1)] * row_bytes;
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        vr.code[e][l] = vr.d[e][l] = 0u;
        if (l < n_rec && tok < n_tok) {
          const uint8_t* rec = row + l * PKV_KVQ8_RECORD_BYTES;
          vr.d[e][l] = *(const uint16_t*)rec;
          vr.code[e][l] = *(const uint16_t*)(rec + 2 + 2 * i);
        }
      }
    }
  };
  const int head = i % 8;
  const bool rest = i >= 8, live = head < GMAX;
  auto pd_bits = [&](float p, uint32_t d) {  // B element: p d pscale as f16, or its remainder
    const float x = p * (pkv_half_bits_to_float((uint16_t)d) * pscale);
    const uint32_t hi = to_mfma_bits<KV_F16>(x);
    return rest ? to_mfma_bits<KV_F16>(x - from_mma_bits<KV_F16>(hi)) : hi;
  };
  Raw cur, nxt;
  int st = wave;
  if (st < n_steps) load(cur, st);
  for (; st < n_steps; st += n_waves) {  // uniform per wavefront: the MFMA sees all of it
    if (st + n_waves < n_steps) load(nxt, st + n_waves);
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = 16 * st + 4 * q + e;
      p[e] = live && tok < n_tok ? scores[tok * GMAX + (live ? head : 0)] : 0.0f;
    }
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      if (l < n_rec) {
        const pkv_u32x2 b = {pd_bits(p[0], cur.d[0][l]) | pd_bits(p[1], cur.d[1][l]) << 16,
                             pd_bits(p[2], cur.d[2][l]) | pd_bits(p[3], cur.d[3][l]) << 16};
        const uint32_t c0 = cur.code[0][l], c1 = cur.code[1][l];
        const uint32_t c2 = cur.code[2][l], c3 = cur.code[3][l];
        const uint32_t lo = (c0 & 0xFFu) | (c1 & 0xFFu) << 8 | (c2 & 0xFFu) << 16 | c3 << 24;
        const uint32_t hi = c0 >> 8 | (c1 & 0xFF00u) | (c2 >> 8) << 16 | (c3 & 0xFF00u) << 16;
        o[2 * l] = mfma_16x16x16<KV_F16>(q8_codes_f16x4(lo), b, o[2 * l]);
        o[2 * l + 1] = mfma_16x16x16<KV_F16>(q8_codes_f16x4(hi), b, o[2 * l + 1]);
      }
    }
    cur = nxt;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) o[j][r] += pkv_shfl_xor(o[j][r], 8);
}
#endif

// q8 KV on RDNA3 WMMA (pkv_paged_attention_q8wmma_g*, gfx11): the f16 WMMA passes' layouts
// with the MFMA q8 passes' arithmetic. Pass 1 (qk_scores_wmma_q8): record l is k-steps 2l
// and 2l + 1 (dims 32l + 16h + 0..15: codes 16h .. 16h + 15 of the record, bytes
// 34l + 2 + 16h on, 4-byte aligned for odd l, 2 for even), made f16 exactly
// (q8_codes_f16x4); the record's two WMMAs go to a zeroed accumulator multiplied by the
// token's d_l in f32 (column i is the lane's own token) and added. Pass 2 (pv_wmma_q8):
// record-pure m-tiles, m-tile 2l + h, row i is dim 32l + 2i + h; lane i reads codes 2i,
// 2i + 1 of record l (2 bytes at 34l + 2 + 2i) and d_l of the step's 16 tokens, one
// record at a time; A's element k is byte h of token k's pair, B's column i < 8 head i's
// p d_l pscale as f16, i + 8 its f16 remainder (pv_mfma_q8's pd_bits). o[2l + h] register
// r is D row 2r + hw, dim 32l + 2(2r + hw) + h; the caller multiplies by q8_pv_unscale.
#if PKV_ATTN_WMMA
template <int GMAX>
PKV_DEV void qk_scores_wmma_q8(const float* __restrict__ q_group, int group, int head_dim,
                               float scale, const uint8_t* __restrict__ k_pool,
                               const int64_t* rows, int64_t row_bytes, int n_tok,
                               float* scores) {
  const int lane = threadIdx.x % 32, wave = threadIdx.x / 32, n_waves = blockDim.x / 32;
  const int i = lane % 16, hw = lane / 16;
  const int n_rec = head_dim / PKV_KVQ8_BLOCK;  // 2 or 4
  pkv_u32x8 qa[8];  // record l is k-steps 2l, 2l + 1
  q_fragments_wmma<KV_F16>(q_group, group, head_dim, scale, qa);
  const int n_groups = (n_tok + 15) / 16;
  for (int grp = wave; grp < n_groups; grp += n_waves) {  // uniform per wave
    const int tok = 16 * grp + i;
    const uint8_t* row = k_pool + rows[min(tok, n_tok - 1)] * row_bytes;
    pkv_f32x8 c = {};
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      if (l < n_rec && tok < n_tok) {
        const uint8_t* rec = row + l * PKV_KVQ8_RECORD_BYTES;
        pkv_f32x8 r = {};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          pkv_u32x8 b;
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const uint8_t* at = rec + 2 + 16 * h + 4 * u;
            const pkv_u32x2 f = q8_codes_f16x4(l % 2 ? load_word_a2<true>(at) : load_word_a2<false>(at));
            b[2 * u] = f.x, b[2 * u + 1] = f.y;
          }
          r = wmma_16x16x16<KV_F16>(qa[2 * l + h], b, r);
        }
        c += pkv_half_bits_to_float(*(const uint16_t*)rec) * r;
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // head g = 2r + hw: rows g (value) and g + 8 (remainder)
      const int g = 2 * r + hw;
      if (g < GMAX && tok < n_tok) scores[tok * GMAX + g] = c[r] + c[r + 4];
    }
  }
}

template <int GMAX>
PKV_DEV void pv_wmma_q8(const float* scores, const uint8_t* __restrict__ v_pool,
                        const int64_t* rows, int64_t row_bytes, int n_tok, int head_dim,
                        float pscale, pkv_f32x8 (&o)[8]) {
  const int lane = threadIdx.x % 32, wave = threadIdx.x / 32, n_waves = blockDim.x / 32;
  const int i = lane % 16;
  const int n_rec = head_dim / PKV_KVQ8_BLOCK;  // 2 or 4
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = pkv_f32x8{};
  const int head = i % 8;
  const bool rest = i >= 8, live = head < GMAX;
  const int n_steps = (n_tok + 15) / 16;
  for (int st = wave; st < n_steps; st += n_waves) {  // uniform per wave
    float p[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const int tok = 16 * st + k;
      p[k] = live && tok < n_tok ? scores[tok * GMAX + (live ? head : 0)] : 0.0f;
    }
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      if (l < n_rec) {
        uint32_t code[16];  // token 16 st + k: codes 2i (low byte), 2i + 1
        pkv_u32x8 b;
#pragma unroll
        for (int k = 0; k < 16; ++k) {
          const int tok = 16 * st + k;
          const uint8_t* rec = v_pool + rows[min(tok, n_tok - 1)] * row_bytes +
                               l * PKV_KVQ8_RECORD_BYTES;
          const uint32_t d = tok < n_tok ? *(const uint16_t*)rec : 0u;
          code[k] = tok < n_tok ? *(const uint16_t*)(rec + 2 + 2 * i) : 0u;
          const float x = p[k] * (pkv_half_bits_to_float((uint16_t)d) * pscale);
          const uint32_t hi = to_mfma_bits<KV_F16>(x);
          const uint32_t bits = rest ? to_mfma_bits<KV_F16>(x - from_mma_bits<KV_F16>(hi)) : hi;
          if (k % 2 == 0) b[k / 2] = bits;
          else b[k / 2] |= bits << 16;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          pkv_u32x8 a;
#pragma unroll
          for (int u = 0; u < 4; ++u) {  // tokens 4u .. 4u + 3: byte h of each pair
            const uint32_t c0 = code[4 * u] >> 8 * h & 0xFFu, c1 = code[4 * u + 1] >> 8 * h & 0xFFu;
            const uint32_t c2 = code[4 * u + 2] >> 8 * h & 0xFFu, c3 = code[4 * u + 3] >> 8 * h & 0xFFu;
            const pkv_u32x2 f = q8_codes_f16x4(c0 | c1 << 8 | c2 << 16 | c3 << 24);
            a[2 * u] = f.x, a[2 * u + 1] = f.y;
          }
          o[2 * l + h] = wmma_16x16x16<KV_F16>(a, b, o[2 * l + h]);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 8; ++r) o[j][r] += pkv_shfl_xor(o[j][r], 8);
}
#endif

// One V record's two m-tiles (2l, 2l + 1) of pv_mma_q8 and pv_mma_q8_staged. c0..c3: the
// words of tokens 4t .. 4t + 3 (codes 4 gid .. 4 gid + 3 of the record); m-tile 2l + j: row
// gid = byte 2j of the lane's word, row gid + 8 = byte 2j + 1; k columns 2t, 2t + 1 = tokens
// 4t, 4t + 1 (c0, c1), 2t + 8, 2t + 9 = 4t + 2, + 3 (c2, c3). b0, b1: p * d of those tokens.
// pv_record_pairs_mma_q8 takes the words interleaved (q8_interleave): lo01 of c0, c1 with
// selector 0x5140, hi01 with 0x7362, and so lo23, hi23 of c2, c3.
PKV_DEV void pv_record_pairs_mma_q8(float (&o0)[4], float (&o1)[4], uint32_t lo01,
                                    uint32_t hi01, uint32_t lo23, uint32_t hi23, uint32_t b0,
                                    uint32_t b1) {
  const uint32_t a0[4] = {q8_codes_f16x2<0x4140>(lo01), q8_codes_f16x2<0x4342>(lo01),
                          q8_codes_f16x2<0x4140>(lo23), q8_codes_f16x2<0x4342>(lo23)};
  const uint32_t a1[4] = {q8_codes_f16x2<0x4140>(hi01), q8_codes_f16x2<0x4342>(hi01),
                          q8_codes_f16x2<0x4140>(hi23), q8_codes_f16x2<0x4342>(hi23)};
  mma_f16_16x8x16(o0, a0, b0, b1);
  mma_f16_16x8x16(o1, a1, b0, b1);
}

PKV_DEV void pv_record_mma_q8(float (&o0)[4], float (&o1)[4], uint32_t c0, uint32_t c1,
                              uint32_t c2, uint32_t c3, uint32_t b0, uint32_t b1) {
  pv_record_pairs_mma_q8(o0, o1, q8_interleave<0x5140>(c0, c1), q8_interleave<0x7362>(c0, c1),
                         q8_interleave<0x5140>(c2, c3), q8_interleave<0x7362>(c2, c3), b0, b1);
}

template <int GMAX>
PKV_DEV void pv_mma_q8(const float* scores, const uint8_t* __restrict__ v_pool,
                       const int64_t* rows, int64_t row_bytes, int n_tok, int head_dim,
                       float pscale, float (&o)[8][4]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const int gid = lane / 4, t = lane % 4;
  const int n_rec = head_dim / PKV_KVQ8_BLOCK;
#pragma unroll
  for (int mt = 0; mt < 8; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
  struct Raw {
    uint32_t code[4][4];  // [token 4t + j][record l]: codes 4 gid .. 4 gid + 3
    uint32_t d[2][4];     // [token pair][record l]: f16 scales of tokens 4t + 2k, + 1
  };
  const int n_steps = (n_tok + 15) / 16;
  auto load = [&](Raw& vr, int st) {
#pragma unroll
    for (int l = 0; l < 4; ++l) vr.d[0][l] = vr.d[1][l] = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int tok = 16 * st + 4 * t + j;
      const uint8_t* row = v_pool + rows[min(tok, n_tok - 1)] * row_bytes;
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        vr.code[j][l] = 0u;
        if (l < n_rec && tok < n_tok) {
          const uint8_t* rec = row + l * PKV_KVQ8_RECORD_BYTES;
          vr.d[j / 2][l] |= (uint32_t)*(const uint16_t*)rec << (16 * (j % 2));
          vr.code[j][l] = l % 2 ? load_word_a2<true>(rec + 2 + 4 * gid)
                                : load_word_a2<false>(rec + 2 + 4 * gid);
        }
      }
    }
  };
  const int head = gid % 4;
  const bool rest = gid >= 4, live = head < GMAX;
  // B of record l: p_t * d_l(t) of tokens tok, tok + 1 (f16, or its remainder on gid >= 4).
  auto pd_pair = [&](const float (&p)[4], int k, uint32_t dpair) {
    uint32_t bits = 0u;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float x =
          p[2 * k + e] * (pkv_half_bits_to_float((uint16_t)(dpair >> (16 * e))) * pscale);
      const uint32_t hi = pkv_float_to_half_bits(x);
      const uint32_t h =
          rest ? pkv_float_to_half_bits(x - pkv_half_bits_to_float((uint16_t)hi)) : hi;
      bits |= h << (16 * e);
    }
    return bits;
  };
  Raw cur, nxt;
  int st = warp;
  if (st < n_steps) load(cur, st);
  for (; st < n_steps; st += n_warps) {  // uniform per warp: the mma sees a whole warp
    if (st + n_warps < n_steps) load(nxt, st + n_warps);
    float p[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int tok = 16 * st + 4 * t + j;
      p[j] = live && tok < n_tok ? scores[tok * GMAX + (live ? head : 0)] : 0.0f;
    }
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      if (l < n_rec) {
        const uint32_t b0 = pd_pair(p, 0, cur.d[0][l]), b1 = pd_pair(p, 1, cur.d[1][l]);
        pv_record_mma_q8(o[2 * l], o[2 * l + 1], cur.code[0][l], cur.code[1][l],
                         cur.code[2][l], cur.code[3][l], b0, b1);
      }
    }
    cur = nxt;
  }
  // Columns 4-7 (remainders) live on lanes t + 2: add them to columns 0-3.
#pragma unroll
  for (int mt = 0; mt < 8; ++mt)
#pragma unroll
    for (int r = 0; r < 4; ++r) o[mt][r] += pkv_shfl_xor(o[mt][r], 2);
}

// q8 KV on tensor cores with the rows staged in shared memory (the q8s kernels, the
// default q8 path; PAGEDKV_ATTN_Q8_STAGE=0 / q8_stage=False turns it off): the passes
// above issue per lane and token 2- and 4-byte loads at 2-byte-aligned record offsets,
// each warp-wide load touching 8 rows (lines), so they are bound by load instructions,
// not DRAM. Here each warp copies the rows of its next 16-token chunks into its own
// shared-memory buffers with cp.async of 8-byte units (head_dim 128: a row is 17 units of 8 bytes, 8-byte aligned;
// head_dim 64: 17 units of 4 bytes), lanes on consecutive units (a warp-wide copy covers
// 2 rows of contiguous bytes), PKV_ATTN_Q8_STAGES chunks per warp (STAGES - 1 in flight
// while one is read). The fragments are then built from shared memory with the lane
// mapping of qk_scores_mma_q8 / pv_mma_q8 (same bytes, same selectors); a staged row
// starts every PKV_ATTN_Q8_STAGE_PITCH_UNITS units (18: 144 bytes at head_dim 128, 2-way
// bank conflicts where the packed 136 would give 4-way in pass 1). Tokens past the
// partition are zero-filled (cp.async src-size 0): scale 0, codes 0.
// Pass 2 keeps pscale per warp and running (the largest V scale of the chunks seen so far,
// as the exponent e, from the staged scales: no pre-pass over V): when a chunk raises it,
// the f32 accumulators are multiplied by the exact power of two 2^(e_old - e_new) first.
// PKV_ATTN_Q8_STAGES (pagedkv/launch.h): the launcher stages only partitions that fill them.
#ifndef PKV_ATTN_Q8_STAGE_PITCH_UNITS
#define PKV_ATTN_Q8_STAGE_PITCH_UNITS 18
#endif
// PKV_ATTN_Q8_STAGE_TMA (sm_90; 0 ignores the launcher's maps): a chunk is staged by one
// tensor copy (cp.async.bulk.tensor.2d, the tensor-memory-access engine) of a 16-row x
// 144-byte box of the pool seen as a 2-D byte array of token slots (kv_heads x 136 bytes
// a row, 16-byte aligned when kv_heads is even): the aligned 144 bytes around each of the
// chunk's rows, the row at offset 0 or 8 of its staged 144, completing on the slot's
// mbarrier (a transaction count of the box's bytes). The launcher builds the two tensor
// maps (K, V) and passes them by value where head_dim is 128, kv_heads even, blocks a
// multiple of 16 tokens and the pools 16-byte aligned (pagedkv.kernels.kvcache); a chunk
// is then 16 consecutive slots of one block. Rows past the partition are whatever the
// block holds there: pass 1 stores no score for them and pass 2 zeroes their scales.
#ifndef PKV_ATTN_Q8_STAGE_TMA
#define PKV_ATTN_Q8_STAGE_TMA 1
#endif
// Tensor copies exist from sm_90 on: other code ignores the maps (the launcher may pass
// them to an sm_80 build running on an sm_90 device).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && PKV_ATTN_Q8_STAGE_TMA
#define PKV_Q8_TMA 1
#else
#define PKV_Q8_TMA 0
#endif
constexpr int Q8_STAGE_TOKENS = 16;
constexpr int Q8_ROW_UNITS = 17;  // 34 * head_dim / 32 bytes = 17 units of head_dim / 16 bytes
constexpr int Q8_STAGE_BYTES_MAX = Q8_STAGE_TOKENS * PKV_ATTN_Q8_STAGE_PITCH_UNITS * 8;
static_assert(PKV_ATTN_Q8_TMA_BOX_BYTES == 8 * (Q8_ROW_UNITS + 1) &&
                  PKV_ATTN_Q8_TMA_BOX_ROWS == Q8_STAGE_TOKENS,
              "a tensor-copy box is a chunk's rows in their aligned 144-byte windows");
static_assert(PKV_ATTN_Q8_STAGE_PITCH_UNITS == 18 || !PKV_ATTN_Q8_STAGE_TMA,
              "PKV_ATTN_Q8_STAGE_TMA stages 144-byte boxes: a 144-byte pitch");

// A CUtensorMap (cuda.h), passed by value (PKV_GRID_CONSTANT) to the q8s kernels.
struct alignas(64) PkvTensorMap {
  unsigned long long words[16];
};

// One pass's tensor-copy staging (map == nullptr: cp.async): the pass's map, the box's
// byte column x (the KV head's aligned window), the row's offset in it (0 or 8) and the
// first token slot of each chunk of the partition.
struct Q8Tma {
  const PkvTensorMap* map;
  int x, off;
  const int32_t* chunk_slot;
  uint32_t bars;  // the shared-window address of the pass's first buffer's mbarrier
};
static_assert(PKV_ATTN_Q8_STAGES >= 2, "PKV_ATTN_Q8_STAGES: one chunk read, one in flight");
static_assert(PKV_ATTN_Q8_STAGE_PITCH_UNITS >= Q8_ROW_UNITS, "a staged row holds a row");
// Static shared memory stays under 48 KB with the rows table and the reductions (4
// stages of 144-byte rows at 128 threads: 36 KB).
static_assert(PKV_ATTN_THREADS / 32 * PKV_ATTN_Q8_STAGES * Q8_STAGE_BYTES_MAX <= 40 * 1024,
              "PKV_ATTN_Q8_STAGES x PKV_ATTN_Q8_STAGE_PITCH_UNITS: over 40 KB of stage buffers");

// The shared-window (32-bit) address of a shared-memory pointer (PTX, not
// __cvta_generic_to_shared: NVRTC too).
PKV_DEV uint32_t smem_window(const uint8_t* smem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint64_t dst;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(dst) : "l"(smem));
  return (uint32_t)dst;
#else
  __builtin_trap();  // callers check PKV_ATTN_MMA_QK
  return 0u;
#endif
}

// One cp.async of BYTES (4 or 8) from global to the shared-window address smem_dst; valid
// false fills zeros.
template <int BYTES>
PKV_DEV void cp_async_unit(uint32_t smem_dst, const uint8_t* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;"
               :: "r"(smem_dst), "l"(src), "n"(BYTES), "r"(valid ? BYTES : 0) : "memory");
#else
  __builtin_trap();  // callers check PKV_ATTN_MMA_QK
#endif
}
PKV_DEV void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int PENDING>
PKV_DEV void cp_async_wait() {  // at most PENDING of this thread's groups still in flight
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory");
#endif
}
PKV_DEV void warp_sync() {
#if defined(__CUDA_ARCH__)
  __syncwarp();
#endif
}

// The tensor copies' mbarriers (shared-window addresses) and the copy itself (sm_90).
PKV_DEV void mbar_init(uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
#endif
}
PKV_DEV void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
PKV_DEV void mbar_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                 " selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
#endif
}
// One lane: arrive on bar expecting the box's bytes, then copy the box at (x, y) of map.
PKV_DEV void tma_box_copy(uint32_t dst, const PkvTensorMap* map, int x, int y, uint32_t bar,
                          uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3}], [%4];"
               :: "r"(dst), "l"((uint64_t)map), "r"(x), "r"(y), "r"(bar) : "memory");
#endif
}

// Chunk c (tokens 16c .. 16c + 15 of the partition) of a pool into one stage buffer:
// staged row j at buf + j * PITCH_UNITS * unit bytes, unit = row_bytes / 17. Lane copies
// units u = lane + 32 i of the chunk (row j = u / 17, unit k = u % 17: one warp-wide copy
// spans ~2 rows of contiguous bytes).
template <int UNIT>
PKV_DEV void q8_stage_units(uint32_t dst, const uint8_t* __restrict__ pool, const int64_t* rows,
                            int64_t row_bytes, int c, int n_tok) {
  const int lane = threadIdx.x % 32;
  const int last = n_tok - 1 - Q8_STAGE_TOKENS * c;  // rows past it: zero-filled
  const int64_t* chunk_rows = rows + Q8_STAGE_TOKENS * c;
#pragma unroll  // all 9 copies, no loop (g4: no spills; g1 on sm_90, g1/g2 on sm_80: 4 bytes)
  for (int i = 0; i < (Q8_STAGE_TOKENS * Q8_ROW_UNITS + 31) / 32; ++i) {
    const int u = lane + 32 * i;
    if (u < Q8_STAGE_TOKENS * Q8_ROW_UNITS) {
      const int j = u / Q8_ROW_UNITS, k = u - j * Q8_ROW_UNITS;
      const bool ok = j <= last;
      const uint8_t* row = pool + chunk_rows[ok ? j : last] * row_bytes;
      // j * PITCH + k = u + j * (PITCH - 17)
      cp_async_unit<UNIT>(dst + UNIT * (u + j * (PKV_ATTN_Q8_STAGE_PITCH_UNITS - Q8_ROW_UNITS)),
                          row + UNIT * k, ok);
    }
  }
}

// q8_stage_units' layout by byte loads and shared stores, for a pool that starts off its
// unit's alignment (cp.async would fault): MLX's launcher cannot see an array's address (a
// uint8 view at an odd byte offset reaches the kernel as it is); the ctypes launcher can,
// and runs the unstaged kernel there instead. Slow, the same bytes; not inlined (one copy
// of this cold code, not one per staging site in a kernel whose size already costs fetches).
__device__ static __noinline__ void q8_stage_bytes(uint8_t* buf, const uint8_t* __restrict__ pool,
                                                   const int64_t* rows, int row_bytes, int c,
                                                   int n_tok) {
  const int last = n_tok - 1 - Q8_STAGE_TOKENS * c;
  const int64_t* chunk_rows = rows + Q8_STAGE_TOKENS * c;
  const int pitch = row_bytes / Q8_ROW_UNITS * PKV_ATTN_Q8_STAGE_PITCH_UNITS;
  for (int i = threadIdx.x % 32; i < Q8_STAGE_TOKENS * row_bytes; i += 32) {
    const int j = i / row_bytes, b = i - j * row_bytes;
    buf[j * pitch + b] = j <= last ? pool[chunk_rows[j] * row_bytes + b] : (uint8_t)0;
  }
}

PKV_DEV void q8_stage_chunk(uint8_t* buf, const uint8_t* __restrict__ pool, const int64_t* rows,
                            int64_t row_bytes, int c, int n_tok) {
  const uint32_t dst = smem_window(buf);  // one conversion per chunk, 32-bit offsets below
  const bool unit8 = row_bytes == 8 * Q8_ROW_UNITS;  // head_dim 128: 8-byte units (64: 4)
  if (((uint64_t)pool & (unit8 ? 7u : 3u)) != 0)
    q8_stage_bytes(buf, pool, rows, (int)row_bytes, c, n_tok);
  else if (unit8)
    q8_stage_units<8>(dst, pool, rows, row_bytes, c, n_tok);
  else
    q8_stage_units<4>(dst, pool, rows, row_bytes, c, n_tok);
}

// Chunk c by one tensor copy into buffer slot (lane 0; Q8Tma).
PKV_DEV void q8_stage_chunk_tma(uint8_t* stage, int slot, const Q8Tma& tma, int c) {
  if (threadIdx.x % 32 == 0)
    tma_box_copy(smem_window(stage + slot * Q8_STAGE_BYTES_MAX), tma.map, tma.x,
                 tma.chunk_slot[c], tma.bars + 8u * slot,
                 PKV_ATTN_Q8_TMA_BOX_ROWS * PKV_ATTN_Q8_TMA_BOX_BYTES);
}

// The warp's first STAGES - 1 chunks c = warp, warp + n_warps, ... into its buffers 0 ..
// STAGES - 2, one commit group each (empty past the end: the wait counts stay uniform).
PKV_DEV void q8_stage_prologue(uint8_t* stage, const uint8_t* __restrict__ pool,
                               const int64_t* rows, int64_t row_bytes, int n_tok,
                               const Q8Tma& tma) {
  const int warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const int n_chunks = (n_tok + Q8_STAGE_TOKENS - 1) / Q8_STAGE_TOKENS;
#pragma unroll
  for (int s = 0; s < PKV_ATTN_Q8_STAGES - 1; ++s) {
    const int c = warp + s * n_warps;
    if (c < n_chunks) {
      if (PKV_Q8_TMA && tma.map != nullptr)
        q8_stage_chunk_tma(stage, s, tma, c);
      else
        q8_stage_chunk(stage + s * Q8_STAGE_BYTES_MAX, pool, rows, row_bytes, c, n_tok);
    }
    cp_async_commit();
  }
}

// q8_staged_chunks over tensor copies: a chunk has landed when its slot's mbarrier
// completes the phase of that use (a loop of its own, so the cp.async loop carries none of
// it); buffers hold each row at tma.off.
template <typename Body>
PKV_DEV void q8_staged_chunks_tma(uint8_t* stage, const Q8Tma& tma, int n_tok, Body body) {
  const int warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const int n_chunks = (n_tok + Q8_STAGE_TOKENS - 1) / Q8_STAGE_TOKENS;
  int slot = 0;
  uint32_t parity = 0u;  // bit s: the phase slot s completes next
  for (int c = warp; c < n_chunks; c += n_warps) {  // uniform per warp
    const int ahead = c + (PKV_ATTN_Q8_STAGES - 1) * n_warps;
    const int ahead_slot = slot == 0 ? PKV_ATTN_Q8_STAGES - 1 : slot - 1;
    warp_sync();  // every lane is done reading ahead_slot (the previous chunk's buffer)
    if (ahead < n_chunks) q8_stage_chunk_tma(stage, ahead_slot, tma, ahead);
    mbar_wait(tma.bars + 8u * slot, (parity >> slot) & 1u);
    parity ^= 1u << slot;
    body((const uint8_t*)(stage + slot * Q8_STAGE_BYTES_MAX + tma.off), c);
    slot = slot == PKV_ATTN_Q8_STAGES - 1 ? 0 : slot + 1;
  }
  warp_sync();  // the buffers are free for the next pass
}

// The warp's chunks through its STAGES buffers: after the prologue (issued here, or by the
// caller when PROLOGUE_ISSUED: pass 2's first V chunks load during the softmax), per chunk
// issue the one STAGES - 1 ahead and wait for this one; body(buf, c) reads the chunk from
// shared memory.
template <bool PROLOGUE_ISSUED, typename Body>
PKV_DEV void q8_staged_chunks(uint8_t* stage, const uint8_t* __restrict__ pool,
                              const int64_t* rows, int64_t row_bytes, int n_tok,
                              const Q8Tma& tma, Body body) {
  const int warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const int n_chunks = (n_tok + Q8_STAGE_TOKENS - 1) / Q8_STAGE_TOKENS;
  if (!PROLOGUE_ISSUED) q8_stage_prologue(stage, pool, rows, row_bytes, n_tok, tma);
  if (PKV_Q8_TMA && tma.map != nullptr) {
    q8_staged_chunks_tma(stage, tma, n_tok, body);
    return;
  }
  int slot = 0;
  for (int c = warp; c < n_chunks; c += n_warps) {  // uniform per warp
    const int ahead = c + (PKV_ATTN_Q8_STAGES - 1) * n_warps;
    const int ahead_slot = slot == 0 ? PKV_ATTN_Q8_STAGES - 1 : slot - 1;
    warp_sync();  // every lane is done reading ahead_slot (the previous chunk's buffer)
    if (ahead < n_chunks)
      q8_stage_chunk(stage + ahead_slot * Q8_STAGE_BYTES_MAX, pool, rows, row_bytes, ahead, n_tok);
    cp_async_commit();
    cp_async_wait<PKV_ATTN_Q8_STAGES - 1>();  // this lane's copies of chunk c have landed
    warp_sync();                              // and every lane's
    body((const uint8_t*)(stage + slot * Q8_STAGE_BYTES_MAX), c);
    slot = slot == PKV_ATTN_Q8_STAGES - 1 ? 0 : slot + 1;
  }
  cp_async_wait<0>();
  warp_sync();  // the buffers are free for the next pass
}

PKV_DEV uint32_t smem_u16(const uint8_t* p) { return *(const uint16_t*)p; }

// The larger of each 16-bit half of a and b, unsigned: one max.u16x2 on sm_90.
PKV_DEV uint32_t u16x2_max(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return max(a & 0xFFFFu, b & 0xFFFFu) | max(a >> 16, b >> 16) << 16;
#endif
}

template <int GMAX>
PKV_DEV void qk_scores_mma_q8_staged(const float* __restrict__ q_group, int group, int head_dim,
                                     float scale, const uint8_t* __restrict__ k_pool,
                                     const int64_t* rows, int64_t row_bytes, int n_tok,
                                     float* scores, uint8_t* stage, const Q8Tma& tma) {
  const int lane = threadIdx.x % 32;
  const int gid = lane / 4, t = lane % 4;
  const int n_rec = head_dim / PKV_KVQ8_BLOCK;  // 2 or 4
  const int pitch = PKV_ATTN_Q8_STAGE_PITCH_UNITS * (int)(row_bytes / Q8_ROW_UNITS);
  uint32_t qa[8][4];  // as qk_scores_mma_q8: record i is k-steps 2i, 2i + 1
  q_fragments<KV_F16>(q_group, group, head_dim, scale, qa);
  q8_staged_chunks<false>(stage, k_pool, rows, row_bytes, n_tok, tma, [&](const uint8_t* buf, int c) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the chunk's two 8-token mma groups
      const uint8_t* row = buf + (8 * h + gid) * pitch;  // token 8h + gid: B's column gid
      const uint8_t* row0 = buf + (8 * h + 2 * t) * pitch;  // tokens of C's columns 2t, 2t + 1
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (i < n_rec) {
          const uint8_t* rec = row + i * PKV_KVQ8_RECORD_BYTES;
          const uint32_t w0 = i % 2 ? load_word_a2<true>(rec + 2 + 8 * t)
                                    : load_word_a2<false>(rec + 2 + 8 * t);
          const uint32_t w1 = i % 2 ? load_word_a2<true>(rec + 6 + 8 * t)
                                    : load_word_a2<false>(rec + 6 + 8 * t);
          const uint32_t x0 = q8_flip(w0), x1 = q8_flip(w1);
          float r[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          mma_f16_16x8x16(r, qa[2 * i], q8_codes_f16x2<0x4140>(x0),
                          q8_codes_f16x2<0x4342>(x0));
          mma_f16_16x8x16(r, qa[2 * i + 1], q8_codes_f16x2<0x4140>(x1),
                          q8_codes_f16x2<0x4342>(x1));
          const float d0 = pkv_half_bits_to_float(
              (uint16_t)smem_u16(row0 + i * PKV_KVQ8_RECORD_BYTES));
          const float d1 = pkv_half_bits_to_float(
              (uint16_t)smem_u16(row0 + pitch + i * PKV_KVQ8_RECORD_BYTES));
          acc[0] += d0 * r[0];
          acc[1] += d1 * r[1];
          acc[2] += d0 * r[2];
          acc[3] += d1 * r[3];
        }
      }
      const int tok = Q8_STAGE_TOKENS * c + 8 * h + 2 * t;
      if (gid < GMAX) {
        if (tok < n_tok) scores[tok * GMAX + gid] = acc[0] + acc[2];
        if (tok + 1 < n_tok) scores[(tok + 1) * GMAX + gid] = acc[1] + acc[3];
      }
    }
  });
}

// Pass 2 from staged rows; o leaves scaled back (times 2^(e - 141) of the warp's final e).
// The caller has issued q8_stage_prologue over v_pool (during the softmax).
template <int GMAX>
PKV_DEV void pv_mma_q8_staged(const float* scores, const uint8_t* __restrict__ v_pool,
                              const int64_t* rows, int64_t row_bytes, int n_tok, int head_dim,
                              uint8_t* stage, const Q8Tma& tma, float (&o)[8][4]) {
  const int lane = threadIdx.x % 32;
  const int gid = lane / 4, t = lane % 4;
  const int n_rec = head_dim / PKV_KVQ8_BLOCK;
  const int pitch = PKV_ATTN_Q8_STAGE_PITCH_UNITS * (int)(row_bytes / Q8_ROW_UNITS);
#pragma unroll
  for (int mt = 0; mt < 8; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
  const int head = gid % 4;
  const bool rest = gid >= 4, live = head < GMAX;
  int e = 103;  // the running largest V scale's f32 exponent (103: the smallest f16 subnormal)
  q8_staged_chunks<true>(stage, v_pool, rows, row_bytes, n_tok, tma, [&](const uint8_t* buf, int c) {
    // Scales first (the chunk's pscale needs all of them); a record's codes are read from
    // shared memory just before its mmas, which keeps 12 fewer registers live (sm_80 spilled).
    uint32_t d[2][4];  // [token pair k][record l]: tokens 4t + 2k / + 1 as low / high half
    // A tensor copy stages rows past the partition as the block holds them: their scales
    // read as 0 (one mask per token pair; the cp.async copies zero-fill such rows).
    const bool tma_rows = PKV_Q8_TMA && tma.map != nullptr;
    uint32_t keep[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int tok = Q8_STAGE_TOKENS * c + 4 * t + 2 * k;
      keep[k] = !tma_rows ? ~0u : (tok < n_tok ? 0xFFFFu : 0u) | (tok + 1 < n_tok ? 0xFFFF0000u : 0u);
    }
    uint32_t dm = 0u;  // the largest |scale| bits of the lane's tokens (a u16 pair on sm_90)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        d[k][l] = 0u;
        if (l < n_rec) {
          const uint8_t* s0 = buf + (4 * t + 2 * k) * pitch + l * PKV_KVQ8_RECORD_BYTES;
          d[k][l] = (smem_u16(s0) | smem_u16(s0 + pitch) << 16) & keep[k];
          dm = u16x2_max(dm, d[k][l] & 0x7FFF7FFFu);  // f16 magnitudes order as their bits
        }
      }
    }
    dm = max(dm & 0xFFFFu, dm >> 16);
    // Lanes t cover the chunk's 16 tokens (every gid holds the same scales).
    dm = max(dm, shfl_word(dm, lane ^ 1));
    dm = max(dm, shfl_word(dm, lane ^ 2));
    const int ec = max((int)((__float_as_uint(pkv_half_bits_to_float((uint16_t)dm)) >> 23) & 0xFF), 103);
    if (ec > e) {  // warp-uniform: rescale what is accumulated to the new pscale, exactly
      const float down = __uint_as_float((uint32_t)(127 + e - ec) << 23);
#pragma unroll
      for (int mt = 0; mt < 8; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) o[mt][r] *= down;
      e = ec;
    }
    // pscale = 2^(141 - e): the largest scale so far times pscale is in [2^14, 2^15).
    const float pscale = __uint_as_float((uint32_t)(268 - e) << 23);
    // p * pscale once per token, then times each record's d: the bits of p * (d * pscale).
    // pscale is a power of two in [2^-1, 2^38] (e <= 142: an f16 scale is below 2^16), so
    // p * pscale is exact but where p < 2^-125 and pscale = 1/2, and there both products are
    // below 2^-110, which the f16 hi and remainder below make 0 alike.
    float pp[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int tok = Q8_STAGE_TOKENS * c + 4 * t + j;
      pp[j] = (live && tok < n_tok ? scores[tok * GMAX + (live ? head : 0)] : 0.0f) * pscale;
    }
    auto pd_pair = [&](int k, int l) {  // B of record l: tokens 4t + 2k, + 1 (low, high half)
      const float v0 = pp[2 * k] * pkv_half_bits_to_float((uint16_t)d[k][l]);
      const float v1 = pp[2 * k + 1] * pkv_half_bits_to_float((uint16_t)(d[k][l] >> 16));
      const uint32_t hi = f32x2_to_f16x2(v0, v1);
      if (!rest) return hi;
      return f32x2_to_f16x2(v0 - pkv_half_bits_to_float((uint16_t)hi),
                            v1 - pkv_half_bits_to_float((uint16_t)(hi >> 16)));
    };
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      if (l < n_rec) {
        // tokens 4t + j: codes 4 gid .. 4 gid + 3 of record l, as the interleaved pairs
        // (4t, 4t + 1) and (4t + 2, 4t + 3) of pv_record_mma_q8; an even record's codes
        // start 2-byte aligned, so they are read as halves and interleaved from those
        const uint8_t* rec = buf + 4 * t * pitch + l * PKV_KVQ8_RECORD_BYTES + 2 + 4 * gid;
        const uint32_t b0 = pd_pair(0, l), b1 = pd_pair(1, l);
        if (l % 2) {
          pv_record_mma_q8(o[2 * l], o[2 * l + 1], load_word_a2<true>(rec),
                           load_word_a2<true>(rec + pitch), load_word_a2<true>(rec + 2 * pitch),
                           load_word_a2<true>(rec + 3 * pitch), b0, b1);
        } else {
          pv_record_pairs_mma_q8(
              o[2 * l], o[2 * l + 1],
              q8_interleave<0x5140>(smem_u16(rec), smem_u16(rec + pitch)),
              q8_interleave<0x5140>(smem_u16(rec + 2), smem_u16(rec + pitch + 2)),
              q8_interleave<0x5140>(smem_u16(rec + 2 * pitch), smem_u16(rec + 3 * pitch)),
              q8_interleave<0x5140>(smem_u16(rec + 2 * pitch + 2), smem_u16(rec + 3 * pitch + 2)),
              b0, b1);
        }
      }
    }
  });
  const float unscale = __uint_as_float((uint32_t)(e - 14) << 23);  // 2^(e - 141)
#pragma unroll
  for (int mt = 0; mt < 8; ++mt)
#pragma unroll
    for (int r = 0; r < 4; ++r) o[mt][r] = (o[mt][r] + pkv_shfl_xor(o[mt][r], 2)) * unscale;
}

// Pass 1 of the q8i kernels on integer tensor cores (mma m16n8k32 s8, mma_s8.h): the K codes
// meet q as exact integers, so no code is converted. Per CTA, each record i (dims 32i ..
// 32i + 31) of each query head g (times scale) is quantized once to 22-bit integers with the
// power-of-two step 2^(e - 22) of its largest |q| (< 2^e) and split into three signed byte
// planes (s8_planes22); A row gid is plane gid / 4 of head gid % 4, row gid + 8 plane 2 of
// head gid (gid < 4; rows 12-15 zero). k 4t + j is dim 8t + j of the record, k 16 + 4t + j
// dim 8t + 4 + j: B's b0 / b1 are then the staged words at codes 8t and 8t + 4 of token
// gid's record i, read as they are (the f16 pass's bytes). One mma per record and 8 tokens
// gives exact int32 plane sums (|sum| < 2^19); each is converted once and accumulated in f32
// times d_i(token) * step_i(g); a head's score is plane 0 + 256 plane 1 + 65536 plane 2,
// plane 1 coming from lane + 16 (gid + 4).
PKV_DEV void q_fragments_s8(const float* __restrict__ q_group, int group, int head_dim,
                            float scale, uint32_t (&qa)[4][4], float (&qstep)[4]) {
  const int lane = threadIdx.x % 32, gid = lane / 4, t = lane % 4;
  const int head = gid % 4;
  const bool live = head < group;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    qa[i][0] = qa[i][1] = qa[i][2] = qa[i][3] = 0u;
    qstep[i] = 0.0f;
    if (i < head_dim / PKV_KVQ8_BLOCK) {  // uniform: every lane reaches the shuffles
      float v[8];
      float amax = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        v[e] = live ? q_group[(int64_t)head * head_dim + 32 * i + 8 * t + e] * scale : 0.0f;
        amax = absmax_keep_nan(amax, v[e]);
      }
      if (amax != amax) amax = INFINITY;  // the shuffles' fmaxf would drop NaN: keep it as inf
      amax = fmaxf(amax, pkv_shfl_xor(amax, 1));  // lanes t hold the record's 32 dims
      amax = fmaxf(amax, pkv_shfl_xor(amax, 2));
      int ex = 0;
      frexpf(amax, &ex);  // amax < 2^ex
      ex = max(ex, -104);  // step and 1 / step stay normal floats
      const bool finite = amax <= 3.4e38f;
      const float inv_step = finite ? ldexpf(1.0f, 22 - ex) : 0.0f;
      qstep[i] = finite ? ldexpf(1.0f, ex - 22) : __int_as_float(0x7FC00000);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        int p0, p1, p2;
        s8_planes22(v[e], inv_step, p0, p1, p2);
        const int reg = e < 4 ? 0 : 2, shift = 8 * (e % 4);
        qa[i][reg] |= (uint32_t)((gid < 4 ? p0 : p1) & 0xFF) << shift;  // row gid
        qa[i][reg + 1] |= (uint32_t)((gid < 4 ? p2 : 0) & 0xFF) << shift;  // row gid + 8
      }
    }
  }
}

template <int GMAX>
PKV_DEV void qk_scores_imma_q8_staged(const float* __restrict__ q_group, int group,
                                      int head_dim, float scale,
                                      const uint8_t* __restrict__ k_pool, const int64_t* rows,
                                      int64_t row_bytes, int n_tok, float* scores,
                                      uint8_t* stage, const Q8Tma& tma) {
  const int lane = threadIdx.x % 32;
  const int gid = lane / 4, t = lane % 4;
  const int n_rec = head_dim / PKV_KVQ8_BLOCK;  // 2 or 4
  const int pitch = PKV_ATTN_Q8_STAGE_PITCH_UNITS * (int)(row_bytes / Q8_ROW_UNITS);
  uint32_t qa[4][4];
  float qstep[4];
  q_fragments_s8(q_group, group, head_dim, scale, qa, qstep);
  q8_staged_chunks<false>(stage, k_pool, rows, row_bytes, n_tok, tma, [&](const uint8_t* buf, int c) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the chunk's two 8-token mma groups
      const uint8_t* row = buf + (8 * h + gid) * pitch;  // token 8h + gid: B's column gid
      const uint8_t* row0 = buf + (8 * h + 2 * t) * pitch;  // tokens of C's columns 2t, 2t + 1
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // rows gid, gid + 8 (planes) x tokens 2t, 2t + 1
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (i < n_rec) {
          const uint8_t* rec = row + i * PKV_KVQ8_RECORD_BYTES;
          const uint32_t w0 = i % 2 ? load_word_a2<true>(rec + 2 + 8 * t)
                                    : load_word_a2<false>(rec + 2 + 8 * t);
          const uint32_t w1 = i % 2 ? load_word_a2<true>(rec + 6 + 8 * t)
                                    : load_word_a2<false>(rec + 6 + 8 * t);
          int r[4] = {0, 0, 0, 0};
          mma_s8_16x8x32(r, qa[i][0], qa[i][1], qa[i][2], qa[i][3], w0, w1);
          const float d0 = qstep[i] * pkv_half_bits_to_float(
              (uint16_t)smem_u16(row0 + i * PKV_KVQ8_RECORD_BYTES));
          const float d1 = qstep[i] * pkv_half_bits_to_float(
              (uint16_t)smem_u16(row0 + pitch + i * PKV_KVQ8_RECORD_BYTES));
          acc[0] += d0 * (float)r[0];
          acc[1] += d1 * (float)r[1];
          acc[2] += d0 * (float)r[2];
          acc[3] += d1 * (float)r[3];
        }
      }
      // Lane gid < 4: planes 0 (acc 0, 1) and 2 (acc 2, 3) of head gid; plane 1 is row
      // gid + 4's, on lane + 16.
      const float up0 = pkv_shfl_xor(acc[0], 16), up1 = pkv_shfl_xor(acc[1], 16);
      const int tok = Q8_STAGE_TOKENS * c + 8 * h + 2 * t;
      if (gid < GMAX) {
        if (tok < n_tok) scores[tok * GMAX + gid] = acc[0] + (256.0f * up0 + 65536.0f * acc[2]);
        if (tok + 1 < n_tok)
          scores[(tok + 1) * GMAX + gid] = acc[1] + (256.0f * up1 + 65536.0f * acc[3]);
      }
    }
  });
}

// The scale of p d in the q8 matrix-unit passes 2 (pv_mma_q8, pv_mfma_q8), from the largest
// V record scale of the partition (each warp's in vscale_max): vm < 2^(e - 126), so
// pscale = 2^(141 - e) puts vm * pscale in [2^14, 2^15), where p d pscale (p <= 1) keeps
// f16's 11 bits; e >= 103 (the smallest f16 subnormal) keeps both powers finite for an
// all-zero V. The pass's sums times q8_pv_unscale(e) = 1 / pscale are the output.
PKV_DEV int q8_pv_exponent(const float* vscale_max, int n_warps) {
  float vm = vscale_max[0];
  for (int w = 1; w < n_warps; ++w) vm = fmaxf(vm, vscale_max[w]);
  return max((int)((__float_as_uint(vm) >> 23) & 0xFF), 103);
}
PKV_DEV float q8_pv_pscale(int e) { return __uint_as_float((uint32_t)(268 - e) << 23); }
PKV_DEV float q8_pv_unscale(int e) { return __uint_as_float((uint32_t)(e - 14) << 23); }

// MFMA: both passes on AMD matrix cores: CDNA MFMA (qk_scores_mfma and pv_mfma; q8:
// qk_scores_mfma_q8 and pv_mfma_q8) or, on gfx11, WMMA (qk_scores_wmma and pv_wmma; q8:
// qk_scores_wmma_q8 and pv_wmma_q8).
// STAGE: q8 on tensor cores from staged rows (qk_scores_mma_q8_staged, pv_mma_q8_staged);
// with QK_S8 pass 1 on integer tensor cores (qk_scores_imma_q8_staged, the q8i kernels).
template <int KIND, int GMAX, bool MMA, bool MFMA = false, bool STAGE = false,
          bool QK_S8 = false>
PKV_DEV void paged_attention_partition(
    const float* __restrict__ q, const uint8_t* __restrict__ k_pool,
    const uint8_t* __restrict__ v_pool, const int32_t* __restrict__ block_tables,
    const int32_t* __restrict__ seq_lens, float* __restrict__ part_out,
    float* __restrict__ part_max, float* __restrict__ part_sum, float scale, int num_heads,
    int kv_heads, int head_dim, int block_size, int table_width, int max_partitions, int part_tokens,
    const PkvTensorMap* k_map = nullptr, const PkvTensorMap* v_map = nullptr) {
  extern __shared__ float smem[];  // scores[PARTITION][GMAX], later the cross-warp sums
  constexpr int PARTITION = PKV_ATTN_OF_KIND(PKV_ATTN_PARTITION, KIND);
  __shared__ int64_t rows[PARTITION];  // row index (slot * kv_heads + kvh) per token
  __shared__ float red[PKV_ATTN_THREADS / PKV_WARP_SIZE][GMAX];
  constexpr bool Q8_STAGED = MMA && KIND == KV_Q8 && STAGE;  // pv_mma_q8_staged: no pre-pass
  constexpr bool Q8_MMA = MMA && KIND == KV_Q8 && !STAGE;
  constexpr bool MFMA_PV = MFMA;  // pv_mfma (f16, bf16), pv_mfma_q8
  constexpr bool Q8_VMAX = Q8_MMA || (MFMA && KIND == KV_Q8);  // q8_pv_exponent's input
  __shared__ float vscale_max[Q8_VMAX ? PKV_ATTN_THREADS / PKV_WARP_SIZE : 1];
  // q8s: each warp's PKV_ATTN_Q8_STAGES chunk buffers (both passes, one after the other)
  // (128-byte aligned: a tensor copy's destination)
  __shared__ __align__(128) uint8_t q8_stage[Q8_STAGED ? PKV_ATTN_THREADS / PKV_WARP_SIZE *
                                                         PKV_ATTN_Q8_STAGES * Q8_STAGE_BYTES_MAX : 16];
  // q8s with tensor copies: each warp's mbarriers (K's buffers, then V's) and each chunk's
  // first token slot
  constexpr bool Q8_TMA = Q8_STAGED && PKV_Q8_TMA;
  __shared__ uint64_t q8_bars[Q8_TMA ? PKV_ATTN_THREADS / PKV_WARP_SIZE * 2 * PKV_ATTN_Q8_STAGES : 1];
  __shared__ int32_t chunk_slot[Q8_TMA ? PARTITION / Q8_STAGE_TOKENS : 1];

  const int part = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
  const int group = num_heads / kv_heads;
  const int seq_len = seq_lens[seq];
  // The launch's tokens per partition (PagedAttention splits short contexts finer so a
  // small batch still fills the GPU); PARTITION, the most, sizes the shared arrays.
  const int part_len = part_tokens > 0 && part_tokens < PARTITION ? part_tokens : PARTITION;
  const int start = part * part_len;
  if (start >= seq_len) return;  // the reduce reads only partitions below seq_len
  const int n_tok = min(part_len, seq_len - start);

  const int lane = threadIdx.x % PKV_WARP_SIZE, warp = threadIdx.x / PKV_WARP_SIZE;
  const int n_warps = PKV_ATTN_THREADS / PKV_WARP_SIZE;
  const int lanes_per_token = head_dim / 8;
  const int tokens_per_warp = PKV_WARP_SIZE / lanes_per_token;
  const int d0 = (lane % lanes_per_token) * 8;
  const int sub = lane / lanes_per_token;
  const int stride = n_warps * tokens_per_warp;
  const int64_t row_bytes = KIND == KV_Q8 ? (int64_t)pkv_kvq8_row_bytes(head_dim) : 2 * head_dim;
  // Tensor copies where the launcher gave maps and each chunk is 16 slots of one block.
  const bool q8_tma = Q8_TMA && k_map != nullptr && v_map != nullptr && head_dim == 128 &&
                      block_size % Q8_STAGE_TOKENS == 0 && part_len % Q8_STAGE_TOKENS == 0;

  // Token -> row once per partition, so the two passes do no division per token. q8 on
  // matrix units: also the largest V record scale (q8_pv_exponent; the 2-byte reads bring in
  // sectors that pass 2 reads again from L2).
  float vmax = 0.0f;
  for (int t = threadIdx.x; t < n_tok; t += PKV_ATTN_THREADS) {
    const int pos = start + t;
    const int64_t block = block_tables[(int64_t)seq * table_width + pos / block_size];
    rows[t] = (block * block_size + pos % block_size) * kv_heads + kvh;
    if constexpr (Q8_TMA)
      if (t % Q8_STAGE_TOKENS == 0)
        chunk_slot[t / Q8_STAGE_TOKENS] = (int32_t)(block * block_size + pos % block_size);
    if constexpr (Q8_VMAX) {
      const uint8_t* rec = v_pool + rows[t] * row_bytes;
      for (int i = 0; i < head_dim / PKV_KVQ8_BLOCK; ++i)
        vmax = fmaxf(vmax, fabsf(pkv_half_bits_to_float(
                               *(const uint16_t*)(rec + i * PKV_KVQ8_RECORD_BYTES))));
    }
  }
  if constexpr (Q8_VMAX) {
    for (int o = PKV_WARP_SIZE / 2; o > 0; o >>= 1) vmax = fmaxf(vmax, pkv_shfl_xor(vmax, o));
    if (lane == 0) vscale_max[warp] = vmax;
  }

  float qv[GMAX][8];  // the CUDA-core pass's queries (the mma pass builds fragments)
  if constexpr (!MMA) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      const int h = kvh * group + (g < group ? g : 0);
      const float* qh = q + ((int64_t)seq * num_heads + h) * head_dim + d0;
#pragma unroll
      for (int i = 0; i < 8; ++i) qv[g][i] = qh[i] * scale;
    }
  }
  __syncthreads();

  auto row_ptr = [&](const uint8_t* pool, int t) { return pool + rows[t] * row_bytes; };

  // Pass 1: scores. A token's GMAX partial dot products live on lanes_per_token lanes;
  // a reduce-scatter halves the heads a lane carries at each of the first log2(GMAX)
  // shuffle steps (GMAX/2 + GMAX/4 + ... + 1 shuffles instead of GMAX per step), so
  // each lane ends with one head's full score: the head given by its lane bits.
  float* scores = smem;
  // U rows per lane and pass step, double-buffered: the next step's loads are in
  // flight while this step's rows are converted and reduced.
  auto load_step = [&](const uint8_t* pool, int t0, RawRow8 (&raw)[PKV_ATTN_UNROLL]) {
#pragma unroll
    for (int u = 0; u < PKV_ATTN_UNROLL; ++u) {
      const int t = t0 + u * stride;
      if (t < n_tok) load_row8<KIND>(row_ptr(pool, t), d0, raw[u]);
      else zero_row8(raw[u]);
    }
  };
  const int step = stride * PKV_ATTN_UNROLL;
  const int first = warp * tokens_per_warp;
  RawRow8 cur[PKV_ATTN_UNROLL], nxt[PKV_ATTN_UNROLL];
  // The passes' tensor-copy staging (map nullptr: cp.async): the KV head's 144-byte window
  // starts at its row's offset rounded down to 16 bytes.
  Q8Tma k_tma{nullptr, 0, 0, nullptr, 0u}, v_tma{nullptr, 0, 0, nullptr, 0u};
  if constexpr (Q8_TMA) {
    if (q8_tma) {
      const int at = kvh * (int)row_bytes;
      const uint32_t bars = smem_window((const uint8_t*)&q8_bars[warp * 2 * PKV_ATTN_Q8_STAGES]);
      k_tma = Q8Tma{k_map, at & ~15, at & 15, chunk_slot, bars};
      v_tma = Q8Tma{v_map, at & ~15, at & 15, chunk_slot, bars + 8u * PKV_ATTN_Q8_STAGES};
      if (lane == 0) {
        for (int b = 0; b < 2 * PKV_ATTN_Q8_STAGES; ++b) mbar_init(bars + 8u * b);
        mbar_init_fence();
      }
      warp_sync();
    }
  }
  if constexpr (Q8_STAGED) {
    if constexpr (QK_S8)
      qk_scores_imma_q8_staged<GMAX>(q + ((int64_t)seq * num_heads + kvh * group) * head_dim,
                                     group, head_dim, scale, k_pool, rows, row_bytes, n_tok,
                                     scores,
                                     q8_stage + warp * PKV_ATTN_Q8_STAGES * Q8_STAGE_BYTES_MAX,
                                     k_tma);
    else
      qk_scores_mma_q8_staged<GMAX>(q + ((int64_t)seq * num_heads + kvh * group) * head_dim,
                                    group, head_dim, scale, k_pool, rows, row_bytes, n_tok,
                                    scores,
                                    q8_stage + warp * PKV_ATTN_Q8_STAGES * Q8_STAGE_BYTES_MAX,
                                    k_tma);
    // pass 1 left this warp's buffers free: the first V chunks load during the softmax
    q8_stage_prologue(q8_stage + warp * PKV_ATTN_Q8_STAGES * Q8_STAGE_BYTES_MAX, v_pool, rows,
                      row_bytes, n_tok, v_tma);
  } else if constexpr (MMA && KIND == KV_Q8) {
    qk_scores_mma_q8<GMAX>(q + ((int64_t)seq * num_heads + kvh * group) * head_dim, group,
                           head_dim, scale, k_pool, rows, row_bytes, n_tok, scores);
  } else if constexpr (MMA) {
    qk_scores_mma<KIND, GMAX>(q + ((int64_t)seq * num_heads + kvh * group) * head_dim, group,
                        head_dim, scale, k_pool, rows, row_bytes, n_tok, scores);
#if PKV_ATTN_MFMA
  } else if constexpr (MFMA && KIND == KV_Q8) {
    qk_scores_mfma_q8<GMAX>(q + ((int64_t)seq * num_heads + kvh * group) * head_dim, group,
                            head_dim, scale, k_pool, rows, row_bytes, n_tok, scores);
  } else if constexpr (MFMA) {
    qk_scores_mfma<KIND, GMAX>(q + ((int64_t)seq * num_heads + kvh * group) * head_dim, group,
                         head_dim, scale, k_pool, rows, row_bytes, n_tok, scores);
#endif
#if PKV_ATTN_WMMA
  } else if constexpr (MFMA && KIND == KV_Q8) {  // gfx11: WMMA
    qk_scores_wmma_q8<GMAX>(q + ((int64_t)seq * num_heads + kvh * group) * head_dim, group,
                            head_dim, scale, k_pool, rows, row_bytes, n_tok, scores);
  } else if constexpr (MFMA) {
    qk_scores_wmma<KIND, GMAX>(q + ((int64_t)seq * num_heads + kvh * group) * head_dim, group,
                               head_dim, scale, k_pool, rows, row_bytes, n_tok, scores);
#endif
  } else {
    if (first < n_tok) load_step(k_pool, first + sub, cur);
    // The loop bound is uniform across the warp (its first token), so every lane
    // reaches the shuffles; lanes past the end compute on zeros and store nothing.
    for (int w0 = first; w0 < n_tok; w0 += step) {
      const int t0 = w0 + sub;
      if (w0 + step < n_tok) load_step(k_pool, t0 + step, nxt);
  #pragma unroll
      for (int u = 0; u < PKV_ATTN_UNROLL; ++u) {
        const int t = t0 + u * stride;
        float kv[8];
        convert_row8<KIND>(cur[u], kv);
        float s[GMAX];
  #pragma unroll
        for (int g = 0; g < GMAX; ++g) {
          s[g] = 0.0f;
  #pragma unroll
          for (int i = 0; i < 8; ++i) s[g] += qv[g][i] * kv[i];
        }
        int o = lanes_per_token / 2, head = 0;
  #pragma unroll
        for (int half = GMAX / 2; half >= 1; half /= 2) {
          const bool upper = (lane & o) != 0;
  #pragma unroll
          for (int g = 0; g < half; ++g) {
            const float send = upper ? s[g] : s[g + half];
            const float keep = upper ? s[g + half] : s[g];
            s[g] = keep + pkv_shfl_xor(send, o);
          }
          head += upper ? half : 0;
          o >>= 1;
        }
        for (; o > 0; o >>= 1) s[0] += pkv_shfl_xor(s[0], o);
        if (t < n_tok && (lane % lanes_per_token) % (lanes_per_token / GMAX) == 0)
          scores[t * GMAX + head] = s[0];
      }
  #pragma unroll
      for (int u = 0; u < PKV_ATTN_UNROLL; ++u) cur[u] = nxt[u];
    }
  }
  // The first V rows load while the softmax of the scores is computed.
  if (!MMA && !MFMA_PV && first < n_tok) load_step(v_pool, first + sub, cur);
  __syncthreads();
  // Partition max per head, from the stored scores.
  float tmax[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) tmax[g] = -INFINITY;
  for (int t = threadIdx.x; t < n_tok; t += PKV_ATTN_THREADS)
#pragma unroll
    for (int g = 0; g < GMAX; ++g) tmax[g] = fmaxf(tmax[g], scores[t * GMAX + g]);
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    float m = tmax[g];
    for (int o = PKV_WARP_SIZE / 2; o > 0; o >>= 1) m = fmaxf(m, pkv_shfl_xor(m, o));
    if (lane == 0) red[warp][g] = m;
  }
  __syncthreads();
  float pmax[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    pmax[g] = red[0][g];
    for (int w = 1; w < n_warps; ++w) pmax[g] = fmaxf(pmax[g], red[w][g]);
  }
  // Probabilities (unnormalized) and their sum.
  float tsum[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) tsum[g] = 0.0f;
  for (int t = threadIdx.x; t < n_tok; t += PKV_ATTN_THREADS) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      const float p = expf(scores[t * GMAX + g] - pmax[g]);
      scores[t * GMAX + g] = p;
      tsum[g] += p;
    }
  }
  __syncthreads();  // everyone has read red[] (pmax) before it is reused
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    float s = tsum[g];
    for (int o = PKV_WARP_SIZE / 2; o > 0; o >>= 1) s += pkv_shfl_xor(s, o);
    if (lane == 0) red[warp][g] = s;
  }
  __syncthreads();

  float* wsum = smem;  // [n_warps][GMAX][head_dim], over the scores once they are read
  if constexpr (MMA) {
    {
      float o[8][4];
      if constexpr (Q8_STAGED) {
        pv_mma_q8_staged<GMAX>(scores, v_pool, rows, row_bytes, n_tok, head_dim,
                               q8_stage + warp * PKV_ATTN_Q8_STAGES * Q8_STAGE_BYTES_MAX, v_tma,
                               o);
      } else if constexpr (KIND == KV_Q8) {
        const int e = q8_pv_exponent(vscale_max, n_warps);
        pv_mma_q8<GMAX>(scores, v_pool, rows, row_bytes, n_tok, head_dim, q8_pv_pscale(e), o);
        const float unscale = q8_pv_unscale(e);
#pragma unroll
        for (int mt = 0; mt < 8; ++mt)
#pragma unroll
          for (int r = 0; r < 4; ++r) o[mt][r] *= unscale;
      } else {
        pv_mma<KIND, GMAX>(scores, v_pool, rows, row_bytes, n_tok, head_dim, o);
      }
      __syncthreads();  // every warp has read the scores
      const int gid = lane / 4, t = lane % 4;
      if (t < 2) {  // lane t holds heads 2t, 2t + 1; o[mt][0..1] even dim, [2..3] odd
#pragma unroll
        for (int mt = 0; mt < 8; ++mt) {
          // m-tile -> dim of row gid: pv_mma_q8's record-pure tiles, pv_mma's 16-byte chunks.
          const int d = KIND == KV_Q8 ? 32 * (mt / 2) + 4 * gid + 2 * (mt % 2)
                                      : 64 * (mt / 4) + 8 * gid + 2 * (mt % 4);
          if (d < head_dim) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int g = 2 * t + e;
              if (g < GMAX) {
                wsum[(warp * GMAX + g) * head_dim + d] = o[mt][e];
                wsum[(warp * GMAX + g) * head_dim + d + 1] = o[mt][2 + e];
              }
            }
          }
        }
      }
    }
  }
#if PKV_ATTN_MFMA
  if constexpr (MFMA_PV) {
    pkv_f32x4 o[8];
    if constexpr (KIND == KV_Q8) {
      const int e = q8_pv_exponent(vscale_max, n_warps);
      pv_mfma_q8<GMAX>(scores, v_pool, rows, row_bytes, n_tok, head_dim, q8_pv_pscale(e), o);
      const float unscale = q8_pv_unscale(e);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] *= unscale;
    } else {
      pv_mfma<KIND, GMAX>(scores, v_pool, rows, row_bytes, n_tok, head_dim, o);
    }
    __syncthreads();  // every wavefront has read the scores
    const int i = lane % 16, q = lane / 16, dpl = head_dim / 16;
    if (i < GMAX) {  // lane i holds head i; o[j][r]: D row 4q + r of m-tile j
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < dpl)  // q8: 2 m-tiles per record of 32 dims, also head_dim / 16
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            // pv_mfma_q8's record-pure m-tiles, pv_mfma's DPL consecutive dims per row
            const int d = KIND == KV_Q8 ? 32 * (j / 2) + 2 * (4 * q + r) + j % 2
                                        : dpl * (4 * q + r) + j;
            wsum[(warp * GMAX + i) * head_dim + d] = o[j][r];
          }
    }
  }
#endif
#if PKV_ATTN_WMMA
  if constexpr (MFMA_PV) {
    pkv_f32x8 o[8];
    if constexpr (KIND == KV_Q8) {
      const int e = q8_pv_exponent(vscale_max, n_warps);
      pv_wmma_q8<GMAX>(scores, v_pool, rows, row_bytes, n_tok, head_dim, q8_pv_pscale(e), o);
      const float unscale = q8_pv_unscale(e);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] *= unscale;
    } else {
      pv_wmma<KIND, GMAX>(scores, v_pool, rows, row_bytes, n_tok, head_dim, o);
    }
    __syncthreads();  // every wave has read the scores
    const int i = lane % 16, hw = lane / 16, dpl = head_dim / 16;
    if (i < GMAX) {  // lane i holds head i; o[j][r]: D row 2r + hw of m-tile j
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < dpl)  // q8: 2 m-tiles per record of 32 dims, also head_dim / 16
#pragma unroll
          for (int r = 0; r < 8; ++r) {
            // pv_wmma_q8's record-pure m-tiles, pv_wmma's DPL consecutive dims per row
            const int d = KIND == KV_Q8 ? 32 * (j / 2) + 2 * (2 * r + hw) + j % 2
                                        : dpl * (2 * r + hw) + j;
            wsum[(warp * GMAX + i) * head_dim + d] = o[j][r];
          }
    }
  }
#endif
  if constexpr (!MMA && !MFMA_PV) {
    // Pass 2: acc = sum_t p_t * V_t over this lane's 8 dims.
    float acc[GMAX][8];
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
    for (int w0 = first; w0 < n_tok; w0 += step) {
      const int t0 = w0 + sub;
      if (w0 + step < n_tok) load_step(v_pool, t0 + step, nxt);
#pragma unroll
      for (int u = 0; u < PKV_ATTN_UNROLL; ++u) {
        const int t = t0 + u * stride;
        if (t < n_tok) {
          float kv[8];
          convert_row8<KIND>(cur[u], kv);
#pragma unroll
          for (int g = 0; g < GMAX; ++g) {
            const float p = scores[t * GMAX + g];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] += p * kv[i];
          }
        }
      }
#pragma unroll
      for (int u = 0; u < PKV_ATTN_UNROLL; ++u) cur[u] = nxt[u];
    }
    // Sum the tokens_per_warp token lanes of each dim, then the warps.
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
#pragma unroll
      for (int i = 0; i < 8; ++i)
        for (int o = PKV_WARP_SIZE / 2; o >= lanes_per_token; o >>= 1)
          acc[g][i] += pkv_shfl_xor(acc[g][i], o);
    __syncthreads();  // scores are no longer read: smem now holds per-warp sums
    if (sub == 0) {
#pragma unroll
      for (int g = 0; g < GMAX; ++g)
#pragma unroll
        for (int i = 0; i < 8; ++i) wsum[(warp * GMAX + g) * head_dim + d0 + i] = acc[g][i];
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < group * head_dim; e += PKV_ATTN_THREADS) {
    const int g = e / head_dim, d = e % head_dim;
    float s = 0.0f;
    for (int w = 0; w < n_warps; ++w) s += wsum[(w * GMAX + g) * head_dim + d];
    const int64_t hp = ((int64_t)seq * num_heads + kvh * group + g) * max_partitions + part;
    part_out[hp * head_dim + d] = s;
    if (d == 0) {
      float l = 0.0f;
      for (int w = 0; w < n_warps; ++w) l += red[w][g];
      float m = pmax[0];
#pragma unroll
      for (int gg = 1; gg < GMAX; ++gg)
        if (gg == g) m = pmax[gg];  // a register array takes constant indices only
      part_max[hp] = m;
      part_sum[hp] = l;
    }
  }
}

// f16 and bf16 KV with up to 4 query heads per KV head and head_dim 64 or 128 run both
// passes on tensor cores where there are some (sm_80+); everything else on CUDA cores.
// q8 KV the same (pv_mma_q8, qk_scores_mma_q8) unless CUDA_CORES: the _cc kernels keep the
// CUDA-core q8 passes selectable (PAGEDKV_ATTN_Q8_MMA=0, pagedkv.kernels.kvcache).
template <int KIND, int GMAX, bool CUDA_CORES = false, bool STAGE = false, bool QK_S8 = false>
PKV_DEV void paged_attention_dispatch(
    const float* q, const uint8_t* k_pool, const uint8_t* v_pool, const int32_t* block_tables,
    const int32_t* seq_lens, float* part_out, float* part_max, float* part_sum, float scale,
    int num_heads, int kv_heads, int head_dim, int block_size, int table_width,
    int max_partitions, int part_tokens, const PkvTensorMap* k_map = nullptr,
    const PkvTensorMap* v_map = nullptr) {
  constexpr bool MMA_OK = PKV_ATTN_MMA_QK && !CUDA_CORES && GMAX <= 4 && PKV_WARP_SIZE == 32;
  // The staged q8 passes get head_dim as a constant (each size its own inlined copy): the
  // record loops, row bytes, stage pitch and copy unit fold, with no per-record branches.
  constexpr bool CONST_HEAD_DIM = MMA_OK && KIND == KV_Q8 && STAGE;
  if (CONST_HEAD_DIM && head_dim == 128)
    paged_attention_partition<KIND, GMAX, MMA_OK, false, STAGE, QK_S8>(
        q, k_pool, v_pool, block_tables, seq_lens, part_out, part_max, part_sum, scale,
        num_heads, kv_heads, 128, block_size, table_width, max_partitions, part_tokens, k_map,
        v_map);
  else if (CONST_HEAD_DIM && head_dim == 64)
    paged_attention_partition<KIND, GMAX, MMA_OK, false, STAGE, QK_S8>(
        q, k_pool, v_pool, block_tables, seq_lens, part_out, part_max, part_sum, scale,
        num_heads, kv_heads, 64, block_size, table_width, max_partitions, part_tokens);
  else if (!CONST_HEAD_DIM && MMA_OK && (head_dim == 64 || head_dim == 128))
    paged_attention_partition<KIND, GMAX, MMA_OK, false, STAGE, QK_S8>(
        q, k_pool, v_pool, block_tables, seq_lens, part_out, part_max, part_sum, scale,
        num_heads, kv_heads, head_dim, block_size, table_width, max_partitions, part_tokens);
  else
    paged_attention_partition<KIND, GMAX, false>(
        q, k_pool, v_pool, block_tables, seq_lens, part_out, part_max, part_sum, scale,
        num_heads, kv_heads, head_dim, block_size, table_width, max_partitions, part_tokens);
}

#define PKV_ATTN_KERNEL_AS(NAME, KIND, GMAX, CUDA_CORES, STAGE, QK_S8)                  \
  PKV_KERNEL void __launch_bounds__(PKV_ATTN_THREADS,                                       \
                                    PKV_ATTN_OF_KIND(PKV_ATTN_MIN_BLOCKS, KIND))             \
      NAME(                                                                                  \
      const float* q, const uint8_t* k_pool, const uint8_t* v_pool,                          \
      const int32_t* block_tables, const int32_t* seq_lens, float* part_out,                 \
      float* part_max, float* part_sum, float scale, int num_heads, int kv_heads,            \
      int head_dim, int block_size, int table_width, int max_partitions, int part_tokens) {                   \
    paged_attention_dispatch<KIND, GMAX, CUDA_CORES, STAGE, QK_S8>(                          \
        q, k_pool, v_pool, block_tables, seq_lens, part_out, part_max, part_sum, scale,      \
        num_heads, kv_heads, head_dim, block_size, table_width, max_partitions, part_tokens);             \
  }

#define PKV_ATTN_KERNEL(NAME, KIND, GMAX) \
  PKV_ATTN_KERNEL_AS(NAME, KIND, GMAX, false, false, false)

// The staged q8 kernels (q8s, q8i): the launcher's two tensor maps (K, V) by value and
// whether it built them (pagedkv.kernels.kvcache; PKV_ATTN_Q8_STAGE_TMA).
#define PKV_ATTN_STAGED_KERNEL(NAME, GMAX, QK_S8)                                            \
  PKV_KERNEL void __launch_bounds__(PKV_ATTN_THREADS,                                       \
                                    PKV_ATTN_OF_KIND(PKV_ATTN_MIN_BLOCKS, KV_Q8))            \
      NAME(                                                                                  \
      const float* q, const uint8_t* k_pool, const uint8_t* v_pool,                          \
      const int32_t* block_tables, const int32_t* seq_lens, float* part_out,                 \
      float* part_max, float* part_sum, float scale, int num_heads, int kv_heads,            \
      int head_dim, int block_size, int table_width, int max_partitions, int part_tokens,    \
      const PKV_GRID_CONSTANT PkvTensorMap k_map, const PKV_GRID_CONSTANT PkvTensorMap v_map, \
      int use_maps) {                                                                        \
    paged_attention_dispatch<KV_Q8, GMAX, false, true, QK_S8>(                               \
        q, k_pool, v_pool, block_tables, seq_lens, part_out, part_max, part_sum, scale,      \
        num_heads, kv_heads, head_dim, block_size, table_width, max_partitions, part_tokens, \
        use_maps ? &k_map : nullptr, use_maps ? &v_map : nullptr);                           \
  }

#if PKV_ATTN_MFMA || PKV_ATTN_WMMA
// Both passes on AMD matrix cores (the partition's MFMA flag: MFMA on CDNA, WMMA on gfx11)
// for head_dim 64 or 128, else the CUDA-core passes.
#define PKV_ATTN_MFMA_KERNEL(NAME, KIND, GMAX)                                               \
  PKV_KERNEL void __launch_bounds__(PKV_ATTN_THREADS,                                       \
                                    PKV_ATTN_OF_KIND(PKV_ATTN_MIN_BLOCKS, KIND))             \
      NAME(                                                                                  \
      const float* q, const uint8_t* k_pool, const uint8_t* v_pool,                          \
      const int32_t* block_tables, const int32_t* seq_lens, float* part_out,                 \
      float* part_max, float* part_sum, float scale, int num_heads, int kv_heads,            \
      int head_dim, int block_size, int table_width, int max_partitions, int part_tokens) {                   \
    if (head_dim == 64 || head_dim == 128)                                                   \
      paged_attention_partition<KIND, GMAX, false, true>(                                    \
          q, k_pool, v_pool, block_tables, seq_lens, part_out, part_max, part_sum, scale,    \
          num_heads, kv_heads, head_dim, block_size, table_width, max_partitions, part_tokens);           \
    else                                                                                     \
      paged_attention_partition<KIND, GMAX, false>(                                          \
          q, k_pool, v_pool, block_tables, seq_lens, part_out, part_max, part_sum, scale,    \
          num_heads, kv_heads, head_dim, block_size, table_width, max_partitions, part_tokens);           \
  }
#endif

#if PKV_ATTN_MFMA
// f16, bf16 and q8 KV with both passes on CDNA MFMA (qk_scores_mfma and pv_mfma; q8:
// qk_scores_mfma_q8 and pv_mfma_q8): pkv_paged_attention_{f16,bf16,q8}mfma_g*, opt-in
// (PAGEDKV_ATTN_MFMA=1, pagedkv.kernels.kvcache) until an AMD device run vouches for it;
// bf16 only where PKV_MFMA_BF16_1K is defined (not gfx908).
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_f16mfma_g1, KV_F16, 1)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_f16mfma_g2, KV_F16, 2)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_f16mfma_g4, KV_F16, 4)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_f16mfma_g8, KV_F16, 8)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_q8mfma_g1, KV_Q8, 1)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_q8mfma_g2, KV_Q8, 2)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_q8mfma_g4, KV_Q8, 4)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_q8mfma_g8, KV_Q8, 8)
#if defined(PKV_MFMA_BF16_1K)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_bf16mfma_g1, KV_BF16, 1)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_bf16mfma_g2, KV_BF16, 2)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_bf16mfma_g4, KV_BF16, 4)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_bf16mfma_g8, KV_BF16, 8)
#endif
#endif

#if PKV_ATTN_WMMA
// f16, bf16 and q8 KV with both passes on RDNA3 WMMA (qk_scores_wmma, pv_wmma; q8:
// qk_scores_wmma_q8, pv_wmma_q8); head_dim 64 or 128, else the CUDA-core passes:
// pkv_paged_attention_{f16,bf16,q8}wmma_g*, opt-in
// (PAGEDKV_ATTN_WMMA=1, pagedkv.kernels.kvcache) until an AMD device run vouches for it.
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_f16wmma_g1, KV_F16, 1)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_f16wmma_g2, KV_F16, 2)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_f16wmma_g4, KV_F16, 4)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_f16wmma_g8, KV_F16, 8)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_bf16wmma_g1, KV_BF16, 1)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_bf16wmma_g2, KV_BF16, 2)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_bf16wmma_g4, KV_BF16, 4)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_bf16wmma_g8, KV_BF16, 8)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_q8wmma_g1, KV_Q8, 1)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_q8wmma_g2, KV_Q8, 2)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_q8wmma_g4, KV_Q8, 4)
PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_q8wmma_g8, KV_Q8, 8)
#endif

PKV_ATTN_KERNEL(pkv_paged_attention_f16_g1, KV_F16, 1)
PKV_ATTN_KERNEL(pkv_paged_attention_f16_g2, KV_F16, 2)
PKV_ATTN_KERNEL(pkv_paged_attention_f16_g4, KV_F16, 4)
PKV_ATTN_KERNEL(pkv_paged_attention_f16_g8, KV_F16, 8)
PKV_ATTN_KERNEL(pkv_paged_attention_bf16_g1, KV_BF16, 1)
PKV_ATTN_KERNEL(pkv_paged_attention_bf16_g2, KV_BF16, 2)
PKV_ATTN_KERNEL(pkv_paged_attention_bf16_g4, KV_BF16, 4)
PKV_ATTN_KERNEL(pkv_paged_attention_bf16_g8, KV_BF16, 8)
PKV_ATTN_KERNEL(pkv_paged_attention_q8_g1, KV_Q8, 1)
PKV_ATTN_KERNEL(pkv_paged_attention_q8_g2, KV_Q8, 2)
PKV_ATTN_KERNEL(pkv_paged_attention_q8_g4, KV_Q8, 4)
PKV_ATTN_KERNEL(pkv_paged_attention_q8_g8, KV_Q8, 8)
PKV_ATTN_KERNEL_AS(pkv_paged_attention_q8cc_g1, KV_Q8, 1, true, false, false)
PKV_ATTN_KERNEL_AS(pkv_paged_attention_q8cc_g2, KV_Q8, 2, true, false, false)
PKV_ATTN_KERNEL_AS(pkv_paged_attention_q8cc_g4, KV_Q8, 4, true, false, false)
PKV_ATTN_KERNEL_AS(pkv_paged_attention_q8cc_g8, KV_Q8, 8, true, false, false)
// q8 with the rows staged in shared memory (pv_mma_q8_staged): the default q8 path.
// Where the tensor-core passes do not apply (AMD, GMAX 8, head_dim 256) these are the q8
// kernels' CUDA-core passes.
PKV_ATTN_STAGED_KERNEL(pkv_paged_attention_q8s_g1, 1, false)
PKV_ATTN_STAGED_KERNEL(pkv_paged_attention_q8s_g2, 2, false)
PKV_ATTN_STAGED_KERNEL(pkv_paged_attention_q8s_g4, 4, false)
PKV_ATTN_STAGED_KERNEL(pkv_paged_attention_q8s_g8, 8, false)
// The q8s kernels with pass 1 on integer tensor cores (qk_scores_imma_q8_staged): opt-in
// (q8_int=True, PAGEDKV_ATTN_Q8_INT=1) until a device run vouches for them; elsewhere the same
// fallbacks as q8s.
PKV_ATTN_STAGED_KERNEL(pkv_paged_attention_q8i_g1, 1, true)
PKV_ATTN_STAGED_KERNEL(pkv_paged_attention_q8i_g2, 2, true)
PKV_ATTN_STAGED_KERNEL(pkv_paged_attention_q8i_g4, 4, true)
PKV_ATTN_STAGED_KERNEL(pkv_paged_attention_q8i_g8, 8, true)

// ---------------------------------------------------------------------------
// Paged-attention decode over compressed KV (docs/kv-quant.md "Attention over compressed
// KV"): the records are read as they are stored, never decompressed into a copy.
//
// K is a rotated mode (fwht4/fwht3/fwht2, or a lloyd mode: KBITS-bit codes, R128 per half
// or R256, KROT):
// q is rotated once per CTA into the K basis, in shared memory, and a token's score is
// scale * cnorm_t * sum_d q_rot[d] * C[code_t[d]]. V is q8 (VBITS 8, dequantized per
// lane as in the q8 kernel) or rotated (VBITS 4/3/2 in the VROT basis: lloyd, R256; or
// pagedkv's fwht V, fwht4/fwht2 in R128 per half): sum_t p_t * cnorm_t * C[code_t[d]]
// accumulates in the rotated basis and pkv_paged_attention_reduce_ifwht256 (VROT 256) or
// pkv_paged_attention_reduce_ifwht128 (VROT 128) rotates each head's combined output back
// once. Centroid tables sit in shared memory
// (16 floats in 16 banks: lanes that look up different codes never conflict).
//
// Lanes hold 8 consecutive dims of a row, as in the kernel above: 8 codes are KBITS
// bytes of the record (one 32-bit load at 4 bits, 16-bit at 2, three bytes at 3) plus the
// record's f32 cnorm (the same 4 bytes for every lane of a token: one broadcast load).

__constant__ float kKvCentroids[PKV_KV_CENTROID_COUNT] = {PKV_KV_CENTROIDS};

// A lane's 8 codes and the row's corrected norm, raw.
struct RawCodes8 {
  uint32_t codes;  // code i in bits [BITS*i, BITS*i + BITS)
  float cnorm;
};

template <int BITS>
PKV_DEV void load_codes8(const uint8_t* row, int d0, RawCodes8& r) {
  // Rows start 4-byte aligned (4 + head_dim*BITS/8 bytes, a multiple of 4 for every mode),
  // so the 32- and 16-bit loads are aligned; 3-bit codes straddle and load byte by byte.
  r.cnorm = *(const float*)row;
  const uint8_t* p = row + PKV_KV_CNORM_BYTES + d0 * BITS / 8;
  if (BITS == 4) {
    r.codes = *(const uint32_t*)p;
  } else if (BITS == 2) {
    r.codes = *(const uint16_t*)p;
  } else {
    r.codes = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16);
  }
}

PKV_DEV void zero_codes8(RawCodes8& r) {
  r.codes = 0;
  r.cnorm = 0.0f;
}

// The 8 centroids of a lane's codes, from the shared table.
template <int BITS>
PKV_DEV void lookup8(const RawCodes8& r, const float* table, float out[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = table[(r.codes >> (BITS * i)) & ((1u << BITS) - 1u)];
}

// In place on n floats of shared memory holding n / ROT rows: y = R x per ROT-block
// (inverse: R^T), with the CTA's threads (R = D2 H D1 / sqrt(ROT), quant.h's signs).
template <int ROT>
PKV_DEV void rotate_shared(float* x, int n, bool inverse) {
  const float c = ROT == 256 ? PKV_FWHT_SCALE_256 : PKV_FWHT_SCALE_128;
  for (int e = threadIdx.x; e < n; e += blockDim.x)
    x[e] = x[e] * (inverse ? pkv_sign2(e % ROT) : pkv_sign1(e % ROT));
  __syncthreads();
  for (int h = 1; h < ROT; h <<= 1) {
    for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
      const int blk = p / (ROT / 2), j = p % (ROT / 2);
      const int i = blk * ROT + (j / h) * 2 * h + j % h;
      const float a = x[i], b = x[i + h];
      x[i] = a + b;
      x[i + h] = a - b;
    }
    __syncthreads();
  }
  for (int e = threadIdx.x; e < n; e += blockDim.x)
    x[e] = x[e] * (c * (inverse ? pkv_sign1(e % ROT) : pkv_sign2(e % ROT)));
  __syncthreads();
}

// ---------------------------------------------------------------------------
// Rotated KV write (fwhtN / lloydN records, docs/kv-quant.md "Encoding and decoding"): the device form
// of pkv_kv_encode_row, byte for byte. One CTA of PKV_KV_WRITE_THREADS threads encodes
// one (token, kv-head) row into the pool at its slot. Every multiply and add that the
// scalar reference rounds separately is an explicit _rn intrinsic here (nvcc would fuse
// x*x + s into one FMA and change the norm's last bit), sqrt and divide are the correctly
// rounded ones, and the sums keep the reference's order: PKV_KV_SUMSQ_LANES partials in
// index order, folded 8, 4, 2, 1; the rotation is rotate_shared, whose butterflies are
// pkv_fwht's. Non-finite input is not checked here (the host encoder refuses it).

#ifndef PKV_KV_WRITE_THREADS
#define PKV_KV_WRITE_THREADS 256
#endif

__constant__ float kKvThresholds[PKV_KV_THRESHOLD_COUNT] = {PKV_KV_THRESHOLDS};

// pkv_kv_sumsq of x[0..n) into *out, by threads 0..15 then thread 0; the caller syncs.
PKV_DEV void sumsq_shared(const float* x, int n, float* part, float* out) {
  const int t = threadIdx.x;
  if (t < (int)PKV_KV_SUMSQ_LANES) {
    float s = 0.0f;
    for (int i = t; i < n; i += PKV_KV_SUMSQ_LANES) s = __fadd_rn(s, __fmul_rn(x[i], x[i]));
    part[t] = s;
  }
  __syncthreads();
  if (t == 0) {
    for (int w = PKV_KV_SUMSQ_LANES / 2; w > 0; w >>= 1)
      for (int j = 0; j < w; ++j) part[j] = __fadd_rn(part[j], part[j + w]);
    *out = part[0];
  }
}

template <typename In>
PKV_DEV void kv_rotated_write(const In* __restrict__ src, const int64_t* __restrict__ slots,
                              uint8_t* __restrict__ pool, int n_tokens, int kv_heads,
                              int head_dim, uint32_t mode) {
  __shared__ float r[256];
  __shared__ uint8_t codes[256];
  __shared__ float part[PKV_KV_SUMSQ_LANES];
  __shared__ float sums[2];  // the value norm's and the centroid row's sums of squares
  const int64_t row = blockIdx.x;  // token * kv_heads + head
  const int t = threadIdx.x;
  if (row >= (int64_t)n_tokens * kv_heads) return;
  const int64_t slot = slots[row / kv_heads];
  if (slot < 0) return;  // a padding token: nothing to store (uniform over the CTA)
  const uint32_t bits = pkv_kv_mode_bits(mode), rot = pkv_kv_mode_rotation(mode);
  const float* C = kKvCentroids + pkv_kv_centroid_offset(bits, rot);
  const float* T = kKvThresholds + pkv_kv_threshold_offset(bits, rot);
  const int nt = (1 << bits) - 1;

  for (int d = t; d < head_dim; d += blockDim.x) r[d] = pkv_load_value(src + row * head_dim + d);
  __syncthreads();
  sumsq_shared(r, head_dim, part, &sums[0]);
  __syncthreads();
  const float norm = __fsqrt_rn(sums[0]);
  const float inv = norm > PKV_KV_NORM_EPS ? __fdiv_rn(1.0f, norm) : 0.0f;
  for (int d = t; d < head_dim; d += blockDim.x) r[d] = __fmul_rn(r[d], inv);
  __syncthreads();
  if (rot == 256u) rotate_shared<256>(r, head_dim, false);
  else rotate_shared<128>(r, head_dim, false);
  for (int d = t; d < head_dim; d += blockDim.x) {
    int c = 0;
    for (int k = 0; k < nt; ++k) c += r[d] > T[k] ? 1 : 0;
    codes[d] = (uint8_t)c;
    r[d] = C[c];
  }
  __syncthreads();
  sumsq_shared(r, head_dim, part, &sums[1]);
  __syncthreads();
  uint8_t* out = pool + (slot * kv_heads + row % kv_heads) *
                            (int64_t)pkv_kv_row_bytes(mode, (uint32_t)head_dim);
  if (t == 0) {
    const float rn = __fsqrt_rn(sums[1]);
    pkv_store_f32le(out, rn > PKV_KV_NORM_EPS ? __fdiv_rn(norm, rn) : norm);
  }
  // Byte b of the LSB-first code stream: bits [8b, 8b + 8) of code i at bit bits*i.
  for (int b = t; b < head_dim * (int)bits / 8; b += blockDim.x) {
    uint32_t byte = 0;
    for (int j = 0; j < 8; ++j) {
      const int bit = 8 * b + j;
      byte |= ((uint32_t)(codes[bit / bits] >> (bit % bits)) & 1u) << j;
    }
    out[PKV_KV_CNORM_BYTES + b] = (uint8_t)byte;
  }
}

PKV_KERNEL void __launch_bounds__(PKV_KV_WRITE_THREADS)
pkv_kv_rotated_write_f32(const float* src, const int64_t* slots, uint8_t* pool, int n_tokens,
                         int kv_heads, int head_dim, int mode) {
  kv_rotated_write<float>(src, slots, pool, n_tokens, kv_heads, head_dim, (uint32_t)mode);
}
PKV_KERNEL void __launch_bounds__(PKV_KV_WRITE_THREADS)
pkv_kv_rotated_write_f16(const uint16_t* src, const int64_t* slots, uint8_t* pool,
                         int n_tokens, int kv_heads, int head_dim, int mode) {
  kv_rotated_write<uint16_t>(src, slots, pool, n_tokens, kv_heads, head_dim, (uint32_t)mode);
}

// ---------------------------------------------------------------------------
// Compressed KV on the f16 tensor-core passes (the _mma kernels below; NVIDIA sm_80+, 4- and
// 2-bit codes, head_dim 128 or 256, GMAX <= 4; docs/kernels.md "Compressed KV on tensor
// cores"). Each nibble of a code byte (one 4-bit code, or two 2-bit codes) indexes a
// 16-entry shared table of the centroids it names, already f16 in the mma's order: for each
// code the f16 of CODE_TABLE_SCALE * C (hi) and the f16 of what that rounding left (lo), so
// hi + lo carry 22 bits of the f32 centroid and each fragment runs two mmas (hi, lo) into
// the same f32 sums. 16 entries, each in banks of its own, make every lookup free of bank
// conflicts (lanes on one entry read it by broadcast): the 256-entry byte tables before
// took ~5.4 shared wavefronts a lookup on random codes and kept the L1 pipe 92% busy
// (Nsight Compute, H100, fwht4/lloyd4 d256, 2026-12-06). CODE_TABLE_SCALE (2^6) keeps every lo an f16 normal (the
// smallest centroid, 0.0079, times 64 is 0.51); the sums are scaled back by 2^-6 exactly.
// Each pass covers 128 dims at a time (head_dim 256: two halves, the second adding to the
// first's scores / writing the other half of the output), so a lane's registers are those
// of the head_dim-128 f16 pass.
// Pass 1 (qk_scores_mma_codes): A is q_fragments of the rotated queries (f16 + remainder),
// B is K's centroids: lane (gid, t) reads the 8 codes of dims 32i + 8t .. + 7 of token gid
// (a 32-bit word at 4 bits, 16 bits at 2), the dims of k-steps 2i, 2i + 1 in q_fragments'
// order; a score is (c0 + c2) * cnorm_t / 64.
// Pass 2 (pv_mma_codes): out^T = V^T . P^T as pv_mma: lane (gid, t) takes tokens 4t .. 4t + 3
// and B's column gid holds p_t * cnorm_t (f16, or its remainder on gid >= 4); one dim of two
// tokens becomes the hi and the lo A register with one byte permute each (4-bit: of the two
// codes' {hi, lo} entries; 2-bit: of the two tokens' hi pairs, then lo pairs).
// 4-bit: the lane reads code bytes 4 gid .. + 3 and 32 + 4 gid .. + 3 of its 128 dims (m-tile
// 4w + j, row gid = dim 64w + 8 gid + 2j: pv_mma's mapping); 2-bit: bytes 4 gid .. + 3
// (m-tile 2j + k, row gid = dim 16 gid + 4j + 2k).
constexpr float CODE_TABLE_SCALE = 64.0f;
// Which table (PKV_ATTN_CODE_TABLE_NIBBLES, pkg/include/pagedkv/launch.h): 16 entries a
// nibble, or 256 a byte (the layout before, kept for sweeps). gfx11's WMMA passes keep the
// byte tables: with the nibble ones their 4-bit K pass 1 spilled 40-112 bytes at 256 VGPRs
// (gfx1100, hip/gfx11_codegen.py, 2026-12-06).
#if PKV_ATTN_WMMA
constexpr bool CODE_NIBBLES = false;
#else
constexpr bool CODE_NIBBLES = PKV_ATTN_CODE_TABLE_NIBBLES != 0;
#endif
constexpr int CODE_TABLE_ENTRIES = CODE_NIBBLES ? 16 : 256;

// u32 words per table entry. Nibble tables: 4-bit {hi | lo << 16} of one code, 2-bit {hi
// pair, lo pair} of the nibble's two codes (the low two bits: the even dim). Byte tables:
// 4-bit {hi pair, lo pair}, 2-bit {hi 0-1, hi 2-3, lo 0-1, lo 2-3}.
template <int BITS>
constexpr int CODE_TABLE_WORDS = (BITS == 4 ? 1 : 2) * (CODE_NIBBLES ? 1 : 2);

// The table of a BITS-bit family's centroids (C: 1 << BITS floats), by the CTA's threads.
template <int BITS>
PKV_DEV void build_code_table(uint32_t* tab, const float* C) {
  constexpr int PER = (CODE_NIBBLES ? 4 : 8) / BITS;  // codes per entry
  for (int n = threadIdx.x; n < CODE_TABLE_ENTRIES; n += blockDim.x) {
    uint32_t hi[PER], lo[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const float v = C[(n >> (BITS * k)) & ((1 << BITS) - 1)] * CODE_TABLE_SCALE;
      hi[k] = pkv_float_to_half_bits(v);
      lo[k] = pkv_float_to_half_bits(v - pkv_half_bits_to_float((uint16_t)hi[k]));
    }
    if (PER == 1) {
      tab[n] = hi[0] | lo[0] << 16;
    } else {
#pragma unroll
      for (int k = 0; k < PER / 2; ++k) {
        tab[n * CODE_TABLE_WORDS<BITS> + k] = hi[2 * k] | hi[(2 * k + 1) % PER] << 16;
        tab[n * CODE_TABLE_WORDS<BITS> + PER / 2 + k] = lo[2 * k] | lo[(2 * k + 1) % PER] << 16;
      }
    }
  }
}

// A 4-bit byte's two nibble-table entries ({hi | lo << 16}; e0: the low nibble's, the even
// dim) as its hi pair and its lo pair.
PKV_DEV void join_code_entries(uint32_t e0, uint32_t e1, uint32_t& hi, uint32_t& lo) {
  hi = __byte_perm(e0, e1, 0x5410), lo = __byte_perm(e0, e1, 0x7632);
}

// 2 bits: the hi and lo pairs (dims 2 pair, + 1) of byte's nibble `pair` (0 or 1).
PKV_DEV void code_pair2(const uint32_t* tab, uint32_t byte, int pair, uint32_t& hi,
                        uint32_t& lo) {
  if (CODE_NIBBLES) {
    const uint2 e = ((const uint2*)tab)[(byte >> (4 * pair)) & 15u];
    hi = e.x, lo = e.y;
  } else {
    const uint4 e = ((const uint4*)tab)[byte & 0xFFu];
    hi = pair ? e.y : e.x, lo = pair ? e.w : e.z;
  }
}

// The pairs of one code byte: hi[k] / lo[k] = dims 2k, 2k + 1 of the byte (k < 2 at 2 bits,
// k = 0 at 4 bits, where a nibble table's two entries are joined by two byte permutes).
template <int BITS>
PKV_DEV void code_byte_pairs(const uint32_t* tab, uint32_t byte, uint32_t (&hi)[2],
                             uint32_t (&lo)[2]) {
  if (BITS == 4 && CODE_NIBBLES) {
    join_code_entries(tab[byte & 15u], tab[(byte >> 4) & 15u], hi[0], lo[0]);
    hi[1] = lo[1] = 0u;
  } else if (BITS == 4) {
    const uint2 e = ((const uint2*)tab)[byte & 0xFFu];
    hi[0] = e.x, lo[0] = e.y, hi[1] = lo[1] = 0u;
  } else {
    code_pair2(tab, byte, 0, hi[0], lo[0]);
    code_pair2(tab, byte, 1, hi[1], lo[1]);
  }
}

// Nibble-table lookups addressed by one byte permute (the NVIDIA _mma passes). Indexing a
// table by `(w >> s) & 15` costs a shift, a mask and the table's base added: 3 instructions
// a lookup, ~40% of pass 2's SASS (sm_90, 2026-12-06). Here one word's 8 nibbles become byte
// offsets at once (NibbleOffsets: 2 shifts and 2 masks), and since the table sits at a
// 256-byte-aligned shared-window address, an entry's address is that base with its low
// byte replaced by the offset: one PRMT a lookup.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
constexpr bool CODE_NIBBLE_PRMT = CODE_NIBBLES && PKV_ATTN_CODE_TABLE_PRMT != 0;
#else
constexpr bool CODE_NIBBLE_PRMT = false;  // AMD: indexes as above
#endif
constexpr int CODE_TABLE_ALIGN = 256;  // the bytes a nibble table may span
static_assert(!CODE_NIBBLES || 16 * CODE_TABLE_WORDS<2> * 4 <= CODE_TABLE_ALIGN,
              "a nibble table fits in the low byte of its address");

// Byte k of lo / hi: the offset of the entry of byte k's low / high nibble (4-bit codes:
// 4-byte entries; 2-bit: 8-byte entries).
struct NibbleOffsets {
  uint32_t lo, hi;
};
template <int BITS>
PKV_DEV NibbleOffsets nibble_offsets(uint32_t w) {
  constexpr int SHIFT = BITS == 4 ? 2 : 3;  // log2 of an entry's bytes
  constexpr uint32_t MASK = 0x0F0F0F0Fu << SHIFT;
  return {(w << SHIFT) & MASK, (w >> (4 - SHIFT)) & MASK};
}

// The entry of byte k's low (high = false) or high nibble; `base`: the table's
// shared-window address. 4 bits: .x = {hi | lo << 16} of the code; 2 bits: {hi pair, lo pair}.
template <int BITS>
PKV_DEV uint2 nibble_entry(uint32_t base, const NibbleOffsets& o, int k, bool high) {
  const uint32_t at = __byte_perm(high ? o.hi : o.lo, base, 0x7650u | (uint32_t)k);
  uint2 e = {0u, 0u};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // volatile: never moved above the barrier after the table is built
  if (BITS == 4) asm volatile("ld.shared.b32 %0, [%1];" : "=r"(e.x) : "r"(at));
  else asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(e.x), "=r"(e.y) : "r"(at));
#else
  __builtin_trap();  // callers check CODE_NIBBLE_PRMT
#endif
  return e;
}

// The hi and lo pairs of byte k of a 4-bit code word (its two codes' entries joined), or of
// nibble `pair` of byte k at 2 bits.
template <int BITS>
PKV_DEV void nibble_pair(uint32_t base, const NibbleOffsets& o, int k, int pair,
                         uint32_t& hi, uint32_t& lo) {
  if (BITS == 4) {
    join_code_entries(nibble_entry<4>(base, o, k, false).x, nibble_entry<4>(base, o, k, true).x,
                      hi, lo);
  } else {
    const uint2 e = nibble_entry<2>(base, o, k, pair != 0);
    hi = e.x, lo = e.y;
  }
}

// Pass 1's code word of lane quad t (NVIDIA: t = lane % 4; MFMA: q = lane / 16) for k-steps
// 2l, 2l + 1: the codes of dims 32l + 8t .. + 7 of the half whose codes start at byte code0 of
// the row; at 2 bits the low 16 bits.
template <int BITS>
PKV_DEV uint32_t code_quad_word(const uint8_t* row, int code0, int l, int t) {
  return BITS == 4 ? *(const uint32_t*)(row + code0 + 16 * l + 4 * t)
                   : (uint32_t)*(const uint16_t*)(row + code0 + 8 * l + 2 * t);
}

// B of pass-1 k-step s (dims 32(s/2) + 8t + 4(s%2) + 0..3) from its code word w: the hi and
// lo pairs of the 4 dims. 4 bits: bytes 2(s%2), 2(s%2) + 1 of w, one pair each; 2 bits:
// byte s%2, both of its pairs.
template <int BITS>
PKV_DEV void code_step_pairs(const uint32_t* tab, uint32_t w, int s, uint32_t (&hi)[2],
                             uint32_t (&lo)[2]) {
  if (BITS == 4) {
    uint32_t hi1[2], lo1[2];
    code_byte_pairs<4>(tab, (w >> (16 * (s % 2))) & 0xFFu, hi, lo);
    code_byte_pairs<4>(tab, (w >> (16 * (s % 2) + 8)) & 0xFFu, hi1, lo1);
    hi[1] = hi1[0], lo[1] = lo1[0];
  } else {
    code_byte_pairs<2>(tab, (w >> (8 * (s % 2))) & 0xFFu, hi, lo);
  }
}

// Pass 1: scores[t][g] of n_tok tokens; qs: the group's rotated queries times scale
// ([GMAX][head_dim] f32, shared). Half 0 stores the scores, half 1 adds to them (the same
// lane both times).
template <int BITS, int GMAX>
PKV_DEV void qk_scores_mma_codes(const float* qs, int group, int head_dim,
                                 const uint8_t* __restrict__ k_pool, const int64_t* rows,
                                 int64_t row_bytes, int n_tok, const uint32_t* tab,
                                 float* scores) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const int gid = lane / 4, t = lane % 4;
  const int n_groups = (n_tok + 7) / 8;
  // The warp's groups are warp, warp + n_warps, ... < n_groups, in each half. Both halves
  // of head_dim 256 run as one sequence of steps (a cursor: group, then half), so the loads
  // in flight carry on across the half boundary instead of draining and starting again.
  const int n_halves = warp < n_groups ? head_dim / 128 : 0;
  uint32_t tab_base = 0u;
  if constexpr (CODE_NIBBLE_PRMT) tab_base = smem_window((const uint8_t*)tab);
  struct Step {
    int grp, half;
  };
  auto next = [&](Step& at) {  // no division on the way
    at.grp += n_warps;
    if (at.grp >= n_groups) at.grp = warp, ++at.half;
  };
  struct Raw {
    uint32_t w[4];  // dims 32i + 8t .. + 7 of token gid (BITS 2: the low 16 bits)
    float cnorm;    // token gid's
  };
  auto load = [&](Raw& kr, const Step& at) {  // past n_tok: the last token again (never stored)
    const uint8_t* row = k_pool + rows[min(8 * at.grp + gid, n_tok - 1)] * row_bytes;
    const int code0 = PKV_KV_CNORM_BYTES + 128 * at.half * BITS / 8;
    kr.cnorm = *(const float*)row;
#pragma unroll
    for (int i = 0; i < 4; ++i) kr.w[i] = code_quad_word<BITS>(row, code0, i, t);
  };
  // PKV_ATTN_CODES_PREFETCH steps' loads in flight while one step computes (a ring in
  // registers, shifted by one each step: plain moves).
  constexpr int AHEAD = PKV_ATTN_CODES_PREFETCH;
  Raw ring[AHEAD + 1];
  Step ahead = {warp, 0};  // the next step to load
#pragma unroll
  for (int a = 0; a < AHEAD; ++a)
    if (ahead.half < n_halves) load(ring[a], ahead), next(ahead);
  uint32_t qa[8][4];
  for (Step at = {warp, 0}; at.half < n_halves; next(at)) {
    // uniform per warp: the mma sees a whole warp
    const int grp = at.grp, half = at.half;
    if (grp == warp) q_fragments<KV_F16>(qs + 128 * half, group, head_dim, 1.0f, qa);
    if (ahead.half < n_halves) load(ring[AHEAD], ahead), next(ahead);
    const Raw& cur = ring[0];
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      uint32_t hi0[2], lo0[2];
      if constexpr (CODE_NIBBLE_PRMT) {  // code_step_pairs' bytes, by nibble_pair
        const NibbleOffsets o = nibble_offsets<BITS>(cur.w[s / 2]);
#pragma unroll
        for (int i = 0; i < 2; ++i)
          nibble_pair<BITS>(tab_base, o, BITS == 4 ? 2 * (s % 2) + i : s % 2, i, hi0[i], lo0[i]);
      } else {
        code_step_pairs<BITS>(tab, cur.w[s / 2], s, hi0, lo0);
      }
      mma_f16_16x8x16(c, qa[s], hi0[0], hi0[1]);
      mma_f16_16x8x16(c, qa[s], lo0[0], lo0[1]);
    }
    // Column 2t / 2t + 1 is token 8 grp + 2t / + 1: its cnorm is on lane 8t / 8t + 4.
    const float cn0 = __uint_as_float(shfl_word(__float_as_uint(cur.cnorm), 8 * t));
    const float cn1 = __uint_as_float(shfl_word(__float_as_uint(cur.cnorm), 8 * t + 4));
    const float s0 = (c[0] + c[2]) * (cn0 * (1.0f / CODE_TABLE_SCALE));
    const float s1 = (c[1] + c[3]) * (cn1 * (1.0f / CODE_TABLE_SCALE));
    const int tok = 8 * grp + 2 * t;
    if (gid < GMAX) {
      if (tok < n_tok) scores[tok * GMAX + gid] = half ? scores[tok * GMAX + gid] + s0 : s0;
      if (tok + 1 < n_tok)
        scores[(tok + 1) * GMAX + gid] = half ? scores[(tok + 1) * GMAX + gid] + s1 : s1;
    }
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) ring[a] = ring[a + 1];
  }
}

// B element of the code passes' pass 2 (f16 bits): x = p_t * cnorm_t, or its remainder on
// the remainder columns (NVIDIA gid >= 4, AMD i >= 8).
PKV_DEV uint32_t codes_p_bits(float x, bool rest) {
  const uint32_t hi = pkv_float_to_half_bits(x);
  return rest ? pkv_float_to_half_bits(x - pkv_half_bits_to_float((uint16_t)hi)) : hi;
}

// The output dim of m-tile mt's row gid in pass 2 (row gid + 8: the next dim), in the half.
template <int BITS>
PKV_DEV int pv_codes_dim(int mt, int gid) {
  return BITS == 4 ? 64 * (mt / 4) + 8 * gid + 2 * (mt % 4) : 16 * gid + 4 * (mt / 2) + 2 * (mt % 2);
}

// Pass 2 over dims 128 half .. + 127 of a rotated V: o as pv_mma's (columns 0-3 after the
// remainder fold), scaled back from the table scale; the sums stay in the V basis.
template <int BITS, int GMAX>
PKV_DEV void pv_mma_codes(const float* scores, const uint8_t* __restrict__ v_pool,
                          const int64_t* rows, int64_t row_bytes, int n_tok, int half,
                          const uint32_t* tab, float (&o)[8][4]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const int gid = lane / 4, t = lane % 4;
  const int code0 = PKV_KV_CNORM_BYTES + 128 * half * BITS / 8;
#pragma unroll
  for (int mt = 0; mt < 8; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
  struct Raw {
    uint32_t w[4][2];  // [token 4t + j]: code bytes 4 gid .. + 3 (and 32 + 4 gid .. at 4 bits)
    float cnorm[4];
  };
  const int n_steps = (n_tok + 15) / 16;
  auto load = [&](Raw& vr, int st) {  // past n_tok: the last token again (its p is 0)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint8_t* row = v_pool + rows[min(16 * st + 4 * t + j, n_tok - 1)] * row_bytes;
      vr.cnorm[j] = *(const float*)row;
      vr.w[j][0] = *(const uint32_t*)(row + code0 + 4 * gid);
      vr.w[j][1] = BITS == 4 ? *(const uint32_t*)(row + code0 + 32 + 4 * gid) : 0u;
    }
  };
  const int head = gid % 4;
  const bool rest = gid >= 4, live = head < GMAX;
  uint32_t tab_base = 0u;
  if constexpr (CODE_NIBBLE_PRMT) tab_base = smem_window((const uint8_t*)tab);
  auto x_pair = [&](const float (&x)[4], int k) {  // B: tokens 4t + 2k, + 1
    return codes_p_bits(x[2 * k], rest) | codes_p_bits(x[2 * k + 1], rest) << 16;
  };
  // PKV_ATTN_CODES_PREFETCH steps' loads in flight while one computes, as pass 1.
  constexpr int AHEAD = PKV_ATTN_CODES_PREFETCH;
  Raw ring[AHEAD + 1];
#pragma unroll
  for (int a = 0; a < AHEAD; ++a)
    if (warp + a * n_warps < n_steps) load(ring[a], warp + a * n_warps);
  for (int st = warp; st < n_steps; st += n_warps) {  // uniform per warp: the mma sees a whole warp
    if (st + AHEAD * n_warps < n_steps) load(ring[AHEAD], st + AHEAD * n_warps);
    const Raw& cur = ring[0];
    float x[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int tok = 16 * st + 4 * t + j;
      x[j] = live && tok < n_tok ? scores[tok * GMAX + (live ? head : 0)] * cur.cnorm[j] : 0.0f;
    }
    const uint32_t b0 = x_pair(x, 0), b1 = x_pair(x, 1);
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) {
      // The code byte of each token that holds m-tile mt's dims, and the pair within it.
      const int word = BITS == 4 ? mt / 4 : 0, byte = BITS == 4 ? mt % 4 : mt / 2;
      const int pair = BITS == 4 ? 0 : mt % 2;
      uint32_t ah[4], al[4];  // rows gid (even dim) / gid + 8 (odd) of tokens 4t .. 4t + 3
      if (BITS == 4 && CODE_NIBBLES) {
        // A token's byte holds the even dim's code (low nibble) and the odd one's; each
        // entry is {hi, lo} of one code, so a permute of two tokens' entries is a register.
        uint32_t ev[4], od[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if constexpr (CODE_NIBBLE_PRMT) {
            const NibbleOffsets o = nibble_offsets<BITS>(cur.w[j][word]);
            ev[j] = nibble_entry<BITS>(tab_base, o, byte, false).x;
            od[j] = nibble_entry<BITS>(tab_base, o, byte, true).x;
          } else {
            const uint32_t b = cur.w[j][word] >> (8 * byte);
            ev[j] = tab[b & 15u], od[j] = tab[(b >> 4) & 15u];
          }
        }
        ah[0] = __byte_perm(ev[0], ev[1], 0x5410), ah[1] = __byte_perm(od[0], od[1], 0x5410);
        ah[2] = __byte_perm(ev[2], ev[3], 0x5410), ah[3] = __byte_perm(od[2], od[3], 0x5410);
        al[0] = __byte_perm(ev[0], ev[1], 0x7632), al[1] = __byte_perm(od[0], od[1], 0x7632);
        al[2] = __byte_perm(ev[2], ev[3], 0x7632), al[3] = __byte_perm(od[2], od[3], 0x7632);
      } else {
        uint32_t hi[4], lo[4];  // the pair (dims 2 pair, + 1) of each token's byte
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t b = cur.w[j][word] >> (8 * byte);
          if constexpr (BITS == 2 && CODE_NIBBLE_PRMT) {
            nibble_pair<BITS>(tab_base, nibble_offsets<BITS>(cur.w[j][word]), byte, pair, hi[j],
                              lo[j]);
          } else if (BITS == 4) {
            uint32_t h[2], l[2];
            code_byte_pairs<4>(tab, b, h, l);
            hi[j] = h[0], lo[j] = l[0];
          } else {
            code_pair2(tab, b, pair, hi[j], lo[j]);
          }
        }
        // Row gid (even dim): low halves of tokens (4t, 4t + 1) / (4t + 2, 4t + 3); gid + 8: high.
        ah[0] = __byte_perm(hi[0], hi[1], 0x5410), ah[1] = __byte_perm(hi[0], hi[1], 0x7632);
        ah[2] = __byte_perm(hi[2], hi[3], 0x5410), ah[3] = __byte_perm(hi[2], hi[3], 0x7632);
        al[0] = __byte_perm(lo[0], lo[1], 0x5410), al[1] = __byte_perm(lo[0], lo[1], 0x7632);
        al[2] = __byte_perm(lo[2], lo[3], 0x5410), al[3] = __byte_perm(lo[2], lo[3], 0x7632);
      }
      mma_f16_16x8x16(o[mt], ah, b0, b1);
      mma_f16_16x8x16(o[mt], al, b0, b1);
    }
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) ring[a] = ring[a + 1];
  }
  // Columns 4-7 (remainders) live on lanes t + 2: add them to columns 0-3; undo the scale.
#pragma unroll
  for (int mt = 0; mt < 8; ++mt)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      o[mt][r] = (o[mt][r] + pkv_shfl_xor(o[mt][r], 2)) * (1.0f / CODE_TABLE_SCALE);
}

// Compressed KV on AMD matrix cores: the same code-byte tables (hi + lo f16 pairs, scaled by
// CODE_TABLE_SCALE) and the same hi + remainder split of q and of P, in the f16 passes'
// layouts, 128 dims at a time; GMAX <= 8 (16 A rows / B columns: 8 heads and their
// remainders). Compile-checked and emulated only (tests/test_attention_codes_amd_simulated.py),
// never run on an AMD GPU; the _mma kernels run them on CDNA / gfx11 (docs/kernels.md, "AMD
// matrix cores").
// MFMA (wave64; layouts of qk_scores_mfma / pv_mfma). Pass 1: A is q_fragments_mfma of the
// rotated queries; k-step s takes dims 32(s/2) + 8q + 4(s%2) + 0..3, qk_scores_mma_codes'
// order with t = q, so lane (i, q) reads token 16 grp + i's code words as lane t does there
// and B is code_step_pairs' hi (then lo) pairs. Head g's score is (D[g] + D[g + 8]) * cnorm
// / 64: lanes q < 2 hold rows 4q + r, lanes q + 2 the remainders; every lane has its
// token's cnorm. Pass 2: m-tile j's row i is dim 8i + j of the half, pv_mfma's mapping at
// DPL 8: lane i reads the code bytes of dims 8i .. 8i + 7 (a word at 4 bits, 16 bits at 2) of
// tokens 16 st + 4q + e, and pair p of them (dims 8i + 2p, + 1) gives m-tiles 2p (low
// halves) and 2p + 1 (high halves), the four tokens' halves packed as pv_mfma packs them.
// B column i is head i % 8's p_t * cnorm_t as f16 (i < 8) or its remainder (i >= 8).
// WMMA (wave32; layouts of qk_scores_wmma / pv_wmma). Pass 1: k-step s is dims 16s .. 16s +
// 15, code bytes 2 BITS s .. of token 16 grp + i, word w of B the pair of dims 16s + 2w, + 1;
// head g = 2r + hw is registers r and r + 4 of the lane's token. Pass 2: m-tile j's row i is
// dim 8i + j as on MFMA, over the 16 tokens of the step (the half-waves hold the same
// operands); o[j] register r is dim 8 (2r + hw) + j.

#if PKV_ATTN_MFMA || PKV_ATTN_WMMA
// A lane's code bytes of dims 8i .. 8i + 7 of a half (`codes`: its first code byte): a word at
// 4 bits, the low 16 bits at 2; pair p of them is byte p (4 bits) or half p % 2 of byte p / 2.
template <int BITS>
PKV_DEV uint32_t code_lane_word(const uint8_t* codes, int i) {
  return BITS == 4 ? *(const uint32_t*)(codes + 4 * i) : (uint32_t)*(const uint16_t*)(codes + 2 * i);
}

#endif

#if PKV_ATTN_MFMA
template <int BITS, int GMAX>
PKV_DEV void qk_scores_mfma_codes(const float* qs, int group, int head_dim,
                                  const uint8_t* __restrict__ k_pool, const int64_t* rows,
                                  int64_t row_bytes, int n_tok, const uint32_t* tab,
                                  float* scores) {
  const int lane = threadIdx.x % 64, wave = threadIdx.x / 64, n_waves = blockDim.x / 64;
  const int i = lane % 16, q = lane / 16;
  const int n_groups = (n_tok + 15) / 16;
  for (int half = 0; half < head_dim / 128; ++half) {
    pkv_u32x2 qa[8];
    q_fragments_mfma<KV_F16>(qs + 128 * half, group, head_dim, 1.0f, qa);
    const int code0 = PKV_KV_CNORM_BYTES + 128 * half * BITS / 8;
    struct Raw {
      uint32_t w[4];  // code_quad_word l of token 16 grp + i
      float cnorm;
    };
    auto load = [&](Raw& kr, int grp) {  // past n_tok: the last token again (never stored)
      const uint8_t* row = k_pool + rows[min(16 * grp + i, n_tok - 1)] * row_bytes;
      kr.cnorm = *(const float*)row;
#pragma unroll
      for (int l = 0; l < 4; ++l) kr.w[l] = code_quad_word<BITS>(row, code0, l, q);
    };
    Raw cur, nxt;
    int grp = wave;
    if (grp < n_groups) load(cur, grp);
    for (; grp < n_groups; grp += n_waves) {  // uniform per wavefront: the MFMA sees all of it
      if (grp + n_waves < n_groups) load(nxt, grp + n_waves);
      pkv_f32x4 c = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        uint32_t hi[2], lo[2];
        code_step_pairs<BITS>(tab, cur.w[s / 2], s, hi, lo);
        c = mfma_16x16x16<KV_F16>(qa[s], pkv_u32x2{hi[0], hi[1]}, c);
        c = mfma_16x16x16<KV_F16>(qa[s], pkv_u32x2{lo[0], lo[1]}, c);
      }
      const int tok = 16 * grp + i;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float rest = pkv_shfl_xor(c[r], 32);  // lane q + 2: row 4q + r + 8
        const int g = 4 * q + r;
        const float sc = (c[r] + rest) * (cur.cnorm * (1.0f / CODE_TABLE_SCALE));
        if (q < 2 && g < GMAX && tok < n_tok)
          scores[tok * GMAX + g] = half ? scores[tok * GMAX + g] + sc : sc;
      }
      cur = nxt;
    }
  }
}

template <int BITS, int GMAX>
PKV_DEV void pv_mfma_codes(const float* scores, const uint8_t* __restrict__ v_pool,
                           const int64_t* rows, int64_t row_bytes, int n_tok, int half,
                           const uint32_t* tab, pkv_f32x4 (&o)[8]) {
  const int lane = threadIdx.x % 64, wave = threadIdx.x / 64, n_waves = blockDim.x / 64;
  const int i = lane % 16, q = lane / 16;
  const int code0 = PKV_KV_CNORM_BYTES + 128 * half * BITS / 8;
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = pkv_f32x4{0.0f, 0.0f, 0.0f, 0.0f};
  const int head = i % 8;
  const bool rest = i >= 8, live = head < GMAX;
  const int n_steps = (n_tok + 15) / 16;
  for (int st = wave; st < n_steps; st += n_waves) {  // uniform per wavefront
    uint32_t w[4], pb[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // past n_tok: the last token's codes, p 0
      const int tok = 16 * st + 4 * q + e;
      const uint8_t* row = v_pool + rows[min(tok, n_tok - 1)] * row_bytes;
      w[e] = code_lane_word<BITS>(row + code0, i);
      const float x =
          live && tok < n_tok ? scores[tok * GMAX + (live ? head : 0)] * *(const float*)row : 0.0f;
      pb[e] = codes_p_bits(x, rest);
    }
    const pkv_u32x2 b = {pb[0] | pb[1] << 16, pb[2] | pb[3] << 16};
#pragma unroll
    for (int by = 0; by < BITS; ++by) {  // the lane's code bytes: BITS of them
      uint32_t hi[4][2], lo[4][2];
#pragma unroll
      for (int e = 0; e < 4; ++e) code_byte_pairs<BITS>(tab, (w[e] >> (8 * by)) & 0xFFu, hi[e], lo[e]);
#pragma unroll
      for (int k = 0; k < 4 / BITS; ++k) {  // pair p = by * 4 / BITS + k: m-tiles 2p, 2p + 1
        const int p = by * (4 / BITS) + k;
#pragma unroll
        for (int up = 0; up < 2; ++up) {
          const pkv_u32x2 ah = {pair_halves(hi[0][k], hi[1][k], up), pair_halves(hi[2][k], hi[3][k], up)};
          const pkv_u32x2 al = {pair_halves(lo[0][k], lo[1][k], up), pair_halves(lo[2][k], lo[3][k], up)};
          o[2 * p + up] = mfma_16x16x16<KV_F16>(ah, b, o[2 * p + up]);
          o[2 * p + up] = mfma_16x16x16<KV_F16>(al, b, o[2 * p + up]);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      o[j][r] = (o[j][r] + pkv_shfl_xor(o[j][r], 8)) * (1.0f / CODE_TABLE_SCALE);
}
#endif

#if PKV_ATTN_WMMA
template <int BITS, int GMAX>
PKV_DEV void qk_scores_wmma_codes(const float* qs, int group, int head_dim,
                                  const uint8_t* __restrict__ k_pool, const int64_t* rows,
                                  int64_t row_bytes, int n_tok, const uint32_t* tab,
                                  float* scores) {
  const int lane = threadIdx.x % 32, wave = threadIdx.x / 32, n_waves = blockDim.x / 32;
  const int i = lane % 16, hw = lane / 16;
  const int n_groups = (n_tok + 15) / 16;
  constexpr int WORDS = 4 * BITS;  // code words of a half's 128 dims
  for (int half = 0; half < head_dim / 128; ++half) {
    pkv_u32x8 qa[8];
    q_fragments_wmma<KV_F16>(qs + 128 * half, group, head_dim, 1.0f, qa);
    const int code0 = PKV_KV_CNORM_BYTES + 128 * half * BITS / 8;
    for (int grp = wave; grp < n_groups; grp += n_waves) {  // uniform per wave
      const int tok = 16 * grp + i;  // past n_tok: the last token again (never stored)
      const uint8_t* row = k_pool + rows[min(tok, n_tok - 1)] * row_bytes;
      const float cnorm = *(const float*)row;
      uint32_t w[WORDS];
#pragma unroll
      for (int x = 0; x < WORDS; ++x) w[x] = *(const uint32_t*)(row + code0 + 4 * x);
      pkv_f32x8 c = {};
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        pkv_u32x8 bh, bl;
#pragma unroll
        for (int by = 0; by < 2 * BITS; ++by) {  // code byte x of the half: dims 8x / BITS ..
          const int x = 2 * BITS * s + by;
          uint32_t h[2], l[2];
          code_byte_pairs<BITS>(tab, (w[x / 4] >> (8 * (x % 4))) & 0xFFu, h, l);
#pragma unroll
          for (int k = 0; k < 4 / BITS; ++k) bh[by * (4 / BITS) + k] = h[k], bl[by * (4 / BITS) + k] = l[k];
        }
        c = wmma_16x16x16<KV_F16>(qa[s], bh, c);
        c = wmma_16x16x16<KV_F16>(qa[s], bl, c);
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // head g = 2r + hw: rows g (value) and g + 8 (remainder)
        const int g = 2 * r + hw;
        const float sc = (c[r] + c[r + 4]) * (cnorm * (1.0f / CODE_TABLE_SCALE));
        if (g < GMAX && tok < n_tok) scores[tok * GMAX + g] = half ? scores[tok * GMAX + g] + sc : sc;
      }
    }
  }
}

template <int BITS, int GMAX>
PKV_DEV void pv_wmma_codes(const float* scores, const uint8_t* __restrict__ v_pool,
                           const int64_t* rows, int64_t row_bytes, int n_tok, int half,
                           const uint32_t* tab, pkv_f32x8 (&o)[8]) {
  const int lane = threadIdx.x % 32, wave = threadIdx.x / 32, n_waves = blockDim.x / 32;
  const int i = lane % 16;
  const int code0 = PKV_KV_CNORM_BYTES + 128 * half * BITS / 8;
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = pkv_f32x8{};
  const int head = i % 8;
  const bool rest = i >= 8, live = head < GMAX;
  const int n_steps = (n_tok + 15) / 16;
  for (int st = wave; st < n_steps; st += n_waves) {  // uniform per wave
    uint32_t w[16];  // token 16 st + k: code_lane_word
    pkv_u32x8 b;
#pragma unroll
    for (int k = 0; k < 16; ++k) {  // past n_tok: the last token's codes, p 0
      const int tok = 16 * st + k;
      const uint8_t* row = v_pool + rows[min(tok, n_tok - 1)] * row_bytes;
      w[k] = code_lane_word<BITS>(row + code0, i);
      const float x =
          live && tok < n_tok ? scores[tok * GMAX + (live ? head : 0)] * *(const float*)row : 0.0f;
      const uint32_t bits = codes_p_bits(x, rest);
      if (k % 2 == 0) b[k / 2] = bits;
      else b[k / 2] |= bits << 16;
    }
#pragma unroll
    for (int by = 0; by < BITS; ++by) {  // the lane's code bytes: BITS of them
      uint32_t hi[16][2], lo[16][2];
#pragma unroll
      for (int k = 0; k < 16; ++k) code_byte_pairs<BITS>(tab, (w[k] >> (8 * by)) & 0xFFu, hi[k], lo[k]);
#pragma unroll
      for (int k = 0; k < 4 / BITS; ++k) {  // pair p = by * 4 / BITS + k: m-tiles 2p, 2p + 1
        const int p = by * (4 / BITS) + k;
#pragma unroll
        for (int up = 0; up < 2; ++up) {
          pkv_u32x8 ah, al;
#pragma unroll
          for (int x = 0; x < 8; ++x) {  // tokens 2x, 2x + 1
            ah[x] = pair_halves(hi[2 * x][k], hi[2 * x + 1][k], up);
            al[x] = pair_halves(lo[2 * x][k], lo[2 * x + 1][k], up);
          }
          o[2 * p + up] = wmma_16x16x16<KV_F16>(ah, b, o[2 * p + up]);
          o[2 * p + up] = wmma_16x16x16<KV_F16>(al, b, o[2 * p + up]);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 8; ++r)
      o[j][r] = (o[j][r] + pkv_shfl_xor(o[j][r], 8)) * (1.0f / CODE_TABLE_SCALE);
}
#endif

// MMA: pass 1 on tensor cores (qk_scores_mma_codes) and, for a rotated V, pass 2 too
// (pv_mma_codes; a q8 V keeps the CUDA-core pass 2). The caller checks the conditions.
template <int KBITS, int KROT, int VBITS, int VROT, int GMAX, bool MMA = false>
PKV_DEV void paged_attention_quant_partition(
    const float* __restrict__ q, const uint8_t* __restrict__ k_pool,
    const uint8_t* __restrict__ v_pool, const int32_t* __restrict__ block_tables,
    const int32_t* __restrict__ seq_lens, float* __restrict__ part_out,
    float* __restrict__ part_max, float* __restrict__ part_sum, float scale, int num_heads,
    int kv_heads, int head_dim, int block_size, int table_width, int max_partitions, int part_tokens) {
  constexpr bool V_Q8 = VBITS == 8;
  // the NVIDIA _mma kernels' own partition (pkg/include/pagedkv/launch.h says why)
  constexpr int PARTITION = MMA && !PKV_ATTN_MFMA && !PKV_ATTN_WMMA ? PKV_ATTN_PARTITION_QKV_MMA
                                                                 : PKV_ATTN_PARTITION_QKV;
  extern __shared__ float smem[];  // scores[PARTITION][GMAX], later the cross-warp sums
  __shared__ int64_t rows[PARTITION];
  __shared__ float red[PKV_ATTN_THREADS / PKV_WARP_SIZE][GMAX];
  constexpr bool V_MMA = MMA && !V_Q8;  // pass 2 on tensor cores
  // The group's queries, rotated into the K basis; with V_MMA later the warps' partial
  // outputs ([n_warps][GMAX][head_dim]: the scores they would overwrite in smem are read
  // by both halves of pass 2).
  __shared__ float qs[V_MMA ? PKV_ATTN_THREADS / PKV_WARP_SIZE * GMAX * 256 : GMAX * 256];
  __shared__ float ctab_k[MMA ? 1 : 16], ctab_v[MMA || V_Q8 ? 1 : 16];
  __shared__ __align__(CODE_TABLE_ALIGN) uint32_t
      tab_k[MMA ? CODE_TABLE_ENTRIES * CODE_TABLE_WORDS<KBITS> : 1];
  __shared__ __align__(CODE_TABLE_ALIGN) uint32_t
      tab_v[V_MMA ? CODE_TABLE_ENTRIES * CODE_TABLE_WORDS<VBITS> : 1];
  // What a launch gets without an opt-in (the launcher asks for none): 48 KB on NVIDIA, the
  // 64 KB of LDS a workgroup has on AMD. These arrays, the tables' alignment and the dynamic
  // part the launcher reserves (attention_shared_bytes: the scores, and room for the warps'
  // partial outputs unless a rotated V's AMD matrix-core pass 2 keeps them in qs) must fit.
#if defined(__HIPCC__)
  constexpr int SHARED_LIMIT = 64 * 1024;
  constexpr bool PARTIALS_IN_QS = V_MMA;
#else
  constexpr int SHARED_LIMIT = 48 * 1024;
  constexpr bool PARTIALS_IN_QS = false;  // reserved anyway (the same size at 4 warps)
#endif
  constexpr int PARTIAL_FLOATS = PARTIALS_IN_QS ? 0 : PKV_ATTN_THREADS / PKV_WARP_SIZE * GMAX * 256;
  static_assert(sizeof(rows) + sizeof(red) + sizeof(qs) + sizeof(ctab_k) + sizeof(ctab_v) +
                        sizeof(tab_k) + sizeof(tab_v) + 2 * CODE_TABLE_ALIGN +
                        4 * (PARTITION * GMAX > PARTIAL_FLOATS ? PARTITION * GMAX
                                                               : PARTIAL_FLOATS) <=
                    SHARED_LIMIT,
                "compressed-KV attention: over the shared memory a launch gets");

  const int part = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
  const int group = num_heads / kv_heads;
  const int seq_len = seq_lens[seq];
  // The launch's tokens per partition (PagedAttention splits short contexts finer so a
  // small batch still fills the GPU); PARTITION, the most, sizes the shared arrays.
  const int part_len = part_tokens > 0 && part_tokens < PARTITION ? part_tokens : PARTITION;
  const int start = part * part_len;
  if (start >= seq_len) return;  // the reduce reads only partitions below seq_len
  const int n_tok = min(part_len, seq_len - start);

  const int lane = threadIdx.x % PKV_WARP_SIZE, warp = threadIdx.x / PKV_WARP_SIZE;
  const int n_warps = PKV_ATTN_THREADS / PKV_WARP_SIZE;
  const int lanes_per_token = head_dim / 8;
  const int tokens_per_warp = PKV_WARP_SIZE / lanes_per_token;
  const int d0 = (lane % lanes_per_token) * 8;
  const int sub = lane / lanes_per_token;
  const int stride = n_warps * tokens_per_warp;
  const int64_t k_row_bytes = PKV_KV_CNORM_BYTES + head_dim * KBITS / 8;
  const int64_t v_row_bytes = V_Q8 ? (int64_t)pkv_kvq8_row_bytes(head_dim)
                                   : PKV_KV_CNORM_BYTES + head_dim * VBITS / 8;

  if constexpr (MMA) {
    build_code_table<KBITS>(tab_k, kKvCentroids + pkv_kv_centroid_offset(KBITS, KROT));
    if constexpr (V_MMA)
      build_code_table<VBITS>(tab_v, kKvCentroids + pkv_kv_centroid_offset(VBITS, VROT));
  } else if (threadIdx.x < 16) {
    const int t = threadIdx.x;
    ctab_k[t] = kKvCentroids[pkv_kv_centroid_offset(KBITS, KROT) + min(t, (1 << KBITS) - 1)];
    if (!V_Q8)
      ctab_v[t] = kKvCentroids[pkv_kv_centroid_offset(VBITS, VROT) + min(t, (1 << VBITS) - 1)];
  }
  for (int e = threadIdx.x; e < GMAX * head_dim; e += PKV_ATTN_THREADS) {
    const int g = e / head_dim;
    const int h = kvh * group + (g < group ? g : 0);
    qs[e] = q[((int64_t)seq * num_heads + h) * head_dim + e % head_dim] * scale;
  }
  for (int t = threadIdx.x; t < n_tok; t += PKV_ATTN_THREADS) {
    const int pos = start + t;
    const int64_t block = block_tables[(int64_t)seq * table_width + pos / block_size];
    rows[t] = (block * block_size + pos % block_size) * kv_heads + kvh;
  }
  __syncthreads();
  rotate_shared<KROT>(qs, GMAX * head_dim, false);
  // Pass 1: scores (the reduce-scatter of the kernel above: each lane ends with one
  // head's dot product), times the row's cnorm.
  float* scores = smem;
  const int step = stride * PKV_ATTN_UNROLL;
  const int first = warp * tokens_per_warp;
  if constexpr (MMA) {
#if PKV_ATTN_MFMA
    qk_scores_mfma_codes<KBITS, GMAX>(qs, group, head_dim, k_pool, rows, k_row_bytes, n_tok,
                                      tab_k, scores);
#elif PKV_ATTN_WMMA
    qk_scores_wmma_codes<KBITS, GMAX>(qs, group, head_dim, k_pool, rows, k_row_bytes, n_tok,
                                      tab_k, scores);
#else
    qk_scores_mma_codes<KBITS, GMAX>(qs, group, head_dim, k_pool, rows, k_row_bytes, n_tok,
                                     tab_k, scores);
#endif
  } else {
    float qv[GMAX][8];
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
#pragma unroll
      for (int i = 0; i < 8; ++i) qv[g][i] = qs[g * head_dim + d0 + i];
    RawCodes8 cur[PKV_ATTN_UNROLL], nxt[PKV_ATTN_UNROLL];
    auto load_k = [&](int t0, RawCodes8 (&raw)[PKV_ATTN_UNROLL]) {
#pragma unroll
      for (int u = 0; u < PKV_ATTN_UNROLL; ++u) {
        const int t = t0 + u * stride;
        if (t < n_tok) load_codes8<KBITS>(k_pool + rows[t] * k_row_bytes, d0, raw[u]);
        else zero_codes8(raw[u]);
      }
    };
    if (first < n_tok) load_k(first + sub, cur);
    for (int w0 = first; w0 < n_tok; w0 += step) {
      const int t0 = w0 + sub;
      if (w0 + step < n_tok) load_k(t0 + step, nxt);
#pragma unroll
      for (int u = 0; u < PKV_ATTN_UNROLL; ++u) {
        const int t = t0 + u * stride;
        float kv[8];
        lookup8<KBITS>(cur[u], ctab_k, kv);
        float s[GMAX];
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
          s[g] = 0.0f;
#pragma unroll
          for (int i = 0; i < 8; ++i) s[g] += qv[g][i] * kv[i];
        }
        int o = lanes_per_token / 2, head = 0;
#pragma unroll
        for (int half = GMAX / 2; half >= 1; half /= 2) {
          const bool upper = (lane & o) != 0;
#pragma unroll
          for (int g = 0; g < half; ++g) {
            const float send = upper ? s[g] : s[g + half];
            const float keep = upper ? s[g + half] : s[g];
            s[g] = keep + pkv_shfl_xor(send, o);
          }
          head += upper ? half : 0;
          o >>= 1;
        }
        for (; o > 0; o >>= 1) s[0] += pkv_shfl_xor(s[0], o);
        if (t < n_tok && (lane % lanes_per_token) % (lanes_per_token / GMAX) == 0)
          scores[t * GMAX + head] = s[0] * cur[u].cnorm;
      }
#pragma unroll
      for (int u = 0; u < PKV_ATTN_UNROLL; ++u) cur[u] = nxt[u];
    }
  }
  __syncthreads();
  // Partition max and the probabilities (unnormalized) with their sum, as above.
  float tmax[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) tmax[g] = -INFINITY;
  for (int t = threadIdx.x; t < n_tok; t += PKV_ATTN_THREADS)
#pragma unroll
    for (int g = 0; g < GMAX; ++g) tmax[g] = fmaxf(tmax[g], scores[t * GMAX + g]);
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    float m = tmax[g];
    for (int o = PKV_WARP_SIZE / 2; o > 0; o >>= 1) m = fmaxf(m, pkv_shfl_xor(m, o));
    if (lane == 0) red[warp][g] = m;
  }
  __syncthreads();
  float pmax[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    pmax[g] = red[0][g];
    for (int w = 1; w < n_warps; ++w) pmax[g] = fmaxf(pmax[g], red[w][g]);
  }
  float tsum[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) tsum[g] = 0.0f;
  for (int t = threadIdx.x; t < n_tok; t += PKV_ATTN_THREADS) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      const float p = expf(scores[t * GMAX + g] - pmax[g]);
      scores[t * GMAX + g] = p;
      tsum[g] += p;
    }
  }
  __syncthreads();  // everyone has read red[] (pmax) before it is reused
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    float s = tsum[g];
    for (int o = PKV_WARP_SIZE / 2; o > 0; o >>= 1) s += pkv_shfl_xor(s, o);
    if (lane == 0) red[warp][g] = s;
  }
  __syncthreads();

  float* wsum = smem;  // [n_warps][GMAX][head_dim]
  if constexpr (V_MMA) {
    // Pass 2 on tensor cores, 128 dims at a time, into qs (scores stay readable).
    wsum = qs;
    for (int half = 0; half < head_dim / 128; ++half) {
#if PKV_ATTN_MFMA
      pkv_f32x4 o[8];
      pv_mfma_codes<VBITS, GMAX>(scores, v_pool, rows, v_row_bytes, n_tok, half, tab_v, o);
      const int i = lane % 16, q = lane / 16;
      if (i < GMAX) {  // lane i holds head i; o[j][r]: D row 4q + r, dim 8 (4q + r) + j
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r)
            wsum[(warp * GMAX + i) * head_dim + 128 * half + 8 * (4 * q + r) + j] = o[j][r];
      }
#elif PKV_ATTN_WMMA
      pkv_f32x8 o[8];
      pv_wmma_codes<VBITS, GMAX>(scores, v_pool, rows, v_row_bytes, n_tok, half, tab_v, o);
      const int i = lane % 16, hw = lane / 16;
      if (i < GMAX) {  // lane i holds head i; o[j][r]: D row 2r + hw, dim 8 (2r + hw) + j
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int r = 0; r < 8; ++r)
            wsum[(warp * GMAX + i) * head_dim + 128 * half + 8 * (2 * r + hw) + j] = o[j][r];
      }
#else
      const int gid = lane / 4, t = lane % 4;
      float o[8][4];
      pv_mma_codes<VBITS, GMAX>(scores, v_pool, rows, v_row_bytes, n_tok, half, tab_v, o);
      if (t < 2) {  // lane t holds heads 2t, 2t + 1; o[mt][0..1] row gid, [2..3] row gid + 8
#pragma unroll
        for (int mt = 0; mt < 8; ++mt) {
          const int d = 128 * half + pv_codes_dim<VBITS>(mt, gid);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int g = 2 * t + e;
            if (g < GMAX) {
              wsum[(warp * GMAX + g) * head_dim + d] = o[mt][e];
              wsum[(warp * GMAX + g) * head_dim + d + 1] = o[mt][2 + e];
            }
          }
        }
      }
#endif
    }
  } else {
  // Pass 2: acc = sum_t p_t * V_t over this lane's 8 dims (rotated V: p_t * cnorm_t *
  // C[code] in the VROT basis).
  float acc[GMAX][8];
#pragma unroll
  for (int g = 0; g < GMAX; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
  if constexpr (V_Q8) {
    RawRow8 cur[PKV_ATTN_UNROLL], nxt[PKV_ATTN_UNROLL];
    auto load_v = [&](int t0, RawRow8 (&raw)[PKV_ATTN_UNROLL]) {
#pragma unroll
      for (int u = 0; u < PKV_ATTN_UNROLL; ++u) {
        const int t = t0 + u * stride;
        if (t < n_tok) load_row8<KV_Q8>(v_pool + rows[t] * v_row_bytes, d0, raw[u]);
        else zero_row8(raw[u]);
      }
    };
    if (first < n_tok) load_v(first + sub, cur);
    for (int w0 = first; w0 < n_tok; w0 += step) {
      const int t0 = w0 + sub;
      if (w0 + step < n_tok) load_v(t0 + step, nxt);
#pragma unroll
      for (int u = 0; u < PKV_ATTN_UNROLL; ++u) {
        const int t = t0 + u * stride;
        if (t < n_tok) {
          float vv[8];
          convert_row8<KV_Q8>(cur[u], vv);
#pragma unroll
          for (int g = 0; g < GMAX; ++g) {
            const float p = scores[t * GMAX + g];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] += p * vv[i];
          }
        }
      }
#pragma unroll
      for (int u = 0; u < PKV_ATTN_UNROLL; ++u) cur[u] = nxt[u];
    }
  } else {
    RawCodes8 cur[PKV_ATTN_UNROLL], nxt[PKV_ATTN_UNROLL];
    auto load_v = [&](int t0, RawCodes8 (&raw)[PKV_ATTN_UNROLL]) {
#pragma unroll
      for (int u = 0; u < PKV_ATTN_UNROLL; ++u) {
        const int t = t0 + u * stride;
        if (t < n_tok) load_codes8<VBITS>(v_pool + rows[t] * v_row_bytes, d0, raw[u]);
        else zero_codes8(raw[u]);
      }
    };
    if (first < n_tok) load_v(first + sub, cur);
    for (int w0 = first; w0 < n_tok; w0 += step) {
      const int t0 = w0 + sub;
      if (w0 + step < n_tok) load_v(t0 + step, nxt);
#pragma unroll
      for (int u = 0; u < PKV_ATTN_UNROLL; ++u) {
        const int t = t0 + u * stride;
        if (t < n_tok) {
          float vv[8];
          lookup8<VBITS>(cur[u], ctab_v, vv);
#pragma unroll
          for (int g = 0; g < GMAX; ++g) {
            const float p = scores[t * GMAX + g] * cur[u].cnorm;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] += p * vv[i];
          }
        }
      }
#pragma unroll
      for (int u = 0; u < PKV_ATTN_UNROLL; ++u) cur[u] = nxt[u];
    }
  }
  // Sum the tokens_per_warp token lanes of each dim, then the warps; write the partial.
#pragma unroll
  for (int g = 0; g < GMAX; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i)
      for (int o = PKV_WARP_SIZE / 2; o >= lanes_per_token; o >>= 1)
        acc[g][i] += pkv_shfl_xor(acc[g][i], o);
  __syncthreads();  // scores are no longer read: smem now holds per-warp sums
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
#pragma unroll
      for (int i = 0; i < 8; ++i) wsum[(warp * GMAX + g) * head_dim + d0 + i] = acc[g][i];
  }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < group * head_dim; e += PKV_ATTN_THREADS) {
    const int g = e / head_dim, d = e % head_dim;
    float s = 0.0f;
    for (int w = 0; w < n_warps; ++w) s += wsum[(w * GMAX + g) * head_dim + d];
    const int64_t hp = ((int64_t)seq * num_heads + kvh * group + g) * max_partitions + part;
    part_out[hp * head_dim + d] = s;
    if (d == 0) {
      float l = 0.0f;
      for (int w = 0; w < n_warps; ++w) l += red[w][g];
      float m = pmax[0];
#pragma unroll
      for (int gg = 1; gg < GMAX; ++gg)
        if (gg == g) m = pmax[gg];  // a register array takes constant indices only
      part_max[hp] = m;
      part_sum[hp] = l;
    }
  }
}

// Kernel names: pkv_paged_attention_<K mode>_<V mode>_g<GMAX>; the modes' widths and
// rotations are those of pagedkv/kvquant.h (pkv_kv_mode_bits / pkv_kv_mode_rotation; VROT
// 0 for a q8 V).
#define PKV_ATTN_QKERNEL(KNAME, KBITS, KROT, VNAME, VBITS, VROT, GMAX)                         \
  PKV_KERNEL void __launch_bounds__(PKV_ATTN_THREADS, PKV_ATTN_MIN_BLOCKS_QKV)                   \
      pkv_paged_attention_##KNAME##_##VNAME##_g##GMAX(                                         \
          const float* q, const uint8_t* k_pool, const uint8_t* v_pool,                        \
          const int32_t* block_tables, const int32_t* seq_lens, float* part_out,               \
          float* part_max, float* part_sum, float scale, int num_heads, int kv_heads,          \
          int head_dim, int block_size, int table_width, int max_partitions, int part_tokens) {                 \
    paged_attention_quant_partition<KBITS, KROT, VBITS, VROT, GMAX>(                           \
        q, k_pool, v_pool, block_tables, seq_lens, part_out, part_max, part_sum, scale,        \
        num_heads, kv_heads, head_dim, block_size, table_width, max_partitions, part_tokens);               \
  }
#define PKV_ATTN_QKERNELS(KNAME, KBITS, KROT, VNAME, VBITS, VROT)  \
  PKV_ATTN_QKERNEL(KNAME, KBITS, KROT, VNAME, VBITS, VROT, 1)     \
  PKV_ATTN_QKERNEL(KNAME, KBITS, KROT, VNAME, VBITS, VROT, 2)     \
  PKV_ATTN_QKERNEL(KNAME, KBITS, KROT, VNAME, VBITS, VROT, 4)     \
  PKV_ATTN_QKERNEL(KNAME, KBITS, KROT, VNAME, VBITS, VROT, 8)
// Every V of one K: q8, lloyd4/3/2 (R256) and pagedkv's fwht4/fwht2 V (R128 per half; an
// fwht3 V is lloyd3's bytes and tables and runs the lloyd3 kernels).
#define PKV_ATTN_QKERNELS_ALL_V(KNAME, KBITS, KROT)     \
  PKV_ATTN_QKERNELS(KNAME, KBITS, KROT, q8, 8, 0)       \
  PKV_ATTN_QKERNELS(KNAME, KBITS, KROT, lloyd4, 4, 256) \
  PKV_ATTN_QKERNELS(KNAME, KBITS, KROT, lloyd3, 3, 256) \
  PKV_ATTN_QKERNELS(KNAME, KBITS, KROT, lloyd2, 2, 256) \
  PKV_ATTN_QKERNELS(KNAME, KBITS, KROT, fwht4, 4, 128)  \
  PKV_ATTN_QKERNELS(KNAME, KBITS, KROT, fwht2, 2, 128)

PKV_ATTN_QKERNELS_ALL_V(fwht4, 4, 128)
PKV_ATTN_QKERNELS_ALL_V(fwht3, 3, 256)
PKV_ATTN_QKERNELS_ALL_V(fwht2, 2, 128)
// K in a lloyd mode (pagedkv's extension: R256 with the matched 256-family tables); a lloyd3
// K is fwht3's bytes and runs the fwht3 kernels.
PKV_ATTN_QKERNELS_ALL_V(lloyd4, 4, 256)
PKV_ATTN_QKERNELS_ALL_V(lloyd2, 2, 256)

// The _mma kernels (pkv_paged_attention_<K>_<V>_mma_g<GMAX>): 4- or 2-bit K with a q8, 4- or
// 2-bit V on the matrix-core passes above where they apply (NVIDIA sm_80+, 32-lane warps, GMAX
// <= 4; AMD CDNA MFMA and gfx11 WMMA, GMAX <= 8; every head_dim these modes store, 128 and
// 256), elsewhere the CUDA-core passes of the kernels above. PAGEDKV_ATTN_QKV_MMA=0
// (pagedkv.kernels.kvcache) selects those instead on NVIDIA; on AMD the host takes the _mma
// kernels only when asked (PAGEDKV_ATTN_MFMA=1 / PAGEDKV_ATTN_WMMA=1).
template <int KBITS, int KROT, int VBITS, int VROT, int GMAX>
PKV_DEV void paged_attention_quant_dispatch(
    const float* q, const uint8_t* k_pool, const uint8_t* v_pool, const int32_t* block_tables,
    const int32_t* seq_lens, float* part_out, float* part_max, float* part_sum, float scale,
    int num_heads, int kv_heads, int head_dim, int block_size, int table_width,
    int max_partitions, int part_tokens) {
  static_assert(KBITS != 3 && VBITS != 3, "3-bit codes have no code-byte table");
  constexpr bool MMA_OK = PKV_ATTN_MFMA || PKV_ATTN_WMMA  // AMD: 8 heads + 8 remainders
                             ? GMAX <= 8
                             : PKV_ATTN_MMA_QK && GMAX <= 4 && PKV_WARP_SIZE == 32;
  paged_attention_quant_partition<KBITS, KROT, VBITS, VROT, GMAX, MMA_OK>(
      q, k_pool, v_pool, block_tables, seq_lens, part_out, part_max, part_sum, scale,
      num_heads, kv_heads, head_dim, block_size, table_width, max_partitions, part_tokens);
}

#define PKV_ATTN_QKERNEL_MMA(KNAME, KBITS, KROT, VNAME, VBITS, VROT, GMAX)                     \
  PKV_KERNEL void __launch_bounds__(PKV_ATTN_THREADS, PKV_ATTN_MIN_BLOCKS_QKV_MMA)               \
      pkv_paged_attention_##KNAME##_##VNAME##_mma_g##GMAX(                                     \
          const float* q, const uint8_t* k_pool, const uint8_t* v_pool,                        \
          const int32_t* block_tables, const int32_t* seq_lens, float* part_out,               \
          float* part_max, float* part_sum, float scale, int num_heads, int kv_heads,          \
          int head_dim, int block_size, int table_width, int max_partitions, int part_tokens) {                 \
    paged_attention_quant_dispatch<KBITS, KROT, VBITS, VROT, GMAX>(                            \
        q, k_pool, v_pool, block_tables, seq_lens, part_out, part_max, part_sum, scale,        \
        num_heads, kv_heads, head_dim, block_size, table_width, max_partitions, part_tokens);               \
  }
#define PKV_ATTN_QKERNELS_MMA(KNAME, KBITS, KROT, VNAME, VBITS, VROT)  \
  PKV_ATTN_QKERNEL_MMA(KNAME, KBITS, KROT, VNAME, VBITS, VROT, 1)     \
  PKV_ATTN_QKERNEL_MMA(KNAME, KBITS, KROT, VNAME, VBITS, VROT, 2)     \
  PKV_ATTN_QKERNEL_MMA(KNAME, KBITS, KROT, VNAME, VBITS, VROT, 4)     \
  PKV_ATTN_QKERNEL_MMA(KNAME, KBITS, KROT, VNAME, VBITS, VROT, 8)
// Every V of one K that has a code-byte table or is q8 (no 3-bit V).
#define PKV_ATTN_QKERNELS_MMA_ALL_V(KNAME, KBITS, KROT)     \
  PKV_ATTN_QKERNELS_MMA(KNAME, KBITS, KROT, q8, 8, 0)       \
  PKV_ATTN_QKERNELS_MMA(KNAME, KBITS, KROT, lloyd4, 4, 256) \
  PKV_ATTN_QKERNELS_MMA(KNAME, KBITS, KROT, lloyd2, 2, 256) \
  PKV_ATTN_QKERNELS_MMA(KNAME, KBITS, KROT, fwht4, 4, 128)  \
  PKV_ATTN_QKERNELS_MMA(KNAME, KBITS, KROT, fwht2, 2, 128)

PKV_ATTN_QKERNELS_MMA_ALL_V(fwht4, 4, 128)
PKV_ATTN_QKERNELS_MMA_ALL_V(fwht2, 2, 128)
PKV_ATTN_QKERNELS_MMA_ALL_V(lloyd4, 4, 256)
PKV_ATTN_QKERNELS_MMA_ALL_V(lloyd2, 2, 256)

// The partition reduce of one (seq, head), block (blockIdx.x, blockIdx.y) = (head, seq), of
// 32-lane warps (a warp per slice: hip/attention_reduce.h; the launcher gives at most
// PKV_ATTN_REDUCE_SLICES, fewer for fewer partitions). Each lane carries head_dim / 32 dims
// (head_dim 32, 64, 128 or 256). Leaves the slices' sums in `sums`, the block synced, and
// returns the head's header and its slice count.
PKV_DEV AttnCombine paged_attention_reduce_block(const float* part_out, const float* part_max,
                                                 const float* part_sum, const int32_t* seq_lens,
                                                 int num_heads, int head_dim,
                                                 int max_partitions, int partition_tokens,
                                                 AttnCombine* header, float* sums,
                                                 int& n_slices) {
  const int h = blockIdx.x, seq = blockIdx.y, lane = threadIdx.x % 32;
  const int64_t hp = ((int64_t)seq * num_heads + h) * max_partitions;
  const int n = attn_partition_count(seq_lens[seq], partition_tokens);
  n_slices = attn_slice_count(n);
  const float* pout = part_out + hp * head_dim;
  switch (head_dim) {
    case 32:
      return attn_block_slices<1>(part_max + hp, part_sum + hp, max_partitions, 1, 0,
                                  pout + lane, head_dim, n, header, sums);
    case 64:
      return attn_block_slices<2>(part_max + hp, part_sum + hp, max_partitions, 1, 0,
                                  pout + 2 * lane, head_dim, n, header, sums);
    case 128:
      return attn_block_slices<4>(part_max + hp, part_sum + hp, max_partitions, 1, 0,
                                  pout + 4 * lane, head_dim, n, header, sums);
    default:  // 256
      return attn_block_slices<8>(part_max + hp, part_sum + hp, max_partitions, 1, 0,
                                  pout + 8 * lane, head_dim, n, header, sums);
  }
}

// The reduce of a rotated V: combine the partitions in the V basis, then rotate each
// (seq, head) row back (R^T per ROT-block) before writing it. rotate_shared strides over
// the block's threads, whatever their number.
template <int ROT>
PKV_DEV void paged_attention_reduce_unrotate(const float* part_out, const float* part_max,
                                             const float* part_sum, const int32_t* seq_lens,
                                             float* out, int num_heads, int head_dim,
                                             int max_partitions, int partition_tokens) {
  __shared__ float sums[PKV_ATTN_REDUCE_SLICES * ATTN_SUMS_STRIDE];
  __shared__ float buf[256];
  __shared__ AttnCombine header[1];
  int n_slices;
  const AttnCombine c = paged_attention_reduce_block(part_out, part_max, part_sum, seq_lens,
                                                     num_heads, head_dim, max_partitions,
                                                     partition_tokens, header, sums, n_slices);
  for (int e = threadIdx.x; e < head_dim; e += blockDim.x)
    buf[e] = attn_slices_total(sums, e, n_slices, c.inv);
  __syncthreads();
  rotate_shared<ROT>(buf, head_dim, true);
  const int64_t row = ((int64_t)blockIdx.y * num_heads + blockIdx.x) * head_dim;
  for (int e = threadIdx.x; e < head_dim; e += blockDim.x) out[row + e] = buf[e];
}

// A lloyd V (or fwht3 V): R256.
PKV_KERNEL void pkv_paged_attention_reduce_ifwht256(const float* part_out, const float* part_max,
                                                    const float* part_sum, const int32_t* seq_lens,
                                                    float* out, int num_heads, int head_dim,
                                                    int max_partitions, int partition_tokens) {
  paged_attention_reduce_unrotate<256>(part_out, part_max, part_sum, seq_lens, out, num_heads,
                                       head_dim, max_partitions, partition_tokens);
}

// pagedkv's fwht4/fwht2 V: R128 on each 128-half (head_dim 128 or 256).
PKV_KERNEL void pkv_paged_attention_reduce_ifwht128(const float* part_out, const float* part_max,
                                                    const float* part_sum, const int32_t* seq_lens,
                                                    float* out, int num_heads, int head_dim,
                                                    int max_partitions, int partition_tokens) {
  paged_attention_reduce_unrotate<128>(part_out, part_max, part_sum, seq_lens, out, num_heads,
                                       head_dim, max_partitions, partition_tokens);
}

// Combine the partitions of one (seq, head): out = sum_p e^(m_p - M) o_p / sum_p e^(m_p - M) l_p
// (hip/attention_reduce.h, the arithmetic and order the decode step's fused reduce shares). An
// empty sequence (seq_len 0) gives zeros. partition_tokens: the partition kernel's.
PKV_KERNEL void pkv_paged_attention_reduce(const float* part_out, const float* part_max,
                                           const float* part_sum, const int32_t* seq_lens,
                                           float* out, int num_heads, int head_dim,
                                           int max_partitions, int partition_tokens) {
  __shared__ float sums[PKV_ATTN_REDUCE_SLICES * ATTN_SUMS_STRIDE];
  __shared__ AttnCombine header[1];
  int n_slices;
  const AttnCombine c = paged_attention_reduce_block(part_out, part_max, part_sum, seq_lens,
                                                     num_heads, head_dim, max_partitions,
                                                     partition_tokens, header, sums, n_slices);
  const int64_t row = ((int64_t)blockIdx.y * num_heads + blockIdx.x) * head_dim;
  for (int e = threadIdx.x; e < head_dim; e += blockDim.x)
    out[row + e] = attn_slices_total(sums, e, n_slices, c.inv);
}

// ---------------------------------------------------------------------------
// Block copies between pools (growth, cold capture and restore): block src_ids[i]
// of src to block dst_ids[i] of dst, block_bytes each. The 16-byte kernel needs
// block_bytes % 16 == 0 and 16-byte aligned pools; the byte kernel takes anything.

PKV_KERNEL void pkv_copy_blocks_16(const uint8_t* src, const int32_t* src_ids,
                                   const int32_t* dst_ids, uint8_t* dst, int n_pairs,
                                   int64_t block_bytes) {
  const int64_t n_vec = block_bytes / 16;
  for (int pair = blockIdx.y; pair < n_pairs; pair += gridDim.y) {
    const uint4* s = (const uint4*)(src + (int64_t)src_ids[pair] * block_bytes);
    uint4* d = (uint4*)(dst + (int64_t)dst_ids[pair] * block_bytes);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_vec;
         i += (int64_t)gridDim.x * blockDim.x)
      d[i] = s[i];
  }
}

PKV_KERNEL void pkv_copy_blocks_1(const uint8_t* src, const int32_t* src_ids,
                                  const int32_t* dst_ids, uint8_t* dst, int n_pairs,
                                  int64_t block_bytes) {
  for (int pair = blockIdx.y; pair < n_pairs; pair += gridDim.y) {
    const uint8_t* s = src + (int64_t)src_ids[pair] * block_bytes;
    uint8_t* d = dst + (int64_t)dst_ids[pair] * block_bytes;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < block_bytes;
         i += (int64_t)gridDim.x * blockDim.x)
      d[i] = s[i];
  }
}
