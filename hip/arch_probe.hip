// Compiled once per candidate AMD arch at configure time: an arch is used when
// the found hipcc (and its device libraries) can build this for it.
#include "pagedkv_compat.h"
PKV_KERNEL void pkv_arch_probe(float* out) { out[threadIdx.x] = PKV_WARP_SIZE; }
