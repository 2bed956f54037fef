"""The hybrid model's KV path interface and its flat (non-paged) implementation.

A hybrid KV path stores, for one sequence, what each layer kind needs:

* full-attention layers: K/V of every position;
* sliding-window layers: K/V of the last ``sliding_window`` positions (plus the chunk being
  computed);
* gated-delta-net layers: the conv state and the recurrent state after the last token;
* KV-shared aliases: nothing; reads resolve to the anchor, writes are refused.

The model talks to it through the members of :class:`HybridKVPath`, so the flat path here
and the paged path over the grouped coordinator run the same forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.tiny_model.flat_rows import LayerRows
from pagedkv.tiny_model.hybrid_config import LINEAR_ATTENTION, SLIDING_ATTENTION, HybridConfig
from pagedkv.tiny_model.hybrid_state import HybridSnapshot, check_rows

__all__ = ["HybridFlatKV", "HybridKVPath", "LinearStateHolder"]


class HybridKVPath(Protocol):
    """What the hybrid forward pass needs from a KV store (layer indices are model layers).

    * ``num_tokens`` / ``extend(tokens)``: as :class:`~pagedkv.tiny_model.kv_paths.KVPath`.
    * ``write(layer, k, v)``: K/V ``[n, kv_heads, head_dim]`` of the last ``n`` positions of a
      full or sliding layer that owns its K/V (never an alias, never a linear layer).
    * ``read(layer, first)``: K/V of positions ``[first, num_tokens)`` in position order,
      ``[tokens, kv_heads, head_dim]``; an alias reads its anchor. The model asks a sliding
      layer only for positions it can still attend.
    * ``linear_state(layer)`` / ``set_linear_state(layer, conv, recurrent)``: a gated-delta-net
      layer's state after the last token (zeros before the first).
    """

    @property
    def num_tokens(self) -> int: ...

    def extend(self, tokens: np.ndarray) -> None: ...

    def write(self, layer: int, k: Any, v: Any) -> None: ...

    def read(self, layer: int, first: int = 0) -> tuple[Any, Any]: ...

    def linear_state(self, layer: int) -> tuple[Any, Any]: ...

    def set_linear_state(self, layer: int, conv_state: Any, recurrent_state: Any) -> None: ...


class LinearStateHolder:
    """The gated-delta-net layers' states of one sequence, for a hybrid KV path (set
    ``config`` and ``_backend``, then call :meth:`_zero_linear_states`): ``float32`` zeros
    before the first token, ``mx.array`` on the MLX backend."""

    config: HybridConfig
    _backend: str
    _states: dict[int, tuple[Any, Any]]

    def _to_backend(self, a: np.ndarray) -> Any:
        if self._backend == "mlx":
            import mlx.core as mx
            return mx.array(a)
        return a

    def _zero_linear_states(self) -> None:
        c = self.config
        self._states = {layer: (self._to_backend(np.zeros(c.conv_state_shape, np.float32)),
                                self._to_backend(np.zeros(c.recurrent_state_shape,
                                                          np.float32)))
                        for layer in c.linear_attention_layers}

    def linear_state(self, layer: int) -> tuple[Any, Any]:
        state = self._states.get(layer)
        if state is None:
            raise InvalidArgument(self._not_linear(layer))
        return state

    def set_linear_state(self, layer: int, conv_state: Any, recurrent_state: Any) -> None:
        if layer not in self._states:
            raise InvalidArgument(self._not_linear(layer))
        self._states[layer] = conv_state, recurrent_state

    def _install_linear_state(self, layer: int, conv: np.ndarray, recurrent: np.ndarray
                              ) -> None:
        """Copies (the source stays read-only and reusable)."""
        self._states[layer] = (self._to_backend(np.array(conv)),
                               self._to_backend(np.array(recurrent)))

    def _linear_arrays(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        linear = self.config.linear_attention_layers
        return ([np.asarray(self._states[i][0]) for i in linear],
                [np.asarray(self._states[i][1]) for i in linear])

    def _not_linear(self, layer: int) -> str:
        kinds = self.config.layer_types
        kind = kinds[layer] if 0 <= layer < len(kinds) else "missing"
        return f"layer {layer} ({kind}) has no recurrent state: it is not {LINEAR_ATTENTION}"


class HybridFlatKV(LinearStateHolder):
    """One sequence of the hybrid model on contiguous arrays (the baseline for parity).

    ``backend="numpy"`` or ``"mlx"`` (the K/V and states are then ``mx.array``s). A sliding
    layer forgets positions older than ``sliding_window`` before the chunk being written, so
    it holds at most ``sliding_window + chunk`` rows.
    """

    def __init__(self, config: HybridConfig, backend: str = "numpy",
                 initial_capacity_tokens: int = 64) -> None:
        if not isinstance(config, HybridConfig):
            raise InvalidArgumentType(
                f"HybridFlatKV needs a HybridConfig, got {type(config).__name__}; a plain "
                "ReferenceConfig uses FlatKV")
        if backend not in ("numpy", "mlx"):
            raise InvalidArgument(f"backend={backend!r}: expected 'numpy' or 'mlx'")
        self.config = config
        self._backend = backend
        self._num_tokens = 0
        row_shape = (config.num_kv_heads, config.head_dim)
        self._rows = {layer: LayerRows(backend, row_shape, initial_capacity_tokens)
                      for layer in config.physical_full_layers + config.physical_sliding_layers}
        self._zero_linear_states()

    def __repr__(self) -> str:
        return f"HybridFlatKV(backend={self._backend!r}, num_tokens={self._num_tokens})"

    # --- HybridKVPath ------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def extend(self, tokens: np.ndarray) -> None:
        self._num_tokens += len(tokens)

    def write(self, layer: int, k: Any, v: Any) -> None:
        rows = self._rows.get(layer)
        if rows is None:
            raise InvalidArgument(self._not_physical(layer, "write K/V to"))
        start = self._num_tokens - k.shape[0]
        if rows.end != start:
            raise InvalidArgument(
                f"HybridFlatKV layer {layer}: writing at {start}, holds up to {rows.end}")
        if self.config.layer_types[layer] == SLIDING_ATTENTION:
            # Keep W rows before the chunk: the chunk's first token needs W - 1 of them, and
            # a snapshot at the chunk's end carries the last min(b, W).
            rows.forget_before(start - self.config.sliding_window)
        rows.append(k, v)

    def read(self, layer: int, first: int = 0) -> tuple[Any, Any]:
        rows = self._rows.get(self.config.physical_kv_layer(layer))
        if rows is None:
            raise InvalidArgument(self._not_physical(layer, "read K/V from"))
        return rows.rows(first)

    def _not_physical(self, layer: int, what: str) -> str:
        kinds = self.config.layer_types
        if not 0 <= layer < len(kinds):
            return f"layer {layer} is outside [0, {len(kinds)})"
        anchor = self.config.kv_anchor(layer)
        if anchor is not None:
            return (f"cannot {what} layer {layer}: it is a KV-shared alias of layer {anchor} "
                    "and owns no K/V (the model writes the anchor only)")
        return f"cannot {what} layer {layer}: it is a {kinds[layer]} layer, not attention"

    # --- snapshots ---------------------------------------------------------------------------

    def held_positions(self, layer: int) -> tuple[int, int]:
        """``(first, end)``: the positions whose K/V an attention layer holds now."""
        rows = self._rows.get(self.config.physical_kv_layer(layer))
        if rows is None:
            raise InvalidArgument(self._not_physical(layer, "inspect"))
        return rows.first, rows.end

    def snapshot(self) -> HybridSnapshot:
        """The out-of-pool state at ``num_tokens`` (every layer written up to it)."""
        c = self.config
        b = self._num_tokens
        for layer, rows in self._rows.items():
            if rows.end != b:
                raise InvalidArgument(
                    f"snapshot at {b} tokens, but layer {layer} holds K/V up to {rows.end}: "
                    "take snapshots between forward calls")
        first = b - min(b, c.sliding_window)
        keys, values = [], []
        for layer in c.physical_sliding_layers:
            k, v = self._rows[layer].rows(first)
            keys.append(np.asarray(k).transpose(1, 0, 2))
            values.append(np.asarray(v).transpose(1, 0, 2))
        return HybridSnapshot.build(c, b, *self._linear_arrays(), keys, values)

    @classmethod
    def from_snapshot(cls, config: HybridConfig, snapshot: HybridSnapshot,
                      full_kv: Mapping[int, tuple[Any, Any]], backend: str = "numpy"
                      ) -> HybridFlatKV:
        """A path at ``snapshot.boundary_tokens = b`` from the snapshot plus, for every
        physical full layer, K and V of positions ``[0, b)`` as ``float32[b, kv_heads,
        head_dim]`` (the pool's blocks). The next forward call continues at position ``b``."""
        if not isinstance(snapshot, HybridSnapshot):
            raise InvalidArgumentType(
                f"snapshot must be a HybridSnapshot, got {type(snapshot).__name__}")
        snapshot.check(config)
        b = snapshot.boundary_tokens
        layers = config.physical_full_layers
        if sorted(full_kv) != sorted(layers):
            raise InvalidArgument(
                f"full_kv covers layers {sorted(full_kv)}; expected the physical full "
                f"layers {list(layers)}")
        shape = (b, config.num_kv_heads, config.head_dim)
        full = {layer: (check_rows(f"full_kv[{layer}] K", full_kv[layer][0], shape),
                        check_rows(f"full_kv[{layer}] V", full_kv[layer][1], shape))
                for layer in layers}
        kv = cls(config, backend, initial_capacity_tokens=max(64, b))
        kv._num_tokens = b
        for layer, (k, v) in full.items():
            kv._rows[layer].append(kv._to_backend(k), kv._to_backend(v))
        first = b - min(b, config.sliding_window)
        for layer, k, v in zip(config.physical_sliding_layers, snapshot.sliding_keys,
                               snapshot.sliding_values, strict=True):
            rows = kv._rows[layer]
            rows.start_at(first)
            rows.append(kv._to_backend(np.ascontiguousarray(k.transpose(1, 0, 2))),
                        kv._to_backend(np.ascontiguousarray(v.transpose(1, 0, 2))))
        for layer, conv, recurrent in zip(config.linear_attention_layers, snapshot.conv_states,
                                          snapshot.recurrent_states, strict=True):
            kv._install_linear_state(layer, conv, recurrent)
        return kv

