"""The kernels driven by a device pool and the adapter's block tables.

An engine step: ``batch = adapter.prepare_decode(seq_ids)``; ``tables =
DeviceDecodeBatch.upload(device, batch)`` (or ``tables.update(batch)`` into the same
buffers, which keeps captured graphs valid); then per layer :func:`write_kv` (this step's
K/V into the pool at ``batch.slot_mapping``) and :func:`attention` (or
``PagedAttention.run_pool``). Every entry point takes the pool, the tables and the
generation they were built for, and raises :class:`~pagedkv.errors.StaleBlockTable` before
anything is launched when the pool has grown since (docs/adapter.md, "Block tables and
decode batches"): block ids survive growth, the arrays the kernels would read do not.
Tables an adapter built are bound to the adapter's pool (``DecodeBatch.pool_instance``):
another pool, even one of the same geometry, size and generation, raises
:class:`~pagedkv.errors.InvalidArgument` before anything is launched.
"""

from __future__ import annotations

import math

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.errors import InvalidArgument, InvalidArgumentType, StaleBlockTable
from pagedkv.kernels.device import Device, StreamLike
from pagedkv.kernels.device_array import DeviceArray, need_array, need_on_device
from pagedkv.kernels.kvcache import (
    PagedAttention,
    _launch_kv_q8_read,
    _launch_kv_q8_write,
    _launch_kv_rotated_write,
    check_decode_batch,
    check_kv_rows,
    copy_blocks,
)
from pagedkv.kernels.weights import PreparedX

__all__ = ["DeviceDecodeBatch", "attention", "attention_prep", "check_attention",
           "check_tables", "copy_pool_blocks", "qkv_rope_write_kv", "read_kv_q8",
           "rope_write_fusable", "write_kv"]

KV_WRITE_THREADS = 256


