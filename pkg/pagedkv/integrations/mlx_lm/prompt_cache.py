"""``PagedPromptCache``: pagedkv as the prompt cache of an mlx-lm model.

One per loaded model. It owns a block allocator, an MLX pool, the request adapter and the
optional cold tier, and hands out requests:

    paged = PagedPromptCache(model)
    request = paged.begin(prompt)                       # hot lookup, then cold
    for token, logprobs in generate_step(mx.array(prompt[request.cached_tokens:]), model,
                                         prompt_cache=request.cache):
        ...
    request.end(prompt + generated)                     # publish, keep the tail warm

A request's layers attend over a private contiguous buffer (KVCache's code, so KVCache's
decode cost and bits); the pool is the store between requests: ``begin`` gathers a cached
prefix into the buffers, ``end`` scatters the positions the pool lacks and publishes every
full block, refcounted and shared by whoever asks for the same prefix next. After ``end`` the
request's table stays live ("parked", at most ``max_parked``): the next turn of that
conversation continues it exactly, tail block included. Details: docs/integrations/mlx-lm.md.

Not thread-safe beyond one lock: calls are serialized; build and evaluate a request's arrays
on one thread at a time (mlx-lm's server runs all generation on one thread).
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from pagedkv.adapter import PagedKVCacheAdapter, TurnPlanReason
from pagedkv.errors import (
    InvalidArgument,
    PoolExhausted,
    RequestClosed,
    UnsupportedModel,
)
from pagedkv.integrations.mlx_lm.layer_cache import STEP_TOKENS, PagedKVLayerCache
from pagedkv.integrations.mlx_lm.layer_kinds import (
    SERVED_KINDS,
    LayerKind,
    check_served,
    layer_specs,
)

__all__ = ["PagedPromptCache", "PagedRequest", "model_kv_geometry"]

#: The per-layer cache class of each served kind (hybrid support adds its kinds here).
LAYER_CACHE_CLASSES: dict[LayerKind, type] = {LayerKind.FULL: PagedKVLayerCache}
assert set(LAYER_CACHE_CLASSES) == SERVED_KINDS

#: Seconds ``close`` (or interpreter exit) waits for the cold tier's queued writes.
COLD_DRAIN_SECONDS = 30.0

#: Unquantized pool dtypes a paged prompt cache stores; it also stores every KV mode
#: (``"q8"``, ``"fwht4/q8"``, ``"fwht4/lloyd4"``, ...: docs/kv-quant.md).
_POOL_DTYPES = ("float16", "bfloat16", "float32")
#: Blocks a pool starts with when neither ``initial_blocks`` nor the env knob says.
_DEFAULT_INITIAL_BLOCKS = 64
#: Context (tokens) sizing the default max pool when the config names none.
_DEFAULT_CONTEXT_TOKENS = 32768


def model_type_of(model) -> str:
    """The mlx-lm ``model_type`` of a loaded model (``"unknown"`` when it has none)."""
    name = getattr(model, "model_type", None)
    if name is None:
        name = getattr(getattr(model, "args", None), "model_type", None)
    return str(name) if name else "unknown"


def _dtype_name(dtype) -> str:
    """An ``mx.Dtype``, NumPy dtype or name as one of the pool dtype names, or a KV mode
    (``"q8"``, ``"<K mode>/<V mode>"``) normalized as the pool spells it."""
    from pagedkv.quant import kv as kv_modes
    text = str(dtype)
    name = text.rsplit(".", 1)[-1]
    if name in _POOL_DTYPES:
        return name
    try:
        return kv_modes.join_kv_dtype(*kv_modes.split_kv_dtype(text))
    except InvalidArgument:
        raise InvalidArgument(
            f"dtype: {dtype!r} is not a paged prompt-cache dtype; use one of "
            f"{list(_POOL_DTYPES)} or a KV mode such as 'q8', 'fwht4/q8' or 'fwht4/lloyd4' "
            f"(docs/kv-quant.md)") from None


def model_kv_geometry(model, num_caches: int) -> tuple[int, int, str]:
    """``(num_kv_heads, head_dim, dtype name)`` of the model's K/V, read from one 1-token
    forward through mlx-lm's own caches (mlx-lm has no uniform geometry API: config field
    names differ per architecture). ``UnsupportedModel`` when layers disagree or K and V
    have different head dims (MLA): one pool holds one geometry."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    shapes = []
    for i, c in enumerate(caches[:num_caches]):
        k, v = c.keys, c.values
        shapes.append((i, int(k.shape[1]), int(k.shape[3]), int(v.shape[3]), k.dtype, v.dtype))
    i0, heads, k_dim, _, k_dtype, _ = shapes[0]
    for i, h, kd, vd, kt, vt in shapes:
        if kd != vd or kt != vt:
            raise UnsupportedModel(
                f"layer {i}: K is [.., {kd}] {kt} and V [.., {vd}] {vt}; one pool stores K "
                "and V of one head_dim and dtype (MLA-style caches need per-group pools)",
                layer=i, kind="full", missing="per-group pool geometry")
        if (h, kd, kt) != (heads, k_dim, k_dtype):
            raise UnsupportedModel(
                f"layer {i} has {h} KV heads x {kd} ({kt}) but layer {i0} has {heads} x "
                f"{k_dim} ({k_dtype}); one pool holds one geometry (per-group pools come with "
                "the grouped coordinator)", layer=i, kind="full",
                missing="per-group pool geometry")
    return heads, k_dim, _dtype_name(k_dtype)


