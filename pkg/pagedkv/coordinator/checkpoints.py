"""``StateCheckpointStore``: in-memory recurrent-state checkpoints at block boundaries
(docs/coordinator.md, "Hybrid hot prefix reuse").

A recurrent layer's state summarizes every token before it, so a prefix hit of a model with
such layers is valid only at a boundary whose state was saved. The engine publishes the
state at block boundaries it chooses (for instance the ladder rungs of ``pagedkv.cold.ladder``;
this store takes whatever boundaries it is given). A checkpoint is keyed and verified
exactly like a cached block: its key is the chain hash of the block that ends at the
boundary, and the identity of that block (its tokens, parent hash, salt, extra-keys digest
and index) must equal the request's, so another prefix, tenant or image never matches.
Retention is bounded (entries and bytes), least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from pagedkv.adapter.arguments import as_count, as_tokens
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.hashing import as_domain_id
from pagedkv.identity import BlockIdentity, extra_keys_digest

__all__ = ["Checkpoint", "StateCheckpointStore"]


class Checkpoint(NamedTuple):
    """A published state: valid for exactly the first ``boundary_tokens`` tokens."""

    boundary_tokens: int
    state: Any
    nbytes: int


def _state_bytes(state) -> int:
    nbytes = getattr(state, "nbytes", None)
    if isinstance(nbytes, (int, np.integer)):
        return int(nbytes)
    if isinstance(state, (tuple, list)):
        return sum(_state_bytes(s) for s in state)
    if isinstance(state, dict):
        return sum(_state_bytes(s) for s in state.values())
    return 0


class StateCheckpointStore:
    """Checkpoints keyed like blocks of ``hasher`` (an object with ``block_size`` and
    ``chain_hashes(tokens, *, extra_keys, extra_keys_per_block, cache_salt)``, normally the
    full-attention group's allocator, so keys use its seed).

    ``max_entries`` (>= 1) and ``max_bytes`` (``None``: unbounded) bound what is kept; the
    least recently published or hit entry goes first. The state object is kept as given:
    publish a copy the model will not modify. Not thread-safe (the scheduler thread's).
    """

    def __init__(self, hasher, *, max_entries: int = 8, max_bytes: int | None = None) -> None:
        if not callable(getattr(hasher, "chain_hashes", None)):
            raise InvalidArgumentType("hasher must have chain_hashes(...) (a BlockAllocator)")
        self._hasher = hasher
        self.block_size = as_count(hasher.block_size, "hasher.block_size")
        self.max_entries = as_count(max_entries, "max_entries")
        if self.max_entries < 1:
            raise InvalidArgument("max_entries must be >= 1")
        self.max_bytes = None if max_bytes is None else as_count(max_bytes, "max_bytes")
        # key (chain hash) -> (identity of the boundary's last block, checkpoint); LRU order.
        self._entries: OrderedDict[int, tuple[BlockIdentity, Checkpoint]] = OrderedDict()
        self._bytes = 0
        self._stats = dict.fromkeys(("publishes", "refreshes", "hits", "misses", "evictions",
                                     "collisions_rejected", "rejected_oversize"), 0)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (f"StateCheckpointStore({len(self._entries)}/{self.max_entries} entries, "
                f"{self._bytes:,} bytes" + (f" of {self.max_bytes:,}" if self.max_bytes else "")
                + f", boundaries {self.boundaries()})")

    @property
    def nbytes(self) -> int:
        """Bytes of the retained states (as published or measured)."""
        return self._bytes

    def boundaries(self) -> list[int]:
        """Boundaries (tokens) of the retained checkpoints, ascending."""
        return sorted(c.boundary_tokens for _, c in self._entries.values())

    def stats(self) -> dict[str, int]:
        return dict(self._stats, entries=len(self._entries), nbytes=self._bytes)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _chain(self, tokens: np.ndarray, extra_keys, extra_keys_per_block, salt: int
               ) -> np.ndarray:
        return self._hasher.chain_hashes(tokens, extra_keys=extra_keys,
                                         extra_keys_per_block=extra_keys_per_block,
                                         cache_salt=salt)

    def _identity(self, tokens: np.ndarray, hashes: np.ndarray, index: int, extra_keys,
                  extra_keys_per_block, salt: int) -> BlockIdentity:
        bs = self.block_size
        keys = extra_keys if extra_keys_per_block is None else extra_keys_per_block[index]
        return BlockIdentity(tokens[index * bs:(index + 1) * bs], int(hashes[index - 1])
                             if index else 0, extra_keys_digest(keys), salt, index)

    def publish(self, tokens, boundary_tokens: int, state, *, extra_keys: Sequence[int] = (),
                extra_keys_per_block=None, cache_salt: int = 0,
                nbytes: int | None = None) -> bool:
        """Keep ``state`` as the recurrent state after ``tokens[:boundary_tokens]``.

        ``boundary_tokens`` must be a positive multiple of the block size within ``tokens``
        (else ``InvalidArgument``). Returns ``False`` (nothing kept) when another identity
        holds the key (a collision, counted) or the state alone exceeds ``max_bytes``;
        publishing the same boundary again replaces its state. ``nbytes`` defaults to the
        state's ``nbytes`` (summed over a tuple, list or dict of arrays)."""
        toks = as_tokens(tokens)
        boundary = as_count(boundary_tokens, "boundary_tokens")
        bs = self.block_size
        if boundary == 0 or boundary % bs or boundary > len(toks):
            raise InvalidArgument(
                f"boundary_tokens = {boundary} must be a positive multiple of the block size "
                f"{bs} within the {len(toks)} tokens given")
        salt = as_domain_id(cache_salt)
        size = _state_bytes(state) if nbytes is None else as_count(nbytes, "nbytes")
        if self.max_bytes is not None and size > self.max_bytes:
            self._stats["rejected_oversize"] += 1
            return False
        hashes = self._chain(toks[:boundary], extra_keys, extra_keys_per_block, salt)
        index = boundary // bs - 1
        if len(hashes) <= index:
            raise InvalidArgument(
                f"extra_keys_per_block covers {len(hashes)} blocks; the boundary at {boundary} "
                f"tokens needs {index + 1}")
        key = int(hashes[index])
        identity = self._identity(toks, hashes, index, extra_keys, extra_keys_per_block, salt)
        held = self._entries.get(key)
        if held is not None:
            if not held[0].same_as(identity):
                self._stats["collisions_rejected"] += 1
                return False
            self._bytes -= held[1].nbytes
            self._stats["refreshes"] += 1
        else:
            self._stats["publishes"] += 1
        self._entries[key] = (identity, Checkpoint(boundary, state, size))
        self._entries.move_to_end(key)
        self._bytes += size
        self._evict(keep=key)
        return True

    def _evict(self, keep: int) -> None:
        while len(self._entries) > self.max_entries or (
                self.max_bytes is not None and self._bytes > self.max_bytes):
            key = next(iter(self._entries))
            if key == keep:
                break
            _, cp = self._entries.pop(key)
            self._bytes -= cp.nbytes
            self._stats["evictions"] += 1

    def deepest(self, tokens, *, extra_keys: Sequence[int] = (), extra_keys_per_block=None,
                cache_salt: int = 0, accept: Callable[[int], bool] | None = None
                ) -> Checkpoint | None:
        """The retained checkpoint with the largest boundary ``<= len(tokens)`` that verifies
        for this prompt (and that ``accept(boundary)`` allows), touched as most recent; or
        ``None``. Costs one chain hash of ``tokens`` and one probe per retained entry."""
        toks = as_tokens(tokens)
        salt = as_domain_id(cache_salt)
        if not self._entries:
            self._stats["misses"] += 1
            return None
        hashes = self._chain(toks, extra_keys, extra_keys_per_block, salt)
        best: tuple[int, int] | None = None  # (index, key)
        for key, (identity, cp) in self._entries.items():
            index = identity.block_index
            if index >= len(hashes) or int(hashes[index]) != key:
                continue
            if best is not None and index <= best[0]:
                continue
            if not identity.same_as(self._identity(toks, hashes, index, extra_keys,
                                                   extra_keys_per_block, salt)):
                self._stats["collisions_rejected"] += 1
                continue
            if accept is not None and not accept(cp.boundary_tokens):
                continue
            best = (index, key)
        if best is None:
            self._stats["misses"] += 1
            return None
        self._entries.move_to_end(best[1])
        self._stats["hits"] += 1
        return self._entries[best[1]][1]
