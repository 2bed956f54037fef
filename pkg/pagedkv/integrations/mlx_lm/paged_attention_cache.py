"""Paged attention for mlx-lm: ``PagedPromptCache(model, attention="paged")``.

In this mode a request keeps no private K/V buffer. Every position's K/V is written into the
MLX pool as the model computes it (the request's blocks, through the coordinator's slot
mapping), and

* a **decode step** (one new token) attends straight over the pool:
  ``pagedkv.kernels.mlx.paged_attention`` with the request's block table, no contiguous
  gather. The layer's ``update_and_fetch`` returns a
  :class:`~pagedkv.integrations.mlx_lm.attention_hook.PoolDecode`, which the patched
  ``scaled_dot_product_attention`` (:mod:`~pagedkv.integrations.mlx_lm.attention_hook`)
  recognizes;
* a **prefill chunk** (several tokens: the prompt, speculative decoding's verify step) is
  written, then the positions so far are gathered from the pool into a buffer laid out as
  ``KVCache``'s and mlx-lm's own SDPA runs with its causal mask.

The accuracy contract (docs/integrations/mlx-lm.md, "Paged attention"): a decode step's
attention is the kernel's, within docs/kernels.md's paged-attention tolerance (``rtol 1e-4,
atol 2e-5`` of the float64 reference), not mlx-lm's SDPA bits; so logits are close to, not
bit-identical with, ``KVCache``'s. Prefill attention is mlx-lm's own over the same K/V.

The row's token ids are recorded as positions are computed (prompt ids where known, a
placeholder for generated positions, whose ids the cache never sees); ``end(tokens)``
re-records the real ids before any block is published. Served: models whose every layer is
full attention through ``mlx_lm.models.base.scaled_dot_product_attention``, with a head_dim
the kernel takes; anything else is refused at construction (``UnsupportedModel``), a
decode call with a mask or attention sinks at the call, before anything changes.
"""

from __future__ import annotations

import numpy as np

from pagedkv.errors import InvalidArgument, RequestClosed, UnsupportedModel
from pagedkv.integrations.mlx_lm.attention_hook import USE_BUFFERS, PoolDecode
from pagedkv.integrations.mlx_lm.layer_cache import SAVED_STATE_REFUSAL, STEP_TOKENS, LayerBuffers
from pagedkv.integrations.mlx_lm.layer_kinds import LayerKind

__all__ = ["ATTENTION_MODES", "PLACEHOLDER_TOKEN", "PagedAttentionLayerCache", "PoolAttention"]

#: ``PagedPromptCache(attention=...)``: per-request buffers read by mlx-lm's SDPA (the
#: default, bit-identical to KVCache), or decode attention over the pool.
ATTENTION_MODES = ("buffer", "paged")
#: The id recorded for a generated position until ``end`` says which token it was (never
#: published: ``end`` re-records every position after the cached prefix first).
PLACEHOLDER_TOKEN = 0
#: Query heads per KV head the decode kernels take (pagedkv.kernels.mlx.paged_attention).
MAX_QUERY_HEADS_PER_KV_HEAD = 8
#: A decode step's block table is -1 padded to a multiple of this many entries, so it is
#: rebuilt (and the CUDA kernel's launch plan, keyed by the width, changes) every this many
#: blocks instead of every block; the kernels read only the entries a length uses.
TABLE_WIDTH_STEP = 64


