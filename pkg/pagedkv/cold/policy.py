"""Sidecar policies: the layout a sidecar must have at each boundary (docs/cold.md,
"Sidecar policies").

A policy is a geometry template plus a rule for :meth:`ColdSidecarPolicy.expected_at`.
Restore asks it which layout a sidecar at ``b`` tokens must decode to — anything else is a
miss, never a reinterpretation — and capture builds its layout from the same rule, so the
two sides agree by construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedkv.argument_checks import int_argument, is_int
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.sidecar import ColdSidecarLayout
from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["ColdSidecarPolicy"]


@dataclass(frozen=True)
class ColdSidecarPolicy:
    """``template``: the layout's fixed fields (its ``boundary_tokens`` is ignored).
    ``axis``: the dims axis that follows the boundary (``None``: unscaled).

    * :meth:`unscaled` — state that summarizes every preceding token (recurrent, conv):
      ``expected_at(b)`` sets only ``boundary_tokens``; valid only at the exact boundary it
      was produced at.
    * :meth:`boundary_scaled` — windowed state: ``expected_at(b)`` also sets
      ``dims[axis] = min(b, extent)`` and scales ``bytes_per_tensor`` to match (the identity
      at ``b >= extent``). The axis describes the payload's shape; it never decides whether
      a boundary may be used.
    """

    template: ColdSidecarLayout
    axis: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.template, ColdSidecarLayout):
            raise InvalidArgumentType(
                f"template must be a ColdSidecarLayout, got {type(self.template).__name__}")
        if self.axis is None:
            return
        axis = self.axis
        if not is_int(axis):
            raise InvalidArgumentType(f"axis must be an int, got {type(axis).__name__}")
        dims = self.template.dims
        if not 0 <= axis < len(dims):
            raise InvalidArgument(f"axis = {axis} is outside the template's {len(dims)} dims "
                                  f"{dims}")
        extent = dims[axis]
        if extent <= 0 or self.template.bytes_per_tensor % extent:
            raise InvalidArgument(
                f"bytes_per_tensor = {self.template.bytes_per_tensor} is not divisible by "
                f"dims[{axis}] = {extent}: the scaled axis must split the tensor evenly")
        object.__setattr__(self, "axis", int(axis))

    @classmethod
    def unscaled(cls, template: ColdSidecarLayout) -> ColdSidecarPolicy:
        return cls(template, None)

    @classmethod
    def boundary_scaled(cls, template: ColdSidecarLayout, axis: int) -> ColdSidecarPolicy:
        """``ValueError`` unless ``axis < len(dims)``, ``dims[axis] > 0`` and
        ``bytes_per_tensor % dims[axis] == 0``."""
        return cls(template, axis)

    @property
    def group(self) -> ColdGroup:
        return self.template.group

    @property
    def extent(self) -> int | None:
        """The template's size along the scaled axis (tokens), ``None`` when unscaled."""
        return None if self.axis is None else self.template.dims[self.axis]

    def scaled_extent(self, boundary_tokens: int) -> int | None:
        """``min(b, extent)``: rows a payload at ``b`` holds along the scaled axis (0 at
        ``b == 0``), or ``None`` when unscaled."""
        b = int_argument("boundary_tokens", boundary_tokens)
        return None if self.axis is None else min(b, self.template.dims[self.axis])

    def expected_at(self, boundary_tokens: int) -> ColdSidecarLayout | None:
        """The exact layout of a sidecar at ``boundary_tokens``; ``None`` at 0, where the
        payload would be empty and nothing matches."""
        b = int_argument("boundary_tokens", boundary_tokens)
        if b == 0:
            return None
        t = self.template
        if self.axis is None:
            return dataclasses.replace(t, boundary_tokens=b)
        extent = t.dims[self.axis]
        rows = min(b, extent)
        dims = t.dims[:self.axis] + (rows,) + t.dims[self.axis + 1:]
        return dataclasses.replace(t, boundary_tokens=b, dims=dims,
                                   bytes_per_tensor=t.bytes_per_tensor // extent * rows)

    def allows(self, layout: ColdSidecarLayout) -> bool:
        """Whether ``layout`` is exactly what this policy expects at its boundary."""
        return layout == self.expected_at(layout.boundary_tokens)

    def __repr__(self) -> str:
        rule = "unscaled" if self.axis is None else f"boundary_scaled(axis={self.axis})"
        t = self.template
        return (f"ColdSidecarPolicy.{rule}({t.group!r}, layers={t.num_layers}, "
                f"tensors_per_layer={t.tensors_per_layer}, dtype={t.dtype!r}, dims={t.dims}, "
                f"bytes_per_tensor={t.bytes_per_tensor})")
