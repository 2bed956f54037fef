// The prepared x of the tensor-core GEMV (hip/weights.hip, "Tensor-core GEMV"): int8
// byte planes of x per 256-group in the mma's B-fragment order, and per (group, batch
// row) the step and the sums of x over each 128-half. One device function, called by
// the GEMV's own prep kernel (pkv_gemv_prep_x) and by the decode-step kernels that
// produce x and write its planes directly (hip/decode.hip: RMSNorm, SiLU*up), so the
// planes they write are byte for byte the prep kernel's. Needs pagedkv_compat.h and
// pagedkv/quant.h (the FWHT sign tables and butterflies) included first.
#ifndef PAGEDKV_GEMV_PREP_X_H
#define PAGEDKV_GEMV_PREP_X_H

#include <pagedkv/launch.h>
#include "mma_s8.h"

// The rotation of one 256-group held by LANES lanes of a warp (all of it, or an aligned
// 32-lane half of a 64-wide AMD wavefront: butterflies across lanes use lane strides below
// LANES only), 256 / LANES consecutive values per lane (lane * 256 / LANES onwards), in
// place. Strides below 256 / LANES are quant.h's butterflies in registers; larger strides
// pair lanes lane ^ (h / per_lane). The lower element of a pair computes a + b and the
// upper a - b, as in the CPU loop, so the result is bit for bit pkv_fwht's.
template <int LANES>
PKV_DEV void fwht256_lanes(float (&v)[PKV_FWHT_N / LANES], int lane) {
  constexpr int PER_LANE = PKV_FWHT_N / LANES;
  const int e0 = lane * PER_LANE;
  // A lane's signs sit in one 32-bit word of each packed table (per_lane <= 32 and
  // e0 is a multiple of per_lane): look the words up once, not per element.
  const uint32_t s1 = pkv_signs1_word((uint32_t)e0 >> 5) >> (e0 & 31);
  const uint32_t s2 = pkv_signs2_word((uint32_t)e0 >> 5) >> (e0 & 31);
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) v[i] = v[i] * ((s1 >> i) & 1u ? 1.0f : -1.0f);
  pkv_fwht_butterflies(v, PER_LANE);
#pragma unroll
  for (int lane_stride = 1; lane_stride < LANES; lane_stride <<= 1) {
    const bool upper = (lane & lane_stride) != 0;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const float other = pkv_shfl_xor(v[i], lane_stride);
      v[i] = upper ? other - v[i] : v[i] + other;
    }
  }
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i)  // c * (+-1) is exact, as in pkv_fwht
    v[i] = v[i] * (PKV_FWHT_SCALE_256 * ((s2 >> i) & 1u ? 1.0f : -1.0f));
}

// x is quantized per 256-group to 22-bit integers (error at most 2^-23 of the group's
// largest |x|).
#define GEMV_X_RANGE 22

// One 32-lane warp per (group g, batch row b): lane L holds v = x[8L, 8L + 8) of the group
// (rotated here first when `rotate`), which is code-byte word 4L of a row: chunk j = L / 8,
// lane t = (L / 2) % 4, word h = L % 2, so mma m = 2j + h (weights.hip, the tensor-core
// GEMV's layout). Its even k are b0's bytes, odd k b1's. Writes the three byte planes to
// xq (n_tiles n-tiles of 8 B columns per group; column 3b + plane) and
// (step, sum of the first 128, sum of the second 128, sum) to xs[g * batch + b]. Every
// lane of the 32 takes part (shuffles); on AMD a 64-wide wavefront holds two such warps
// (lane strides stay below 32, so the halves never mix).
//
// n_tiles == 0 selects the f16 layout of the f16-activation GEMV (weights.hip, gemv_f16)
// instead: x scaled per (group, batch row) by inv_step = 2^(GEMV_X_F16_RANGE - e), so that
// its largest |x| is below 2^15, and rounded once to f16 (error at most 2^-11 of |x|, or
// 2^-25 step below f16's normal range); lane L's 8 values are one 16-byte unit, stored in
// the order x0 x4 x1 x5 x2 x6 x3 x7 (the B-fragment pairs of gemv_f16's nibble pairs) at
// unit 32 (g batch + b) + 8 (L / 8) + 4 (L % 2) + (L / 2) % 4 of xq (the (mma m, t) order:
// lane (gid, t) of mma m = 2j + h reads unit 4m + t); xs gets the step and the sums of the
// rounded values times the step, so that the GEMV's f32 epilogue uses the x it multiplied.
#define GEMV_X_F16_RANGE 15

// The step of one (group, batch row) held by a warp as gemv_prep_x_warp takes it (v
// rotated in place first when `rotate`): 2^(e - range) with the group's largest |x| below
// 2^e (NaN for a group that holds a NaN or an infinity), and inv_step its inverse (0 there).
PKV_DEV float gemv_x_step(float (&v)[8], int lane, bool rotate, int range, float& inv_step) {
  if (rotate) fwht256_lanes<32>(v, lane);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = absmax_keep_nan(amax, v[i]);
  if (amax != amax) amax = INFINITY;  // the shuffles' fmaxf would drop NaN: keep it as inf
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, pkv_shfl_xor(amax, o));
  // step = 2^(e - range) with amax < 2^e; e >= -104 keeps step and 1/step normal floats.
  int e = 0;
  frexpf(amax, &e);
  e = max(e, -104);
  const bool finite = amax <= 3.4e38f;
  inv_step = finite ? ldexpf(1.0f, range - e) : 0.0f;
  return finite ? ldexpf(1.0f, e - range) : __int_as_float(0x7FC00000);
}

