// KV-cache kernels: q8 quantize (the write side; MLX scatters the records into the
// pool) and dequantize-on-gather (docs/contracts/hfqm-and-quant.md, '6.3 q8 (K and V)'),
// paged-attention decode over
// block tables (docs/contracts/paged-kv.md, '5.2 Layout') and block gathers between pools.
//
// Pool layout, per layer and side: [num_blocks, block_size, kv_heads, row] where a row
// is head_dim f16/bf16 values (passed as uint16 bits) or head_dim/32 q8 records of 34
// bytes. A token's slot is block_id * block_size + offset.
//
// As in weights.metal, pkv_*_thread are the kernels' bodies, index arrays and params
// take any pointer type (MLX passes small inputs in the constant address space).
#ifndef PAGEDKV_METAL_KVCACHE
#define PAGEDKV_METAL_KVCACHE

#include "pagedkv_metal.h"

// ---------------------------------------------------------------------------
// q8 quantize: one 32-value record per simdgroup, lane j holding value j; the record
// max comes from a shuffle butterfly (NaN kept). src: [n_records * 32] f32 or f16; out:
// n_records * 34 bytes. The grid is whole simdgroups; params: [n_records].

template <typename In, typename P>
inline void pkv_kv_q8_quantize_thread(const device In* src, device uint8_t* out, P params,
                                      uint32_t gid, uint32_t lane) {
  const uint32_t rec = gid / PKV_SIMD;
  if (rec >= uint32_t(params[0])) return;  // whole simdgroups leave together
  const float v = float(src[int64_t(rec) * PKV_KVQ8_BLOCK + lane]);
  float amax = fabs(v);  // a butterfly, not simd_max: a NaN must win (pkv_kvq8_amax)
  for (ushort m = PKV_SIMD / 2; m > 0; m >>= 1)
    amax = pkv_kvq8_amax(amax, simd_shuffle_xor(amax, m));
  device uint8_t* r = out + int64_t(rec) * PKV_KVQ8_RECORD_BYTES;
  r[2 + lane] = uint8_t(int8_t(pkv_kvq8_code(v, pkv_kvq8_inv_scale(amax))));
  if (lane == 0) pkv_store_u16le(r, pkv_kvq8_scale_bits(amax));
}

// q8 read: one value per thread, rows gathered by slot. params: [n_tokens, kv_heads,
// head_dim]; out: [n_tokens, kv_heads, head_dim].
template <typename Out, typename S, typename P>
inline void pkv_kv_q8_read_thread(const device uint8_t* pool, S slots, device Out* out, P params,
                                  uint64_t i) {
  const int64_t row_vals = int64_t(params[1]) * params[2];
  if (int64_t(i) >= int64_t(params[0]) * row_vals) return;
  const int64_t token = int64_t(i) / row_vals;
  const int64_t within = int64_t(i) - token * row_vals;  // head * head_dim + dim
  const int64_t rec = int64_t(slots[token]) * (row_vals / PKV_KVQ8_BLOCK) + within / PKV_KVQ8_BLOCK;
  const device uint8_t* r = pool + rec * PKV_KVQ8_RECORD_BYTES;
  const float d = pkv_half_bits_to_float(uint16_t(pkv_load_u16le(r)));
  out[i] = Out(pkv_kvq8_value(d, int8_t(r[2 + within % PKV_KVQ8_BLOCK])));
}

// ---------------------------------------------------------------------------
// Paged-attention decode, one query token per sequence, GQA (query head h reads KV
// head h / (heads / kv_heads)). Split along the sequence: threadgroup (partition,
// kv_head, seq) attends PKV_METAL_ATTN_PARTITION tokens for the kv head's group of query
// heads and writes the unnormalized partial output with its max and sum (the layout
// hip/kvcache.hip's partitions write); pkv_paged_attention_reduce_thread combines
// them. Within a partition each simdgroup takes every PKV_METAL_ATTN_SIMDGROUPS-th token,
// lanes splitting head_dim (HEAD_DIM / 32 consecutive dims each, so a row is one
// contiguous load across the simdgroup), with an online softmax; the simdgroups meet
// in threadgroup memory at the end.
//
// params: [num_heads, kv_heads, block_size, table_width, max_partitions, scale as f32
// bits]. KIND: 0 f16, 1 bf16, 2 q8.

// Tokens per partition and simdgroups per threadgroup: pagedkv/launch.h.
#define PKV_METAL_ATTN_THREADS (PKV_METAL_ATTN_SIMDGROUPS * PKV_SIMD)
#define PKV_KV_F16 0
#define PKV_KV_BF16 1
#define PKV_KV_Q8 2

