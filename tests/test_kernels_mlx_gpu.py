"""pagedkv.kernels.mlx on an MLX GPU backend (Metal on a Mac, CUDA on NVIDIA) against the
NumPy references: every output poisoned before its launch (NaN, or 255 in integer
outputs), fresh random inputs. Skipped without an MLX GPU; with PAGEDKV_REQUIRE_GPU=1 a
missing one is a failure (hip/device_check.sh with MLX=1 runs these on the H200)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_support import gpu_required
from mlx_kernel_cases import (
    GEMV_FORMATS,
    QUANT_FORMATS,
    attention_case,
    bits_equal,
    fresh_rng,
    gemv_case,
    to_mlx_pool,
    weights_case,
)
from pagedkv.kernels import numpy_kernels as ref

pytestmark = pytest.mark.gpu
mx = pytest.importorskip("mlx.core")
K = pytest.importorskip("pagedkv.kernels.mlx")


@pytest.fixture(autouse=True)
def gpu_backend(monkeypatch):
    monkeypatch.delenv("PAGEDKV_MLX_KERNELS", raising=False)
    name = K.backend()
    if name == "ops":
        if gpu_required():
            pytest.fail(f"PAGEDKV_REQUIRE_GPU is set but MLX runs on {mx.default_device()} "
                        f"(no Metal or CUDA backend)")
        pytest.skip(f"no MLX GPU backend (MLX default device {mx.default_device()})")
    from pagedkv.kernels.mlx.launch import poisoning
    real = K._impl

    def poisoned():
        n, impl, run = real()
        return n, impl, poisoning(run)
    monkeypatch.setattr(K, "_impl", poisoned)
    return name


def _within_group_ulp(got, expect, group: int) -> bool:
    """|got - expect| <= one f32 ulp of the group's largest magnitude (GPU decoders may
    fuse q * scale + offset)."""
    n = expect.size
    pad = -n % group
    mags = np.abs(np.concatenate([expect, np.zeros(pad, np.float32)])).reshape(-1, group)
    ulp = np.repeat(np.spacing(mags.max(axis=1)), group)[:n]
    return bool((np.abs(got.astype(np.float64) - expect) <= ulp).all())


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_dequantize(fmt):
    from pagedkv.quant.formats import resolve
    rng, seed = fresh_rng()
    raw, numel = weights_case(rng, fmt)
    got = np.array(K.dequantize(mx.array(raw), fmt, numel, basis="rotated"))
    expect = ref.dequantize(raw, fmt, numel)
    assert _within_group_ulp(got, expect, resolve(fmt).group_size), f"seed {seed}"
    half = np.array(K.dequantize(mx.array(raw), fmt, numel, dtype=mx.float16, basis="rotated"))
    assert np.isfinite(half).all() and np.allclose(half, expect, rtol=1e-3, atol=1e-3)


def test_fwht256_bit_exact():
    rng, seed = fresh_rng()
    x = rng.standard_normal((33, 512)).astype(np.float32)
    assert bits_equal(np.array(K.fwht256(mx.array(x))), ref.fwht256(x)), f"seed {seed}"


def _gemv_inputs(fmt, M, K_, batch):
    """``(weights prepared, x, expected y, tolerance, seed)`` on fresh random inputs."""
    rng, seed = fresh_rng()
    raw, x, expect, tol = gemv_case(rng, fmt, M, K_, batch)
    return K.prepare_gemv(mx.array(raw), fmt, M, K_), x, expect, tol, seed


@pytest.mark.parametrize("fmt", GEMV_FORMATS)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_gemv(fmt, batch):
    w, x, expect, tol, seed = _gemv_inputs(fmt, 333, 1280, batch)
    got = np.array(K.gemv(w, mx.array(x)))
    err = np.abs(got - expect)
    assert (err <= tol).all(), f"{w!r}, seed {seed}: max error {err.max()}"


@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256v2"])
@pytest.mark.parametrize("batch", [1, 2])
def test_gemv_fused_x_is_the_two_launch_gemv_bit_for_bit(monkeypatch, gpu_backend, fmt, batch):
    if gpu_backend != "cuda":
        pytest.skip("the fused-x kernel is MLX CUDA's (hip/ on NVIDIA)")
    # K = 4352: 17 groups over 8 warps: some take 3, the next group loaded ahead
    w, x, expect, tol, seed = _gemv_inputs(fmt, 333, 4352, batch)
    outs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PAGEDKV_GEMV_FUSED_X", fused)
        outs[fused] = np.array(K.gemv(w, mx.array(x)))
    assert bits_equal(outs["1"], outs["0"]), f"seed {seed}"
    assert (np.abs(outs["1"] - expect) <= tol).all(), f"seed {seed}"


@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256v2"])
@pytest.mark.parametrize("batch", [1, 8, 11])
def test_gemv_inside_mx_compile_is_the_uncompiled_gemv_bit_for_bit(fmt, batch):
    # Under mx.compile MLX traces the custom-kernel launches once and replays them (no
    # kernel built per call: python -m pagedkv.bench mlx's "[mx.compile]" rows); the
    # replays must launch the same kernels on the same inputs. 11 rows: two chunks, joined
    # inside the trace.
    w, x, expect, tol, seed = _gemv_inputs(fmt, 333, 1280, batch)
    want = np.array(K.gemv(w, mx.array(x)))
    step = mx.compile(lambda xs: K.gemv(w, xs))
    for _ in range(2):  # the trace, then a replay
        assert bits_equal(np.array(step(mx.array(x))), want), f"seed {seed}"
    assert (np.abs(want - expect) <= tol).all(), f"seed {seed}"


def test_kv_q8_write_and_read():
    rng, seed = fresh_rng()
    v = (rng.standard_normal((37, 4, 128)) * 3).astype(np.float32)
    assert bits_equal(np.array(K.kv_q8_quantize(mx.array(v))), ref.kv_q8_quantize(v))
    pool = rng.integers(0, 256, (64, 4, 136), dtype=np.uint8)
    slots = rng.permutation(64)[:37]
    slots[5] = -1
    out = np.array(K.kv_q8_write(mx.array(pool), slots, mx.array(v)))
    expect = pool.copy()
    expect[slots[slots >= 0]] = ref.kv_q8_quantize(v[slots >= 0])
    assert bits_equal(out, expect), f"seed {seed}"
    read = np.array(K.kv_q8_read(mx.array(expect), slots[slots >= 0]))
    assert bits_equal(read, ref.kv_q8_dequantize(expect[slots[slots >= 0]], 128))


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "q8"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(32, 8, 128), (8, 8, 64), (16, 2, 256), (12, 4, 32)])
def test_paged_attention(kv_dtype, heads, kv_heads, head_dim):
    rng, seed = fresh_rng()
    lens = [int(rng.integers(1, 3000)), 0, 1, 1025, int(rng.integers(1, 64))]
    q, kp, vp, tables, lens_arr, expect = attention_case(
        rng, kv_dtype, seqs=len(lens), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        block_size=16, lens=lens)
    got = K.paged_attention(mx.array(q), to_mlx_pool(mx, kp, kv_dtype),
                            to_mlx_pool(mx, vp, kv_dtype), tables, lens_arr)
    np.testing.assert_allclose(np.array(got), expect, rtol=1e-4, atol=2e-5,
                               err_msg=f"seed {seed}")


@pytest.mark.parametrize("offset", [1, 4])
def test_q8_attention_over_a_pool_view_off_alignment_gives_the_aligned_bits(gpu_backend,
                                                                            offset):
    """A q8 pool that starts ``offset`` bytes into its MLX buffer (a uint8 view: MLX gives
    the launcher no address to check) runs the staged kernel as an aligned pool does, its
    chunks copied by byte loads instead of cp.async (hip/kvcache.hip, q8_stage_bytes): the
    same staged bytes, so the same bits."""
    if gpu_backend != "cuda":
        pytest.skip("the staged q8 kernels are MLX CUDA's")
    from pagedkv.kernels import kvcache
    from pagedkv.kernels.mlx import cuda
    rng, seed = fresh_rng()
    lens = [int(n) for n in rng.integers(1500, 2100, 8)]
    q, kp, vp, tables, lens_arr, expect = attention_case(
        rng, "q8", seqs=8, heads=8, kv_heads=2, head_dim=128, block_size=16, lens=lens)
    sms = cuda.sm_count()
    tokens = kvcache.attention_partition_tokens("q8", 8, 2, max(lens), sms)
    assert kvcache.q8_staged_by_default(128, 4, tokens, 16 * -(-max(lens) // tokens), sms)

    def shifted(pool):
        flat = mx.array(np.concatenate([np.zeros(offset, np.uint8), pool.reshape(-1)]))
        return flat[offset:].reshape(pool.shape)
    aligned = np.array(K.paged_attention(mx.array(q), mx.array(kp), mx.array(vp), tables,
                                         lens_arr))
    got = np.array(K.paged_attention(mx.array(q), shifted(kp), shifted(vp), tables, lens_arr))
    assert np.isfinite(got).all() and bits_equal(got, aligned), f"seed {seed}"
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=2e-5, err_msg=f"seed {seed}")


def test_copy_blocks():
    rng, seed = fresh_rng()
    src = rng.standard_normal((40, 16, 8, 128)).astype(np.float16)
    dst = rng.standard_normal((30, 16, 8, 128)).astype(np.float16)
    si, di = rng.permutation(40)[:20], rng.permutation(30)[:20]
    got = K.copy_blocks(mx.array(src), si, di, mx.array(dst))
    assert bits_equal(np.array(got), ref.copy_blocks(src, si, di, dst)), f"seed {seed}"
    odd = rng.integers(0, 256, (9, 7, 3), dtype=np.uint8)
    got = K.copy_blocks(mx.array(odd), [8, 1], [0, 2], mx.array(odd))
    assert bits_equal(np.array(got), ref.copy_blocks(odd, [8, 1], [0, 2], odd))


@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256v2"])
def test_inline_headers_give_the_include_path_s_bits(gpu_backend, fmt):
    """The earlier inline-header path (PAGEDKV_MLX_CUDA_HEADER=inline, the fallback if the
    #include path breaks) computes the same bits: the same kernels, the text passed by
    value instead of by file."""
    if gpu_backend != "cuda":
        pytest.skip("header modes are MLX CUDA's")
    from pagedkv.kernels.mlx import cuda
    rng, seed = fresh_rng()
    raw, x, _, _ = gemv_case(rng, fmt, 333, 1280, 5)
    q, kp, vp, tables, lens_arr, _ = attention_case(
        rng, "float16", seqs=3, heads=8, kv_heads=2, head_dim=128, block_size=16,
        lens=[1500, 1, 17])
    w = K.prepare_gemv(mx.array(raw), fmt, 333, 1280)
    pools = to_mlx_pool(mx, kp, "float16"), to_mlx_pool(mx, vp, "float16")
    outs = {}
    try:
        for mode in ("include", "inline"):
            cuda.set_header_mode(mode)
            outs[mode] = (np.array(K.gemv(w, mx.array(x))),
                          np.array(K.paged_attention(mx.array(q), *pools, tables, lens_arr)))
    finally:
        cuda.set_header_mode("include")
    for a, b in zip(outs["include"], outs["inline"], strict=True):
        assert np.isfinite(a).all() and bits_equal(a, b), f"seed {seed}"
