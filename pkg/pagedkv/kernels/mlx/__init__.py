"""pagedkv's kernel set on ``mx.array``s: one function per kernel, three ways to run it.

* **metal** (Apple GPUs): the ``metal/`` kernels through ``mx.fast.metal_kernel``, their
  per-element math the ``pagedkv/*.h`` text passed as ``header=``.
* **cuda** (MLX's CUDA backend): the ``hip/`` kernels' own device code through
  ``mx.fast.cuda_kernel`` (:mod:`pagedkv.kernels.mlx.cuda`).
* **ops** (MLX's CPU backend, or forced): the same math in MLX array ops.

:func:`backend` says which runs; ``PAGEDKV_MLX_KERNELS=metal|cuda|ops`` forces one.
Every function checks its arguments first (:class:`~pagedkv.errors.InvalidArgument` or
:class:`~pagedkv.errors.InvalidArgumentType` naming the argument, nothing launched) and
returns new arrays; ``kv_q8_write`` and ``copy_blocks`` return the updated pool, which
MLX writes in place when the caller holds no other reference to the old one. Results
match the NumPy references of :mod:`pagedkv.kernels.numpy_kernels` within the tolerances
of docs/kernels.md ("MLX dispatch").
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import Any

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.quant import kv_q8
from pagedkv.quant.arguments import basis_argument, shape_tuple

__all__ = [
    "BACKENDS",
    "GEMV_FORMATS",
    "GemvWeights",
    "backend",
    "copy_blocks",
    "dequantize",
    "fwht256",
    "gemv",
    "kv_q8_quantize",
    "kv_q8_read",
    "kv_q8_write",
    "paged_attention",
    "prepare_gemv",
]

logger = logging.getLogger("pagedkv")

#: What :func:`backend` returns.
BACKENDS = ("metal", "cuda", "ops")
#: Formats of the fused GEMV (the GPU GEMV's, hip/weights.hip); dequantize takes every P1 format.
GEMV_FORMATS = ("hfq4g256", "mq4g256", "mq4g256v2", "hfq6g256", "q8f16")
HEAD_DIMS = (32, 64, 128, 256)
_warned: set[str] = set()


@functools.cache
def _mx():
    # cached: every call of every kernel asks (a from-import costs ~10 us each time); a
    # missing MLX raises, which is not cached
    from pagedkv.pool.mlx_storage import load_mlx
    return load_mlx()


@functools.cache
def _gpu_kind() -> str | None:
    """The GPU backend this MLX build has (fixed for the process)."""
    mx = _mx()
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


def _gpu_backend(mx) -> str | None:
    return _gpu_kind() if mx.default_device().type == mx.gpu else None


def backend() -> str:
    """``"metal"``, ``"cuda"`` or ``"ops"``: how the next call runs on MLX's default device.
    ``PAGEDKV_MLX_KERNELS`` forces one (``ops`` runs anywhere; the others need their GPU)."""
    mx = _mx()
    forced = os.environ.get("PAGEDKV_MLX_KERNELS", "")
    gpu = _gpu_backend(mx)
    if forced:
        if forced not in BACKENDS:
            raise InvalidArgument(f"PAGEDKV_MLX_KERNELS={forced!r}: expected one of {BACKENDS}")
        if forced != "ops" and forced != gpu:
            raise InvalidArgument(f"PAGEDKV_MLX_KERNELS={forced!r}, but MLX's default device "
                                  f"is {mx.default_device()} ({gpu or 'no GPU backend'})")
        return forced
    if gpu == "cuda" and not _hip_sources_installed():
        if "cuda" not in _warned:
            _warned.add("cuda")
            logger.warning("pagedkv.kernels.mlx: MLX runs on CUDA but this pagedkv has no hip/ "
                           "kernel sources installed; using MLX array ops (reinstall pagedkv)")
        return "ops"
    return gpu or "ops"


@functools.cache
def _hip_sources_installed() -> bool:
    from pagedkv.kernels.mlx.sources import _locate
    return _locate("hip/kvcache.hip") is not None and _locate("hip/weights.hip") is not None


def _impl():
    """(backend name, implementation module, runner) of the current backend."""
    return _impl_of(backend())


@functools.cache
def _impl_of(name: str):
    # cached: every kernel call asks, and the imports below cost microseconds each time
    if name == "metal":
        from pagedkv.kernels.mlx import metal
        from pagedkv.kernels.mlx.launch import run_metal
        return name, metal, run_metal
    if name == "cuda":
        from pagedkv.kernels.mlx import cuda
        from pagedkv.kernels.mlx.launch import run_cuda
        return name, cuda, run_cuda
    from pagedkv.kernels.mlx import array_ops
    return name, array_ops, None


# -- argument checks ----------------------------------------------------------------------

def _array(mx, name: str, x, dtypes: tuple, what: str):
    """``x`` as an ``mx.array`` of one of ``dtypes`` (NumPy arrays are converted, never cast)."""
    if isinstance(x, np.ndarray):
        converted = mx.array(x)
        # mx.array narrows float64 to float32 (MLX's default float) without a word: refuse
        # it like any other dtype, not compute on values the caller did not pass
        if converted.dtype.size != x.dtype.itemsize:
            raise InvalidArgument(f"{name}: dtype {x.dtype}, expected {what}; MLX would cast "
                                  f"it to {converted.dtype}: convert it first (astype)")
        x = converted
    elif not isinstance(x, mx.array):
        raise InvalidArgumentType(f"{name}: expected an mx.array or numpy array ({what}), got "
                                  f"{type(x).__name__}")
    if x.dtype not in dtypes:
        raise InvalidArgument(f"{name}: dtype {x.dtype}, expected {what}")
    return x


def _host_ints(name: str, x, dtype) -> np.ndarray:
    """A host copy of an index array (NumPy or mx), for range checks."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{name}: dtype {arr.dtype}, expected integers")
    info = np.iinfo(dtype)
    if arr.size and (arr.min() < info.min or arr.max() > info.max):  # never wrapped
        raise InvalidArgument(f"{name}: values {int(arr.min())}..{int(arr.max())} do not fit "
                              f"{np.dtype(dtype).name} (ids and slots are {np.dtype(dtype).name})")
    return arr.astype(dtype, copy=False)


