// The small kernels of a decoder step between the GEMVs and attention (the
// `pagedkv.bench decode` step, docs/kernels.md "Decode step"): RMSNorm (fused with
// the residual add), RoPE on the packed QKV projection (split into q, k, v), SiLU(gate)
// * up of the packed gate/up projection, and the f16/bf16 KV write of this step's
// tokens into a device pool at the adapter's slot mapping. Activations are f32.
//
// Parameters: inputs, outputs, then scalars.
#include "pagedkv_compat.h"
#include <pagedkv/kvquant.h>
#include <pagedkv/launch.h>
#include <pagedkv/quant.h>
#include "attention_reduce.h"
#include "gemv_prep_x.h"

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

// A thread's share of a row: its k-th float4 (k = 0, 1, ...) is at norm_vec_index(k, dim), -1
// past the end. When dim % 256 == 0 a 32-lane warp owns whole 256-groups (groups w, w + warps,
// ...; lane L float4s 2L and 2L + 1 of each: the values gemv_prep_x_warp wants in a lane), so
// the fused kernel preps from registers; otherwise float4 t + threads * k. The plain and the
// fused RMSNorm share it, so both sum x^2 in one order and round alike.
PKV_DEV int norm_vec_index(int k, int dim) {
  if (dim % 256 == 0) {
    const int g = (int)threadIdx.x / 32 + (PKV_NORM_THREADS / 32) * (k / 2);
    return g < dim / 256 ? g * 64 + 2 * ((int)threadIdx.x % 32) + (k & 1) : -1;
  }
  const int i = (int)threadIdx.x + PKV_NORM_THREADS * k;
  return i < dim / 4 ? i : -1;
}

// ss + the squares of v's four values, as explicit FMAs in one order. The plain and the
// fused RMSNorm inline add_residual_rms_inv into different code, and `a*a + b*b + ...` left
// to the compiler was contracted into FMAs differently in the two: about one row in 25 of
// dim 10240 got another 1/rms, every y and prepared-x byte of the row (2026-12-07;
// tests/test_kernels_decode_fused.py, docs/reliability.md).
PKV_DEV float add_squares(float ss, float4 v) {
  ss = fmaf(v.x, v.x, ss);
  ss = fmaf(v.y, v.y, ss);
  ss = fmaf(v.z, v.z, ss);
  return fmaf(v.w, v.w, ss);
}

