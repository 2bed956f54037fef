// The combine of paged attention's partitions (hip/kvcache.hip, "Paged-attention decode"):
// each partition p of a (seq, head) left its unnormalized output o_p, its max m_p and its
// sum l_p; out = sum_p e^(m_p - M) o_p / sum_p e^(m_p - M) l_p with M = max_p m_p. One set of
// device functions for the reduce kernels (kvcache.hip) and the decode step's fused reduce
// that writes the O projection's prepared x (hip/decode.hip, pkv_attention_reduce_prep_f32),
// so the fused kernel's x is the reduce's output bit for bit: every product-sum is an
// explicit fmaf (no contraction left to the compiler, which could choose differently in
// another kernel), each in the same partition order. Needs pagedkv_compat.h first.
#ifndef PAGEDKV_ATTENTION_REDUCE_H
#define PAGEDKV_ATTENTION_REDUCE_H

// A (seq, head)'s partition count, largest max and 1 / weighted sum of the partition sums
// (0 for an empty sequence: its output is zeros).
struct AttnCombine {
  int n_parts;
  float m;
  float inv;
};

// Partition p's weight e^(m_p - M).
PKV_DEV float attn_partition_weight(float part_max, float m) { return expf(part_max - m); }

// pmax, psum: the (seq, head)'s partitions (max_partitions apart per head); the sequence
// has ceil(seq_len / partition_tokens) of them, the partition kernel's own count (it
// writes nothing for partitions past seq_len, so none of those is read).
PKV_DEV AttnCombine attn_combine_begin(const float* pmax, const float* psum, int seq_len,
                                       int partition_tokens) {
  AttnCombine c;
  c.n_parts = (seq_len + partition_tokens - 1) / partition_tokens;
  float m = -INFINITY;
#pragma unroll 8
  for (int p = 0; p < c.n_parts; ++p) m = fmaxf(m, pmax[p]);
  float denom = 0.0f;
#pragma unroll 8
  for (int p = 0; p < c.n_parts; ++p)
    denom = fmaf(attn_partition_weight(pmax[p], m), psum[p], denom);
  c.m = m;
  c.inv = denom > 0.0f ? 1.0f / denom : 0.0f;
  return c;
}

// N consecutive values of a partition's output row: one (the reduce's thread per dim) or 8
// (a 32-byte aligned run: the fused kernel's lane).
PKV_DEV void attn_load_values(const float* src, float (&v)[1]) { v[0] = *src; }
PKV_DEV void attn_load_values(const float* src, float (&v)[8]) {
  const float4 lo = ((const float4*)src)[0], hi = ((const float4*)src)[1];
  v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
  v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
}

// out[i] = sum_p e^(m_p - M) o_p[d0 + i] * inv for N consecutive dims d0.. of one
// (seq, head): pmax its partitions' maxima, pout its partition 0's row at d0 (partition p
// at pout + p * head_dim). The per-element arithmetic of every reduce.
template <int N>
PKV_DEV void attn_combine_values(const AttnCombine& c, const float* pmax, const float* pout,
                                 int head_dim, float (&out)[N]) {
  float acc[N];
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = 0.0f;
#pragma unroll 4
  for (int p = 0; p < c.n_parts; ++p) {
    const float w = attn_partition_weight(pmax[p], c.m);
    float o[N];
    attn_load_values(pout + (int64_t)p * head_dim, o);
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = fmaf(w, o[i], acc[i]);
  }
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = acc[i] * c.inv;
}

#endif  // PAGEDKV_ATTENTION_REDUCE_H