def _codec(fmt):
    from pagedkv.quant.formats import resolve
    return resolve(fmt)


# -- weights ----------------------------------------------------------------------------

def dequantize(raw, fmt: str | int, shape, *, dtype=None, basis: str = "original"):
    """Decode stored weight bytes (``uint8``, ``ceil(numel / G) * B`` of them) of any P1
    format into ``dtype`` (``mx.float32`` default, or ``mx.float16``) of ``shape``.
    ``basis="rotated"`` keeps MQ formats in their stored (FWHT-rotated) basis, what the
    GEMV reads; ``"original"`` undoes the rotation (``numel % 256 == 0``), like
    :func:`pagedkv.quant.dequantize`."""
    mx = _mx()
    codec = _codec(fmt)
    dtype = mx.float32 if dtype is None else dtype
    if dtype not in (mx.float32, mx.float16):
        raise InvalidArgument(f"dtype: {dtype}, expected mx.float32 or mx.float16")
    rotated_basis = basis_argument(basis)
    if codec.kind not in ("raw", "affine", "q8", "lloyd"):
        from pagedkv.errors import UnsupportedQuantType
        raise UnsupportedQuantType(
            f"{codec.name}: the MLX path does not decode the P2 formats (docs/formats/quant.md, "
            "'P2 formats'); decode with pagedkv.quant.dequantize and wrap it in mx.array")
    shape = shape_tuple(shape)
    numel = math.prod(shape)
    raw = _array(mx, "raw", raw, (mx.uint8,), "uint8 stored bytes").reshape(-1)
    if raw.size != codec.nbytes(numel):
        raise InvalidArgument(f"raw: {raw.size} bytes, {codec.name} of {numel} weights takes "
                              f"{codec.nbytes(numel)}")
    undo = codec.rotated and not rotated_basis
    if undo and numel % 256:
        raise InvalidArgument(f"shape {shape}: basis='original' of {codec.name} needs a "
                              f"multiple of 256 weights (the rotation works per 256)")
    if numel == 0:
        return mx.zeros(shape, dtype=dtype)
    if codec.kind == "raw":
        src = {"f16": mx.float16, "f32": mx.float32, "bf16": mx.bfloat16}[codec.name]
        return raw.view(src).astype(dtype).reshape(shape)
    _, impl, run = _impl()
    work = mx.float32 if undo else dtype
    if codec.kind == "lloyd":  # no custom kernel yet: MLX array ops on every backend
        from pagedkv.kernels.mlx import array_ops
        out = array_ops.dequantize(mx, raw, codec, numel, work)
    elif run is None:
        out = impl.dequantize(mx, raw, codec, numel, work)
    else:
        out = impl.dequantize(mx, raw, codec, numel, work, run)
    if undo:
        from pagedkv.kernels.mlx import array_ops
        out = array_ops.fwht256(mx, out, inverse=True).astype(dtype)
    return out.reshape(shape)


