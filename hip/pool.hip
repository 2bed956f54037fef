// Device KV pool block I/O (docs/pool.md, "Device backend"): one block of every layer's
// K and V between the pool and a staging buffer in one launch, for the cold tier's
// capture (gather, then one copy to the host) and restore (one copy from the host, then
// scatter). The pool keeps one allocation per layer and side, so the arrays are given
// as a table of base addresses (uploaded once per pool generation).
//
// Parameters: inputs, outputs, then scalars.
#include "pagedkv_compat.h"

// Copy n_arrays slabs of slab_bytes: slab i lives at bases[i] + offset in the pool and
// at i * slab_bytes in the staging buffer. Block (x, i) copies a share of slab i in
// 16-byte vectors when every address and size allows it, bytes otherwise.
template <bool GATHER>
PKV_DEV void copy_slabs(const uint64_t* __restrict__ bases, uint8_t* staging, int n_arrays,
                        int64_t offset, int64_t slab_bytes) {
  for (int i = blockIdx.y; i < n_arrays; i += gridDim.y) {
    uint8_t* pool = (uint8_t*)(uintptr_t)bases[i] + offset;
    uint8_t* stage = staging + (int64_t)i * slab_bytes;
    const bool vec = ((uintptr_t)pool % 16 == 0) && ((uintptr_t)stage % 16 == 0) &&
                     (slab_bytes % 16 == 0);
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
      uint4* dst = (uint4*)(GATHER ? stage : pool);
      const uint4* src = (const uint4*)(GATHER ? pool : stage);
      for (int64_t v = first; v < slab_bytes / 16; v += stride) dst[v] = src[v];
    } else {
      uint8_t* dst = GATHER ? stage : pool;
      const uint8_t* src = GATHER ? pool : stage;
      for (int64_t b = first; b < slab_bytes; b += stride) dst[b] = src[b];
    }
  }
}

PKV_KERNEL void pkv_slabs_gather(const uint64_t* bases, uint8_t* staging, int n_arrays,
                                 int64_t offset, int64_t slab_bytes) {
  copy_slabs<true>(bases, staging, n_arrays, offset, slab_bytes);
}

PKV_KERNEL void pkv_slabs_scatter(const uint8_t* staging, const uint64_t* bases, int n_arrays,
                                  int64_t offset, int64_t slab_bytes) {
  copy_slabs<false>(bases, (uint8_t*)staging, n_arrays, offset, slab_bytes);
}