class DeviceDecodeBatch:
    """A :class:`pagedkv.adapter.DecodeBatch` on the device: ``block_tables``
    ``int32[seqs, width]``, ``seq_lens`` ``int32[seqs]``, ``slot_mapping`` ``int64[seqs]``,
    ``positions`` ``int32[seqs]`` (``seq_lens - 1``: this step's token, for RoPE) and the
    pool ``generation`` they belong to. ``width`` may exceed the batch's (rows padded with
    -1) so that later steps fit the same buffers. ``pool_instance``: the
    :attr:`~pagedkv.pool.LayerKVPool.instance_id` of the pool whose adapter built the batch
    (:func:`check_tables` refuses the tables with any other pool), or ``None`` for a batch
    built by hand (no ``pool_instance``): taken with any pool that can back its ids."""

    __slots__ = ("_checked_for", "_host", "block_tables", "device", "generation",
                 "max_seq_len", "pool_instance", "positions", "seq_lens", "slot_mapping")

    def __init__(self, device: Device, num_seqs: int, width: int) -> None:
        if num_seqs < 1 or width < 1:
            raise InvalidArgument(f"num_seqs={num_seqs}, width={width}: each must be >= 1")
        self.device = device
        self.block_tables = device.empty((num_seqs, width), np.int32)
        self.seq_lens = device.empty((num_seqs,), np.int32)
        self.slot_mapping = device.empty((num_seqs,), np.int64)
        self.positions = device.empty((num_seqs,), np.int32)
        self.generation: int | None = None  # None: nothing uploaded yet
        self.pool_instance: int | None = None  # the adapter's pool; None: not bound
        self.max_seq_len = 0  # the longest sequence uploaded, tokens
        # Host copies of what was uploaded (tables, seq_lens, slots: small), checked against
        # a pool's (num_blocks, block_size) once, at the first launch on that pool.
        self._host: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._checked_for: tuple[int, int] | None = None

    def __repr__(self) -> str:
        s, w = self.block_tables.shape
        return f"DeviceDecodeBatch(seqs={s}, width={w}, generation={self.generation})"

    @classmethod
    def upload(cls, device: Device, batch, *, width: int | None = None) -> DeviceDecodeBatch:
        """New device buffers holding ``batch`` (a DecodeBatch); ``width``: table columns to
        reserve (default the batch's)."""
        tables = np.asarray(batch.block_tables)
        out = cls(device, tables.shape[0], max(1, tables.shape[1] if width is None else width))
        out.update(batch)
        return out

    def update(self, batch) -> None:
        """Copy ``batch`` into these buffers (same number of sequences, table width at most
        this one's). Checked on the host first; nothing is copied on error."""
        tables = np.asarray(batch.block_tables)
        seq_lens = np.asarray(batch.seq_lens)
        slots = np.asarray(batch.slot_mapping)
        s, w = self.block_tables.shape
        if tables.dtype != np.int32 or tables.ndim != 2 or tables.shape[0] != s \
                or tables.shape[1] > w:
            raise InvalidArgument(f"block_tables: {tables.dtype}{list(tables.shape)}, expected "
                                  f"int32[{s}, <= {w}]")
        if seq_lens.dtype != np.int32 or seq_lens.shape != (s,):
            raise InvalidArgument(f"seq_lens: {seq_lens.dtype}{list(seq_lens.shape)}, expected "
                                  f"int32[{s}]")
        if slots.dtype != np.int64 or slots.shape != (s,):
            raise InvalidArgument(f"slot_mapping: {slots.dtype}{list(slots.shape)}, expected "
                                  f"int64[{s}]")
        if not is_int(batch.generation):
            raise InvalidArgumentType("generation: expected an int")
        pool_instance = getattr(batch, "pool_instance", None)
        if pool_instance is not None and not is_int(pool_instance):
            raise InvalidArgumentType(f"pool_instance: expected an int (the instance_id of "
                                      f"the adapter's pool) or None, got "
                                      f"{type(pool_instance).__name__}")
        padded = np.full((s, w), -1, np.int32)
        padded[:, :tables.shape[1]] = tables
        self.block_tables.copy_from(padded)
        self.seq_lens.copy_from(seq_lens)
        self.slot_mapping.copy_from(slots)
        self.positions.copy_from(np.maximum(seq_lens - 1, 0).astype(np.int32))
        self.generation = int(batch.generation)
        self.pool_instance = None if pool_instance is None else int(pool_instance)
        self.max_seq_len = int(seq_lens.max()) if s else 0
        self._host = (tables.copy(), seq_lens.copy(), slots.copy())
        self._checked_for = None

    def check_against(self, num_blocks: int, block_size: int) -> None:
        """``InvalidArgument`` unless every table entry the sequences use is a block id
        below ``num_blocks``, every length fits its row, and every slot is -1 (no write) or
        below ``num_blocks * block_size``: the kernels index the pool with them unchecked.
        Done once per upload and pool geometry (:func:`check_tables` calls it)."""
        if self._checked_for == (num_blocks, block_size):
            return
        if self._host is None:
            raise InvalidArgument("tables: nothing uploaded yet (DeviceDecodeBatch.upload, or "
                                  ".update with a DecodeBatch)")
        tables, seq_lens, slots = self._host
        check_decode_batch(tables, seq_lens, num_blocks=num_blocks, block_size=block_size)
        bad = (slots < -1) | (slots >= num_blocks * block_size)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidArgument(f"slot_mapping[{i}] = {int(slots[i])} is outside "
                                  f"-1..{num_blocks * block_size - 1} (-1: no write)")
        self._checked_for = (num_blocks, block_size)

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]


def _on_pool_device(pool, name: str, obj) -> None:
    """``InvalidArgument`` unless ``obj`` (argument ``name``: tables, a PagedAttention or a
    DeviceArray; anything else is left to the type checks) is on the pool's GPU: the kernels
    launch on the pool's device and would read the other GPU's addresses there."""
    need_on_device(obj, name, pool.device, "the pool", "pool.device")


def check_tables(pool, tables: DeviceDecodeBatch, generation: int | None = None) -> None:
    """``StaleBlockTable`` unless ``tables`` (and ``generation``, when given) belong to the
    pool's current generation; ``InvalidArgument`` for a pool without device storage, for
    tables an adapter built over another pool (``tables.pool_instance`` is not the pool's
    ``instance_id``; tables without one, built by hand, are not bound to a pool) and for
    ids, lengths or slots the pool cannot back."""
    if getattr(pool, "backend", None) != "device":
        raise InvalidArgument(f"pool: expected a LayerKVPool(backend='device'), got "
                              f"{type(pool).__name__}"
                              + (f" of backend {pool.backend!r}" if hasattr(pool, "backend")
                                 else ""))
    if not isinstance(tables, DeviceDecodeBatch):
        raise InvalidArgumentType(f"tables: expected a DeviceDecodeBatch, got "
                                  f"{type(tables).__name__}")
    _on_pool_device(pool, "tables", tables)
    if tables.pool_instance is not None and tables.pool_instance != pool.instance_id:
        # Same geometry, size and generation would pass every check below, and the kernels
        # would read (and write) this pool's blocks at the other pool's ids: wrong KV.
        raise InvalidArgument(
            f"tables: built by the adapter of pool instance {tables.pool_instance}, passed "
            f"with pool instance {pool.instance_id} (pool_id {pool.pool_id!r}): their block "
            f"ids index the other pool; build the tables with the adapter of the pool you "
            f"pass (adapter.prepare_decode, then DeviceDecodeBatch.upload or .update)")
    if generation is not None and not is_int(generation):
        raise InvalidArgumentType(f"generation must be an int or None, got "
                                  f"{type(generation).__name__}")
    # ids, lengths and slots against the pool; tables never uploaded (buffers of garbage)
    tables.check_against(pool.num_blocks, pool.block_size)
    if generation is not None and tables.generation != generation:
        raise StaleBlockTable(f"generation: the tables were uploaded for pool generation "
                              f"{tables.generation}, the caller says {generation}")
    pool.check_generation(tables.generation if generation is None else generation)


