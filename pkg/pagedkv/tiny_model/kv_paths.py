"""The two KV paths of the reference model: flat (one contiguous array per layer) and paged.

The model talks to both through the same four members, so a parity test runs one forward
pass twice and only the KV storage differs:

* ``num_tokens``: positions whose K/V are stored (or reserved by ``extend``);
* ``extend(tokens)``: reserve positions for new tokens (the paged path records them in the
  adapter, which may allocate blocks);
* ``write(layer, k, v)``: store K/V ``[n, kv_heads, head_dim]`` of the last ``n`` positions;
* ``read(layer) -> (k, v)``: K/V of positions ``[0, num_tokens)`` in position order.

With a KV mode (``kv_dtype`` ``"q8"``, ``"fwht4/q8"``, ``"fwht4/lloyd4"``...; docs/kv-quant.md)
both paths hand the model the *decoded* rows: the paged path stores the records and decodes
them on read, the flat path keeps ``decode(encode(x))``. The CPU codecs are exact, so the two
stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

import numpy as np

from pagedkv.errors import InvalidArgument
from pagedkv.quant import kv as kv_modes
from pagedkv.tiny_model.config import ReferenceConfig
from pagedkv.tiny_model.flat_rows import LayerRows

__all__ = ["FlatKV", "KVPath", "PagedKV"]


class KVPath(Protocol):
    @property
    def num_tokens(self) -> int: ...

    def extend(self, tokens: np.ndarray) -> None: ...

    def write(self, layer: int, k: Any, v: Any) -> None: ...

    def read(self, layer: int) -> tuple[Any, Any]: ...


class FlatKV:
    """One growing contiguous K and V array per layer for one sequence (the baseline path).

    ``backend="numpy"`` keeps ``float32[capacity, kv_heads, head_dim]`` buffers that double
    when full; ``backend="mlx"`` keeps ``mx.array``s extended by concatenation.
    """

    def __init__(self, config: ReferenceConfig, backend: str = "numpy",
                 initial_capacity_tokens: int = 64, kv_dtype: str = "float32") -> None:
        if backend not in ("numpy", "mlx"):
            raise InvalidArgument(f"backend={backend!r}: expected 'numpy' or 'mlx'")
        self._config = config
        self._backend = backend
        # (K mode, V mode) when K/V round-trip a KV mode, else None
        sides = kv_modes.split_kv_dtype(kv_dtype)
        self._modes = sides if sides[0] in kv_modes.KV_MODES else None
        self._num_tokens = 0
        row_shape = (config.num_kv_heads, config.head_dim)
        self._rows = [LayerRows(backend, row_shape, initial_capacity_tokens)
                      for _ in range(config.num_layers)]

    def __repr__(self) -> str:
        return f"FlatKV(backend={self._backend!r}, num_tokens={self._num_tokens})"

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def extend(self, tokens: np.ndarray) -> None:
        self._num_tokens += len(tokens)

    def write(self, layer: int, k, v) -> None:
        if self._modes is not None:  # what a paged pool of this mode hands back on read
            hd = self._config.head_dim
            k, v = (kv_modes.decode(kv_modes.encode(x, m), m, hd)
                    for x, m in zip((k, v), self._modes, strict=True))
        start = self._num_tokens - k.shape[0]
        rows = self._rows[layer]
        if rows.end != start:
            raise InvalidArgument(f"FlatKV layer {layer}: writing at {start}, holds {rows.end}")
        rows.append(k, v)

    def read(self, layer: int):
        return self._rows[layer].rows(0)


class PagedKV:
    """One sequence of a :class:`~pagedkv.adapter.PagedKVCacheAdapter` seen as a KV path.

    ``extend`` is ``record_tokens`` (lazy block allocation), ``write`` is ``write_kv`` into
    the pool's slots (encoding values for a KV-mode pool), ``read`` is ``gather_kv`` over the
    sequence's block table (decoded for a KV-mode pool). ``adaptive``: a
    :class:`~pagedkv.kv_adaptive.KVAdaptive` over the adapter's pool, stepped down before
    each ``extend`` as the context grows.
    """

    def __init__(self, adapter, seq_id: Hashable, *, adaptive=None) -> None:
        self.adapter = adapter
        self.seq_id = seq_id
        self.adaptive = adaptive

    def __repr__(self) -> str:
        return f"PagedKV(seq_id={self.seq_id!r}, num_tokens={self.num_tokens})"

    @property
    def num_tokens(self) -> int:
        return self.adapter.num_tokens(self.seq_id)

    def extend(self, tokens: np.ndarray) -> None:
        if self.adaptive is not None:
            self.adaptive.before_append(self.num_tokens, len(tokens))
        self.adapter.record_tokens(self.seq_id, tokens)

    def write(self, layer: int, k, v) -> None:
        self.adapter.write_kv(self.seq_id, layer, k, v)

    def read(self, layer: int):
        k, v = self.adapter.gather_kv(self.seq_id, layer)
        pool = self.adapter.pool
        return pool.decode_tokens(k, v) if pool.geometry.quantized else (k, v)
