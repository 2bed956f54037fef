/* FWHT-256 over rows, compiled per ISA level (cpu_simd.h); math from pagedkv/quant.h. */
#ifndef PAGEDKV_QUANT_FWHT_LOOPS_H
#define PAGEDKV_QUANT_FWHT_LOOPS_H

#include "pagedkv/quant.h"
#include "cpu_simd.h"

/* y[r] = R x[r] (pre = SIGNS1, post = SIGNS2) or Rᵀ x[r] (swapped), for n_rows rows of 256. */
PKV_CPU_CLONES
static void pkv_cpu_fwht256_rows(const float *x, float *y, ptrdiff_t n_rows,
                                 const float *pre, const float *post) {
    for (ptrdiff_t r = 0; r < n_rows; ++r)
        pkv_fwht_with_tables(x + 256 * r, y + 256 * r, 256u, pre, post);
}

#endif /* PAGEDKV_QUANT_FWHT_LOOPS_H */
