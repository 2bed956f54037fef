"""LayerKVPool: the physical K/V storage of a paged cache (docs/contracts/paged-kv.md, '5.
LayerKVPool').

Per physical layer one K and one V array ``[num_blocks, block_size, num_kv_heads, head_dim]``
of the pool's backend (``numpy.ndarray`` by default, ``mx.array`` with ``backend="mlx"``,
a GPU :class:`~pagedkv.kernels.DeviceArray` with ``backend="device"``).
Slot ``s = block_id * block_size + offset`` addresses one token of one block. The pool never
decides *which* block a token goes to: the allocator and the adapter do; the pool validates
and copies, vectorized, one NumPy (or MLX) call per array.

Every call validates all of its arguments before it writes anything, so a call that raises
leaves the pool as it was. Calls that take block tables or slot arrays accept the
``generation`` those were built for; another generation raises :class:`StaleBlockTable`.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
import threading
from collections.abc import Callable, Hashable

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.errors import (
    InvalidArgument,
    InvalidArgumentType,
    PagedKVError,
    PoolExhausted,
    StaleBlockTable,
)
from pagedkv.pool.geometry import PoolGeometry
from pagedkv.pool.memory_budget import MemoryBudget
from pagedkv.pool.numpy_storage import NumpyKVStorage, NumpySplitKVStorage
from pagedkv.quant import kv as kv_modes
from pagedkv.quant import kv_q8

__all__ = ["BACKENDS", "LayerKVPool", "growth_lock"]

logger = logging.getLogger("pagedkv")

#: Backend names a pool accepts.
BACKENDS = ("numpy", "mlx", "device")

GrowCallback = Callable[[int, int, int], None]

# Outermost lock of the growth order: growth lock -> memory budget -> allocator -> pool.
# Re-entrant so the adapter can hold it across grow_to + allocator.grow_by.
_GROWTH_LOCK = threading.RLock()


def _out_of_memory(exc: BaseException) -> bool:
    """A failure to allocate a new generation that freeing memory may cure."""
    return isinstance(exc, MemoryError) or getattr(exc, "out_of_memory", False) is True


_pool_numbers = itertools.count()


def growth_lock() -> threading.RLock:
    """The process-wide lock that serializes all pool growth (hold it across
    ``pool.grow_to`` and ``allocator.grow_by``)."""
    return _GROWTH_LOCK


def _storage_class(backend: str, geometry: PoolGeometry, split: bool = False):
    if backend == "numpy":
        # Records with K and V rows of different sizes (and kv_adaptive pools, whose rows
        # shrink in place) keep both sides of a block together: the split layout.
        return NumpyKVStorage if geometry.symmetric and not split else NumpySplitKVStorage
    if backend == "mlx":
        from pagedkv.pool.mlx_storage import MlxKVStorage
        return MlxKVStorage
    if backend == "device":
        from pagedkv.pool.device_storage import DeviceKVStorage
        return DeviceKVStorage
    raise InvalidArgument(f"backend: {backend!r} is not a pool backend; use one of "
                          f"{list(BACKENDS)}")


def _index(name: str, value) -> int:
    if not is_int(value):
        raise InvalidArgumentType(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    return operator.index(value)


def _id_array(name: str, ids) -> np.ndarray:
    """``ids`` as a 1-D intp array (no copy when it already is one)."""
    if type(ids) is np.ndarray and ids.dtype == np.intp and ids.ndim == 1:
        return ids
    arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":  # [] from a Python list
            arr = arr.astype(np.intp)
        else:
            raise InvalidArgumentType(
                f"{name}: dtype {arr.dtype} is not an integer dtype; pass int32 ids")
    if arr.ndim != 1:
        raise InvalidArgument(f"{name}: ndim {arr.ndim} (shape {arr.shape}); expected a 1-D array")
    return arr.astype(np.intp, copy=False)


def _is_float_values(x) -> bool:
    """A NumPy float32/float16 array, or an MLX floating array (values to encode)."""
    if isinstance(x, np.ndarray):
        return x.dtype in (np.float32, np.float16)
    dtype = getattr(x, "dtype", None)
    return type(x).__module__.startswith("mlx") and "float" in str(dtype)


class _ClosedStorage:
    """Stands in for the storage of a closed pool: every use raises."""

    backend = "closed"
    slot_copier = None

    def __getattr__(self, name):
        raise PagedKVError("the pool is closed; build a new LayerKVPool")


class LayerKVPool:
    """Per-layer K and V block arrays with block I/O, token scatter/gather and growth.

    ``num_blocks``: blocks allocated now; ``max_num_blocks`` (default ``num_blocks``): the
    most :meth:`grow_to` may reach. ``memory_budget``: debited with this pool's bytes (the
    first allocation must fit, else ``InvalidArgument``). ``pool_id`` names the pool in the
    budget (default ``"pool-<n>"``, ``n`` its :attr:`instance_id`). ``device``: the GPU of
    a ``backend="device"`` pool (a :class:`pagedkv.kernels.Device`; default
    ``open_device()``); other backends refuse it.
    """

    def __init__(self, geometry: PoolGeometry, num_blocks: int, max_num_blocks: int | None = None,
                 *, backend: str = "numpy", memory_budget: MemoryBudget | None = None,
                 pool_id: Hashable | None = None, device=None,
                 layer_region_bytes: int | None = None) -> None:
        if not isinstance(geometry, PoolGeometry):
            raise InvalidArgumentType(
                f"geometry: expected a PoolGeometry, got {type(geometry).__name__}")
        num_blocks = _index("num_blocks", num_blocks)
        if num_blocks < 1:
            raise InvalidArgument(f"num_blocks: {num_blocks} is not positive; it must be >= 1")
        if max_num_blocks is None:
            max_num_blocks = num_blocks
        max_num_blocks = _index("max_num_blocks", max_num_blocks)
        if max_num_blocks < num_blocks:
            raise InvalidArgument(
                f"max_num_blocks: {max_num_blocks} is below num_blocks={num_blocks}; "
                f"it must be >= {num_blocks}")
        if memory_budget is not None and not isinstance(memory_budget, MemoryBudget):
            raise InvalidArgumentType(
                f"memory_budget: expected a MemoryBudget, got {type(memory_budget).__name__}")
        if layer_region_bytes is not None:
            layer_region_bytes = _index("layer_region_bytes", layer_region_bytes)
            if backend != "numpy" or not geometry.quantized:
                raise InvalidArgument("layer_region_bytes: only NumPy pools of KV-mode records "
                                      "have fixed byte regions (kv_adaptive)")
            per_block = geometry.k_slab_bytes + geometry.v_slab_bytes
            if num_blocks * per_block > layer_region_bytes:
                raise InvalidArgument(
                    f"layer_region_bytes: {layer_region_bytes} bytes per layer hold "
                    f"{layer_region_bytes // per_block} blocks of {per_block} bytes, fewer "
                    f"than num_blocks={num_blocks}")
        storage_class = _storage_class(backend, geometry, layer_region_bytes is not None)
        storage_args = {}
        if backend == "device":
            storage_args["device"] = device
        elif device is not None:
            raise InvalidArgument(f"device: only a backend='device' pool takes a device "
                                  f"(backend={backend!r})")
        instance_id = next(_pool_numbers)
        if pool_id is None:
            pool_id = f"pool-{instance_id}"
        try:
            hash(pool_id)  # the memory budget keys its debits by it
        except TypeError:
            raise InvalidArgumentType(f"pool_id must be hashable, got "
                                      f"{type(pool_id).__name__}") from None

        total_bytes = geometry.pool_bytes(num_blocks)
        # The id check and the debit are one step under the budget's lock; a separate check
        # let two pools built at once with one id share a single debit.
        if memory_budget is not None and not memory_budget.try_reserve_new_pool(pool_id,
                                                                                 total_bytes):
            raise InvalidArgument(
                f"num_blocks: {num_blocks} blocks ({total_bytes} bytes) do not fit the memory "
                f"budget: {memory_budget.available_bytes} of {memory_budget.limit_bytes} "
                "bytes available")
        try:
            if layer_region_bytes is None:
                storage = storage_class(geometry, num_blocks, **storage_args)
            else:
                storage = NumpySplitKVStorage(geometry, num_blocks, np.zeros(
                    (geometry.num_layers, layer_region_bytes), np.uint8))
        except BaseException:
            if memory_budget is not None:
                memory_budget.release_pool(pool_id)
            raise

        self._geometry = geometry
        self._backend = backend
        self._storage = storage
        # The storage's C fast path for per-layer token calls (None: always validate in Python).
        self._slot_copier = storage.slot_copier
        self._num_blocks = num_blocks
        self._max_num_blocks = max_num_blocks
        self._generation = 0
        self._budget = memory_budget
        self._pool_id = pool_id
        self._instance_id = instance_id
        self._grow_callbacks: list[GrowCallback] = []
        self._fixed_regions = layer_region_bytes is not None
        self._lock = threading.Lock()
        # Token offsets inside a block, reused by every gather.
        self._offsets = np.arange(geometry.block_size, dtype=np.intp)
        self._side_shapes = (geometry.k_token_shape, geometry.v_token_shape)

    # -- read-only state -------------------------------------------------------------------

    @property
    def geometry(self) -> PoolGeometry:
        return self._geometry

    @property
    def backend(self) -> str:
        """``"numpy"``, ``"mlx"`` or ``"device"``."""
        return self._backend

    @property
    def device(self):
        """The :class:`pagedkv.kernels.Device` of a ``backend="device"`` pool, else None."""
        return getattr(self._storage, "device", None)

    @property
    def pool_id(self) -> Hashable:
        return self._pool_id

    @property
    def instance_id(self) -> int:
        """A process-unique number of this pool object, fixed at construction (``pool_id``
        may be shared by pools of different budgets). An adapter's
        :class:`~pagedkv.adapter.DecodeBatch` records it, and the device kernels refuse the
        tables with any other pool (:func:`pagedkv.kernels.paged.check_tables`)."""
        return self._instance_id

    @property
    def memory_budget(self) -> MemoryBudget | None:
        return self._budget

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def max_num_blocks(self) -> int:
        return self._max_num_blocks

    @property
    def num_layers(self) -> int:
        return self._geometry.num_layers

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._geometry.block_size

    @property
    def num_slots(self) -> int:
        """Token slots now: ``num_blocks * block_size``."""
        return self._num_blocks * self._geometry.block_size

    @property
    def max_cached_tokens(self) -> int:
        """Tokens the pool holds now: ``num_blocks * block_size``."""
        return self.num_slots

    @property
    def generation(self) -> int:
        """Incremented by every committed :meth:`grow_to`."""
        return self._generation

    @property
    def layer_region_bytes(self) -> int | None:
        """Bytes of each layer's fixed region (a pool built with ``layer_region_bytes``:
        kv_adaptive), or None when the pool has none."""
        return self._storage.region_bytes if self._fixed_regions else None

    @property
    def slab_bytes(self) -> int:
        return self._geometry.slab_bytes

    @property
    def bytes_per_block(self) -> int:
        return self._geometry.bytes_per_block

    @property
    def total_bytes(self) -> int:
        """Bytes of the current generation."""
        return self._geometry.pool_bytes(self._num_blocks)

    def __repr__(self) -> str:
        return (f"LayerKVPool(backend={self._backend!r}, geometry={self._geometry!r}, "
                f"num_blocks={self._num_blocks}, max_num_blocks={self._max_num_blocks}, "
                f"generation={self._generation}, total_bytes={self.total_bytes}, "
                f"pool_id={self._pool_id!r})")

    # -- validation ------------------------------------------------------------------------

    def check_generation(self, generation: int | None) -> None:
        """Raise :class:`StaleBlockTable` unless ``generation`` is None or the current one
        (:class:`InvalidArgumentType` unless it is None or an int)."""
        if generation is not None and not is_int(generation):
            raise InvalidArgumentType(
                f"generation must be an int (the pool's generation the table was built for) "
                f"or None, got {type(generation).__name__}")
        if generation is not None and generation != self._generation:
            raise StaleBlockTable(
                f"generation: the block table was built for pool generation {generation}, "
                f"the pool is at generation {self._generation} (it grew); rebuild the table")

    def _fast_generation(self, generation) -> bool:
        """Whether the C fast path may run for ``generation``: None or the current
        generation as an exact ``int``. ``==`` alone let ``False`` or ``0.0`` through (equal
        to generation 0), which :meth:`check_generation` refuses; anything else declines,
        and the validating path decides."""
        return generation is None or (type(generation) is int
                                      and generation == self._generation)

    def _layer_index(self, layer) -> int:
        layer = _index("layer", layer)
        if not 0 <= layer < self._geometry.num_layers:
            raise InvalidArgument(
                f"layer: {layer} is out of range [0, {self._geometry.num_layers})")
        return layer

    def _block_id(self, block_id) -> int:
        block_id = _index("block_id", block_id)
        if not 0 <= block_id < self._num_blocks:
            raise InvalidArgument(f"block_id: {block_id} is out of range [0, {self._num_blocks})")
        return block_id

    def _check_range(self, name: str, ids: np.ndarray, limit: int, what: str) -> None:
        # One reduction catches both ends: negative intp values are huge as uintp.
        if ids.size and ids.view(np.uintp).max() >= limit:
            bad = ids[(ids < 0) | (ids >= limit)][0]
            raise InvalidArgument(f"{name}: {what} {int(bad)} is out of range [0, {limit})")

    def _slots(self, slots) -> np.ndarray:
        slots = _id_array("slots", slots)
        self._check_range("slots", slots, self.num_slots, "slot")
        return slots

    def _table_slots(self, block_ids, num_tokens) -> np.ndarray:
        """Slots of positions ``[0, num_tokens)`` of a block table row (entries past
        ``ceil(num_tokens / block_size)`` are ignored, so -1 padding is fine)."""
        ids = _id_array("block_ids", block_ids)
        num_tokens = _index("num_tokens", num_tokens)
        bs = self._geometry.block_size
        if not 0 <= num_tokens <= ids.shape[0] * bs:
            raise InvalidArgument(
                f"num_tokens: {num_tokens} is out of range [0, {ids.shape[0] * bs}] for "
                f"{ids.shape[0]} block ids of {bs} tokens")
        used = ids[: -(-num_tokens // bs)]
        self._check_range("block_ids", used, self._num_blocks, "block id")
        return (used[:, None] * bs + self._offsets).reshape(-1)[:num_tokens]

    def _side_payload(self, side: int, name: str, x, lead: tuple[int, ...]):
        """``x`` as stored records or values of one side (0 = K, 1 = V), shape
        ``lead + (kv_heads, row)``. A pool of KV-mode records also takes float32/float16
        values ``lead + (kv_heads, head_dim)`` and encodes them (docs/kv-quant.md)."""
        g = self._geometry
        mode = (g.k_dtype, g.v_dtype)[side]
        what = ", ".join(("num_layers", "len(slots)")[-len(lead):]) if lead else ""
        if g.quantized and isinstance(x, np.ndarray) and x.dtype.kind == "f" \
                and not _is_float_values(x):
            raise InvalidArgumentType(
                f"{name}: dtype {x.dtype}; a {g.dtype} pool takes float32/float16 values to "
                f"encode or uint8 records; convert before writing")
        if g.quantized and _is_float_values(x):
            want = lead + (g.num_kv_heads, g.head_dim)
            if tuple(x.shape) != want:
                raise InvalidArgument(
                    f"{name}: shape {tuple(x.shape)} does not match the pool; expected {want} "
                    f"= ({what}, num_kv_heads, head_dim) values to encode as {mode}")
            x = kv_modes.encode(x, mode)
        expected = lead + self._side_shapes[side]
        unit = "record bytes" if g.quantized else "head_dim"
        return self._payload(name, x, expected, f"({what}, num_kv_heads, {unit})")

    def _payload(self, name: str, x, expected: tuple[int, ...], meaning: str):
        x = self._storage.as_payload(name, x)
        if tuple(x.shape) != expected:
            raise InvalidArgument(
                f"{name}: shape {tuple(x.shape)} does not match the pool; expected "
                f"{expected} = {meaning}")
        return x

    # -- slot addressing -------------------------------------------------------------------

    def slot(self, block_id: int, offset: int) -> int:
        """Slot id of token ``offset`` of block ``block_id``: ``block_id * block_size + offset``."""
        block_id = self._block_id(block_id)
        offset = _index("offset", offset)
        if not 0 <= offset < self._geometry.block_size:
            raise InvalidArgument(
                f"offset: {offset} is out of range [0, {self._geometry.block_size})")
        return block_id * self._geometry.block_size + offset

    def block_and_offset(self, slot: int) -> tuple[int, int]:
        """``(block_id, offset)`` of a slot id."""
        slot = _index("slot", slot)
        if not 0 <= slot < self.num_slots:
            raise InvalidArgument(f"slot: {slot} is out of range [0, {self.num_slots})")
        return divmod(slot, self._geometry.block_size)

    def slots_for_positions(self, block_ids, positions, *, generation: int | None = None
                            ) -> np.ndarray:
        """Slots (``int64[n]``) of token ``positions`` of a sequence whose block table row is
        ``block_ids``: ``block_ids[p // block_size] * block_size + p % block_size``."""
        self.check_generation(generation)
        ids = _id_array("block_ids", block_ids)
        pos = _id_array("positions", positions)
        bs = self._geometry.block_size
        self._check_range("positions", pos, ids.shape[0] * bs, "position")
        blocks = ids[pos // bs]
        self._check_range("block_ids", blocks, self._num_blocks, "block id")
        return (blocks * bs + pos % bs).astype(np.int64, copy=False)

    # -- arrays ----------------------------------------------------------------------------

    def layer(self, layer: int):
        """``(k, v)`` of ``layer``, ``[num_blocks, block_size, kv_heads, head_dim]`` arrays of
        the current generation. Do not keep them across calls that may grow the pool."""
        return self._storage.layer(self._layer_index(layer))

    # -- token scatter / gather ------------------------------------------------------------

    # The per-layer calls run once per layer per sequence per decode step, so each first
    # offers its arguments to the storage's C fast path (NumPy backend), which copies only
    # when every argument is of the exact expected kind and in range, and otherwise declines
    # without touching the pool. Declined calls take the validating path below: it alone
    # raises, with the same messages whichever path ran.

    def write_tokens(self, layer: int, slots, k, v, *, generation: int | None = None) -> None:
        """Write ``n`` tokens' K and V (``[n, kv_heads, row]`` of the storage dtype) of
        ``layer`` into ``slots`` (``int[n]``). A pool of KV-mode records (``q8``,
        ``fwht4/q8``, ...) also takes float32/float16 values ``[n, kv_heads, head_dim]`` and
        encodes each side in its mode first. Duplicate slots: the last write wins."""
        with self._lock:
            copier = self._slot_copier
            if copier is not None and self._fast_generation(generation) \
                    and copier.write_slots(layer, slots, k, v):
                return
            self.check_generation(generation)
            layer = self._layer_index(layer)
            slots = self._slots(slots)
            k = self._side_payload(0, "k", k, (slots.shape[0],))
            v = self._side_payload(1, "v", v, (slots.shape[0],))
            self._storage.write_tokens(layer, slots, k, v)

    def try_write_positions(self, layer: int, block_ids, start: int, k, v, *,
                            generation: int | None = None) -> bool:
        """The fast path alone: write ``k``, ``v`` (``[n, kv_heads, head_dim]``) of ``layer``
        at positions ``[start, start + n)`` of the sequence whose block table row is
        ``block_ids``, and return True; or return False, having changed nothing, when the
        arguments are not C-contiguous ndarrays of the pool dtype and shape, an int32/int64
        table and ``int`` layer/start all in range (or the backend has no fast path). Callers
        then take a validating path (:meth:`slots_for_positions` + :meth:`write_tokens`)."""
        with self._lock:
            copier = self._slot_copier
            return copier is not None and self._fast_generation(generation) \
                and copier.write_positions(layer, block_ids, start, k, v)

    def write_tokens_layers(self, slots, k_layers, v_layers, *,
                            generation: int | None = None) -> None:
        """All-layers form of :meth:`write_tokens`: ``k_layers``, ``v_layers`` are
        ``[num_layers, n, kv_heads, head_dim]``; one validation, one scatter per array."""
        with self._lock:
            self.check_generation(generation)
            slots = self._slots(slots)
            lead = (self._geometry.num_layers, slots.shape[0])
            k_layers = self._side_payload(0, "k_layers", k_layers, lead)
            v_layers = self._side_payload(1, "v_layers", v_layers, lead)
            self._storage.write_tokens_layers(slots, k_layers, v_layers)

    def gather(self, layer: int, block_ids, num_tokens: int, *, generation: int | None = None):
        """K and V of positions ``[0, num_tokens)`` of the sequence whose block table row is
        ``block_ids``: new contiguous ``[num_tokens, kv_heads, head_dim]`` arrays."""
        with self._lock:
            copier = self._slot_copier
            if copier is not None and self._fast_generation(generation):
                out = copier.gather(layer, block_ids, num_tokens)
                if out is not None:
                    return out
            self.check_generation(generation)
            layer = self._layer_index(layer)
            slots = self._table_slots(block_ids, num_tokens)
            return self._storage.gather(layer, slots)

    def try_gather(self, layer: int, block_ids, num_tokens: int, *,
                   generation: int | None = None):
        """The fast path of :meth:`gather` alone: its result, or None (nothing done) when the
        arguments are not of the exact kind the C path takes (see :meth:`try_write_positions`)
        or the backend has none. Callers then validate and call :meth:`gather`."""
        with self._lock:
            copier = self._slot_copier
            if copier is not None and self._fast_generation(generation):
                return copier.gather(layer, block_ids, num_tokens)
            return None

    def gather_layers(self, block_ids, num_tokens: int, *, generation: int | None = None):
        """All-layers form of :meth:`gather`: ``(k_layers, v_layers)``, each
        ``[num_layers, num_tokens, kv_heads, head_dim]`` with every layer's
        ``[num_tokens, kv_heads, head_dim]`` slice C-contiguous (on NumPy both are views of
        one new ``[num_layers, 2, num_tokens, ...]`` array, filled by one copy)."""
        with self._lock:
            self.check_generation(generation)
            slots = self._table_slots(block_ids, num_tokens)
            return self._storage.gather_layers(slots)

    def flush(self) -> None:
        """Start evaluating the pool's pending lazy writes and return at once (MLX backend:
        ``mx.async_eval``; NumPy writes are eager, so nothing to do). Token writes and
        gathers on an MLX pool never evaluate (docs/pool.md, "MLX backend")."""
        with self._lock:
            self._storage.flush()

    # -- decode attention ------------------------------------------------------------------

    def paged_attention(self, layer: int, q, block_tables, seq_lens, *,
                        generation: int | None = None, scale: float | None = None,
                        check: bool = True):
        """Decode attention of one layer straight from the pool: one query token per sequence
        (``q`` ``[seqs, heads, head_dim]``), GQA, over ``block_tables`` (``int32[seqs,
        width]``, -1 padded) and ``seq_lens`` (``int32[seqs]``), as
        :meth:`PagedKVCacheAdapter.prepare_decode <pagedkv.adapter.PagedKVCacheAdapter.prepare_decode>`
        builds them (pass its ``generation``). Returns ``float32[seqs, heads, head_dim]``;
        ``scale`` defaults to ``head_dim ** -0.5``.

        MLX pools run :func:`pagedkv.kernels.mlx.paged_attention` (the Metal or CUDA kernel
        on an MLX GPU, MLX array ops on its CPU), reading K/V where they are: no gather into
        a contiguous cache. NumPy pools compute the float64 reference
        (:func:`pagedkv.kernels.numpy_kernels.paged_attention_decode`). ``check=False`` skips
        the host check of the table entries on MLX pools: for a decode step that checked
        its batch once (``pagedkv.kernels.kvcache.check_decode_batch``) and passes the same
        ``mx.array`` tables to every layer."""
        with self._lock:
            self.check_generation(generation)
            layer = self._layer_index(layer)
            return self._storage.paged_attention(layer, q, block_tables, seq_lens, scale,
                                                 check)

    def decode_tokens(self, k, v):
        """``(k, v)`` gathered from this pool as float32 values ``[..., kv_heads, head_dim]``,
        whatever the pool dtype: the records of a KV-mode pool decoded (NumPy, or MLX array
        ops on an MLX pool; a device pool's arrays are copied to the host first), the
        float16/bfloat16 values of an unquantized pool widened exactly (NumPy bfloat16 bits
        ``<< 16``), float32 values as they are. An MLX pool returns ``mx.array``s, the other
        backends NumPy arrays."""
        g = self._geometry
        out = []
        for side, x in ((g.k_dtype, k), (g.v_dtype, v)):
            if self._backend == "device":  # DeviceArrays: decoded on the host
                x = self._storage.to_numpy(x)
            if side in kv_modes.KV_MODES:
                x = kv_modes.decode(x, side, g.head_dim)
            elif side == "bfloat16" and isinstance(x, np.ndarray):
                from pagedkv.pool.bfloat16 import bf16_bits_to_float32
                x = bf16_bits_to_float32(x)
            elif self._backend == "mlx" and not isinstance(x, np.ndarray):
                import mlx.core as mx
                x = x if x.dtype == mx.float32 else x.astype(mx.float32)
            else:
                x = np.asarray(x).astype(np.float32, copy=False)
            out.append(x)
        return out[0], out[1]

    def transcode(self, dtype: str, *, num_blocks: int | None = None) -> None:
        """Re-encode every block into the KV dtype ``dtype`` (kv_adaptive's downshift,
        docs/kv-quant.md): per side unchanged, narrowed within a table family (fwht4 ->
        fwht2, lloyd4 -> lloyd3 -> lloyd2) or q8 -> lloydN / fwhtN (decode + encode). A pool
        built with ``layer_region_bytes`` is transcoded inside its regions and may then hold
        more blocks: ``num_blocks`` (default: as many as fit, at most the regions') becomes
        both ``num_blocks`` and ``max_num_blocks``. The generation increments (block tables
        stay valid by id but must be rebuilt), the budget is updated, grow callbacks run when
        blocks were added. Bad ``dtype`` or transition: ``InvalidArgument``, nothing changed.
        A pool without ``layer_region_bytes`` builds the new generation beside the old one:
        its memory budget must hold both (``old + new`` bytes, checked before anything is
        allocated), else ``PoolExhausted``; so is running out of memory while building it
        (``MemoryError``, a ``DeviceError`` whose ``out_of_memory`` is true: the error is its
        ``__cause__``). Any failing re-encode or upload changes nothing (mode, bytes,
        generation, budget debit), and a device pool's new arrays are freed before the
        error propagates.
        """
        old = self._geometry
        new = PoolGeometry(old.num_layers, old.num_kv_heads, old.head_dim, old.block_size,
                           dtype, old.layout)
        if not (old.quantized and new.quantized):
            raise InvalidArgument(f"dtype: transcoding runs between KV-mode records; "
                                  f"{old.dtype!r} -> {new.dtype!r} is not such a pair")
        sides = []
        for src, dst in ((old.k_dtype, new.k_dtype), (old.v_dtype, new.v_dtype)):
            s_mode, d_mode = kv_modes.kv_mode(src), kv_modes.kv_mode(dst)
            ok = src == dst or src == "q8" or (
                s_mode.rotation == d_mode.rotation and s_mode.sides == d_mode.sides
                and d_mode.bits < s_mode.bits)
            if not ok:
                raise InvalidArgument(f"dtype: {old.dtype!r} -> {new.dtype!r}: {src} -> {dst} is "
                                      f"not a transcode (same, q8 -> any mode, or narrowing "
                                      f"within a table family)")
            sides.append((src, dst))
        hd = old.head_dim

        def convert(side: int, records):
            src, dst = sides[side]
            return records if src == dst else kv_modes.transcode(records, src, dst, hd)

        def check(side: int, records):
            # Only decode + encode can refuse (a downshift re-codes any bytes): a q8 record
            # with a non-finite scale, which the encoder of the new mode cannot take.
            src, dst = sides[side]
            if src == "q8" and dst != src:
                kv_q8.check_scales(records)

        with _GROWTH_LOCK, self._lock:
            if isinstance(self._storage, _ClosedStorage):
                raise PagedKVError("the pool is closed; build a new LayerKVPool")
            storage = self._storage
            per_block = new.k_slab_bytes + new.v_slab_bytes
            old_blocks = self._num_blocks
            if self._fixed_regions:
                assert isinstance(storage, NumpySplitKVStorage)
                room = storage.region_bytes // per_block
                target = room if num_blocks is None else _index("num_blocks", num_blocks)
                if not old_blocks <= target <= room:
                    raise InvalidArgument(f"num_blocks: {target} is outside [{old_blocks}, "
                                          f"{room}] (the blocks the regions hold at {dtype!r})")
                new_storage = storage.transcoded(new, target, convert, check)
            else:
                target = old_blocks if num_blocks is None else _index("num_blocks", num_blocks)
                if target != old_blocks:
                    raise InvalidArgument("num_blocks: only a pool with layer_region_bytes "
                                          "gains blocks when it transcodes")
                # The new generation is built beside the old one: the budget must hold
                # both (as for grow_to), checked before anything is allocated.
                old_bytes, new_bytes = self.total_bytes, new.pool_bytes(old_blocks)
                budget = self._budget
                if budget is not None and not budget.try_reserve(self._pool_id, new_bytes):
                    logger.info("paged pool transcode refused by the memory budget: %s -> %s "
                                "transient_bytes=%d available_bytes=%d", old.dtype, new.dtype,
                                old_bytes + new_bytes, budget.available_bytes)
                    raise PoolExhausted(
                        f"transcoding {old.dtype} -> {new.dtype} builds a {new_bytes}-byte "
                        f"generation beside the pool's {old_bytes} bytes; the memory budget "
                        f"has {budget.available_bytes} of {budget.limit_bytes} bytes "
                        f"available; nothing changed")
                extra = {"device": storage.device} if self._backend == "device" else {}
                fresh = None  # the new generation once allocated, for the discard below
                buf = np.empty(old.block_buffer_shape, np.uint8)
                try:
                    new_storage = fresh = _storage_class(  # type: ignore[operator]
                        self._backend, new)(new, old_blocks, **extra)
                    for b in range(old_blocks):
                        storage.read_block_into(b, buf)
                        rows = buf.reshape(old.num_layers, -1)
                        k = rows[:, :old.k_slab_bytes].reshape(old.num_layers, old.block_size,
                                                               *old.k_token_shape)
                        v = rows[:, old.k_slab_bytes:].reshape(old.num_layers, old.block_size,
                                                               *old.v_token_shape)
                        out = np.concatenate([convert(0, k).reshape(old.num_layers, -1),
                                              convert(1, v).reshape(old.num_layers, -1)],
                                             axis=1)
                        new_storage.write_block(b, np.ascontiguousarray(out).reshape(
                            new.block_buffer_shape))
                except BaseException as exc:
                    # device pools: free the unpublished generation now, not when the
                    # error's traceback (which holds it) goes
                    discard = getattr(fresh, "discard", None)
                    if discard is not None:
                        discard()
                    if budget is not None:
                        budget.update_pool(self._pool_id, old_bytes)
                    if not _out_of_memory(exc):
                        raise
                    # Memory the budget allowed but the device (or host) does not have now:
                    # refused like the budget's refusal (grow_to: PoolExhausted), not a crash.
                    logger.warning("paged pool transcode refused: out of memory for the new "
                                   "generation: %s -> %s new_bytes=%d (%s)", old.dtype,
                                   new.dtype, new_bytes, exc)
                    raise PoolExhausted(
                        f"transcoding {old.dtype} -> {new.dtype}: out of memory for the "
                        f"{new_bytes}-byte new generation ({exc}); nothing changed") from exc
            self._storage = new_storage
            self._slot_copier = new_storage.slot_copier
            self._geometry = new
            self._side_shapes = (new.k_token_shape, new.v_token_shape)
            self._num_blocks = target
            self._max_num_blocks = max(self._max_num_blocks, target)
            self._generation += 1
            generation = self._generation
            release = getattr(storage, "release", None)  # device pools: after the bump
            if release is not None and storage is not new_storage:
                release()
            if self._budget is not None:
                self._budget.update_pool(self._pool_id, self.total_bytes)
        logger.info("paged pool transcoded %s -> %s blocks=%d->%d generation=%d", old.dtype,
                    new.dtype, old_blocks, target, generation)
        if target > old_blocks:
            for fn in tuple(self._grow_callbacks):
                try:
                    fn(old_blocks, target, generation)
                except Exception:
                    logger.exception("paged pool grow callback %r failed after a transcode", fn)

    # -- block I/O -------------------------------------------------------------------------

    def read_block(self, block_id: int, out: np.ndarray | None = None) -> np.ndarray:
        """Block ``block_id`` of every layer as one ``uint8`` buffer of
        ``geometry.block_buffer_shape`` (``[num_layers, 2, slab_bytes]``, or ``[num_layers,
        k_slab_bytes + v_slab_bytes]`` when K and V rows differ): K then V per layer, layers
        in pool order. Written into ``out`` when given."""
        shape = self._geometry.block_buffer_shape
        with self._lock:
            block_id = self._block_id(block_id)
            if out is None:
                out = np.empty(shape, dtype=np.uint8)
            elif not isinstance(out, np.ndarray):
                raise InvalidArgumentType(
                    f"out: expected a NumPy uint8{shape} array, got {type(out).__name__}")
            elif out.dtype != np.uint8 or out.shape != shape:
                raise InvalidArgument(
                    f"out: {out.dtype}{out.shape} does not match; expected uint8{shape}")
            elif not (out.flags.c_contiguous and out.flags.writeable):
                raise InvalidArgument("out: must be a writeable C-contiguous array")
            self._storage.read_block_into(block_id, out)
            return out

    def write_block(self, block_id: int, data) -> None:
        """Write a block buffer (``geometry.block_buffer_shape``, or its bytes, flat) into
        block ``block_id`` of every layer. The id, shape and length are validated first."""
        shape = self._geometry.block_buffer_shape
        total = math.prod(shape)
        if not isinstance(data, np.ndarray):
            try:
                data = np.frombuffer(data, dtype=np.uint8)
            except TypeError:
                raise InvalidArgumentType(
                    f"data: expected a uint8{shape} array or {total} bytes, "
                    f"got {type(data).__name__}") from None
        if data.dtype != np.uint8:
            raise InvalidArgumentType(f"data: dtype {data.dtype} is not uint8; expected "
                                      f"uint8{shape}")
        if data.shape != shape:
            if data.ndim != 1 or data.size != total:
                raise InvalidArgument(
                    f"data: shape {data.shape} ({data.size} bytes) does not match the block "
                    f"buffer; expected uint8{shape} ({total} bytes)")
            data = data.reshape(shape)
        data = np.ascontiguousarray(data)
        with self._lock:
            block_id = self._block_id(block_id)
            self._storage.write_block(block_id, data)

    # -- growth ----------------------------------------------------------------------------

    def add_grow_callback(self, fn: GrowCallback) -> None:
        """Run ``fn(old_blocks, new_blocks, generation)`` after every committed grow."""
        if not callable(fn):
            raise InvalidArgumentType(f"fn: {fn!r} is not callable")
        self._grow_callbacks.append(fn)

    def remove_grow_callback(self, fn: GrowCallback) -> None:
        """Forget ``fn`` (no-op if it was never added)."""
        try:
            self._grow_callbacks.remove(fn)
        except ValueError:
            pass

    def grow_to(self, new_num_blocks: int, *, needed: int | None = None) -> bool:
        """Grow to ``new_num_blocks`` blocks, keeping every block's contents.

        ``False`` (nothing changes) when ``new_num_blocks <= num_blocks``, the memory
        budget refuses the transient ``old + new`` bytes, the pool's fixed layer regions
        (``layer_region_bytes``: kv_adaptive) do not hold them, or the new generation
        cannot be allocated for lack of memory (``MemoryError``, a ``DeviceError`` whose
        ``out_of_memory`` is true: logged at WARNING); ``InvalidArgument`` beyond
        ``max_num_blocks``. On success the generation increments, the budget is debited
        with the new total, the growth is logged (``needed``: the blocks the triggering
        reservation needed, for the log) and the grow callbacks run. A failing copy
        (``grown``) changes nothing and propagates; once the new storage is swapped in, a
        failing release of the old one is logged and the grow stays committed.
        """
        new_num_blocks = _index("new_num_blocks", new_num_blocks)
        with _GROWTH_LOCK:
            if isinstance(self._storage, _ClosedStorage):
                raise PagedKVError("the pool is closed; build a new LayerKVPool")
            old = self._num_blocks
            if new_num_blocks <= old:
                return False
            if new_num_blocks > self._max_num_blocks:
                raise InvalidArgument(
                    f"new_num_blocks: {new_num_blocks} exceeds max_num_blocks="
                    f"{self._max_num_blocks}; grow to at most {self._max_num_blocks}")
            if self._fixed_regions and new_num_blocks > self._storage.region_bytes // (
                    self._geometry.k_slab_bytes + self._geometry.v_slab_bytes):
                # Regions sized once (kv_adaptive) never grow: transcoding to a narrower
                # mode is what makes room in them.
                logger.info("paged pool growth refused: from=%d to=%d does not fit the fixed "
                            "layer regions of %d bytes at %s", old, new_num_blocks,
                            self._storage.region_bytes, self._geometry.dtype)
                return False
            old_bytes = self.total_bytes
            new_bytes = self._geometry.pool_bytes(new_num_blocks)
            budget = self._budget
            if budget is not None and not budget.try_reserve(self._pool_id, new_bytes):
                logger.info("paged pool growth refused by the memory budget: from=%d to=%d "
                            "transient_bytes=%d available_bytes=%d", old, new_num_blocks,
                            old_bytes + new_bytes, budget.available_bytes)
                return False
            # The pool lock is held through the copy so no concurrent write is lost.
            with self._lock:
                old_storage = self._storage
                if isinstance(old_storage, _ClosedStorage):
                    # close() (which does not take the growth lock) ran after the check
                    # above; its release may have come before try_reserve's debit, so drop
                    # the debit here: a closed pool holds none.
                    if budget is not None:
                        budget.release_pool(self._pool_id)
                    raise PagedKVError("the pool is closed; build a new LayerKVPool")
                try:
                    new_storage = old_storage.grown(new_num_blocks)
                    copier = new_storage.slot_copier
                except BaseException as exc:  # nothing changed: the old storage stays in use
                    if budget is not None:
                        budget.update_pool(self._pool_id, old_bytes)
                    if not _out_of_memory(exc):
                        raise
                    # Memory the budget allowed but the device (or host) does not have now
                    # is a refusal like the budget's: the reservation that asked raises
                    # PoolExhausted, which an engine answers by preempting, not a crash.
                    logger.warning("paged pool growth refused: out of memory for the new "
                                   "generation: from=%d to=%d new_bytes=%d (%s)", old,
                                   new_num_blocks, new_bytes, exc)
                    return False
                # Committed: plain assignments, nothing between them can fail.
                self._storage, self._slot_copier = new_storage, copier
                self._num_blocks = new_num_blocks
                self._generation += 1
                generation = self._generation
                if budget is not None:
                    budget.update_pool(self._pool_id, new_bytes)
                # The old generation's memory goes only after the bump (device pools: the
                # last holder of an exported view frees it). A failing release cannot undo
                # the commit: the pool is new and usable, so it is logged, not raised.
                release = getattr(old_storage, "release", None)
                if release is not None:
                    try:
                        release()
                    except Exception:
                        logger.exception("paged pool grow: releasing the old storage failed; "
                                         "the grow stays committed (generation=%d)",
                                         generation)
            logger.info("paged pool grew from=%d to=%d generation=%d needed=%d", old,
                        new_num_blocks, generation,
                        new_num_blocks - old if needed is None else needed)
            for fn in tuple(self._grow_callbacks):
                try:
                    fn(old, new_num_blocks, generation)
                except Exception:
                    logger.exception("paged pool grow callback %r failed; the grow stays "
                                     "committed", fn)
            return True

    def close(self) -> None:
        """Drop the arrays and release the memory-budget debit. Idempotent."""
        with self._lock:
            self._storage = _ClosedStorage()
            self._slot_copier = None
        if self._budget is not None:
            self._budget.release_pool(self._pool_id)
