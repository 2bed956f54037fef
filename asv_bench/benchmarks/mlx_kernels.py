"""pagedkv.kernels.mlx speed (issue 14) as asv track benchmarks: the targeted rows of
``python -m pagedkv.bench mlx``, each a ratio of two figures measured in one run.

- ``MlxVsMlx.track_ratio``: MLX's own op time / ours: ``mx.quantized_matmul`` (4 bits,
  group 64) over the 4-bit GEMV at batch 1 and 8 (target > 1; the ``[mx.compile]`` rows
  with both sides inside ``mx.compile``), and MLX's
  ``scaled_dot_product_attention`` on a contiguous cache over paged attention (target
  >= 1 / 1.1).
- ``MlxBandwidth.track_percent_of_copy``: each kernel's share of MLX's copy bandwidth.
- ``MlxQ8Staging.track_stage_speedup``: the unstaged q8 attention's time over the staged
  kernels' (the default on MLX CUDA since 2026-12-06), same calls, same run.

Skipped unless MLX runs pagedkv's kernels on a GPU (``setup_cache`` raises
NotImplementedError on the array-ops path). Figures: docs/performance.md, "MLX kernels".
"""

from __future__ import annotations

GEMV_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
RATIO_ROWS = (
    [f"gemv {fmt} b{b}{c} | {m}x{k}" for fmt in ("hfq4g256", "mq4g256v2") for b in (1, 8)
     for c in ("", " [mx.compile]") for m, k in GEMV_SHAPES]
    + ["paged_attention float16 | 32x4096 kvh8 d128"])
BANDWIDTH_ROWS = RATIO_ROWS + [f"paged_attention {dt} | 32x4096 kvh8 d128"
                               for dt in ("bfloat16", "q8", "q8 unstaged")]
Q8_STAGED_ROW = "paged_attention q8 | 32x4096 kvh8 d128"


def _run_bench() -> list[dict]:
    try:
        import mlx.core as mx
    except ImportError:
        raise NotImplementedError("MLX is not installed") from None
    import pagedkv.kernels.mlx as K
    from pagedkv.bench import mlx as bench

    if K.backend() == "ops":
        raise NotImplementedError("MLX runs pagedkv's kernels as array ops here (no GPU)")
    copy_bw = bench.copy_bandwidth(mx, 1 << 30)
    rows: list[dict] = []
    bench.bench_gemv(mx, K, rows, copy_bw, GEMV_SHAPES, (1, 8), True)
    bench.bench_attention(mx, K, rows, copy_bw, bench.ATTENTION_CASE)
    return rows


def by_row(rows: list[dict], field: str) -> dict[str, float]:
    """``{"<kernel> | <shape>": row[field]}`` for the rows that have ``field``."""
    return {f"{r['kernel']} | {r['shape']}": float(r[field]) for r in rows if field in r}


class MlxVsMlx:
    params = RATIO_ROWS
    param_names = ["row"]  # noqa: RUF012
    timeout = 900
    unit = "x (MLX op time / ours)"

    def setup_cache(self):
        rows = _run_bench()
        out = by_row(rows, "speedup_vs_mlx")
        out.update({k: 1 / v for k, v in by_row(rows, "ratio_vs_mlx_sdpa").items()})
        return out

    def track_ratio(self, cache, row):
        return cache[row]


class MlxBandwidth:
    params = BANDWIDTH_ROWS
    param_names = ["row"]  # noqa: RUF012
    timeout = 900
    unit = "% of copy bandwidth"

    def setup_cache(self):
        return {k: 100 * v for k, v in by_row(_run_bench(), "of_copy").items()}

    def track_percent_of_copy(self, cache, row):
        return cache[row]


class MlxQ8Staging:
    timeout = 900
    unit = "x (unstaged q8 attention time / staged)"

    def setup_cache(self):
        return by_row(_run_bench(), "stage_speedup")

    def track_stage_speedup(self, cache):
        return cache[Q8_STAGED_ROW]
