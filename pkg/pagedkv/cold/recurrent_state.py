"""Recurrent-state sidecar codecs: GDN-style (conv + recurrent state) and conv-only
(docs/cold.md, "GDN-style recurrent sidecar").

Per recurrent layer one tensor (``tensors_per_layer = 1``): the conv state ``[K-1,
conv_dim]`` bytes followed, for GDN, by the recurrent state ``[Hv, Dv, Dk]`` bytes;
``dims = [K-1, conv_dim, Hv, Dv, Dk]`` gives the decoder the split point. The element dtype
is the pool's and round-trips bit-exactly (bfloat16 as uint16 bit patterns). The policy is
unscaled: a recurrent state summarizes every preceding token, so it is valid only at the
exact boundary it was produced at.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pagedkv.argument_checks import int_argument, items_argument
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.policy import ColdSidecarPolicy
from pagedkv.cold.sidecar import ColdSidecarLayout, RestoredSidecar, storage_dtype
from pagedkv.cold.stats import record_sidecar_installed
from pagedkv.errors import InvalidArgument, InvalidArgumentType, SidecarLayoutMismatch

__all__ = ["RecurrentStateCodec", "conv_state_codec", "gdn_state_codec"]


@dataclass(frozen=True)
class RecurrentStateCodec:
    """Packs per-layer recurrent state into a sidecar payload and back.

    ``parts``: the per-layer shape of each state tensor, in payload order (GDN: the conv
    state, then the recurrent state). A state handed to :meth:`pack` is one array per part,
    each ``[num_layers, *shape]`` (a batch axis of 1 after the layer axis is accepted), or
    a sequence of ``num_layers`` per-layer arrays; its dtype must be the codec's storage
    dtype exactly (bfloat16: ``uint16`` bit patterns).
    """

    group: ColdGroup
    num_layers: int
    parts: tuple[tuple[int, ...], ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.group not in (ColdGroup.GDN_STATE, ColdGroup.CONV_STATE):
            raise InvalidArgument(f"group = {self.group!r}: a recurrent state codec is for "
                                  "GDN_STATE or CONV_STATE")
        int_argument("num_layers", self.num_layers, 1)
        parts = tuple(tuple(int_argument("part dim", d, 1) for d in items_argument("part", p))
                      for p in items_argument("parts", self.parts))
        if not parts:
            raise InvalidArgument("parts must name at least one state tensor shape")
        object.__setattr__(self, "parts", parts)
        storage_dtype(self.dtype)
        self.policy  # noqa: B018 - builds the template: a ColdSidecarLayout raises on bad geometry

    def _layout(self, boundary_tokens: int) -> ColdSidecarLayout:
        return ColdSidecarLayout(self.group, boundary_tokens, self.num_layers, 1, self.dtype,
                                 tuple(d for p in self.parts for d in p),
                                 self.bytes_per_layer)

    @property
    def itemsize(self) -> int:
        return storage_dtype(self.dtype).itemsize

    @property
    def part_bytes(self) -> tuple[int, ...]:
        """Bytes of each part of one layer."""
        return tuple(math.prod(p) * self.itemsize for p in self.parts)

    @property
    def bytes_per_layer(self) -> int:
        return sum(self.part_bytes)

    @property
    def bytes_per_checkpoint(self) -> int:
        """Payload bytes of one checkpoint (every layer)."""
        return self.num_layers * self.bytes_per_layer

    @cached_property
    def policy(self) -> ColdSidecarPolicy:
        """Unscaled: only ``boundary_tokens`` follows the boundary."""
        return ColdSidecarPolicy.unscaled(self._layout(1))

    def layout_at(self, boundary_tokens: int) -> ColdSidecarLayout:
        """The layout a checkpoint at ``boundary_tokens`` (> 0) is written with."""
        layout = self.policy.expected_at(boundary_tokens)
        if layout is None:
            raise InvalidArgument("boundary_tokens = 0: a checkpoint needs a positive boundary")
        return layout

    # --- pack / unpack ---------------------------------------------------------------------

    def _part_layers(self, k: int, value) -> list[np.ndarray] | np.ndarray:
        """Part ``k`` of a state as a ``[num_layers, *shape]`` array or a list of per-layer
        arrays, after the dtype/shape checks (``SidecarLayoutMismatch``)."""
        shape, want = self.parts[k], storage_dtype(self.dtype)
        what = f"state part {k} ({self.group.label}, {self.dtype}, per-layer {list(shape)})"
        if isinstance(value, np.ndarray):
            arr = value
            if arr.ndim == len(shape) + 2 and arr.shape[1] == 1:
                arr = arr.reshape((arr.shape[0],) + arr.shape[2:])
            if arr.dtype != want:
                raise SidecarLayoutMismatch(f"{what}: dtype {arr.dtype}, the layout needs "
                                            f"{want} (never relabelled)")
            if arr.shape != (self.num_layers, *shape):
                raise SidecarLayoutMismatch(f"{what}: shape {arr.shape}, the layout needs "
                                            f"{(self.num_layers, *shape)}")
            return arr
        if not isinstance(value, Sequence) or len(value) != self.num_layers:
            raise SidecarLayoutMismatch(f"{what}: expected a [{self.num_layers}, ...] array "
                                        f"or {self.num_layers} per-layer arrays")
        layers = []
        for i, a in enumerate(value):
            a = np.asarray(a)
            if a.ndim == len(shape) + 1 and a.shape[0] == 1:
                a = a.reshape(a.shape[1:])
            if a.dtype != want or a.shape != shape:
                raise SidecarLayoutMismatch(f"{what}, layer {i}: {a.dtype}{a.shape}, the "
                                            f"layout needs {want}{shape}")
            layers.append(a)
        return layers

    def _state_parts(self, state) -> list:
        if len(self.parts) == 1 and isinstance(state, np.ndarray):
            state = (state,)
        if not isinstance(state, (tuple, list)) or len(state) != len(self.parts):
            raise SidecarLayoutMismatch(f"state must hold {len(self.parts)} part(s) "
                                        f"({self.group.label}), got {type(state).__name__}")
        return [self._part_layers(k, v) for k, v in enumerate(state)]

    def pack(self, state, boundary_tokens: int, out: np.ndarray | None = None
             ) -> tuple[ColdSidecarLayout, np.ndarray]:
        """``(layout, payload)``: the state at ``boundary_tokens`` as ``uint8[num_layers,
        bytes_per_layer]``, written into ``out`` when given (one copy of every byte).
        ``SidecarLayoutMismatch`` (nothing written) when a part's dtype or shape differs."""
        layout = self.layout_at(boundary_tokens)
        parts = self._state_parts(state)
        shape = (self.num_layers, self.bytes_per_layer)
        if out is None:
            out = np.empty(shape, np.uint8)
        elif out.dtype != np.uint8 or out.shape != shape or not out.flags.c_contiguous:
            raise InvalidArgument(f"out must be a C-contiguous uint8{shape} array, got "
                                  f"{out.dtype}{out.shape}")
        start = 0
        for part, nbytes in zip(parts, self.part_bytes, strict=True):
            dst = out[:, start:start + nbytes]
            if isinstance(part, np.ndarray):
                # One strided copy per part: the destination rows are this part's columns.
                dst.view(part.dtype)[...] = part.reshape(self.num_layers, -1)
            else:
                for i, a in enumerate(part):
                    dst[i].view(a.dtype)[...] = a.reshape(-1)
            start += nbytes
        return layout, out

    def unpack(self, sidecar: RestoredSidecar) -> tuple[np.ndarray, ...]:
        """Views of the payload, one ``[num_layers, *shape]`` array per part, in the storage
        dtype. ``SidecarLayoutMismatch`` when the sidecar is not this codec's layout."""
        if not isinstance(sidecar, RestoredSidecar):
            raise InvalidArgumentType(
                f"sidecar must be a RestoredSidecar, got {type(sidecar).__name__}")
        want = self.policy.expected_at(sidecar.boundary_tokens)
        if sidecar.layout != want or sidecar.payload.shape != (self.num_layers,
                                                                self.bytes_per_layer):
            raise SidecarLayoutMismatch(f"sidecar layout {sidecar.layout!r} is not this "
                                        f"codec's layout at {sidecar.boundary_tokens}: {want!r}")
        dt = storage_dtype(self.dtype)
        out, start = [], 0
        for shape, nbytes in zip(self.parts, self.part_bytes, strict=True):
            cols = sidecar.payload[:, start:start + nbytes]
            out.append(np.ascontiguousarray(cols).view(dt).reshape((self.num_layers, *shape)))
            start += nbytes
        return tuple(out)

    def install(self, sidecar: RestoredSidecar, *targets: np.ndarray) -> None:
        """Copy a restored sidecar into the family's state arrays (one
        ``[num_layers, *shape]`` array per part, storage dtype) and count ``installed``.
        Every target is checked before anything is written."""
        parts = self.unpack(sidecar)
        if len(targets) != len(parts):
            raise SidecarLayoutMismatch(f"install needs {len(parts)} target array(s), got "
                                        f"{len(targets)}")
        for k, (t, p) in enumerate(zip(targets, parts, strict=True)):
            if not isinstance(t, np.ndarray) or t.dtype != p.dtype or t.shape != p.shape:
                got = f"{t.dtype}{t.shape}" if isinstance(t, np.ndarray) else type(t).__name__
                raise SidecarLayoutMismatch(f"install target {k}: {got}, the sidecar holds "
                                            f"{p.dtype}{p.shape}")
            if not t.flags.writeable:
                raise InvalidArgument(f"install target {k} is read-only")
        for t, p in zip(targets, parts, strict=True):
            t[...] = p
        record_sidecar_installed()

    def __repr__(self) -> str:
        return (f"RecurrentStateCodec({self.group!r}, layers={self.num_layers}, "
                f"parts={list(self.parts)}, dtype={self.dtype!r}, "
                f"bytes_per_checkpoint={self.bytes_per_checkpoint})")