def _as_tokens(tokens, name: str = "tokens") -> np.ndarray:
    """Token ids (a list, NumPy array or ``mx.array``, 1-D) as uint32, by the project's token
    rule (``pagedkv.hashing.as_token_array``)."""
    from pagedkv.hashing import as_token_array

    if not isinstance(tokens, (np.ndarray, list, tuple)):
        tokens = np.asarray(tokens)  # an mx.array: its buffer, no Python list
    return as_token_array(tokens, name)


def _salt(cache_salt) -> int:
    """``None`` → 0 (shared); a str (a tenant name) → its domain id; a u64 domain id as is."""
    from pagedkv.hashing import as_domain_id, salt_domain_id

    if isinstance(cache_salt, str):
        return salt_domain_id(cache_salt)
    return as_domain_id(cache_salt)


class PagedRequest:
    """One request's view of a :class:`PagedPromptCache`.

    ``cache``: the per-layer list to pass as ``prompt_cache=`` with
    ``prompt_tokens[cached_tokens:]``. ``cached_tokens``: leading prompt tokens whose K/V
    came from the cache (hot, cold or a parked conversation). End it with :meth:`end`
    (publish), :meth:`release` (discard) or let it be collected (discarded).
    """

    __slots__ = ("__weakref__", "_finalizer", "_owner", "_pool_tokens", "_seq", "cache",
                 "cache_salt", "cached_tokens", "prompt_tokens", "request_id", "restored_tokens",
                 "state")

    def __init__(self, owner: PagedPromptCache, seq: int, prompt: np.ndarray, salt: int,
                 cached: int, restored: int) -> None:
        self._owner = owner
        self._seq = seq
        self.request_id = seq
        self.prompt_tokens = prompt
        self.cache_salt = salt
        self.cached_tokens = cached
        self.restored_tokens = restored
        self.state = "live"
        self.cache: list[PagedKVLayerCache] = []
        # Tokens whose K/V the adapter row holds in pool blocks (a prefix of the context).
        self._pool_tokens = prompt[:cached]
        # A request dropped without end() gives its blocks back at the owner's next call.
        self._finalizer = weakref.finalize(self, owner._dropped.append, seq)

    def __repr__(self) -> str:
        offset = self.cache[0].offset if self.cache else 0
        return (f"PagedRequest(id={self.request_id}, state={self.state!r}, "
                f"prompt_tokens={len(self.prompt_tokens)}, cached_tokens={self.cached_tokens}, "
                f"restored_tokens={self.restored_tokens}, cache_tokens={offset})")

    @property
    def closed(self) -> bool:
        return self.state != "live"

    def _check_live(self, call: str) -> None:
        if self.state != "live":
            raise RequestClosed(f"{call}: request {self.request_id} is {self.state}; begin() a "
                                "new request")

    def end(self, tokens) -> int:
        """Publish the request: ``tokens`` is every token the cache now holds (prompt +
        generated, ``len(tokens) == request.cache[0].offset``). Writes the K/V positions the
        pool lacks, publishes every full block for reuse and parks the table so the next
        turn of this conversation continues it exactly. Returns the tokens written to the
        pool. ``InvalidArgument`` (nothing changed) when ``tokens`` does not match the cache;
        ``RequestClosed`` after end, release or a hand-over to a batch."""
        self._check_live("end")
        return self._owner._end(self, tokens)

    def release(self) -> None:
        """Discard the request: its pool references go back, nothing is published."""
        if self.state == "live":
            self._owner._release_request(self)

    def fork(self) -> PagedRequest:
        """An independent copy (what ``copy.deepcopy`` calls): same tokens and K/V, its own
        buffers and pool references; either may continue or end without the other."""
        self._check_live("fork")
        return self._owner._fork(self)

    def hand_over(self) -> None:
        """The caches were merged into a batch that owns copies (mlx-lm batching): release
        the pool references; the batch's extracted caches are published with
        ``PagedPromptCache.insert``."""
        if self.state == "live":
            self._owner._release_request(self, state="handed over to a batch")

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
        ``make_prompt_cache(model)``; a kind this build cannot page raises
        :class:`~pagedkv.errors.UnsupportedModel` naming the layer.
    block_size:
        Tokens per block (8, 16 or 32).
    max_blocks:
        The most blocks the pool may grow to (default: ``PAGEDKV_PAGED_CACHE_MEMORY_MB``, else
        one full context of the model's ``max_position_embeddings``, docs/pool.md "Sizing").
    dtype:
        Pool dtype (``"float16"``, ``"bfloat16"``, ``"float32"``; default: the model's K/V
        dtype, which keeps reuse bit-exact; another dtype casts at the pool boundary), or a
        KV mode (``"q8"``, ``"fwht4/q8"``, ``"fwht4/lloyd4"``, ...: docs/kv-quant.md): K/V
        are encoded as they enter the pool and decoded back to the model's dtype when a
        cached prefix is loaded, so reuse is as exact as the mode (the model's own
        per-request cache is not quantized).
    cold_dir:
        A directory for the cold tier: full blocks persist there and a later process with
        the same model restores them (``None``: no cold tier).
    model_dir:
        The model's directory, so the cold-tier fingerprint uses its files (weight digests
        cached in the tier); default: a digest of the loaded parameters.
    initial_blocks:
        Pool blocks at start (default 64, or ``PAGEDKV_PAGED_CACHE_INITIAL_MB``); it grows on
        demand up to ``max_blocks``.
    max_parked:
        Ended conversations whose tables stay live for an exact continuation (default 32);
        the oldest is released first, and all are released under pool pressure.
    """

    def __init__(self, model, *, block_size: int = 16, max_blocks: int | None = None,
                 dtype=None, cold_dir=None, model_dir=None, initial_blocks: int | None = None,
                 max_parked: int = 32) -> None:
        from pagedkv.allocator import BlockAllocator
        from pagedkv.pool import LayerKVPool, PoolGeometry
        from pagedkv.sizing import PagedCacheConfig, resolve_pool_sizing

        model_type = model_type_of(model)
        specs = layer_specs(model)
        check_served(specs, model_type)
        config = PagedCacheConfig(block_size=block_size).with_env()
        if max_parked < 0:
            raise InvalidArgument(f"max_parked: {max_parked} must be >= 0")
        heads, head_dim, kv_dtype = model_kv_geometry(model, len(specs))
        pool_dtype = kv_dtype if dtype is None else _dtype_name(dtype)
        geometry = PoolGeometry(len(specs), heads, head_dim, block_size, pool_dtype)
        context = int(getattr(getattr(model, "args", None), "max_position_embeddings", 0)
                      or _DEFAULT_CONTEXT_TOKENS)
        sizing = resolve_pool_sizing(geometry, config, max_model_len=context)
        if max_blocks is None:
            max_blocks = sizing.max_blocks
        elif isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
            raise InvalidArgument(f"max_blocks: {max_blocks!r} must be a positive int")
        if initial_blocks is None:
            initial_blocks = (sizing.initial_blocks if config.initial_memory_mb is not None
                              else _DEFAULT_INITIAL_BLOCKS)
        initial_blocks = max(1, min(int(initial_blocks), max_blocks))

        self.model_type = model_type
        self.layers = specs
        self.geometry = geometry
        self.kv_dtype = kv_dtype
        self.max_parked = int(max_parked)
        self.allocator = BlockAllocator(initial_blocks, max_blocks, block_size)
        self.pool = LayerKVPool(geometry, initial_blocks, max_blocks, backend="mlx")
        self.cold_tier = None
        cold = None
        self._closer = None
        if cold_dir is not None:
            from pagedkv.integrations.mlx_lm.cold import ClosableColdHooks, open_cold_tier
            context = open_cold_tier(cold_dir, model, geometry, model_dir=model_dir)
            if context is not None:
                cold = ClosableColdHooks(context)
                self.cold_tier = context.tier
                # close() or, failing that, interpreter exit persists what is queued.
                self._closer = weakref.finalize(self, cold.close, COLD_DRAIN_SECONDS)
        # One call site for the adapter's cold-tier keyword (renamed `cold=` on main soon).
        self.adapter = PagedKVCacheAdapter(self.allocator, self.pool, cold=cold)
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._parked: collections.OrderedDict[int, tuple[int, np.ndarray]] = \
            collections.OrderedDict()
        self._dropped: collections.deque[int] = collections.deque()
        self._live: weakref.WeakValueDictionary[int, PagedRequest] = \
            weakref.WeakValueDictionary()
        self._counters = dict.fromkeys((
            "requests", "prompt_tokens", "hit_tokens", "restored_tokens", "continued_tokens",
            "published_tokens", "forks", "handed_over", "released", "parked_released"), 0)

    def __repr__(self) -> str:
        g = self.geometry
        return (f"PagedPromptCache(model_type={self.model_type!r}, layers={g.num_layers}, "
                f"kv_heads={g.num_kv_heads}, head_dim={g.head_dim}, dtype={g.dtype!r}, "
                f"block_size={g.block_size}, pool_blocks={self.pool.num_blocks}/"
                f"{self.pool.max_num_blocks}, live={len(self._live)}, "
                f"parked={len(self._parked)}, cold={'on' if self.cold_tier else 'off'})")

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
        queue the id, so no adapter call ever runs inside garbage collection)."""
        while self._dropped:
            seq = self._dropped.popleft()
            if self.adapter.release_request(seq):
                self._counters["released"] += 1

    def _make_room(self, blocks: int) -> None:
        """Release parked conversations, oldest first, while the allocator has fewer than
        ``blocks`` free or evictable blocks: a parked table must never make the pool grow."""
        allocator = self.allocator
        while self._parked and allocator.free_or_evictable_blocks < blocks:
            self._release_parked(next(iter(self._parked)))

    def _with_room(self, call):
        """``call()``, releasing parked conversations oldest first while it runs out of
        blocks (a parked table pins its blocks)."""
        while True:
            try:
                return call()
            except PoolExhausted:
                if not self._parked:
                    raise
                self._release_parked(next(iter(self._parked)))

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
        self.adapter.release_request(seq)
        self._counters["parked_released"] += 1

    def _park(self, seq: int, tokens: np.ndarray, salt: int) -> None:
        if self.max_parked == 0 or len(tokens) == 0:
            self.adapter.release_request(seq)
            return
        self._parked[seq] = (salt, tokens)
        while len(self._parked) > self.max_parked:
            self._release_parked(next(iter(self._parked)))

    def _take_parked(self, tokens: np.ndarray, salt: int) -> int | None:
        """The parked conversation with the longest token list that ``tokens`` extends by at
        least one token (the last prompt token is always computed), removed from the park."""
        best, best_len = None, 0
        for seq, (s, held) in self._parked.items():
            n = len(held)
            if s == salt and best_len < n < len(tokens) and np.array_equal(tokens[:n], held):
                best, best_len = seq, n
        if best is not None:
            del self._parked[best]
        return best

    # --- requests ------------------------------------------------------------------------

    def begin(self, prompt_tokens, *, cache_salt=None) -> PagedRequest:
        """Look up the longest cached prefix of ``prompt_tokens`` (a parked conversation it
        extends, else the hot prefix cache, then the cold tier) and return a request whose
        ``cache`` holds it: run ``prompt_tokens[request.cached_tokens:]`` with
        ``prompt_cache=request.cache``. ``cache_salt`` (a tenant name or domain id) keeps
        tenants' prefixes apart. The last prompt token is never served from the cache."""
        tokens = _as_tokens(prompt_tokens, "prompt_tokens")
        if len(tokens) == 0:
            raise InvalidArgument("prompt_tokens is empty; mlx-lm needs at least one token")
        salt = _salt(cache_salt)
        with self._lock:
            self._reap()
            adapter = self.adapter
            seq = self._take_parked(tokens, salt)
            if seq is None:
                seq = next(self._ids)
            self._make_room(-(-len(tokens) // self.geometry.block_size))
            restored0 = adapter.stats()["restored_blocks"]
            plan = self._with_room(lambda: adapter.prepare_turn(
                seq, tokens, total_tokens=len(tokens), cache_salt=salt))
            restored = (adapter.stats()["restored_blocks"] - restored0) * self.geometry.block_size
            cached = plan.cached_tokens
            request = PagedRequest(self, seq, tokens.copy(), salt, cached, restored)
            try:
                request.cache = self._load(seq, cached, len(tokens), request)
            except BaseException:
                request._finalizer.detach()
                adapter.release_request(seq)
                raise
            self._live[seq] = request
            c = self._counters
            c["requests"] += 1
            c["prompt_tokens"] += len(tokens)
            c["hit_tokens"] += cached
            c["restored_tokens"] += restored
            if plan.reason is TurnPlanReason.CONTINUED_LIVE_PREFIX:
                c["continued_tokens"] += cached
            return request

    def _stream(self):
        import mlx.core as mx

        from pagedkv.pool.mlx_storage import pool_stream
        stream = pool_stream(mx)
        return mx.stream(stream) if stream is not None else mx.stream(mx.default_stream(
            mx.default_device()))

    def _load(self, seq: int, cached: int, prompt_len: int, request: PagedRequest):
        """Per-layer caches holding the ``cached`` leading positions, gathered lazily from
        the pool into buffers with room for the whole prompt (prefill appends in place)."""
        layers = [LAYER_CACHE_CLASSES[spec.kind](request, spec.index) for spec in self.layers]
        if not cached:
            return layers
        import mlx.core as mx

        g = self.geometry
        capacity = -(-prompt_len // STEP_TOKENS) * STEP_TOKENS
        dtype = getattr(mx, self.kv_dtype)
        shape = (1, g.num_kv_heads, capacity, g.head_dim)
        with self._stream():
            for i, layer in enumerate(layers):
                k, v = self.adapter.gather_kv(seq, i)  # [cached, heads, dim], lazy
                if g.quantized:  # records of a KV mode: decoded in MLX ops
                    k, v = self.pool.decode_tokens(k, v)
                keys = mx.zeros(shape, dtype)
                values = mx.zeros(shape, dtype)
                keys[..., :cached, :] = k.transpose(1, 0, 2)[None].astype(dtype)
                values[..., :cached, :] = v.transpose(1, 0, 2)[None].astype(dtype)
                layer.keys, layer.values, layer.offset = keys, values, cached
        return layers

    def _end(self, request: PagedRequest, tokens) -> int:
        toks = _as_tokens(tokens)
        layers = request.cache
        offsets = {layer.offset for layer in layers}
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
        with self._lock:
            self._reap()
            written = self._publish(request._seq, toks, [(c.keys, c.values) for c in layers],
                                    request.cache_salt)
            request._finalizer.detach()
            request.state = "ended"
            request._pool_tokens = toks
            self._live.pop(request._seq, None)
            return written

    def insert(self, tokens, cache: Sequence[Any], *, cache_salt=None) -> int:
        """Publish K/V computed outside a paged request (mlx-lm's batching returns
        ``KVCache`` lists: ``batch_generate(..., return_prompt_caches=True)``, the server's
        batched path): ``cache`` holds exactly ``tokens``. Positions already in the pool are
        not written again. A list of one live request's own layers ends that request.
        Returns the tokens written to the pool."""
        toks = _as_tokens(tokens)
        salt = _salt(cache_salt)
        if cache and all(isinstance(c, PagedKVLayerCache) for c in cache):
            owner = cache[0].request
            if all(c.request is owner for c in cache) and owner._owner is self \
                    and owner.state == "live":
                return owner.end(toks)
        g = self.geometry
        if len(cache) != g.num_layers:
            raise InvalidArgument(f"insert: cache has {len(cache)} layers, the model {g.num_layers}")
        for i, c in enumerate(cache):
            keys = getattr(c, "keys", None)
            offset = getattr(c, "offset", None)
            if keys is None and len(toks) == 0:
                continue
            if keys is None or not isinstance(offset, int) or offset != len(toks):
                raise InvalidArgument(
                    f"insert: layer {i} holds {offset!r} tokens, tokens has {len(toks)}; pass "
                    "a KVCache-style list (keys, values, offset) holding exactly tokens")
            want = (1, g.num_kv_heads, g.head_dim)
            got = (keys.shape[0], keys.shape[1], keys.shape[3])
            if got != want or c.values.shape[3] != g.head_dim:
                raise InvalidArgument(f"insert: layer {i} K is {tuple(keys.shape)}, expected "
                                      f"[1, {g.num_kv_heads}, >= {len(toks)}, {g.head_dim}]")
        with self._lock:
            self._reap()
            seq = next(self._ids)
            self.adapter.reset_for_new_request(seq)
            try:
                self.adapter.find_cached_prefix(seq, toks, cache_salt=salt)
                return self._publish(seq, toks, [(c.keys, c.values) for c in cache], salt)
            except BaseException:
                self.adapter.release_request(seq)
                raise

    def _publish(self, seq: int, toks: np.ndarray, buffers, salt: int) -> int:
        """Write positions ``[R, n)`` (R: what the row's table holds) from ``buffers`` into
        the pool, publish the full blocks and park the table. A row whose tokens are not a
        prefix of ``toks`` (the cache was trimmed or rewritten under them) starts over from
        a lookup, so a shared block is never written."""
        adapter = self.adapter
        n = len(toks)
        held = adapter.num_tokens(seq)
        if held > n or not np.array_equal(adapter.request_tokens(seq), toks[:held]):
            adapter.reset_for_new_request(seq)
            held = self._with_room(lambda: adapter.find_cached_prefix(
                seq, toks, cache_salt=salt)).cached_tokens
        new = n - held
        if new:
            bs = self.geometry.block_size
            self._make_room(-(-n // bs) - adapter.num_table_blocks(seq))
            self._with_room(lambda: adapter.record_tokens(seq, toks[held:]))
            import mlx.core as mx
            g = self.geometry
            # A KV-mode pool takes float values and encodes them (float32: what its codecs
            # read); an unquantized pool takes its own dtype.
            pool_dtype = mx.float32 if g.quantized else getattr(mx, g.dtype)
            with self._stream():
                for i, (keys, values) in enumerate(buffers):
                    k = keys[0, :, held:n, :].transpose(1, 0, 2).astype(pool_dtype)
                    v = values[0, :, held:n, :].transpose(1, 0, 2).astype(pool_dtype)
                    adapter.write_kv(seq, i, k, v)
            self.pool.flush()
        adapter.finalize_turn_keep_live(seq, cache_salt=salt)
        self._counters["published_tokens"] += new
        self._park(seq, toks, salt)
        return new

    def _release_request(self, request: PagedRequest, state: str = "released") -> None:
        with self._lock:
            request._finalizer.detach()
            self.adapter.release_request(request._seq)
            self._live.pop(request._seq, None)
            request.state = state
            self._counters["handed_over" if state != "released" else "released"] += 1

    def _fork(self, request: PagedRequest) -> PagedRequest:
        """A new row re-acquiring the source's published blocks (a lookup over the tokens
        its table holds) and buffers that share the source's until either writes."""
        with self._lock:
            self._reap()
            seq = next(self._ids)
            held = request._pool_tokens
            self.adapter.reset_for_new_request(seq)
            try:
                hit = self.adapter.find_cached_prefix(seq, held, cache_salt=request.cache_salt)
            except BaseException:
                self.adapter.release_request(seq)
                raise
            fork = PagedRequest(self, seq, request.prompt_tokens, request.cache_salt,
                                request.cached_tokens, request.restored_tokens)
            fork._pool_tokens = held[:hit.cached_tokens]
            # a[...] is a new array object over the same data: a write into either copies.
            fork.cache = [type(c)(fork, c.index, None if c.keys is None else c.keys[...],
                                  None if c.values is None else c.values[...], c.offset)
                          for c in request.cache]
            self._live[seq] = fork
            self._counters["forks"] += 1
            return fork

    # --- observability -------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters and pool occupancy.

        ``hit_tokens``: prompt tokens served from the cache (hot, cold or parked);
        ``restored_tokens``: those the cold tier restored from disk; ``continued_tokens``:
        those a parked conversation supplied. ``blocks_in_use``: blocks holding K/V
        (referenced or cached); ``blocks_shared``: blocks referenced by two or more
        requests or parked conversations; ``bytes_in_use``: ``blocks_in_use`` times the
        bytes of a block over all layers.
        """
        from pagedkv.allocator import BLOCK_CACHED

        with self._lock:
            self._reap()
            a = self.allocator
            records = a.block_records[:a.num_blocks]
            refs = records["refcount"].astype(np.int64)
            owners = refs - ((records["flags"] & BLOCK_CACHED) != 0)
            in_use = int((refs > 0).sum())
            out = dict(self._counters)
            out.update(
                blocks_in_use=in_use,
                blocks_shared=int((owners >= 2).sum()),
                blocks_cached=int(a.prefix_cache_len),
                bytes_in_use=in_use * self.geometry.bytes_per_block,
                pool_blocks=self.pool.num_blocks,
                pool_max_blocks=self.pool.max_num_blocks,
                pool_bytes=self.pool.total_bytes,
                grow_events=self.adapter.stats()["grow_events"],
                evictions=a.stats()["pressure_evictions"],
                live_requests=len(self._live),
                parked=len(self._parked),
            )
            if self.cold_tier is not None:
                s = self.cold_tier.stats()
                out.update(cold_hits=s.hits, cold_misses=s.misses,
                           cold_corruptions=s.corruptions, cold_enqueued=s.enqueued)
            return out
