"""Weight kernels (hip/weights.hip): dequant, fused dequant-GEMV and FWHT-256 against
the CPU codecs of pagedkv.quant, on fresh random inputs with poisoned outputs."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from kernels_support import poisoned
from pagedkv import errors, quant
from pagedkv.env_knobs import env_bool
from pagedkv.kernels import numpy_kernels, weights

RNG = np.random.default_rng()
FORMATS = list(weights.WEIGHT_FORMATS)


def _weights(fmt, shape):
    w = RNG.standard_normal(shape).astype(np.float32) * 0.05
    return w, quant.quantize(w, fmt)


def test_format_table_matches_the_cpu_codecs():
    for name, f in weights.WEIGHT_FORMATS.items():
        codec = quant.resolve(name)
        assert (f.group_size, f.group_bytes, f.rotated) == (
            codec.group_size, codec.group_bytes, codec.rotated)
        assert weights.raw_nbytes(name, 1000) == codec.nbytes(1000)
    with pytest.raises(errors.InvalidArgument, match="fmt='hfq3g256'"):
        weights.raw_nbytes("hfq3g256", 256)
    for name, f in weights.DEQUANT_ONLY_FORMATS.items():   # Lloyd codebooks, P2 formats
        codec = quant.resolve(name)
        assert (f.group_size, f.group_bytes, f.rotated) == (
            codec.group_size, codec.group_bytes, codec.rotated)
        assert weights.raw_nbytes(name, 1024, 512) == codec.payload_nbytes((2, 512))
        with pytest.raises(errors.InvalidArgument, match="the GPU kernels take"):
            weights.Gemv(None, name, 256, 256)  # dequantize only: no GEMV kernel
    assert weights.raw_nbytes("hfp4g32", 1024, 512) == 2 * (16 + 17 * 16)
    assert weights.raw_nbytes("q8hfq", 192, 96) == 2 * 128   # 6 + 96 bytes, padded to 128
    with pytest.raises(errors.InvalidArgument, match="pass the row length"):
        weights.raw_nbytes("q8hfq", 96)


def test_reference_gemv_equals_the_original_basis_product():
    _, raw = _weights("mq4g256v2", (5, 512))
    x = RNG.standard_normal((2, 512)).astype(np.float32)
    y = numpy_kernels.gemv(raw, "mq4g256v2", 5, 512, x, rotated=True)
    w_orig = quant.dequantize(raw, "mq4g256v2", (5, 512)).astype(np.float64)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w_orig.T, rtol=1e-4, atol=1e-5)


# --- GPU --------------------------------------------------------------------------------


def _shape(fmt):
    # Ragged: 5000 weights is not a multiple of 256 (a short last group). Rotated formats
    # come in whole 256-groups (the rotated basis is defined per group).
    return (3, 768) if weights.WEIGHT_FORMATS[fmt].rotated else (5, 1000)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_gpu_dequantize_matches_cpu_codec(device, fmt, out_dtype):
    shape = _shape(fmt)
    _, raw = _weights(fmt, shape)
    out = poisoned(device, shape, out_dtype)
    weights.dequantize(device, device.array(raw), fmt, out)
    got = out.to_numpy().astype(np.float32).reshape(-1)
    want = numpy_kernels.dequantize(raw, fmt, int(np.prod(shape)))
    assert np.isfinite(got).all()
    # GPU decoders may fuse q*s + m: 1 ulp of the group's largest magnitude (f32), then
    # the f16 rounding of the result (half an f16 ulp, one more if the FMA moved a tie).
    g = weights.WEIGHT_FORMATS[fmt].group_size
    pad = -want.size % g
    gmax = np.abs(np.pad(want, (0, pad))).reshape(-1, g).max(axis=1).repeat(g)[:want.size]
    tol = gmax * 2.0**-23 * 2
    if out_dtype == np.float16:
        tol = tol + np.spacing(np.abs(want).astype(np.float16)).astype(np.float32)
    assert (np.abs(got - want) <= tol).all()


P2_FORMATS = [n for n, f in weights.DEQUANT_ONLY_FORMATS.items() if f.p2]


def p2_raw(fmt: str, shape: tuple[int, int]) -> np.ndarray:
    """A payload of ``fmt``: quantized random weights, or for the decode-only formats random
    codes under finite random f16 scales."""
    codec = quant.resolve(fmt)
    if codec.encodes:
        return _weights(fmt, shape)[1]
    raw = RNG.integers(0, 256, codec.payload_nbytes(shape), dtype=np.uint8)
    groups = raw.reshape(-1, codec.group_bytes)
    n_halves = 2 if fmt == "q4k" else 1      # Q4K: d and dmin; TQ2/BQ1: d
    groups[:, : 2 * n_halves] = (RNG.standard_normal((len(groups), n_halves)) * 0.01).astype(
        np.float16).view(np.uint8)
    return raw


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", P2_FORMATS)
@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_gpu_dequantize_p2_is_the_cpu_decode_exactly(device, fmt, out_dtype):
    # whole 256-groups and rows of K = 768 (a multiple of 256 for MFP4/GL; 4 short-of-a-
    # block 64-groups would not exist); 5 rows so a thread's 16 weights cross rows
    shape = (5, 768)
    raw = p2_raw(fmt, shape)
    out = poisoned(device, shape, out_dtype)
    weights.dequantize(device, device.array(raw), fmt, out)
    want = quant.dequantize(raw, fmt, shape, basis="rotated")
    # Every product and sum is rounded on its own (pkv_mul_rn/pkv_add_rn): exact in f32,
    # and the f16 output is the f32 value rounded to nearest even.
    np.testing.assert_array_equal(out.to_numpy(), want.astype(out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [n for n, f in weights.DEQUANT_ONLY_FORMATS.items()
                                 if not f.p2])
@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_gpu_dequantize_lloyd_is_the_exact_codebook_lookup(device, fmt, out_dtype):
    rotated = weights.DEQUANT_ONLY_FORMATS[fmt].rotated
    shape = (3, 768) if rotated else (5, 1000)   # unrotated: a short last group
    _, raw = _weights(fmt, shape)
    out = poisoned(device, shape, out_dtype)
    weights.dequantize(device, device.array(raw), fmt, out)
    want = quant.dequantize(raw, fmt, shape, basis="rotated" if rotated else "original")
    # Every weight is an f16 centroid: exact in f32 and in f16.
    np.testing.assert_array_equal(out.to_numpy().astype(np.float32), want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch,long_rows", [(1, False), (3, False), (8, False), (2, True)])
def test_gpu_gemv_matches_reference(device, fmt, batch, long_rows):
    # M = 37 is not a multiple of a thread block's 8 (or 4) rows. K = 1280 gives the
    # block's 128 threads 160 spans of 8 (80 of 16 for 6-bit): a partial second round; the
    # long rows (17 groups) take each thread through 3-5 prefetched spans, the last partial.
    M = 37
    if fmt == "q8f16":
        K = 4384 if long_rows else 1312
    else:
        K = 4352 if long_rows else 1280
    _, raw = _weights(fmt, (M, K))
    x = RNG.standard_normal((batch, K)).astype(np.float32)
    g = weights.Gemv(device, fmt, M, K, batch)
    y = poisoned(device, (batch, M), np.float32)
    g.run(g.upload(raw), device.array(x), y)
    want = numpy_kernels.gemv(raw, fmt, M, K, x, rotated=weights.WEIGHT_FORMATS[fmt].rotated)
    scale = _gemv_bound(raw, fmt, M, K, x)
    got = y.to_numpy()
    assert np.isfinite(got).all()
    # f32 accumulation in slices of 32 (sum(q x) and sum(x) separately, 4-bit codes as
    # 1 + q/16), or x quantized to 2^-23 of its group's max |x| and exact integer sums
    # (tensor cores): 2e-5 of sum |w||x|, about 2^-15.6, far below any decoding error.
    assert (np.abs(got - want) <= 2e-5 * scale + 1e-7).all()


def _gemv_bound(raw, fmt, M, K, x):
    """sum |w||x| per output: the scale of the GEMV tolerance."""
    wabs = np.abs(numpy_kernels.dequantize(raw, fmt, M * K).reshape(M, K)).astype(np.float64)
    xr = numpy_kernels.fwht256(x) if weights.WEIGHT_FORMATS[fmt].rotated else x
    return np.abs(xr).astype(np.float64) @ wabs.T


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_gemv_extreme_magnitudes_and_one_prepare_for_two_weights(device, fmt):
    # Batch rows of |x| ~ 1e30, ~ 1e-30, all zeros and ordinary: the tensor-core kernel
    # quantizes x with a power-of-two step per group, which must follow every scale.
    M, K = 21, 768
    x = RNG.standard_normal((4, K)).astype(np.float32)
    x[0] *= np.float32(1e30)
    x[1] *= np.float32(1e-30)
    x[2] = 0.0
    g = weights.Gemv(device, fmt, M, K, 4)
    g.prepare(device.array(x))
    for _ in range(2):  # two weights on one prepared x
        _, raw = _weights(fmt, (M, K))
        y = poisoned(device, (4, M), np.float32)
        g.run_prepared(g.upload(raw), y)
        got = y.to_numpy()
        want = numpy_kernels.gemv(raw, fmt, M, K, x, rotated=weights.WEIGHT_FORMATS[fmt].rotated)
        bound = _gemv_bound(raw, fmt, M, K, x)
        assert np.isfinite(got).all()
        assert (got[2] == 0.0).all()
        assert (np.abs(got - want) <= 2e-5 * bound + 1e-37).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_gemv_a_nan_in_x_poisons_only_its_batch_row(device, fmt):
    M, K = 9, 512
    _, raw = _weights(fmt, (M, K))
    x = RNG.standard_normal((2, K)).astype(np.float32)
    x[1, 300] = np.nan
    y = poisoned(device, (2, M), np.float32)
    g = weights.Gemv(device, fmt, M, K, 2)
    g.run(g.upload(raw), device.array(x), y)
    got = y.to_numpy()
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hfq6g256", "q8f16"])
@pytest.mark.parametrize("batch,M,K", [(1, 37, 1280), (3, 16, 256), (8, 300, 4096),
                                       (5, 4096, 4096)])
def test_gpu_hfq6_and_q8f16_on_tensor_cores(device, monkeypatch, fmt, batch, M, K):
    # gemv_mma<HFQ6G256> / <Q8F16>, the default where int8 tensor cores exist (since this
    # passed on an H100, 2026-12-06), against the float64 reference and the CUDA-core kernel
    # on the same x, with rows of |x| ~ 1e30, ~ 1e-30 and zero, and a NaN that poisons only
    # its batch row.
    monkeypatch.delenv(weights.WIDE_MMA_ENV, raising=False)
    g = weights.Gemv(device, fmt, M, K, batch)
    if not g.tensor_cores:
        pytest.skip(f"no int8 tensor cores on {device.properties.arch}")
    assert g._kernel.name == f"pkv_gemv_mma_{fmt}_n{math.ceil(3 * batch / 8)}", g.launch
    _, raw = _weights(fmt, (M, K))
    x = RNG.standard_normal((batch, K)).astype(np.float32)
    if batch >= 5:
        x[1] *= np.float32(1e30)
        x[2] *= np.float32(1e-30)
        x[3] = 0.0
        x[4, 77] = np.nan
    y = poisoned(device, (batch, M), np.float32)
    g.run(g.upload(raw), device.array(x), y)
    got = y.to_numpy()
    want = numpy_kernels.gemv(raw, fmt, M, K, x, rotated=False)
    bound = _gemv_bound(raw, fmt, M, K, x)
    live = np.isfinite(want).all(axis=1)
    assert np.isnan(got[~live]).all()
    assert np.isfinite(got[live]).all()
    assert (np.abs(got[live] - want[live]) <= 2e-5 * bound[live] + 1e-37).all()
    if batch >= 5:
        assert (got[3] == 0.0).all()
    monkeypatch.setenv(weights.WIDE_MMA_ENV, "0")
    cc = weights.Gemv(device, fmt, M, K, batch)
    assert not cc.tensor_cores
    y_cc = poisoned(device, (batch, M), np.float32)
    cc.run(cc.upload(raw), device.array(x), y_cc)
    other = y_cc.to_numpy()
    assert (np.abs(got[live] - other[live]) <= 4e-5 * bound[live] + 1e-37).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hfq6g256", "q8f16"])
@pytest.mark.parametrize("batch,M,K", [(13, 37, 1280), (32, 300, 4096), (17, 4096, 4096),
                                       (32, 4096, 14336)])
def test_gpu_hfq6_and_q8f16_batch_9_to_32_on_tensor_cores(device, monkeypatch, fmt, batch, M,
                                                          K):
    # gemv_mma_staged<HFQ6G256> / <Q8F16> (NVIDIA; gemv_amd_mc's tiled n6 / n12 on AMD), the
    # default at batch 9-32 (since this passed on an H100, 2026-12-06), against the float64
    # reference and the batch 1-8 tensor-core kernel on each 8 rows of the same x, with rows
    # of |x| ~ 1e30, ~ 1e-30 and zero and a NaN that poisons only its batch row; a second
    # launch (the split-K arrival counters reset by the first) gives the same bits.
    monkeypatch.delenv(weights.WIDE_MMA_ENV, raising=False)
    try:
        g = weights.Gemv(device, fmt, M, K, batch)
    except errors.InvalidArgument:
        pytest.skip(f"no int8 tensor cores for {fmt} on {device.properties.arch}")
    n_tiles = 6 if batch <= 16 else 12
    kind = "staged_" if device.backend == "cuda" else "tiled_"
    assert g._kernel.name == f"pkv_gemv_mma_{kind}{fmt}_n{n_tiles}", g.launch
    _, raw = _weights(fmt, (M, K))
    x = RNG.standard_normal((batch, K)).astype(np.float32)
    x[1] *= np.float32(1e30)
    x[2] *= np.float32(1e-30)
    x[3] = 0.0
    x[9, 77] = np.nan
    w = g.upload(raw)
    y = poisoned(device, (batch, M), np.float32)
    g.run(w, device.array(x), y)
    got = y.to_numpy()
    want = numpy_kernels.gemv(raw, fmt, M, K, x, rotated=False)
    bound = _gemv_bound(raw, fmt, M, K, x)
    live = np.isfinite(want).all(axis=1)
    assert np.isnan(got[~live]).all() and np.isfinite(got[live]).all()
    assert (np.abs(got[live] - want[live]) <= 2e-5 * bound[live] + 1e-37).all()
    assert (got[3] == 0.0).all()
    y2 = poisoned(device, (batch, M), np.float32)
    g.run(w, device.array(x), y2)
    np.testing.assert_array_equal(y2.to_numpy().view(np.uint32), got.view(np.uint32))
    for lo in range(0, batch, 8):
        n = min(8, batch - lo)
        small = weights.Gemv(device, fmt, M, K, n, wide_mma=True)
        y8 = poisoned(device, (n, M), np.float32)
        small.run(small.upload(raw), device.array(x[lo:lo + n]), y8)
        rows = live[lo:lo + n]
        diff = np.abs(got[lo:lo + n][rows] - y8.to_numpy()[rows])
        assert (diff <= 4e-5 * bound[lo:lo + n][rows] + 1e-37).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256v2", "hfq6g256", "q8f16"])
def test_gpu_staged_gemv_is_the_same_bits_at_any_warps_a_block(device, fmt):
    # The staged batch 9-32 kernel at 2, 4 and 8 warps a block (HFQ6G256 / Q8F16 default to
    # 4 since 2026-12-06, measured faster on an H100; the 4-bit formats to 8): a warp owns
    # its 16-row tile over all the groups of its split, so at the same splits every warp
    # count gives the same bits; the default launch is within the int8 kernels' bound.
    M, K, batch = 300, 4096, 32  # 19 row tiles: the last block of each warp count is partial
    kw = {"f16_x": False} if fmt in ("hfq4g256", "mq4g256v2") else {}
    try:
        default = weights.Gemv(device, fmt, M, K, batch, **kw)
    except errors.InvalidArgument:
        pytest.skip(f"no staged kernel for {fmt} on {device.properties.arch}")
    if device.backend != "cuda":
        pytest.skip("the staged kernel is NVIDIA's (AMD runs the tiled one)")
    assert default._block == ((128,) if fmt in ("hfq6g256", "q8f16") else (256,))
    _, raw = _weights(fmt, (M, K))
    x = RNG.standard_normal((batch, K)).astype(np.float32)
    xd, w = device.array(x), default.upload(raw)  # the packing does not depend on the launch
    for splits in (1, 2):
        outs = []
        for warps in (2, 4, 8):
            g = weights.Gemv(device, fmt, M, K, batch, warps=warps, splits=splits, **kw)
            y = poisoned(device, (batch, M), np.float32)
            g.run(w, xd, y)
            outs.append(y.to_numpy().view(np.uint32))
        for other in outs[1:]:
            np.testing.assert_array_equal(other, outs[0])
    y = poisoned(device, (batch, M), np.float32)
    default.run(w, xd, y)
    want = numpy_kernels.gemv(raw, fmt, M, K, x, rotated=weights.WEIGHT_FORMATS[fmt].rotated)
    bound = _gemv_bound(raw, fmt, M, K, x)
    assert (np.abs(y.to_numpy() - want) <= 2e-5 * bound + 1e-37).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256", "mq4g256v2", "hfq6g256", "q8f16"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("M,K", [(37, 1280), (300, 4352)])
def test_gpu_fused_x_gemv_is_the_two_launch_gemv_bit_for_bit(device, fmt, batch, M, K):
    # The fused-x kernel prepares each group's x in the warp that multiplies it, with the
    # prep kernel's own functions, and hands the mmas the words the prep would have written:
    # y must be the prep + GEMV pair's bit for bit. K = 1280: 5 groups over 8 warps (some
    # warps have none); 4352: 17, up to 3 a warp (the next group's x loaded ahead). Rows of
    # 1e30, 1e-30, zeros and a NaN follow every scale (batch 2: the NaN row is row 1 alone).
    try:
        fused = weights.Gemv(device, fmt, M, K, batch, fused_x=True)
    except errors.InvalidArgument:
        pytest.skip(f"no fused-x kernel for {fmt} on {device.properties.arch}")
    two = weights.Gemv(device, fmt, M, K, batch, fused_x=False)
    _, raw = _weights(fmt, (M, K))
    w = fused.upload(raw)
    for case in ("normal", "extremes", "nan"):
        x = RNG.standard_normal((batch, K)).astype(np.float32)
        if case == "extremes":
            x[0, : K // 2] *= np.float32(1e30)
            x[0, K // 2:] *= np.float32(1e-30)
            x[-1, 256:512] = 0.0
        elif case == "nan":
            x[-1, K - 3] = np.nan
        xd = device.array(x)
        for x_rotated in (False, True):
            got, want = (poisoned(device, (batch, M), np.float32) for _ in range(2))
            fused.run(w, xd, got, x_rotated=x_rotated)
            two.run(w, xd, want, x_rotated=x_rotated)
            np.testing.assert_array_equal(got.to_numpy().view(np.uint32),
                                          want.to_numpy().view(np.uint32))
        if case == "normal":  # and within the int8 kernels' bound of the reference
            ref = numpy_kernels.gemv(raw, fmt, M, K, x,
                                     rotated=weights.WEIGHT_FORMATS[fmt].rotated)
            got = poisoned(device, (batch, M), np.float32)
            fused.run(w, xd, got)
            bound = _gemv_bound(raw, fmt, M, K, x)
            assert (np.abs(got.to_numpy() - ref) <= 2e-5 * bound + 1e-37).all()
        if case == "nan" and batch == 2:
            assert np.isfinite(got.to_numpy()[0]).all()


@pytest.mark.gpu
@pytest.mark.compile_ahead("tune:weights")
def test_gpu_fused_x_gemv_at_two_row_tiles_is_the_two_launch_gemv_bit_for_bit(
        device, compiled_ahead, monkeypatch):
    # weights.hip rebuilt with both row-tile knobs at 2 (tests/compile_ahead.py TUNE_KNOBS,
    # an sm_90 cubin), served in place of the installed object: blocks of two 16-row tiles,
    # each warp preparing its groups' x once for both. Compared with the two launches at
    # the fused launch's own warps (another warp count adds the warps' partial sums in
    # another order). M = 37 and 8208 leave the last block one tile (its second reads the
    # first again and writes no row); 8208 x 1280 also gets 5 warps a block where the
    # default grid of 513 one-tile blocks gets 4.
    if device.backend != "cuda" or device.properties.arch != "sm_90":
        pytest.skip("the rebuilt object is an sm_90 cubin")
    if shutil.which("nvcc") is None:  # an installed wheel on a GPU host without the toolkit
        pytest.skip("no nvcc: the two-tile object cannot be built")
    from pagedkv.kernels.code_objects import read_object
    image = compiled_ahead.output("tune:weights").read_bytes()
    installed = read_object("weights", device.backend, device.properties.arch)
    device.load_module("weights", image)
    monkeypatch.setattr(weights, "GEMV_X_ROW_TILES", 2)
    monkeypatch.setattr(weights, "GEMV_X_ROW_TILES_WIDE", 2)
    try:
        for fmt in ("hfq4g256", "mq4g256v2", "hfq6g256", "q8f16"):
            for M, K in ((37, 1280), (8208, 1280), (300, 4352)):
                _, raw = _weights(fmt, (M, K))
                for batch in (1, 2):
                    fused = weights.Gemv(device, fmt, M, K, batch, fused_x=True)
                    assert fused._fused_grid == (math.ceil(math.ceil(M / 16) / 2),)
                    warps = fused._fused_block[0] // device.properties.warp_size
                    two = weights.Gemv(device, fmt, M, K, batch, fused_x=False, warps=warps)
                    w = fused.upload(raw)
                    x = RNG.standard_normal((batch, K)).astype(np.float32)
                    xd = device.array(x)
                    got, want = (poisoned(device, (batch, M), np.float32) for _ in range(2))
                    fused.run(w, xd, got)
                    two.run(w, xd, want)
                    np.testing.assert_array_equal(got.to_numpy().view(np.uint32),
                                                  want.to_numpy().view(np.uint32),
                                                  err_msg=f"{fmt} {M}x{K} b{batch}")
    finally:
        device.load_module("weights", installed)


@pytest.mark.gpu
def test_gpu_gemv_rejects_bad_shapes(device):
    with pytest.raises(errors.InvalidArgument, match="K=1000"):
        weights.Gemv(device, "hfq4g256", 8, 1000)
    most = weights.max_batch(device, "hfq4g256")  # 32 on tensor cores, else 8
    with pytest.raises(errors.InvalidArgument, match=f"batch={most + 1}: expected 1..{most}"):
        weights.Gemv(device, "hfq4g256", 8, 256, most + 1)
    g = weights.Gemv(device, "q8f16", 8, 64)
    with pytest.raises(errors.InvalidArgument, match="raw: 64 bytes"):
        g.run(device.empty(64, np.uint8), device.empty((1, 64), np.float32),
              device.empty((1, 8), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_gpu_fwht256_is_bit_exact(device, rows):
    x = RNG.standard_normal((rows, 1024)).astype(np.float32)
    out = poisoned(device, x.shape, np.float32)
    xd = device.array(x)
    weights.fwht256(device, xd, out)
    want = numpy_kernels.fwht256(x)
    np.testing.assert_array_equal(out.to_numpy().view(np.uint32), want.view(np.uint32))
    weights.fwht256(device, xd, xd)  # in place
    np.testing.assert_array_equal(xd.to_numpy().view(np.uint32), want.view(np.uint32))


MMA_FORMATS = ("hfq4g256", "mq4g256", "mq4g256v2")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", MMA_FORMATS)
@pytest.mark.parametrize("batch", [9, 16, 17, 32])
def test_gpu_tiled_gemv_matches_reference(device, fmt, batch):
    """The batch 9-32 tensor-core GEMV (the staged kernel on NVIDIA: n6 up to 16 rows, n12
    up to 32) on fresh random inputs: M = 37 leaves a padded last tile and idle warps, K =
    17 groups an uneven split over blocks."""
    M, K = 37, 4352
    g = weights.Gemv(device, fmt, M, K, batch, f16_x=False)  # the exact int8 kernel
    if not g.tensor_cores:
        pytest.skip("the tiled GEMV is the tensor-core kernel's (NVIDIA sm_80+)")
    _, raw = _weights(fmt, (M, K))
    _check_wide_gemv(device, g, raw)


def _check_wide_gemv(device, g, raw, error=2e-5):
    """``g`` on fresh x of mixed magnitudes against the float64 reference, within ``error``
    sum |w||x| (int8 kernels: 2e-5, x quantized to 2^-23 of its group's max |x|, exact int
    sums; the f16 kernel: GEMV_F16_ERROR)."""
    fmt, M, K, batch = g.fmt.name, g.M, g.K, g.batch
    x = (RNG.standard_normal((batch, K)) * RNG.uniform(0.01, 100, (batch, 1))).astype(np.float32)
    y = poisoned(device, (batch, M), np.float32)
    g.run(g.upload(raw), device.array(x), y)
    want = numpy_kernels.gemv(raw, fmt, M, K, x, rotated=weights.WEIGHT_FORMATS[fmt].rotated)
    got = y.to_numpy()
    assert np.isfinite(got).all()
    assert (np.abs(got - want) <= error * _gemv_bound(raw, fmt, M, K, x) + 1e-7).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256v2"])
@pytest.mark.parametrize("M", [40, 300])
def test_gpu_staged_gemv_rows_agree_with_batch_1_calls(device, fmt, M):
    """Each batch row of the batch-32 kernel (gemv_mma_staged: split over blocks, the last
    block adding the splits) against the batch-1 kernel on the same row, on fresh random
    inputs: the same exact int32 sums, f32 sums grouped differently, so within the f32
    bound. M = 300: three row blocks of 128, the last partial; run twice, so the arrival
    counters reset by the first launch serve the second."""
    K = 2048
    wide = weights.Gemv(device, fmt, M, K, 32, f16_x=False)
    if not wide.tensor_cores:
        pytest.skip("the staged GEMV is the tensor-core kernel's (NVIDIA sm_80+)")
    one = weights.Gemv(device, fmt, M, K, 1)
    _, raw = _weights(fmt, (M, K))
    w = wide.upload(raw)
    for run in range(2):
        x = (RNG.standard_normal((32, K)) * RNG.uniform(0.01, 100, (32, 1))).astype(np.float32)
        y = poisoned(device, (32, M), np.float32)
        wide.run(w, device.array(x), y)
        got = y.to_numpy()
        assert np.isfinite(got).all()
        bound = 2e-5 * _gemv_bound(raw, fmt, M, K, x) + 1e-7
        for b in range(32):
            y1 = poisoned(device, (1, M), np.float32)
            one.run(w, device.array(x[b:b + 1]), y1)
            assert (np.abs(got[b] - y1.to_numpy()[0]) <= bound[b]).all(), (run, b)


def _f16_gemv_or_skip(device, fmt, M, K, batch, **kw):
    try:
        return weights.Gemv(device, fmt, M, K, batch, f16_x=True, **kw)
    except errors.InvalidArgument as e:  # not NVIDIA sm_80+
        pytest.skip(f"no f16-activation GEMV here: {e}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", MMA_FORMATS)
@pytest.mark.parametrize("batch", [1, 5, 8, 9, 17, 32])
def test_gpu_f16x_gemv_matches_reference(device, fmt, batch):
    """gemv_f16 (x rounded once to f16 per group) on fresh x of mixed magnitudes against the
    float64 reference, within GEMV_F16_ERROR of sum |w||x|: M = 37 leaves a padded last tile
    and idle warps, K = 17 groups an uneven split over blocks, batches 1-32 every n-tile
    count and padded batch rows."""
    M, K = 37, 4352
    g = _f16_gemv_or_skip(device, fmt, M, K, batch)
    assert g.f16_x and "f16 x" in repr(g)
    _, raw = _weights(fmt, (M, K))
    _check_wide_gemv(device, g, raw, weights.GEMV_F16_ERROR)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256v2"])
@pytest.mark.parametrize("batch", [12, 32])
def test_gpu_f16x_gemv_fills_launch_is_the_one_tile_launch_bit_for_bit(device, fmt, batch):
    """Where 128-row blocks cover the SMs (gemv_f16_fills_sms, the gate/up shape) the launch
    is 4 warps of 2 tiles, unsplit: the same f32 operations per output as 8 warps of 1 tile
    at one split, so the same bytes, and within GEMV_F16_ERROR of the float64 reference.
    M = 128 x SMs + 40 rows (a partial last block), on fresh x."""
    sms = device.properties.multiprocessor_count
    M, K = 128 * sms + 40, 512
    g = _f16_gemv_or_skip(device, fmt, M, K, batch)
    one_tile = weights.Gemv(device, fmt, M, K, batch, f16_x=True, warps=8, splits=1)
    assert g._kernel.name.endswith("_t2") and g._grid[1] == 1 and g._block == (128,)
    assert one_tile._kernel.name.endswith("_t1") and one_tile._grid[1] == 1
    _, raw = _weights(fmt, (M, K))
    x = (RNG.standard_normal((batch, K)) * RNG.uniform(0.01, 100, (batch, 1))).astype(np.float32)
    ys = []
    for gemv in (g, one_tile):
        y = poisoned(device, (batch, M), np.float32)
        gemv.run(gemv.upload(raw), device.array(x), y)
        ys.append(y.to_numpy())
    assert ys[0].tobytes() == ys[1].tobytes()
    want = numpy_kernels.gemv(raw, fmt, M, K, x, rotated=weights.WEIGHT_FORMATS[fmt].rotated)
    assert (np.abs(ys[0] - want) <= weights.GEMV_F16_ERROR * _gemv_bound(raw, fmt, M, K, x)
            + 1e-7).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256v2"])
def test_gpu_f16x_gemv_edges_splits_and_a_nan_row(device, fmt):
    """Batch rows of |x| ~ 1e30, ~ 1e-30, all zeros, a NaN, and ordinary ones at M = 300
    (row blocks of 128 or 256 rows, the last partial) with 3 group splits, run twice (the
    arrival counters reset by the first launch serve the second) and with one split: the
    power-of-two step follows every scale, zeros give zeros, the NaN poisons its row only."""
    M, K, batch = 300, 2048, 12
    _, raw = _weights(fmt, (M, K))
    for splits in (3, 1):
        g = _f16_gemv_or_skip(device, fmt, M, K, batch, splits=splits)
        assert g._grid[1] == splits
        w = g.upload(raw)
        for run in range(2):
            x = (RNG.standard_normal((batch, K)) * RNG.uniform(0.01, 100, (batch, 1))
                 ).astype(np.float32)
            x[0] *= np.float32(1e30)
            x[1] *= np.float32(1e-30)
            x[2] = 0.0
            x[3, 700] = np.nan
            y = poisoned(device, (batch, M), np.float32)
            g.run(w, device.array(x), y)
            got = y.to_numpy()
            assert np.isnan(got[3]).all() and (got[2] == 0.0).all(), (splits, run)
            live = np.r_[0:3, 4:batch]
            x[3] = 0.0
            want = numpy_kernels.gemv(raw, fmt, M, K, x,
                                      rotated=weights.WEIGHT_FORMATS[fmt].rotated)
            bound = _gemv_bound(raw, fmt, M, K, x)
            assert np.isfinite(got[live]).all()
            assert (np.abs(got[live] - want[live])
                    <= weights.GEMV_F16_ERROR * bound[live] + 1e-37).all(), (splits, run)


PIPE_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]


def _pipe_or_skip(device, fmt, M, K, batch, splits):
    try:
        return weights.Gemv(device, fmt, M, K, batch, pipe=True, splits=splits)
    except errors.InvalidArgument as e:  # not NVIDIA sm_80+, or the ring does not fit
        pytest.skip(f"no pipelined GEMV here: {e}")


def _wide_pair(device, fmt, M, K, batch, splits):
    """The pipelined and the staged batch 9-32 GEMV at the same group splits, or a skip."""
    return (_pipe_or_skip(device, fmt, M, K, batch, splits),
            weights.Gemv(device, fmt, M, K, batch, pipe=False, splits=splits))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256v2"])
@pytest.mark.parametrize("batch", [9, 16, 24, 32])
@pytest.mark.parametrize(("M", "K"), PIPE_SHAPES)
def test_gpu_pipelined_gemv_is_the_staged_kernel_bit_for_bit(device, fmt, batch, M, K):
    """gemv_mma_pipe against gemv_mma_staged at the same splits (1 and 3: one block per row
    block, and an uneven split of the groups): the same exact int32 sums and the same f32
    operations in the same order per output (docs/kernels.md, "Pipelined tensor-core GEMV"),
    so the same bytes; the pipelined kernel's own splits (up to 8) against the float64
    reference. Fresh random inputs; each configuration runs twice (the arrival counters the
    first launch resets serve the second)."""
    _, raw = _weights(fmt, (M, K))
    for splits in (1, 3):
        pipe, staged = _wide_pair(device, fmt, M, K, batch, splits)
        w_pipe, w_staged = pipe.upload(raw), staged.upload(raw)
        for run in range(2):
            x = (RNG.standard_normal((batch, K)) * RNG.uniform(0.01, 100, (batch, 1)))
            xd = device.array(x.astype(np.float32))
            y_pipe, y_staged = (poisoned(device, (batch, M), np.float32) for _ in range(2))
            pipe.run(w_pipe, xd, y_pipe)
            staged.run(w_staged, xd, y_staged)
            got = y_pipe.to_numpy()
            assert np.isfinite(got).all(), (splits, run)
            assert got.tobytes() == y_staged.to_numpy().tobytes(), (splits, run)
    # the int8 kernels without pipe=: the staged one unless PAGEDKV_GEMV_PIPE=1 (opt-in)
    g = weights.Gemv(device, fmt, M, K, batch, f16_x=False)
    assert g.pipe == bool(env_bool(weights.PIPE_ENV, False)), repr(g)
    _check_wide_gemv(device, g, raw)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mq4g256", "mq4g256v2"])
@pytest.mark.parametrize("batch", [17, 32])
def test_gpu_pipelined_gemv_edges_and_a_nan_row(device, fmt, batch):
    """M = 300 (19 tiles: the second block's last warp holds tile 18 and a clamped copy of it,
    later warps idle), K = 17 groups over 8 splits (2-3 each, fewer than the ring's depth);
    a NaN in one batch row's x poisons that row only, as in the staged kernel."""
    M, K = 300, 4352
    pipe = _pipe_or_skip(device, fmt, M, K, batch, 8)
    _, raw = _weights(fmt, (M, K))
    x = (RNG.standard_normal((batch, K)) * RNG.uniform(0.01, 100, (batch, 1))).astype(np.float32)
    x[5, 1000] = np.nan
    y = poisoned(device, (batch, M), np.float32)
    pipe.run(pipe.upload(raw), device.array(x), y)
    got = y.to_numpy()
    assert np.isnan(got[5]).all()
    rest = np.delete(np.arange(batch), 5)
    assert np.isfinite(got[rest]).all()
    want = numpy_kernels.gemv(raw, fmt, M, K, x[rest], rotated=weights.WEIGHT_FORMATS[fmt].rotated)
    bound = 2e-5 * _gemv_bound(raw, fmt, M, K, x[rest]) + 1e-7
    assert (np.abs(got[rest] - want) <= bound).all()
