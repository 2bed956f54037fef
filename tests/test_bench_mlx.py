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
    # each configuration twice: calls built one by one, and inside mx.compile (ours and
    # mx.quantized_matmul both compiled)
    assert [r["kernel"] for r in rows] == [
        f"gemv {f} b{b}{c}" for f in ("hfq4g256", "mq4g256v2") for b in (1, 8)
        for c in ("", " [mx.compile]")]
    for r in rows:
        assert r["speedup_vs_mlx"] == pytest.approx(r["mlx_qmm_4bit_us"] / r["us"])
        assert r["of_copy"] == pytest.approx(r["GB/s"] * 1e9 / 1e9)
        assert 0 < r["host_us"] and 0 < r["mlx_qmm_host_us"]
        assert r["eval_us"] > 0 and r["mlx_qmm_eval_us"] > 0


def test_host_time_times_building_the_calls_not_evaluating_them():
    import time
    built, evaluated = [], []

    class FakeMx:
        @staticmethod
        def eval(outs):
            evaluated.append(len(outs))
            time.sleep(0.05)  # a slow device: not in the host time

        @staticmethod
        def synchronize():
            pass

    def call(i):
        built.append(i)
        return i

    t = bench._host_time(FakeMx, call, 3)
    assert t < 0.01 and built == [0, 1, 2] * bench.REPEATS and evaluated == [3] * bench.REPEATS


def test_eval_time_times_evaluating_prebuilt_calls_not_building_them():
    import time
    order = []

    class FakeMx:
        @staticmethod
        def eval(outs):
            order.append(("eval", len(outs)))
            time.sleep(0.03)

        @staticmethod
        def synchronize():
            pass

    def call(i):
        order.append(("build", i))
        time.sleep(0.03)  # a slow host: not in the eval time
        return i

    t = bench._eval_time(FakeMx, call, 2)
    assert 0.015 <= t < 0.03  # one 30 ms eval per 2 calls
    assert order == [("build", 0), ("build", 1), ("eval", 2)] * bench.REPEATS


def test_rows_split_host_and_eval_time_for_ours_and_mlx():
    rows = []
    bench.bench_gemv(mx, K, rows, 1e9, [(16, 256)], (1,), gpu=False)
    case = {**bench.ATTENTION_CASE, "seqs": 1, "tokens": 32, "kv_heads": 2, "heads": 4,
            "head_dim": 32}
    bench.bench_attention(mx, K, rows, 1e9, case)
    for r in rows:
        assert r["host_us"] > 0 and r["eval_us"] > 0
    for r in rows[:2]:
        assert r["mlx_qmm_host_us"] > 0 and r["mlx_qmm_eval_us"] > 0
    f16 = next(r for r in rows if r["kernel"] == "paged_attention float16")
    assert f16["mlx_sdpa_host_us"] > 0 and f16["mlx_sdpa_eval_us"] > 0
    # one path on the array-ops backend: no [inline header] rows
    assert not any("inline" in r["kernel"] for r in rows) and bench._header_modes(K) == [("", None)]


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
    cuda_only = {"paged_attention q8 unstaged"}  # the staged kernels exist on MLX CUDA only
    tracked = {row.split(" | ")[0] for row in asv.RATIO_ROWS + asv.BANDWIDTH_ROWS}
    assert cuda_only <= tracked and tracked - cuda_only <= names
    assert asv.Q8_STAGED_ROW.split(" | ")[0] in names
    assert set(asv.by_row(rows, "speedup_vs_mlx")) == {
        f"gemv {f} b{b}{c} | 16x256" for f in ("hfq4g256", "mq4g256v2") for b in (1, 8)
        for c in ("", " [mx.compile]")}
    monkeypatch.setenv("PAGEDKV_MLX_KERNELS", "ops")
    for suite in (asv.MlxVsMlx(), asv.MlxBandwidth(), asv.MlxQ8Staging()):
        with pytest.raises(NotImplementedError, match="array ops"):
            suite.setup_cache()


def test_q8_unstaged_row_times_the_calls_with_staging_off_then_restores_it(monkeypatch):
    """On MLX CUDA the q8 attention row is the staged kernels'; the next row times the same
    calls with PAGEDKV_ATTN_Q8_STAGE=0 (launch plans rebuilt before and after) and the staged
    row gets stage_speedup = unstaged / staged time."""
    import os

    from pagedkv.kernels.mlx import cuda
    seen, cleared = [], []
    monkeypatch.setattr(bench, "_time", lambda mx, calls, n: (seen.append(
        os.environ.get("PAGEDKV_ATTN_Q8_STAGE")), 3e-6)[1])
    monkeypatch.setattr(cuda._attention_plan, "cache_clear", lambda: cleared.append(1))
    for before in (None, "1"):
        if before is None:
            monkeypatch.delenv("PAGEDKV_ATTN_Q8_STAGE", raising=False)
        else:
            monkeypatch.setenv("PAGEDKV_ATTN_Q8_STAGE", before)
        rows = [{"kernel": "paged_attention q8", "us": 2.0}, {"kernel": "[inline header]"}]
        bench._q8_unstaged_row(mx, rows, rows[0], None, "1x64 kvh2 d32", 3000, 1e9)
        assert seen[-1] == "0" and os.environ.get("PAGEDKV_ATTN_Q8_STAGE") == before
        assert rows[-1]["kernel"] == "paged_attention q8 unstaged" and rows[-1]["us"] == 3.0
        assert rows[0]["stage_speedup"] == 1.5
    assert len(cleared) == 4
