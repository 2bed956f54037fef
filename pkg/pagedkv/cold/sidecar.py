"""Sidecar layouts (docs/cold.md, "Sidecars"): the geometry of a family's out-of-pool state
at a block-aligned boundary, and a restored sidecar (its verified layout and payload).
Policies are in ``policy.py``, the state codecs in ``recurrent_state.py`` and
``sliding_window.py``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.cold.codec import DTYPE_CODES, header_overhead
from pagedkv.cold.groups import ColdGroup
from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["DTYPE_STORAGE", "MAX_DIMS", "MAX_TENSORS_PER_LAYER", "ColdSidecarLayout",
           "RestoredSidecar", "storage_dtype"]

MAX_TENSORS_PER_LAYER = 16
MAX_DIMS = 8

#: NumPy dtype a sidecar element travels as (bfloat16 as uint16 bit patterns).
DTYPE_STORAGE: dict[str, np.dtype] = {"float16": np.dtype(np.float16),
                                       "bfloat16": np.dtype(np.uint16),
                                       "float32": np.dtype(np.float32)}


def storage_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype of one element of a ``dtype`` sidecar (``q8`` has none)."""
    try:
        return DTYPE_STORAGE[dtype]
    except KeyError:
        raise InvalidArgument(f"dtype = {dtype!r} has no element type for sidecar state; "
                              f"valid: {sorted(DTYPE_STORAGE)}") from None


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
        # Counts are written into the object's metadata as they are: a float 16.0 would be
        # stored as "16.0", which no later load accepts.
        if not isinstance(self.dims, (tuple, list)) or not all(is_int(d) for d in self.dims):
            raise InvalidArgumentType(f"dims must be a tuple of ints, got {self.dims!r}")
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))
        checks = (("boundary_tokens", self.boundary_tokens, 1, None),
                  ("num_layers", self.num_layers, 1, None),
                  ("tensors_per_layer", self.tensors_per_layer, 1, MAX_TENSORS_PER_LAYER),
                  ("len(dims)", len(self.dims), 1, MAX_DIMS),
                  ("bytes_per_tensor", self.bytes_per_tensor, 1, None))
        for name, v, lo, hi in checks:
            if not is_int(v):
                raise InvalidArgumentType(f"{name} must be an int, got {v!r}")
            if int(v) < lo or (hi is not None and int(v) > hi):
                rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise InvalidArgument(f"{name} = {v} is outside {rng}")
        for name in ("boundary_tokens", "num_layers", "tensors_per_layer", "bytes_per_tensor"):
            object.__setattr__(self, name, int(getattr(self, name)))
        if min(self.dims) <= 0:
            raise InvalidArgument(f"dims = {self.dims}: every dim must be > 0")
        if not isinstance(self.dtype, str):
            raise InvalidArgumentType(f"dtype must be a str, got {self.dtype!r}")
        if self.dtype not in DTYPE_CODES:
            raise InvalidArgument(f"dtype = {self.dtype!r}; valid: {sorted(DTYPE_CODES)}")

    @property
    def tensor_count(self) -> int:
        return self.num_layers * self.tensors_per_layer

    @property
    def bound(self) -> int:
        """Largest valid encoded object in bytes (docs/contracts/cold-tier.md, '6.5 Size
        bounds')."""
        return self.tensor_count * self.bytes_per_tensor + header_overhead(self.tensor_count)

    def matches(self, fields: dict) -> bool:
        """Whether a decoded sidecar's layout fields are exactly this layout."""
        return (fields["boundary_tokens"], fields["num_layers"], fields["tensors_per_layer"],
                fields["dtype"], fields["dims"], fields["bytes_per_tensor"]) == (
            self.boundary_tokens, self.num_layers, self.tensors_per_layer, self.dtype,
            self.dims, self.bytes_per_tensor)


@dataclass(frozen=True, eq=False)
class RestoredSidecar:
    """A sidecar the restore walk loaded and verified: valid for exactly
    ``boundary_tokens`` tokens (what ``take_restored_sidecar`` hands to the family).

    ``payload``: ``uint8[tensor_count, bytes_per_tensor]``, owned (not shared with any
    buffer the tier reuses). Decode it with the family's codec (``unpack``/``install``).
    """

    layout: ColdSidecarLayout
    payload: np.ndarray
    key: bytes

    @property
    def boundary_tokens(self) -> int:
        return self.layout.boundary_tokens

    @property
    def group(self) -> ColdGroup:
        return self.layout.group

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)

    def __repr__(self) -> str:
        return (f"RestoredSidecar({self.layout.group!r}, boundary_tokens="
                f"{self.boundary_tokens}, nbytes={self.nbytes}, key={self.key.hex()[:16]}...)")
