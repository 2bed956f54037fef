"""Device storage of a paged KV pool: one GPU allocation per layer for K and one for V.

Each is a :class:`~pagedkv.kernels.DeviceArray` ``[num_blocks, block_size, num_kv_heads,
row]`` of the storage dtype (``uint16`` bits for bfloat16, ``uint8`` records for q8 and the
``<K>/<V>`` KV modes, whose K and V rows may differ in size), the
layout of docs/pool.md, so ``layer(i)`` hands kernels (and, through DLPack, torch) the
arrays themselves. Every byte moves on the device:

- token writes and gathers are ``copy_blocks`` launches over token rows (a row of
  ``num_kv_heads * row_bytes`` is a "block" of 1 token), host payloads going up first;
- block I/O (the cold tier) is one ``pkv_slabs_gather`` / ``pkv_slabs_scatter`` launch
  between the pool and a ``uint8[num_layers, 2, slab_bytes]`` staging buffer plus one
  host copy, through a table of the arrays' base addresses built once per generation
  (K/V modes whose K and V rows differ, docs/kv-quant.md: one launch per side into a
  staging buffer per side, interleaved into the block buffer's order on the host);
- growth allocates the new arrays and copies blocks ``[0, old)`` with one ``copy_blocks``
  launch per array; the old arrays are released after the generation bump
  (:meth:`release`) and their memory returns when the last holder of a view or an
  exported DLPack tensor lets go.

Host-facing calls (NumPy payloads, ``read_block``, ``write_block``, ``grown``) end with a
device synchronize, so their results are complete when they return, as on the NumPy
backend. This class trusts its arguments: :class:`~pagedkv.pool.LayerKVPool` validates
ids, shapes, dtypes and generations before calling it.
"""

from __future__ import annotations

from contextlib import suppress

import numpy as np

from pagedkv.errors import InvalidArgumentType
from pagedkv.pool.geometry import PoolGeometry

__all__ = ["DeviceKVStorage"]


def _open(device):
    from pagedkv.kernels import open_device
    return open_device() if device is None else device


