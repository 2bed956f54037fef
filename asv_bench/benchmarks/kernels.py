"""KV-cache q8 CPU codec (issue 6) against the NumPy reference, and the host-side packing of
GEMV weights for the tensor-core kernel, each against a baseline measured in the same run.

The GPU kernels are measured by ``python -m pagedkv.bench gpu`` on a GPU machine (time,
GB/s and the fraction of the copy bandwidth measured in the same run; see
docs/performance.md). Here: ``pagedkv.quant.kv_q8`` (kvquant.h, the same math as the
GPU write) versus ``pagedkv.kernels.numpy_kernels.kv_q8_quantize`` (vectorized NumPy),
on 4096 tokens x 8 KV heads x head_dim 128 (16 MiB of float32).

Run as an asv suite, or as a script for a quick table::

    python asv_bench/benchmarks/kernels.py
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

from pagedkv.kernels import numpy_kernels, weights
from pagedkv.quant import kv_q8

TOKENS, KV_HEADS, HEAD_DIM = 4096, 8, 128


class KvQ8:
    def setup(self):
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((TOKENS, KV_HEADS, HEAD_DIM)).astype(np.float32)
        self.rec = kv_q8.quantize(self.x)

    def time_quantize(self):
        kv_q8.quantize(self.x)

    def time_quantize_numpy_baseline(self):
        numpy_kernels.kv_q8_quantize(self.x)

    def time_dequantize(self):
        kv_q8.dequantize(self.rec, HEAD_DIM)

    def time_dequantize_numpy_baseline(self):
        numpy_kernels.kv_q8_dequantize(self.rec, HEAD_DIM)


class _FakeCudaDevice:
    """Enough of a device for Gemv to pick the tensor-core kernel and pack (no GPU needed)."""

    backend = "cuda"
    properties = SimpleNamespace(name="host", arch="sm_90", warp_size=32)

    def kernel(self, *args, **kwargs):
        return None

    def empty(self, shape, dtype):
        return None


class GemvPack:
    """Gemv.pack of a 14336x4096 HFQ4G256 weight (29.8 MiB), done once at load; baseline:
    a plain copy of the same bytes."""

    def setup(self):
        M, K = 14336, 4096
        self.raw = np.random.default_rng(0).integers(0, 256, M * K // 256 * 136, dtype=np.uint8)
        self.gemv = weights.Gemv(_FakeCudaDevice(), "hfq4g256", M, K)

    def time_pack(self):
        self.gemv.pack(self.raw)

    def time_copy_baseline(self):
        self.raw.copy()


def _best(fn, repeat: int = 7) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    b = KvQ8()
    b.setup()
    nbytes = b.x.nbytes
    for name, ours, base in (("quantize", b.time_quantize, b.time_quantize_numpy_baseline),
                             ("dequantize", b.time_dequantize,
                              b.time_dequantize_numpy_baseline)):
        t, tb = _best(ours), _best(base)
        print(f"kv q8 {name:<10} {t * 1e3:7.2f} ms ({nbytes / t / 1e9:5.2f} GB/s of float32) | "
              f"numpy {tb * 1e3:7.2f} ms | {tb / t:5.2f}x")
    p = GemvPack()
    p.setup()
    t, tb = _best(p.time_pack), _best(p.time_copy_baseline)
    print(f"gemv pack 14336x4096 hfq4 {t * 1e3:7.2f} ms ({p.raw.nbytes / t / 1e9:5.2f} GB/s) | "
          f"copy {tb * 1e3:7.2f} ms | {t / tb:5.2f}x the copy's time")


if __name__ == "__main__":
    main()
