// Benchmark reference kernels: what this device's memory delivers to a kernel that
// does nothing but read, the ceiling for the bandwidth-bound kernels at the same size
// (python -m pagedkv.bench gpu reports every kernel against it and against the copy).
//
// Parameters: inputs, outputs, then scalars.
#include "pagedkv_compat.h"

// Streaming read of n_vec 16-byte vectors, grid-stride; block b writes the 32-bit
// wrapping sum of its words to block_sums[b], so the loads cannot be dropped and a test
// can check that every byte was read. (One global atomic per block on a shared total
// cost ~1 us at 1000 blocks: a visible share of a 9 MB read.)
PKV_KERNEL void pkv_read_probe(const uint4* src, uint32_t* block_sums, int64_t n_vec) {
  __shared__ uint32_t block_sum;
  if (threadIdx.x == 0) block_sum = 0u;
  __syncthreads();
  uint32_t acc = 0u;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_vec; i += stride) {
    const uint4 v = src[i];
    acc += v.x + v.y + v.z + v.w;
  }
  atomicAdd(&block_sum, acc);
  __syncthreads();
  if (threadIdx.x == 0) block_sums[blockIdx.x] = block_sum;
}

// The partition reduce as it was before hip/attention_reduce.h split the partitions into
// slices (kept for `python -m pagedkv.bench gpu` only, to time the new one against it):
// one block of head_dim threads per (head, seq) = (blockIdx.x, blockIdx.y), every thread
// walking all partitions itself (the max, the denominator, then its dim's weighted sum).
PKV_KERNEL void pkv_bench_attention_reduce_serial(const float* part_out, const float* part_max,
                                                  const float* part_sum,
                                                  const int32_t* seq_lens, float* out,
                                                  int num_heads, int head_dim,
                                                  int max_partitions, int partition_tokens) {
  const int h = blockIdx.x, seq = blockIdx.y;
  const int64_t hp = ((int64_t)seq * num_heads + h) * max_partitions;
  const float* pmax = part_max + hp;
  const float* psum = part_sum + hp;
  const int n = (seq_lens[seq] + partition_tokens - 1) / partition_tokens;
  float m = -INFINITY;
  for (int p = 0; p < n; ++p) m = fmaxf(m, pmax[p]);
  float denom = 0.0f;
  for (int p = 0; p < n; ++p) denom = fmaf(expf(pmax[p] - m), psum[p], denom);
  const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int p = 0; p < n; ++p)
      acc = fmaf(expf(pmax[p] - m), part_out[(hp + p) * head_dim + d], acc);
    out[((int64_t)seq * num_heads + h) * head_dim + d] = acc * inv;
  }
}
