"""pagedkv.kernels.mlx on MLX's CPU backend (the array-ops path) against the NumPy
references, plus argument checks and backend selection. Fresh random inputs every run."""

from __future__ import annotations

import numpy as np
import pytest

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
from pagedkv import quant
from pagedkv.errors import (
    InvalidArgument,
    InvalidArgumentType,
    UnknownQuantType,
    UnsupportedQuantType,
)
from pagedkv.kernels import numpy_kernels as ref

mx = pytest.importorskip("mlx.core")
K = pytest.importorskip("pagedkv.kernels.mlx")


@pytest.fixture(autouse=True)
def _ops(monkeypatch):
    monkeypatch.setenv("PAGEDKV_MLX_KERNELS", "ops")


def test_backend_is_ops_on_the_cpu_and_a_forced_gpu_backend_is_refused(monkeypatch):
    monkeypatch.delenv("PAGEDKV_MLX_KERNELS")
    if mx.default_device().type == mx.gpu:
        pytest.skip("MLX's default device is a GPU")
    assert K.backend() == "ops"
    monkeypatch.setenv("PAGEDKV_MLX_KERNELS", "metal")
    with pytest.raises(InvalidArgument, match="PAGEDKV_MLX_KERNELS='metal', but MLX"):
        K.backend()
    monkeypatch.setenv("PAGEDKV_MLX_KERNELS", "vulkan")
    with pytest.raises(InvalidArgument, match="expected one of"):
        K.backend()


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_dequantize_every_p1_format_is_bit_exact_in_both_bases(fmt):
    rng, seed = fresh_rng()
    raw, numel = weights_case(rng, fmt)
    rotated = K.dequantize(mx.array(raw), fmt, numel, basis="rotated")
    assert bits_equal(np.array(rotated), ref.dequantize(raw, fmt, numel)), f"seed {seed}"
    original = K.dequantize(raw, fmt, (numel,))
    assert bits_equal(np.array(original), quant.dequantize(raw, fmt, (numel,))), f"seed {seed}"
    half = K.dequantize(raw, fmt, numel, dtype=mx.float16, basis="rotated")
    assert half.dtype == mx.float16
    assert bits_equal(np.array(half), ref.dequantize(raw, fmt, numel).astype(np.float16))


@pytest.mark.parametrize("fmt", ["hfp4g32", "mq2g256gl", "mq8g256", "q4k", "tq2g128"])
def test_dequantize_refuses_the_p2_formats_and_says_where_to_decode(fmt):
    with pytest.raises(UnsupportedQuantType, match="pagedkv.quant.dequantize"):
        K.dequantize(np.zeros(16, np.uint8), fmt, (1, 256))


@pytest.mark.parametrize("fmt", ["f16", "bf16", "f32"])
def test_dequantize_raw_formats_widen_exactly(fmt):
    rng, _ = fresh_rng()
    w = rng.standard_normal(77).astype(np.float32)
    raw = quant.quantize(w, fmt)
    got = K.dequantize(raw, fmt, (7, 11))
    assert got.shape == (7, 11)
    assert bits_equal(np.array(got), quant.dequantize(raw, fmt, (7, 11)))


def test_fwht256_is_bit_exact_and_its_errors_name_the_problem():
    rng, seed = fresh_rng()
    x = (rng.standard_normal((3, 768)) * 10.0 ** rng.uniform(-20, 20)).astype(np.float32)
    assert bits_equal(np.array(K.fwht256(mx.array(x))), ref.fwht256(x)), f"seed {seed}"
    with pytest.raises(InvalidArgument, match="not a multiple of 256"):
        K.fwht256(mx.zeros((300,)))
    with pytest.raises(InvalidArgument, match="dtype mlx.core.float16, expected float32"):
        K.fwht256(mx.zeros((256,), dtype=mx.float16))


def test_dequantize_takes_the_basis_and_shape_checks_of_pagedkv_quant():
    """Found by a review: ``basis=np.array([...])`` raised a builtin ValueError, and a float
    or bool dim was truncated (``int(2.5)``) where pagedkv.quant refuses it: both now go
    through pagedkv.quant's own checks."""
    raw = quant.quantize(np.ones((2, 256), np.float32), "mq4g256v2")
    with pytest.raises(InvalidArgumentType, match="basis must be a str"):
        K.dequantize(raw, "mq4g256v2", (2, 256), basis=np.array(["rotated", "original"]))
    with pytest.raises(InvalidArgument, match="basis must be one of"):
        K.dequantize(raw, "mq4g256v2", (2, 256), basis="stored")
    for shape in ((2.0, 256), (2, "256"), True):
        with pytest.raises(InvalidArgumentType, match="shape must be an int or a sequence"):
            K.dequantize(raw, "mq4g256v2", shape)
    assert K.dequantize(raw, "mq4g256v2", (np.int64(2), 256), basis="rotated").shape == (2, 256)


