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
