"""Token and extra-key argument checks shared by the cold keys and walks."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["as_tokens_u32", "per_block_extra_keys", "check_domain_id"]

_U32_MAX = 0xFFFFFFFF
_U64_MAX = (1 << 64) - 1


def as_tokens_u32(tokens, name: str = "tokens") -> np.ndarray:
    """Any 1-D integer array-like as C-contiguous ``uint32`` (no copy when it already is)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32 and tokens.ndim == 1 \
            and tokens.flags.c_contiguous:
        return tokens
    arr = np.asarray(tokens)
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":
            arr = arr.astype(np.int64)  # np.asarray([]) is float64
        else:
            raise InvalidArgumentType(
                f"{name} must be integers, got dtype {arr.dtype}; pass token ids as ints")
    if arr.ndim != 1:
        raise InvalidArgument(f"{name} must be 1-D, got ndim={arr.ndim}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _U32_MAX):
        raise InvalidArgument(f"{name} must satisfy 0 <= t < 2**32, got "
                              f"[{int(arr.min())}, {int(arr.max())}]")
    return np.ascontiguousarray(arr, dtype=np.uint32)


def _check_keys(keys: Sequence[int], name: str) -> tuple[int, ...]:
    out = []
    for j, k in enumerate(keys):
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
            raise InvalidArgumentType(f"{name}[{j}] must be an int in [0, 2**64), "
                                      f"got {type(k).__name__}")
        k = int(k)
        if not 0 <= k <= _U64_MAX:
            raise InvalidArgument(f"{name}[{j}] = {k} is outside [0, 2**64)")
        out.append(k)
    return tuple(out)


def per_block_extra_keys(num_full_blocks: int, extra_keys: Sequence[int] = (),
                         extra_keys_per_block: Sequence[Sequence[int]] | None = None
                         ) -> list[tuple[int, ...]]:
    """The extra keys of each chained block, with the hot chain's stopping rule.

    ``extra_keys`` applies to every block; ``extra_keys_per_block[i]`` to block ``i`` and
    the chain stops at the first block without an entry (paged-kv.md §2.2).
    """
    if extra_keys_per_block is not None:
        if len(tuple(extra_keys)):
            raise InvalidArgument(
                "pass extra_keys or extra_keys_per_block, not both")
        n = min(num_full_blocks, len(extra_keys_per_block))
        return [_check_keys(extra_keys_per_block[i], f"extra_keys_per_block[{i}]")
                for i in range(n)]
    uniform = _check_keys(extra_keys, "extra_keys")
    return [uniform] * num_full_blocks


def check_domain_id(cache_salt, name: str = "cache_salt") -> int:
    """A u64 domain id (``salt_domain_id`` turns a salt string into one)."""
    if isinstance(cache_salt, str):
        raise InvalidArgumentType(
            f"{name} must be a u64 domain id, got the str {cache_salt!r}; "
            "convert it with pagedkv.hashing.salt_domain_id")
    if isinstance(cache_salt, (bool, np.bool_)) or not isinstance(cache_salt, (int, np.integer)):
        raise InvalidArgumentType(f"{name} must be an int, got {type(cache_salt).__name__}")
    v = int(cache_salt)
    if not 0 <= v <= _U64_MAX:
        raise InvalidArgument(f"{name} = {v} is outside [0, 2**64)")
    return v

