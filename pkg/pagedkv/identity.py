"""Argument types that carry a cached block's identity (docs/contracts/paged-kv.md, '2.3 Block
identity and verification' and '4.9 Batch publish of restored blocks').

No per-block identity object is ever *stored*: the allocator keeps identities in
its flat block arrays. These small immutable types only carry one into
``register_prefix``, ``lookup_prefix`` and ``publish_restored_batch``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["EXTRA_KEYS_DIGEST_BYTES", "BlockIdentity", "RestoredBlock", "extra_keys_digest"]

#: Length of a non-empty extra-keys digest: BLAKE2b-128.
EXTRA_KEYS_DIGEST_BYTES = 16

_U64_MAX = (1 << 64) - 1


def extra_keys_digest(extra_keys: Sequence[int]) -> bytes:
    """``b""`` for no keys, else BLAKE2b-128 of (u64 count, then each key as u64), little-endian.

    Keys must be integers in ``[0, 2**64)``; order matters.
    """
    keys = tuple(extra_keys)
    if not keys:
        return b""
    buf = bytearray(len(keys).to_bytes(8, "little"))
    for i, k in enumerate(keys):
        if not is_int(k):
            raise InvalidArgumentType(
                f"extra_keys[{i}] must be an int in [0, 2**64), got {type(k).__name__}")
        k = int(k)
        if not 0 <= k <= _U64_MAX:
            raise InvalidArgument(f"extra_keys[{i}] = {k} is outside [0, 2**64)")
        buf += k.to_bytes(8, "little")
    return hashlib.blake2b(bytes(buf), digest_size=EXTRA_KEYS_DIGEST_BYTES).digest()


class BlockIdentity(NamedTuple):
    """What a cached block is, compared in full on every hash → block path.

    tokens: the block's ``block_size`` token ids (``uint32[bs]``).
    parent_hash: hot hash of the previous block (0 for block 0).
    extra_keys_digest: ``b""`` or the 16-byte digest of :func:`extra_keys_digest`.
    cache_salt: the publishing request's domain id (u64), stored on every block.
    block_index: position in the chain.
    """

    tokens: np.ndarray
    parent_hash: int
    extra_keys_digest: bytes
    cache_salt: int
    block_index: int

    @classmethod
    def of(cls, tokens, parent_hash: int = 0, extra_keys: Sequence[int] = (),
           cache_salt: int = 0, block_index: int = 0) -> BlockIdentity:
        """Build an identity from raw extra keys (digested here) and any integer tokens."""
        arr = np.asarray(tokens)
        if arr.dtype.kind not in "iu":
            raise InvalidArgumentType(
                f"tokens must be integers, got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise InvalidArgument(f"tokens must be 1-D, got ndim={arr.ndim}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
            raise InvalidArgument(f"tokens must be in [0, 2**32), got values in "
                                  f"[{int(arr.min())}, {int(arr.max())}]")
        return cls(np.ascontiguousarray(arr, dtype=np.uint32), int(parent_hash),
                   extra_keys_digest(extra_keys), int(cache_salt), int(block_index))

    def __eq__(self, other: object) -> bool:
        # The tuple ``==`` would compare the token arrays elementwise and then fail on the
        # truth value of an array; two identities are equal when every field is. Not
        # NotImplemented for other objects: the reflected tuple ``==`` would fail the same way.
        return isinstance(other, BlockIdentity) and self.same_as(other)

    def __ne__(self, other: object) -> bool:  # tuple's own != would compare the arrays
        return not self == other

    def __hash__(self) -> int:
        # Unhashable, as before, but declared as a method: a ``__hash__ = None`` line in a
        # NamedTuple body is read by type checkers as a field, making every call to the
        # constructor look one argument short. Hashing the tuple would hash the token
        # ndarray (a TypeError anyway); key dicts by ``block_hash`` instead.
        raise TypeError("unhashable type: 'BlockIdentity' (it holds the token array; "
                        "key by the block hash instead)")

    def same_as(self, other: BlockIdentity) -> bool:
        """Full comparison of every field (what ``==`` does)."""
        return (self.parent_hash == other.parent_hash
                and self.extra_keys_digest == other.extra_keys_digest
                and self.cache_salt == other.cache_salt
                and self.block_index == other.block_index
                and np.array_equal(np.asarray(self.tokens, dtype=np.uint32),
                                   np.asarray(other.tokens, dtype=np.uint32)))


class RestoredBlock(NamedTuple):
    """One entry of ``BlockAllocator.publish_restored_batch`` (docs/contracts/paged-kv.md, '4.9
    Batch publish of restored blocks')."""

    block_id: int
    block_hash: int
    identity: BlockIdentity
