/* pagedkv_compat.h: the few vendor differences the hip/ kernels touch.
 *
 * One .hip source compiles with hipcc (AMD, code objects) and with nvcc
 * (NVIDIA, `-x cu`, cubins/PTX). HIP's own NVIDIA headers are not used: they
 * do not compile against CUDA 13, and the kernels need only what is below.
 * Everything else (threadIdx, __shared__, __syncthreads, atomics) is spelled
 * the same by both compilers.
 */
#ifndef PAGEDKV_COMPAT_H
#define PAGEDKV_COMPAT_H

#if defined(__HIPCC__)
#  include <hip/hip_runtime.h>
/* clang defines the wavefront size per offload target: 64 on GCN/CDNA
 * (gfx90a, gfx940), 32 on RDNA (gfx1030, gfx11, gfx12) in the default wave32 mode. */
#  if defined(__AMDGCN_WAVEFRONT_SIZE)
#    define PKV_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#  elif defined(__HIP_DEVICE_COMPILE__)
#    error "hipcc did not define __AMDGCN_WAVEFRONT_SIZE for this target"
#  else
#    define PKV_WARP_SIZE 64 /* host pass: never used for code generation */
#  endif
#elif defined(__CUDACC__)
#  define PKV_WARP_SIZE 32
#else
#  error "pagedkv_compat.h is for hipcc or nvcc"
#endif

/* AMD matrix cores (MFMA, CDNA, wave64) for weights.hip's gemv_amd_mc: PKV_MFMA_I8 is the k
 * (int8 products per output) of the instruction it uses. gfx908 (CDNA1, MI100) and gfx90a
 * (CDNA2, MI200) have v_mfma_i32_16x16x16i8; CDNA3 (gfx940-942, MI300) dropped it for
 * v_mfma_i32_16x16x32_i8. Defined only in device passes for those targets; RDNA (gfx10-12)
 * has no MFMA (gfx11's WMMA is PKV_WMMA_I8 below). Debian's HIP 5.2 builds gfx908, gfx90a
 * and gfx940, not gfx941/942. */
#if defined(__HIPCC__) && (defined(__gfx908__) || defined(__gfx90a__))
#  define PKV_MFMA_I8 16
#elif defined(__HIPCC__) && (defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__))
#  define PKV_MFMA_I8 32
#endif
/* RDNA3 / RDNA3.5 matrix cores (WMMA, wave32) for weights.hip's int8 GEMV: PKV_WMMA_I8 is the
 * int8 k of one v_wmma_i32_16x16x16_iu8. gfx12 (RDNA4) has WMMA with other register layouts
 * (no half-wave replication): not written. Debian's HIP 5.2 emits gfx11 LLVM IR but its LLVM 15
 * cannot generate the code; hip/gfx11_codegen.py finishes the compile with a newer LLVM. */
#if defined(__HIPCC__) && defined(__GFX11__)
#  define PKV_WMMA_I8 16
#endif
/* bf16 MFMA with k 16 (v_mfma_f32_16x16x16bf16_1k, kvcache.hip's bf16 attention): gfx90a
 * and CDNA3; gfx908 has only the k-8 v_mfma_f32_16x16x8bf16, so no bf16 MFMA kernels there. */
#if defined(__HIPCC__) && (defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || \
                           defined(__gfx942__))
#  define PKV_MFMA_BF16_1K 1
#endif

#include <pagedkv/portability.h>

#define PKV_KERNEL extern "C" __global__
#define PKV_DEV __device__ static __forceinline__
/* A by-value kernel parameter whose address a kernel takes (a TMA tensor map): NVIDIA's
 * __grid_constant__ (sm_70+, CUDA 11.7+), nothing on HIP. */
#if defined(__CUDACC__) && !defined(__HIP_PLATFORM_AMD__)
#define PKV_GRID_CONSTANT __grid_constant__
#else
#define PKV_GRID_CONSTANT
#endif

/* Whole-warp butterfly exchange; every lane of the warp takes part. */
PKV_DEV float pkv_shfl_xor(float v, int lane_mask) {
#if defined(__HIPCC__)
  return __shfl_xor(v, lane_mask, PKV_WARP_SIZE);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, PKV_WARP_SIZE);
#endif
}

/* Hardware IEEE half <-> float conversions (round to nearest even), on raw bits
 * so that no vendor half type leaks into the kernels' interfaces. */
PKV_DEV float pkv_half_bits_to_float(uint16_t h) {
#if defined(__HIPCC__)
  return (float)__builtin_bit_cast(_Float16, h);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}

PKV_DEV uint16_t pkv_float_to_half_bits(float f) {
#if defined(__HIPCC__)
  return __builtin_bit_cast(uint16_t, (_Float16)f);
#else
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#endif
}

/* bfloat16 widens exactly: its bits are the top half of a float's. */
PKV_DEV float pkv_bf16_bits_to_float(uint16_t b) {
  return __uint_as_float((uint32_t)b << 16);
}

/* An integer code (< 2^23) as a float, exactly, without the quarter-rate int->float
 * conversion: 2^23 + q is a float whose mantissa is q; subtract 2^23. */
PKV_DEV float pkv_code_to_float(uint32_t q) { return __uint_as_float(0x4B000000u | q) - 8388608.0f; }

/* A signed byte code the same way: q ^ 0x80 is q + 128 as an unsigned byte. */
PKV_DEV float pkv_signed_byte_to_float(uint32_t q) {
  return __uint_as_float(0x4B000000u | ((q & 0xFFu) ^ 0x80u)) - 8388736.0f;
}

/* Programmatic Dependent Launch (NVIDIA sm_90+). A kernel that the host may launch with
 * CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (pagedkv.kernels.device: those
 * looked up with dependent_launch=True) can start while the previous kernel of the stream
 * still runs: it calls pkv_grid_dependency_wait() before it reads or writes anything an
 * earlier launch reads or writes (what comes before may only touch read-only data, such
 * as weights), then pkv_launch_dependents() lets the next such kernel start (its own wait
 * still waits for this whole grid to finish and flush; called after the wait, at most one
 * grid waits ahead of the running one). Both are no-ops when the
 * kernel was launched plainly, and on AMD and pre-sm_90 targets, where the host never
 * sets the attribute (docs/kernels.md, "Programmatic Dependent Launch"). */
PKV_DEV void pkv_grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
PKV_DEV void pkv_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#endif /* PAGEDKV_COMPAT_H */
