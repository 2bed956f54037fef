// mma.sync m16n8k32 on int8 tensor cores (NVIDIA sm_80+), shared by the tensor-core GEMV
// (weights.hip) and the q8 attention's integer pass 1 (kvcache.hip). Fragment layout (PTX
// ISA, "mma.m16n8k32" with .s8): lane (gid = lane / 4, t = lane % 4); a0 / a1 / a2 / a3 hold
// A[gid][4t + 0..3] / A[gid + 8][4t + 0..3] / A[gid][16 + 4t + 0..3] / A[gid + 8][16 + 4t +
// 0..3], b0 / b1 hold B[4t + 0..3][gid] / B[16 + 4t + 0..3][gid] (byte i = element i), c0, c1
// C[gid][2t, 2t + 1] and c2, c3 C[gid + 8][2t, 2t + 1]: exact int32 sums. NumPy model:
// tests/test_gemv_mma_simulated.py (mma_s8_16x8x32). Include after pagedkv_compat.h; on AMD
// it is declared (the attention templates name it) and never called.
#ifndef PAGEDKV_MMA_S8_H
#define PAGEDKV_MMA_S8_H

PKV_DEV void mma_s8_16x8x32(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                            uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __builtin_trap();  // callers run it only on sm_80 and newer (never on AMD)
#endif
}

// max(m, |x|) that keeps a NaN, from either side: fmaxf returns the other operand when one is
// NaN, so a NaN in x would leave the power-of-two step finite and be rounded into the planes
// as if it were a number (the Q8F16 tensor-core GEMV, which has no offset term carrying the
// sum of x, then gave finite outputs for a NaN batch row; H100, 2026-12-05). With it, amax is
// NaN, the caller's non-finite check makes the step NaN, and every output of the row is NaN.
PKV_DEV float absmax_keep_nan(float m, float x) {
  const float a = fabsf(x);
  return a > m || a != a ? a : m;
}

// v / step as an exact integer of at most 22 bits (|v| < 2^e, step = 2^(e - 22), one
// rounding) split into three signed bytes x = p2 * 2^16 + p1 * 2^8 + p0 (p0, p1 in [-128,
// 127], |p2| <= 64): the planes int8 mma multiplies exactly. inv_step = 1 / step, exact.
PKV_DEV void s8_planes22(float v, float inv_step, int& p0, int& p1, int& p2) {
  const int x = __float2int_rn(v * inv_step);
  p0 = (int)(int8_t)(x & 0xFF);
  const int r1 = (x - p0) >> 8;
  p1 = (int)(int8_t)(r1 & 0xFF);
  p2 = (r1 - p1) >> 8;
}

#endif  // PAGEDKV_MMA_S8_H
