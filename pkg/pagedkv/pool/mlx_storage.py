"""MLX storage of a paged KV pool: one ``mx.array`` K and V per layer.

MLX is imported here lazily, when the first MLX pool is built, so ``import pagedkv`` never
imports it. On Linux MLX runs on its CPU backend; on Apple silicon on Metal. Arrays hold the
native MLX dtype (``mx.bfloat16`` for bfloat16 pools, ``mx.uint8`` records for q8); at the
NumPy boundary (block I/O, NumPy payloads) bfloat16 travels as ``uint16`` bit patterns.

Each layer's K and V are kept as ``[num_blocks * block_size, kv_heads, row]`` slot arrays so a
token write is one ``a[slots] = k`` on the stored array itself: MLX then donates the old
buffer to the scatter and updates in place (a write through a reshape copies the whole
layer). ``layer()`` returns ``[num_blocks, block_size, ...]`` reshapes of them. MLX arrays are
values: arrays fetched with ``layer()`` before a write do not show it (and, while alive,
make the next write copy instead of donating).

Token writes and gathers stay lazy: they add one scatter (or take) to MLX's graph and return
at once, so inside a model's lazy forward they cost what the op costs, not an evaluation
round trip per layer. The graph is evaluated by whoever consumes a gathered array, by
:meth:`MlxKVStorage.flush` (``mx.async_eval``, which does not wait), and every
``MAX_PENDING_WRITES`` lazy writes, so a pool that is only written never holds an unbounded
chain of scatters. Growth and block I/O evaluate: block reads ``mx.eval`` once for all
layers and then copy through zero-copy NumPy views.

MLX (0.32) evaluates an op only on the thread that owns its stream, and a pool is shared by
threads (a server's generation thread, a test's writer, the cold tier's caller). So every op
of every MLX pool runs on one process-wide stream per device made with
``mx.new_thread_unsafe_stream``, which any thread may evaluate; the pool lock serializes the
calls that build on it. An MLX without that call gets the eager behaviour instead: each
write and gather evaluates before it returns.

This class trusts its arguments: :class:`~pagedkv.pool.LayerKVPool` validates them.
"""

from __future__ import annotations

import contextlib

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.pool.geometry import PoolGeometry

__all__ = ["MAX_PENDING_WRITES", "MlxKVStorage", "load_mlx", "pool_stream"]

#: Lazy token writes a storage accepts before it schedules their evaluation
#: (``mx.async_eval``): bounds the scatter chain, and the K/V it keeps alive, of a pool
#: that is written and not read.
MAX_PENDING_WRITES = 64

# device name -> the stream every MLX pool of this process builds its ops on (None: eager).
_POOL_STREAMS: dict[str, object] = {}

_MLX_DTYPE_NAMES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
                    "q8": "uint8"}


def load_mlx():
    """``mlx.core``, or ``InvalidArgument`` naming MLX's platform floor when it is missing."""
    try:
        import mlx.core as mx
    except ImportError as exc:
        raise InvalidArgument(
            f"backend: 'mlx' needs MLX, which cannot be imported here ({exc}). MLX runs on "
            "Linux with glibc >= 2.35 (manylinux_2_35 wheels: pip install 'mlx[cpu]') and on "
            "Apple-silicon macOS (pip install mlx); elsewhere use backend='numpy'") from None
    return mx


def pool_stream(mx):
    """The process-wide stream of MLX pools on the default device (made on first use), or
    ``None`` when this MLX cannot make a stream other threads may evaluate."""
    make = getattr(mx, "new_thread_unsafe_stream", None)
    if make is None:
        return None
    device = mx.default_device()
    key = str(device)
    stream = _POOL_STREAMS.get(key)
    if stream is None:
        stream = _POOL_STREAMS.setdefault(key, make(device))
    return stream


def _slab(g: PoolGeometry, buffer: np.ndarray, layer: int, side: int) -> np.ndarray:
    """One layer's K (side 0) or V (1) slab of a block buffer, ``[block_size, kv_heads,
    row]`` of the storage dtype (K and V rows may differ: docs/kv-quant.md)."""
    rows = buffer.view(g.storage_dtype).reshape(g.num_layers, -1)
    k = g.k_slab_bytes // g.storage_dtype.itemsize
    slab = rows[layer, :k] if side == 0 else rows[layer, k:]
    return slab.reshape(g.block_size, *(g.k_token_shape if side == 0 else g.v_token_shape))


