"""``python -m pagedkv.bench quality``: weight error per format at its bits per weight,
beside llama.cpp's ggml (q4_0, q4_K, q8_0) and MLX affine 4-bit on the same tensors.

The error of one tensor is ``‖ŵ − w‖₂ / ‖w‖₂`` (relative RMS, the figure ``pagedkv
convert`` reports); the table gives the mean over the tensors. ggml q4_0/q8_0 come
from the ``gguf`` package's reference quantizers (llama.cpp's ``quantize_row_*_ref``);
q4_K/q5_K/q6_K need ggml itself: pass ``--ggml-lib DIR`` holding ``libggml-base.so``
(``ggml_quantize_chunk``, no importance matrix, as ``llama-quantize`` without
``--imatrix``). MLX is ``mx.quantize`` (affine, f16 scale and bias) from float16
weights. Experiment rows (no format id of their own) encode the FWHT-256 rotation of the
weights (the MQ formats' ``fwht256``: sign patterns and all) in a pagedkv format and
rotate back after decoding. docs/formats/quant.md, "Quality".
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from collections.abc import Callable

import numpy as np

#: ggml_type ids of the ggml quantizers used (ggml.h).
_GGML_TYPES = {"q4_0": 2, "q8_0": 8, "q4_K": 12, "q5_K": 13, "q6_K": 14}
_GGML_BPW = {"q4_0": 4.5, "q8_0": 8.5, "q4_K": 4.5, "q5_K": 5.5, "q6_K": 6.5625}

PAGEDKV_FORMATS = ("mq2g256gl", "mq3g256gl", "mq3g256v2", "mq3g256lloyd", "hfq4g256",
                   "hfq4g128", "mq4g256", "mq4g256v2", "mq4cg256", "hfp4g32", "mfp4g32",
                   "mfp4g32p", "q4f16g64", "q4k", "mq4g256lloyd", "mq5g256v2", "hfq6g256",
                   "mq6g256v2", "mq8g256", "q8f16", "q8hfq")

#: Unrotated formats measured on FWHT-256-rotated weights too (experiment rows).
ROTATED_EXPERIMENTS = ("q4k",)


def weight_sets(rows: int, k: int, seed: int) -> dict[str, list[np.ndarray]]:
    """Synthetic weight matrices [rows, k]: ``gaussian`` (i.i.d. N(0, 1/k)) and ``llm-like``
    (Student-t ν=5 values, log-normal per-row scales, 0.5% of input channels ×8: the heavy
    tails and outlier channels of trained transformer weights)."""
    rng = np.random.default_rng(seed)
    gauss = [(rng.standard_normal((rows, k)) / np.sqrt(k)).astype(np.float32) for _ in range(2)]
    llm = []
    for _ in range(2):
        w = rng.standard_t(5, (rows, k)) * np.exp(0.3 * rng.standard_normal((rows, 1)))
        w[:, rng.choice(k, max(1, k // 200), replace=False)] *= 8.0
        llm.append((w / np.sqrt(k)).astype(np.float32))
    return {"gaussian": gauss, "llm-like": llm}


def rel_error(w: np.ndarray, w_hat: np.ndarray) -> float:
    diff = w_hat.astype(np.float64) - w
    return float(np.sqrt(np.square(diff).sum() / np.square(w.astype(np.float64)).sum()))


def pagedkv_codec(fmt: str, shape: tuple[int, int]) -> tuple[float, Callable[[np.ndarray],
                                                                            np.ndarray]]:
    """Bits per weight of ``fmt`` on tensors of ``shape`` (the row formats' headers and
    padding depend on K) and its quantize -> dequantize round trip."""
    from pagedkv.quant import dequantize, quantize, resolve
    codec = resolve(fmt)
    bpw = 8 * codec.payload_nbytes(shape) / (shape[0] * shape[1])

    def run(w: np.ndarray) -> np.ndarray:
        return dequantize(quantize(w, fmt), fmt, w.shape)
    return bpw, run


def rotated_codec(fmt: str, shape: tuple[int, int]) -> tuple[float, Callable[[np.ndarray],
                                                                            np.ndarray]]:
    """``fmt`` applied to the FWHT-256 rotation of every 256 weights of a row (as the MQ
    formats store them), rotated back after decoding; the bits per weight are ``fmt``'s."""
    from pagedkv.quant import fwht256
    bpw, run = pagedkv_codec(fmt, shape)

    def rotated(w: np.ndarray) -> np.ndarray:
        r = fwht256(w.reshape(-1, 256)).reshape(w.shape)
        return fwht256(run(r).reshape(-1, 256), inverse=True).reshape(w.shape)
    return bpw, rotated