@pytest.mark.parametrize("fmt", GEMV_FORMATS)
@pytest.mark.parametrize("batch", [1, 3, 8, 11])
def test_gemv_matches_the_reference(fmt, batch):
    rng, seed = fresh_rng()
    M, K_ = 45, 512
    raw, x, expect, tol = gemv_case(rng, fmt, M, K_, batch)
    w = K.prepare_gemv(mx.array(raw), fmt, M, K_)
    assert w.backend == "ops" and not w.tensor_cores
    got = np.array(K.gemv(w, mx.array(x)))
    assert got.shape == (batch, M)
    assert (np.abs(got - expect) <= tol).all(), f"seed {seed}: {np.abs(got - expect).max()}"


@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256v2"])
def test_gemv_runs_inside_mx_compile(fmt):
    # A model that compiles its step calls gemv while MLX traces it (x a tracer, the
    # weights a constant of the compiled function); the replays must stay within the
    # reference's bound. On MLX's CPU backend gemv is one array-op call; the chunked
    # launches (11 rows: 8 + 3) inside a trace are the GPU test's
    # (tests/test_kernels_mlx_gpu.py, test_gemv_inside_mx_compile_is_the_uncompiled_gemv_...).
    rng, seed = fresh_rng()
    M, K_ = 45, 512
    raw, x, expect, tol = gemv_case(rng, fmt, M, K_, 11)
    w = K.prepare_gemv(mx.array(raw), fmt, M, K_)
    step = mx.compile(lambda xs: K.gemv(w, xs))
    for _ in range(2):  # the trace, then a replay
        got = np.array(step(mx.array(x)))
        assert (np.abs(got - expect) <= tol).all(), f"seed {seed}"


def test_gemv_refuses_bad_arguments():
    raw = quant.quantize(np.zeros((4, 256), np.float32), "hfq4g256")
    with pytest.raises(InvalidArgument, match="the GEMV takes"):
        K.prepare_gemv(quant.quantize(np.zeros((4, 256), np.float32), "hfq2g256"), "hfq2g256",
                       4, 256)
    with pytest.raises(InvalidArgument, match="K a positive multiple of 256"):
        K.prepare_gemv(raw, "hfq4g256", 8, 128)
    with pytest.raises(UnknownQuantType):
        K.prepare_gemv(raw, "hfq9g256", 4, 256)
    w = K.prepare_gemv(raw, "hfq4g256", 4, 256)
    with pytest.raises(InvalidArgument, match=r"x: shape \(2, 128\), expected \[batch >= 1, 256\]"):
        K.gemv(w, mx.zeros((2, 128)))
    with pytest.raises(InvalidArgumentType, match="expected GemvWeights"):
        K.gemv(raw, mx.zeros((1, 256)))


def test_kv_q8_quantize_write_read_are_bit_exact_and_skip_slot_minus_one():
    rng, seed = fresh_rng()
    for dt in (np.float32, np.float16):
        v = (rng.standard_normal((6, 3, 64)) * 4).astype(dt)
        v[0, 0, :32] = 0  # an all-zero record: scale 0, codes 0
        records = np.array(K.kv_q8_quantize(mx.array(v)))
        assert bits_equal(records, ref.kv_q8_quantize(v.astype(np.float32))), f"seed {seed}"
    pool = rng.integers(0, 256, (4, 2, 3, 68), dtype=np.uint8)  # [blocks, bs, kvh, row]
    slots = np.array([7, -1, 0, 5, -1, 2])
    out = K.kv_q8_write(mx.array(pool), slots, mx.array(v))
    expect = pool.reshape(8, 3, 68).copy()
    expect[slots[slots >= 0]] = ref.kv_q8_quantize(v[slots >= 0].astype(np.float32))
    assert out.shape == pool.shape
    assert bits_equal(np.array(out).reshape(8, 3, 68), expect), f"seed {seed}"
    read = K.kv_q8_read(out, [5, 0, 7], dtype=mx.float16)
    assert bits_equal(np.array(read), ref.kv_q8_dequantize(expect[[5, 0, 7]], 64)
                      .astype(np.float16))


