"""Weight-codec speed (issue 3): dequantize, fused GEMV, FWHT-256 and quantize, each against a
NumPy / OpenBLAS baseline measured in the same run. Single-threaded by design.

Targets: HFQ4/MQ4 dequant to float32 >= 8 GB/s of floats written (>= 3x the chunked NumPy
baseline); fused GEMV x[1,4096]·W[4096,4096]ᵀ in HFQ4 <= 1 ms and faster than float32
OpenBLAS ``x @ W.T``; FWHT-256 >= 4 M rows/s; quantize HFQ4/MQ4 >= 1 GB/s of float32 in.

Run as asv suites, or as a script for a quick table (one BLAS thread; unset the machine's
OpenBLAS tuning so the baseline is numpy's default)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OPENBLAS_NUM_THREADS=1 \\
        python asv_bench/benchmarks/quant.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # before numpy loads OpenBLAS

import numpy as np

import pagedkv.quant as Q

ROWS, K = 4096, 4096            # dequant / quantize: 16 M weights, 64 MiB of float32 (> L3)
GEMV_M = GEMV_K = 4096
FWHT_ROWS = 16384


def _weights(rows: int, k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)


def numpy_hfq4_dequant(raw: np.ndarray, out: np.ndarray, chunk_groups: int = 4096) -> None:
    """Baseline: HFQ4G256 decode with NumPy ops, a chunk of groups at a time."""
    groups = raw.reshape(-1, 136)
    flat = out.reshape(-1, 256)
    for g0 in range(0, groups.shape[0], chunk_groups):
        blk = groups[g0:g0 + chunk_groups]
        hdr = blk[:, :8].copy().view(np.float32)
        codes = blk[:, 8:]
        q = np.empty((blk.shape[0], 128, 2), np.uint8)
        np.bitwise_and(codes, 15, out=q[:, :, 0])
        np.right_shift(codes, 4, out=q[:, :, 1])
        dst = flat[g0:g0 + chunk_groups]
        np.multiply(q.reshape(-1, 256), hdr[:, :1], out=dst)
        dst += hdr[:, 1:2]


def numpy_fwht_butterflies(x: np.ndarray, s1: np.ndarray, s2: np.ndarray) -> np.ndarray:
    """Baseline: the docs/contracts/hfqm-and-quant.md, '3.6 FWHT rotation' stages as whole-array
    NumPy ops over all rows."""
    y = x * s1
    n = x.shape[0]
    h = 1
    while h < 256:
        v = y.reshape(n, -1, 2, h)
        a = v[:, :, 0, :]
        b = v[:, :, 1, :]
        y = np.stack([a + b, a - b], axis=2).reshape(n, 256)
        h *= 2
    return y * (np.float32(0.0625) * s2)


class Dequantize:
    params = ["hfq4g256", "mq4g256", "mq4g256v2"]  # noqa: RUF012 (asv reads lists)
    param_names = ["fmt"]  # noqa: RUF012

    def setup(self, fmt):
        self.raw = Q.quantize(_weights(ROWS, K), fmt)
        self.out = np.empty((ROWS, K), np.float32)
        self.raw_hfq4 = Q.quantize(_weights(ROWS, K), "hfq4g256")

    def time_dequantize_into(self, fmt):
        Q.dequantize(self.raw, fmt, (ROWS, K), out=self.out)

    def time_dequantize_stored_basis(self, fmt):
        Q.dequantize(self.raw, fmt, (ROWS, K), out=self.out, basis="rotated"
                     if Q.resolve(fmt).rotated else "original")

    def time_numpy_hfq4_baseline(self, fmt):
        numpy_hfq4_dequant(self.raw_hfq4, self.out)


class Gemv:
    params = ["hfq4g256", "mq4g256", "mq4g256v2", "q8f16"]  # noqa: RUF012 (asv reads lists)
    param_names = ["fmt"]  # noqa: RUF012

    def setup(self, fmt):
        w = _weights(GEMV_M, GEMV_K)
        self.raw = Q.quantize(w, fmt)
        self.w = w
        self.x = _weights(1, GEMV_K, seed=1)

    def time_gemv(self, fmt):
        Q.gemv(self.raw, fmt, (GEMV_M, GEMV_K), self.x)

    def time_openblas_f32_baseline(self, fmt):
        self.x @ self.w.T


class Fwht256:
    def setup(self):
        self.x = _weights(FWHT_ROWS, 256)
        self.s1 = Q.fwht.sign_table(42)
        self.s2 = Q.fwht.sign_table(1042)
        self.dense = Q.fwht256(np.eye(256, dtype=np.float32)).T.copy()   # R as a matrix

    def time_fwht256(self):
        Q.fwht256(self.x)

    def time_numpy_butterflies_baseline(self):
        numpy_fwht_butterflies(self.x, self.s1, self.s2)

    def time_dense_matmul_baseline(self):
        self.x @ self.dense.T


class Quantize:
    params = ["hfq4g256", "mq4g256", "mq4g256v2", "q8f16"]  # noqa: RUF012 (asv reads lists)
    param_names = ["fmt"]  # noqa: RUF012

    def setup(self, fmt):
        self.w = _weights(ROWS, K)

    def time_quantize(self, fmt):
        Q.quantize(self.w, fmt)


def _best_seconds(fn, repeat: int = 15, number: int = 1) -> float:
    """Best of ``repeat``, in this thread's CPU seconds: on a shared machine wall time
    mostly measures the neighbours; CPU time is the per-core cost (asv reports wall)."""
    import time
    best = float("inf")
    for _ in range(repeat):
        t0 = time.thread_time()
        for _ in range(number):
            fn()
        best = min(best, (time.thread_time() - t0) / number)
    return best


def main() -> None:
    float_bytes = ROWS * K * 4
    print(f"# {ROWS}x{K} weights ({float_bytes / 2**20:.0f} MiB float32); best of 15, thread CPU time")
    d = Dequantize()
    d.setup("hfq4g256")
    base = _best_seconds(lambda: numpy_hfq4_dequant(d.raw_hfq4, d.out))
    print(f"dequant numpy-chunked hfq4 baseline  {float_bytes / base / 1e9:6.2f} GB/s")
    for fmt in Dequantize.params:
        d.setup(fmt)
        t = _best_seconds(lambda fmt=fmt: Q.dequantize(d.raw, fmt, (ROWS, K), out=d.out))
        line = f"dequant {fmt:<12} original basis  {float_bytes / t / 1e9:6.2f} GB/s  {base / t:5.1f}x"
        if Q.resolve(fmt).rotated:
            t2 = _best_seconds(lambda fmt=fmt: Q.dequantize(d.raw, fmt, (ROWS, K), out=d.out,
                                                    basis="rotated"))
            line += f" | stored basis {float_bytes / t2 / 1e9:6.2f} GB/s  {base / t2:5.1f}x"
        print(line)
    g = Gemv()
    g.setup("hfq4g256")
    blas = _best_seconds(lambda: g.x @ g.w.T, repeat=15)
    print(f"gemv 1x{GEMV_K}·{GEMV_M}x{GEMV_K}ᵀ float32 OpenBLAS  {blas * 1e3:7.3f} ms")
    for fmt in Gemv.params:
        g.setup(fmt)
        t = _best_seconds(lambda fmt=fmt: Q.gemv(g.raw, fmt, (GEMV_M, GEMV_K), g.x), repeat=15)
        print(f"gemv {fmt:<12} fused  {t * 1e3:7.3f} ms  {blas / t:5.2f}x vs OpenBLAS f32")
    f = Fwht256()
    f.setup()
    t = _best_seconds(lambda: Q.fwht256(f.x))
    tb = _best_seconds(lambda: numpy_fwht_butterflies(f.x, f.s1, f.s2))
    tm = _best_seconds(lambda: f.x @ f.dense.T)
    print(f"fwht256 {FWHT_ROWS / t / 1e6:6.2f} M rows/s | numpy butterflies "
          f"{FWHT_ROWS / tb / 1e6:5.2f} M rows/s ({tb / t:4.1f}x) | dense matmul "
          f"{FWHT_ROWS / tm / 1e6:5.2f} M rows/s ({tm / t:4.1f}x)")
    q = Quantize()
    q.setup("hfq4g256")
    for fmt in Quantize.params:
        t = _best_seconds(lambda fmt=fmt: Q.quantize(q.w, fmt), repeat=5)
        print(f"quantize {fmt:<12} {float_bytes / t / 1e9:6.2f} GB/s of float32 in")


if __name__ == "__main__":
    main()