def gdn_state_codec(num_layers: int, *, conv_kernel: int, conv_dim: int, num_v_heads: int,
                    v_head_dim: int, k_head_dim: int, dtype: str = "bfloat16"
                    ) -> RecurrentStateCodec:
    """GDN-style sidecar of ``num_layers`` linear-attention layers: conv state
    ``[conv_kernel - 1, conv_dim]`` and recurrent state ``[num_v_heads, v_head_dim,
    k_head_dim]`` per layer. 48 layers, conv ``[3, 10240]``, recurrent ``[48, 128, 128]``,
    bf16: 1,634,304 bytes per layer, 78,446,592 per checkpoint."""
    k = int_argument("conv_kernel", conv_kernel, 1)
    if k < 2:
        raise InvalidArgument(f"conv_kernel = {k}: a conv state needs a kernel of >= 2 taps")
    return RecurrentStateCodec(ColdGroup.GDN_STATE, num_layers,
                               ((k - 1, conv_dim), (num_v_heads, v_head_dim, k_head_dim)),
                               dtype)


def conv_state_codec(num_layers: int, *, conv_kernel: int, conv_dim: int,
                     dtype: str = "bfloat16") -> RecurrentStateCodec:
    """Conv-only sidecar (short-conv families): ``[conv_kernel - 1, conv_dim]`` per layer."""
    k = int_argument("conv_kernel", conv_kernel, 1)
    if k < 2:
        raise InvalidArgument(f"conv_kernel = {k}: a conv state needs a kernel of >= 2 taps")
    return RecurrentStateCodec(ColdGroup.CONV_STATE, num_layers, ((k - 1, conv_dim),), dtype)
