// The small kernels of a decoder step between the GEMVs and attention (the
// `pagedkv.bench decode` step, docs/kernels.md "Decode step"): RMSNorm (fused with
// the residual add), RoPE on the packed QKV projection (split into q, k, v), SiLU(gate)
// * up of the packed gate/up projection, and the f16/bf16 KV write of this step's
// tokens into a device pool at the adapter's slot mapping. Activations are f32.
//
// Parameters: inputs, outputs, then scalars.
#include "pagedkv_compat.h"

#ifndef PKV_NORM_THREADS
#define PKV_NORM_THREADS 256
#endif

// Sum over the block (PKV_NORM_THREADS threads); every thread gets the total.
PKV_DEV float block_sum(float v, float* red) {
  const int lane = threadIdx.x % PKV_WARP_SIZE, warp = threadIdx.x / PKV_WARP_SIZE;
  constexpr int n_warps = PKV_NORM_THREADS / PKV_WARP_SIZE;
  for (int o = PKV_WARP_SIZE / 2; o > 0; o >>= 1) v += pkv_shfl_xor(v, o);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = 0.0f;
#pragma unroll
  for (int w = 0; w < n_warps; ++w) s += red[w];
  __syncthreads();  // red is reused by the next call
  return s;
}

// One block per row: if `residual` is not null, x += residual first (written back);
// then y = x / sqrt(mean(x^2) + eps) * weight. dim % 4 == 0, rows 16-byte aligned.
PKV_KERNEL void __launch_bounds__(PKV_NORM_THREADS)
    pkv_add_rmsnorm_f32(float* x, const float* residual, const float* weight, float* y,
                        int dim, float eps) {
  __shared__ float red[PKV_NORM_THREADS / PKV_WARP_SIZE];
  float4* xr = (float4*)(x + (int64_t)blockIdx.x * dim);
  const float4* rr = residual ? (const float4*)(residual + (int64_t)blockIdx.x * dim) : nullptr;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < dim / 4; i += PKV_NORM_THREADS) {
    float4 v = xr[i];
    if (rr) {
      const float4 r = rr[i];
      v.x += r.x; v.y += r.y; v.z += r.z; v.w += r.w;
      xr[i] = v;
    }
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  const float inv = rsqrtf(block_sum(ss, red) / (float)dim + eps);
  const float4* wr = (const float4*)weight;
  float4* yr = (float4*)(y + (int64_t)blockIdx.x * dim);
  for (int i = threadIdx.x; i < dim / 4; i += PKV_NORM_THREADS) {
    const float4 v = xr[i], w = wr[i];  // this thread wrote xr[i] itself
    yr[i] = make_float4(v.x * inv * w.x, v.y * inv * w.y, v.z * inv * w.z, v.w * inv * w.w);
  }
}

// RoPE (rotate-half pairing: dim i with i + head_dim/2, angle pos * theta^(-2i/head_dim),
// computed in double so a 32k-token position keeps its precision) on the q and k heads of a
// packed QKV row [q_heads | kv_heads | kv_heads] x head_dim, written out split: q
// [rows, q_heads, head_dim], k and v [rows, kv_heads, head_dim] (v copied unrotated).
// positions[row]: the token's position. One thread per (row, head, pair).
PKV_KERNEL void pkv_qkv_rope_split_f32(const float* qkv, const int32_t* positions, float* q,
                                       float* k, float* v, int rows, int q_heads,
                                       int kv_heads, int head_dim, float theta) {
  const int half = head_dim / 2;
  const int heads = q_heads + 2 * kv_heads;
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)rows * heads * half) return;
  const int pair = (int)(i % half);
  const int head = (int)((i / half) % heads);
  const int row = (int)(i / ((int64_t)half * heads));
  const float* src = qkv + ((int64_t)row * heads + head) * head_dim;
  float a = src[pair], b = src[pair + half];
  float* dst;
  if (head < q_heads) {
    dst = q + ((int64_t)row * q_heads + head) * head_dim;
  } else if (head < q_heads + kv_heads) {
    dst = k + ((int64_t)row * kv_heads + head - q_heads) * head_dim;
  } else {
    dst = v + ((int64_t)row * kv_heads + head - q_heads - kv_heads) * head_dim;
  }
  if (head < q_heads + kv_heads) {
    const double inv_freq = pow((double)theta, -2.0 * pair / head_dim);
    double s, c;
    sincos((double)positions[row] * inv_freq, &s, &c);
    const float cf = (float)c, sf = (float)s;
    const float ra = a * cf - b * sf, rb = b * cf + a * sf;
    a = ra;
    b = rb;
  }
  dst[pair] = a;
  dst[pair + half] = b;
}

// out[row, j] = silu(gu[row, j]) * gu[row, ffn + j] for the packed [gate | up] rows.
PKV_KERNEL void pkv_silu_mul_f32(const float* gu, float* out, int rows, int ffn) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)rows * ffn) return;
  const int64_t row = i / ffn, j = i - row * ffn;
  const float g = gu[row * 2 * ffn + j], u = gu[row * 2 * ffn + ffn + j];
  out[i] = g / (1.0f + expf(-g)) * u;
}

// This step's K and V rows ([n_tokens, kv_heads, head_dim] f32) into f16 (BF16 = 0) or
// bf16 (BF16 = 1, as uint16 bits) pools at slots[t] (slot = block * block_size + offset;
// -1 skips a token). Round to nearest even, as pagedkv.pool.float32_to_bf16_bits and
// NumPy's float16 cast. One thread per value, K and V both.
PKV_DEV uint16_t to_bf16_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);  // quiet NaN
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <bool BF16>
PKV_DEV void kv_write(const float* k, const float* v, const int64_t* slots, uint16_t* k_pool,
                      uint16_t* v_pool, int n_tokens, int row_values) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)n_tokens * row_values) return;
  const int64_t t = i / row_values, e = i - t * row_values;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  const int64_t at = slot * row_values + e;
  k_pool[at] = BF16 ? to_bf16_bits(k[i]) : pkv_float_to_half_bits(k[i]);
  v_pool[at] = BF16 ? to_bf16_bits(v[i]) : pkv_float_to_half_bits(v[i]);
}

PKV_KERNEL void pkv_kv_write_f16(const float* k, const float* v, const int64_t* slots,
                                 uint16_t* k_pool, uint16_t* v_pool, int n_tokens,
                                 int row_values) {
  kv_write<false>(k, v, slots, k_pool, v_pool, n_tokens, row_values);
}
PKV_KERNEL void pkv_kv_write_bf16(const float* k, const float* v, const int64_t* slots,
                                  uint16_t* k_pool, uint16_t* v_pool, int n_tokens,
                                  int row_values) {
  kv_write<true>(k, v, slots, k_pool, v_pool, n_tokens, row_values);
}
