"""The metal/ kernels without Apple hardware: compiled against metal/shim and run on the
CPU emulator, exactly as MLX's metal_kernel would wrap them (tests/metal_emulation.py),
against the NumPy references. Outputs start as 0xFF bytes; inputs are fresh random.

What this cannot show: Metal compiler diagnostics the shim does not model, fast-math
effects of Apple's compiler (exp, FMA, subnormal flushing) and speed. docs/kernels.md
("What ran where") lists them."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from metal_emulation import ROOT, SHIM, MetalEmulator, clangxx
from mlx_kernel_cases import (
    GEMV_FORMATS,
    KERNEL_QUANT_FORMATS,
    attention_case,
    bits_equal,
    fresh_rng,
    gemv_case,
    to_mlx_pool,
    weights_case,
)
from pagedkv.kernels import numpy_kernels as ref

mx = pytest.importorskip("mlx.core")
metal = pytest.importorskip("pagedkv.kernels.mlx.metal")
from pagedkv.quant.formats import resolve

if clangxx() is None:
    pytest.skip("no clang++ for the Metal shim", allow_module_level=True)


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return MetalEmulator(tmp_path_factory.mktemp("metal-emu"))


@pytest.mark.parametrize("source", ["weights.metal", "kvcache.metal"])
def test_metal_sources_compile_against_the_shim_with_address_spaces(source, tmp_path):
    """The standalone sources, entry points included (what xcrun metal compiles on a Mac)."""
    done = subprocess.run(
        [clangxx(), "-std=c++17", "-D__METAL_VERSION__=310", "-Wno-unknown-attributes",
         "-fsyntax-only", "-x", "c++", "-I", str(SHIM), "-I", str(ROOT / "pkg" / "include"),
         str(ROOT / "metal" / source)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_the_shim_rejects_a_device_pointer_where_thread_scratch_is_expected(tmp_path):
    bad = tmp_path / "bad.metal"
    bad.write_text('#include "pagedkv_metal.h"\n'
                   "inline void f(device float* y) { pkv_fwht_butterflies(y, 8u); }\n")
    done = subprocess.run(
        [clangxx(), "-std=c++17", "-D__METAL_VERSION__=310", "-Wno-unknown-attributes",
         "-fsyntax-only", "-x", "c++", "-I", str(SHIM), "-I", str(ROOT / "metal"),
         "-I", str(ROOT / "pkg" / "include"), str(bad)], capture_output=True, text=True, check=False)
    assert done.returncode != 0
    assert "address space" in done.stderr


def test_dequantize_every_p1_format(emu):
    rng, seed = fresh_rng()
    cases = {fmt: weights_case(rng, fmt) for fmt in KERNEL_QUANT_FORMATS}

    def calls(run):
        out = {}
        for fmt, (raw, numel) in cases.items():
            dt = mx.float16 if fmt in ("hfq4g256", "mq4g256v2", "q8f16") else mx.float32
            out[fmt] = (metal.dequantize(mx, mx.array(raw), resolve(fmt), numel, mx.float32, run),
                        metal.dequantize(mx, mx.array(raw), resolve(fmt), numel, dt, run), dt)
        return out

    emu.prepare(calls)
    for fmt, (f32, other, dt) in calls(emu.run).items():
        raw, numel = cases[fmt]
        expect = ref.dequantize(raw, fmt, numel)
        assert bits_equal(np.array(f32), expect), f"{fmt}, seed {seed}"
        want = expect.astype(np.float16) if dt == mx.float16 else expect
        assert bits_equal(np.array(other), want), f"{fmt} {dt}, seed {seed}"


def test_fwht256_is_bit_exact(emu):
    rng, seed = fresh_rng()
    x = (rng.standard_normal((5, 512)) * 10.0 ** rng.uniform(-10, 10)).astype(np.float32)
    got = metal.fwht256(mx, mx.array(x), emu.run)
    assert bits_equal(np.array(got), ref.fwht256(x)), f"seed {seed}"


def test_gemv_every_format_and_batch(emu):
    rng, seed = fresh_rng()
    M, K = 29, 512  # 29 rows: the last threadgroup's rows run past M
    cases = {(fmt, b): gemv_case(rng, fmt, M, K, b) for fmt in GEMV_FORMATS for b in (1, 5, 8)}

    def calls(run):
        return {key: metal.gemv(mx, mx.array(raw), resolve(key[0]), M, K, mx.array(x), run)
                for key, (raw, x, _, _) in cases.items()}

    emu.prepare(calls)
    for key, got in calls(emu.run).items():
        _, _, expect, tol = cases[key]
        err = np.abs(np.array(got) - expect)
        assert (err <= tol).all(), f"{key}, seed {seed}: max error {err.max()}"


def test_kv_q8_quantize_and_read(emu):
    rng, seed = fresh_rng()
    v32 = (rng.standard_normal((7, 2, 64)) * 3).astype(np.float32)
    v32[3, 1, 32:] = 0
    v16 = v32.astype(np.float16)
    pool = ref.kv_q8_quantize(rng.standard_normal((11, 2, 64)).astype(np.float32))
    slots = np.array([10, 0, 3, 3, 7], np.int64)

    def calls(run):
        return (metal.kv_q8_quantize(mx, mx.array(v32), run),
                metal.kv_q8_quantize(mx, mx.array(v16), run),
                metal.kv_q8_read(mx, mx.array(pool), mx.array(slots), 2, 64, mx.float32, run),
                metal.kv_q8_read(mx, mx.array(pool), mx.array(slots[:2]), 2, 64, mx.float16, run))

    emu.prepare(calls)
    q32, q16, r32, r16 = calls(emu.run)
    assert bits_equal(np.array(q32), ref.kv_q8_quantize(v32)), f"seed {seed}"
    assert bits_equal(np.array(q16), ref.kv_q8_quantize(v16.astype(np.float32)))
    assert bits_equal(np.array(r32), ref.kv_q8_dequantize(pool[slots], 64))
    assert bits_equal(np.array(r16), ref.kv_q8_dequantize(pool[slots[:2]], 64).astype(np.float16))


def test_kv_q8_quantize_stores_a_nan_scale_for_a_record_with_a_nan(emu):
    # kvquant.h's pkv_kvq8_amax: a NaN wins the record max, so the record's scale is the
    # quiet NaN 0x7E00 (pkv_kvq8_scale_bits, whatever the NaN's payload) and its finite
    # values' codes 0, as the NumPy reference stores them
    # (simd_max dropped the NaN: a finite scale under which the record decoded as if whole).
    # The NaN value's own code is not specified (its record decodes to NaN either way).
    rng, seed = fresh_rng()
    v32 = (rng.standard_normal((3, 2, 64)) * 3).astype(np.float32)
    nans = [(0, 1, 7), (2, 0, 40), (2, 0, 41), (1, 0, 5), (1, 1, 33)]
    v32[0, 1, 7], v32[2, 0, 40], v32[2, 0, 41] = np.nan, -np.nan, np.float32("nan")
    # NaNs with other payloads: NVIDIA's canonical 0x7FFFFFFF (a CUDA writer's amax / 127
    # of any NaN; pkv_f16_rne kept its payload as 0x7FFF) and a negative one
    v32.view(np.uint32)[1, 0, 5], v32.view(np.uint32)[1, 1, 33] = 0x7FFFFFFF, 0xFFE00001

    def calls(run):
        return (metal.kv_q8_quantize(mx, mx.array(v32), run),)

    emu.prepare(calls)
    got = np.array(calls(emu.run)[0]).reshape(3, 2, 2, 34)
    with np.errstate(invalid="ignore"):
        want = ref.kv_q8_quantize(v32).reshape(3, 2, 2, 34)
    for tok, head, dim in nans:
        rec, j = divmod(dim, 32)
        assert got[tok, head, rec, :2].view(np.uint16)[0] == 0x7E00, f"seed {seed}"
        got[tok, head, rec, 2 + j] = want[tok, head, rec, 2 + j] = 0
    assert bits_equal(got, want), f"seed {seed}"


def test_paged_attention_kv_dtypes_gqa_head_dims_and_partitions(emu):
    rng, seed = fresh_rng()
    # (kv dtype, heads, kv_heads, head_dim): groups 1, 3, 4, 8 and every head_dim
    geometries = [("float16", 4, 4, 32), ("float16", 16, 2, 128), ("bfloat16", 8, 2, 64),
                  ("bfloat16", 6, 2, 256), ("q8", 8, 1, 64), ("q8", 4, 2, 128)]
    cases = []
    for kv_dtype, heads, kv_heads, head_dim in geometries:
        lens = [int(rng.integers(257, 420)), 0, int(rng.integers(1, 9))]  # 1-2 partitions
        cases.append((kv_dtype, attention_case(rng, kv_dtype, seqs=3, heads=heads,
                                               kv_heads=kv_heads, head_dim=head_dim,
                                               block_size=16, lens=lens)))

    def calls(run):
        out = []
        for kv_dtype, (q, kp, vp, tables, lens, _) in cases:
            out.append(metal.paged_attention(
                mx, mx.array(q), to_mlx_pool(mx, kp, kv_dtype), to_mlx_pool(mx, vp, kv_dtype),
                mx.array(tables), mx.array(lens), kv_dtype=kv_dtype,
                scale=q.shape[2] ** -0.5, max_seq_len=int(lens.max()), run=run))
        return out

    emu.prepare(calls)
    for (kv_dtype, (q, *_, expect)), got in zip(cases, calls(emu.run), strict=True):
        np.testing.assert_allclose(np.array(got), expect, rtol=1e-4, atol=2e-5,
                                   err_msg=f"{kv_dtype} {q.shape}, seed {seed}")


def test_block_gather_and_copy(emu):
    rng, seed = fresh_rng()
    src = rng.integers(0, 256, (9, 2, 3, 64), dtype=np.uint8)  # 384-byte blocks (16-byte path)
    odd = rng.integers(0, 256, (6, 13), dtype=np.uint8)  # 13-byte blocks
    dst = rng.integers(0, 256, (4, 2, 3, 64), dtype=np.uint8)

    def calls(run):
        return (metal.copy_blocks(mx, mx.array(src), mx.array(np.array([8, 2, 5], np.int32)),
                                  mx.array(np.array([3, 0, 1], np.int32)), mx.array(dst), run),
                metal.gather_blocks(mx, mx.array(odd), mx.array(np.array([5, 5, 0], np.int32)),
                                    run))

    emu.prepare(calls)
    copied, gathered = calls(emu.run)
    assert bits_equal(np.array(copied), ref.copy_blocks(src, [8, 2, 5], [3, 0, 1], dst))
    assert bits_equal(np.array(gathered), odd[[5, 5, 0]]), f"seed {seed}"
