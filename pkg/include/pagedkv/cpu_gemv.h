/* The prepared in-memory weight layout of the CPU int8 GEMV (pagedkv.quant.PreparedGemv).
 *
 * Reference: docs/formats/cpu-gemv.md. This layout lives in memory only: it is
 * built from HFQM bytes by `prepare_gemv` and never written to a file.
 *
 * Rows are cut into tiles of PKV_PGEMV_TILE_ROWS (the last tile padded with
 * zero rows) and K into spans: the weights that share one (scale, min) pair and
 * the x values that share one int8 scale. Per tile and span the codes form
 * chunks: each chunk is 4 bytes of every row of the tile, row after row, so one
 * 64-byte load holds the same 4 code bytes of 16 rows and an integer dot
 * product lane is one row (vpdpbusd / vpmaddubsw / sdot lanes need no
 * horizontal sum). Chunk bytes hold:
 *   - nibble codes (2-4 bits, Q4K): 8 codes per row per chunk; within each unit
 *     of U codes (128, or 32 for the span-32 kind NIBBLE32), byte 4c+b of chunk
 *     c holds code 4c+b in its low nibble and code U/2+4c+b in its high nibble,
 *     so the low and high halves of a vector meet x at offsets 0 and U/2 of the
 *     unit, in x's natural order;
 *   - byte codes (5-6 bits unsigned, Q8F16 signed): 4 codes per row per chunk,
 *     byte b of chunk c is code 4c+b.
 * Scales and minimums are separate arrays [tile][span][16 rows], f32 (HFQ,
 * MQ v1 and Q4K, whose d * sc and -(dmin * m) are exact in f32) or the stored f16 bits (MQ V2, MQ4C, Q8F16), widened exactly.
 */
#ifndef PAGEDKV_CPU_GEMV_H
#define PAGEDKV_CPU_GEMV_H

#include "portability.h"

#define PKV_PGEMV_TILE_ROWS     16u     /* rows per tile: the lanes of one 512-bit vector */
#define PKV_PGEMV_CHUNK_BYTES   4u      /* bytes of one row per chunk: one dot-product lane */
#define PKV_PGEMV_UNIT_CODES    128u    /* nibble codes: low nibbles 0-63, high 64-127 */
#define PKV_PGEMV_UNIT32_CODES  32u     /* NIBBLE32: low nibbles 0-15, high 16-31 */
#define PKV_PGEMV_X_MAX         127     /* int8 x is clamped to [-127, 127] */

/* Code storage kinds. */
enum {
    PKV_PGEMV_NIBBLE = 0,   /* unsigned codes 0..15, two per byte (2-, 3- and 4-bit formats) */
    PKV_PGEMV_UBYTE = 1,    /* unsigned codes 0..63, one per byte (5- and 6-bit formats) */
    PKV_PGEMV_SBYTE = 2,    /* signed codes -128..127, one per byte (Q8F16), no minimum */
    PKV_PGEMV_NIBBLE32 = 3, /* NIBBLE in units of 32 codes: span 32 (Q4K's sub-blocks), where
                             * a 128-code unit would straddle four (scale, min) pairs */
};

/* Whether codes of `kind` are nibbles, and their unit (codes per low/high pairing). */
PKV_FN int pkv_pgemv_is_nibble(int kind) {
    return kind == PKV_PGEMV_NIBBLE || kind == PKV_PGEMV_NIBBLE32;
}
PKV_FN uint32_t pkv_pgemv_unit_codes(int kind) {
    return kind == PKV_PGEMV_NIBBLE32 ? PKV_PGEMV_UNIT32_CODES : PKV_PGEMV_UNIT_CODES;
}

/* Bytes of one row of one span. */
PKV_FN uint32_t pkv_pgemv_span_row_bytes(int kind, uint32_t span) {
    return pkv_pgemv_is_nibble(kind) ? span / 2u : span;
}

/* Byte offset, inside the code block of one (tile, span), of the byte that holds code
 * j (0 <= j < span) of tile row r; for nibble codes *high is set when it is the high
 * nibble. The code block of (tile t, span s) starts at (t * n_spans + s) * 16 *
 * span_row_bytes. */
PKV_FN uint32_t pkv_pgemv_code_offset(int kind, uint32_t j, uint32_t r, uint32_t *high) {
    uint32_t byte_in_row;       /* which of the row's span bytes, in chunk order */
    if (pkv_pgemv_is_nibble(kind)) {
        const uint32_t U = pkv_pgemv_unit_codes(kind);
        uint32_t unit = j / U, within = j % U;
        *high = within >= U / 2u;
        byte_in_row = unit * (U / 2u) + within % (U / 2u);
    } else {
        *high = 0u;
        byte_in_row = j;
    }
    uint32_t chunk = byte_in_row / PKV_PGEMV_CHUNK_BYTES, b = byte_in_row % PKV_PGEMV_CHUNK_BYTES;
    return (chunk * PKV_PGEMV_TILE_ROWS + r) * PKV_PGEMV_CHUNK_BYTES + b;
}

#endif /* PAGEDKV_CPU_GEMV_H */
