// mma.sync m16n8k16 with f16 / bf16 operands and f32 sums (NVIDIA sm_80+), shared by the
// f16 and bf16 attention's tensor-core passes (kvcache.hip) and the f16-activation GEMV
// (weights.hip). Fragment layout (PTX ISA, "mma.m16n8k16" with .f16): lane (gid = lane / 4,
// t = lane % 4); a0 / a1 / a2 / a3 hold A[gid][2t, 2t + 1] / A[gid + 8][2t, 2t + 1] /
// A[gid][8 + 2t, 9 + 2t] / A[gid + 8][8 + 2t, 9 + 2t] (element 0 in the low half), b0 / b1
// B[2t, 2t + 1][gid] / B[8 + 2t, 9 + 2t][gid], c0, c1 C[gid][2t, 2t + 1] and c2, c3
// C[gid + 8][2t, 2t + 1]. Include after pagedkv_compat.h; on AMD it is declared (templates
// name it) and never called.
#ifndef PAGEDKV_MMA_F16_H
#define PAGEDKV_MMA_F16_H

// mma_f16_16x8x16 and mma_bf16_16x8x16 (T: the PTX operand type); bf16 uses the f16
// fragment layouts (16-bit elements).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define PKV_MMA_M16N8K16(NAME, T)                                                             \
  PKV_DEV void NAME(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {        \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 {%0,%1,%2,%3}, "               \
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                                              \
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                      \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                      \
  }
#else  // callers run it only on sm_80 and newer (never on AMD)
#define PKV_MMA_M16N8K16(NAME, T)                                                             \
  PKV_DEV void NAME(float (&)[4], const uint32_t (&)[4], uint32_t, uint32_t) {                \
    __builtin_trap();                                                                         \
  }
#endif
PKV_MMA_M16N8K16(mma_f16_16x8x16, "f16")
PKV_MMA_M16N8K16(mma_bf16_16x8x16, "bf16")
#undef PKV_MMA_M16N8K16

#endif  // PAGEDKV_MMA_F16_H
