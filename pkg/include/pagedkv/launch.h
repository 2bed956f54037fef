/* Launch constants of the hip/ and metal/ kernels: the one definition of every number that
 * a kernel and its launchers must agree on (threads per block, tokens per attention
 * partition, rows per block, __launch_bounds__ minimum blocks).
 *
 * Read by the kernels (the hip/ sources and metal/pagedkv_metal.h include this header) and
 * by every launcher: pagedkv.kernels.launch_constants parses the `#define PKV_<NAME> <int>`
 * lines below for the ctypes launchers (pagedkv.kernels.kvcache, .weights, .decode), the
 * MLX CUDA launcher (pagedkv.kernels.mlx.cuda) and the Metal one (.mlx.metal), and
 * tests/test_launch_constants.py fails if a launcher's value differs or a kernel source
 * defines one of these names itself. Keep each value a plain decimal integer on its own
 * `#define` line (the parser reads no expressions).
 *
 * Every value is overridable with -D for tuning sweeps (hip/tune.py), which also sets
 * the launchers' Python mirrors of the swept value. The defaults are the best of the
 * H200 sweeps (docs/performance.md).
 */
#ifndef PAGEDKV_LAUNCH_H
#define PAGEDKV_LAUNCH_H

/* --- paged-attention decode (hip/kvcache.hip) ---------------------------------------
 * Tokens per partition (one CTA per partition, kv head and sequence; the scores of a
 * partition live in shared memory) and minimum CTAs per SM, per KV dtype: f16, bf16 and
 * q8 run the tensor-core passes on sm_80+ (q8's codes become f16 fragments in registers;
 * 4 CTAs/SM leave it 128 registers, 6 spilled), q8's _cc kernels the CUDA-core ones. A
 * launcher sizes the partition count, the reduce and the dynamic shared memory from these. */
#ifndef PKV_ATTN_PARTITION_F16
#define PKV_ATTN_PARTITION_F16 1024
#endif
#ifndef PKV_ATTN_PARTITION_BF16
#define PKV_ATTN_PARTITION_BF16 1024
#endif
#ifndef PKV_ATTN_PARTITION_Q8
#define PKV_ATTN_PARTITION_Q8 512
#endif
#ifndef PKV_ATTN_MIN_BLOCKS_F16
#define PKV_ATTN_MIN_BLOCKS_F16 4
#endif
#ifndef PKV_ATTN_MIN_BLOCKS_BF16
#define PKV_ATTN_MIN_BLOCKS_BF16 4
#endif
#ifndef PKV_ATTN_MIN_BLOCKS_Q8
#define PKV_ATTN_MIN_BLOCKS_Q8 4
#endif
/* Compressed K/V pairs (fwhtN or lloydN K with a q8 or lloydN V, docs/kv-quant.md): CUDA
 * cores, q8's settings. */
#ifndef PKV_ATTN_PARTITION_QKV
#define PKV_ATTN_PARTITION_QKV 512
#endif
#ifndef PKV_ATTN_MIN_BLOCKS_QKV
#define PKV_ATTN_MIN_BLOCKS_QKV 6
#endif
/* Their tensor-core (_mma) kernels: the f16 kernel's 4 (at 6, i.e. 80 registers, the mma
 * passes spilled 40-120 bytes on sm_90; static shared memory caps them at 5 CTAs per SM at
 * head_dim 256 anyway). Same partition. */
#ifndef PKV_ATTN_MIN_BLOCKS_QKV_MMA
#define PKV_ATTN_MIN_BLOCKS_QKV_MMA 4
#endif
/* Their partition on NVIDIA (AMD's matrix-core ones keep PKV_ATTN_PARTITION_QKV: at 1,024
 * tokens and 8 heads a group their LDS would pass 64 KB). On an H100 (2026-12-06, 32 x 4096
 * and 8 x 32768) 1,024-token partitions took 0.89-0.95x the time of 512 for every _mma pair;
 * the CUDA-core kernels took up to 1.08x longer, so they keep 512. */
#ifndef PKV_ATTN_PARTITION_QKV_MMA
#define PKV_ATTN_PARTITION_QKV_MMA 1024
#endif
/* Steps of code loads each warp keeps in flight while it computes one, in the _mma kernels'
 * passes (pass 1: 8 tokens, pass 2: 16 tokens a step; a ring in registers). The loads are
 * direct, not staged: bytes in flight per SM set how much of DRAM's bandwidth a pass can
 * reach. hip/tune.py attn --kv fwht4/lloyd4 sweeps it. */
#ifndef PKV_ATTN_CODES_PREFETCH
#define PKV_ATTN_CODES_PREFETCH 1
#endif
/* The _mma kernels' centroid tables: 1 = an entry per nibble (16; lookups free of bank
 * conflicts), 0 = an entry per code byte (256; ~5 lanes a bank pair on random codes). The
 * same f16 values reach the mmas either way: outputs are bit-identical. gfx11 (WMMA) always
 * uses the byte tables (hip/kvcache.hip says why). */
