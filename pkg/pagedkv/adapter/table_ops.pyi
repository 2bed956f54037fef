"""Type stubs for pagedkv.adapter.table_ops (Cython): the block-table row loops of the
request lifecycle (docs/adapter.md, "Block tables and decode batches"; docs/coordinator.md,
"Sliding null sentinel")."""

from typing import Final

import numpy as np
import numpy.typing as npt

from pagedkv.allocator import BlockAllocator

PUBLISH_NONE: Final[int]
PUBLISH_PLAIN: Final[int]
PUBLISH_KEYED: Final[int]

def crossing_rows(
    num_blocks: npt.NDArray[np.int32], rows: npt.NDArray[np.intp],
    ends: npt.NDArray[np.int32], block_size: int,
) -> tuple[npt.NDArray[np.intp], int]: ...
def append_blocks(
    table: npt.NDArray[np.int32], num_blocks: npt.NDArray[np.int32],
    revision: npt.NDArray[np.int64], rows: npt.NDArray[np.intp],
    blocks: npt.NDArray[np.int32],
) -> None: ...
def decode_batch(
    table: npt.NDArray[np.int32], num_blocks: npt.NDArray[np.int32],
    rows: npt.NDArray[np.intp], lens: npt.NDArray[np.int32], block_size: int,
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]: ...
def prune_rows(
    allocator: BlockAllocator, table: npt.NDArray[np.int32], num_blocks: npt.NDArray[np.int32],
    null_upto: npt.NDArray[np.int32], revision: npt.NDArray[np.int64],
    parent_hash: npt.NDArray[np.uint64], parent_known: npt.NDArray[np.bool_],
    rows: npt.NDArray[np.intp], committed: npt.NDArray[np.int32], window: int,
    tokens: npt.NDArray[np.uint32], salts: npt.NDArray[np.uint64],
    publish: npt.NDArray[np.uint8],
) -> tuple[int, npt.NDArray[np.intp]]: ...
