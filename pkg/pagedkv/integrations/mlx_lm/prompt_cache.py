"""``PagedPromptCache``: pagedkv as the prompt cache of an mlx-lm model.

One per loaded model. It owns the grouped coordinator (one allocator and one MLX pool per
group of layers: full attention, each sliding window), the recurrent-state checkpoints and
the optional cold tier, and hands out requests:

    paged = PagedPromptCache(model)
    request = paged.begin(prompt)                       # hot lookup, then cold
    for token, logprobs in generate_step(mx.array(prompt[request.cached_tokens:]), model,
                                         prompt_cache=request.cache):
        ...
    request.end(prompt + generated)                     # publish, keep the tail warm

A request's layers attend over private contiguous buffers (a full layer's grows like
``KVCache``, a sliding layer's keeps about one window); the pool is the store between
requests: ``begin`` gathers a cached prefix into the buffers, ``end`` scatters the positions
the pool lacks and publishes every full block, refcounted and shared by whoever asks for the
same prefix next. Sliding layers also write the prompt's positions through as they are
computed, so their blocks go back to the pool as the window moves. After ``end`` the
request's tables stay live ("parked", at most ``max_parked``): the next turn of that
conversation continues them exactly. Details: docs/integrations/mlx-lm.md.

Not thread-safe beyond one lock: calls are serialized; build and evaluate a request's arrays
on one thread at a time (mlx-lm's server runs all generation on one thread).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from pagedkv.adapter import turns
from pagedkv.argument_checks import int_argument, items_argument
from pagedkv.errors import (
    InvalidArgument,
    PagedKVError,
    PoolExhausted,
    RequestClosed,
    UnsupportedModel,
)
from pagedkv.integrations.mlx_lm.attention_hook import install as install_attention_hook
from pagedkv.integrations.mlx_lm.layer_cache import LayerBuffers, PagedKVLayerCache
from pagedkv.integrations.mlx_lm.layer_kinds import LayerKind, check_served, layer_specs
from pagedkv.integrations.mlx_lm.paged_attention_cache import (
    ATTENTION_MODES,
    PagedAttentionLayerCache,
    PoolAttention,
    kv_buffers,
)
from pagedkv.integrations.mlx_lm.recurrent import (
    CHECKPOINT_INTERVAL_TOKENS,
    CHECKPOINTS_PER_REQUEST,
    RecurrentCheckpoints,
)
from pagedkv.integrations.mlx_lm.sliding_cache import PagedSlidingLayerCache
from pagedkv.integrations.mlx_lm.state_cache import PagedStateLayerCache
from pagedkv.integrations.mlx_lm.topology import (
    PREFILL_CHUNK_TOKENS,
    build_coordinator,
    dtype_name,
    model_layout,
    plan_groups,
)

__all__ = ["PagedPromptCache", "PagedRequest"]

log = logging.getLogger("pagedkv.integrations.mlx_lm")

#: Seconds ``close`` (or interpreter exit) waits for the cold tier's queued writes.
COLD_DRAIN_SECONDS = 30.0
#: Context (tokens) sizing the default max pool when the config names none.
_DEFAULT_CONTEXT_TOKENS = 32768
#: Tokens recorded at once when ``end`` writes a sliding model's positions (the sliding
#: groups prune between chunks, so a row never holds more than a window plus this).
_END_CHUNK_TOKENS = 512
#: Recurrent-state checkpoints kept in memory (the hot store; the least recently published or
#: hit goes first).
DEFAULT_CHECKPOINT_ENTRIES = 16


def model_type_of(model) -> str:
    """The mlx-lm ``model_type`` of a loaded model (``"unknown"`` when it has none)."""
    name = getattr(model, "model_type", None)
    if name is None:
        name = getattr(getattr(model, "args", None), "model_type", None)
    return str(name) if name else "unknown"


def _as_tokens(tokens, name: str = "tokens") -> np.ndarray:
    """Token ids (a list, NumPy array or ``mx.array``, 1-D) as uint32, by the project's token
    rule (``pagedkv.hashing.as_token_array``)."""
    from pagedkv.hashing import as_token_array

    if not isinstance(tokens, (np.ndarray, list, tuple)):
        tokens = np.asarray(tokens)  # an mx.array: its buffer, no Python list
    return as_token_array(tokens, name)


def _first_non_finite(k, v, start: int) -> str | None:
    """Where the first non-finite value of K/V ``[n, kv_heads, head_dim]`` for positions
    from ``start`` is (``"K holds nan at position 9, kv-head 1"``), or ``None``. Evaluates
    both: for an error message only."""
    import mlx.core as mx

    for name, x in (("K", k), ("V", v)):
        values = np.array(x.astype(mx.float32))
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            pos, head, _ = np.unravel_index(bad[0], values.shape)
            return (f"{name} holds {values.flat[bad[0]]} at position {start + int(pos)}, "
                    f"kv-head {int(head)}")
    return None


def _salt(cache_salt) -> int:
    """``None`` → 0 (shared); a str (a tenant name) → its domain id; a u64 domain id as is."""
    from pagedkv.hashing import as_domain_id, salt_domain_id

    if isinstance(cache_salt, str):
        return salt_domain_id(cache_salt)
    return as_domain_id(cache_salt)


def _check_checkpoint_policy(block_size, entries, max_bytes, interval, per_request) -> None:
    int_argument("checkpoint_entries", entries, 1)
    if max_bytes is not None:
        int_argument("checkpoint_bytes", max_bytes, 1)
    int_argument("checkpoints_per_request", per_request, 1)
    if int_argument("checkpoint_interval", interval, 0) % block_size:
        raise InvalidArgument(f"checkpoint_interval: {interval} tokens is not a multiple of "
                              f"block_size {block_size} (checkpoints sit on block boundaries)")


class PagedRequest:
    """One request's view of a :class:`PagedPromptCache`.

    ``cache``: the per-layer list to pass as ``prompt_cache=`` with
    ``prompt_tokens[cached_tokens:]``. ``cached_tokens``: leading prompt tokens the cache
    holds: ``hit_tokens`` of them came from the cache (hot, cold or a parked conversation),
    ``prefilled_tokens`` were computed by ``begin`` (a model with recurrent layers runs its
    prompt up to the last checkpoint rung there). End it with :meth:`end` (publish),
    :meth:`release` (discard) or let it be collected (discarded).
    """

    __slots__ = ("__weakref__", "_chunk", "_decode_batch", "_finalizer", "_full_from", "_owner",
                 "_pool_tokens", "_recorded", "_seq", "_write_through", "cache", "cache_salt",
                 "cached_tokens", "hit_tokens", "prefilled_tokens", "prompt_tokens",
                 "request_id", "restored_tokens", "state")

    def __init__(self, owner: PagedPromptCache, seq: int, prompt: np.ndarray, salt: int,
                 cached: int, restored: int) -> None:
        self._owner = owner
        self._seq = seq
        self.request_id = seq
        self.prompt_tokens = prompt
        self.cache_salt = salt
        self.cached_tokens = cached
        self.hit_tokens = cached
        self.prefilled_tokens = 0
        self.restored_tokens = restored
        self.state = "live"
        self.cache: list[Any] = []
        # Tokens whose K/V the row holds in pool blocks in every layer (a prefix of the
        # context): where a fork's lookup stops.
        self._pool_tokens = prompt[:cached]
        # The full layers' K/V are in the pool up to _full_from; the row's cursor
        # (_recorded) runs ahead of it while sliding layers write the prompt through.
        self._full_from = cached
        self._recorded = cached
        self._write_through = bool(owner._sliding)
        self._chunk: tuple[int, int] | None = None
        self._decode_batch = None  # attention="paged": the last decode step's block table
        # A request dropped without end() gives its blocks back at the owner's next call.
        self._finalizer = weakref.finalize(self, owner._dropped.append, seq)

    def __repr__(self) -> str:
        offset = self._owner._offset_of(self.cache)
        return (f"PagedRequest(id={self.request_id}, state={self.state!r}, "
                f"prompt_tokens={len(self.prompt_tokens)}, cached_tokens={self.cached_tokens}, "
                f"restored_tokens={self.restored_tokens}, cache_tokens={offset})")

    @property
    def closed(self) -> bool:
        return self.state != "live"

    @property
    def block_size(self) -> int:
        return self._owner.block_size

    @property
    def writes_through(self) -> bool:
        """Whether sliding layers still write prompt positions into the pool as they go."""
        return self._write_through

    def _check_live(self, call: str) -> None:
        if self.state != "live":
            raise RequestClosed(f"{call}: request {self.request_id} is {self.state}; begin() a "
                                "new request")

    def end(self, tokens) -> int:
        """Publish the request: ``tokens`` is every token the cache now holds (prompt +
        generated, ``len(tokens) == request.cache[0].offset``). Writes the K/V positions the
        pool lacks, publishes every full block (and, for a recurrent model, the state at a
        block boundary) for reuse and parks the tables so the next turn of this
        conversation continues them exactly. Returns the tokens written to the pool.
        ``InvalidArgument`` (nothing changed) when ``tokens`` does not match the cache;
        ``RequestClosed`` after end, release or a hand-over to a batch. An error while
        writing the K/V (``PoolExhausted``; on a KV-mode pool a non-finite K/V value:
        ``InvalidArgument`` naming the layer, K or V, the position and the kv-head) releases
        the request (nothing published) and propagates."""
        self._check_live("end")
        return self._owner._end(self, tokens)

    def release(self) -> None:
        """Discard the request: its pool references go back, nothing more is published."""
        if self.state == "live":
            self._owner._release_request(self)

    def fork(self) -> PagedRequest:
        """An independent copy (what ``copy.deepcopy`` calls): same tokens, K/V and state,
        its own buffers and pool references; either may continue or end without the
        other. Not with ``attention="paged"`` (``InvalidArgument``): its unpublished
        positions live in its own pool blocks."""
        self._check_live("fork")
        if self._owner._paged is not None:
            raise InvalidArgument(
                f"fork: request {self.request_id} attends over the pool (attention='paged'); "
                "its unpublished positions live in its own blocks, which a fork would have to "
                "copy. end() it and begin() the copy from the published prefix, or use "
                "attention='buffer'")
        return self._owner._fork(self)

    def hand_over(self) -> None:
        """The caches were merged into a batch that owns copies (mlx-lm batching): release
        the pool references; the batch's extracted caches are published with
        ``PagedPromptCache.insert``."""
        if self.state == "live":
            self._owner._release_request(self, state="handed over to a batch")

    def check_trim(self, n: int) -> None:
        """Called by every layer's ``trim`` before it changes anything: ``InvalidArgument``
        when a sliding layer cannot rewind ``n`` tokens. A rewind also stops the
        write-through (the tokens after it are no longer the prompt's).

        The rewind is measured from the request's untrimmed offset, the largest of its
        layers': mlx-lm's ``trim_prompt_cache`` trims layer by layer, so the layers trimmed
        before this call already hold the new offset (checked as if they had ``n`` more
        tokens to rewind, a trim the first layer allowed was refused half-way)."""
        offset = max(layer.offset for layer in self.cache if isinstance(layer, LayerBuffers))
        target = offset - min(offset, n)
        for layer in self.cache:
            if isinstance(layer, PagedSlidingLayerCache) and not layer.holds_window_at(target):
                raise InvalidArgument(
                    f"trim({n}): sliding layer {layer.index} (window {layer.window}) holds "
                    f"positions from {layer.start}; after the rewind a query at {target} "
                    f"needs them from {max(0, target - layer.window + 1)}. A paged sliding "
                    "layer keeps about one window: rewind at most "
                    "pagedkv.integrations.mlx_lm.sliding_cache.TRIM_MARGIN_TOKENS tokens, "
                    f"and not before the {self.cached_tokens} tokens begin() loaded (it "
                    "loads the window before them only)")
        if self._owner._paged is not None:
            self._owner._paged.check_trim(self, n, offset)
        self._write_through = False

    def sliding_written(self, index: int, prev: int, keys, values) -> None:
        """A sliding layer computed positions ``[prev, prev + n)``: write the prompt's among
        them into the pool (docs/integrations/mlx-lm.md, "How it works")."""
        self._owner._write_through(self, index, prev, keys, values)

    def __deepcopy__(self, memo):
        fork = self.fork()
        memo[id(self)] = fork
        return fork


class PagedPromptCache:
    """pagedkv as the prompt cache of one mlx-lm model.

    Parameters
    ----------
    model:
        A loaded mlx-lm model. Its layer kinds are read from mlx-lm's
        ``make_prompt_cache(model)``: ``KVCache`` → full attention, ``RotatingKVCache`` →
        sliding window, ``ArraysCache`` → recurrent state, layers past the list that read
        another's K/V → aliases. A kind this build cannot page raises
        :class:`~pagedkv.errors.UnsupportedModel` naming the layer.
    block_size:
        Tokens per block (8, 16 or 32).
    max_blocks:
        The most blocks each group's pool may grow to (default: ``PAGEDKV_PAGED_CACHE_MEMORY_MB``,
        else one full context of the model's ``max_position_embeddings``, docs/pool.md
        "Sizing").
    dtype:
        Pool dtype (``"float16"``, ``"bfloat16"``, ``"float32"``; default: the model's K/V
        dtype, which keeps reuse bit-exact; another dtype casts at the pool boundary), or a
        KV mode (``"q8"``, ``"fwht4/q8"``, ``"fwht4/lloyd4"``, ...: docs/kv-quant.md): K/V
        are encoded as they enter the pool and decoded back to the model's dtype when a
        cached prefix is loaded, so reuse is as exact as the mode (the model's own
        per-request cache is not quantized).
    cold_dir:
        A directory for the cold tier: full blocks (and a recurrent model's state sidecars)
        persist there and a later process with the same model restores them (``None``: no
        cold tier).
    model_dir:
        The model's directory, so the cold-tier fingerprint uses its files (weight digests
        cached in the tier); default: a digest of the loaded parameters.
    initial_blocks:
        Pool blocks at start, per group (default 64, or ``PAGEDKV_PAGED_CACHE_INITIAL_MB``);
        each grows on demand up to ``max_blocks``.
    max_parked:
        Ended conversations whose tables stay live for an exact continuation (default 32);
        the oldest is released first, and all are released under pool pressure.
    checkpoint_entries:
        Recurrent-state checkpoints kept in memory (models with recurrent layers); the least
        recently published or hit goes first.
    checkpoint_bytes:
        A bound on those checkpoints' bytes (``None``: only ``checkpoint_entries``).
    checkpoint_interval:
        Tokens between the prefill checkpoints of a recurrent model (a multiple of
        ``block_size``; 0: only each prompt's tail): ``begin`` keeps the state at every
        multiple of it, doubled until at most ``checkpoints_per_request - 1`` fall in the
        prompt (``pagedkv.integrations.mlx_lm.recurrent.checkpoint_boundaries``).
    checkpoints_per_request:
        The most checkpoints one ``begin`` publishes, the prompt's tail included (``end``
        adds one more when the conversation ends on a block boundary).
    attention:
        ``"buffer"`` (default): each request attends over private contiguous buffers through
        mlx-lm's own SDPA, bit-identical to ``KVCache``; the pool is the store between
        requests. ``"paged"``: every position's K/V goes into the pool as it is computed
        and decode steps attend straight over the pool with
        ``pagedkv.kernels.mlx.paged_attention`` (logits within the kernel's tolerance, not
        bit-identical; full-attention models only:
        :mod:`~pagedkv.integrations.mlx_lm.paged_attention_cache`).
    """

    def __init__(self, model, *, block_size: int = 16, max_blocks: int | None = None,
                 dtype=None, cold_dir=None, model_dir=None, initial_blocks: int | None = None,
                 max_parked: int = 32,
                 checkpoint_entries: int = DEFAULT_CHECKPOINT_ENTRIES,
                 checkpoint_bytes: int | None = None,
                 checkpoint_interval: int = CHECKPOINT_INTERVAL_TOKENS,
                 checkpoints_per_request: int = CHECKPOINTS_PER_REQUEST,
                 attention: str = "buffer") -> None:
        from pagedkv.sizing import PagedCacheConfig

        if attention not in ATTENTION_MODES:
            raise InvalidArgument(f"attention: {attention!r} is not one of {ATTENTION_MODES}")
        model_type = model_type_of(model)
        specs = layer_specs(model)
        check_served(specs, model_type)
        config = PagedCacheConfig(block_size=block_size).with_env()
        max_parked = int_argument("max_parked", max_parked, 0)
        _check_checkpoint_policy(block_size, checkpoint_entries, checkpoint_bytes,
                                 checkpoint_interval, checkpoints_per_request)
        pool_dtype = None if dtype is None else dtype_name(dtype)
        layout = model_layout(model, specs, model_type)
        if attention == "paged":
            PoolAttention.check_model(specs, layout, pool_dtype, model_type)
        context = int(getattr(getattr(model, "args", None), "max_position_embeddings", 0)
                      or _DEFAULT_CONTEXT_TOKENS)

        self.model = model
        self.model_type = model_type
        self.attention = attention
        self.layers = specs
        self.layout = layout
        self.block_size = block_size
        self.max_parked = int(max_parked)
        self.recurrent = RecurrentCheckpoints(layout.states, block_size, PREFILL_CHUNK_TOKENS,
                                              interval=checkpoint_interval,
                                              per_request=checkpoints_per_request)
        self._entries = tuple(s for s in specs if s.kind is not LayerKind.SHARED)
        self._sliding = tuple(s.index for s in specs if s.kind is LayerKind.SLIDING)
        self._full = tuple(s.index for s in specs if s.kind is LayerKind.FULL)
        self._kv = tuple(sorted(self._sliding + self._full))
        first_kv = layout.kv[self._kv[0]]
        self.kv_dtype = first_kv.dtype
        self.cold_tier = None
        self._closer = None
        self._snapshots = None
        self._cold_context = None
        kv_specs, groups = plan_groups(layout, block_size, pool_dtype, context)
        cold = None
        if cold_dir is not None:
            cold = self._open_cold(cold_dir, model, model_dir, groups)

        def checkpoint_store(hasher):
            from pagedkv.coordinator import StateCheckpointStore

            # A request's count is capped where its boundaries are chosen
            # (checkpoint_boundaries); the store evicts the least recently published or hit.
            return StateCheckpointStore(hasher, max_entries=checkpoint_entries,
                                        max_bytes=checkpoint_bytes)

        self.coordinator = build_coordinator(
            kv_specs, groups, block_size=block_size, context_tokens=context, config=config,
            max_blocks=max_blocks, initial_blocks=initial_blocks, cold=cold,
            checkpoints=checkpoint_store if self.recurrent else None)
        self.recurrent.store = self.coordinator.checkpoints
        if self._snapshots is not None:
            self._snapshots.bind(self.coordinator.groups[0].allocator)
        self.groups = groups
        #: The pool geometry of the first group (all K/V layers of a full-attention model).
        self.geometry = self.coordinator.groups[0].pool.geometry
        self._routes = {i: self.coordinator.route_for_layer(i) for i in self._kv}
        self._sliding_groups = sorted({self._routes[i].group_id for i in self._sliding})
        self._pools = {i: self.coordinator.groups[r.group_id].pool
                       for i, r in self._routes.items()}
        self._windows: dict[int, int] = {s.index: int(s.window) for s in specs
                                         if s.kind is LayerKind.SLIDING and s.window}
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        # seq -> (salt, tokens, recurrent states at len(tokens) or None)
        self._parked: collections.OrderedDict[int, tuple[int, np.ndarray, Any]] = \
            collections.OrderedDict()
        self._dropped: collections.deque[int] = collections.deque()
        self._live: weakref.WeakValueDictionary[int, PagedRequest] = \
            weakref.WeakValueDictionary()
        self._counters = dict.fromkeys((
            "requests", "prompt_tokens", "hit_tokens", "restored_tokens", "continued_tokens",
            "prefilled_tokens", "published_tokens", "forks", "handed_over", "released",
            "parked_released", "write_through_stops"), 0)
        self._paged: PoolAttention | None = None
        if attention == "paged":
            install_attention_hook(model, model_type)
            self._paged = PoolAttention(self)

    def _open_cold(self, cold_dir, model, model_dir, groups):
        """The cold tier's hooks for this model, with its sidecar codec: none (full attention
        only), the GDN state of the recurrent layers, or the window rows of the one sliding
        group (its snapshots kept by :class:`~pagedkv.integrations.mlx_lm.cold.
        SlidingSnapshots`). ``None`` when persistence is off."""
        from pagedkv.cold import SlidingWindowCodec
        from pagedkv.integrations.mlx_lm.cold import (
            ClosableColdHooks,
            SlidingSnapshots,
            gdn_codec_for,
            open_cold_tier,
        )

        def refuse(why: str, missing: str):
            raise UnsupportedModel(
                f"model_type {self.model_type!r}: cold_dir: {why}; run it without cold_dir "
                "(the hot cache works)", missing=missing)

        full = groups[0]
        sliding = [g for g in groups if g.kind.is_sliding]
        if not full.kind.is_full:
            refuse("the cold tier restores through a full-attention group's chain and this "
                   "model has none", "a full-attention group")
        sidecar = checkpoints = None
        if self.recurrent and sliding:
            refuse("a model with both recurrent and sliding-window layers needs a bundle of "
                   "both sidecars, which this integration does not build", "a sidecar bundle")
        if self.recurrent:
            sidecar = gdn_codec_for(self.layout.states)
            if sidecar is None:
                refuse(f"its recurrent state arrays {self.layout.states} are not a gated-delta "
                       "conv + recurrent pair, the one recurrent sidecar this integration "
                       "writes", "a recurrent sidecar codec")
            self.recurrent.codec = sidecar
            checkpoints = self.recurrent
        elif sliding:
            if len(sliding) != 1:
                refuse(f"its sliding layers form {len(sliding)} groups (windows or layouts "
                       "differ); the cold tier rebuilds one sliding group", "one sliding group")
            g = sliding[0]
            sidecar = SlidingWindowCodec(window=g.kind.window,
                                         num_layers=g.num_physical_layers,
                                         kv_heads=g.layout.num_kv_heads,
                                         head_dim=g.layout.head_dim, dtype=g.layout.dtype)
            self._snapshots = checkpoints = SlidingSnapshots(
                sidecar, g.physical_layer_indices, g.layout.dtype, self.block_size)
        geometry = full.layout.pool_geometry(full.num_physical_layers)
        context = open_cold_tier(cold_dir, model, geometry, model_dir=model_dir,
                                 sidecar=sidecar, checkpoints=checkpoints)
        if context is None:
            self._snapshots = None
            return None
        hooks = ClosableColdHooks(context)
        self._cold_context = context
        self.cold_tier = context.tier
        # close() or, failing that, interpreter exit persists what is queued.
        self._closer = weakref.finalize(self, hooks.close, COLD_DRAIN_SECONDS)
        return hooks

    def __repr__(self) -> str:
        with self._lock:
            if len(self.groups) == 1:
                g = self.geometry
                pool = self.coordinator.groups[0].pool
                layout = (f"layers={g.num_layers}, kv_heads={g.num_kv_heads}, "
                          f"head_dim={g.head_dim}, dtype={g.dtype!r}, block_size={g.block_size}, "
                          f"pool_blocks={pool.num_blocks}/{pool.max_num_blocks}")
            else:
                parts = []
                for spec, g in zip(self.groups, self.coordinator.groups, strict=True):
                    kind = "full" if spec.kind.is_full else f"sliding {spec.kind.window}"
                    parts.append(f"{kind}: {spec.num_physical_layers} layers "
                                 f"{spec.layout.num_kv_heads}x{spec.layout.head_dim} "
                                 f"{spec.layout.dtype} {g.pool.num_blocks}/"
                                 f"{g.pool.max_num_blocks} blocks")
                layout = f"block_size={self.block_size}, groups=[{'; '.join(parts)}]"
            recurrent = f", recurrent={len(self.recurrent.indices)}" if self.recurrent else ""
            return (f"PagedPromptCache(model_type={self.model_type!r}, {layout}{recurrent}, "
                    f"live={len(self._live)}, parked={len(self._parked)}, "
                    f"cold={'on' if self.cold_tier else 'off'})")

    # --- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Persist what the cold tier has queued and close it (also done at interpreter exit
        for a cache never closed). Idempotent; the hot cache keeps working without a tier."""
        if self._closer is not None:
            self._closer()
            self._closer = None
            self.cold_tier = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _reap(self) -> None:
        """Release the tables of requests collected without end() (their finalizers only
        queue the id, so no coordinator call ever runs inside garbage collection)."""
        while self._dropped:
            seq = self._dropped.popleft()
            if self.coordinator.release_request(seq):
                self._counters["released"] += 1

    def _make_room(self, blocks: int) -> None:
        """Release parked conversations, oldest first, while a full-attention group has fewer
        than ``blocks`` free or evictable blocks: a parked table must never make a pool
        grow. (Sliding groups need a window's blocks at most; :meth:`_with_room` covers
        them.)"""
        full = [g for g in self.coordinator.groups if g.kind_name == "full"]
        if any(blocks * self.block_size > g.capacity_tokens for g in full):
            return  # never fits: the reservation refuses it, released tables would be lost
        while self._parked and any(g.allocator.free_or_evictable_blocks < blocks
                                   for g in full):
            self._release_parked(next(iter(self._parked)))

    def _with_room(self, call):
        """``call()``, releasing parked conversations oldest first while it runs out of
        blocks (a parked table pins its blocks), then, once, the requests dropped without
        ``end`` that only the cyclic garbage collector frees (:meth:`_collect_dropped`)."""
        collected = False
        while True:
            try:
                return call()
            except PoolExhausted:
                if self._parked:
                    self._release_parked(next(iter(self._parked)))
                    continue
                if collected or not self._collect_dropped():
                    raise
                collected = True

    def _collect_dropped(self) -> bool:
        """Run Python's cyclic garbage collector, release the requests it collected, and say
        whether there were any. A request references its layers and each layer its request
        (mlx-lm code may hold either: ``pagedkv serve`` hands out the layers alone), so a
        request dropped without ``end`` or ``release`` (an exception mid-generation) is
        collected only when a full collection happens to run, its blocks held until then.
        Run before a ``PoolExhausted`` is raised: a full collection costs milliseconds, a
        refused request more."""
        import gc

        released = self._counters["released"]
        gc.collect()
        self._reap()
        return self._counters["released"] > released

    def release_parked(self, keep: int = 0) -> int:
        """Release parked conversations, oldest first, until ``keep`` remain; their published
        blocks stay cached (evictable). Returns how many were released."""
        with self._lock:
            released = 0
            while len(self._parked) > max(0, keep):
                self._release_parked(next(iter(self._parked)))
                released += 1
            return released

    def _release_parked(self, seq: int) -> None:
        del self._parked[seq]
        self.coordinator.release_request(seq)
        self._counters["parked_released"] += 1

    def _park(self, seq: int, tokens: np.ndarray, salt: int, states) -> None:
        if self.max_parked == 0 or len(tokens) == 0:
            self.coordinator.release_request(seq)
            return
        self._parked[seq] = (salt, tokens, states)
        while len(self._parked) > self.max_parked:
            self._release_parked(next(iter(self._parked)))

    def _take_parked(self, tokens: np.ndarray, salt: int):
        """The parked conversation with the longest token list that ``tokens`` extends by at
        least one token (the last prompt token is always computed), removed from the park
        (so that making room never releases it): ``(seq, its park entry, the conversations
        parked after it)`` or ``None``."""
        best, best_len = None, 0
        for seq, (s, held, _) in self._parked.items():
            n = len(held)
            if s == salt and best_len < n < len(tokens) and np.array_equal(tokens[:n], held):
                best, best_len = seq, n
        if best is None:
            return None
        order = list(self._parked)
        later = tuple(order[order.index(best) + 1:])
        return best, self._parked.pop(best), later

    def _continue_parked(self, tokens: np.ndarray, total: int, parked) -> int:
        """Continue the conversation :meth:`_take_parked` took: its table backs ``total``
        tokens from here. Returns the tokens it holds. A refusal (``CapacityExceeded``,
        ``PoolExhausted``) changes nothing of it: the continuation reserves all or nothing,
        and the conversation goes back to its place in the park."""
        seq, entry, later = parked
        try:
            prior, _ = self._with_room(
                lambda: self.coordinator.continue_turn(seq, tokens, total))
        except BaseException:
            self._parked[seq] = entry
            for other in later:  # back before the ones parked after it
                if other in self._parked:
                    self._parked.move_to_end(other)
            raise
        return prior

    @staticmethod
    def _offset_of(cache) -> int:
        for layer in cache:
            offset = getattr(layer, "offset", None)
            if isinstance(offset, int):
                return offset
        return 0

    # --- requests ------------------------------------------------------------------------

    def begin(self, prompt_tokens, *, cache_salt=None) -> PagedRequest:
        """Look up the longest cached prefix of ``prompt_tokens`` (a parked conversation it
        extends, else the hot prefix cache, then the cold tier) and return a request whose
        ``cache`` holds it: run ``prompt_tokens[request.cached_tokens:]`` with
        ``prompt_cache=request.cache``. ``cache_salt`` (a tenant name or domain id) keeps
        tenants' prefixes apart. The last prompt token is never served from the cache.

        A model with recurrent layers resumes only where a state was checkpointed, and
        ``begin`` then runs the rest of the prompt up to its last block boundary through the
        model, split at the checkpoint ladder's rungs (docs/integrations/mlx-lm.md,
        "Recurrent hybrids"): ``cached_tokens`` includes those ``prefilled_tokens``."""
        tokens = _as_tokens(prompt_tokens, "prompt_tokens")
        if len(tokens) == 0:
            raise InvalidArgument("prompt_tokens is empty; mlx-lm needs at least one token")
        salt = _salt(cache_salt)
        with self._lock:
            self._reap()
            lc = self.coordinator
            parked = self._take_parked(tokens, salt)
            seq = parked[0] if parked is not None else next(self._ids)
            self._make_room(-(-len(tokens) // self.block_size))
            restored0 = lc.stats()["restored_blocks"]
            # Sliding groups reserve chunk by chunk (pruning between), never a whole prompt.
            total = 0 if self._sliding else len(tokens)
            continued = parked is not None
            if continued:
                cached = self._continue_parked(tokens, total, parked)
            else:
                cached = self._with_room(lambda: turns.prepare_turn(
                    lc, seq, tokens, total_tokens=total, cache_salt=salt)).cached_tokens
            restored = (lc.stats()["restored_blocks"] - restored0) * self.block_size
            request = PagedRequest(self, seq, tokens.copy(), salt, cached, restored)
            try:
                states = None
                if self.recurrent and cached:
                    if continued:
                        states = parked[1][2]  # the recurrent states it ended with
                    else:
                        states = self.recurrent.from_lookup(lc.take_restored_sidecar(seq))
                        lc.confirm_aux_prefix_primed(seq, cached)
                request.cache = self._load(seq, cached, len(tokens), request, states)
                if self.recurrent:
                    request.prefilled_tokens = self.recurrent.prefill(self.model, request)
                    request.cached_tokens += request.prefilled_tokens
            except BaseException:
                request._finalizer.detach()
                request.state = "released"
                lc.release_request(seq)
                raise
            self._live[seq] = request
            c = self._counters
            c["requests"] += 1
            c["prompt_tokens"] += len(tokens)
            c["hit_tokens"] += cached
            c["restored_tokens"] += restored
            c["prefilled_tokens"] += request.prefilled_tokens
            if continued:
                c["continued_tokens"] += cached
            return request

    def _stream(self):
        import mlx.core as mx

        from pagedkv.pool.mlx_storage import pool_stream
        stream = pool_stream(mx)
        return mx.stream(stream) if stream is not None else mx.stream(mx.default_stream(
            mx.default_device()))

    def _new_layers(self, request: PagedRequest, states=None) -> list[Any]:
        """Empty per-layer caches of ``request`` in cache-list order (recurrent layers with
        ``states`` installed when given)."""
        layers: list[Any] = []
        recurrent = dict(zip(self.recurrent.indices, states or (), strict=False))
        for spec in self._entries:
            i = spec.index
            if spec.kind is LayerKind.FULL and self._paged is not None:
                layers.append(PagedAttentionLayerCache(request, i))
            elif spec.kind is LayerKind.FULL:
                layers.append(PagedKVLayerCache(request, i))
            elif spec.kind is LayerKind.SLIDING:
                layers.append(PagedSlidingLayerCache(request, i, self._windows[i]))
            else:
                arrays = recurrent.get(i)
                layers.append(PagedStateLayerCache(request, i, len(self.layout.states[i]),
                                                   None if arrays is None else
                                                   self.recurrent.check(i, arrays)))
        return layers

    def _load(self, seq: int, cached: int, prompt_len: int, request: PagedRequest, states):
        """Per-layer caches holding the ``cached`` leading positions, gathered lazily from
        the pool into buffers with room for the prompt (a full layer's for all of it, a
        sliding layer's for its window and the first prefill chunk)."""
        layers = self._new_layers(request, states)
        if self._paged is not None:  # the prefix stays in the pool, where decode reads it
            for layer in layers:
                layer.offset = cached
            return layers
        if not cached:
            return layers
        import mlx.core as mx

        lc = self.coordinator
        with self._stream():
            for i in self._kv:
                layer = layers[i]
                dtype = getattr(mx, self.layout.kv[i].dtype)
                if isinstance(layer, PagedSlidingLayerCache):
                    first = lc.first_live_position(seq, self._routes[i].group_id)
                    k, v = lc.gather_kv(seq, i, start=first)
                    need = cached - first + min(prompt_len - cached, PREFILL_CHUNK_TOKENS)
                else:
                    first = 0
                    k, v = lc.gather_kv(seq, i)  # [cached, heads, dim], lazy
                    need = prompt_len
                if self._pools[i].geometry.quantized:  # a KV mode's records: decoded
                    k, v = self._pools[i].decode_tokens(k, v)
                keys, values = kv_buffers(k, v, cached - first, need, dtype)
                layer.keys, layer.values, layer.offset = keys, values, cached
                if isinstance(layer, PagedSlidingLayerCache):
                    layer.start = first
        return layers

    def _write_through(self, request: PagedRequest, index: int, prev: int, keys, values) -> None:
        """A sliding layer of ``request`` computed positions ``[prev, prev + n)``. The first
        sliding layer of a forward records the prompt's tokens among them; each sliding layer
        writes its K/V there (a lazy scatter); the last prunes the sliding groups at the new
        frontier, publishing and freeing the blocks the window left. Positions past the
        prompt (token ids unknown until ``end``) stop the write-through; so does a failure
        (logged and counted: ``end`` then writes what the buffers still hold)."""
        if request.state != "live":
            return
        lc = self.coordinator
        if index == self._sliding[0]:
            request._chunk = None
            stop = min(prev + keys.shape[2], len(request.prompt_tokens))
            if stop <= prev:
                request._write_through = False  # the prompt is done
                return
            if prev != request._recorded:
                return
            with self._lock:
                try:
                    self._with_room(lambda: lc.record_tokens(
                        request._seq, request.prompt_tokens[prev:stop]))
                except PagedKVError as exc:
                    self._stop_write_through(request, exc)
                    return
            request._chunk = (prev, stop)
        chunk = request._chunk
        if chunk is None or chunk[0] != prev:
            return
        n = chunk[1] - prev
        dtype = self._mx_pool_dtype(index)
        k = keys[0, :, :n, :].transpose(1, 0, 2).astype(dtype)
        v = values[0, :, :n, :].transpose(1, 0, 2).astype(dtype)
        with self._lock:
            try:
                with self._stream():
                    lc.write_kv(request._seq, index, k, v, start=prev)
                if index == self._sliding[-1]:
                    if self._snapshots is not None:  # before the prune drops their rows
                        for b in self._snapshots.due(prev, chunk[1]):
                            self._snapshots.publish(request.prompt_tokens, b, request.cache,
                                                    request.cache_salt, request._seq)
                    lc.prune_sliding_all(request._seq, chunk[1])
                    request._recorded = chunk[1]
                    request._chunk = None
                    # Evaluate the chunk's scatters now, on the pool's stream, while the
                    # prefill runs: left pending they would keep every chunk's K/V alive
                    # until MAX_PENDING_WRITES writes, and be computed during a later
                    # request's decode.
                    for i in self._sliding_groups:
                        lc.groups[i].pool.flush()
            except PagedKVError as exc:
                # The chunk is recorded but not written in every sliding layer: take it back
                # (no prune ran for it), so the row's cursor is what the pool holds.
                lc.rollback_last_tokens(request._seq, lc.num_tokens(request._seq)
                                        - request._recorded)
                self._stop_write_through(request, exc)

    def _stop_write_through(self, request: PagedRequest, exc: Exception) -> None:
        request._write_through = False
        request._chunk = None
        self._counters["write_through_stops"] += 1
        log.warning("pagedkv: request %s stops writing its prompt through to the sliding "
                    "groups (%s); end() writes what its buffers still hold",
                    request.request_id, exc)

    def _mx_pool_dtype(self, index: int):
        """The MLX dtype layer ``index``'s K/V enter its pool as: the pool's own dtype, or
        float32 for a KV-mode pool (its codecs encode float values as they are written)."""
        import mlx.core as mx

        g = self._pools[index].geometry
        return mx.float32 if g.quantized else getattr(mx, g.dtype)

    def _end(self, request: PagedRequest, tokens) -> int:
        toks = _as_tokens(tokens)
        layers = request.cache
        offsets = {layers[i].offset for i in self._kv}
        if len(offsets) != 1:
            raise InvalidArgument(
                f"end: the layers of request {request.request_id} hold different token counts "
                f"{sorted(offsets)} (a forward was interrupted?); release() it instead")
        (n,) = offsets
        if len(toks) != n:
            raise InvalidArgument(
                f"end: tokens has {len(toks)} ids but request {request.request_id}'s cache "
                f"holds {n} tokens; pass exactly the tokens the cache holds (prompt + every "
                "token fed back to the model)")
        buffers = {i: (layers[i].keys, layers[i].values, getattr(layers[i], "start", 0))
                   for i in self._kv}
        states = self.recurrent.states_of(layers) if self.recurrent else None
        with self._lock:
            self._reap()
            if self._paged is not None:  # every position is in the pool: record the real ids
                self._paged.finish(request, toks)
            if self._snapshots is not None:  # the window the cold tier persists
                self._snapshots.publish(toks, self._snapshots.deepest_ready(layers, n), layers,
                                        request.cache_salt, request._seq)
            try:
                written = self._publish(request._seq, toks, buffers, request._full_from,
                                        request.cache_salt, states)
            except BaseException:
                # The row may be half written: it is released, never published further.
                request._finalizer.detach()
                self.coordinator.release_request(request._seq)
                self._live.pop(request._seq, None)
                request.state = "released"
                self._counters["released"] += 1
                raise
            request._finalizer.detach()
            request.state = "ended"
            request._pool_tokens = toks
            self._live.pop(request._seq, None)
            return written

    def insert(self, tokens, cache: Sequence[Any], *, cache_salt=None) -> int:
        """Publish K/V computed outside a paged request (mlx-lm's batching returns
        ``KVCache`` / ``RotatingKVCache`` / ``ArraysCache`` lists:
        ``batch_generate(..., return_prompt_caches=True)``, the server's batched path):
        ``cache`` holds exactly ``tokens``. Positions already in the pool are not written
        again. A list of one live request's own layers ends that request. A sliding layer
        must hold the positions its group's last window needs (mlx-lm's batched
        ``RotatingKVCache`` keeps the window only, which rarely starts on a block:
        ``InvalidArgument`` then, nothing published). Returns the tokens written."""
        toks = _as_tokens(tokens)
        salt = _salt(cache_salt)
        cache = items_argument("cache", cache)
        owner = getattr(cache[0], "request", None) if cache else None
        if isinstance(owner, PagedRequest) and owner._owner is self and owner.state == "live" \
                and all(getattr(c, "request", None) is owner for c in cache):
            return owner.end(toks)
        n = len(toks)
        if len(cache) != len(self._entries):
            raise InvalidArgument(f"insert: cache has {len(cache)} layers, the model's cache "
                                  f"list {len(self._entries)}")
        buffers, states = {}, []
        for spec in self._entries:
            i, c = spec.index, cache[spec.index]
            if spec.kind is LayerKind.RECURRENT:
                arrays = getattr(c, "cache", None)
                if arrays is None or (n and any(a is None for a in arrays)):
                    raise InvalidArgument(f"insert: layer {i} is recurrent; pass its "
                                          "ArraysCache (the state after tokens)")
                states.append(self.recurrent.check(i, arrays) if n else ())
                continue
            buffers[i] = self._inserted_kv(i, spec, c, n)
        with self._lock:
            self._reap()
            lc = self.coordinator
            seq = next(self._ids)
            lc.reset_for_new_request(seq)
            try:
                hit = self._with_room(lambda: lc.find_cached_prefix(seq, toks,
                                                                    cache_salt=salt))
                lc.take_restored_sidecar(seq)
                lc.confirm_aux_prefix_primed(seq, hit.cached_tokens)
                return self._publish(seq, toks, buffers, hit.cached_tokens, salt,
                                     tuple(states) if self.recurrent and n else None)
            except BaseException:
                lc.release_request(seq)
                raise

    def _inserted_kv(self, i: int, spec, c, n: int):
        """``(keys, values, start)`` of an mlx-lm K/V cache holding ``n`` tokens: ``keys``
        ``[1, heads, >= n - start, dim]`` for positions ``[start, n)``."""
        g = self.layout.kv[i]
        keys = getattr(c, "keys", None)
        offset = getattr(c, "offset", None)
        if keys is None and n == 0:
            return None, None, 0
        if keys is None or not isinstance(offset, int) or offset != n:
            raise InvalidArgument(
                f"insert: layer {i} holds {offset!r} tokens, tokens has {n}; pass a "
                "KVCache-style list (keys, values, offset) holding exactly tokens")
        values, start = getattr(c, "values", None), 0
        if getattr(keys, "ndim", None) != 4 or getattr(values, "ndim", None) != 4:
            raise InvalidArgument(
                f"insert: layer {i} K/V have shapes {getattr(keys, 'shape', None)} and "
                f"{getattr(values, 'shape', None)}, expected arrays [1, {g.num_kv_heads}, "
                f">= {n}, {g.head_dim}]")
        assert values is not None  # its ndim is 4
        if isinstance(c, PagedSlidingLayerCache):
            start = c.start
        elif hasattr(c, "_temporal_order"):  # RotatingKVCache: the window, oldest first
            keys, values = c._temporal_order(keys), c._temporal_order(values)
            start = n - keys.shape[2]
        elif spec.kind is LayerKind.SLIDING and keys.shape[2] < n:
            raise InvalidArgument(f"insert: layer {i} holds {keys.shape[2]} positions for "
                                  f"{n} tokens")
        got = (keys.shape[0], keys.shape[1], keys.shape[3])
        if got != (1, g.num_kv_heads, g.head_dim) or values.shape[3] != g.head_dim:
            raise InvalidArgument(f"insert: layer {i} K is {tuple(keys.shape)}, expected "
                                  f"[1, {g.num_kv_heads}, >= {n - start}, {g.head_dim}]")
        return keys, values, start

    def _publish(self, seq: int, toks: np.ndarray, buffers, full_from: int, salt: int,
                 states) -> int:
        """Write the positions the pool lacks from ``buffers`` (per K/V layer ``(keys,
        values, start)``: index ``j`` holds position ``start + j``), publish every full block
        and the sliding windows, checkpoint the recurrent state at a block boundary, and park
        the tables. Full layers' K/V are in the pool before ``full_from``.

        A row whose tokens are not a prefix of ``toks`` (the cache was trimmed or rewritten
        under them) starts over from a lookup, so a shared block is never written. A sliding
        layer that no longer holds the positions after the row's cursor (it keeps about one
        window: a long generation) publishes its group's last window only: the blocks it
        dropped are recorded without being published (``prune_sliding(publish=False)``)."""
        lc = self.coordinator
        n = len(toks)
        held = lc.num_tokens(seq)
        if held > n or not np.array_equal(lc.request_tokens(seq), toks[:held]):
            lc.reset_for_new_request(seq)
            held = self._with_room(lambda: lc.find_cached_prefix(
                seq, toks, cache_salt=salt)).cached_tokens
            lc.take_restored_sidecar(seq)
            lc.confirm_aux_prefix_primed(seq, held)
        full_from = min(full_from, held)
        sliding = [(i, buffers[i]) for i in self._sliding]
        self._make_room(-(-n // self.block_size) - lc.num_table_blocks(seq, 0))
        if sliding and max(b[2] for _, b in sliding) > held:
            self._publish_with_gap(seq, toks, held, sliding)
        else:
            for a in range(held, n, _END_CHUNK_TOKENS):
                b = min(n, a + _END_CHUNK_TOKENS)
                self._with_room(lambda a=a, b=b: lc.record_tokens(seq, toks[a:b]))
                if sliding:
                    self._write_layers(seq, sliding, a, b)
                    lc.prune_sliding_all(seq, b)
        self._write_layers(seq, [(i, buffers[i]) for i in self._full], full_from, n)
        for g in lc.groups:
            g.pool.flush()
        lc.finalize_turn_keep_live(seq, cache_salt=salt)
        new = n - full_from  # what this request added (written through or now)
        self._counters["published_tokens"] += new
        if states is not None and n:
            self.recurrent.publish(toks, n, states, salt, seq)
            if self._cold_context is not None and self.cold_tier is not None:
                self.recurrent.persist_lineage(self._cold_context, toks, salt)
        self._park(seq, toks, salt, states)
        return new

    def _publish_with_gap(self, seq: int, toks: np.ndarray, held: int, sliding) -> None:
        """Record ``toks[held:]`` when a sliding buffer lacks positions after ``held``: first
        up to where the smallest window's prune publishes exactly the blocks written before
        ``held`` (the prompt's last window), then the rest in chunks, dropping what the
        buffers lack unpublished, then each sliding layer's live window from its buffer."""
        lc = self.coordinator
        n, bs = len(toks), self.block_size
        need = {}
        for i, (_, _, start) in sliding:
            group = self._routes[i].group_id
            first = max(self._first_live_at(n, i), held)
            if start > first:
                raise InvalidArgument(
                    f"sliding layer {i} holds positions from {start}, but its group's window "
                    f"at {n} tokens needs them from {first} (block-aligned): mlx-lm's "
                    "RotatingKVCache keeps the window only; publish from the request's own "
                    "caches (end) instead")
            need[i] = (group, first)
        edge = max(held, min(n, held // bs * bs + min(self._windows.values()) - 1))
        self._with_room(lambda: lc.record_tokens(seq, toks[held:edge]))
        lc.prune_sliding_all(seq, edge)
        for a in range(edge, n, _END_CHUNK_TOKENS):
            b = min(n, a + _END_CHUNK_TOKENS)
            self._with_room(lambda a=a, b=b: lc.record_tokens(seq, toks[a:b]))
            lc.prune_sliding_all(seq, b, publish=False)
        for i, buf in sliding:
            self._write_layers(seq, [(i, buf)], need[i][1], n)

    def _first_live_at(self, n: int, index: int) -> int:
        from pagedkv.coordinator import expired_blocks

        return expired_blocks(n, self._windows[index], self.block_size) * self.block_size

    def _write_layers(self, seq: int, layers, a: int, b: int) -> None:
        """Write positions ``[a, b)`` of each ``(index, (keys, values, start))`` into the
        pool (lazy scatters, cast to the pool dtype). A write the pool refuses raises
        ``InvalidArgument`` naming the layer (and, for a non-finite value a KV mode cannot
        encode, K or V, the position and the kv-head)."""
        if b <= a:
            return
        lc = self.coordinator
        with self._stream():
            for i, (keys, values, start) in layers:
                if keys is None:  # attention="paged": the pool has them already
                    continue
                dtype = self._mx_pool_dtype(i)
                k = keys[0, :, a - start:b - start, :].transpose(1, 0, 2).astype(dtype)
                v = values[0, :, a - start:b - start, :].transpose(1, 0, 2).astype(dtype)
                try:
                    lc.write_kv(seq, i, k, v, start=a)
                except InvalidArgument as exc:
                    g = self._pools[i].geometry
                    where = _first_non_finite(k, v, a) if g.quantized else None
                    if where is None:
                        raise InvalidArgument(f"layer {i}, positions [{a}, {b}): {exc}") from exc
                    raise InvalidArgument(
                        f"layer {i}: {where}; a {g.dtype} pool takes finite K/V only") from exc

    def _release_request(self, request: PagedRequest, state: str = "released") -> None:
        with self._lock:
            request._finalizer.detach()
            self.coordinator.release_request(request._seq)
            self._live.pop(request._seq, None)
            request.state = state
            self._counters["handed_over" if state != "released" else "released"] += 1

    def _fork(self, request: PagedRequest) -> PagedRequest:
        """A new row re-acquiring the source's published blocks (a lookup over the tokens
        its table holds) and buffers that share the source's until either writes."""
        with self._lock:
            self._reap()
            lc = self.coordinator
            seq = next(self._ids)
            held = request._pool_tokens
            lc.reset_for_new_request(seq)
            try:
                hit = lc.find_cached_prefix(seq, held, cache_salt=request.cache_salt)
                lc.take_restored_sidecar(seq)
                lc.confirm_aux_prefix_primed(seq, hit.cached_tokens)
            except BaseException:
                lc.release_request(seq)
                raise
            fork = PagedRequest(self, seq, request.prompt_tokens, request.cache_salt,
                                request.cached_tokens, request.restored_tokens)
            fork.hit_tokens = request.hit_tokens
            fork.prefilled_tokens = request.prefilled_tokens
            fork._pool_tokens = held[:hit.cached_tokens]
            fork._full_from = fork._recorded = hit.cached_tokens
            fork._write_through = False
            # a[...] is a new array object over the same data: a write into either copies.
            layers: list[Any] = []
            for c in request.cache:
                if isinstance(c, PagedStateLayerCache):
                    layers.append(PagedStateLayerCache(fork, c.index, len(c.cache), c.cache))
                    continue
                keys = None if c.keys is None else c.keys[...]
                values = None if c.values is None else c.values[...]
                if isinstance(c, PagedSlidingLayerCache):
                    layers.append(PagedSlidingLayerCache(fork, c.index, c.window, keys, values,
                                                         c.offset, c.start))
                else:
                    layers.append(PagedKVLayerCache(fork, c.index, keys, values, c.offset))
            fork.cache = layers
            self._live[seq] = fork
            self._counters["forks"] += 1
            return fork

    # --- observability -------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters and pool occupancy, summed over the groups.

        ``hit_tokens``: prompt tokens served from the cache (hot, cold or parked);
        ``restored_tokens``: those the cold tier restored from disk; ``continued_tokens``:
        those a parked conversation supplied; ``prefilled_tokens``: those ``begin`` computed
        (recurrent models). ``blocks_in_use``: blocks holding K/V (referenced or cached);
        ``blocks_shared``: blocks referenced by two or more requests or parked
        conversations; ``bytes_in_use``: each in-use block times its group's bytes per block;
        ``sliding_blocks_in_use``: the part of ``blocks_in_use`` in sliding groups.
        """
        from pagedkv.allocator import BLOCK_CACHED

        with self._lock:
            self._reap()
            out = dict(self._counters)
            totals = dict.fromkeys(("blocks_in_use", "blocks_shared", "blocks_cached",
                                    "bytes_in_use", "pool_blocks", "pool_max_blocks",
                                    "pool_bytes", "evictions", "sliding_blocks_in_use"), 0)
            for g in self.coordinator.groups:
                a = g.allocator
                records = a.block_records[:a.num_blocks]
                refs = records["refcount"].astype(np.int64)
                if a.null_block_id is not None:
                    refs[a.null_block_id] = 0
                owners = refs - ((records["flags"] & BLOCK_CACHED) != 0)
                in_use = int((refs > 0).sum())
                totals["blocks_in_use"] += in_use
                totals["blocks_shared"] += int((owners >= 2).sum())
                totals["blocks_cached"] += int(a.prefix_cache_len)
                totals["bytes_in_use"] += in_use * g.pool.geometry.bytes_per_block
                totals["pool_blocks"] += g.pool.num_blocks
                totals["pool_max_blocks"] += g.pool.max_num_blocks
                totals["pool_bytes"] += g.pool.total_bytes
                totals["evictions"] += a.stats()["pressure_evictions"]
                if g.kind_name == "sliding":
                    totals["sliding_blocks_in_use"] += in_use
            out.update(totals)
            out.update(grow_events=self.coordinator.stats()["grow_events"],
                       live_requests=len(self._live), parked=len(self._parked))
            if self.recurrent and self.recurrent.store is not None:
                store = self.recurrent.store.stats()
                out.update(checkpoints=store["entries"], checkpoint_bytes=store["nbytes"],
                           checkpoint_hits=store["hits"])
            if self.cold_tier is not None:
                s = self.cold_tier.stats()
                out.update(cold_hits=s.hits, cold_misses=s.misses,
                           cold_corruptions=s.corruptions, cold_enqueued=s.enqueued)
            return out
