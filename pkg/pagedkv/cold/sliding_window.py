"""Sliding-window sidecar: the live window rows of every physical sliding layer at a
boundary (docs/cold.md, "Sliding-window sidecar").

Per physical sliding layer (KV-shared aliases hold no state of their own) two tensors, K
then V, each ``[1, kv_heads, min(b, window), head_dim]`` in the pool's dtype (bfloat16 as
uint16 bit patterns, float16 or float32; the layout records it) — the rows
``[b - min(b, window), b)`` — layer-major across the sliding groups in group order. The
policy is ``boundary_scaled(axis=2)``: any positive block-aligned boundary works and a
pre-wrap state (``b < window``) is first-class.

Reading a boundary's rows out of the sliding groups' pools (:meth:`snapshot`) and writing
them back into freshly allocated blocks with null entries in front (:meth:`install`) live
here too, so a checkpoint store and the grouped restore share one definition of "the
rows of a boundary".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from pagedkv.argument_checks import int_argument
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.policy import ColdSidecarPolicy
from pagedkv.cold.sidecar import ColdSidecarLayout, RestoredSidecar, storage_dtype
from pagedkv.errors import (
    InvalidArgument,
    InvalidArgumentType,
    PoolExhausted,
    SidecarLayoutMismatch,
)

__all__ = ["SlidingGroupRows", "SlidingGroupTarget", "SlidingWindowCodec"]


@dataclass(frozen=True)
class SlidingGroupRows:
    """One sliding group of a live request, as :meth:`SlidingWindowCodec.snapshot` reads it:
    the group's pool (its physical layers, in group order), the request's block table
    row — absolute logical width, entry ``i`` holding tokens ``[i*bs, (i+1)*bs)``, expired
    entries ``null_block_id``, ``-1`` past the end — and ``num_tokens``, the committed
    tokens whose rows are written."""

    pool: Any
    block_table: np.ndarray
    null_block_id: int
    num_tokens: int


@dataclass(frozen=True)
class SlidingGroupTarget:
    """One sliding group a restore installs into: its pool, allocator and null block."""

    pool: Any
    allocator: Any
    null_block_id: int


@dataclass(frozen=True)
class SlidingWindowCodec:
    """Packs the window rows of ``num_layers`` physical sliding layers (all sliding groups
    together, group order) into a sidecar payload and back.

    ``dtype``: the sliding pools' dtype, ``bfloat16`` (default), ``float16`` or ``float32``;
    it is part of the layout, so a sidecar of another dtype never decodes. A state is
    ``(k, v)``, each ``[num_layers, min(b, window), kv_heads, head_dim]`` in the storage dtype
    (bfloat16: ``uint16`` bit patterns; token-major, as the pool stores rows); the payload
    stores each as ``[kv_heads, rows, head_dim]``.
    """

    window: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    group = ColdGroup.SLIDING_WINDOW

    def __post_init__(self) -> None:
        for name in ("window", "num_layers", "kv_heads", "head_dim"):
            int_argument(name, getattr(self, name), 1)
        storage_dtype(self.dtype)  # InvalidArgument for q8 or an unknown name
        self.policy  # noqa: B018 - validates the template geometry

    @cached_property
    def policy(self) -> ColdSidecarPolicy:
        """``boundary_scaled(axis=2)`` over ``[1, kv_heads, window, head_dim]``."""
        row_bytes = self.kv_heads * self.head_dim * self.storage.itemsize
        template = ColdSidecarLayout(self.group, self.window, self.num_layers, 2, self.dtype,
                                     (1, self.kv_heads, self.window, self.head_dim),
                                     row_bytes * self.window)
        return ColdSidecarPolicy.boundary_scaled(template, 2)

    @property
    def storage(self) -> np.dtype:
        """The NumPy dtype one element travels as (bfloat16: ``uint16``)."""
        return storage_dtype(self.dtype)

    def rows_at(self, boundary_tokens: int) -> int:
        """Rows one layer's K (or V) holds at ``boundary_tokens``: ``min(b, window)``."""
        rows = self.policy.scaled_extent(boundary_tokens)
        assert rows is not None
        return rows

    def layout_at(self, boundary_tokens: int) -> ColdSidecarLayout:
        layout = self.policy.expected_at(boundary_tokens)
        if layout is None:
            raise InvalidArgument("boundary_tokens = 0: a checkpoint needs a positive boundary")
        return layout

    # --- pack / unpack ---------------------------------------------------------------------

    def pack(self, state, boundary_tokens: int, out: np.ndarray | None = None
             ) -> tuple[ColdSidecarLayout, np.ndarray]:
        """``(layout, payload)``: ``state = (k, v)`` at ``boundary_tokens`` as
        ``uint8[2 * num_layers, bytes_per_tensor]`` (one transposing copy).
        ``SidecarLayoutMismatch`` (nothing written) for another dtype or shape."""
        layout = self.layout_at(boundary_tokens)
        rows = layout.dims[2]
        want = (self.num_layers, rows, self.kv_heads, self.head_dim)
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise SidecarLayoutMismatch("a sliding state is (k, v)")
        for name, a in zip("kv", state, strict=True):
            if not isinstance(a, np.ndarray) or a.dtype != self.storage or a.shape != want:
                got = f"{a.dtype}{a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise SidecarLayoutMismatch(
                    f"sliding {name} at {boundary_tokens} tokens: {got}; the layout needs "
                    f"{self.dtype} ({self.storage}){want} (other dtypes are never "
                    "relabelled)")
        shape = (layout.tensor_count, layout.bytes_per_tensor)
        if out is None:
            out = np.empty(shape, np.uint8)
        elif out.dtype != np.uint8 or out.shape != shape or not out.flags.c_contiguous:
            raise InvalidArgument(f"out must be a C-contiguous uint8{shape} array")
        dst = out.view(self.storage).reshape(self.num_layers, 2, self.kv_heads, rows, self.head_dim)
        dst[:, 0] = state[0].transpose(0, 2, 1, 3)
        dst[:, 1] = state[1].transpose(0, 2, 1, 3)
        return layout, out

    def unpack(self, sidecar: RestoredSidecar) -> tuple[np.ndarray, np.ndarray]:
        """``(k, v)``, each ``[num_layers, rows, kv_heads, head_dim]`` in the storage dtype
        (new arrays).
        ``SidecarLayoutMismatch`` when the sidecar is not this codec's layout."""
        if not isinstance(sidecar, RestoredSidecar):
            raise InvalidArgumentType(
                f"sidecar must be a RestoredSidecar, got {type(sidecar).__name__}")
        want = self.policy.expected_at(sidecar.boundary_tokens)
        if want is None or sidecar.layout != want or sidecar.payload.shape != (
                want.tensor_count, want.bytes_per_tensor):
            raise SidecarLayoutMismatch(f"sidecar layout {sidecar.layout!r} is not this "
                                        f"codec's layout at {sidecar.boundary_tokens}: {want!r}")
        rows = want.dims[2]
        src = np.ascontiguousarray(sidecar.payload).view(self.storage).reshape(
            self.num_layers, 2, self.kv_heads, rows, self.head_dim)
        return (np.ascontiguousarray(src[:, 0].transpose(0, 2, 1, 3)),
                np.ascontiguousarray(src[:, 1].transpose(0, 2, 1, 3)))

    # --- the pools -------------------------------------------------------------------------

    def _check_groups(self, pools) -> None:
        total = 0
        for g, pool in enumerate(pools):
            geo = pool.geometry
            if (geo.num_kv_heads, geo.head_dim) != (self.kv_heads, self.head_dim) or \
                    geo.dtype != self.dtype:
                raise SidecarLayoutMismatch(
                    f"sliding group {g}: pool rows are {geo.dtype}[{geo.num_kv_heads}, "
                    f"{geo.head_dim}], the sidecar holds {self.dtype}[{self.kv_heads}, "
                    f"{self.head_dim}]")
            total += geo.num_layers
        if total != self.num_layers:
            raise SidecarLayoutMismatch(f"the sliding groups hold {total} physical layers, "
                                        f"the sidecar {self.num_layers}")

    def snapshot(self, groups: Sequence[SlidingGroupRows], boundary_tokens: int):
        """``(k, v)`` rows ``[b - min(b, window), b)`` of every physical sliding layer (group
        order), read from the live tables; ``None`` when any of those rows was already
        pruned (its entry is null or missing). A boundary past a group's committed tokens
        raises ``InvalidArgument``."""
        b = int_argument("boundary_tokens", boundary_tokens, 1)
        self._check_groups([g.pool for g in groups])
        rows = self.rows_at(b)
        ks, vs = [], []
        for i, g in enumerate(groups):
            if b > g.num_tokens:
                raise InvalidArgument(f"sliding group {i}: boundary {b} is past its "
                                      f"{g.num_tokens} committed tokens")
            bs = g.pool.block_size
            first, last = (b - rows) // bs, (b - 1) // bs
            table = np.asarray(g.block_table, dtype=np.int64).reshape(-1)
            if last >= len(table):
                return None
            ids = table[first:last + 1]
            if (ids < 0).any() or (ids == g.null_block_id).any():
                return None
            start = (b - rows) - first * bs
            k, v = g.pool.gather_layers(ids, (last + 1 - first) * bs)
            ks.append(np.asarray(k)[:, start:start + rows])
            vs.append(np.asarray(v)[:, start:start + rows])
        return (np.ascontiguousarray(np.concatenate(ks)),
                np.ascontiguousarray(np.concatenate(vs)))

    def install(self, targets: Sequence[SlidingGroupTarget], sidecar: RestoredSidecar
                ) -> list[np.ndarray]:
        """Rebuild every sliding group at the sidecar's boundary ``b``: per group, allocate
        blocks for the entries rows ``[b - min(b, window), b)`` cover, write the rows, and
        return its table row (``int32[ceil(b / bs)]``, earlier entries ``null_block_id``;
        each allocated block holds one reference owned by the caller). All or nothing: on
        any failure every block allocated here is freed and the error propagates."""
        self._check_groups([t.pool for t in targets])
        k, v = self.unpack(sidecar)
        b = sidecar.boundary_tokens
        rows = k.shape[1]
        tables: list[np.ndarray] = []
        taken: list[tuple[Any, np.ndarray]] = []
        layer = 0
        try:
            for g, t in enumerate(targets):
                bs = t.pool.block_size
                first, last = (b - rows) // bs, (b - 1) // bs
                n = last + 1 - first
                ids = t.allocator.allocate_many(n)
                if ids is None:
                    raise PoolExhausted(f"sliding group {g}: {n} blocks needed to restore "
                                        f"{rows} window rows at {b} tokens")
                ids = np.asarray(ids, dtype=np.int32)
                taken.append((t.allocator, ids))
                positions = np.arange(b - rows, b, dtype=np.int64) - first * bs
                slots = t.pool.slots_for_positions(ids, positions)
                nl = t.pool.geometry.num_layers
                t.pool.write_tokens_layers(slots, k[layer:layer + nl], v[layer:layer + nl])
                layer += nl
                table = np.full(last + 1, t.null_block_id, dtype=np.int32)
                table[first:] = ids
                tables.append(table)
        except BaseException:
            for allocator, ids in taken:
                allocator.free_many(ids)
            raise
        return tables

    def __repr__(self) -> str:
        return (f"SlidingWindowCodec(window={self.window}, layers={self.num_layers}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, dtype={self.dtype!r})")
