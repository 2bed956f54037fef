"""KV-cache mode codecs on the CPU (docs/kv-quant.md), against baselines in the same run.

Target: encode a 16-token block of 32 layers x 8 KV heads x 128 (524,288 values, 1 MiB of
float16 in) at >= 1 GB/s of float16 input per core, i.e. <= 1.05 ms per block. The hd-256
suite encodes the same number of values as 32 layers x 4 heads x 256 (the lloyd V modes
need head_dim 256). Baselines: widening the same float16 block to float32 with NumPy (the
least any encoder must do) and the float32 NumPy oracle of kernels/numpy_kernels.py.

Run as an asv suite, or as a script (single-threaded)::

    python asv_bench/benchmarks/kvquant.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

from pagedkv.kernels import numpy_kernels
from pagedkv.quant import kv

TOKENS, LAYERS = 16, 32
BLOCK_BYTES = TOKENS * LAYERS * 8 * 128 * 2  # f16 in


class _Block:
    number = 20
    repeat = 7
    head_dim = 128
    heads = 8

    def setup(self, *mode):
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((LAYERS, TOKENS, self.heads, self.head_dim)) \
            .astype(np.float16)
        self.x32 = self.x.astype(np.float32)
        self.out = np.empty(self.x.shape, np.float32)

    def time_numpy_widen_baseline(self, *mode):
        np.copyto(self.out, self.x)


class EncodeBlock128(_Block):
    """One block at head_dim 128: q8, fwht4, fwht2 (K or V)."""

    params = ["q8", "fwht4", "fwht2"]  # noqa: RUF012 (asv reads lists)
    param_names = ["mode"]  # noqa: RUF012

    def setup(self, mode="fwht4"):
        super().setup()
        self.mode = mode
        self.rec = kv.encode(self.x, mode)

    def time_encode(self, mode="fwht4"):
        kv.encode(self.x, mode)

    def time_decode(self, mode="fwht4"):
        kv.decode(self.rec, mode, self.head_dim)


class EncodeBlock256(EncodeBlock128):
    """The same values at head_dim 256: fwht3 (K) and the lloyd V modes."""

    head_dim, heads = 256, 4
    params = ["fwht4", "fwht3", "lloyd4", "lloyd3", "lloyd2"]  # noqa: RUF012


class OracleBlock(_Block):
    """The NumPy oracle on the same block (fwht4): how much the C loops buy."""

    number, repeat = 1, 3

    def time_numpy_oracle_fwht4(self):
        numpy_kernels.kv_rotated_quantize(self.x32, "fwht4")


def _best(fn, number: int = 20, repeat: int = 7) -> float:
    """Best thread CPU seconds per call (per core, whatever else runs here)."""
    from benchmarks.quant import _best_seconds
    return _best_seconds(fn, repeat=repeat, number=number)


def main() -> None:
    print(f"# one block: {TOKENS} tokens x {LAYERS} layers, {BLOCK_BYTES / 2**20:.0f} MiB of "
          f"float16 in; best of 7 x 20 calls, thread CPU time; GB/s of float16 input")
    for cls in (EncodeBlock128, EncodeBlock256):
        for mode in cls.params:
            obj = cls()
            obj.setup(mode)
            base = _best(lambda o=obj: o.time_numpy_widen_baseline())
            enc = _best(lambda o=obj, m=mode: o.time_encode(m))
            dec = _best(lambda o=obj, m=mode: o.time_decode(m))
            print(f"hd{obj.head_dim} {mode:7s} encode {enc * 1e3:7.3f} ms "
                  f"{BLOCK_BYTES / enc / 1e9:5.2f} GB/s | decode {dec * 1e3:7.3f} ms | "
                  f"numpy f16->f32 widen {base * 1e3:6.3f} ms: encode = {enc / base:4.1f}x it")
    oracle = OracleBlock()
    oracle.setup()
    t = _best(oracle.time_numpy_oracle_fwht4, number=1, repeat=3)
    print(f"NumPy oracle fwht4 (float32 in): {t * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