def gguf_codec(name: str) -> tuple[float, Callable[[np.ndarray], np.ndarray]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    qt = GGMLQuantizationType[name.upper()]
    return _GGML_BPW[name], lambda w: dequantize(quantize(w, qt), qt)


def ggml_codec(name: str, lib_dir: str) -> tuple[float, Callable[[np.ndarray], np.ndarray]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize
    lib = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    qt = GGMLQuantizationType[name.upper()]
    block, size = GGML_QUANT_SIZES[qt]

    def run(w: np.ndarray) -> np.ndarray:
        w = np.ascontiguousarray(w, np.float32)
        rows, k = w.shape
        out = np.empty((rows, k // block * size), np.uint8)
        n = lib.ggml_quantize_chunk(_GGML_TYPES[name], w.ctypes.data, out.ctypes.data, 0,
                                    rows, k, None)
        assert n == out.nbytes, (n, out.nbytes)
        return dequantize(out, qt)
    return _GGML_BPW[name], run


def mlx_codec(group: int) -> tuple[float, Callable[[np.ndarray], np.ndarray]]:
    import mlx.core as mx

    def run(w: np.ndarray) -> np.ndarray:
        x = mx.array(w.astype(np.float16))
        q, s, b = mx.quantize(x, group_size=group, bits=4)
        return np.array(mx.dequantize(q, s, b, group_size=group, bits=4).astype(mx.float32))
    return 4 + 32 / group, run


def measure(rows: int, k: int, seed: int, ggml_lib: str | None) -> list[dict]:
    """One row per (codec, weight set): bits per weight and mean relative error."""
    codecs: dict[str, tuple[str, float, Callable[[np.ndarray], np.ndarray]]] = {}
    for fmt in PAGEDKV_FORMATS:
        bpw, run = pagedkv_codec(fmt, (rows, k))
        codecs[f"pagedkv {fmt}"] = ("pagedkv", bpw, run)
    for fmt in ROTATED_EXPERIMENTS:
        bpw, run = rotated_codec(fmt, (rows, k))
        codecs[f"experiment: FWHT-256 + {fmt}"] = ("pagedkv", bpw, run)
    for name in ("q4_0", "q8_0"):
        bpw, run = gguf_codec(name)
        codecs[f"ggml {name}"] = ("ggml", bpw, run)
    if ggml_lib:
        for name in ("q4_K", "q5_K", "q6_K"):
            bpw, run = ggml_codec(name, ggml_lib)
            codecs[f"ggml {name}"] = ("ggml", bpw, run)
    try:
        for group in (64, 32):
            bpw, run = mlx_codec(group)
            codecs[f"MLX 4-bit g{group}"] = ("mlx", bpw, run)
    except ImportError:
        pass
    sets = weight_sets(rows, k, seed)
    results = []
    for label, (lib, bpw, run) in codecs.items():
        row = {"codec": label, "library": lib, "bpw": bpw}
        for set_name, tensors in sets.items():
            row[set_name] = float(np.mean([rel_error(w, run(w)) for w in tensors]))
        results.append(row)
    return sorted(results, key=lambda r: (r["bpw"], r["llm-like"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ggml-lib", default=None,
                   help="directory with libggml-base.so, for q4_K/q5_K/q6_K")
    args = p.parse_args(argv)
    results = measure(args.rows, args.k, args.seed, args.ggml_lib)
    print("| codec | bits/w | gaussian | llm-like |")
    print("|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['codec']} | {r['bpw']:.4g} | {r['gaussian']:.4f} | {r['llm-like']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