def fwht256(x):
    """FWHT-256 of each 256-segment of ``x`` (float32, size a multiple of 256), bit for bit
    :func:`pagedkv.quant.fwht256` (finite normal inputs on Metal, which may flush
    subnormals)."""
    mx = _mx()
    x = _array(mx, "x", x, (mx.float32,), "float32")
    if x.size % 256:
        raise InvalidArgument(f"x: size {x.size} is not a multiple of 256")
    if x.size == 0:
        return x
    _, impl, run = _impl()
    return impl.fwht256(mx, x) if run is None else impl.fwht256(mx, x, run)


class GemvWeights:
    """A weight matrix in the layout :func:`gemv` reads on the backend it was prepared for
    (:func:`prepare_gemv`): the stored bytes, or on CUDA sm_80+ for the 4-bit formats the
    16-row tiles of the tensor-core kernel (``pagedkv.kernels.weights.Gemv.pack``)."""

    __slots__ = ("K", "M", "array", "backend", "codec", "tensor_cores")

    def __init__(self, array, codec, M: int, K: int, backend: str, tensor_cores: bool) -> None:
        self.array, self.codec, self.M, self.K = array, codec, M, K
        self.backend, self.tensor_cores = backend, tensor_cores

    @property
    def fmt(self) -> str:
        return self.codec.name

    def __repr__(self) -> str:
        layout = "tensor-core tiles" if self.tensor_cores else "stored bytes"
        return (f"GemvWeights({self.fmt!r}, M={self.M}, K={self.K}, backend={self.backend!r}, "
                f"{layout}, {self.array.nbytes} bytes)")


def _tensor_cores(mx, name: str, codec) -> bool:
    from pagedkv.kernels.mlx.cuda import HIP_WEIGHT_KERNELS, MMA_KERNELS
    if name != "cuda" or HIP_WEIGHT_KERNELS[codec.name] not in MMA_KERNELS:
        return False
    from pagedkv.kernels.device import sm_version
    return sm_version(str(mx.device_info().get("architecture", ""))) >= 80  # "sm_90"