// A row's x += residual (when rr is not null; written back), then 1 / sqrt(mean(x^2) + eps)
// over the block. The thread's first PKV_NORM_CACHED_VECS float4s of x (after the add) and
// of the weight stay in xv / wv: all their loads are issued before the first store (x's
// store-back could alias them otherwise), one memory round trip instead of one per float4
// (the kernel is latency-bound: one block per row, a few KiB), and the output pass reads
// no x again. Later float4s (rows above PKV_NORM_THREADS * 4 * PKV_NORM_CACHED_VECS
// values) are re-read by the thread that wrote them.
PKV_DEV float add_residual_rms_inv(float4* xr, const float4* rr, const float4* wr, int dim,
                                   float eps, float* red, float4 (&xv)[PKV_NORM_CACHED_VECS],
                                   float4 (&wv)[PKV_NORM_CACHED_VECS]) {
  float4 rv[PKV_NORM_CACHED_VECS];
#pragma unroll
  for (int k = 0; k < PKV_NORM_CACHED_VECS; ++k) {
    const int j = norm_vec_index(k, dim);
    if (j >= 0) {
      xv[k] = xr[j];
      wv[k] = wr[j];
      if (rr) rv[k] = rr[j];
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < PKV_NORM_CACHED_VECS; ++k) {
    const int j = norm_vec_index(k, dim);
    if (j >= 0) {
      float4& v = xv[k];
      if (rr) {
        v.x += rv[k].x; v.y += rv[k].y; v.z += rv[k].z; v.w += rv[k].w;
        xr[j] = v;
      }
      ss = add_squares(ss, v);
    }
  }
  for (int k = PKV_NORM_CACHED_VECS, j; (j = norm_vec_index(k, dim)) >= 0; ++k) {
    float4 v = xr[j];
    if (rr) {
      const float4 r = rr[j];
      v.x += r.x; v.y += r.y; v.z += r.z; v.w += r.w;
      xr[j] = v;
    }
    ss = add_squares(ss, v);
  }
  return rsqrtf(block_sum(ss, red) / (float)dim + eps);
}

// x / rms * weight per element, likewise one expression for both.
PKV_DEV float4 normalized(float4 v, float inv, float4 w) {
  return make_float4(v.x * inv * w.x, v.y * inv * w.y, v.z * inv * w.z, v.w * inv * w.w);
}

// One block per row: if `residual` is not null, x += residual first (written back);
// then y = x / sqrt(mean(x^2) + eps) * weight. dim % 4 == 0, rows 16-byte aligned.
PKV_KERNEL void __launch_bounds__(PKV_NORM_THREADS)
    pkv_add_rmsnorm_f32(float* x, const float* residual, const float* weight, float* y,
                        int dim, float eps) {
  pkv_grid_dependency_wait();  // PDL: the previous kernel's outputs are ready from here
  pkv_launch_dependents();
  __shared__ float red[PKV_NORM_THREADS / PKV_WARP_SIZE];
  float4* xr = (float4*)(x + (int64_t)blockIdx.x * dim);
  const float4* rr = residual ? (const float4*)(residual + (int64_t)blockIdx.x * dim) : nullptr;
  const float4* wr = (const float4*)weight;
  float4 xv[PKV_NORM_CACHED_VECS], wv[PKV_NORM_CACHED_VECS];
  const float inv = add_residual_rms_inv(xr, rr, wr, dim, eps, red, xv, wv);
  float4* yr = (float4*)(y + (int64_t)blockIdx.x * dim);
#pragma unroll
  for (int k = 0; k < PKV_NORM_CACHED_VECS; ++k) {
    const int j = norm_vec_index(k, dim);
    if (j >= 0) yr[j] = normalized(xv[k], inv, wv[k]);
  }
  for (int k = PKV_NORM_CACHED_VECS, j; (j = norm_vec_index(k, dim)) >= 0; ++k)
    yr[j] = normalized(xr[j], inv, wr[j]);  // this thread wrote xr[j] itself
}

// The fused kernel's work on one 256-group of a row (norm_vec_index's group layout: the
// lane's float4s j and j + 1, already normalized): y when not null, then the prepared x.
PKV_DEV void rmsnorm_prep_group(float4 lo, float4 hi, int j, int b, float* y, uint32_t* xq,
                                float4* xs, int dim, int batch, int n_tiles, int rotate) {
  if (y) {
    float4* yr = (float4*)(y + (int64_t)b * dim);
    yr[j] = lo;
    yr[j + 1] = hi;
  }
  float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  gemv_prep_x_warp(v, (int)threadIdx.x % 32, j / 64, b, xq, xs, batch, n_tiles, rotate != 0);
}

// RMSNorm as above, then the normalized row's prepared x for the tensor-core GEMV that
// reads it (xq, xs: the Gemv's scratch, `n_tiles` its n-tiles, `rotate` for the MQ
// formats); y is written too unless null. One block per row (= batch row), its 32-lane
// warps one 256-group at a time (norm_vec_index's group layout); dim % 256 == 0.
PKV_KERNEL void __launch_bounds__(PKV_NORM_THREADS)
    pkv_add_rmsnorm_prep_f32(float* x, const float* residual, const float* weight, float* y,
                             uint32_t* xq, float4* xs, int dim, float eps, int batch,
                             int n_tiles, int rotate) {
  pkv_grid_dependency_wait();  // PDL: the previous kernel's outputs are ready from here
  pkv_launch_dependents();
  __shared__ float red[PKV_NORM_THREADS / PKV_WARP_SIZE];
  const int b = blockIdx.x;
  float4* xr = (float4*)(x + (int64_t)b * dim);
  const float4* rr = residual ? (const float4*)(residual + (int64_t)b * dim) : nullptr;
  const float4* wr = (const float4*)weight;
  float4 xv[PKV_NORM_CACHED_VECS], wv[PKV_NORM_CACHED_VECS];
  const float inv = add_residual_rms_inv(xr, rr, wr, dim, eps, red, xv, wv);
  // k = 2m and 2m + 1 are the lane's two float4s of the warp's m-th group; whole warps
  // take the same branches (gemv_prep_x_warp shuffles)
  static_assert(PKV_NORM_CACHED_VECS % 2 == 0, "a group's two float4s are cached together");
#pragma unroll
  for (int k = 0; k < PKV_NORM_CACHED_VECS; k += 2) {
    const int j = norm_vec_index(k, dim);
    if (j >= 0)
      rmsnorm_prep_group(normalized(xv[k], inv, wv[k]), normalized(xv[k + 1], inv, wv[k + 1]),
                         j, b, y, xq, xs, dim, batch, n_tiles, rotate);
  }
  for (int k = PKV_NORM_CACHED_VECS, j; (j = norm_vec_index(k, dim)) >= 0; k += 2)
    rmsnorm_prep_group(normalized(xr[j], inv, wr[j]), normalized(xr[j + 1], inv, wr[j + 1]), j,
                       b, y, xq, xs, dim, batch, n_tiles, rotate);
}

// Rotate the pair (a, b) = (dim pair, dim pair + head_dim/2) of a head by RoPE at `pos`,
// the angle computed in double (see below).
PKV_DEV void rope_rotate(float& a, float& b, int32_t pos, int pair, int head_dim, float theta) {
  const double inv_freq = pow((double)theta, -2.0 * pair / head_dim);
  double s, c;
  sincos((double)pos * inv_freq, &s, &c);
  const float cf = (float)c, sf = (float)s;
  // each product and sum rounded on its own: no FMA contraction that could differ between
  // the split and the fused KV write
  const float ra = pkv_add_rn(pkv_mul_rn(a, cf), -pkv_mul_rn(b, sf));
  const float rb = pkv_add_rn(pkv_mul_rn(b, cf), pkv_mul_rn(a, sf));
  a = ra;
  b = rb;
}

// RoPE (rotate-half pairing: dim i with i + head_dim/2, angle pos * theta^(-2i/head_dim),
// computed in double so a 32k-token position keeps its precision) on the q and k heads of a
// packed QKV row [q_heads | kv_heads | kv_heads] x head_dim, written out split: q
// [rows, q_heads, head_dim], k and v [rows, kv_heads, head_dim] (v copied unrotated).
// positions[row]: the token's position. One thread per (row, head, pair).
PKV_KERNEL void pkv_qkv_rope_split_f32(const float* qkv, const int32_t* positions, float* q,
                                       float* k, float* v, int rows, int q_heads,
                                       int kv_heads, int head_dim, float theta) {
  pkv_grid_dependency_wait();  // PDL: the previous kernel's outputs are ready from here
  pkv_launch_dependents();
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
  if (head < q_heads + kv_heads) rope_rotate(a, b, positions[row], pair, head_dim, theta);
  dst[pair] = a;
  dst[pair + half] = b;
}

// silu(g) * u for the plain and the fused kernel alike (the sum rounded on its own: no
// contraction with expf's last product that could differ between the two).
PKV_DEV float silu_times(float g, float u) { return g / pkv_add_rn(1.0f, expf(-g)) * u; }

// out[row, j] = silu(gu[row, j]) * gu[row, ffn + j] for the packed [gate | up] rows.
PKV_KERNEL void pkv_silu_mul_f32(const float* gu, float* out, int rows, int ffn) {
  pkv_grid_dependency_wait();  // PDL: the previous kernel's outputs are ready from here
  pkv_launch_dependents();
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)rows * ffn) return;
  const int64_t row = i / ffn, j = i - row * ffn;
  out[i] = silu_times(gu[row * 2 * ffn + j], gu[row * 2 * ffn + ffn + j]);
}

