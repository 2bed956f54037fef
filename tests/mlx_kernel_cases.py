"""Inputs and NumPy expectations shared by the pagedkv.kernels.mlx tests (ops path,
Metal emulator, MLX GPU): fresh random data every run (the seed is in every failure
message), ragged sizes, and the tolerances of docs/kernels.md ("MLX dispatch")."""

from __future__ import annotations

import os

import numpy as np

from pagedkv import quant
from pagedkv.kernels import numpy_kernels as ref
from pagedkv.quant.formats import CODECS

#: Every P1 quantized format (the raw F16/F32/BF16 ones widen without a kernel; the P2
#: formats of docs/formats/quant.md have no MLX path and raise UnsupportedQuantType there).
QUANT_FORMATS = tuple(c.name for c in CODECS.values() if c.kind in ("affine", "q8", "lloyd"))
#: The ones with a Metal/MLX-CUDA kernel (the Lloyd codebooks decode through array ops).
KERNEL_QUANT_FORMATS = tuple(c.name for c in CODECS.values() if c.kind in ("affine", "q8"))
GEMV_FORMATS = ("hfq4g256", "mq4g256", "mq4g256v2", "hfq6g256", "q8f16")


def fresh_rng() -> tuple[np.random.Generator, int]:
    """A generator seeded from the OS (``PAGEDKV_TEST_SEED`` replays one)."""
    seed = int(os.environ.get("PAGEDKV_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    return np.random.default_rng(seed), seed


def weights_case(rng, fmt: str) -> tuple[np.ndarray, int]:
    """Stored bytes of a random tensor: 5000 weights (a short last group) for unrotated
    formats, 4352 (17 groups of 256) for rotated ones."""
    codec = quant.formats.resolve(fmt)
    numel = 4352 if codec.rotated else 5000
    w = (rng.standard_normal(numel) * rng.uniform(0.01, 3)).astype(np.float32)
    return quant.quantize(w, fmt), numel


def gemv_case(rng, fmt: str, M: int, K: int, batch: int):
    w = (rng.standard_normal((M, K)) * 0.05).astype(np.float32)
    raw = quant.quantize(w, fmt)
    x = rng.standard_normal((batch, K)).astype(np.float32)
    rotated = quant.formats.resolve(fmt).rotated
    expect = ref.gemv(raw, fmt, M, K, x, rotated=rotated)
    wq = np.abs(quant.dequantize(raw, fmt, (M, K), basis="rotated")).astype(np.float64)
    xr = np.abs(ref.fwht256(x) if rotated else x).astype(np.float64)
    tol = 2e-5 * (xr @ wq.T)  # 2e-5 * sum |w||x| per output
    return raw, x, expect, tol


def attention_case(rng, kv_dtype: str, *, seqs: int, heads: int, kv_heads: int,
                   head_dim: int, block_size: int, lens: list[int]):
    """A decode batch with blocks in random order: (q, k_pool, v_pool, tables, lens,
    expected). Pools hold float16, bfloat16 bits (uint16) or q8 records."""
    lens_arr = np.array(lens, np.int32)
    per_seq = [-(-n // block_size) for n in lens]
    width = max(1, max(per_seq) + 1)
    num_blocks = sum(per_seq) + 3
    ids = rng.permutation(num_blocks)
    tables = np.full((seqs, width), -1, np.int32)
    k = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = ids[k:k + n]
        k += n
    shape = (num_blocks, block_size, kv_heads, head_dim)

    def pool():
        x = rng.uniform(-2, 2, shape).astype(np.float32)
        if kv_dtype == "float16":
            return x.astype(np.float16)
        if kv_dtype == "bfloat16":
            return (x.view(np.uint32) >> 16).astype(np.uint16)
        return ref.kv_q8_quantize(x)

    k_pool, v_pool = pool(), pool()
    q = rng.standard_normal((seqs, heads, head_dim)).astype(np.float32)
    expect = ref.paged_attention_decode(q, k_pool, v_pool, tables, lens_arr, kv_dtype=kv_dtype,
                                        scale=head_dim ** -0.5)
    return q, k_pool, v_pool, tables, lens_arr, expect


def to_mlx_pool(mx, pool: np.ndarray, kv_dtype: str):
    arr = mx.array(pool)
    return arr.view(mx.bfloat16) if kv_dtype == "bfloat16" else arr


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()
