"""``PagedSlidingLayerCache``: one sliding-window layer of a paged request, in mlx-lm's
protocol (docs/integrations/mlx-lm.md, "Sliding-window models").

Attention reads a request-private buffer in **temporal order** holding the positions
``[start, offset)``: ``update_and_fetch`` appends in place and returns the last
``window - 1`` positions before the new ones plus the new ones, and ``make_mask`` builds the
matching mask. Unlike mlx-lm's ``RotatingKVCache`` (whose decode step returns keys in ring
order) the keys stay in position order, so the logits are those of mlx-lm's forward of the
whole sequence without a cache, bit for bit. When the buffer is full it drops what no query
and no bounded rewind (``trim``) can still read, keeping block-aligned positions, so a
request holds about one window (plus a 256-token step) per sliding layer however long it
runs.

The pool gets the K/V in two ways: positions of the prompt are written through as they are
computed (their token ids are known), so the sliding group publishes each block and gives it
back to the pool as the window moves past it; the positions generated after the prompt are
written at :meth:`PagedRequest.end`, from the buffer (docs/integrations/mlx-lm.md, "How it
works").
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache, create_causal_mask

from pagedkv.errors import InvalidArgument
from pagedkv.integrations.mlx_lm.layer_cache import (
    STEP_TOKENS,
    LayerBuffers,
    fork_layer,
)

__all__ = ["TRIM_MARGIN_TOKENS", "PagedSlidingLayerCache"]

#: Positions a sliding buffer keeps beyond the window (before block alignment), so that a
#: rewind of up to this many tokens (speculative decoding's rejected drafts, a short
#: ``trim_prompt_cache``) still finds the window it needs. It counts positions the request
#: computed: a prefix ``begin`` loaded from the pool comes with the window before its end
#: only (block-aligned), so a rewind that ends inside that prefix may be refused.
TRIM_MARGIN_TOKENS = 64


class PagedSlidingLayerCache(LayerBuffers):
    """The cache of one sliding-window layer of one :class:`PagedRequest`.

    ``keys``/``values``: ``[1, kv_heads, capacity, head_dim]`` buffers (``None`` before the
    first write) whose index ``i`` holds position ``start + i``, valid up to ``offset``.
    ``window``: tokens a query attends (itself included). ``request``: the owning request.
    """

    step = STEP_TOKENS
    __slots__ = ("__weakref__", "start", "window")

    def __init__(self, request, index: int, window: int, keys=None, values=None,
                 offset: int = 0, start: int = 0) -> None:
        self.request = request
        self.index = index
        self.window = int(window)
        self.keys = keys
        self.values = values
        self.offset = offset
        self.start = start

    def __repr__(self) -> str:
        shape = None if self.keys is None else tuple(self.keys.shape)
        return (f"PagedSlidingLayerCache(layer={self.index}, window={self.window}, "
                f"offset={self.offset}, holds=[{self.start}, {self.offset}), buffer={shape}, "
                f"request={getattr(self.request, 'request_id', None)!r})")

    @property
    def max_size(self) -> int:
        """The window (mlx-lm's ``RotatingKVCache.max_size``)."""
        return self.window

    # --- the attention path -------------------------------------------------------------

    def _first_kept(self, offset: int) -> int:
        """The first position a compaction at ``offset`` keeps: block-aligned, at least the
        window and :data:`TRIM_MARGIN_TOKENS` behind ``offset`` (what the next query, a
        rewind and the request's publication can still need)."""
        bs = self.request.block_size
        return max(0, offset - self.window - TRIM_MARGIN_TOKENS) // bs * bs

    def _make_room(self, n: int) -> None:
        """Room for ``n`` more positions: drop what no one can read, then a buffer with
        ``n`` rounded up to whole 256-token steps of free space (KVCache's growth)."""
        keys = self.keys
        room = -(-n // self.step) * self.step
        first = max(self.start, self._first_kept(self.offset))
        held = self.offset - first
        shape = (keys.shape[0], keys.shape[1], room, keys.shape[3])
        a, b = first - self.start, self.offset - self.start
        self.keys = mx.concatenate([keys[..., a:b, :], mx.zeros(shape, keys.dtype)], axis=2)
        self.values = mx.concatenate(
            [self.values[..., a:b, :], mx.zeros(shape[:3] + (self.values.shape[3],),
                                                self.values.dtype)], axis=2)
        self.start = first
        assert self.keys.shape[2] >= held + n

    def update_and_fetch(self, keys, values):
        prev = self.offset
        n = keys.shape[2]
        if self.keys is None or prev - self.start + n > self.keys.shape[2]:
            if self.keys is None:
                self.start = prev
                room = -(-n // self.step) * self.step
                B, heads, _, k_dim = keys.shape
                self.keys = mx.zeros((B, heads, room, k_dim), keys.dtype)
                self.values = mx.zeros((B, heads, room, values.shape[3]), values.dtype)
            else:
                self._make_room(n)
        at = prev - self.start
        self.keys[..., at:at + n, :] = keys
        self.values[..., at:at + n, :] = values
        self.offset = prev + n
        request = self.request
        if request.writes_through:
            request.sliding_written(self.index, prev, keys, values)
        lo = max(0, prev - self.window + 1) - self.start
        return self.keys[..., lo:at + n, :], self.values[..., lo:at + n, :]

    def keys_and_values(self):
        """The positions a query at ``offset`` attends, before it: ``[offset - window + 1,
        offset)`` (all of them when shorter)."""
        lo = max(0, self.offset - self.window + 1) - self.start
        hi = self.offset - self.start
        return self.keys[..., lo:hi, :], self.values[..., lo:hi, :]

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """The mask of ``N`` queries over what :meth:`update_and_fetch` returns: the keys
        start ``min(offset, window - 1)`` positions before the first query (mlx-lm's
        ``RotatingKVCache.make_mask`` for ``N > 1``; ``None`` for one query, which attends
        every key returned)."""
        ws = window_size or self.window
        if ws > self.window:
            raise InvalidArgument(
                f"make_mask: window_size {ws} is wider than layer {self.index}'s window "
                f"{self.window}: its cache returns only the last {self.window} positions")
        before = min(self.offset, self.window - 1)
        if N > 1:
            if before + N > ws or return_array:
                return create_causal_mask(N, before, window_size=ws)
            return "causal"
        if before + 1 <= ws:
            return None
        return mx.arange(before + 1) >= before + 1 - ws

    # --- the rest of the protocol ------------------------------------------------------

    def size(self) -> int:
        """Tokens a query attends at most (mlx-lm's ``RotatingKVCache.size``)."""
        return min(self.offset, self.window)

    def holds_window_at(self, offset: int) -> bool:
        """Whether the buffer still holds the window a query at ``offset`` attends (what a
        rewind to ``offset`` needs)."""
        return max(0, offset - self.window + 1) >= self.start

    def as_rotating(self) -> RotatingKVCache:
        """mlx-lm's ``RotatingKVCache`` holding the same window (temporal order), what its
        batching merges: exactly ``min(offset, window)`` positions, as mlx-lm's own holds.
        The oldest of them, ``offset - window``, no query reads again (the next token
        replaces it), and the buffer may not hold it: it is then a zero row."""
        cache = RotatingKVCache(self.window)
        if self.keys is not None:
            held = min(self.offset, self.window)
            a, b = self.offset - held - self.start, self.offset - self.start
            keys, values = self.keys[..., max(a, 0):b, :], self.values[..., max(a, 0):b, :]
            if a < 0:
                keys = mx.concatenate([mx.zeros(keys.shape[:2] + (-a, keys.shape[3]),
                                                keys.dtype), keys], axis=2)
                values = mx.concatenate([mx.zeros(values.shape[:2] + (-a, values.shape[3]),
                                                  values.dtype), values], axis=2)
            cache.keys, cache.values = keys, values
            cache.offset = self.offset
            cache._idx = held
        return cache

    @classmethod
    def merge(cls, caches):
        """mlx-lm batching: one ``BatchRotatingKVCache`` (mlx-lm's own ``merge``) holding each
        request's window. The batch owns copies: each paged request is handed over (its pool
        references released, nothing published)."""
        batch = BatchRotatingKVCache.merge(
            [c.as_rotating() if isinstance(c, cls) else c for c in caches])
        for c in caches:
            if isinstance(c, cls):
                c.request.hand_over()
        return batch

    def __deepcopy__(self, memo):
        """The matching layer of an independent fork of the whole request."""
        return fork_layer(self, memo)
