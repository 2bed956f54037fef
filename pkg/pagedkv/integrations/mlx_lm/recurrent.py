"""Recurrent-state checkpoints of a paged mlx-lm model (docs/integrations/mlx-lm.md,
"Recurrent hybrids").

A recurrent layer's state summarizes every token before it, so a prefix of a Qwen3-Next /
Qwen3.5 model is reusable only at a boundary whose state was saved, together with its K/V:
the coordinator's hot hit stops at the deepest block boundary a
:class:`~pagedkv.coordinator.StateCheckpointStore` holds a verified state for, never K/V
without its state. States exist only where the prefill split, so
:meth:`RecurrentCheckpoints.prefill` runs a request's uncached prompt up to its last block
boundary split at the rungs of the cold tier's GDN ladder (``pagedkv.cold.ladder``,
docs/cold.md "GDN ladder and prefill splits") and publishes the state at each rung. On
mlx-lm's CPU path a split changes no bits of the state (the recurrence runs token by token),
so the rungs cost nothing in parity.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgument

__all__ = ["RecurrentCheckpoints"]

#: A request's recurrent state: per recurrent entry (cache-list order), its arrays.
States = tuple[tuple[Any, ...], ...]


def _mx_dtype(name: str):
    import mlx.core as mx

    return getattr(mx, name)


class RecurrentCheckpoints:
    """The state checkpoints of one :class:`PagedPromptCache`: the recurrent entries'
    indices and array geometry, the store (set once the coordinator exists), the codec of
    the cold tier's sidecars (``None`` without one)."""

    def __init__(self, states_geometry: dict[int, tuple[tuple[tuple[int, ...], str], ...]],
                 block_size: int, prefill_chunk: int) -> None:
        self.indices = tuple(sorted(states_geometry))
        self.geometry = states_geometry
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
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
        ``owner``: the publishing request (the ladder retention caps per owner)."""
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

    # --- the ladder prefill -------------------------------------------------------------

    def prefill(self, model, request) -> int:
        """Run ``request``'s uncached prompt up to its last block boundary below the prompt
        end, split at the GDN ladder's rungs (``gdn_ladder_rungs``) and every
        ``prefill_chunk`` tokens, publishing the state at each rung. Returns the tokens
        run (0 when the prompt has no rung past what is cached)."""
        import mlx.core as mx

        from pagedkv.cold.ladder import gdn_ladder_rungs, prefill_ranges

        prompt = request.prompt_tokens
        cached = request.cached_tokens
        rungs = gdn_ladder_rungs(len(prompt), cached, self.block_size)
        if not rungs:
            return 0
        cache = request.cache
        for start, stop in prefill_ranges(rungs[-1], self.prefill_chunk, rungs, start=cached):
            model(mx.array(prompt[start:stop])[None], cache=cache)
            mx.eval([c.state for c in cache])
            if stop in rungs:
                self.publish(prompt, stop, self.states_of(cache), request.cache_salt,
                             request.request_id)
        return rungs[-1] - cached
