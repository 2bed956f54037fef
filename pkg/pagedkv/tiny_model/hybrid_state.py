"""What a hybrid sequence keeps outside the paged pool at a token boundary: a snapshot.

At boundary ``b`` (the sequence holds positions ``[0, b)``) the snapshot carries exactly what
a sidecar carries (docs/tiny-model.md, "Snapshots"):

* per gated-delta-net layer (``config.linear_attention_layers`` order): the conv state
  ``float32[K - 1, conv_dim]`` and the recurrent state ``float32[Hv, Dv, Dk]``;
* per physical sliding layer (``config.physical_sliding_layers`` order, no aliases): K and V
  of positions ``[b - min(b, W), b)``, heads-major ``float32[kv_heads, min(b, W), head_dim]``
  (the sliding sidecar's ``[1, kv_heads, rows, head_dim]`` without its batch axis).

The full-attention K/V of ``[0, b)`` are not in it: they are the pool's blocks (hot, or
restored from the cold tier). Together they resume the sequence at ``b`` with logits
bit-identical to running straight through.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.tiny_model.hybrid_config import HybridConfig

__all__ = ["HybridSnapshot", "check_rows"]


def check_rows(what: str, array: object, shape: tuple[int, ...]) -> np.ndarray:
    """``array`` as a float32 ndarray of exactly ``shape``; a specific error otherwise."""
    a = np.asarray(array)
    if a.dtype != np.float32:
        raise InvalidArgumentType(f"{what}: expected float32, got {a.dtype}")
    if a.shape != shape:
        raise InvalidArgument(f"{what}: expected shape {shape}, got {a.shape}")
    return a


def _frozen_copy(a: np.ndarray) -> np.ndarray:
    a = np.array(a, dtype=np.float32, copy=True, order="C")
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class HybridSnapshot:
    """Out-of-pool state of one sequence at ``boundary_tokens`` (read-only float32 copies).

    Build one with :meth:`HybridFlatKV.snapshot`, resume with
    :meth:`HybridFlatKV.from_snapshot`. ``==`` compares every byte.
    """

    boundary_tokens: int
    conv_states: tuple[np.ndarray, ...]
    recurrent_states: tuple[np.ndarray, ...]
    sliding_keys: tuple[np.ndarray, ...]
    sliding_values: tuple[np.ndarray, ...]

    @classmethod
    def build(cls, config: HybridConfig, boundary_tokens: int, conv_states, recurrent_states,
              sliding_keys, sliding_values) -> HybridSnapshot:
        """A validated snapshot holding copies of the given arrays (NumPy, or anything
        ``numpy.asarray`` takes, such as ``mx.array``)."""
        if not isinstance(boundary_tokens, (int, np.integer)) or isinstance(boundary_tokens,
                                                                             bool):
            raise InvalidArgumentType(
                f"boundary_tokens must be an int, got {type(boundary_tokens).__name__}")
        b = int(boundary_tokens)
        if not 0 <= b <= config.max_position:
            raise InvalidArgument(
                f"boundary_tokens = {b}: must be in [0, max_position={config.max_position}]")
        rows = min(b, config.sliding_window)
        window_shape = (config.num_kv_heads, rows, config.head_dim)
        parts = (("conv_states", conv_states, config.linear_attention_layers,
                  config.conv_state_shape),
                 ("recurrent_states", recurrent_states, config.linear_attention_layers,
                  config.recurrent_state_shape),
                 ("sliding_keys", sliding_keys, config.physical_sliding_layers, window_shape),
                 ("sliding_values", sliding_values, config.physical_sliding_layers,
                  window_shape))
        checked = []
        for name, arrays, layers, shape in parts:
            arrays = tuple(arrays)
            if len(arrays) != len(layers):
                raise InvalidArgument(
                    f"{name}: {len(arrays)} arrays for the {len(layers)} layers {layers}")
            checked.append(tuple(
                _frozen_copy(check_rows(f"{name}[{i}] (layer {layer})", a, shape))
                for i, (a, layer) in enumerate(zip(arrays, layers, strict=True))))
        return cls(b, *checked)

    def check(self, config: HybridConfig) -> None:
        """Raise unless this snapshot fits ``config`` (layer counts, shapes, dtypes)."""
        HybridSnapshot.build(config, self.boundary_tokens, self.conv_states,
                             self.recurrent_states, self.sliding_keys, self.sliding_values)

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (*self.conv_states, *self.recurrent_states, *self.sliding_keys,
                *self.sliding_values)

    @property
    def nbytes(self) -> int:
        """Bytes of state carried (what a sidecar's payload holds, headers aside)."""
        return sum(a.nbytes for a in self._arrays())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HybridSnapshot):
            return NotImplemented
        mine, theirs = self._arrays(), other._arrays()
        return (self.boundary_tokens == other.boundary_tokens
                and (len(self.conv_states), len(self.sliding_keys))
                == (len(other.conv_states), len(other.sliding_keys))
                and all(a.shape == b.shape and a.tobytes() == b.tobytes()
                        for a, b in zip(mine, theirs, strict=True)))

    __hash__ = None  # type: ignore[assignment]  # holds arrays

    def __repr__(self) -> str:
        rows = self.sliding_keys[0].shape[1] if self.sliding_keys else 0
        return (f"HybridSnapshot(boundary_tokens={self.boundary_tokens}, "
                f"linear_layers={len(self.conv_states)}, "
                f"sliding_layers={len(self.sliding_keys)} x {rows} rows, "
                f"nbytes={self.nbytes:,})")