#ifndef PKV_ATTN_CODE_TABLE_NIBBLES
#define PKV_ATTN_CODE_TABLE_NIBBLES 1
#endif
/* How the NVIDIA _mma kernels address a nibble table's entries: 1 = one byte permute of the
 * table's 256-byte-aligned base and the nibble's offset (a word's 8 offsets from 2 shifts
 * and 2 masks), 0 = shift, mask and add per lookup (3 instructions). Same loads, same bits;
 * kept for sweeps (hip/tune.py attn --set PKV_ATTN_CODE_TABLE_PRMT=0,1). */
#ifndef PKV_ATTN_CODE_TABLE_PRMT
#define PKV_ATTN_CODE_TABLE_PRMT 1
#endif
#ifndef PKV_ATTN_THREADS
#define PKV_ATTN_THREADS 128
#endif
/* The staged q8 kernels' (q8s) chunk buffers per warp, 16 tokens each: STAGES - 1 chunks in
 * flight while one is read. PagedAttention stages a partition by default only when it
 * gives every warp more chunks than the first STAGES - 1 copies (hip/kvcache.hip). */
#ifndef PKV_ATTN_Q8_STAGES
#define PKV_ATTN_Q8_STAGES 3
#endif
/* Their tensor copies on sm_90 (hip/kvcache.hip, PKV_ATTN_Q8_STAGE_TMA): the box the
 * launcher's tensor maps describe and the kernel expects per chunk, a 16-token chunk's
 * slots x a head_dim-128 row's 136 bytes in its 16-byte aligned window. */
#define PKV_ATTN_Q8_TMA_BOX_BYTES 144
#define PKV_ATTN_Q8_TMA_BOX_ROWS 16
/* The partition reduce (hip/attention_reduce.h): partition p is summed in slice
 * p % PKV_ATTN_REDUCE_SLICES, a 32-lane warp per slice (the reduce's block: at most this
 * many warps, fewer for fewer partitions; the fused reduce + prep's: this many). The value
 * fixes the summation order, so it fixes the last bits of every attention output: the
 * reduce and the fused reduce + prep agree bit for bit because both read it here. */
#ifndef PKV_ATTN_REDUCE_SLICES
#define PKV_ATTN_REDUCE_SLICES 8
#endif

/* --- weights (hip/weights.hip) ------------------------------------------------------ */
/* Dequantize: weights decoded per thread, threads per block (64 was the fastest of
 * 64/128/256 for every format and output on the H200). */
#ifndef PKV_DEQUANT_SPAN
#define PKV_DEQUANT_SPAN 16
#endif
#ifndef PKV_DEQUANT_THREADS
#define PKV_DEQUANT_THREADS 64
#endif
/* CUDA-core GEMV: threads per block; rows per block at batch 1-2 (8 rows share each x
 * span) and at batch 3-8 (4: x and the per-row sums already fill the registers). */
#ifndef PKV_GEMV_THREADS
#define PKV_GEMV_THREADS 128
#endif
#ifndef PKV_GEMV_ROWS_B2
#define PKV_GEMV_ROWS_B2 8
#endif
#ifndef PKV_GEMV_ROWS_B8
#define PKV_GEMV_ROWS_B8 4
#endif
/* Tensor-core GEMV: rows per block (one m16 tile), most warps per block (they split the
 * tile's groups), most n-tiles of 8 B columns (3 byte planes per batch row: batch <= 8),
 * prepared-x words per lane, group and n-tile (8 mmas x (b0, b1)). */
#ifndef PKV_GEMV_MMA_ROWS
#define PKV_GEMV_MMA_ROWS 16
#endif
#ifndef PKV_GEMV_MMA_MAX_WARPS
#define PKV_GEMV_MMA_MAX_WARPS 8
#endif
#ifndef PKV_GEMV_MMA_MAX_TILES
#define PKV_GEMV_MMA_MAX_TILES 3
#endif
/* Staged tensor-core GEMV (batch 9-32, gemv_mma_staged): most n-tiles at which the next group's weights
 * are prefetched into registers (above it they spill). */
#ifndef PKV_GEMV_MMA_PREFETCH_TILES
#define PKV_GEMV_MMA_PREFETCH_TILES 6
#endif
/* Pipelined tensor-core GEMV (batch 9-32, gemv_mma_pipe): groups in flight in its shared-
 * memory ring (x, sums and weights copied STAGES - 1 groups ahead) and 16-row tiles per
 * warp (each x fragment feeds that many mmas). Shared bytes per block grow with both
 * (weights.pipe_shared_bytes: 175.5 KiB at n12, 8 warps, 3 stages, 2 tiles). */
