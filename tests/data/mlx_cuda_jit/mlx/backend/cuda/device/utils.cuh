// Stand-in for MLX's mlx/backend/cuda/device/utils.cuh, the header MLX's cuda_kernel
// puts first in every custom kernel (MLX embeds the real one in libmlx). It includes
// what the real one includes from the toolkit; pagedkv's kernel text may rely on
// nothing else from MLX (tests/cuda_jit.py).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>

namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}  // namespace mlx::core::cu