// SiLU(gate) * up as above, written as the prepared x of the down projection's
// tensor-core GEMV (xq, xs, n_tiles, rotate as in pkv_add_rmsnorm_prep_f32); `out` too
// unless null. One 32-lane warp per (256-group, row), like pkv_gemv_prep_x; ffn % 256 == 0.
PKV_KERNEL void pkv_silu_mul_prep_f32(const float* gu, float* out, uint32_t* xq, float4* xs,
                                      int rows, int ffn, int n_tiles, int rotate) {
  pkv_grid_dependency_wait();  // PDL: the previous kernel's outputs are ready from here
  pkv_launch_dependents();
  const int lane = threadIdx.x % 32;
  const int64_t wid = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int groups = ffn / 256;
  if (wid >= (int64_t)groups * rows) return;  // whole warps leave together
  const int g = (int)(wid % groups), row = (int)(wid / groups);
  const int64_t j0 = (int64_t)g * 256 + 8 * lane;
  const float* gate = gu + (int64_t)row * 2 * ffn + j0;
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; i += 4) {
    const float4 a = *(const float4*)(gate + i), u = *(const float4*)(gate + ffn + i);
    v[i] = silu_times(a.x, u.x);
    v[i + 1] = silu_times(a.y, u.y);
    v[i + 2] = silu_times(a.z, u.z);
    v[i + 3] = silu_times(a.w, u.w);
  }
  if (out) {
    float4* dst = (float4*)(out + (int64_t)row * ffn + j0);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
  gemv_prep_x_warp(v, lane, g, row, xq, xs, rows, n_tiles, rotate != 0);
}

