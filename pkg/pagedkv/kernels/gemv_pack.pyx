# cython: language_level=3
"""The weight packing of the tensor-core GEMV (hip/weights.hip, ``gemv_mma``), in C.

A 4-bit group (HFQ4G256, MQ4G256, MQ4G256V2) is 136 bytes: seventeen 8-byte words, the
header then code chunks 0-15. The kernel reads, per 16-row tile and group, the 16 headers
(row order) then the code chunks in the order its lanes load them: code chunk ``4j + t`` of
row ``8 rr + gid`` goes to word ``j % 2`` of 16-byte load ``2 rr + j // 2`` of lane
``4 gid + t``. Rows past ``M`` (the last tile's padding) are zero groups. ``Gemv.pack``
checks the arguments; this module only moves words, with the GIL released.
"""

import numpy as np

from pagedkv.errors import InvalidArgument

from libc.stdint cimport int64_t, uint64_t

cdef enum:
    GROUP_WORDS = 17  # 136 bytes: header + 16 code chunks
    TILE_ROWS = 16
    TILE_GROUP_WORDS = 272  # 16 headers + 256 code chunks = 2176 bytes


def pack_tiles_4bit(const uint64_t[:, ::1] rows, int64_t groups):
    """``rows``: the stored weights as ``uint64[M, groups * 17]``. Returns the packed
    ``uint64[ceil(M / 16) * groups * 272]``."""
    cdef int64_t M = rows.shape[0]
    cdef int64_t tiles = (M + TILE_ROWS - 1) // TILE_ROWS
    if rows.shape[1] != groups * GROUP_WORDS:
        raise InvalidArgument(f"rows: {rows.shape[1]} words per row, expected "
                              f"{groups * GROUP_WORDS} for {groups} groups of 17 words")
    # every word of a real row is written; only the last tile's padding rows need zeros
    out = (np.empty if M % TILE_ROWS == 0 else np.zeros)(tiles * groups * TILE_GROUP_WORDS,
                                                         np.uint64)
    cdef uint64_t[::1] o = out
    cdef int64_t tile, g, r, row, chunk, j, t, base, src, lane_load
    with nogil:
        for tile in range(tiles):
            for g in range(groups):
                base = (tile * groups + g) * TILE_GROUP_WORDS
                src = g * GROUP_WORDS
                for r in range(TILE_ROWS):
                    row = tile * TILE_ROWS + r
                    if row >= M:
                        break
                    o[base + r] = rows[row, src]
                    for chunk in range(16):
                        j = chunk >> 2
                        t = chunk & 3
                        # load 2 (r / 8) + j / 2 of lane 4 (r % 8) + t, word j % 2
                        lane_load = 32 * (2 * (r >> 3) + (j >> 1)) + 4 * (r & 7) + t
                        o[base + TILE_ROWS + 2 * lane_load + (j & 1)] = rows[row, src + 1 + chunk]
    return out