def write_kv(pool, layer: int, k: DeviceArray, v: DeviceArray, tables: DeviceDecodeBatch, *,
             generation: int | None = None, stream: StreamLike = None) -> None:
    """Write this step's K and V (``float32[seqs, kv_heads, head_dim]``; ``float16`` too for
    q8 and KV-mode pools) of ``layer`` into the pool at ``tables.slot_mapping``, rounding to
    the pool dtype (f16 / bf16 round to nearest even; q8 as ``kv_q8_write``) or encoding
    each side in its KV mode (``fwht4/q8``, ``fwht4/lloyd4``, ...: ``kv_rotated_write`` for
    a rotated side, ``kv_q8_write`` for a q8 one; the host codec's bytes)."""
    check_tables(pool, tables, generation)
    g = pool.geometry
    k_pool, v_pool = pool.layer(layer)
    shape = (tables.num_seqs, g.num_kv_heads, g.head_dim)
    for name, arr in (("k", k), ("v", v)):
        if not isinstance(arr, DeviceArray):
            raise InvalidArgumentType(f"{name}: expected a DeviceArray, got {type(arr).__name__}")
        _on_pool_device(pool, name, arr)
        if arr.shape != shape:
            raise InvalidArgument(f"{name}: shape {arr.shape}, expected {shape}")
    if g.quantized:  # q8, or a <K>/<V> pair of KV modes
        from pagedkv.quant import kv as kv_modes
        sides = ((g.k_dtype, k, k_pool), (g.v_dtype, v, v_pool))
        # both sides before either launches: a V refused after K's write left the pool
        # holding this step's K beside the old V
        rows = [check_kv_rows(arr, name, tables.slot_mapping, side_pool, side, into_pool=True)
                for (side, arr, side_pool), name in zip(sides, "kv", strict=True)]
        for (side, arr, side_pool), side_rows in zip(sides, rows, strict=True):
            if side == "q8":
                _launch_kv_q8_write(pool.device, arr, tables.slot_mapping, side_pool,
                                    side_rows, stream)
            else:
                _launch_kv_rotated_write(pool.device, arr, tables.slot_mapping, side_pool,
                                         kv_modes.kv_mode(side).id, side_rows, stream)
        return
    if g.dtype not in ("float16", "bfloat16"):
        raise InvalidArgument(f"pool dtype {g.dtype}: the KV write kernels take float16, "
                              f"bfloat16 and q8 pools")
    need_array(k, "k", np.float32)
    need_array(v, "v", np.float32)
    suffix = "f16" if g.dtype == "float16" else "bf16"
    kernel = pool.device.kernel("decode", f"pkv_kv_write_{suffix}", "pppppii",
                                dependent_launch=True)
    n = tables.num_seqs * g.num_kv_heads * g.head_dim
    kernel((math.ceil(n / KV_WRITE_THREADS),), (KV_WRITE_THREADS,), k, v, tables.slot_mapping,
           k_pool, v_pool, tables.num_seqs, g.num_kv_heads * g.head_dim, stream=stream)


#: Pool dtype -> the kernel of :func:`qkv_rope_write_kv` (hip/decode.hip).
_ROPE_WRITE_KERNELS = {"float16": "f16", "bfloat16": "bf16", "q8": "q8"}


