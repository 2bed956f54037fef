"""Sidecar layouts (cold-tier.md §13.1): the geometry of a family's out-of-pool state at a
block-aligned boundary. Policies and capture/restore of sidecars come with the sidecar
issue; the layout, its object codec and its names are here so the store can index, bound,
verify and evict sidecar objects now."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.cold.codec import DTYPE_CODES, header_overhead
from pagedkv.cold.groups import ColdGroup
from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["MAX_DIMS", "MAX_TENSORS_PER_LAYER", "ColdSidecarLayout"]

MAX_TENSORS_PER_LAYER = 16
MAX_DIMS = 8


@dataclass(frozen=True)
class ColdSidecarLayout:
    """``tensor_count = num_layers * tensors_per_layer`` tensors of ``bytes_per_tensor``
    bytes each, layer-major (tensor ``layer * tensors_per_layer + slot``)."""

    group: ColdGroup
    boundary_tokens: int
    num_layers: int
    tensors_per_layer: int
    dtype: str
    dims: tuple[int, ...]
    bytes_per_tensor: int

    def __post_init__(self) -> None:
        if not isinstance(self.group, ColdGroup):
            raise InvalidArgumentType(f"group must be a ColdGroup, got {self.group!r}")
        if self.group is ColdGroup.KV:
            raise InvalidArgument("group = ColdGroup.KV: a sidecar needs a sidecar group")
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))
        checks = (("boundary_tokens", self.boundary_tokens, 1, None),
                  ("num_layers", self.num_layers, 1, None),
                  ("tensors_per_layer", self.tensors_per_layer, 1, MAX_TENSORS_PER_LAYER),
                  ("len(dims)", len(self.dims), 1, MAX_DIMS),
                  ("bytes_per_tensor", self.bytes_per_tensor, 1, None))
        for name, v, lo, hi in checks:
            if int(v) < lo or (hi is not None and int(v) > hi):
                rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise InvalidArgument(f"{name} = {v} is outside {rng}")
        if min(self.dims) <= 0:
            raise InvalidArgument(f"dims = {self.dims}: every dim must be > 0")
        if self.dtype not in DTYPE_CODES:
            raise InvalidArgument(f"dtype = {self.dtype!r}; valid: {sorted(DTYPE_CODES)}")

    @property
    def tensor_count(self) -> int:
        return self.num_layers * self.tensors_per_layer

    @property
    def bound(self) -> int:
        """Largest valid encoded object in bytes (§6.5)."""
        return self.tensor_count * self.bytes_per_tensor + header_overhead(self.tensor_count)

    def matches(self, fields: dict) -> bool:
        """Whether a decoded sidecar's layout fields are exactly this layout."""
        return (fields["boundary_tokens"], fields["num_layers"], fields["tensors_per_layer"],
                fields["dtype"], fields["dims"], fields["bytes_per_tensor"]) == (
            self.boundary_tokens, self.num_layers, self.tensors_per_layer, self.dtype,
            self.dims, self.bytes_per_tensor)
