"""llama.cpp's ``quantize_row_q4_K_ref`` as the oracle of pagedkv's Q4K encoder, and the
known-answer vectors made with it (tests/data/q4k_ggml_vectors.npz).

The oracle is ggml's own C, loaded with ctypes from either

* ``PAGEDKV_GGML_LIB``: a shared library that exports ``quantize_row_q4_K_ref``, e.g. the
  ``libggml-base.so`` of a llama.cpp build (``cmake --build build --target ggml-base``), or
* ``PAGEDKV_GGML_SRC``: ggml's source, a ``ggml`` directory (holding ``src/ggml-quants.c``)
  or the llama-cpp-python sdist that vendors it (``pip download --no-binary :all: --no-deps
  llama-cpp-python``: ``llama_cpp_python-0.3.36.tar.gz``); :func:`build` compiles
  ``ggml-quants.c`` alone into a small library, with stubs for the four ggml functions it
  names but the Q4_K path never calls.

:func:`build` compiles with ggml-base's own flags for that file (``-O3 -DNDEBUG
-std=gnu11``, no ``-march``: ggml-base is built for the baseline ISA, so on x86-64 there
is no FMA and nothing to contract), which is what pagedkv's ``-ffp-contract=off`` build
matches. The vectors file was written on x86-64 by ``python tests/ggml_q4k_reference.py
SDIST_OR_GGML_DIR`` (from llama-cpp-python 0.3.36's ggml); running it again rewrites the
same bytes.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import numpy as np

VECTORS = Path(__file__).parent / "data" / "q4k_ggml_vectors.npz"
QK_K, BLOCK_BYTES = 256, 144
F32 = np.float32

# ggml-quants.c calls these only on paths Q4_K does not take (row validation, IQ grids,
# GGML_ASSERT failures); they exist so that dlopen resolves every symbol.
_STUBS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
void ggml_abort(const char *file, int line, const char *fmt, ...) {
    fprintf(stderr, "ggml_abort %s:%d %s\n", file, line, fmt);
    abort();
}
size_t ggml_row_size(int type, long long ne) { (void)type; (void)ne; abort(); }
const char *ggml_type_name(int type) { (void)type; return "?"; }
size_t ggml_type_size(int type) { (void)type; abort(); }
"""


def _ggml_dir(source: Path, scratch: Path) -> Path:
    """The ``ggml`` directory of ``source`` (a ggml directory or an sdist tarball)."""
    if source.is_dir():
        return source
    with tarfile.open(source) as tar:
        # ggml/src/*.c, *.h, the CPU backend's headers (ggml-quants.c includes one) and
        # ggml/include/
        members = [m for m in tar.getmembers()
                   if PurePosixPath(m.name).parent.match("*/vendor/llama.cpp/ggml/src")
                   or (PurePosixPath(m.name).parent.match("*/vendor/llama.cpp/ggml/src/ggml-cpu")
                       and m.name.endswith(".h"))
                   or "/vendor/llama.cpp/ggml/include/" in m.name]
        tar.extractall(scratch, members=members, filter="data")
    (found,) = scratch.glob("*/vendor/llama.cpp/ggml")
    return found


def build(source: str | Path, out_dir: str | Path) -> Path:
    """Compile ggml's ``ggml-quants.c`` from ``source`` into ``out_dir/libq4k_ref.so``."""
    out = Path(out_dir) / "libq4k_ref.so"
    with tempfile.TemporaryDirectory() as scratch:
        ggml = _ggml_dir(Path(source), Path(scratch))
        stubs = Path(scratch) / "stubs.c"
        stubs.write_text(_STUBS)
        subprocess.run(["gcc", "-O3", "-DNDEBUG", "-std=gnu11", "-fPIC", "-shared",
                        f"-I{ggml / 'src'}", f"-I{ggml / 'include'}",
                        str(ggml / "src" / "ggml-quants.c"), str(stubs), "-lm", "-o", str(out)],
                       check=True, capture_output=True)
    return out