def prepare_gemv(raw, fmt: str | int, M: int, K: int) -> GemvWeights:
    """The stored bytes of an ``[M, K]`` weight (``uint8``) in the layout :func:`gemv`
    reads here; do it once, when the weights are loaded. ``fmt``: one of
    :data:`GEMV_FORMATS`; ``K`` a multiple of the group size and of 32."""
    mx = _mx()
    codec = _codec(fmt)
    if codec.name not in GEMV_FORMATS:
        raise InvalidArgument(f"fmt={fmt!r}: the GEMV takes {list(GEMV_FORMATS)}; dequantize "
                              f"other formats")
    if M < 1 or K < 1 or K % codec.group_size or K % 32:
        raise InvalidArgument(f"M={M}, K={K}: need M >= 1 and K a positive multiple of "
                              f"{max(codec.group_size, 32)} for {codec.name}")
    want = codec.nbytes(M * K)
    raw_arr = _array(mx, "raw", raw, (mx.uint8,), "uint8 stored bytes").reshape(-1)
    if raw_arr.size != want:
        raise InvalidArgument(f"raw: {raw_arr.size} bytes, {codec.name} of {M}x{K} takes {want}")
    name = backend()
    tc = _tensor_cores(mx, name, codec)
    if tc:
        from pagedkv.kernels.weights import _pack_tiles
        raw_arr = mx.array(_pack_tiles(np.asarray(raw_arr), M, K, codec.group_bytes))
    return GemvWeights(raw_arr, codec, M, K, name, tc)


def gemv(weights: GemvWeights, x):
    """``y = x W^T``: ``x`` float32 ``[batch, K]`` (any batch; the kernels take 8 rows per
    launch), ``y`` float32 ``[batch, M]``. Rotated formats rotate ``x`` first, so ``y`` is
    ``W x`` of the original weights."""
    mx = _mx()
    if not isinstance(weights, GemvWeights):
        raise InvalidArgumentType(f"weights: expected GemvWeights (prepare_gemv), got "
                                  f"{type(weights).__name__}")
    x = _array(mx, "x", x, (mx.float32,), "float32 [batch, K]")
    if x.ndim != 2 or x.shape[1] != weights.K or x.shape[0] < 1:
        raise InvalidArgument(f"x: shape {tuple(x.shape)}, expected [batch >= 1, {weights.K}]")
    name, impl, run = _impl()
    if name != weights.backend:
        raise InvalidArgument(f"weights: prepared for backend {weights.backend!r}, this call "
                              f"runs on {name!r}; prepare_gemv again")
    w, c, M, K = weights.array, weights.codec, weights.M, weights.K
    if run is None:
        return impl.gemv(mx, w, c, M, K, x)
    parts = []
    for b0 in range(0, x.shape[0], 8):
        # batch <= 8 launches on x itself: a slice would add an MLX op (host time) per call
        chunk = x if x.shape[0] <= 8 else x[b0:b0 + 8]
        if name == "cuda":
            parts.append(impl.gemv(mx, w, c, M, K, chunk, run, tensor_cores=weights.tensor_cores))
        else:
            parts.append(impl.gemv(mx, w, c, M, K, chunk, run))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


# -- KV cache --------------------------------------------------------------------------

