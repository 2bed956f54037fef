"""Type stubs for pagedkv.hashing (Cython). Contracts: docs/contracts/paged-kv.md, '2. Block
hashing' and '3. cache_salt domain id'."""

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

from pagedkv.identity import BlockIdentity as BlockIdentity

__all__ = [
    "XXH3_SOURCE",
    "BlockIdentity",
    "as_token_array",
    "chain_hashes",
    "hot_block_hash",
    "per_block_extra_keys",
    "salt_domain_id",
]

#: "libxxhash" (system library called from C) or "xxhash-wheel" (the Python package).
XXH3_SOURCE: Final[str]

def hot_block_hash(
    parent: int,
    tokens: npt.ArrayLike,
    extra_keys: Sequence[int] = (),
    cache_salt: int | None = 0,
    block_index: int = 0,
    *,
    seed: int = 0,
) -> int:
    """XXH3-64 of ``parent u64 | tokens u32*bs | key count u64 | keys u64* | salt u64``
    (salt only when block_index == 0 and cache_salt != 0); 0 is remapped to 1."""

def chain_hashes(
    tokens: npt.ArrayLike,
    block_size: int,
    *,
    extra_keys: Sequence[int] = (),
    extra_keys_per_block: Sequence[Sequence[int]] | None = None,
    cache_salt: int | None = 0,
    seed: int = 0,
) -> npt.NDArray[np.uint64]:
    """``uint64[min(len(tokens) // block_size, len(extra_keys_per_block))]`` chained hashes;
    block_size 0 gives an empty array. Passing both key forms is InvalidArgument."""

def salt_domain_id(salt: str | None) -> int:
    """None → 0; a non-empty str of at most 256 UTF-8 bytes → first 8 bytes (LE) of its
    SHA-256, 0 remapped to 1. Not a str → InvalidArgumentType; empty/too long →
    InvalidArgument."""

def as_token_array(tokens: npt.ArrayLike, name: str = "tokens") -> npt.NDArray[np.uint32]:
    """Token input rule of docs/contracts/paged-kv.md, '2.1 Hot block hash': a C-contiguous 1-D
    uint32 array is returned as is; other
    integer input is range-checked and converted; float/bool/object → InvalidArgumentType;
    ndim != 1 → InvalidArgument."""

def as_domain_id(cache_salt: int | None, name: str = "cache_salt") -> int:
    """A u64 domain id; a str raises InvalidArgumentType pointing to salt_domain_id."""

def as_u64(value: int, name: str) -> int: ...

@disjoint_base
class ChainKeys:
    """Validated extra keys of one chain (uniform or per block)."""

    @property
    def flat_keys(self) -> npt.NDArray[np.uint64]: ...
    @property
    def key_offsets(self) -> npt.NDArray[np.intp] | None: ...
    @property
    def max_blocks(self) -> int:
        """Chain-length limit in blocks; -1 when unbounded."""
    @property
    def per_block(self) -> bool: ...
    @property
    def digests(self) -> npt.NDArray[np.uint8]:
        """``uint8[m, 16]`` extra-keys digests: m = 1 (uniform) or one per block."""
    @property
    def digest_lens(self) -> npt.NDArray[np.uint32]:
        """``uint32[m]``: 0 (no keys) or 16."""

def make_chain_keys(
    extra_keys: Sequence[int] = (),
    extra_keys_per_block: Sequence[Sequence[int]] | None = None,
) -> ChainKeys: ...

def per_block_extra_keys(
    num_full_blocks: int,
    extra_keys: Sequence[int] = (),
    extra_keys_per_block: Sequence[Sequence[int]] | None = None,
) -> list[tuple[int, ...]]:
    """The validated extra keys of each chained block, one tuple per block, with the chain's
    stopping rule."""

def _set_xxh3_source(source: str) -> str:
    """Test hook: route XXH3 through "libxxhash" or "xxhash-wheel"; returns the previous."""