def test_kv_q8_errors_leave_the_pool_as_it_was():
    pool = mx.array(np.arange(8 * 68, dtype=np.uint8).reshape(8, 1, 68))
    before = np.array(pool)
    v = mx.zeros((2, 1, 64))
    with pytest.raises(InvalidArgument, match=r"slots: values must be -1 \(skip\) or in \[0, 8\)"):
        K.kv_q8_write(pool, [1, 8], v)
    with pytest.raises(InvalidArgument, match="slots: length 1, expected 2"):
        K.kv_q8_write(pool, [1], v)
    with pytest.raises(InvalidArgument, match=r"values: shape \(2, 1, 32\), expected \[n, 1, 64\]"):
        K.kv_q8_write(pool, [1, 2], mx.zeros((2, 1, 32)))
    with pytest.raises(InvalidArgument, match=r"slots: values must be in \[0, 8\)"):
        K.kv_q8_read(pool, [-1])
    with pytest.raises(InvalidArgument, match="uint8 q8 records"):
        K.kv_q8_read(mx.zeros((8, 1, 68)), [0])
    assert bits_equal(np.array(pool), before)


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "q8"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(4, 4, 64), (8, 4, 128), (8, 2, 32), (16, 2, 256), (6, 2, 64)])
def test_paged_attention_matches_the_reference(kv_dtype, heads, kv_heads, head_dim):
    rng, seed = fresh_rng()
    lens = [int(rng.integers(1, 700)), 0, int(rng.integers(1, 40)), 16]
    q, kp, vp, tables, lens_arr, expect = attention_case(
        rng, kv_dtype, seqs=4, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        block_size=16, lens=lens)
    got = K.paged_attention(mx.array(q), to_mlx_pool(mx, kp, kv_dtype),
                            to_mlx_pool(mx, vp, kv_dtype), tables, lens_arr)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), expect, rtol=1e-4, atol=2e-5,
                               err_msg=f"seed {seed}")
    assert not np.array(got)[1].any()  # the empty sequence


def test_paged_attention_checks_tables_and_shapes_before_running():
    rng, _ = fresh_rng()
    q, kp, vp, tables, lens, _ = attention_case(rng, "float16", seqs=2, heads=4, kv_heads=2,
                                                head_dim=64, block_size=16, lens=[20, 3])
    k, v = mx.array(kp), mx.array(vp)
    bad = tables.copy()
    bad[0, 1] = kp.shape[0]
    with pytest.raises(InvalidArgument, match="block_tables: a used entry is outside"):
        K.paged_attention(mx.array(q), k, v, bad, lens)
    with pytest.raises(InvalidArgument, match="seq_lens: values must be in"):
        K.paged_attention(mx.array(q), k, v, tables, np.array([20, 10_000], np.int32))
    with pytest.raises(InvalidArgument, match="max_seq_len=8 is below the longest"):
        K.paged_attention(mx.array(q), k, v, tables, lens, max_seq_len=8)
    # found by a review: ids past int32 wrapped (2**32 became block 0) instead of raising,
    # and tables of width 0 (sequences with no token yet) crashed the array-ops path
    wide = tables.astype(np.int64)
    wide[0, 0] = 2**32
    with pytest.raises(InvalidArgument, match="block_tables: values .* do not fit int32"):
        K.paged_attention(mx.array(q), k, v, wide, lens)
    for none in (np.zeros((2, 0), np.int32), mx.zeros((2, 0), dtype=mx.int32)):
        got = K.paged_attention(mx.array(q), k, v, none, np.zeros(2, np.int32))
        assert got.shape == (2, 4, 64) and not np.array(got).any()
    pool = mx.zeros((4, 16, 2, 68), dtype=mx.uint8)
    with pytest.raises(InvalidArgument, match="slots: values .* do not fit int64"):
        K.kv_q8_write(pool, np.array([2**64 - 1], np.uint64), mx.zeros((1, 2, 64)))
    with pytest.raises(InvalidArgument, match="block_size = 0"):
        K.paged_attention(mx.array(q), mx.zeros((4, 0, 2, 64), dtype=mx.float16),
                          mx.zeros((4, 0, 2, 64), dtype=mx.float16), tables[:, :1],
                          np.zeros(2, np.int32))
    with pytest.raises(InvalidArgument, match="heads must be 1..8 times kv_heads"):
        K.paged_attention(mx.zeros((2, 3, 64)), k, v, tables, lens)
    with pytest.raises(InvalidArgument, match="needs pool rows of 48"):
        K.paged_attention(mx.zeros((2, 4, 48)), k, v, tables, lens)
    with pytest.raises(InvalidArgument, match="v_pool"):
        K.paged_attention(mx.array(q), k, v.astype(mx.bfloat16), tables, lens)
    with pytest.raises(InvalidArgumentType, match="expected an mx.array pool"):
        K.paged_attention(mx.array(q), kp, v, tables, lens)