class DeviceKVStorage:
    """One generation of a device pool's arrays (immutable size; growth builds a new one)."""

    backend = "device"
    # No C fast path: the per-layer token calls validate in Python, then launch.
    slot_copier = None
    __slots__ = ("_bases", "_side_bases", "_staging", "device", "geometry", "k", "num_blocks",
                 "v")

    def __init__(self, geometry: PoolGeometry, num_blocks: int, device=None) -> None:
        from pagedkv.kernels import DeviceArray
        self.device = device = _open(device)
        self.geometry = g = geometry
        self.num_blocks = num_blocks
        self.k: list = []
        self.v: list = []
        self._bases = None
        self._side_bases: tuple = ()
        self._staging: tuple = ()  # the staging buffer(s), made on first block I/O
        try:
            for _ in range(g.num_layers):
                for side, shape in ((self.k, g.k_layer_shape(num_blocks)),
                                    (self.v, g.v_layer_shape(num_blocks))):
                    arr = DeviceArray.empty(device, shape, g.storage_dtype)
                    side.append(arr)
                    arr.fill_bytes(0)  # a new block reads as zeros, never as old bytes
            if g.symmetric:
                # Base addresses K0 V0 K1 V1 ... (the block buffer's order) for the slab
                # kernels.
                self._bases = device.array(np.array(
                    [a.ptr for pair in zip(self.k, self.v, strict=True) for a in pair],
                    dtype=np.uint64))
            else:
                # K and V slabs differ in size: one table (and one launch) per side.
                self._side_bases = tuple(device.array(np.array([a.ptr for a in side],
                                                               np.uint64))
                                         for side in (self.k, self.v))
        except BaseException:
            self.discard()
            raise

    def discard(self, *extra) -> None:
        """Free every array of a generation nobody was handed (one whose construction,
        growth copy or transcode failed), and ``extra`` arrays, now, rather than when the exception's
        traceback, which holds them, is dropped: out of memory, a caller keeping the error
        (a future, a log record) would otherwise keep a partial generation allocated."""
        with suppress(Exception):  # launches already queued on them finish first
            self.device.synchronize()
        for arr in (*self.k, *self.v, self._bases, *self._side_bases, *self._staging, *extra):
            if arr is not None:
                with suppress(Exception):  # the error being raised is the one to report
                    arr.free()
        self.k, self.v, self._bases, self._side_bases, self._staging = [], [], None, (), ()

    def __repr__(self) -> str:
        return (f"DeviceKVStorage(num_blocks={self.num_blocks}, layers={len(self.k)}, "
                f"dtype={self.geometry.dtype}, device={self.device!r})")

    # -- payloads --------------------------------------------------------------------------

    def as_payload(self, name: str, x):
        """``x`` as a :class:`DeviceArray` (device data, DLPack / CUDA-array-interface
        objects, taken without a copy) or a NumPy array (uploaded by the write), of the
        storage dtype. Never casts."""
        from pagedkv.kernels import DeviceArray
        from pagedkv.kernels.device_array import need_device_array
        from pagedkv.kernels.interop import as_device_array, is_device_buffer
        g = self.geometry
        hint = " (bfloat16 pools take uint16 bit patterns)" if g.dtype == "bfloat16" else ""
        if isinstance(x, DeviceArray) or is_device_buffer(x):
            arr = as_device_array(x, self.device, name=name)
            # a freed V found by its copy's launch came after K's copy had written the pool
            need_device_array(arr, name)
            if arr.dtype != g.storage_dtype:
                raise InvalidArgumentType(
                    f"{name}: dtype {arr.dtype} does not match the pool dtype {g.dtype}: "
                    f"expected {g.storage_dtype}{hint}; convert before writing")
            return arr
        if not isinstance(x, np.ndarray):
            try:
                x = np.asarray(x)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InvalidArgumentType(f"{name}: cannot be read as an array ({exc})") from None
        if x.dtype != g.storage_dtype:
            raise InvalidArgumentType(
                f"{name}: dtype {x.dtype} does not match the pool dtype {g.dtype}: expected "
                f"{g.storage_dtype}{hint} or a DeviceArray of it; convert before writing")
        return x

    def to_numpy(self, x) -> np.ndarray:
        return x.to_numpy()

    def _upload(self, x):
        from pagedkv.kernels import DeviceArray
        return x if isinstance(x, DeviceArray) else self.device.array(np.ascontiguousarray(x))

    def _ids(self, ids: np.ndarray):
        return self.device.array(np.ascontiguousarray(ids, dtype=np.int32))

    # -- arrays ----------------------------------------------------------------------------

    def layer(self, layer: int):
        return self.k[layer], self.v[layer]

    def _token_rows(self, arr):
        """``arr`` (``[..., kv_heads, row]``, either side) as ``uint8[tokens, token_bytes]``."""
        token_bytes = self.geometry.num_kv_heads * arr.shape[-1] * arr.dtype.itemsize
        return arr.view((arr.nbytes // token_bytes, token_bytes), np.uint8)

    def _slabs(self):
        """``((K arrays, k_slab_bytes), (V arrays, v_slab_bytes))``."""
        g = self.geometry
        return (self.k, g.k_slab_bytes), (self.v, g.v_slab_bytes)

    def grown(self, new_num_blocks: int) -> DeviceKVStorage:
        from pagedkv.kernels.kvcache import copy_blocks
        new = DeviceKVStorage(self.geometry, new_num_blocks, self.device)
        ids = None
        try:
            ids = self._ids(np.arange(self.num_blocks))
            for (old_side, slab), new_side in zip(self._slabs(), (new.k, new.v), strict=True):
                for old, fresh in zip(old_side, new_side, strict=True):
                    copy_blocks(self.device, old.view((self.num_blocks, slab), np.uint8), ids,
                                ids, fresh.view((new_num_blocks, slab), np.uint8))
            self.device.synchronize()
        except BaseException:
            new.discard(ids)
            raise
        return new

    def release(self) -> None:
        """Drop this generation's arrays (after the generation bump). Memory returns when
        the last view or exported DLPack tensor of an array lets go of it."""
        self.k, self.v, self._bases, self._side_bases, self._staging = [], [], None, (), ()

    # -- block I/O -------------------------------------------------------------------------

    def _slab_kernel(self, name: str):
        return self.device.kernel("pool", name, "ppiqq")

    def _launch_slabs(self, name: str, block_id: int, bases, staging, n: int, slab: int, *,
                      gather: bool) -> None:
        args = (bases, staging) if gather else (staging, bases)
        grid = (max(1, min(64, -(-slab // (16 * 256)))), min(n, 65535))
        self._slab_kernel(name)(grid, (256,), *args, n, block_id * slab, slab)

    def _staging_buffers(self) -> tuple:
        """One ``uint8[num_layers, 2, slab_bytes]`` buffer, or per side ``uint8[num_layers,
        side_slab_bytes]`` when K and V slabs differ."""
        if not self._staging:
            g = self.geometry
            if g.symmetric:
                self._staging = (self.device.empty(g.block_buffer_shape, np.uint8),)
            else:
                self._staging = tuple(self.device.empty((g.num_layers, slab), np.uint8)
                                      for _, slab in self._slabs())
        return self._staging

    def _side_views(self, buffer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The K and V slabs of a ``[num_layers, k_slab + v_slab]`` block buffer."""
        k_slab = self.geometry.k_slab_bytes
        return buffer[:, :k_slab], buffer[:, k_slab:]

    def read_block_into(self, block_id: int, out: np.ndarray) -> None:
        g = self.geometry
        staging = self._staging_buffers()
        if g.symmetric:
            self._launch_slabs("pkv_slabs_gather", block_id, self._bases, staging[0],
                               2 * g.num_layers, g.slab_bytes, gather=True)
            self.device.copy_dtoh(out, staging[0].ptr)  # ordered after the gather
            return
        host = [np.empty((g.num_layers, slab), np.uint8) for _, slab in self._slabs()]
        for (_, slab), bases, buf, h in zip(self._slabs(), self._side_bases, staging, host,
                                            strict=True):
            self._launch_slabs("pkv_slabs_gather", block_id, bases, buf, g.num_layers, slab,
                               gather=True)
            self.device.copy_dtoh(h, buf.ptr)
        for view, h in zip(self._side_views(out), host, strict=True):
            np.copyto(view, h)

    def write_block(self, block_id: int, data: np.ndarray) -> None:
        g = self.geometry
        staging = self._staging_buffers()
        if g.symmetric:
            self.device.copy_htod(staging[0].ptr, data)
            self._launch_slabs("pkv_slabs_scatter", block_id, self._bases, staging[0],
                               2 * g.num_layers, g.slab_bytes, gather=False)
        else:
            for (_, slab), bases, buf, view in zip(self._slabs(), self._side_bases, staging,
                                                   self._side_views(data), strict=True):
                self.device.copy_htod(buf.ptr, np.ascontiguousarray(view))
                self._launch_slabs("pkv_slabs_scatter", block_id, bases, buf, g.num_layers,
                                   slab, gather=False)
        self.device.synchronize()  # a restored block is published only after this returns

    # -- tokens ----------------------------------------------------------------------------

    @staticmethod
    def _last_writes(slots: np.ndarray) -> np.ndarray:
        """Indices of the last occurrence of each slot (duplicate slots: the last write
        wins, as on the NumPy backend, where the device would race)."""
        if slots.size < 2:
            return np.arange(slots.size)
        rev = slots[::-1]
        _, first = np.unique(rev, return_index=True)
        return np.sort(slots.size - 1 - first)

    def _scatter(self, dst, slots: np.ndarray, src) -> None:
        from pagedkv.kernels.kvcache import copy_blocks
        if slots.size == 0:
            return
        rows = self._last_writes(slots)
        copy_blocks(self.device, self._token_rows(src), self._ids(rows), self._ids(slots[rows]),
                    self._token_rows(dst))

    def write_tokens(self, layer: int, slots: np.ndarray, k, v) -> None:
        k_dev, v_dev = self._upload(k), self._upload(v)
        self._scatter(self.k[layer], slots, k_dev)
        self._scatter(self.v[layer], slots, v_dev)
        self.device.synchronize()

    def write_tokens_layers(self, slots: np.ndarray, k_layers, v_layers) -> None:
        k_dev, v_dev = self._upload(k_layers), self._upload(v_layers)
        for layer in range(self.geometry.num_layers):
            self._scatter(self.k[layer], slots, k_dev.rows(layer, layer + 1))
            self._scatter(self.v[layer], slots, v_dev.rows(layer, layer + 1))
        self.device.synchronize()

    def _gather_into(self, out, src, slots: np.ndarray) -> None:
        from pagedkv.kernels.kvcache import copy_blocks
        if slots.size:
            copy_blocks(self.device, self._token_rows(src), self._ids(slots),
                        self._ids(np.arange(slots.size)), self._token_rows(out))

    def gather(self, layer: int, slots: np.ndarray):
        g = self.geometry
        k = self.device.empty((slots.size, *g.k_token_shape), g.storage_dtype)
        v = self.device.empty((slots.size, *g.v_token_shape), g.storage_dtype)
        self._gather_into(k, self.k[layer], slots)
        self._gather_into(v, self.v[layer], slots)
        self.device.synchronize()
        return k, v

    def gather_layers(self, slots: np.ndarray):
        g = self.geometry
        k = self.device.empty((g.num_layers, slots.size, *g.k_token_shape), g.storage_dtype)
        v = self.device.empty((g.num_layers, slots.size, *g.v_token_shape), g.storage_dtype)
        for layer in range(g.num_layers):
            self._gather_into(k.rows(layer, layer + 1), self.k[layer], slots)
            self._gather_into(v.rows(layer, layer + 1), self.v[layer], slots)
        self.device.synchronize()
        return k, v
