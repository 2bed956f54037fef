/* pagedkv public C headers: portability macros.
 *
 * Every header under include/pagedkv/ is included by C (the Cython modules),
 * by HIP/CUDA (hip/ kernels, through hip/pagedkv_compat.h, compiled offline by
 * hipcc/nvcc or at run time by NVRTC through mlx.core.fast.cuda_kernel) and by
 * Metal (metal/ kernels, and as text passed to mlx.core.fast.metal_kernel).
 * Functions are declared PKV_FN, pointers into kernel buffers PKV_DEVPTR and
 * pointers to a thread's own scratch (local arrays) PKV_THREAD, so one text
 * serves all of them: Metal has no generic address space, every pointer names
 * one (device, constant, threadgroup or thread).
 */
#ifndef PAGEDKV_PORTABILITY_H
#define PAGEDKV_PORTABILITY_H

#if defined(__METAL_VERSION__)
#  define PKV_FN inline
#  define PKV_DEVPTR device
#  define PKV_THREAD thread
#  define PKV_CONST constant
#  define PKV_METAL 1
#elif defined(__HIPCC__) || defined(__CUDACC__)
#  define PKV_FN __host__ __device__ static inline
#  define PKV_DEVPTR
#  define PKV_THREAD
#  define PKV_CONST
#  define PKV_GPU 1
#else
#  define PKV_FN static inline
#  define PKV_DEVPTR
#  define PKV_THREAD
#  define PKV_CONST
#  define PKV_HOST 1
#endif

#if defined(__METAL_VERSION__)
#  include <metal_stdlib>   /* uint8_t .. uint64_t, size_t, ptrdiff_t, as_type */
#elif defined(__CUDACC_RTC__)
/* NVRTC (mlx.core.fast.cuda_kernel) has no C library headers; libcu++ (CCCL, on
 * NVRTC's include path) declares the fixed-width types in the global namespace. */
#  include <cuda/std/cstdint>
#  include <cuda/std/cstddef>
#else
#  include <stdint.h>
#  include <stddef.h>
#endif

/* C11 static assertions are unavailable in Metal; layouts are checked on the host. */
#if defined(PKV_HOST) && !defined(__cplusplus)
#  define PKV_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#else
#  define PKV_STATIC_ASSERT(cond, msg)
#endif

#endif /* PAGEDKV_PORTABILITY_H */
