# cython: language_level=3
"""The weight packing of the tensor-core GEMV (hip/weights.hip, ``gemv_mma``), in C.

A 4-bit group (HFQ4G256, MQ4G256, MQ4G256V2) is 136 bytes: seventeen 8-byte words, the
header then code chunks 0-15. The kernel reads, per 16-row tile and group, the 16 headers
(row order) then the code chunks in the order its lanes load them: code chunk ``4j + t`` of
row ``8 rr + gid`` goes to word ``j % 2`` of 16-byte load ``2 rr + j // 2`` of lane
``4 gid + t``. Rows past ``M`` (the last tile's padding) are zero groups. ``Gemv.pack``
checks the arguments; this module only moves words, with the GIL released.

A Q8F16 row of one 256-group is 8 blocks of 34 bytes (f16 scale, 32 int8 codes). Per 16-row
tile and group the kernel reads the 16 rows' 8 scales (256 bytes, row order), then per mma
``m`` (0-7) and lane ``4 gid + t`` 16 bytes: its A registers a0, a1, a2, a3, the codes of
rows ``gid`` / ``gid + 8`` at the even (a0, a1) or odd (a2, a3) dims of ``8L .. 8L + 7``,
``L = 8 (m / 2) + 2 t + m % 2``: where the prepared x puts those dims (4352 bytes).

An HFQ6G256 row-group is 200 bytes: an 8-byte header, 256 six-bit codes LSB-first. Packed:
the 16 headers (128 bytes), then per lane 24 words, mma ``m``'s three at ``3m``: the low
nibbles of a0's and a2's codes (byte k: a0 in bits 0-3, a2 in 4-7), those of a1 and a3, and
the high two bits of all sixteen (byte k: a0, a2, a1, a3 in bits 0-1, 2-3, 4-5, 6-7); word
``4k + v`` of lane ``l`` in 16-byte unit ``32k + l`` (3200 bytes).
"""

import numpy as np

from pagedkv.errors import InvalidArgument

from libc.stdint cimport int64_t, uint8_t, uint64_t

cdef enum:
    GROUP_WORDS = 17  # 136 bytes: header + 16 code chunks
    TILE_ROWS = 16
    TILE_GROUP_WORDS = 272  # 16 headers + 256 code chunks = 2176 bytes
    Q8_GROUP_BYTES = 272  # a row's 256-group of Q8F16: 8 blocks of 34 bytes
    Q8_TILE_GROUP_BYTES = 4352  # 256 bytes of scales + 4096 codes
    H6_GROUP_BYTES = 200  # a row's HFQ6G256 group: 8-byte header + 192 bytes of codes
    H6_TILE_GROUP_BYTES = 3200  # 128 bytes of headers + 32 lanes x 96 bytes


def _packed_out(M, width, groups, per_group, unit, group_words, tile_group, dtype,
                zeroed=False):
    """The packed array of M rows of ``width`` units (``groups`` groups of ``per_group``),
    or InvalidArgument. Every unit of a real row is written; only the last tile's padding
    rows need zeros (``zeroed``: all of it, for packings that OR their bits in)."""
    if width != groups * per_group:
        raise InvalidArgument(f"rows: {width} {unit} per row, expected {groups * per_group} "
                              f"for {groups} groups of {group_words}")
    tiles = (M + TILE_ROWS - 1) // TILE_ROWS
    return (np.zeros if zeroed or M % TILE_ROWS else np.empty)(tiles * groups * tile_group, dtype)


def pack_tiles_4bit(const uint64_t[:, ::1] rows, int64_t groups):
    """``rows``: the stored weights as ``uint64[M, groups * 17]``. Returns the packed
    ``uint64[ceil(M / 16) * groups * 272]``."""
    cdef int64_t M = rows.shape[0]
    cdef int64_t tiles = (M + TILE_ROWS - 1) // TILE_ROWS
    out = _packed_out(rows.shape[0], rows.shape[1], groups, GROUP_WORDS, "words", "17 words",
                      TILE_GROUP_WORDS, np.uint64)
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


cdef inline int64_t _lane_word_byte(int64_t d, int64_t r, int64_t* m) noexcept nogil:
    """Where the prepared x puts dim d of a group (prep lane L = d / 8 in B quad t of mma m):
    sets m, returns the lane (4 (r % 8) + t) of tile row r whose A registers take it."""
    cdef int64_t L = d >> 3
    m[0] = 2 * (L >> 3) + (L & 1)
    return 4 * (r & 7) + ((L & 7) >> 1)


