"""``StateCheckpointStore``: in-memory recurrent-state checkpoints at block boundaries
(docs/coordinator.md, "Hybrid hot prefix reuse").

A recurrent layer's state summarizes every token before it, so a prefix hit of a model with
such layers is valid only at a boundary whose state was saved. The engine publishes the
state at block boundaries it chooses (for instance the ladder rungs of ``pagedkv.cold.ladder``;
this store takes whatever boundaries it is given). A checkpoint is keyed and verified
exactly like a cached block: its key is the chain hash of the block that ends at the
boundary, and the identity of that block (its tokens, parent hash, salt, extra-keys digest
and index) must equal the request's, so another prefix, tenant or image never matches.
Retention is bounded (entries and bytes), least recently used first; a ``retention`` policy
(for instance ``pagedkv.cold.ladder.LadderRetention``, the ladder's victim orders) decides
first, after every publish.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np

from pagedkv.adapter.arguments import as_count, as_tokens
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.hashing import as_domain_id, make_chain_keys
from pagedkv.identity import BlockIdentity, extra_keys_digest

__all__ = ["Checkpoint", "CheckpointRetention", "StateCheckpointStore"]


class Checkpoint(NamedTuple):
    """A published state: valid for exactly the first ``boundary_tokens`` tokens."""

    boundary_tokens: int
    state: Any
    nbytes: int


#: ``retention(owners, lengths, chains, *, publisher, last_used) -> indices to evict``: the
#: store's entries in publish order (index 0 oldest) as ``int64[n]`` owner ids, ``int64[n]``
#: boundaries (tokens), per-entry chain hashes (``uint64[k]``, one per block of the
#: boundary's prefix) and ``int64[n]`` last-use ticks (larger = more recent); ``publisher``
#: is the owner id of the entry just published. What ``pagedkv.cold.ladder.LadderRetention``
#: implements.
CheckpointRetention = Callable[..., Sequence[int]]


class _Entry:
    __slots__ = ("chain", "checkpoint", "identity", "owner", "used")

    def __init__(self, identity: BlockIdentity, checkpoint: Checkpoint, owner: int,
                 chain: np.ndarray, used: int) -> None:
        self.identity = identity
        self.checkpoint = checkpoint
        self.owner = owner
        self.chain = chain
        self.used = used


def _key_args(extra_keys, extra_keys_per_block) -> tuple[Any, Any]:
    """The extra keys as both the chain hash and the identities read them: ``None`` as no
    keys, iterables materialized once (an iterator hashed first was empty when the identity
    read it, so the entry never verified), then checked like the allocator's
    (``InvalidArgumentType`` / ``InvalidArgument``)."""
    def materialized(keys):
        if isinstance(keys, (str, bytes)) or not hasattr(keys, "__iter__"):
            return keys         # refused by make_chain_keys, naming the type
        return tuple(keys)

    uniform = materialized(() if extra_keys is None else extra_keys)
    per_block = extra_keys_per_block
    if per_block is not None and not isinstance(per_block, (str, bytes)) and \
            hasattr(per_block, "__len__"):
        per_block = [materialized(k) for k in per_block]
    make_chain_keys(uniform, per_block)
    return uniform, per_block


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
    least recently published or hit entry goes first. ``retention`` (a
    :data:`CheckpointRetention`, e.g. ``pagedkv.cold.ladder.LadderRetention``) runs after
    every publish, before those bounds, and picks victims by owner and lineage (the ladder's
    victim orders: docs/cold.md, "Retention"). The state object is kept as given: publish a
    copy the model will not modify. Not thread-safe (the scheduler thread's).
    """

    def __init__(self, hasher, *, max_entries: int = 8, max_bytes: int | None = None,
                 retention: CheckpointRetention | None = None) -> None:
        if not callable(getattr(hasher, "chain_hashes", None)):
            raise InvalidArgumentType("hasher must have chain_hashes(...) (a BlockAllocator)")
        if retention is not None and not callable(retention):
            raise InvalidArgumentType("retention must be callable(owners, lengths, chains, *, "
                                      "publisher, last_used) -> indices (LadderRetention)")
        self._hasher = hasher
        self.block_size = as_count(hasher.block_size, "hasher.block_size")
        self.max_entries = as_count(max_entries, "max_entries")
        if self.max_entries < 1:
            raise InvalidArgument("max_entries must be >= 1")
        self.max_bytes = None if max_bytes is None else as_count(max_bytes, "max_bytes")
        self.retention = retention
        # key (chain hash) -> entry, in publish order (a republish moves to the end).
        self._entries: dict[int, _Entry] = {}
        self._owners: dict[Hashable, int] = {}
        self._tick = 0
        self._bytes = 0
        self._stats = dict.fromkeys(("publishes", "refreshes", "hits", "misses", "evictions",
                                     "collisions_rejected", "rejected_oversize"), 0)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        rule = "" if self.retention is None else f", retention={self.retention!r}"
        return (f"StateCheckpointStore({len(self._entries)}/{self.max_entries} entries, "
                f"{self._bytes:,} bytes" + (f" of {self.max_bytes:,}" if self.max_bytes else "")
                + f", boundaries {self.boundaries()}{rule})")

    @property
    def nbytes(self) -> int:
        """Bytes of the retained states (as published or measured)."""
        return self._bytes

    def boundaries(self) -> list[int]:
        """Boundaries (tokens) of the retained checkpoints, ascending."""
        return sorted(e.checkpoint.boundary_tokens for e in self._entries.values())

    def stats(self) -> dict[str, int]:
        return dict(self._stats, entries=len(self._entries), nbytes=self._bytes)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

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
                extra_keys_per_block=None, cache_salt: int = 0, nbytes: int | None = None,
                owner: Hashable = None) -> bool:
        """Keep ``state`` as the recurrent state after ``tokens[:boundary_tokens]``.

        ``boundary_tokens`` must be a positive multiple of the block size within ``tokens``
        (else ``InvalidArgument``). Returns ``False`` (nothing kept) when another identity
        holds the key (a collision, counted) or the state alone exceeds ``max_bytes``, and
        whether the entry survived retention otherwise; publishing the same boundary again
        replaces its state. ``nbytes`` defaults to the state's ``nbytes`` (summed over a
        tuple, list or dict of arrays). ``owner``: who published it (a request or session
        id; the ladder's per-owner caps count by it)."""
        toks = as_tokens(tokens)
        boundary = as_count(boundary_tokens, "boundary_tokens")
        bs = self.block_size
        if boundary == 0 or boundary % bs or boundary > len(toks):
            raise InvalidArgument(
                f"boundary_tokens = {boundary} must be a positive multiple of the block size "
                f"{bs} within the {len(toks)} tokens given")
        salt = as_domain_id(cache_salt)
        extra_keys, extra_keys_per_block = _key_args(extra_keys, extra_keys_per_block)
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
            if not held.identity.same_as(identity):
                self._stats["collisions_rejected"] += 1
                return False
            self._bytes -= held.checkpoint.nbytes
            del self._entries[key]
            self._stats["refreshes"] += 1
        else:
            self._stats["publishes"] += 1
        owner_id = self._owners.setdefault(owner, len(self._owners))
        self._entries[key] = _Entry(identity, Checkpoint(boundary, state, size), owner_id,
                                    np.asarray(hashes[:index + 1], np.uint64).copy(),
                                    self._next_tick())
        self._bytes += size
        if self.retention is not None:
            self._retain(owner_id)
        self._evict(keep=key)
        return key in self._entries

    def _drop(self, key: int) -> None:
        self._bytes -= self._entries.pop(key).checkpoint.nbytes
        self._stats["evictions"] += 1

    def _retain(self, publisher: int) -> None:
        keys = list(self._entries)
        entries = [self._entries[k] for k in keys]
        assert self.retention is not None
        victims = self.retention(
            np.fromiter((e.owner for e in entries), np.int64, len(entries)),
            np.fromiter((e.checkpoint.boundary_tokens for e in entries), np.int64,
                        len(entries)),
            [e.chain for e in entries], publisher=publisher,
            last_used=np.fromiter((e.used for e in entries), np.int64, len(entries)))
        for i in victims:
            self._drop(keys[int(i)])

    def _evict(self, keep: int) -> None:
        while len(self._entries) > self.max_entries or (
                self.max_bytes is not None and self._bytes > self.max_bytes):
            key = min(self._entries, key=lambda k: self._entries[k].used)
            if key == keep:
                break
            self._drop(key)

    def _verified(self, tokens, extra_keys, extra_keys_per_block, cache_salt):
        """``(index, key, entry)`` of every retained entry that verifies for this prompt."""
        toks = as_tokens(tokens)
        salt = as_domain_id(cache_salt)
        extra_keys, extra_keys_per_block = _key_args(extra_keys, extra_keys_per_block)
        if not self._entries:
            return
        hashes = self._chain(toks, extra_keys, extra_keys_per_block, salt)
        for key, e in list(self._entries.items()):
            index = e.identity.block_index
            if index >= len(hashes) or int(hashes[index]) != key:
                continue
            if not e.identity.same_as(self._identity(toks, hashes, index, extra_keys,
                                                     extra_keys_per_block, salt)):
                self._stats["collisions_rejected"] += 1
                continue
            yield index, key, e

    def deepest(self, tokens, *, extra_keys: Sequence[int] = (), extra_keys_per_block=None,
                cache_salt: int = 0, accept: Callable[[int], bool] | None = None
                ) -> Checkpoint | None:
        """The retained checkpoint with the largest boundary ``<= len(tokens)`` that verifies
        for this prompt (and that ``accept(boundary)`` allows), touched as most recent; or
        ``None``. Costs one chain hash of ``tokens`` and one probe per retained entry."""
        best: tuple[int, _Entry] | None = None
        for index, _, e in self._verified(tokens, extra_keys, extra_keys_per_block,
                                          cache_salt):
            if best is not None and index <= best[0]:
                continue
            if accept is not None and not accept(e.checkpoint.boundary_tokens):
                continue
            best = (index, e)
        if best is None:
            self._stats["misses"] += 1
            return None
        best[1].used = self._next_tick()
        self._stats["hits"] += 1
        return best[1].checkpoint

    def verified(self, tokens, *, extra_keys: Sequence[int] = (), extra_keys_per_block=None,
                 cache_salt: int = 0) -> dict[int, Any]:
        """``{boundary: state}`` of every retained checkpoint on this prompt's lineage (at
        or below ``len(tokens)``, verified like :meth:`deepest`), without touching them or
        counting hits: what a cold tier's sidecar capture asks for."""
        return {e.checkpoint.boundary_tokens: e.checkpoint.state
                for _, _, e in self._verified(tokens, extra_keys, extra_keys_per_block,
                                              cache_salt)}
