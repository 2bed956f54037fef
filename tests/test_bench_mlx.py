"""``python -m pagedkv.bench mlx`` plumbing on MLX's CPU (the figures come from the H200 run
of hip/device_check.sh with MLX=1): rows carry the measured kernel, bytes, the fraction of
copy bandwidth and MLX's own baselines next to attention and the 4-bit GEMV."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")
bench = pytest.importorskip("pagedkv.bench.mlx")
K = pytest.importorskip("pagedkv.kernels.mlx")


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    monkeypatch.setattr(bench, "REPEATS", 1)


def test_attention_row_has_mlx_sdpa_next_to_it():
    rows = []
    case = {**bench.ATTENTION_CASE, "seqs": 1, "tokens": 64, "kv_heads": 2, "heads": 4,
            "head_dim": 32}
    bench.bench_attention(mx, K, rows, 1e9, case)
    assert [r["kernel"] for r in rows] == ["paged_attention float16", "paged_attention bfloat16",
                                           "paged_attention q8"]
    f16 = rows[0]
    assert f16["ratio_vs_mlx_sdpa"] == pytest.approx(f16["us"] / f16["mlx_sdpa_contiguous_us"])
    # K + V pools (4 blocks of 16 tokens, 2 heads, 32 dims, f16) + q in and out + tables
    assert f16["GB/s"] * f16["us"] * 1e3 == pytest.approx(2 * 4 * 16 * 2 * 32 * 2 + 2 * 4 * 32 * 4
                                                         + 4 * 4, rel=1e-6)


def test_gemv_rows_have_mlx_quantized_matmul_next_to_them():
    rows = []
    bench.bench_gemv(mx, K, rows, 1e9, [(16, 256)], (1, 8), gpu=False)
    assert [r["kernel"] for r in rows] == ["gemv hfq4g256 b1", "gemv hfq4g256 b8",
                                           "gemv mq4g256v2 b1", "gemv mq4g256v2 b8"]
    for r in rows:
        assert r["speedup_vs_mlx"] == pytest.approx(r["mlx_qmm_4bit_us"] / r["us"])
        assert r["of_copy"] == pytest.approx(r["GB/s"] * 1e9 / 1e9)


def test_the_suite_is_registered():
    from pagedkv.bench.__main__ import SUITES
    assert SUITES["mlx"] == "pagedkv.bench.mlx"


def test_asv_tracks_rows_the_bench_emits_and_skips_on_the_array_ops_path(monkeypatch):
    from kernels_support import load_tree_script
    asv = load_tree_script("asv_bench/benchmarks/mlx_kernels.py", "pagedkv_asv_mlx")
    rows = []
    bench.bench_gemv(mx, K, rows, 1e9, [(16, 256)], (1, 8), gpu=False)
    bench.bench_attention(mx, K, rows, 1e9, {**bench.ATTENTION_CASE, "seqs": 1, "tokens": 32,
                                             "kv_heads": 2, "heads": 4, "head_dim": 32})
    names = {r["kernel"] for r in rows}
    assert {row.split(" | ")[0] for row in asv.RATIO_ROWS + asv.BANDWIDTH_ROWS} <= names
    assert set(asv.by_row(rows, "speedup_vs_mlx")) == {
        f"gemv {f} b{b} | 16x256" for f in ("hfq4g256", "mq4g256v2") for b in (1, 8)}
    monkeypatch.setenv("PAGEDKV_MLX_KERNELS", "ops")
    for suite in (asv.MlxVsMlx(), asv.MlxBandwidth()):
        with pytest.raises(NotImplementedError, match="array ops"):
            suite.setup_cache()