def load(cache_dir: str | Path) -> tuple[Callable[[np.ndarray], bytes] | None, str]:
    """(quantize, where it came from), or (None, why not): the oracle from
    ``PAGEDKV_GGML_LIB`` or, built into ``cache_dir``, from ``PAGEDKV_GGML_SRC``."""
    lib_path = os.environ.get("PAGEDKV_GGML_LIB")
    if not lib_path:
        src = os.environ.get("PAGEDKV_GGML_SRC")
        if not src:
            return None, ("ggml's quantize_row_q4_K_ref is not available: set PAGEDKV_GGML_LIB "
                          "to a libggml-base.so or PAGEDKV_GGML_SRC to llama.cpp's ggml "
                          "directory or the llama-cpp-python sdist (tests/ggml_q4k_reference.py)")
        if shutil.which("gcc") is None:
            return None, "PAGEDKV_GGML_SRC is set but gcc is not on PATH to build it"
        lib_path = str(build(src, cache_dir))
    lib = ctypes.CDLL(lib_path)
    fn = lib.quantize_row_q4_K_ref
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

    def quantize(x: np.ndarray) -> bytes:
        x = np.ascontiguousarray(x, F32).reshape(-1)
        assert x.size % QK_K == 0
        out = np.zeros(x.size // QK_K * BLOCK_BYTES, np.uint8)
        if x.size:
            fn(x.ctypes.data, out.ctypes.data, x.size)
        return out.tobytes()
    return quantize, lib_path


KINDS = ("gaussian", "heavy-tailed", "constant", "zero", "tiny", "huge", "ties", "one-signed",
         "sparse")


def inputs(kind: str, seed: int, n_blocks: int) -> np.ndarray:
    """``n_blocks`` super-blocks (float32 ``[n_blocks, 256]``) of one kind of input, each
    ggml can store with finite d and dmin (``huge`` stays below the f16 limit)."""
    rng = np.random.default_rng([KINDS.index(kind), seed])
    shape = (n_blocks, QK_K)
    row_scale = np.exp(rng.uniform(-3, 3, (n_blocks, 1)))
    if kind == "gaussian":
        x = rng.standard_normal(shape) * row_scale
    elif kind == "heavy-tailed":              # Student-t, outlier channels
        x = rng.standard_t(rng.choice([1.5, 3, 5]), shape) * row_scale
        x[:, rng.integers(0, QK_K, 3)] *= 30
    elif kind == "constant":                  # a constant per block, or per sub-block
        c = rng.standard_normal((n_blocks, 8)) * row_scale
        c[::2] = c[::2, :1]
        x = np.repeat(c, 32, axis=1)
    elif kind == "zero":                      # all zero, or zero sub-blocks beside values
        x = rng.standard_normal(shape) * row_scale
        x[::2] = 0
        x[1::2, rng.integers(0, 8) * 32:][:, :32] = 0
    elif kind == "tiny":                      # f16 d/dmin subnormal or zero, f32 subnormals
        x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-44, -3, (n_blocks, 1))
    elif kind == "huge":                      # up to about 1e6 (d up to about 1e3)
        x = rng.standard_normal(shape) * 10.0 ** rng.uniform(2, 5.3, (n_blocks, 1))
    elif kind == "ties":                      # coarse grids: exact ties in nearest_int
        x = np.round(rng.standard_normal(shape) * rng.choice([2, 4, 7.5, 15], (n_blocks, 1)))
        x /= rng.choice([1, 4, 16], (n_blocks, 1))
    elif kind == "one-signed":                # all >= 0 or all <= 0 (the min clamps)
        x = np.abs(rng.standard_normal(shape)) * row_scale + rng.uniform(0, 3, (n_blocks, 1))
        x[1::2] *= -1
    else:                                     # sparse spikes in zeros
        x = np.zeros(shape)
        x[rng.random(shape) < 0.02] = 1
        x *= rng.standard_normal(shape) * row_scale
    return x.astype(F32)


def write_vectors(quantize: Callable[[np.ndarray], bytes], path: Path = VECTORS) -> None:
    """Four super-blocks of every kind in :data:`KINDS`, and ggml's bytes for them."""
    x = np.concatenate([inputs(kind, 1000, 4) for kind in KINDS])
    raw = np.frombuffer(quantize(x), np.uint8).reshape(len(x), BLOCK_BYTES)
    np.savez_compressed(path, x=x, raw=raw, kinds=np.repeat(np.array(KINDS), 4))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PAGEDKV_GGML_SRC"] = sys.argv[1]
        os.environ.pop("PAGEDKV_GGML_LIB", None)
        q, origin = load(tmp)
        assert q is not None, origin
        write_vectors(q)
        print(f"wrote {VECTORS} with {origin}")