// Paged attention's partition reduce (pkv_paged_attention_reduce, hip/kvcache.hip) written
// as the prepared x of the O projection's tensor-core GEMV (xq, xs, n_tiles, rotate as in
// pkv_add_rmsnorm_prep_f32); `out` ([num_seqs, num_heads, head_dim], the reduce's output)
// too unless null. x row seq is out[seq] flattened: K = num_heads * head_dim, a multiple of
// 256, so a 256-group spans 256 / head_dim heads (head_dim <= 256 divides 256). One block
// per (256-group, seq) = (blockIdx.x, blockIdx.y) of PKV_ATTN_REDUCE_SLICES 32-lane warps:
// hip/attention_reduce.h's attn_block_slices with lane L of every warp on x[8L, 8L + 8) of
// the group (8 dims of one head, head_dim % 8 == 0), the group's heads' headers computed
// one per warp; the slices' sums and their total are the reduce's, so its values are the
// reduce's bit for bit. Warp 0 then adds the slices and writes them through
// gemv_prep_x_warp. The partition geometry (max_partitions, partition_tokens) is the
// partition launch's.
PKV_KERNEL void pkv_attention_reduce_prep_f32(const float* part_out, const float* part_max,
                                              const float* part_sum, const int32_t* seq_lens,
                                              float* out, uint32_t* xq, float4* xs,
                                              int num_seqs, int num_heads, int head_dim,
                                              int max_partitions, int partition_tokens,
                                              int n_tiles, int rotate) {
  pkv_grid_dependency_wait();  // PDL: the previous kernel's outputs are ready from here
  pkv_launch_dependents();
  __shared__ float sums[PKV_ATTN_REDUCE_SLICES * ATTN_SUMS_STRIDE];
  __shared__ AttnCombine header[8];  // the group's heads: 256 / head_dim <= 8
  const int lane = threadIdx.x % 32, g = blockIdx.x, seq = blockIdx.y;
  const int heads = 256 / head_dim, h0 = g * heads;  // the group's heads
  const int mine = 8 * lane / head_dim, d0 = 8 * lane - mine * head_dim;
  const int64_t hp0 = ((int64_t)seq * num_heads + h0) * max_partitions;
  const int n = attn_partition_count(seq_lens[seq], partition_tokens);
  const AttnCombine c = attn_block_slices<8>(
      part_max + hp0, part_sum + hp0, max_partitions, heads, mine,
      part_out + (hp0 + (int64_t)mine * max_partitions) * head_dim + d0, head_dim, n, header,
      sums);
  if (threadIdx.x >= 32) return;  // warp 0 (AMD: the wavefront's first half) writes
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j)
    v[j] = attn_slices_total(sums, 8 * lane + j, attn_slice_count(n), c.inv);
  if (out) {
    float4* dst = (float4*)(out + ((int64_t)seq * num_heads + h0) * head_dim + 8 * lane);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
  gemv_prep_x_warp(v, lane, g, seq, xq, xs, num_seqs, n_tiles, rotate != 0);
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
  pkv_grid_dependency_wait();  // PDL: the previous kernel's outputs are ready from here
  pkv_launch_dependents();
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

// The step's RoPE, split and KV write in one kernel: q as pkv_qkv_rope_split_f32 writes
// it, this token's k (rotated) and v straight into the pool at slots[row] (-1: q only),
// the same bytes as the split followed by pkv_kv_write_{f16,bf16} / pkv_kv_q8_write_f32.
// One thread per (row, head, pair) as above. q8 (KIND 2): the 32 lanes of pairs
// [32c, 32c + 32) of one head hold two whole 32-value records, their first halves (dims
// 32c..) and their second (dims half + 32c..): each record's scale is a 32-lane max, so
// head_dim % 64 == 0 and every lane takes part (rows * heads * half is then a multiple
// of 32, whole warps leave together).
template <int KIND>  // 0: f16 pool, 1: bf16, 2: q8
PKV_DEV void qkv_rope_kv_write(const float* qkv, const int32_t* positions, const int64_t* slots,
                               float* q, void* k_pool, void* v_pool, int rows, int q_heads,
                               int kv_heads, int head_dim, float theta) {
  pkv_grid_dependency_wait();  // PDL: the previous kernel's outputs are ready from here
  pkv_launch_dependents();
  const int half = head_dim / 2;
  const int heads = q_heads + 2 * kv_heads;
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)rows * heads * half) return;
  const int pair = (int)(i % half);
  const int head = (int)((i / half) % heads);
  const int row = (int)(i / ((int64_t)half * heads));
  const float* src = qkv + ((int64_t)row * heads + head) * head_dim;
  float a = src[pair], b = src[pair + half];
  if (head < q_heads + kv_heads) rope_rotate(a, b, positions[row], pair, head_dim, theta);
  if (head < q_heads) {
    float* dst = q + ((int64_t)row * q_heads + head) * head_dim;
    dst[pair] = a;
    dst[pair + half] = b;
    return;  // a whole head's pairs are whole warps: the q8 shuffles below stay uniform
  }
  const bool is_k = head < q_heads + kv_heads;
  const int kv_head = is_k ? head - q_heads : head - q_heads - kv_heads;
  const int64_t slot = slots[row];
  if (KIND == 2) {
    float amax_a = fabsf(a), amax_b = fabsf(b);
    for (int m = 16; m > 0; m >>= 1) {
      amax_a = pkv_kvq8_amax(amax_a, pkv_shfl_xor(amax_a, m));
      amax_b = pkv_kvq8_amax(amax_b, pkv_shfl_xor(amax_b, m));
    }
    if (slot < 0) return;
    const int recs_per_row = head_dim / PKV_KVQ8_BLOCK;
    uint8_t* row_out = (uint8_t*)(is_k ? k_pool : v_pool) +
                       (slot * kv_heads + kv_head) * recs_per_row * PKV_KVQ8_RECORD_BYTES;
    const int j = pair % PKV_KVQ8_BLOCK;
    uint8_t* out_a = row_out + (pair / PKV_KVQ8_BLOCK) * PKV_KVQ8_RECORD_BYTES;
    uint8_t* out_b = row_out + ((pair + half) / PKV_KVQ8_BLOCK) * PKV_KVQ8_RECORD_BYTES;
    out_a[2 + j] = (uint8_t)(int8_t)pkv_kvq8_code(a, pkv_kvq8_inv_scale(amax_a));
    out_b[2 + j] = (uint8_t)(int8_t)pkv_kvq8_code(b, pkv_kvq8_inv_scale(amax_b));
    if (j == 0) {
      pkv_store_u16le(out_a, pkv_kvq8_scale_bits(amax_a));
      pkv_store_u16le(out_b, pkv_kvq8_scale_bits(amax_b));
    }
    return;
  }
  if (slot < 0) return;
  uint16_t* dst = (uint16_t*)(is_k ? k_pool : v_pool) +
                  (slot * kv_heads + kv_head) * head_dim;
  dst[pair] = KIND == 1 ? to_bf16_bits(a) : pkv_float_to_half_bits(a);
  dst[pair + half] = KIND == 1 ? to_bf16_bits(b) : pkv_float_to_half_bits(b);
}

#define PKV_QKV_ROPE_KV_WRITE(NAME, KIND)                                                   \
  PKV_KERNEL void pkv_qkv_rope_kv_write_##NAME(                                             \
      const float* qkv, const int32_t* positions, const int64_t* slots, float* q,           \
      void* k_pool, void* v_pool, int rows, int q_heads, int kv_heads, int head_dim,        \
      float theta) {                                                                        \
    qkv_rope_kv_write<KIND>(qkv, positions, slots, q, k_pool, v_pool, rows, q_heads,        \
                            kv_heads, head_dim, theta);                                     \
  }
PKV_QKV_ROPE_KV_WRITE(f16, 0)
PKV_QKV_ROPE_KV_WRITE(bf16, 1)
PKV_QKV_ROPE_KV_WRITE(q8, 2)
