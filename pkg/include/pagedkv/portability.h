/* pagedkv public C headers: portability macros.
 *
 * Every header under include/pagedkv/ is included by C (the Cython modules),
 * by HIP/CUDA (hip/ kernels, through hip/pagedkv_compat.h) and by Metal (passed
 * as text to mlx.core.fast.metal_kernel). Functions are declared PKV_FN and
 * device pointers PKV_DEVPTR so one text serves all three.
 */
#ifndef PAGEDKV_PORTABILITY_H
#define PAGEDKV_PORTABILITY_H

#if defined(__METAL_VERSION__)
#  define PKV_FN inline
#  define PKV_DEVPTR device
#  define PKV_CONST constant
#  define PKV_METAL 1
#elif defined(__HIPCC__) || defined(__CUDACC__)
#  define PKV_FN __host__ __device__ static inline
#  define PKV_DEVPTR
#  define PKV_CONST
#  define PKV_GPU 1
#else
#  define PKV_FN static inline
#  define PKV_DEVPTR
#  define PKV_CONST
#  define PKV_HOST 1
#endif

#if !defined(__METAL_VERSION__)
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