def rope_write_fusable(pool) -> bool:
    """Whether :func:`qkv_rope_write_kv` takes ``pool``: float16, bfloat16 and q8 pools
    (q8: head_dim a multiple of 64, two q8 records per warp); not the KV-mode pairs."""
    g = pool.geometry
    return g.dtype in _ROPE_WRITE_KERNELS and (g.dtype != "q8" or g.head_dim % 64 == 0)


def qkv_rope_write_kv(pool, layer: int, qkv: DeviceArray, q: DeviceArray,
                      tables: DeviceDecodeBatch, *, q_heads: int, theta: float,
                      generation: int | None = None, stream: StreamLike = None) -> None:
    """RoPE, the split and :func:`write_kv` in one launch: ``q`` (``float32[seqs, q_heads,
    head_dim]``) as ``decode.qkv_rope_split`` writes it, and this step's rotated K and V
    from ``qkv`` (``float32[seqs, (q_heads + 2 kv_heads) * head_dim]``) straight into
    ``layer`` of the pool at ``tables.slot_mapping`` (positions ``tables.positions``): the
    bytes the split followed by :func:`write_kv` leave. Pools: :func:`rope_write_fusable`."""
    check_tables(pool, tables, generation)
    g = pool.geometry
    if not rope_write_fusable(pool):
        raise InvalidArgument(f"pool: {g.dtype} (head_dim {g.head_dim}) has no fused RoPE + KV "
                              f"write; use decode.qkv_rope_split then write_kv")
    rows, heads = tables.num_seqs, q_heads + 2 * g.num_kv_heads
    for name, arr in (("qkv", qkv), ("q", q)):
        _on_pool_device(pool, name, arr)
    need_array(qkv, "qkv", np.float32)
    if qkv.shape != (rows, heads * g.head_dim):
        raise InvalidArgument(f"qkv: shape {qkv.shape}, expected {(rows, heads * g.head_dim)}")
    need_array(q, "q", np.float32, writable=True)
    if q.shape != (rows, q_heads, g.head_dim):
        raise InvalidArgument(f"q: shape {q.shape}, expected {(rows, q_heads, g.head_dim)}")
    k_pool, v_pool = pool.layer(layer)
    kernel = pool.device.kernel("decode", f"pkv_qkv_rope_kv_write_{_ROPE_WRITE_KERNELS[g.dtype]}",
                                "ppppppiiiif", dependent_launch=True)
    n = rows * heads * g.head_dim // 2  # a thread per (row, head, pair)
    kernel((math.ceil(n / KV_WRITE_THREADS),), (KV_WRITE_THREADS,), qkv, tables.positions,
           tables.slot_mapping, q, k_pool, v_pool, rows, q_heads, g.num_kv_heads, g.head_dim,
           float(theta), stream=stream)


def check_attention(attn: PagedAttention, pool, tables: DeviceDecodeBatch,
                    generation: int | None = None) -> None:
    """:func:`attention`'s checks without a launch: ``tables`` of the pool's generation
    (:func:`check_tables`), ``attn`` built for the pool's geometry and its workspace
    holding the longest sequence of ``tables`` (``InvalidArgument`` otherwise)."""
    check_tables(pool, tables, generation)
    _on_pool_device(pool, "attn", attn)
    g = pool.geometry
    if (attn.kv_dtype, attn.kv_heads, attn.head_dim, attn.block_size) != (
            g.dtype, g.num_kv_heads, g.head_dim, g.block_size):
        raise InvalidArgument(f"attn: {attn!r} was built for another pool geometry than {g!r}")
    most = attn.max_partitions * attn.partition_tokens  # its partition workspace
    if tables.max_seq_len > most:
        raise InvalidArgument(f"tables: a sequence of {tables.max_seq_len} tokens, but attn's "
                              f"workspace holds {attn.max_partitions} partitions of "
                              f"{attn.partition_tokens} ({most} tokens); build it with a larger "
                              "max_seq_len")


def _attention_layer(attn: PagedAttention, pool, layer: int, tables: DeviceDecodeBatch,
                     generation: int | None, q, out):
    """``layer``'s K and V arrays, once the tables and ``attn``'s geometry fit the pool (and
    ``q`` and ``out`` are on its device)."""
    check_attention(attn, pool, tables, generation)
    for name, arr in (("q", q), ("out", out)):
        _on_pool_device(pool, name, arr)
    return pool.layer(layer)