def kv_buffers(k, v, count: int, capacity: int, dtype):
    """``(keys, values)``: zero ``[1, kv_heads, capacity rounded up to STEP_TOKENS,
    head_dim]`` buffers of ``dtype`` (KVCache's layout) holding ``k``, ``v`` (``[count,
    kv_heads, head_dim]``, lazily gathered from a pool) in their first ``count``
    positions."""
    import mlx.core as mx

    capacity = -(-max(capacity, count) // STEP_TOKENS) * STEP_TOKENS
    shape = (1, k.shape[1], capacity, k.shape[2])
    keys = mx.zeros(shape, dtype)
    values = mx.zeros(shape, dtype)
    keys[..., :count, :] = k.transpose(1, 0, 2)[None].astype(dtype)
    values[..., :count, :] = v.transpose(1, 0, 2)[None].astype(dtype)
    return keys, values


class PagedAttentionLayerCache(LayerBuffers):
    """One full-attention layer of a request of ``PagedPromptCache(attention="paged")``:
    mlx-lm's cache protocol over the pool. ``keys``/``values`` stay ``None`` (the request
    holds no buffer: ``nbytes`` is 0); ``offset`` counts the positions written."""

    step = STEP_TOKENS
    __slots__ = ("__weakref__",)

    def __init__(self, request, index: int, offset: int = 0) -> None:
        self.request = request
        self.index = index
        self.keys = self.values = None
        self.offset = offset

    def __repr__(self) -> str:
        return (f"PagedAttentionLayerCache(layer={self.index}, offset={self.offset}, "
                f"request={getattr(self.request, 'request_id', None)!r})")

    @property
    def _attention(self) -> PoolAttention:
        return self.request._owner._paged

    def update_and_fetch(self, keys, values):
        """One decode token: a :class:`PoolDecode` (the write and the attention happen in
        the patched SDPA). Several tokens: written into the pool, then the positions so far
        gathered into a KVCache-layout buffer for mlx-lm's SDPA."""
        self.request._check_live("update_and_fetch")
        if keys.shape[0] != 1:
            raise InvalidArgument(
                f"layer {self.index}: a batch of {keys.shape[0]} sequences; a paged request is "
                "one sequence (mlx-lm batching merges caches instead, which pool attention "
                f"does not serve: {USE_BUFFERS})")
        if keys.shape[2] == 1:
            decode = PoolDecode(self, keys, values)
            return decode, decode
        prev = self.offset
        self._attention.write(self.request, self.index, prev, keys, values)
        self.offset = prev + keys.shape[2]
        return self._attention.gather(self.request, self.index, self.offset, keys.dtype)

    def attend_pool(self, queries, keys, values, scale: float, mask, sinks):
        """The patched SDPA's decode call: checks the call, writes this token's K/V into the
        pool and attends over the request's blocks. Returns ``[1, heads, 1, head_dim]``."""
        attention = self._attention
        attention.check_decode(self, queries, mask, sinks)
        prev = self.offset
        attention.write(self.request, self.index, prev, keys, values)
        self.offset = prev + 1
        return attention.attend(self.request, self.index, queries, scale, self.offset)

    def keys_and_values(self):
        return self._attention.gather(self.request, self.index, self.offset, None)

    def make_mask(self, *args, **kwargs):
        from mlx_lm.models.cache import create_attention_mask

        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def empty(self) -> bool:
        return self.offset == 0

    def size(self) -> int:
        return self.offset

    @property
    def state(self):
        """The pool's arrays of this layer (what ``generate_step`` evaluates after each
        prefill chunk: the chunk's pending writes) and the offset. No saved state rebuilds
        one (the setter refuses, as the other paged layers')."""
        k, v = self._attention.pool_arrays(self.index)
        return k, v, self.offset

    @state.setter
    def state(self, value) -> None:
        raise RequestClosed(SAVED_STATE_REFUSAL)

    @classmethod
    def merge(cls, caches):
        raise InvalidArgument(
            "mlx-lm batching merges each request's contiguous K/V into one BatchKVCache; a "
            f"request with attention='paged' has none. {USE_BUFFERS}")

    def __deepcopy__(self, memo):
        self.request.fork()  # raises: pool-attention requests do not fork


class PoolAttention:
    """The pool side of attention="paged" for one :class:`PagedPromptCache` (``owner``):
    records a request's positions, writes K/V, gathers prefill buffers, runs the decode
    kernel and re-records the real token ids at ``end``."""

    def __init__(self, owner) -> None:
        self.owner = owner
        self.first = owner._full[0]  # the layer whose forward call records positions

    @staticmethod
    def check_model(specs, layout, pool_dtype, model_type: str) -> None:
        """``UnsupportedModel`` / ``InvalidArgument`` unless every layer is full attention
        with a head_dim the decode kernel takes and the pool holds the model's K/V dtype."""
        from pagedkv.kernels.mlx import HEAD_DIMS

        for spec in specs:
            if spec.kind is not LayerKind.FULL:
                raise UnsupportedModel(
                    f"model_type {model_type!r}: {spec}: attention='paged' serves full-"
                    f"attention layers only (no sliding windows, recurrent or KV-shared "
                    f"layers); {USE_BUFFERS}", layer=spec.index, kind=spec.kind.value,
                    missing="paged decode attention for this layer kind")
            g = layout.kv[spec.index]
            if g.head_dim not in HEAD_DIMS:
                raise UnsupportedModel(
                    f"model_type {model_type!r}: layer {spec.index} has head_dim {g.head_dim}; "
                    f"the paged decode kernel takes {HEAD_DIMS}; {USE_BUFFERS}",
                    layer=spec.index, kind="full", missing=f"a head_dim in {HEAD_DIMS}")
            if pool_dtype is not None and pool_dtype != g.dtype:
                raise InvalidArgument(
                    f"dtype={pool_dtype!r}: attention='paged' reads the pool as the model's "
                    f"K/V, so the pool holds the model's dtype ({g.dtype!r}); leave dtype "
                    "unset, or use attention='buffer' for a cast or KV-mode pool")

    def check_decode(self, layer: PagedAttentionLayerCache, queries, mask, sinks) -> None:
        """Refuse a decode call the kernel cannot compute (before anything changes)."""
        why = None
        if mask is not None:
            why = (f"a mask ({type(mask).__name__}) at decode; the paged kernel attends "
                   "causally over every position (a sliding window or a custom mask needs "
                   "mlx-lm's SDPA)")
        elif sinks is not None:
            why = "attention sinks, which the paged kernel does not add"
        else:
            g = self.owner.layout.kv[layer.index]
            heads = queries.shape[1]
            if queries.shape[0] != 1 or queries.shape[2] != 1 or heads % g.num_kv_heads \
                    or heads // g.num_kv_heads > MAX_QUERY_HEADS_PER_KV_HEAD:
                why = (f"queries {tuple(queries.shape)} over {g.num_kv_heads} KV heads; the "
                       f"kernel takes one token of 1..{MAX_QUERY_HEADS_PER_KV_HEAD} query "
                       "heads per KV head")
        if why is not None:
            raise UnsupportedModel(f"layer {layer.index}: attention='paged' got {why}; "
                                   f"{USE_BUFFERS}", layer=layer.index, kind="full",
                                   missing="this attention variant in the paged kernel")

    # --- writes ---------------------------------------------------------------------------

    def _record(self, request, prev: int, n: int) -> None:
        """Move the row's cursor to ``prev`` (a ``trim`` since the last forward leaves it
        ahead) and record ``n`` positions: the prompt's ids where known, else
        :data:`PLACEHOLDER_TOKEN`. The row's blocks back them from here on."""
        lc = self.owner.coordinator
        seq = request._seq
        have = lc.num_tokens(seq)
        if have > prev:
            lc.rollback_last_tokens(seq, have - prev)
        elif have < prev:
            raise InvalidArgument(
                f"request {request.request_id}: layer {self.first} writes position {prev} but "
                f"the pool holds {have} (a forward was interrupted?); release() the request")
        ids = np.full(n, PLACEHOLDER_TOKEN, np.uint32)
        known = request.prompt_tokens[prev:prev + n]
        ids[:len(known)] = known
        self.owner._with_room(lambda: lc.record_tokens(seq, ids))

    def write(self, request, index: int, prev: int, keys, values) -> None:
        """Write ``keys``/``values`` (``[1, kv_heads, n, head_dim]``) of positions ``[prev,
        prev + n)`` into layer ``index``'s pool (the first layer of a forward records the
        positions first). Lazy: one scatter per side."""
        owner = self.owner
        dtype = owner._mx_pool_dtype(index)
        k = keys[0].transpose(1, 0, 2).astype(dtype)
        v = values[0].transpose(1, 0, 2).astype(dtype)
        with owner._lock:
            if index == self.first:
                self._record(request, prev, keys.shape[2])
            with owner._stream():
                owner.coordinator.write_kv(request._seq, index, k, v, start=prev)

    # --- reads ----------------------------------------------------------------------------

    def pool_arrays(self, index: int):
        route = self.owner._routes[index]
        with self.owner._lock:
            return self.owner._pools[index].layer(route.physical_layer_ordinal)

    def gather(self, request, index: int, count: int, dtype):
        """Positions ``[0, count)`` of layer ``index`` as ``(keys, values)`` slices of
        KVCache-layout buffers (mlx-lm's SDPA then sees what KVCache would hand it)."""
        import mlx.core as mx

        owner = self.owner
        dtype = dtype or getattr(mx, owner.layout.kv[index].dtype)
        with owner._lock, owner._stream():
            # the row's cursor runs ahead of ``count`` after a trim until the next forward
            k, v = owner.coordinator.gather_kv(request._seq, index)
            keys, values = kv_buffers(k[:count], v[:count], count, count, dtype)
        return keys[..., :count, :], values[..., :count, :]

    def attend(self, request, index: int, queries, scale: float, seq_len: int):
        """Decode attention of layer ``index`` over the request's blocks; the first layer of
        the step builds and checks the step's table once, the others reuse it."""
        from pagedkv.kernels.mlx import paged_attention

        owner = self.owner
        route = owner._routes[index]
        pool = owner._pools[index]
        with owner._lock:
            if index == self.first or request._decode_batch is None:
                request._decode_batch = self._step_batch(request, route.group_id, pool,
                                                         seq_len)
            _, _, tables, lens = request._decode_batch
            k_pool, v_pool = pool.layer(route.physical_layer_ordinal)
        out = paged_attention(queries[:, :, 0, :], k_pool, v_pool, tables, lens, scale=scale,
                              max_seq_len=seq_len, check=False)
        return out.astype(queries.dtype)[:, :, None, :]

    def _step_batch(self, request, group_id: int, pool, seq_len: int):
        """``(key, host table, table, lens)`` of this decode step: the table (``int32[1,
        width]``) rebuilt only when the row's blocks, their revision or the pool generation
        changed since the last step; checked on the host every step."""
        import mlx.core as mx

        from pagedkv.kernels.kvcache import check_decode_batch

        lc = self.owner.coordinator
        seq = request._seq
        key = (lc.num_table_blocks(seq, group_id), lc.physical_revision(seq, group_id),
               pool.generation)
        last = request._decode_batch
        if last is not None and last[0] == key:
            host, tables = last[1], last[2]
        else:
            ids = lc.block_table(seq, group_id)
            host = np.full((1, -(-len(ids) // TABLE_WIDTH_STEP) * TABLE_WIDTH_STEP), -1,
                           np.int32)
            host[0, :len(ids)] = ids
            tables = mx.array(host)
        lens = np.array([seq_len], np.int32)
        check_decode_batch(host, lens, num_blocks=pool.num_blocks, block_size=pool.block_size)
        return key, host, tables, mx.array(lens)

    # --- end ------------------------------------------------------------------------------

    def finish(self, request, toks: np.ndarray) -> None:
        """Before ``end`` publishes: the row holds exactly ``toks`` (every position after the
        cached prefix re-recorded with its real id; the blocks already back them) and the
        pool already has every position's K/V. ``InvalidArgument`` (nothing changed) when
        ``toks`` does not start with the cached prefix."""
        lc = self.owner.coordinator
        seq, cached = request._seq, request.cached_tokens
        if len(toks) < cached or not np.array_equal(toks[:cached],
                                                    request.prompt_tokens[:cached]):
            raise InvalidArgument(
                f"end: tokens do not start with the {cached} cached prompt tokens of request "
                f"{request.request_id}; pass the tokens the cache holds (prompt + generated)")
        lc.rollback_last_tokens(seq, lc.num_tokens(seq) - cached)
        lc.record_tokens(seq, toks[cached:])

    def check_trim(self, request, n: int, offset: int) -> None:
        """``InvalidArgument`` when a rewind of ``n`` from the request's untrimmed ``offset``
        (``PagedRequest.check_trim``) reaches into the cached prefix: its blocks may be
        shared, and the next forward would write K/V into them in place."""
        if offset - min(offset, n) < request.cached_tokens:
            raise InvalidArgument(
                f"trim({n}): request {request.request_id} holds {offset} tokens, "
                f"{request.cached_tokens} of them from the cache; with attention='paged' a "
                "rewind may not reach into the cached prefix (its blocks may be shared and "
                f"the pool is written in place). {USE_BUFFERS}")
