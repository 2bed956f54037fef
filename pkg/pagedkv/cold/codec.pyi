"""Type stubs of pagedkv.cold.codec (docs/contracts/cold-tier.md, '6. Object format')."""

from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np
from typing_extensions import disjoint_base

__all__ = [
    "DTYPE_CODES",
    "LAYOUTS",
    "BlockGeometry",
    "DecodedBlock",
    "ObjectHeader",
    "block_bound",
    "block_checksum",
    "checksum_of_named",
    "checksum_of_stream",
    "decode_block",
    "decode_sidecar",
    "encode_block",
    "encode_sidecar",
    "header_length",
    "header_overhead",
    "kv_slab_bytes",
    "parse_block_header",
    "parse_sidecar_header",
    "sidecar_checksum",
]

DTYPE_CODES: dict[str, int]
LAYOUTS: frozenset[str]

def header_overhead(n_tensors: int) -> int: ...
def kv_slab_bytes(block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: str) -> tuple[int, int]: ...

@disjoint_base
class BlockGeometry:
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layout: str
    slab_bytes: int
    key_bytes: int
    value_bytes: int
    def __init__(self, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: str, layout: str = ...) -> None: ...
    @classmethod
    def of(cls, geometry: object) -> BlockGeometry: ...
    @property
    def bytes_per_block(self) -> int: ...
    @property
    def buffer_shape(self) -> tuple[int, ...]: ...
    @property
    def bound(self) -> int: ...
    def as_tuple(self) -> tuple[int, int, int, int, str, str]: ...

@disjoint_base
class DecodedBlock:
    geometry: BlockGeometry
    tokens: np.ndarray
    payload: np.ndarray
    checksum: str
    nbytes: int

def block_bound(geometry: object) -> int: ...
def checksum_of_named(tag: bytes, tensors: Iterable[tuple[str, object]]) -> str: ...
def block_checksum(tag: bytes, geometry: BlockGeometry, tokens: np.ndarray,
                   buffer: np.ndarray) -> str: ...
def encode_block(abi: str, checksum_tag: bytes, key_hex: str, fingerprint_hex: str,
                 geometry: BlockGeometry, tokens: np.ndarray, buffer: np.ndarray,
                 checksum: str | None = ...) -> tuple[bytes, memoryview, memoryview]: ...
def decode_block(data: object, *, abi: str, checksum_tag: bytes, key_hex: str | None = ...,
                 fingerprint_hex: str | None = ..., expected: BlockGeometry | None = ...,
                 bound: int = ..., path: str | None = ...) -> DecodedBlock: ...
def sidecar_checksum(tag: bytes, layout: object, payload: object) -> str: ...
def encode_sidecar(abi: str, checksum_tag: bytes, key_hex: str, fingerprint_hex: str,
                   layout: object, payload: np.ndarray) -> tuple[bytes, memoryview]: ...
def decode_sidecar(data: object, *, abi: str, checksum_tag: bytes, group: str,
                   key_hex: str | None = ..., fingerprint_hex: str | None = ...,
                   bound: int = ..., path: str | None = ...) -> tuple[dict, np.ndarray]: ...

class ObjectHeader(NamedTuple):
    payload_start: int
    checksum: str
    tensors: list

def header_length(data: object, object_size: int, path: str | None = ...) -> int: ...
def parse_block_header(data: object, object_size: int, *, abi: str, key_hex: str | None = ...,
                       fingerprint_hex: str | None = ..., path: str | None = ...
                       ) -> ObjectHeader: ...
def parse_sidecar_header(data: object, object_size: int, *, abi: str, group: str,
                         key_hex: str | None = ..., fingerprint_hex: str | None = ...,
                         path: str | None = ...) -> ObjectHeader: ...
def checksum_of_stream(tag: bytes, tensors: Iterable[tuple[str, int]],
                       readinto: Callable[[memoryview], int], chunk_bytes: int = ...,
                       path: str | None = ...) -> str: ...