def kv_q8_quantize(values):
    """q8 records (``uint8[..., head_dim/32*34]``) of float32/float16 ``values``
    (``[..., head_dim]``, ``head_dim % 32 == 0``): bit-exact with
    :func:`pagedkv.kernels.numpy_kernels.kv_q8_quantize`."""
    mx = _mx()
    values = _array(mx, "values", values, (mx.float32, mx.float16), "float32 or float16")
    if values.ndim < 1 or values.shape[-1] % kv_q8.BLOCK_VALUES:
        raise InvalidArgument(f"values: shape {tuple(values.shape)}: head_dim (last axis) must "
                              f"be a multiple of {kv_q8.BLOCK_VALUES}")
    if values.size == 0:
        return mx.zeros((*values.shape[:-1], values.shape[-1] // kv_q8.BLOCK_VALUES * kv_q8.RECORD_BYTES), dtype=mx.uint8)
    name, impl, run = _impl()
    if run is None:
        return impl.kv_q8_quantize(mx, values)
    if name == "cuda":
        shaped = values.reshape(-1, 1, values.shape[-1])
        return impl.kv_q8_quantize(mx, shaped, run).reshape(
            *values.shape[:-1], values.shape[-1] // kv_q8.BLOCK_VALUES * kv_q8.RECORD_BYTES)
    return impl.kv_q8_quantize(mx, values, run)


def _q8_pool(mx, pool, name: str = "pool"):
    pool = _array(mx, name, pool, (mx.uint8,), "uint8 q8 records")
    if pool.ndim < 3 or pool.shape[-1] % kv_q8.RECORD_BYTES:
        raise InvalidArgument(f"{name}: shape {tuple(pool.shape)}, expected [..., kv_heads, "
                              f"head_dim/32*34] q8 records")
    return pool


def kv_q8_write(pool, slots, values):
    """The q8 ``pool`` (``uint8[..., kv_heads, row]``, leading axes the slots) with token
    ``i`` of ``values`` (``[n, kv_heads, head_dim]``) quantized into slot ``slots[i]``
    (-1 skips a token). Returns the updated pool."""
    mx = _mx()
    pool = _q8_pool(mx, pool)
    kvh, row = pool.shape[-2], pool.shape[-1]
    values = _array(mx, "values", values, (mx.float32, mx.float16), "float32 or float16")
    if values.ndim != 3 or values.shape[1:] != (kvh, row // kv_q8.RECORD_BYTES * kv_q8.BLOCK_VALUES):
        raise InvalidArgument(f"values: shape {tuple(values.shape)}, expected [n, {kvh}, "
                              f"{row // kv_q8.RECORD_BYTES * kv_q8.BLOCK_VALUES}] for this pool")
    host = _host_ints("slots", slots, np.int64).reshape(-1)
    n_slots = pool.size // (kvh * row)
    if host.shape[0] != values.shape[0]:
        raise InvalidArgument(f"slots: length {host.shape[0]}, expected {values.shape[0]}")
    if host.size and (host.min() < -1 or host.max() >= n_slots):
        raise InvalidArgument(f"slots: values must be -1 (skip) or in [0, {n_slots})")
    keep = np.flatnonzero(host >= 0)
    if keep.size == 0:
        return pool
    records = kv_q8_quantize(values[mx.array(keep)] if keep.size < host.size else values)
    flat = pool.reshape(n_slots, kvh, row)
    flat[mx.array(host[keep])] = records
    return flat.reshape(pool.shape)


def kv_q8_read(pool, slots, *, dtype=None):
    """The q8 rows of ``pool`` (``uint8[..., kv_heads, row]``) at ``slots`` (``int[n]``),
    dequantized to ``dtype`` (``mx.float32`` default, or ``mx.float16``):
    ``[n, kv_heads, head_dim]``."""
    mx = _mx()
    pool = _q8_pool(mx, pool)
    dtype = mx.float32 if dtype is None else dtype
    if dtype not in (mx.float32, mx.float16):
        raise InvalidArgument(f"dtype: {dtype}, expected mx.float32 or mx.float16")
    kvh, row = pool.shape[-2], pool.shape[-1]
    head_dim = row // kv_q8.RECORD_BYTES * kv_q8.BLOCK_VALUES
    n_slots = pool.size // (kvh * row)
    host = _host_ints("slots", slots, np.int64).reshape(-1)
    if host.size and (host.min() < 0 or host.max() >= n_slots):
        raise InvalidArgument(f"slots: values must be in [0, {n_slots})")
    if host.size == 0:
        return mx.zeros((0, kvh, head_dim), dtype=dtype)
    _, impl, run = _impl()
    idx = mx.array(host)
    if run is None:
        return impl.kv_q8_read(mx, pool, idx, kvh, head_dim, dtype)
    return impl.kv_q8_read(mx, pool, idx, kvh, head_dim, dtype, run)


def _kv_dtype(mx, pool, name: str) -> str:
    names = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.uint8: "q8",
             mx.float32: "float32"}
    if not isinstance(pool, mx.array):
        raise InvalidArgumentType(f"{name}: expected an mx.array pool, got {type(pool).__name__}")
    if pool.dtype not in names:
        raise InvalidArgument(f"{name}: dtype {pool.dtype}, expected float16, bfloat16, uint8 "
                              f"(q8 records) or float32")
    return names[pool.dtype]


def paged_attention(q, k_pool, v_pool, block_tables, seq_lens, *, scale: float | None = None,
                    max_seq_len: int | None = None, check: bool = True):
    """Decode attention over a paged KV cache: one query token per sequence, GQA (query head
    ``h`` reads KV head ``h // (heads // kv_heads)``).

    ``q``: ``[seqs, heads, head_dim]`` (float32, float16 or bfloat16; computed in float32);
    pools: ``[num_blocks, block_size, kv_heads, row]`` of float16, bfloat16 or q8 records
    (``uint8``, row ``head_dim/32*34``), or float32 (test pools: MLX array ops);
    ``block_tables``: ``int32[seqs, width]`` (-1 past a sequence's blocks, as the adapter
    builds them: entries past a sequence's ``ceil(len / block_size)`` are padding, never
    read as ids, whatever they hold); ``seq_lens``: ``int32[seqs]``. ``scale`` defaults to
    ``head_dim ** -0.5``; ``max_seq_len`` (partitions to launch) to ``max(seq_lens)``.
    Returns ``float32[seqs, heads, head_dim]``; an empty sequence gives zeros.

    ``check=True`` checks every used table entry and length on the host
    (:func:`pagedkv.kernels.kvcache.check_decode_batch`; the kernels read the ids
    unchecked). A model's decode step checks its batch once and passes the same
    ``mx.array`` tables to every layer with ``check=False`` and ``max_seq_len`` (without
    it the longest length is read back from the device)."""
    mx = _mx()
    kv_dtype = _kv_dtype(mx, k_pool, "k_pool")
    if _kv_dtype(mx, v_pool, "v_pool") != kv_dtype or v_pool.shape != k_pool.shape:
        raise InvalidArgument(f"v_pool: {v_pool.dtype}{tuple(v_pool.shape)} differs from "
                              f"k_pool {k_pool.dtype}{tuple(k_pool.shape)}")
    q = _array(mx, "q", q, (mx.float32, mx.float16, mx.bfloat16), "float32/float16/bfloat16")
    if q.ndim != 3:
        raise InvalidArgument(f"q: shape {tuple(q.shape)}, expected [seqs, heads, head_dim]")
    seqs, heads, head_dim = q.shape
    if k_pool.ndim != 4:
        raise InvalidArgument(f"k_pool: shape {tuple(k_pool.shape)}, expected [num_blocks, "
                              f"block_size, kv_heads, row]")
    num_blocks, block_size, kv_heads, row = k_pool.shape
    want_row = head_dim // kv_q8.BLOCK_VALUES * kv_q8.RECORD_BYTES if kv_dtype == "q8" else head_dim
    if head_dim not in HEAD_DIMS or row != want_row:
        raise InvalidArgument(f"q/k_pool: head_dim {head_dim} (one of {HEAD_DIMS}) needs pool "
                              f"rows of {want_row}, got {row}")
    if kv_heads < 1 or heads % kv_heads or heads // kv_heads > 8:
        raise InvalidArgument(f"q/k_pool: {heads} query heads over {kv_heads} KV heads; heads "
                              f"must be 1..8 times kv_heads")
    if max_seq_len is not None and not is_int(max_seq_len):
        raise InvalidArgumentType(f"max_seq_len={max_seq_len!r}: expected an int (or None for "
                                  f"max(seq_lens)), got {type(max_seq_len).__name__}")
    if check:
        tables = _host_ints("block_tables", block_tables, np.int32)
        lens = _host_ints("seq_lens", seq_lens, np.int32)
        from pagedkv.kernels.kvcache import check_decode_batch
        if tables.ndim != 2 or tables.shape[0] != seqs:
            raise InvalidArgument(f"block_tables: shape {tables.shape}, expected [{seqs}, "
                                  f"width]")
        check_decode_batch(tables, lens, num_blocks=num_blocks, block_size=block_size)
        longest = int(lens.max()) if lens.size else 0
        if max_seq_len is not None and max_seq_len < longest:
            raise InvalidArgument(f"max_seq_len={max_seq_len} is below the longest sequence "
                                  f"({longest})")
        t, s = mx.array(tables), mx.array(lens)
    else:
        t = _array(mx, "block_tables", block_tables, (mx.int32,), "int32 [seqs, width]")
        s = _array(mx, "seq_lens", seq_lens, (mx.int32,), "int32 [seqs]")
        if t.ndim != 2 or t.shape[0] != seqs or s.shape != (seqs,):
            raise InvalidArgument(f"block_tables/seq_lens: shapes {tuple(t.shape)}/"
                                  f"{tuple(s.shape)}, expected [{seqs}, width]/[{seqs}]")
        longest = int(s.max().item()) if max_seq_len is None and seqs else 0
    if max_seq_len is None:
        max_seq_len = max(longest, 1)
    from pagedkv.kernels.kvcache import attention_scale
    scale = attention_scale(scale, head_dim)
    q = q.astype(mx.float32)
    name, impl, run = _impl()
    if kv_dtype == "float32":  # CPU-test pools (pagedkv.pool.geometry): no kernel reads them
        from pagedkv.kernels.mlx import array_ops
        name, impl, run = "ops", array_ops, None
    if name == "cuda":
        from pagedkv.kernels.mlx.cuda import attention_geometry
        gmax = attention_geometry(kv_dtype, heads, kv_heads, head_dim)["gmax"]
        if gmax > head_dim // 8:
            raise InvalidArgument(f"head_dim={head_dim} with {heads // kv_heads} query heads "
                                  f"per KV head: the CUDA kernel takes at most "
                                  f"{head_dim // 8}")
    args: dict[str, Any] = {"kv_dtype": kv_dtype, "scale": scale, "max_seq_len": max_seq_len}
    if run is None:
        return impl.paged_attention(mx, q, k_pool, v_pool, t, s, **args)
    return impl.paged_attention(mx, q, k_pool, v_pool, t, s, run=run, **args)


def copy_blocks(src, src_ids, dst_ids, dst):
    """``dst`` with block ``dst_ids[i]`` replaced by ``src``'s block ``src_ids[i]`` (blocks on
    axis 0, the same bytes per block; pool growth, cold capture and restore)."""
    mx = _mx()
    for name, a in (("src", src), ("dst", dst)):
        if not isinstance(a, mx.array):
            raise InvalidArgumentType(f"{name}: expected an mx.array, got {type(a).__name__}")
        if a.ndim < 1 or a.shape[0] == 0:
            raise InvalidArgument(f"{name}: shape {tuple(a.shape)} needs blocks on axis 0")
    block_bytes = src.nbytes // src.shape[0]
    if dst.nbytes // dst.shape[0] != block_bytes:
        raise InvalidArgument(f"src/dst: {block_bytes} and {dst.nbytes // dst.shape[0]} bytes "
                              f"per block differ")
    s_ids = _host_ints("src_ids", src_ids, np.int32).reshape(-1)
    d_ids = _host_ints("dst_ids", dst_ids, np.int32).reshape(-1)
    if s_ids.shape != d_ids.shape:
        raise InvalidArgument(f"src_ids/dst_ids: lengths {s_ids.size} and {d_ids.size} differ")
    for name, ids, limit in (("src_ids", s_ids, src.shape[0]), ("dst_ids", d_ids, dst.shape[0])):
        if ids.size and (ids.min() < 0 or ids.max() >= limit):
            raise InvalidArgument(f"{name}: block ids must be in [0, {limit})")
    if s_ids.size == 0:
        return dst
    name, impl, run = _impl()
    si, di = mx.array(s_ids), mx.array(d_ids)
    if run is None:
        return impl.copy_blocks(mx, src, si, di, dst)
    return impl.copy_blocks(mx, src, si, di, dst, run)