cdef void _pack_row_q8f16(const uint8_t[:, ::1] rows, uint8_t[::1] o, int64_t row, int64_t r,
                          int64_t src, int64_t base) noexcept nogil:
    cdef int64_t blk, d, m, lane
    for blk in range(8):
        o[base + 16 * r + 2 * blk] = rows[row, src + 34 * blk]
        o[base + 16 * r + 2 * blk + 1] = rows[row, src + 34 * blk + 1]
    for d in range(256):
        lane = _lane_word_byte(d, r, &m)
        # mma m, the lane's register (r / 8) + 2 (d % 2) (a0 / a1: even dims, a2 / a3: odd),
        # byte (d % 8) / 2
        o[base + 256 + 16 * (32 * m + lane) + 4 * ((r >> 3) + 2 * (d & 1))
          + ((d & 7) >> 1)] = rows[row, src + 34 * (d >> 5) + 2 + (d & 31)]


cdef void _pack_row_hfq6(const uint8_t[:, ::1] rows, uint8_t[::1] o, int64_t row, int64_t r,
                         int64_t src, int64_t base) noexcept nogil:
    cdef int64_t d, m, lane, x, jb, half = r >> 3, odd
    cdef unsigned int w = 0, code
    for d in range(8):
        o[base + 8 * r + d] = rows[row, src + d]
    for d in range(256):
        if d & 3 == 0:  # 4 codes in 3 bytes, LSB first
            x = src + 8 + 3 * (d >> 2)
            w = rows[row, x] | (<unsigned int>rows[row, x + 1] << 8) | (
                <unsigned int>rows[row, x + 2] << 16)
        code = (w >> (6 * (d & 3))) & 63
        lane = _lane_word_byte(d, r, &m)
        odd = d & 1
        jb = (d & 7) >> 1
        x = 3 * m + half  # the low-nibble word
        o[base + 128 + 16 * (32 * (x >> 2) + lane) + 4 * (x & 3) + jb] |= (code & 15) << (4 * odd)
        x = 3 * m + 2  # the high-bits word
        o[base + 128 + 16 * (32 * (x >> 2) + lane) + 4 * (x & 3) + jb] |= \
            (code >> 4) << (2 * (2 * half + odd))


def _pack_byte_tiles(const uint8_t[:, ::1] rows, int64_t groups, int64_t group_bytes,
                     int64_t tile_group_bytes, bint hfq6):
    """The tile / group / row walk of the byte-layout packings (HFQ6 ORs its bits into a
    zeroed output; Q8F16 writes every byte of a real row, so only padding needs zeros)."""
    cdef int64_t M = rows.shape[0]
    cdef int64_t tiles = (M + TILE_ROWS - 1) // TILE_ROWS
    out = _packed_out(M, rows.shape[1], groups, group_bytes, "bytes", f"{group_bytes} bytes",
                      tile_group_bytes, np.uint8, zeroed=hfq6)
    cdef uint8_t[::1] o = out
    cdef int64_t tile, g, r, row, base
    with nogil:
        for tile in range(tiles):
            for g in range(groups):
                base = (tile * groups + g) * tile_group_bytes
                for r in range(TILE_ROWS):
                    row = tile * TILE_ROWS + r
                    if row >= M:
                        break
                    if hfq6:
                        _pack_row_hfq6(rows, o, row, r, g * group_bytes, base)
                    else:
                        _pack_row_q8f16(rows, o, row, r, g * group_bytes, base)
    return out


def pack_tiles_q8f16(const uint8_t[:, ::1] rows, int64_t groups):
    """``rows``: the stored Q8F16 weights as ``uint8[M, groups * 272]``. Returns the packed
    ``uint8[ceil(M / 16) * groups * 4352]``."""
    return _pack_byte_tiles(rows, groups, Q8_GROUP_BYTES, Q8_TILE_GROUP_BYTES, False)


def pack_tiles_hfq6(const uint8_t[:, ::1] rows, int64_t groups):
    """``rows``: the stored HFQ6G256 weights as ``uint8[M, groups * 200]``. Returns the
    packed ``uint8[ceil(M / 16) * groups * 3200]``."""
    return _pack_byte_tiles(rows, groups, H6_GROUP_BYTES, H6_TILE_GROUP_BYTES, True)
