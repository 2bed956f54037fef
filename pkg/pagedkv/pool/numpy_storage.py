"""NumPy storage of a paged KV pool: every layer's K and V in one C-contiguous ndarray.

The array is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, row]`` (axis 1: K, V),
so ``array[layer, 0]`` is layer ``layer``'s K, itself a C-contiguous
``[num_blocks, block_size, num_kv_heads, row]`` array, and ``array[:, :, block]`` is exactly
the ``uint8[num_layers, 2, slab_bytes]`` block buffer of docs/contracts/paged-kv.md, '5.5 Block I/O'
once viewed as
bytes. One array instead of ``2 * num_layers`` lets block I/O and all-layer token writes and
gathers run as one NumPy call each.

This class trusts its arguments: :class:`~pagedkv.pool.LayerKVPool` validates ids, shapes,
dtypes and generations before calling it.
"""

from __future__ import annotations

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.pool.geometry import PoolGeometry
from pagedkv.pool.slot_copy import SlotCopier

__all__ = ["NumpyKVStorage", "NumpySplitKVStorage"]


class NumpyKVStorage:
    """One generation of a NumPy pool's arrays (immutable size; growth builds a new one)."""

    backend = "numpy"
    __slots__ = ("_blocks", "_layer_tokens", "_tokens", "array", "geometry", "num_blocks",
                 "slot_copier")

    def __init__(self, geometry: PoolGeometry, num_blocks: int,
                 array: np.ndarray | None = None) -> None:
        g = geometry
        self.geometry = g
        self.num_blocks = num_blocks
        if array is None:
            # np.zeros maps fresh zero pages lazily: an unused tail costs no memory until
            # written, and no block ever holds another process's bytes.
            array = np.zeros((g.num_layers, 2, *g.layer_shape(num_blocks)), dtype=g.storage_dtype)
        self.array = array
        # Views (no copies): per token slot and per block.
        self._tokens = array.reshape(g.num_layers, 2, num_blocks * g.block_size,
                                     g.num_kv_heads, g.row_elements)
        self._blocks = array.reshape(g.num_layers, 2, num_blocks,
                                     g.block_size * g.num_kv_heads * g.row_elements)
        # Per-layer (K, V) slot views, built once: indexing the 5-D view on every
        # per-layer call costs as much as the copy of a decode token.
        self._layer_tokens = [(self._tokens[i, 0], self._tokens[i, 1])
                              for i in range(g.num_layers)]
        # The C fast path of the per-layer token calls (LayerKVPool tries it first).
        self.slot_copier = SlotCopier(array)

    def __repr__(self) -> str:
        return (f"NumpyKVStorage(num_blocks={self.num_blocks}, shape={self.array.shape}, "
                f"dtype={self.array.dtype}, nbytes={self.array.nbytes})")

    # -- payload type ----------------------------------------------------------------------

    def as_payload(self, name: str, x) -> np.ndarray:
        """``x`` as an ndarray of the storage dtype; never casts (a cast would change bits)."""
        if not isinstance(x, np.ndarray):
            try:
                x = np.asarray(x)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InvalidArgumentType(
                    f"{name}: cannot be read as a NumPy array ({exc})") from None
        if x.dtype != self.geometry.storage_dtype:
            g = self.geometry
            hint = (" (bfloat16 pools take uint16 bit patterns)" if g.dtype == "bfloat16" else
                    " records, or float32/float16 values to encode" if g.quantized else "")
            raise InvalidArgumentType(
                f"{name}: dtype {x.dtype} does not match the pool dtype {g.dtype}: expected "
                f"{g.storage_dtype}{hint}; convert before writing")
        return x

    def to_numpy(self, x) -> np.ndarray:
        return x

    # -- arrays ----------------------------------------------------------------------------

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.array[layer, 0], self.array[layer, 1]

    def grown(self, new_num_blocks: int) -> NumpyKVStorage:
        new = NumpyKVStorage(self.geometry, new_num_blocks)
        # num_layers * 2 contiguous runs, one np.copyto (a memcpy) each: measured faster
        # than one strided 6-D assignment, whose inner loop does not reach memcpy speed.
        old = self.num_blocks
        for layer in range(self.geometry.num_layers):
            for kv in (0, 1):
                np.copyto(new.array[layer, kv, :old], self.array[layer, kv])
        return new

    # -- decode attention ------------------------------------------------------------------

    def paged_attention(self, layer: int, q, block_tables, seq_lens, scale,
                        check: bool = True) -> np.ndarray:
        """The float64 NumPy reference over this layer (the oracle the kernels are tested
        against; correct, not fast). The tables are always checked."""
        from pagedkv.kernels.kvcache import attention_scale, check_decode_batch
        from pagedkv.kernels.numpy_kernels import paged_attention_decode
        g = self.geometry
        scale = attention_scale(scale, g.head_dim)
        if not isinstance(q, np.ndarray) or q.dtype.kind != "f":
            raise InvalidArgumentType(f"q: expected a floating-point numpy.ndarray, got "
                                      f"{getattr(q, 'dtype', type(q).__name__)}")
        q = np.asarray(q, dtype=np.float32)
        if q.ndim != 3 or q.shape[2] != g.head_dim or q.shape[1] % g.num_kv_heads:
            raise InvalidArgument(f"q: shape {q.shape}, expected [seqs, heads (a multiple of "
                                  f"{g.num_kv_heads}), {g.head_dim}]")
        tables = np.asarray(block_tables)
        lens = np.asarray(seq_lens)
        check_decode_batch(tables, lens, num_blocks=self.num_blocks, block_size=g.block_size)
        if tables.shape[0] != q.shape[0]:
            raise InvalidArgument(f"block_tables: {tables.shape[0]} rows, q has {q.shape[0]} "
                                  f"sequences")
        k, v = self.layer(layer)
        return paged_attention_decode(q, k, v, tables, lens, kv_dtype=g.dtype, scale=scale)

    # -- block I/O -------------------------------------------------------------------------

    def read_block_into(self, block_id: int, out: np.ndarray) -> None:
        np.copyto(out.view(self.geometry.storage_dtype), self._blocks[:, :, block_id])

    def write_block(self, block_id: int, data: np.ndarray) -> None:
        np.copyto(self._blocks[:, :, block_id], data.view(self.geometry.storage_dtype))

    # -- tokens ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Nothing to do: NumPy writes are done when they return."""

    def write_tokens(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        k_slots, v_slots = self._layer_tokens[layer]
        k_slots[slots] = k
        v_slots[slots] = v

    def write_tokens_layers(self, slots: np.ndarray, k_layers: np.ndarray,
                            v_layers: np.ndarray) -> None:
        self._tokens[:, 0, slots] = k_layers
        self._tokens[:, 1, slots] = v_layers

    def gather(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k_slots, v_slots = self._layer_tokens[layer]
        return k_slots.take(slots, axis=0), v_slots.take(slots, axis=0)

    def gather_layers(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # One take over the whole (C-contiguous) array: ndarray.take copies a
        # non-contiguous source in full first, so K and V are not taken separately.
        both = self._tokens.take(slots, axis=2)
        return both[:, 0], both[:, 1]


class NumpySplitKVStorage:
    """NumPy storage of a pool of KV-mode records whose K and V rows may differ in size
    (``fwht4/q8`` ...), and of every kv_adaptive pool: per layer one ``uint8`` region in
    which block ``b`` sits at ``b * (k_slab + v_slab)``, its K slab then its V slab, so the
    block buffer (``uint8[num_layers, k_slab + v_slab]``) is one contiguous copy per layer.
    ``layer()`` returns strided ``[num_blocks, block_size, kv_heads, row]`` views.

    ``region_bytes`` (default: exactly ``num_blocks`` blocks) fixes each layer's region:
    :meth:`transcoded` re-encodes every block into narrower records inside the same
    regions, front to back (a block's new offset never passes its old one), so a
    downshift moves no memory to a new buffer. No C fast path (``slot_copier`` is None).
    """

    backend = "numpy"
    __slots__ = ("_k", "_v", "geometry", "num_blocks", "region")
    slot_copier = None

    def __init__(self, geometry: PoolGeometry, num_blocks: int,
                 region: np.ndarray | None = None) -> None:
        g = geometry
        self.geometry = g
        self.num_blocks = num_blocks
        block = g.k_slab_bytes + g.v_slab_bytes
        if region is None:
            region = np.zeros((g.num_layers, num_blocks * block), np.uint8)
        if region.shape[1] < num_blocks * block:
            raise InvalidArgument(f"region: {region.shape[1]} bytes per layer hold fewer than "
                                  f"{num_blocks} blocks of {block} bytes")
        self.region = region
        blocks = region[:, :num_blocks * block].reshape(g.num_layers, num_blocks, block)
        self._k = blocks[:, :, :g.k_slab_bytes].reshape(g.num_layers, *g.k_layer_shape(num_blocks))
        self._v = blocks[:, :, g.k_slab_bytes:].reshape(g.num_layers, *g.v_layer_shape(num_blocks))

    def __repr__(self) -> str:
        return (f"NumpySplitKVStorage(num_blocks={self.num_blocks}, dtype={self.geometry.dtype!r}"
                f", region_bytes={self.region.shape[1]}, nbytes={self.region.nbytes})")

    as_payload = NumpyKVStorage.as_payload
    to_numpy = NumpyKVStorage.to_numpy
    # The float64 reference over the layer's strided views (compressed K/V read as stored).
    paged_attention = NumpyKVStorage.paged_attention
    flush = NumpyKVStorage.flush

    @property
    def region_bytes(self) -> int:
        """Bytes of one layer's region."""
        return self.region.shape[1]

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self._k[layer], self._v[layer]

    def grown(self, new_num_blocks: int) -> NumpySplitKVStorage:
        g = self.geometry
        block = g.k_slab_bytes + g.v_slab_bytes
        if new_num_blocks * block <= self.region_bytes:  # room left in the regions
            return NumpySplitKVStorage(g, new_num_blocks, self.region)
        new = NumpySplitKVStorage(g, new_num_blocks)
        np.copyto(new.region[:, :self.num_blocks * block],
                  self.region[:, :self.num_blocks * block])
        return new

    def transcoded(self, geometry: PoolGeometry, num_blocks: int, convert,
                   check=None) -> NumpySplitKVStorage:
        """This storage's blocks re-encoded to ``geometry`` (narrower records) by ``convert(
        side, records)`` (``side`` 0 = K, 1 = V; records ``[n, kv_heads, row]``), inside the
        same regions, then viewed as ``num_blocks`` blocks of the new geometry. The
        rewrite is in place, so ``check(side, records)`` first sees every block's records
        of each side and raises for any that ``convert`` would refuse: a refusal halfway
        would leave earlier blocks in the new layout under the old geometry."""
        old, g = self.geometry, geometry
        ob, nb = old.k_slab_bytes + old.v_slab_bytes, g.k_slab_bytes + g.v_slab_bytes
        if nb > ob or num_blocks * nb > self.region_bytes:
            raise InvalidArgument(f"transcode to {g.dtype!r}: {num_blocks} blocks of {nb} "
                                  f"bytes do not fit regions of {self.region_bytes} bytes "
                                  f"holding blocks of {ob}")
        live = self.region[:, :self.num_blocks * ob].reshape(old.num_layers, self.num_blocks, ob)
        if check is not None:
            check(0, live[:, :, :old.k_slab_bytes])
            check(1, live[:, :, old.k_slab_bytes:])
        bs_tokens = old.block_size
        for layer in range(old.num_layers):
            row = self.region[layer]
            for b in range(self.num_blocks):  # front to back: b * nb <= b * ob
                blk = row[b * ob:(b + 1) * ob]
                k = convert(0, blk[:old.k_slab_bytes].reshape(bs_tokens, *old.k_token_shape))
                v = convert(1, blk[old.k_slab_bytes:].reshape(bs_tokens, *old.v_token_shape))
                out = row[b * nb:(b + 1) * nb]
                out[:g.k_slab_bytes] = k.reshape(-1)
                out[g.k_slab_bytes:] = v.reshape(-1)
        # Bytes past the live blocks keep old records: zero them, as a fresh pool would be.
        self.region[:, self.num_blocks * nb:] = 0
        return NumpySplitKVStorage(g, num_blocks, self.region)

    def _block_views(self, buffer: np.ndarray) -> np.ndarray:
        g = self.geometry
        return buffer.reshape(g.num_layers, g.k_slab_bytes + g.v_slab_bytes)

    def read_block_into(self, block_id: int, out: np.ndarray) -> None:
        block = self.geometry.k_slab_bytes + self.geometry.v_slab_bytes
        np.copyto(self._block_views(out), self.region[:, block_id * block:(block_id + 1) * block])

    def write_block(self, block_id: int, data: np.ndarray) -> None:
        block = self.geometry.k_slab_bytes + self.geometry.v_slab_bytes
        np.copyto(self.region[:, block_id * block:(block_id + 1) * block], self._block_views(data))

    def _split(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.divmod(slots, self.geometry.block_size)

    def write_tokens(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        blocks, offs = self._split(slots)
        self._k[layer, blocks, offs] = k
        self._v[layer, blocks, offs] = v

    def write_tokens_layers(self, slots: np.ndarray, k_layers: np.ndarray,
                            v_layers: np.ndarray) -> None:
        blocks, offs = self._split(slots)
        self._k[:, blocks, offs] = k_layers
        self._v[:, blocks, offs] = v_layers

    def gather(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        blocks, offs = self._split(slots)
        return self._k[layer, blocks, offs], self._v[layer, blocks, offs]

    def gather_layers(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # The layer axis is indexed too: with a slice there NumPy lays the result out
        # token-major, so no layer's [n, kv_heads, row] slice was C-contiguous (the contract
        # of LayerKVPool.gather_layers). All-advanced indices give a C-ordered result.
        blocks, offs = self._split(slots)
        layers = np.arange(self.geometry.num_layers)[:, None]
        return self._k[layers, blocks, offs], self._v[layers, blocks, offs]