// A lane's D dims [d0, d0 + D) of one K or V row as floats.
template <int KIND, int D>
inline void pkv_load_dims(const device uint8_t* row, uint32_t d0, thread float* out) {
  if (KIND == PKV_KV_Q8) {
    const device uint8_t* rec = row + (d0 / PKV_KVQ8_BLOCK) * PKV_KVQ8_RECORD_BYTES;
    const float d = pkv_half_bits_to_float(uint16_t(pkv_load_u16le(rec)));
    const device uint8_t* codes = rec + 2 + d0 % PKV_KVQ8_BLOCK;
    for (int i = 0; i < D; ++i) out[i] = pkv_kvq8_value(d, int8_t(codes[i]));
  } else {
    const device uint16_t* v = (const device uint16_t*)row + d0;
    for (int i = 0; i < D; ++i)
      out[i] = KIND == PKV_KV_F16 ? pkv_half_bits_to_float(v[i]) : pkv_bf16_bits_to_float(v[i]);
  }
}

template <int KIND, int GMAX, int HEAD_DIM, typename T, typename L, typename P>
inline void pkv_paged_attention_thread(
    const device float* q, const device uint8_t* k_pool, const device uint8_t* v_pool,
    T block_tables, L seq_lens, device float* part_out, device float* part_max,
    device float* part_sum, P params, uint3 tg, uint32_t simdgroup, uint32_t lane,
    uint32_t tid, threadgroup float* sm_m, threadgroup float* sm_l, threadgroup float* sm_acc) {
  constexpr int D = HEAD_DIM / PKV_SIMD;
  const int num_heads = params[0], kv_heads = params[1], block_size = params[2];
  const int table_width = params[3], max_partitions = params[4];
  const float scale = as_type<float>(params[5]);
  const int part = int(tg.x), kvh = int(tg.y), seq = int(tg.z);
  const int group = num_heads / kv_heads;
  const int seq_len = seq_lens[seq];
  const int start = part * PKV_METAL_ATTN_PARTITION;
  if (start >= seq_len) return;  // the whole threadgroup: the reduce reads only live partitions
  const int n_tok = min(PKV_METAL_ATTN_PARTITION, seq_len - start);
  const int64_t row_bytes = KIND == PKV_KV_Q8 ? int64_t(pkv_kvq8_row_bytes(HEAD_DIM)) : 2 * HEAD_DIM;
  const uint32_t d0 = lane * D;

  float qv[GMAX][D];
  for (int g = 0; g < GMAX; ++g) {
    const int h = kvh * group + (g < group ? g : 0);
    const device float* qh = q + (int64_t(seq) * num_heads + h) * HEAD_DIM + d0;
    for (int i = 0; i < D; ++i) qv[g][i] = qh[i] * scale;
  }
  float m[GMAX], l[GMAX], acc[GMAX][D];
  for (int g = 0; g < GMAX; ++g) {
    m[g] = PKV_LOWEST_FLOAT;
    l[g] = 0.0f;
    for (int i = 0; i < D; ++i) acc[g][i] = 0.0f;
  }
  // t is uniform across the simdgroup, so every lane reaches simd_sum.
  for (int t = int(simdgroup); t < n_tok; t += PKV_METAL_ATTN_SIMDGROUPS) {
    const int pos = start + t;
    const int64_t block = block_tables[int64_t(seq) * table_width + pos / block_size];
    const int64_t row = (block * block_size + pos % block_size) * kv_heads + kvh;
    float kf[D], vf[D];
    pkv_load_dims<KIND, D>(k_pool + row * row_bytes, d0, kf);
    pkv_load_dims<KIND, D>(v_pool + row * row_bytes, d0, vf);
    for (int g = 0; g < GMAX; ++g) {
      float s = 0.0f;
      for (int i = 0; i < D; ++i) s += qv[g][i] * kf[i];
      s = simd_sum(s);
      const float m_new = max(m[g], s);
      const float a = exp(m[g] - m_new), p = exp(s - m_new);
      l[g] = l[g] * a + p;
      for (int i = 0; i < D; ++i) acc[g][i] = acc[g][i] * a + p * vf[i];
      m[g] = m_new;
    }
  }
  // Combine the simdgroups: per head the max M, the sum L and sum_s e^(m_s - M) acc_s.
  if (lane == 0) {
    for (int g = 0; g < GMAX; ++g) {
      sm_m[simdgroup * GMAX + g] = m[g];
      sm_l[simdgroup * GMAX + g] = l[g];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float w[GMAX];
  for (int g = 0; g < GMAX; ++g) {
    float mm = sm_m[g];
    for (int s = 1; s < PKV_METAL_ATTN_SIMDGROUPS; ++s) mm = max(mm, sm_m[s * GMAX + g]);
    w[g] = exp(m[g] - mm);  // 0 for a simdgroup that saw no token (m: the lowest float)
  }
  for (int s = 0; s < PKV_METAL_ATTN_SIMDGROUPS; ++s) {
    if (int(simdgroup) == s) {
      for (int g = 0; g < GMAX; ++g)
        for (int i = 0; i < D; ++i) {
          const int e = g * HEAD_DIM + int(d0) + i;
          sm_acc[e] = (s == 0 ? 0.0f : sm_acc[e]) + acc[g][i] * w[g];
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (int e = int(tid); e < group * HEAD_DIM; e += PKV_METAL_ATTN_THREADS) {
    const int g = e / HEAD_DIM, d = e - g * HEAD_DIM;
    const int64_t hp = (int64_t(seq) * num_heads + kvh * group + g) * max_partitions + part;
    part_out[hp * HEAD_DIM + d] = sm_acc[e];
    if (d == 0) {
      float mm = sm_m[g];
      for (int s = 1; s < PKV_METAL_ATTN_SIMDGROUPS; ++s) mm = max(mm, sm_m[s * GMAX + g]);
      float ll = 0.0f;
      for (int s = 0; s < PKV_METAL_ATTN_SIMDGROUPS; ++s)
        ll += exp(sm_m[s * GMAX + g] - mm) * sm_l[s * GMAX + g];
      part_max[hp] = mm;
      part_sum[hp] = ll;
    }
  }
}

// Combine the partitions of one (seq, head, dim): out = sum_p e^(m_p - M) o_p /
// sum_p e^(m_p - M) l_p; an empty sequence gives zeros. params: [num_heads, head_dim,
// max_partitions]. One thread per (dim, head, seq).
template <typename F, typename L, typename P>
inline void pkv_paged_attention_reduce_thread(F part_out, F part_max, F part_sum, L seq_lens,
                                              device float* out, P params, uint3 pos) {
  const int num_heads = params[0], head_dim = params[1], max_partitions = params[2];
  const int d = int(pos.x), h = int(pos.y), seq = int(pos.z);
  if (d >= head_dim) return;
  const int n_parts = (seq_lens[seq] + PKV_METAL_ATTN_PARTITION - 1) / PKV_METAL_ATTN_PARTITION;
  const int64_t hp = (int64_t(seq) * num_heads + h) * max_partitions;
  float mm = PKV_LOWEST_FLOAT;
  for (int p = 0; p < n_parts; ++p) mm = max(mm, part_max[hp + p]);
  float denom = 0.0f, s = 0.0f;
  for (int p = 0; p < n_parts; ++p) {
    const float e = exp(part_max[hp + p] - mm);
    denom += e * part_sum[hp + p];
    s += e * part_out[(hp + p) * head_dim + d];
  }
  out[(int64_t(seq) * num_heads + h) * head_dim + d] = denom > 0.0f ? s / denom : 0.0f;
}

// ---------------------------------------------------------------------------
// Block gather: out[i] = src block src_ids[i] (block_bytes each), 16 bytes per thread
// when block_bytes % 16 == 0, else one; MLX scatters the result where it belongs (pool
// growth, cold capture and restore). params: [n_pairs, block_bytes]. pos: (unit, pair).
template <typename I, typename P>
inline void pkv_gather_blocks16_thread(const device uint8_t* src, I src_ids, device uint8_t* out,
                                       P params, uint3 pos) {
  const int64_t block_bytes = params[1];
  const int64_t i = int64_t(pos.x) * 16, pair = pos.y;
  if (i >= block_bytes || pair >= params[0]) return;
  *(device uint4*)(out + pair * block_bytes + i) =
      *(const device uint4*)(src + int64_t(src_ids[pair]) * block_bytes + i);
}

template <typename S, typename I, typename P>
inline void pkv_gather_blocks1_thread(S src, I src_ids, device uint8_t* out, P params, uint3 pos) {
  const int64_t block_bytes = params[1];
  const int64_t i = pos.x, pair = pos.y;
  if (i >= block_bytes || pair >= params[0]) return;
  out[pair * block_bytes + i] = src[int64_t(src_ids[pair]) * block_bytes + i];
}

#ifndef PKV_MLX_JIT  // MLX generates its own kernels around the same calls

// ---------------------------------------------------------------------------
// Entry points for pagedkv.metallib and the compile checks.

[[kernel]] void pkv_kv_q8_quantize_f32(const device float* src [[buffer(0)]],
                                       const device int32_t* params [[buffer(1)]],
                                       device uint8_t* out [[buffer(2)]],
                                       uint3 tid [[thread_position_in_grid]],
                                       uint lane [[thread_index_in_simdgroup]]) {
  pkv_kv_q8_quantize_thread(src, out, params, tid.x, lane);
}
[[kernel]] void pkv_kv_q8_quantize_f16(const device half* src [[buffer(0)]],
                                       const device int32_t* params [[buffer(1)]],
                                       device uint8_t* out [[buffer(2)]],
                                       uint3 tid [[thread_position_in_grid]],
                                       uint lane [[thread_index_in_simdgroup]]) {
  pkv_kv_q8_quantize_thread(src, out, params, tid.x, lane);
}
[[kernel]] void pkv_kv_q8_read_f32(const device uint8_t* pool [[buffer(0)]],
                                   const device int64_t* slots [[buffer(1)]],
                                   const device int32_t* params [[buffer(2)]],
                                   device float* out [[buffer(3)]],
                                   uint3 tid [[thread_position_in_grid]]) {
  pkv_kv_q8_read_thread(pool, slots, out, params, tid.x);
}

#define PKV_ATTN_ENTRY(NAME, KIND, GMAX, HEAD_DIM)                                             \
  [[kernel]] void NAME(                                                                        \
      const device float* q [[buffer(0)]], const device uint8_t* k_pool [[buffer(1)]],         \
      const device uint8_t* v_pool [[buffer(2)]],                                              \
      const device int32_t* block_tables [[buffer(3)]],                                        \
      const device int32_t* seq_lens [[buffer(4)]], const device int32_t* params [[buffer(5)]], \
      device float* part_out [[buffer(6)]], device float* part_max [[buffer(7)]],              \
      device float* part_sum [[buffer(8)]], uint3 tg [[threadgroup_position_in_grid]],         \
      uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],     \
      uint tid [[thread_index_in_threadgroup]]) {                                              \
    PKV_SHARED(float, sm_m, PKV_METAL_ATTN_SIMDGROUPS * GMAX);                                 \
    PKV_SHARED(float, sm_l, PKV_METAL_ATTN_SIMDGROUPS * GMAX);                                 \
    PKV_SHARED(float, sm_acc, GMAX * HEAD_DIM);                                                \
    pkv_paged_attention_thread<KIND, GMAX, HEAD_DIM>(                                          \
        q, k_pool, v_pool, block_tables, seq_lens, part_out, part_max, part_sum, params, tg,   \
        sg, lane, tid, sm_m, sm_l, sm_acc);                                                    \
  }

PKV_ATTN_ENTRY(pkv_paged_attention_f16_g4_d128, PKV_KV_F16, 4, 128)
PKV_ATTN_ENTRY(pkv_paged_attention_bf16_g8_d64, PKV_KV_BF16, 8, 64)
PKV_ATTN_ENTRY(pkv_paged_attention_q8_g1_d256, PKV_KV_Q8, 1, 256)

[[kernel]] void pkv_paged_attention_reduce(const device float* part_out [[buffer(0)]],
                                           const device float* part_max [[buffer(1)]],
                                           const device float* part_sum [[buffer(2)]],
                                           const device int32_t* seq_lens [[buffer(3)]],
                                           const device int32_t* params [[buffer(4)]],
                                           device float* out [[buffer(5)]],
                                           uint3 pos [[thread_position_in_grid]]) {
  pkv_paged_attention_reduce_thread(part_out, part_max, part_sum, seq_lens, out, params, pos);
}

[[kernel]] void pkv_gather_blocks_16(const device uint8_t* src [[buffer(0)]],
                                     const device int32_t* src_ids [[buffer(1)]],
                                     const device int32_t* params [[buffer(2)]],
                                     device uint8_t* out [[buffer(3)]],
                                     uint3 pos [[thread_position_in_grid]]) {
  pkv_gather_blocks16_thread(src, src_ids, out, params, pos);
}

#endif  // PKV_MLX_JIT
#endif  // PAGEDKV_METAL_KVCACHE