// The sum over the lane's half of the group (lanes 0-15 the first 128 values, 16-31 the
// second) and over the other half, from `sum`, a lane's sum of its 8 values. Every lane of
// a half gets the same bits (xor butterflies add the same pairs in every lane), so lane L
// holds the first half's sum in `half` (L < 16) or in `other` (L >= 16).
PKV_DEV void gemv_x_half_sums(float sum, float& half, float& other) {
  half = sum;
  for (int o = 8; o > 0; o >>= 1) half += pkv_shfl_xor(half, o);
  other = pkv_shfl_xor(half, 16);
}

// The lane's three int8 byte planes of its 8 values (GEMV_X_RANGE bits, mma_s8.h's split;
// word h of a plane holds values h, h + 2, h + 4, h + 6), stored for batch row b of group g
// where the mma lanes read them: xq holds n_tiles n-tiles of 32 lanes x PKV_GEMV_X_WORDS
// words per group (column 3b + plane in n-tile col / 8, B row n = col % 8). The fused-x
// GEMV passes its warp's one-group stage as xq, g 0 and one n-tile.
PKV_DEV void gemv_x_store_planes22(const float (&v)[8], float inv_step, int lane, uint32_t* xq,
                                   int64_t g, int n_tiles, int b) {
  uint32_t planes[3][2] = {{0u, 0u}, {0u, 0u}, {0u, 0u}};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    int p0, p1, p2;
    s8_planes22(v[i], inv_step, p0, p1, p2);  // exact scaling, one rounding (mma_s8.h)
    const int shift = 8 * (i / 2);
    planes[0][i % 2] |= (uint32_t)(p0 & 0xFF) << shift;
    planes[1][i % 2] |= (uint32_t)(p1 & 0xFF) << shift;
    planes[2][i % 2] |= (uint32_t)(p2 & 0xFF) << shift;
  }
  const int t = (lane / 2) % 4, m = 2 * (lane / 8) + lane % 2;
#pragma unroll
  for (int p = 0; p < 3; ++p) {
    const int col = 3 * b + p, tile = col / 8, n = col % 8;
    uint32_t* dst = xq + ((g * n_tiles + tile) * 32 + 4 * n + t) * PKV_GEMV_X_WORDS + 2 * m;
    *(uint2*)dst = make_uint2(planes[p][0], planes[p][1]);
  }
}

PKV_DEV void gemv_prep_x_warp(float (&v)[8], int lane, int g, int b, uint32_t* xq, float4* xs,
                              int batch, int n_tiles, bool rotate) {
  float inv_step;
  const float step =
      gemv_x_step(v, lane, rotate, n_tiles == 0 ? GEMV_X_F16_RANGE : GEMV_X_RANGE, inv_step);
  // The sums add with pkv_add_rn: the callers' v is a product in the fused kernels (the
  // RMSNorm's x * inv * w, silu * up, the reduce's t * inv, the FWHT's last scaling) and a
  // load in pkv_gemv_prep_x, and `sum += a * b` may be contracted into an FMA in one kernel
  // and not in the other (today none is: v reaches the sum through the rotate branch).
  float sum = 0.0f;
  uint32_t h16[8];
  if (n_tiles == 0) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      h16[i] = pkv_float_to_half_bits(v[i] * inv_step);  // exact scaling, one rounding
      sum = pkv_add_rn(sum, pkv_half_bits_to_float((uint16_t)h16[i]));
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) sum = pkv_add_rn(sum, v[i]);
  }
  float half_sum, other_half;  // lane 0: the first 128 values' sum, then the second's
  gemv_x_half_sums(sum, half_sum, other_half);
  if (n_tiles == 0) {
    const int unit = 8 * (lane / 8) + 4 * (lane % 2) + (lane / 2) % 4;
    ((uint4*)xq)[((int64_t)g * batch + b) * 32 + unit] =
        make_uint4(h16[0] | h16[4] << 16, h16[1] | h16[5] << 16, h16[2] | h16[6] << 16,
                   h16[3] | h16[7] << 16);
    if (lane == 0) {  // sums of the rounded values, times the step (a power of two)
      const float s_lo = pkv_mul_rn(half_sum, step), s_hi = pkv_mul_rn(other_half, step);
      xs[(int64_t)g * batch + b] = make_float4(step, s_lo, s_hi, pkv_add_rn(s_lo, s_hi));
    }
    return;
  }
  gemv_x_store_planes22(v, inv_step, lane, xq, g, n_tiles, b);
  if (lane == 0) {
    const float s_lo = half_sum, s_hi = other_half;
    xs[(int64_t)g * batch + b] = make_float4(step, s_lo, s_hi, s_lo + s_hi);
  }
}

#endif  // PAGEDKV_GEMV_PREP_X_H
