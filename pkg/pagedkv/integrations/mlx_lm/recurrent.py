"""Recurrent-state checkpoints of a paged mlx-lm model (docs/integrations/mlx-lm.md,
"Recurrent hybrids").

A recurrent layer's state summarizes every token before it, so a prefix of a Qwen3-Next /
Qwen3.5 model is reusable only at a boundary whose state was saved, together with its K/V:
the coordinator's hot hit stops at the deepest block boundary a
:class:`~pagedkv.coordinator.StateCheckpointStore` holds a verified state for, never K/V
without its state. States exist only where the prefill split, so
:meth:`RecurrentCheckpoints.prefill` runs a request's uncached prompt up to its last block
boundary split at the boundaries of :func:`checkpoint_boundaries` (a grid pinned at token 0,
so every prompt on a lineage splits at the same places, and the prompt's tail) and publishes
the state at each. On mlx-lm's CPU path a split changes no bits of the state (the recurrence
runs token by token), so the checkpoints cost nothing in parity.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgument

__all__ = [
    "CHECKPOINTS_PER_REQUEST",
    "CHECKPOINT_INTERVAL_TOKENS",
    "RecurrentCheckpoints",
    "checkpoint_boundaries",
]

#: Default grid of the prefill checkpoints (tokens): a prefill splits and keeps the state at
#: every multiple of it (a multiple of every supported block size).
CHECKPOINT_INTERVAL_TOKENS = 256
#: Default cap on the checkpoints one prefill publishes (its tail included).
CHECKPOINTS_PER_REQUEST = 4

#: A request's recurrent state: per recurrent entry (cache-list order), its arrays.
States = tuple[tuple[Any, ...], ...]


def _mx_dtype(name: str):
    import mlx.core as mx

    return getattr(mx, name)


def checkpoint_boundaries(n_tokens: int, cached_tokens: int, block_size: int,
                          interval: int = CHECKPOINT_INTERVAL_TOKENS,
                          per_request: int = CHECKPOINTS_PER_REQUEST) -> list[int]:
    """Where a prefill of ``tokens[cached_tokens:n_tokens]`` keeps the recurrent state
    (tokens, ascending): the *tail* ``T`` (the last block boundary strictly below the prompt
    end: the last prompt token is always computed by the caller) and the *grid points*, the
    multiples of ``g`` strictly between ``cached_tokens`` and ``T``, where ``g`` is the
    smallest ``interval * 2**j`` that leaves at most ``per_request - 1`` of them. The grid is
    pinned at token 0, so prompts sharing a prefix split at the same places and the second
    one resumes at the deepest grid point of the shared part. Empty when ``T <= cached``.

    (544, 0, 16) → ``[256, 512, 528]``; (2000, 0, 16) → ``[512, 1024, 1536, 1984]`` (the
    256-grid would give 7 points); (544, 512, 16) → ``[528]``; ``interval=0``: the tail
    only."""
    from pagedkv.cold.ladder import gdn_checkpoint_target

    bs = int(block_size)
    cached = int(cached_tokens)
    tail = gdn_checkpoint_target(int(n_tokens), cached, bs)
    if tail is None:
        return []
    if interval <= 0 or per_request <= 1:
        return [tail]
    grid = int(interval)
    while (tail - 1) // grid - cached // grid > per_request - 1:
        grid *= 2
    first = cached // grid + 1
    return [k * grid for k in range(first, (tail - 1) // grid + 1)] + [tail]


class RecurrentCheckpoints:
    """The state checkpoints of one :class:`PagedPromptCache`: the recurrent entries'
    indices and array geometry, the store (set once the coordinator exists), the codec of
    the cold tier's sidecars (``None`` without one)."""

    def __init__(self, states_geometry: dict[int, tuple[tuple[tuple[int, ...], str], ...]],
                 block_size: int, prefill_chunk: int, *,
                 interval: int = CHECKPOINT_INTERVAL_TOKENS,
                 per_request: int = CHECKPOINTS_PER_REQUEST) -> None:
        self.indices = tuple(sorted(states_geometry))
        self.geometry = states_geometry
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        self.interval = interval
        self.per_request = per_request
        self.store = None
        self.codec = None

    def __bool__(self) -> bool:
        return bool(self.indices)

    # --- states -------------------------------------------------------------------------

    def states_of(self, cache) -> States:
        """The arrays of every recurrent layer of a request's cache list (MLX arrays are
        immutable: the model assigns new ones, so these references are a snapshot)."""
        return tuple(tuple(cache[i].cache) for i in self.indices)

    def nbytes(self, states: States) -> int:
        return sum(int(a.nbytes) for layer in states for a in layer)

    def check(self, index: int, arrays) -> tuple[Any, ...]:
        """``arrays`` (an ``ArraysCache``'s list) as entry ``index``'s state; their shapes and
        dtypes must be the model's (``InvalidArgument`` otherwise)."""
        want = self.geometry[index]
        arrays = tuple(arrays)
        got = tuple((tuple(int(d) for d in a.shape), str(a.dtype).rsplit(".", 1)[-1])
                    if a is not None else None for a in arrays)
        if got != want:
            raise InvalidArgument(f"layer {index}: recurrent state arrays are {got}, the "
                                  f"model's are {want}")
        return arrays

    # --- checkpoints --------------------------------------------------------------------

    def publish(self, tokens: np.ndarray, boundary: int, states: States, salt: int,
                owner=None) -> bool:
        """Keep ``states`` as the state after ``tokens[:boundary]`` (a block boundary);
        ``owner``: the publishing request."""
        if self.store is None or boundary <= 0 or boundary % self.block_size:
            return False
        return self.store.publish(tokens, boundary, states, cache_salt=salt,
                                  nbytes=self.nbytes(states), owner=owner)

    def __call__(self, tokens, *, cache_salt: int = 0, extra_keys_per_block=None) -> dict:
        """The cold tier's checkpoint source: ``{boundary: sidecar state}`` of the retained
        checkpoints on ``tokens``' lineage (:meth:`sidecar_state`)."""
        if self.store is None:
            return {}
        found = self.store.verified(tokens, cache_salt=cache_salt,
                                    extra_keys_per_block=extra_keys_per_block)
        return {b: self.sidecar_state(state) for b, state in found.items()}

    def persist_lineage(self, context, tokens: np.ndarray, salt: int) -> int:
        """Offer the cold tier (a ``ColdTierContext``) every retained checkpoint on
        ``tokens``' lineage but the deepest, which the tier's capture at publication already
        took (it persists one sidecar per published turn, the deepest under its K/V reach):
        a restart then resumes at the grid points too, where prompts sharing a prefix
        diverge. What is already on disk or queued is skipped by the tier. Returns how many
        were offered."""
        found = self(tokens, cache_salt=salt)
        offered = 0
        for b in sorted(found)[:-1]:
            context.capture_sidecar({b: found[b]}, tokens=tokens,
                                    captured_blocks=b // self.block_size,
                                    block_size=self.block_size, cache_salt=salt)
            offered += 1
        return offered

    def from_lookup(self, sidecar) -> States:
        """The state a lookup handed out: a hot :class:`~pagedkv.coordinator.Checkpoint`
        (its arrays as published) or a cold-tier ``RestoredSidecar`` (unpacked by the
        codec, cast back to each array's dtype: the sidecar stores float32 and the casts
        are exact)."""
        state = getattr(sidecar, "state", None)
        if state is not None:
            return state
        if self.codec is None:
            raise InvalidArgument("a restored sidecar without a recurrent codec")
        import mlx.core as mx

        parts = self.codec.unpack(sidecar)   # per part: [layers, *shape without batch]
        out = []
        for layer, i in enumerate(self.indices):
            arrays = []
            for part, (shape, dtype) in zip(parts, self.geometry[i], strict=True):
                value = mx.array(np.ascontiguousarray(part[layer])).reshape(shape)
                arrays.append(value.astype(_mx_dtype(dtype)))
            out.append(tuple(arrays))
        return tuple(out)

    def sidecar_state(self, states: States) -> tuple[np.ndarray, ...]:
        """``states`` as the codec's float32 parts, ``[layers, *shape without batch]`` each."""
        import mlx.core as mx

        parts = []
        for p in range(len(self.geometry[self.indices[0]])):
            parts.append(np.stack([np.asarray(layer[p].astype(mx.float32))[0]
                                   for layer in states]))
        return tuple(parts)

    # --- the checkpointed prefill ------------------------------------------------------

    def boundaries(self, n_tokens: int, cached_tokens: int) -> list[int]:
        """:func:`checkpoint_boundaries` under this cache's interval and cap."""
        return checkpoint_boundaries(n_tokens, cached_tokens, self.block_size, self.interval,
                                     self.per_request)

    def prefill(self, model, request) -> int:
        """Run ``request``'s uncached prompt up to its last block boundary below the prompt
        end, split at :meth:`boundaries` and every ``prefill_chunk`` tokens, publishing the
        state at each boundary. Returns the tokens run (0 when the prompt has no boundary
        past what is cached)."""
        import mlx.core as mx

        from pagedkv.cold.ladder import prefill_ranges

        prompt = request.prompt_tokens
        cached = request.cached_tokens
        stops = self.boundaries(len(prompt), cached)
        if not stops:
            return 0
        cache = request.cache
        for start, stop in prefill_ranges(stops[-1], self.prefill_chunk, stops, start=cached):
            model(mx.array(prompt[start:stop])[None], cache=cache)
            mx.eval([c.state for c in cache])
            if stop in stops:
                self.publish(prompt, stop, self.states_of(cache), request.cache_salt,
                             request.request_id)
        return stops[-1] - cached
