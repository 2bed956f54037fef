"""K/V scatter and gather for one row of one group (docs/adapter.md, "Lifecycle":
``write_kv``, ``gather_kv`` and their all-layers forms).

The per-layer calls run once per layer per sequence per decode step, so each first offers
its arguments to the pool's C fast path (exact-kind arrays, checked there), and only a
declined call is validated here, raising the same errors whichever path ran.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from pagedkv.adapter.arguments import as_count
from pagedkv.adapter.group_blocks import GroupBlocks
from pagedkv.argument_checks import is_int
from pagedkv.errors import InvalidArgument

__all__ = ["check_layers_shape", "gather_layers", "gather_positions", "write_layers",
           "write_positions"]


def check_layer(group: GroupBlocks, layer) -> int:
    if not is_int(layer) \
            or not 0 <= layer < group.num_layers:
        raise InvalidArgument(
            f"layer = {layer!r} is outside [0, {group.num_layers}) physical layers")
    return int(layer)


def token_count(group: GroupBlocks, name: str, x, n: int | None) -> int:
    """Tokens in ``x`` (``[n, kv_heads, head_dim]``); the pool validates the rest of the shape
    and the dtype before it writes anything."""
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 3 or (n is not None and shape[0] != n):
        want = ("n" if n is None else str(n)) + ", " + ", ".join(map(str, group.token_shape))
        raise InvalidArgument(f"{name} has shape {list(shape)}, expected [{want}] "
                              "(tokens, kv_heads, head_dim)")
    return shape[0]


def write_positions(group: GroupBlocks, row: int, seq_id: Hashable, have: int, layer, k, v,
                    start, generation: int | None) -> None:
    """Scatter ``k``, ``v`` (``[n, kv_heads, head_dim]``) of positions ``[start, start + n)``
    (``start`` defaults to ``have - n``) into physical layer ``layer`` of the row's blocks."""
    live = group.first_live_position(row)
    if type(k) is np.ndarray and k.ndim == 3:
        n = k.shape[0]
        first = have - n if start is None else start
        if type(first) is int and live <= first and first + n <= have and n and \
                group.shared_block(row, first, n) < 0 and \
                group.pool.try_write_positions(layer, group.table[row], first, k, v,
                                               generation=generation):
            return
    layer = check_layer(group, layer)
    n = token_count(group, "k", k, None)
    token_count(group, "v", v, n)
    first = have - n if start is None else as_count(start, "start")
    if first < 0 or first + n > have:
        raise InvalidArgument(
            f"write_kv positions [{first}, {first + n}) are outside the {have} recorded "
            f"tokens of seq_id {seq_id!r}: record_tokens first")
    if n and first < live:
        raise InvalidArgument(
            f"write_kv positions [{first}, {first + n}) of seq_id {seq_id!r} start before "
            f"{live}: those blocks left the sliding window (null entries)")
    group.check_write(row, first, n, seq_id, "write_kv")
    if n:
        group.pool.write_tokens(layer, group.slots(row, first, first + n), k, v,
                                generation=generation)
    else:  # nothing to write, but a stale table is refused like a non-empty write
        group.pool.check_generation(generation)


def check_layers_shape(group: GroupBlocks, k_layers, v_layers) -> None:
    """``InvalidArgument`` unless both lead with the group's physical layer count."""
    for name, x in (("k_layers", k_layers), ("v_layers", v_layers)):
        if tuple(getattr(x, "shape", ()))[:1] != (group.num_layers,):
            raise InvalidArgument(f"{name} has shape {list(getattr(x, 'shape', ()))}, "
                                  f"expected [{group.num_layers}, n, kv_heads, head_dim]")


def write_layers(group: GroupBlocks, row: int, seq_id: Hashable, have: int, k_layers,
                 v_layers) -> None:
    """All physical layers at once: ``[num_layers, n, kv_heads, head_dim]`` each, positions
    ``[have - n, have)``."""
    check_layers_shape(group, k_layers, v_layers)
    n = token_count(group, "k_layers[0]", k_layers[0], None)
    token_count(group, "v_layers[0]", v_layers[0], n)
    if n > have:
        raise InvalidArgument(f"write_kv_layers: {n} tokens but seq_id {seq_id!r} recorded "
                              f"only {have}: record_tokens first")
    live = group.first_live_position(row)
    if n and have - n < live:
        raise InvalidArgument(
            f"write_kv_layers positions [{have - n}, {have}) of seq_id {seq_id!r} start "
            f"before {live}: those blocks left the sliding window (null entries)")
    group.check_write(row, have - n, n, seq_id, "write_kv_layers")
    if n:
        group.pool.write_tokens_layers(group.slots(row, have - n, have), k_layers, v_layers)


def gather_positions(group: GroupBlocks, row: int, seq_id: Hashable, have: int, layer,
                     start: int, generation: int | None):
    """Copies of positions ``[start, have)`` of physical layer ``layer``: ``(k, v)``, each
    ``[have - start, kv_heads, head_dim]``. A ``start`` inside expired (null) blocks →
    ``InvalidArgument``."""
    live = group.first_live_position(row)
    # An exact int: False and 0.0 equal 0 but as_count refuses them.
    if type(start) is int and start == 0 and live == 0:
        out = group.pool.try_gather(layer, group.table[row], have, generation=generation)
        if out is not None:
            return out
    start = as_count(start, "start")
    layer = check_layer(group, layer)
    if start > have:
        raise InvalidArgument(f"gather_kv start = {start} is past the {have} recorded tokens "
                              f"of seq_id {seq_id!r}")
    if start < live:
        raise InvalidArgument(
            f"gather_kv start = {start} of seq_id {seq_id!r} is before {live}: those blocks "
            "left the sliding window (null entries); start at or after it")
    bs = group.block_size
    first_block = start // bs
    k, v = group.pool.gather(layer, group.table[row, first_block:group.blocks_for(have)],
                             have - first_block * bs, generation=generation)
    skip = start - first_block * bs
    return (k[skip:], v[skip:]) if skip else (k, v)


def gather_layers(group: GroupBlocks, row: int, seq_id: Hashable, have: int,
                  generation: int | None):
    """All physical layers of positions ``[0, have)``: ``(k_layers, v_layers)``."""
    if group.first_live_position(row):
        raise InvalidArgument(
            f"gather_kv_layers: seq_id {seq_id!r} holds only positions from "
            f"{group.first_live_position(row)} in this sliding group; use gather_kv with start")
    return group.pool.gather_layers(group.table[row, :group.blocks_for(have)], have,
                                    generation=generation)
