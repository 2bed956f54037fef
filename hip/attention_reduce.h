// The combine of paged attention's partitions (hip/kvcache.hip, "Paged-attention decode"):
// each partition p of a (seq, head) left its unnormalized output o_p, its max m_p and its
// sum l_p; out = sum_p e^(m_p - M) o_p / sum_p e^(m_p - M) l_p with M = max_p m_p. One set of
// device functions for the reduce kernels (kvcache.hip) and the decode step's fused reduce
// that writes the O projection's prepared x (hip/decode.hip, pkv_attention_reduce_prep_f32),
// so the fused kernel's x is the reduce's output bit for bit: every product-sum is an
// explicit fmaf (no contraction left to the compiler, which could choose differently in
// another kernel), and the summation order is a function of the partition count alone,
// never of the block shape:
//   - header (M and the denominator): lane j of one 32-lane warp takes partitions j, j + 32,
//     ... in ascending order (a fmaf chain from 0), then the lanes' sums meet in the xor
//     butterfly 16, 8, 4, 2, 1 (every lane ends with the same bits: a + b == b + a);
//   - values: partition p belongs to slice p % PKV_ATTN_REDUCE_SLICES; a slice's sum is a
//     fmaf chain from 0 over its partitions in ascending order, and the slices' sums are
//     added in slice order (slice 0 + slice 1 + ...), then times 1 / denominator.
// A warp per slice accumulates all of a head's dims at once (the old kernel ran every
// partition serially in every thread: 8 µs per launch at 64 partitions). Needs
// pagedkv_compat.h first.
#ifndef PAGEDKV_ATTENTION_REDUCE_H
#define PAGEDKV_ATTENTION_REDUCE_H

#include <pagedkv/launch.h>

// Partitions per slice loaded at once for N dims per lane: 32 values in flight per lane, at
// most 8 partitions (a warp's first chunk is in flight while the header is computed: 64
// partitions over 8 slices are one chunk at head_dim <= 128).
#define ATTN_CHUNK(N) ((N) >= 8 ? 4 : 8)
// Partitions per header lane kept in registers from one load (the rest are re-read).
#define ATTN_HEADER_CACHED 2

// A (seq, head)'s largest partition max and 1 / weighted sum of the partition sums (0 for
// an empty sequence: its output is zeros).
struct AttnCombine {
  float m;
  float inv;
};

// The partitions a sequence of seq_len tokens has: the partition kernel's own count (it
// writes nothing for partitions past seq_len, so none of those is read).
PKV_DEV int attn_partition_count(int seq_len, int partition_tokens) {
  return (seq_len + partition_tokens - 1) / partition_tokens;
}

// Slices holding at least one of n partitions.
PKV_DEV int attn_slice_count(int n_parts) { return min(n_parts, PKV_ATTN_REDUCE_SLICES); }

// Partition p's weight e^(m_p - M).
PKV_DEV float attn_partition_weight(float part_max, float m) { return expf(part_max - m); }

// The header of one (seq, head) by one 32-lane warp (lane 0..31; every lane calls it, and
// every lane gets the result). pmax, psum: its partitions (n_parts of them).
PKV_DEV AttnCombine attn_combine_header(const float* pmax, const float* psum, int n_parts,
                                        int lane) {
  float pm[ATTN_HEADER_CACHED], ps[ATTN_HEADER_CACHED];
#pragma unroll
  for (int k = 0; k < ATTN_HEADER_CACHED; ++k) {  // all loads issued before the first use
    const int p = lane + 32 * k;
    pm[k] = p < n_parts ? pmax[p] : -INFINITY;
    ps[k] = p < n_parts ? psum[p] : 0.0f;
  }
  float m = -INFINITY;  // fmaxf: order-free (NaN is dropped in any order)
#pragma unroll
  for (int k = 0; k < ATTN_HEADER_CACHED; ++k) m = fmaxf(m, pm[k]);
  for (int p = lane + 32 * ATTN_HEADER_CACHED; p < n_parts; p += 32) m = fmaxf(m, pmax[p]);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, pkv_shfl_xor(m, o));
  float d = 0.0f;
#pragma unroll
  for (int k = 0; k < ATTN_HEADER_CACHED; ++k)
    if (lane + 32 * k < n_parts) d = fmaf(attn_partition_weight(pm[k], m), ps[k], d);
  for (int p = lane + 32 * ATTN_HEADER_CACHED; p < n_parts; p += 32)
    d = fmaf(attn_partition_weight(pmax[p], m), psum[p], d);
  for (int o = 16; o > 0; o >>= 1) d = d + pkv_shfl_xor(d, o);
  AttnCombine c;
  c.m = m;
  c.inv = d > 0.0f ? 1.0f / d : 0.0f;
  return c;
}

// N consecutive values of a partition's output row (a lane's share of a warp's row: N =
// head_dim / 32 in the reduce, 8 in the fused kernel), aligned to N floats.
PKV_DEV void attn_load_values(const float* src, float (&v)[1]) { v[0] = *src; }
PKV_DEV void attn_load_values(const float* src, float (&v)[2]) {
  const float2 a = *(const float2*)src;
  v[0] = a.x; v[1] = a.y;
}
PKV_DEV void attn_load_values(const float* src, float (&v)[4]) {
  const float4 a = *(const float4*)src;
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}
PKV_DEV void attn_load_values(const float* src, float (&v)[8]) {
  const float4 lo = ((const float4*)src)[0], hi = ((const float4*)src)[1];
  v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
  v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
}