def attention(attn: PagedAttention, q: DeviceArray, pool, layer: int,
              tables: DeviceDecodeBatch, out: DeviceArray, *, generation: int | None = None,
              stream: StreamLike = None) -> None:
    """``attn.run`` over ``layer``'s K and V arrays of a device pool and the uploaded tables."""
    k_pool, v_pool = _attention_layer(attn, pool, layer, tables, generation, q, out)
    attn.run(q, k_pool, v_pool, tables.block_tables, tables.seq_lens, out, stream=stream)


def attention_prep(attn: PagedAttention, q: DeviceArray, pool, layer: int,
                   tables: DeviceDecodeBatch, prepared: PreparedX,
                   out: DeviceArray | None = None, *, generation: int | None = None,
                   stream: StreamLike = None) -> None:
    """:func:`attention` whose reduce writes the next GEMV's prepared x
    (``attn.run_prep``: ``prepared = gemv.prepared_x()`` of the O projection, then
    ``gemv.run_prepared``); ``out`` may be ``None``. Geometries: ``attn.prep_fusable``."""
    k_pool, v_pool = _attention_layer(attn, pool, layer, tables, generation, q, out)
    attn.run_prep(q, k_pool, v_pool, tables.block_tables, tables.seq_lens, prepared, out,
                  stream=stream)


def read_kv_q8(pool, layer: int, slots: DeviceArray, k_out: DeviceArray, v_out: DeviceArray,
               *, generation: int, stream: StreamLike = None) -> None:
    """Dequantize ``layer``'s q8 K and V rows at ``slots`` (``int64``, built for pool
    ``generation``) into ``k_out``, ``v_out`` (``float32``/``float16[n, kv_heads,
    head_dim]``)."""
    pool.check_generation(generation)
    if pool.geometry.dtype != "q8":
        raise InvalidArgument(f"pool dtype {pool.geometry.dtype}: read_kv_q8 needs a q8 pool")
    k_pool, v_pool = pool.layer(layer)
    for name, arr in (("slots", slots), ("k_out", k_out), ("v_out", v_out)):
        _on_pool_device(pool, name, arr)
    sides = (("k_out", k_out, k_pool), ("v_out", v_out, v_pool))
    rows = [check_kv_rows(out, name, slots, side_pool, into_pool=False)
            for name, out, side_pool in sides]  # both before either launch
    for (_, out, side_pool), side_rows in zip(sides, rows, strict=True):
        _launch_kv_q8_read(pool.device, side_pool, slots, out, side_rows, stream)


def copy_pool_blocks(pool, src_ids, dst_ids, *, generation: int,
                     stream: StreamLike = None) -> None:
    """Copy block ``src_ids[i]`` to block ``dst_ids[i]`` in every layer's K and V (a forked
    sequence's copy-on-write tail, say). Ids (``int32``, host or device) are checked on the
    host when they are NumPy arrays; ``generation`` is the one they were chosen in."""
    pool.check_generation(generation)
    device = pool.device
    hosts = {}
    for name, arr in (("src_ids", src_ids), ("dst_ids", dst_ids)):
        if isinstance(arr, DeviceArray):
            _on_pool_device(pool, name, arr)
            continue
        host = np.asarray(arr)
        if host.dtype.kind not in "iu" or host.ndim != 1:
            raise InvalidArgument(f"{name}: {host.dtype}{list(host.shape)}, expected int32[n]")
        if host.size and (host.min() < 0 or host.max() >= pool.num_blocks):
            raise InvalidArgument(f"{name}: an id is outside 0..{pool.num_blocks - 1}")
        hosts[name] = host
    # the copies run in parallel: a block written twice, or read while written, races
    if len(hosts) == 2 and np.intersect1d(hosts["src_ids"], hosts["dst_ids"]).size:
        raise InvalidArgument("src_ids/dst_ids: a block is both a source and a destination; "
                              "the copies run in parallel, so use disjoint sets")
    if "dst_ids" in hosts and np.unique(hosts["dst_ids"]).size != hosts["dst_ids"].size:
        raise InvalidArgument("dst_ids: a block is a destination twice; the copies run in "
                              "parallel, so give each destination once")
    ids = [device.array(hosts[name].astype(np.int32)) if name in hosts else arr
           for name, arr in (("src_ids", src_ids), ("dst_ids", dst_ids))]
    g = pool.geometry
    for layer in range(pool.num_layers):
        for arr, slab in zip(pool.layer(layer), (g.k_slab_bytes, g.v_slab_bytes), strict=True):
            blocks = arr.view((pool.num_blocks, slab), np.uint8)
            copy_blocks(device, blocks, ids[0], ids[1], blocks, stream=stream)