def test_float64_numpy_input_and_a_non_number_scale_are_refused():
    """Found by a review: ``mx.array`` narrows a float64 NumPy array to float32, so float64
    ``x`` was computed on silently (other dtypes are refused), and ``scale="x"`` raised a
    builtin ValueError. Both raise pagedkv errors before anything runs; a pool stays as it
    was."""
    wide = np.ones((1, 256), np.float64)
    with pytest.raises(InvalidArgument, match="x: dtype float64, expected float32; MLX would "
                                              "cast it to mlx.core.float32"):
        K.fwht256(wide)
    w = K.prepare_gemv(quant.quantize(np.zeros((4, 256), np.float32), "hfq4g256"), "hfq4g256",
                       4, 256)
    with pytest.raises(InvalidArgument, match="x: dtype float64"):
        K.gemv(w, wide)
    with pytest.raises(InvalidArgument, match="values: dtype float64"):
        K.kv_q8_quantize(np.zeros((1, 64)))
    pool = mx.array(np.arange(8 * 68, dtype=np.uint8).reshape(8, 1, 68))
    before = np.array(pool)
    with pytest.raises(InvalidArgument, match="values: dtype float64"):
        K.kv_q8_write(pool, [1], np.zeros((1, 1, 64)))
    assert bits_equal(np.array(pool), before)
    rng, _ = fresh_rng()
    q, kp, vp, tables, lens, _ = attention_case(rng, "float16", seqs=2, heads=4, kv_heads=2,
                                                head_dim=64, block_size=16, lens=[20, 3])
    k, v = mx.array(kp), mx.array(vp)
    with pytest.raises(InvalidArgument, match="q: dtype float64"):
        K.paged_attention(q.astype(np.float64), k, v, tables, lens)
    for scale, error in (("x", InvalidArgumentType), (True, InvalidArgumentType),
                         (float("nan"), InvalidArgument), (float("inf"), InvalidArgument)):
        with pytest.raises(error, match=f"scale={scale!r}"):
            K.paged_attention(mx.array(q), k, v, tables, lens, scale=scale)
    assert np.allclose(np.array(K.paged_attention(mx.array(q), k, v, tables, lens,
                                                  scale=np.float32(0.125))),
                       np.array(K.paged_attention(mx.array(q), k, v, tables, lens)))


def test_copy_blocks_copies_bytes_and_refuses_bad_ids():
    rng, _ = fresh_rng()
    src = rng.standard_normal((9, 16, 2, 32)).astype(np.float16)
    dst = rng.standard_normal((5, 16, 2, 32)).astype(np.float16)
    out = K.copy_blocks(mx.array(src), [8, 0, 3], [4, 1, 0], mx.array(dst))
    assert out.dtype == mx.float16
    assert bits_equal(np.array(out), ref.copy_blocks(src, [8, 0, 3], [4, 1, 0], dst))
    odd = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)  # 15-byte blocks
    got = K.copy_blocks(mx.array(odd), [3], [0], mx.array(odd))
    assert bits_equal(np.array(got), ref.copy_blocks(odd, [3], [0], odd))
    with pytest.raises(InvalidArgument, match=r"dst_ids: block ids must be in \[0, 5\)"):
        K.copy_blocks(mx.array(src), [0], [5], mx.array(dst))
    with pytest.raises(InvalidArgument, match="bytes per block differ"):
        K.copy_blocks(mx.array(src), [0], [0], mx.zeros((5, 3), dtype=mx.uint8))


def test_the_mlx_dispatch_example_of_docs_kernels_runs(capsys):
    from pathlib import Path
    page = Path(__file__).resolve().parents[1] / "docs" / "kernels.md"
    if not page.is_file():
        pytest.skip("docs/ is not next to the tests")
    text = page.read_text(encoding="utf-8")
    section = text[text.index("## MLX dispatch"):]
    assert "<!-- docs-test: needs mlx.core -->\n```python\n" in section  # the pages' runner too
    code = section[section.index("```python\n") + 10:section.index("```\n", section.index(
        "```python\n") + 10)]
    exec(compile(code, "docs/kernels.md", "exec"), {"__name__": "docs_kernels_mlx"})  # noqa: S102 (our docs)
    # the backend this machine's MLX dispatches to: ops on MLX's CPU, cuda or metal on a GPU
    assert capsys.readouterr().out.splitlines() == [f"{K.backend()} (2, 64)", "(2, 4, 64)"]


