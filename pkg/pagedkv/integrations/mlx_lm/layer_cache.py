"""``PagedKVLayerCache``: one full-attention layer of a paged request, in mlx-lm's protocol.

mlx-lm's attention calls ``cache.update_and_fetch(keys, values)`` and hands the result to
``scaled_dot_product_attention``, which needs each sequence's K and V as one contiguous
``[B, kv_heads, L, head_dim]`` array. So attention reads a request-private buffer that grows
exactly like ``mlx_lm.models.cache.KVCache`` (256-token steps, slice-assign appends, a slice
view returned): the decode step costs what KVCache's costs, and the logits are KVCache's bit
for bit. The paged pool is the store between requests: :class:`PagedPromptCache.begin`
loads a cached prefix into the buffer (one lazy gather per layer) and
:meth:`PagedRequest.end` writes the positions the pool does not have yet (one lazy scatter
per layer) and publishes the full blocks (docs/integrations/mlx-lm.md, "How it works").

The protocol is mlx-lm 0.32's: ``offset``, ``update_and_fetch``, ``keys_and_values``,
``make_mask``, ``state``, ``is_trimmable``/``trim``, ``size``, ``empty``, ``nbytes`` and the
``merge`` classmethod that batching calls. There is no ``bits`` attribute: mlx-lm switches to
its quantized attention on ``hasattr(cache, "bits")``.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, create_attention_mask

from pagedkv.argument_checks import int_argument
from pagedkv.errors import InvalidArgument, RequestClosed

__all__ = ["SAVED_STATE_REFUSAL", "LayerBuffers", "PagedKVLayerCache", "fork_layer"]

#: Buffer growth step in tokens: KVCache.step, so buffers have KVCache's shapes.
STEP_TOKENS = 256

#: What a paged layer's ``state`` setter says: mlx-lm's ``load_prompt_cache`` /
#: ``from_state`` cannot rebuild one.
SAVED_STATE_REFUSAL = (
    "a paged layer cache cannot be rebuilt from a saved state (mlx-lm's load_prompt_cache / "
    "from_state): paged prefixes persist through PagedPromptCache(cold_dir=...), "
    "docs/integrations/mlx-lm.md, 'Restarts'")


class LayerBuffers:
    """What the paged layer caches share of mlx-lm's cache protocol: ``keys``/``values``
    buffers (``None`` before the first write) valid up to ``offset``, a ``state`` that
    ``generate_step`` evaluates but no saved state can rebuild, ``trim`` (through the owning
    ``request``) and the refusal of mlx-lm's KV quantization."""

    # the slots trim and the protocol read and write; subclasses add their own
    __slots__ = ("index", "keys", "offset", "request", "values")
    index: int  # the layer
    keys: Any  # an mx.array, or None before the first write
    values: Any
    offset: int
    request: Any  # the owning PagedRequest

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of this request's buffers (what a live request holds beyond the pool)."""
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    @property
    def state(self):
        """``(keys, values, offset)`` as KVCache's: what ``generate_step`` evaluates after
        each prefill chunk."""
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, value) -> None:
        raise RequestClosed(SAVED_STATE_REFUSAL)

    def is_trimmable(self) -> bool:
        """True, for a sliding layer too once its buffer dropped positions (unlike mlx-lm's
        ``RotatingKVCache`` past its window): ``trim_prompt_cache``, which speculative
        decoding rewinds its rejected drafts with, trims nothing at all, silently, when a
        layer answers False. What a sliding layer cannot rewind, :meth:`trim` refuses
        (``InvalidArgument``, no layer changed); ``LRUPromptCache``, which trims a longer
        entry by any amount, gets that refusal rather than a fallback."""
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (speculative decoding, ``trim_prompt_cache``);
        returns how many were dropped. ``InvalidArgument`` (no layer changed) when a sliding
        layer of the request cannot rewind that far: its buffer no longer holds the window
        before the new offset (a rewind of up to ``TRIM_MARGIN_TOKENS`` tokens that ends at
        or after the request's ``cached_tokens`` always works)."""
        n = int_argument("trim: n", n, 0)  # a negative n would grow the offset
        self.request.check_trim(n)
        n = min(self.offset, n)
        self.offset -= n
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """mlx-lm's ``kv_bits`` path calls this; paged KV is not quantized by mlx-lm."""
        raise InvalidArgument(
            f"kv_bits={bits}: mlx-lm's KV quantization would replace the paged cache with a "
            "private QuantizedKVCache; run without kv_bits (docs/integrations/mlx-lm.md, "
            "'Limits')")


class PagedKVLayerCache(LayerBuffers):
    """The cache of one full-attention layer of one :class:`PagedRequest`.

    ``keys``/``values``: ``[1, kv_heads, capacity, head_dim]`` buffers (``None`` before the
    first write), valid up to ``offset`` tokens. ``request``: the owning request.
    """

    step = STEP_TOKENS
    __slots__ = ("__weakref__",)

    def __init__(self, request, index: int, keys=None, values=None, offset: int = 0) -> None:
        self.request = request
        self.index = index
        self.keys = keys
        self.values = values
        self.offset = offset

    def __repr__(self) -> str:
        shape = None if self.keys is None else tuple(self.keys.shape)
        return (f"PagedKVLayerCache(layer={self.index}, offset={self.offset}, buffer={shape}, "
                f"request={getattr(self.request, 'request_id', None)!r})")

    # --- the attention path (KVCache's code, so its cost and bits) -----------------------

    def update_and_fetch(self, keys, values):
        prev = self.offset
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            v_head_dim = values.shape[3]
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            k_shape = (B, n_kv_heads, n_steps * self.step, k_head_dim)
            v_shape = (B, n_kv_heads, n_steps * self.step, v_head_dim)
            new_k = mx.zeros(k_shape, keys.dtype)
            new_v = mx.zeros(v_shape, values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset += keys.shape[2]
        self.keys[..., prev:self.offset, :] = keys
        self.values[..., prev:self.offset, :] = values
        return self.keys_and_values()

    def keys_and_values(self):
        if self.offset < self.keys.shape[2]:
            return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]
        return self.keys, self.values

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    # --- the rest of the protocol --------------------------------------------------------

    def size(self) -> int:
        """Tokens held (mlx-lm's "sequence length")."""
        return self.offset

    @classmethod
    def merge(cls, caches):
        """mlx-lm batching (``batch_generate``, ``BatchGenerator``, the server's batched
        path): one ``BatchKVCache`` holding every request's tokens, built by mlx-lm's own
        ``BatchKVCache.merge``. The batch owns copies from here on, so each paged request
        among ``caches`` is handed over (its pool references released, nothing published);
        publish what the batch computed with ``PagedPromptCache.insert(tokens, cache)``."""
        batch = BatchKVCache.merge(caches)
        for c in caches:
            request = getattr(c, "request", None)
            if request is not None and isinstance(c, cls):
                request.hand_over()
        return batch

    def __deepcopy__(self, memo):
        """What ``copy.deepcopy`` (mlx-lm's ``LRUPromptCache``) calls: the matching layer of
        an independent fork of the whole request, made once per deep copy."""
        return fork_layer(self, memo)


def fork_layer(layer, memo):
    """``copy.deepcopy`` of one layer of a paged request: the same layer of a fork of the
    whole request (made once per deep copy, whichever layer is copied first)."""
    return copy.deepcopy(layer.request, memo).cache[layer.index]