// One chunk of a slice: partitions p0, p0 + SLICES, ... (ATTN_CHUNK of them, those below
// n_parts), their maxima and N values each. pmax: the (seq, head)'s partitions; pout: its
// partition 0's row at the lane's first dim (partition p at pout + p * head_dim).
template <int N>
struct AttnChunk {
  float pm[ATTN_CHUNK(N)];
  float o[ATTN_CHUNK(N)][N];
};

template <int N>
PKV_DEV void attn_chunk_load(const float* pmax, const float* pout, int head_dim, int n_parts,
                             int p0, AttnChunk<N>& ch) {
#pragma unroll
  for (int i = 0; i < ATTN_CHUNK(N); ++i) {
    const int p = p0 + PKV_ATTN_REDUCE_SLICES * i;
    if (p < n_parts) {
      ch.pm[i] = pmax[p];
      attn_load_values(pout + (int64_t)p * head_dim, ch.o[i]);
    }
  }
}

// acc += the chunk's weighted values, in partition order.
template <int N>
PKV_DEV void attn_chunk_add(const AttnChunk<N>& ch, float m, int n_parts, int p0,
                            float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < ATTN_CHUNK(N); ++i) {
    if (p0 + PKV_ATTN_REDUCE_SLICES * i < n_parts) {
      const float w = attn_partition_weight(ch.pm[i], m);
#pragma unroll
      for (int j = 0; j < N; ++j) acc[j] = fmaf(w, ch.o[i][j], acc[j]);
    }
  }
}

// Slice s's sum of weighted values (N dims of one lane), its first chunk already loaded
// into `first` (attn_chunk_load at p0 = s): the rest of the slice is loaded and added here.
template <int N>
PKV_DEV void attn_slice_sum(const AttnChunk<N>& first, const float* pmax, const float* pout,
                            int head_dim, int n_parts, int s, float m, float (&acc)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) acc[j] = 0.0f;
  attn_chunk_add(first, m, n_parts, s, acc);
  for (int p0 = s + PKV_ATTN_REDUCE_SLICES * ATTN_CHUNK(N); p0 < n_parts;
       p0 += PKV_ATTN_REDUCE_SLICES * ATTN_CHUNK(N)) {
    AttnChunk<N> ch;
    attn_chunk_load(pmax, pout, head_dim, n_parts, p0, ch);
    attn_chunk_add(ch, m, n_parts, p0, acc);
  }
}

// Shared floats per slice of a block's sums: a head's row (head_dim <= 256) or a 256-group.
#define ATTN_SUMS_STRIDE 256

// One block's combine up to its slices' sums, shared by the reduce (a head per block) and
// the fused reduce + prep (a 256-group per block: up to 8 heads). The block's heads are
// `heads` consecutive heads of one sequence, head k's partition maxima and sums at
// pmax0 / psum0 + k * max_partitions; this lane's N dims belong to head `mine`, whose
// partition 0 row at the lane's first dim is pout. blockDim.x: 32-lane warps (AMD: two per
// wavefront, shuffles stay in their half); warp w loads slice w's first chunk, computes the
// headers of heads w, w + warps, ... into header[] (up to 8), then after a barrier sums
// slices w, w + warps, ... into sums[s * ATTN_SUMS_STRIDE + N * lane + j]. Returns head
// mine's header with the block synced (sums complete).
template <int N>
PKV_DEV AttnCombine attn_block_slices(const float* pmax0, const float* psum0, int max_partitions,
                                      int heads, int mine, const float* pout, int head_dim,
                                      int n_parts, AttnCombine* header, float* sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int n_slices = attn_slice_count(n_parts);
  const float* pmax = pmax0 + (int64_t)mine * max_partitions;
  AttnChunk<N> chunk;
  // The values' loads are in flight while the header's are waited for.
  if (warp < n_slices) attn_chunk_load(pmax, pout, head_dim, n_parts, warp, chunk);
  for (int k = warp; k < heads; k += warps) {
    const AttnCombine c = attn_combine_header(pmax0 + (int64_t)k * max_partitions,
                                              psum0 + (int64_t)k * max_partitions, n_parts,
                                              lane);
    if (lane == 0) header[k] = c;
  }
  __syncthreads();
  const AttnCombine c = header[mine];
  for (int s = warp; s < n_slices; s += warps) {
    if (s != warp) attn_chunk_load(pmax, pout, head_dim, n_parts, s, chunk);
    float acc[N];
    attn_slice_sum(chunk, pmax, pout, head_dim, n_parts, s, c.m, acc);
#pragma unroll
    for (int j = 0; j < N; ++j) sums[s * ATTN_SUMS_STRIDE + N * lane + j] = acc[j];
  }
  __syncthreads();
  return c;
}

// The combined value at index e of the slices' sums (attn_block_slices): slice 0 + slice 1
// + ... in order, times inv (0 for no slice: an empty sequence).
PKV_DEV float attn_slices_total(const float* sums, int e, int n_slices, float inv) {
  float t = 0.0f;
  if (n_slices > 0) t = sums[e];
  for (int s = 1; s < n_slices; ++s) t = t + sums[s * ATTN_SUMS_STRIDE + e];
  return t * inv;
}

#endif  // PAGEDKV_ATTENTION_REDUCE_H