@pytest.mark.parametrize("which", ["metal", "cuda"])
def test_the_gpu_runners_reach_mlx_with_accepted_arguments(which):
    """On MLX's CPU the custom-kernel calls get as far as MLX's 'no backend' error: every
    keyword (template, grid, threadgroup, output shapes and dtypes, init_value) passed
    MLX's own argument checks."""
    if mx.default_device().type == mx.gpu:
        pytest.skip("MLX's default device is a GPU")
    from pagedkv.kernels.mlx import cuda, launch, metal
    from pagedkv.quant.formats import resolve
    codec = resolve("hfq4g256")
    mod, run = (metal, launch.run_metal) if which == "metal" else (cuda, launch.run_cuda)
    raw = mx.zeros((codec.nbytes(256),), dtype=mx.uint8)
    with pytest.raises(RuntimeError, match=rf"\[{which}_kernel\] No (Metal|CUDA) back-end"):
        mx.eval(mod.dequantize(mx, raw, codec, 256, mx.float32, launch.poisoning(run)))


def test_paged_attention_unchecked_takes_mlx_tables_and_gives_the_same_result():
    rng, seed = fresh_rng()
    q, kp, vp, tables, lens, expect = attention_case(rng, "q8", seqs=3, heads=8, kv_heads=2,
                                                     head_dim=64, block_size=16,
                                                     lens=[90, 0, 33])
    t, s = mx.array(tables), mx.array(lens)
    got = K.paged_attention(mx.array(q), mx.array(kp), mx.array(vp), t, s, check=False)
    np.testing.assert_allclose(np.array(got), expect, rtol=1e-4, atol=2e-5,
                               err_msg=f"seed {seed}")
    with pytest.raises(InvalidArgument, match=r"block_tables: dtype mlx.core.int64"):
        K.paged_attention(mx.array(q), mx.array(kp), mx.array(vp), t.astype(mx.int64), s,
                          check=False)
    with pytest.raises(InvalidArgument, match=r"shapes \(3, 7\)/\(2,\)"):
        K.paged_attention(mx.array(q), mx.array(kp), mx.array(vp), t, s[:2], check=False)