class MlxKVStorage:
    """One generation of an MLX pool's arrays (immutable size; growth builds a new one)."""

    backend = "mlx"
    __slots__ = ("_dtype", "_is_bf16", "_mx", "_pending", "_stream", "geometry", "k",
                 "num_blocks", "v")
    # No C fast path: every token call goes through LayerKVPool's validating path.
    slot_copier = None

    def __init__(self, geometry: PoolGeometry, num_blocks: int,
                 k: list | None = None, v: list | None = None) -> None:
        mx = load_mlx()
        self._mx = mx
        self._stream = pool_stream(mx)
        self.geometry = geometry
        self.num_blocks = num_blocks
        self._dtype = getattr(mx, _MLX_DTYPE_NAMES.get(geometry.dtype, "uint8"))  # K/V modes
        self._is_bf16 = geometry.dtype == "bfloat16"
        if k is None or v is None:
            if k is not None or v is not None:  # one side alone would leave a None layer list
                raise InvalidArgument("MlxKVStorage: pass both k and v (lists of per-layer "
                                      "mx.arrays) or neither")
            k_shape = (num_blocks * geometry.block_size, *geometry.k_token_shape)
            v_shape = (num_blocks * geometry.block_size, *geometry.v_token_shape)
            with self._on_stream():
                k = [mx.zeros(k_shape, dtype=self._dtype) for _ in range(geometry.num_layers)]
                v = [mx.zeros(v_shape, dtype=self._dtype) for _ in range(geometry.num_layers)]
                mx.eval(k, v)
        self.k: list = k
        self.v: list = v
        self._pending = 0  # lazy writes since the last scheduled evaluation

    def __repr__(self) -> str:
        return (f"MlxKVStorage(num_blocks={self.num_blocks}, layers={len(self.k)}, "
                f"dtype={self.geometry.dtype}, lazy={self._stream is not None})")

    def _on_stream(self):
        return (contextlib.nullcontext() if self._stream is None
                else self._mx.stream(self._stream))

    # -- NumPy boundary --------------------------------------------------------------------

    def _from_numpy(self, x: np.ndarray):
        arr = self._mx.array(x)
        return arr.view(self._dtype) if self._is_bf16 else arr

    def to_numpy(self, x) -> np.ndarray:
        """A NumPy copy of an MLX array of the pool dtype (bfloat16 as uint16 bits)."""
        with self._on_stream():
            if self._is_bf16:
                x = x.view(self._mx.uint16)
            return np.array(x)

    def as_payload(self, name: str, x):
        """``x`` as an ``mx.array`` of the pool dtype; NumPy input must have the storage dtype
        (uint16 bits for bfloat16). Never casts."""
        mx = self._mx
        g = self.geometry
        # A KV-mode pool also takes float values (LayerKVPool encodes them before this):
        # say so, as the NumPy storage does.
        values = " records, or float32/float16/bfloat16 values to encode" if g.quantized else ""
        if isinstance(x, mx.array):
            if x.dtype != self._dtype:
                raise InvalidArgumentType(
                    f"{name}: dtype {x.dtype} does not match the pool dtype {g.dtype}: "
                    f"expected {self._dtype}{values}; convert before writing")
            return x
        if not isinstance(x, np.ndarray):
            try:
                x = np.asarray(x)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentType(f"{name}: cannot be read as an array ({exc})") from None
        if x.dtype != g.storage_dtype:
            hint = " (bfloat16 pools take uint16 bit patterns)" if self._is_bf16 else ""
            raise InvalidArgumentType(
                f"{name}: dtype {x.dtype} does not match the pool dtype {g.dtype}: expected "
                f"{g.storage_dtype}{hint} or an mx.array of {self._dtype}{values}; convert "
                f"before writing")
        with self._on_stream():
            return self._from_numpy(x)

    # -- arrays ---------------------------------------------------------------------------

    def layer(self, layer: int):
        g = self.geometry
        with self._on_stream():
            return (self.k[layer].reshape(g.k_layer_shape(self.num_blocks)),
                    self.v[layer].reshape(g.v_layer_shape(self.num_blocks)))

    def grown(self, new_num_blocks: int) -> MlxKVStorage:
        mx = self._mx
        g = self.geometry
        # mx.pad measured 1.7x faster than concatenating a zero tail on MLX's CPU backend.
        pad = [(0, (new_num_blocks - self.num_blocks) * g.block_size), (0, 0), (0, 0)]
        with self._on_stream():
            k = [mx.pad(a, pad) for a in self.k]
            v = [mx.pad(a, pad) for a in self.v]
            mx.eval(k, v)
        return MlxKVStorage(g, new_num_blocks, k, v)

    # -- decode attention ------------------------------------------------------------------

    def paged_attention(self, layer: int, q, block_tables, seq_lens, scale, check: bool = True):
        """pagedkv.kernels.mlx.paged_attention over this layer's K/V (reshapes: no copy); a
        ``<K>/<V>`` KV-mode pool runs :func:`pagedkv.quant.kv_mlx.attention_decode` per
        sequence over its records (read as stored, never decoded into a copy; tables are
        always checked on the host)."""
        g = self.geometry
        if "/" not in g.dtype:
            from pagedkv.kernels.mlx import paged_attention
            k, v = self.layer(layer)
            return paged_attention(q, k, v, block_tables, seq_lens, scale=scale, check=check)
        from pagedkv.kernels.kvcache import attention_scale, check_decode_batch
        from pagedkv.kernels.mlx import _array
        from pagedkv.quant import kv as kv_modes
        from pagedkv.quant.kv_mlx import attention_decode
        mx = self._mx
        # checked as given, so a list or tuple is named as what it is
        check_decode_batch(block_tables, seq_lens, num_blocks=self.num_blocks,
                           block_size=g.block_size)
        tables = np.asarray(block_tables)
        lens = np.asarray(seq_lens)
        # q and scale as the unpaired path takes them: a float64 or integer q, a str, bool
        # or non-finite scale are refused, not cast (NaN scale made every output NaN)
        q = _array(mx, "q", q, (mx.float32, mx.float16, mx.bfloat16), "float32/float16/bfloat16")
        scale = attention_scale(scale, g.head_dim)
        if q.ndim != 3 or q.shape[0] != tables.shape[0] or q.shape[2] != g.head_dim \
                or q.shape[1] % g.num_kv_heads:
            raise InvalidArgument(f"q: shape {tuple(q.shape)}, expected [{tables.shape[0]}, "
                                  f"heads (a multiple of {g.num_kv_heads}), {g.head_dim}]")
        k_mode, v_mode = (kv_modes.kv_mode(side) for side in (g.k_dtype, g.v_dtype))
        bs = g.block_size
        outs = []
        with self._on_stream():
            for s in range(tables.shape[0]):
                n = int(lens[s])
                if n == 0:
                    outs.append(mx.zeros(q.shape[1:], dtype=mx.float32))
                    continue
                pos = np.arange(n)
                idx = mx.array((tables[s, pos // bs].astype(np.int64) * bs + pos % bs)
                               .astype(np.int32))
                outs.append(attention_decode(q[s], mx.take(self.k[layer], idx, axis=0),
                                             mx.take(self.v[layer], idx, axis=0), k_mode,
                                             v_mode, g.head_dim, scale))
            return mx.stack(outs)

    # -- block I/O -------------------------------------------------------------------------

    def read_block_into(self, block_id: int, out: np.ndarray) -> None:
        mx = self._mx
        arrays = [a for kv in zip(self.k, self.v, strict=True) for a in kv]  # K0 V0 K1 V1 ...
        with self._on_stream():
            if self._is_bf16:
                arrays = [a.view(mx.uint16) for a in arrays]
            mx.eval(arrays)  # one round trip for every layer
        self._pending = 0
        g = self.geometry
        bs = g.block_size
        for i, a in enumerate(arrays):  # K0 V0 K1 V1 ...: each layer's K slab, then its V slab
            # A zero-copy view of evaluated MLX memory, copied at once under the pool lock.
            np.copyto(_slab(g, out, i // 2, i % 2), np.asarray(a)[block_id * bs:(block_id + 1) * bs])

    def write_block(self, block_id: int, data: np.ndarray) -> None:
        g = self.geometry
        bs = g.block_size
        rows = slice(block_id * bs, (block_id + 1) * bs)
        with self._on_stream():
            for layer in range(g.num_layers):
                self.k[layer][rows] = self._from_numpy(_slab(g, data, layer, 0))
                self.v[layer][rows] = self._from_numpy(_slab(g, data, layer, 1))
            self._mx.eval(self.k, self.v)
        self._pending = 0

    # -- tokens ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Schedule the evaluation of every pending write (``mx.async_eval``; returns at once)."""
        self._pending = 0
        with self._on_stream():
            self._mx.async_eval(self.k, self.v)

    def _written(self, writes: int) -> None:
        if self._stream is None:  # an MLX without a shareable stream: stay eager
            self._mx.eval(self.k, self.v)
            return
        self._pending += writes
        if self._pending >= MAX_PENDING_WRITES:
            self.flush()

    def write_tokens(self, layer: int, slots: np.ndarray, k, v) -> None:
        with self._on_stream():
            idx = self._mx.array(slots.astype(np.int32))
            self.k[layer][idx] = k
            self.v[layer][idx] = v
        self._written(1)

    def write_tokens_layers(self, slots: np.ndarray, k_layers, v_layers) -> None:
        with self._on_stream():
            idx = self._mx.array(slots.astype(np.int32))
            for layer in range(self.geometry.num_layers):
                self.k[layer][idx] = k_layers[layer]
                self.v[layer][idx] = v_layers[layer]
        self._written(self.geometry.num_layers)

    def _gathered(self, *arrays):
        if self._stream is None:
            self._mx.eval(*arrays)
        return arrays

    def gather(self, layer: int, slots: np.ndarray):
        mx = self._mx
        with self._on_stream():
            idx = mx.array(slots.astype(np.int32))
            return self._gathered(mx.take(self.k[layer], idx, axis=0),
                                  mx.take(self.v[layer], idx, axis=0))

    def gather_layers(self, slots: np.ndarray):
        mx = self._mx
        with self._on_stream():
            idx = mx.array(slots.astype(np.int32))
            return self._gathered(mx.stack([mx.take(a, idx, axis=0) for a in self.k]),
                                  mx.stack([mx.take(a, idx, axis=0) for a in self.v]))