#ifndef PKV_GEMV_PIPE_STAGES
#define PKV_GEMV_PIPE_STAGES 3
#endif
#ifndef PKV_GEMV_PIPE_TILES_PER_WARP
#define PKV_GEMV_PIPE_TILES_PER_WARP 2
#endif
/* Half-groups of weights (1 KiB per 16-row tile) the f16-activation GEMV keeps in its
 * register ring, D - 1 in flight ahead of the one computed (weights.hip, gemv_f16). 6: H200,
 * batch 32, kernel alone, µs, HFQ4 at 4 -> 6 -> 8: 6144x4096 16.5 -> 14.5 -> 21.4 (8 costs a
 * resident block of the 384), 4096x14336 30.2 -> 28.7 -> 28.3, 4096² 12.8 -> 12.6 -> 12.7,
 * 28672x4096 (4 warps of 2 tiles) 40.1 -> 40.3 -> 51.4 (docs/kernels.md). */
#ifndef PKV_GEMV_F16_PREFETCH
#define PKV_GEMV_F16_PREFETCH 6
#endif
/* Groups of f16 x in the f16-activation GEMV's shared ring: XS - 1 copies in flight ahead of
 * the group computed (its dynamic shared memory: weights.gemv_f16_shared_bytes). */
#ifndef PKV_GEMV_F16_X_STAGES
#define PKV_GEMV_F16_X_STAGES 2
#endif
/* __launch_bounds__ minimum 256-thread blocks per SM of the f16-activation GEMV (a tuning
 * knob: 2 holds it to 128 registers, 3 to 80). 0: none, the default: nvcc 13 gives the NT = 4
 * kernel 124 registers then, but 134 with an explicit minimum of 1, and that build ran the
 * gate/up shape 25% slower on the H200 (docs/performance.md, "Batch 32: where the time goes"). */
#ifndef PKV_GEMV_F16_MIN_BLOCKS
#define PKV_GEMV_F16_MIN_BLOCKS 0
#endif
#ifndef PKV_GEMV_X_WORDS
#define PKV_GEMV_X_WORDS 16
#endif
/* The fused-x GEMV (batch 1-2, pkv_gemv_mma_x_*): 16-row tiles per block, each warp
 * running all of them on the x it prepares once per group (the MQ formats rotate it there):
 * PKV_GEMV_X_ROW_TILES for HFQ4G256 / MQ4G256V2, _WIDE for HFQ6G256 / Q8F16, whose tiles
 * hold 1.5x / 2x the registers. At the two-launch kernel's warps (which keep y its bits)
 * an H100 measured 2 faster for Q8F16 by 5-14%, within 2% for HFQ6G256, and mixed for
 * HFQ4G256 (2 4% faster at 4096x4096, 3% slower at 14336x4096): 1 for the 4-bit formats,
 * 2 for the wide ones (docs/kernels.md, 'Fused x (batch 1–2)'). */
#ifndef PKV_GEMV_X_ROW_TILES
#define PKV_GEMV_X_ROW_TILES 1
#endif
#ifndef PKV_GEMV_X_ROW_TILES_WIDE
#define PKV_GEMV_X_ROW_TILES_WIDE 2
#endif

/* --- decode-step glue (hip/decode.hip) ---------------------------------------------- */
/* RMSNorm: threads per block (one block per row; a multiple of 32: 32-lane warps own whole
 * 256-groups when dim % 256 == 0) and float4s of the row each thread keeps in registers
 * between the sum of squares and the output (512 x 4 x 4: rows up to 8192 values are read
 * once). */
#ifndef PKV_NORM_THREADS
#define PKV_NORM_THREADS 512
#endif
#ifndef PKV_NORM_CACHED_VECS
#define PKV_NORM_CACHED_VECS 4
#endif

/* --- Metal (the metal/ sources through MLX, pagedkv.kernels.mlx.metal) ----------------------
 * Apple GPUs' simdgroup width (the kernels' lane arithmetic assumes it); paged attention:
 * tokens per partition and simdgroups per threadgroup; GEMV: rows per simdgroup and
 * simdgroups per threadgroup. */
#ifndef PKV_METAL_SIMD_WIDTH
#define PKV_METAL_SIMD_WIDTH 32
#endif
#ifndef PKV_METAL_ATTN_PARTITION
#define PKV_METAL_ATTN_PARTITION 256
#endif
#ifndef PKV_METAL_ATTN_SIMDGROUPS
#define PKV_METAL_ATTN_SIMDGROUPS 4
#endif
#ifndef PKV_METAL_GEMV_ROWS
#define PKV_METAL_GEMV_ROWS 4
#endif
#ifndef PKV_METAL_GEMV_SIMDGROUPS
#define PKV_METAL_GEMV_SIMDGROUPS 2
#endif

#endif /* PAGEDKV_LAUNCH_H */