@pytest.mark.parametrize("pad", ["num_blocks", 2**31 - 1, -7])
def test_paged_attention_reads_no_padding_entry_of_a_table(pad):
    """Found by a review: the array-ops path gathered every entry of the table up to the
    longest sequence, padding included, and ``mx.take`` does not bounds-check: a padding
    entry past the pool (check_decode_batch checks the used entries only) read memory past
    the pool, giving wrong results (num_blocks) or a segfault (2**31 - 1). Padding is now
    read as block 0 and masked."""
    rng, seed = fresh_rng()
    q, kp, vp, tables, lens, expect = attention_case(rng, "float16", seqs=3, heads=4,
                                                     kv_heads=2, head_dim=64, block_size=16,
                                                     lens=[40, 7, 0])
    tables[1, 1:] = kp.shape[0] if pad == "num_blocks" else pad
    tables[2, :] = kp.shape[0] if pad == "num_blocks" else pad
    got = K.paged_attention(mx.array(q), mx.array(kp), mx.array(vp), tables, lens)
    np.testing.assert_allclose(np.array(got), expect, rtol=1e-4, atol=2e-5,
                               err_msg=f"seed {seed}")
    unchecked = K.paged_attention(mx.array(q), mx.array(kp), mx.array(vp), mx.array(tables),
                                  mx.array(lens), check=False)
    np.testing.assert_allclose(np.array(unchecked), expect, rtol=1e-4, atol=2e-5,
                               err_msg=f"seed {seed}")


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "q8"])
def test_paged_attention_ignores_non_finite_values_past_the_length(kv_dtype):
    """Found by a review: the array-ops path multiplied the softmax weights (0 past a
    sequence's length) by every gathered V row, and 0 * inf is NaN: a non-finite value in a
    slot past the length (a reused block's stale tokens, the block read for padding) turned
    the output into NaN where the reference and the kernels read only live tokens."""
    rng, seed = fresh_rng()
    q, kp, vp, tables, lens, _ = attention_case(rng, kv_dtype, seqs=2, heads=4, kv_heads=2,
                                                head_dim=64, block_size=16, lens=[20, 7])
    dead = np.ones(kp.shape[:2], bool)  # [block, row]: no sequence's token there
    for s, n in enumerate(lens):
        pos = np.arange(n)
        dead[tables[s, pos // 16], pos % 16] = False
    for pool in (kp, vp):
        if kv_dtype == "q8":  # an inf scale: each value of the record inf or NaN
            pool[dead, :, 0:2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
        else:  # float16, or bfloat16 bits
            pool[dead] = np.inf if kv_dtype == "float16" else 0x7F80
    expect = ref.paged_attention_decode(q, kp, vp, tables, lens, kv_dtype=kv_dtype,
                                        scale=64 ** -0.5)
    assert np.isfinite(expect).all()
    got = K.paged_attention(mx.array(q), to_mlx_pool(mx, kp, kv_dtype),
                            to_mlx_pool(mx, vp, kv_dtype), tables, lens)
    np.testing.assert_allclose(np.array(got), expect, rtol=1e-4, atol=2e-5,
                               err_msg=f"seed {seed}")


def test_kv_q8_quantize_writes_codes_0_where_127_over_amax_overflows():
    """Found by a review: the array-ops q8 encoder took ``127 / amax`` as the code factor
    even where it overflows float32 (a record whose largest magnitude is below ~3.7e-37),
    so such a record got codes +-127 (and an undefined cast of 0 * inf = NaN for its zero
    values) where kvquant.h, the reference and the GPU kernels write codes 0: not the
    bit-exact records docs/kernels.md promises."""
    v = np.zeros((2, 3, 64), np.float32)
    v[0, 0, :3] = [1e-40, -5e-41, 3e-38]
    v[1, 2, 40] = -2e-39
    expect = ref.kv_q8_quantize(v)
    assert bits_equal(np.array(K.kv_q8_quantize(mx.array(v))), expect)
    pool = K.kv_q8_write(mx.zeros((2, 1, 3, 68), dtype=mx.uint8), [1, 0], mx.array(v))
    assert bits_equal(np.array(pool).reshape(2, 3, 68), expect[[1, 0]])


def test_kv_q8_quantize_writes_the_canonical_nan_scale():
    """Found by a review: kv_q8_quantize takes NaN unchecked, and a record holding one got
    the float16 scale bits MLX's cast gives, 0x7D00, where the NumPy reference (and
    kvquant.h's pkv_f16_rne, which the GPU kernels use) writes the quiet NaN 0x7E00; the
    codes agreed. Both write 0x7E00 now, whatever the NaN's sign or payload."""
    payload = np.array([0x7FA00000, 0xFFC00000, 0x7FC00001], np.uint32).view(np.float32)
    for dt in (np.float32, np.float16):
        v = np.ones((3, 2, 64), np.float32)
        v[0, 0, 3], v[1, 1, 40], v[2, 0, 0] = np.nan, -np.nan, np.nan
        if dt is np.float32:
            v[2, 1, 33:36] = payload
        v = v.astype(dt)
        expect = ref.kv_q8_quantize(v.astype(np.float32))
        got = np.array(K.kv_q8_quantize(mx.array(v)))
        scales = expect.reshape(-1, 34)[:, :2].copy().view(np.uint16).ravel()
        assert sorted(set(scales.tolist())) == [0x2008, 0x7E00]  # 1/127 and the NaN
        assert bits_equal(got, expect)
        pool = K.kv_q8_write(mx.zeros((2, 2, 2, 68), dtype=mx.uint8), [1, 3, 0],
                             mx.array(v))
        assert bits_equal(np.array(pool).reshape(4, 2, 68)[[1, 3, 0]], expect)


def test_paged_attention_refuses_a_max_seq_len_that_is_not_an_int():
    """Found by a review: ``max_seq_len="5"`` raised a bare TypeError from a comparison,
    and 5.5 or True were taken (unchecked: as a partition count)."""
    rng, _ = fresh_rng()
    q, kp, vp, tables, lens, _ = attention_case(rng, "float16", seqs=2, heads=4, kv_heads=2,
                                                head_dim=64, block_size=16, lens=[20, 3])
    for bad in ("5", 25.5, True):
        for check in (True, False):
            with pytest.raises(InvalidArgumentType, match=f"max_seq_len={bad!r}: expected an int"):
                K.paged_attention(mx.array(q), mx.array(kp), mx.array(vp), mx.array(tables),
                                  mx.array(lens), max_seq_len=bad, check=check)
