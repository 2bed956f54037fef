/* Building the prepared GEMV layout (pagedkv/cpu_gemv.h) from stored groups.
 *
 * The stored groups are those of docs/formats/quant.md with K % G == 0 (a group
 * never straddles rows). The caller zeroes the output arrays: rows past M (the
 * last tile's padding) stay zero codes with zero scales and minimums.
 */
#ifndef PAGEDKV_QUANT_PREPARED_GEMV_PACK_H
#define PAGEDKV_QUANT_PREPARED_GEMV_PACK_H

#include "pagedkv/cpu_gemv.h"
#include "pagedkv/quant.h"
#include "affine_loops.h"   /* PKV_FAMILY_* */

/* The tile of a weight row, and (*r) its row within the tile. */
static inline ptrdiff_t pkv_pgemv_tile_of(ptrdiff_t row, uint32_t *r) {
    *r = (uint32_t)(row % (ptrdiff_t)PKV_PGEMV_TILE_ROWS);
    return row / (ptrdiff_t)PKV_PGEMV_TILE_ROWS;
}

/* The codes of one (row, span) into the code block of its (tile, span). */
static inline void pkv_pgemv_put_span(const uint8_t *q, uint32_t span, int kind, uint32_t r,
                                      uint8_t *blk) {
    if (pkv_pgemv_is_nibble(kind)) {
        const uint32_t U = pkv_pgemv_unit_codes(kind), half = U / 2u;
        for (uint32_t u = 0; u < span / U; ++u) {
            const uint8_t *qu = q + u * U;
            uint8_t *bu = blk + (size_t)u * 16u * half;
            for (uint32_t j = 0; j < half; ++j)
                bu[((j / 4u) * PKV_PGEMV_TILE_ROWS + r) * 4u + j % 4u] =
                    (uint8_t)(qu[j] | (qu[j + half] << 4));
        }
    } else {
        for (uint32_t j = 0; j < span; ++j)
            blk[((j / 4u) * PKV_PGEMV_TILE_ROWS + r) * 4u + j % 4u] = q[j];
    }
}

/* Rows [row0, row1) of affine groups (family, bits, G; K % G == 0) into codes / scales /
 * mins (rows write disjoint bytes, so ranges may run on different threads).
 * Spans: G for HFQ and MQ v1 (f32 parameters), 128 for MQ V2 and 256 for MQ4C (the
 * stored f16 bits). Nibble codes for 2-4 bits, bytes for 5-6 bits. */
static void pkv_pgemv_pack_affine(const uint8_t *raw, ptrdiff_t row0, ptrdiff_t row1, ptrdiff_t k,
                                  int family, uint32_t bits, uint32_t G, uint8_t *codes,
                                  void *scales, void *mins) {
    const int kind = bits <= 4u ? PKV_PGEMV_NIBBLE : PKV_PGEMV_UBYTE;
    const uint32_t span = family == PKV_FAMILY_MQ_V2 ? 128u : G;
    const uint32_t spans_per_group = G / span;
    const ptrdiff_t groups_per_row = k / (ptrdiff_t)G, ns = k / (ptrdiff_t)span;
    const size_t B = PKV_AFFINE_GROUP_BYTES(bits, G);
    const size_t blk_bytes = (size_t)PKV_PGEMV_TILE_ROWS * pkv_pgemv_span_row_bytes(kind, span);
    const int f16 = family == PKV_FAMILY_MQ_V2 || family == PKV_FAMILY_MQ4C;
    uint8_t q[256];
    for (ptrdiff_t row = row0; row < row1; ++row) {
        uint32_t r;
        const ptrdiff_t t = pkv_pgemv_tile_of(row, &r);
        for (ptrdiff_t g = 0; g < groups_per_row; ++g) {
            const uint8_t *grp = raw + (size_t)(row * groups_per_row + g) * B;
            pkv_unpack_codes(grp + PKV_AFFINE_HEADER_BYTES, G, bits, q);
            for (uint32_t h = 0; h < spans_per_group; ++h) {
                const ptrdiff_t s = g * (ptrdiff_t)spans_per_group + (ptrdiff_t)h;
                const size_t sb = (size_t)(t * ns + s);
                pkv_pgemv_put_span(q + h * span, span, kind, r, codes + sb * blk_bytes);
                const size_t at = sb * PKV_PGEMV_TILE_ROWS + r;
                if (f16) {     /* V2: (s, z) of half h at 4h; MQ4C: at 0 */
                    ((uint16_t *)scales)[at] = (uint16_t)pkv_load_u16le(grp + 4u * h);
                    ((uint16_t *)mins)[at] = (uint16_t)pkv_load_u16le(grp + 4u * h + 2u);
                } else {
                    ((float *)scales)[at] = pkv_hfq_scale(grp);
                    ((float *)mins)[at] = pkv_hfq_min(grp);
                }
            }
        }
    }
}

/* Rows [row0, row1) of Q8F16 blocks (K % 32 == 0): span 32, f16 scales, signed codes. */
static void pkv_pgemv_pack_q8f16(const uint8_t *raw, ptrdiff_t row0, ptrdiff_t row1, ptrdiff_t k,
                                 uint8_t *codes, uint16_t *scales) {
    const ptrdiff_t ns = k / (ptrdiff_t)PKV_Q8F16_GROUP;
    const size_t blk_bytes = (size_t)PKV_PGEMV_TILE_ROWS * PKV_Q8F16_GROUP;
    for (ptrdiff_t row = row0; row < row1; ++row) {
        uint32_t r;
        const ptrdiff_t t = pkv_pgemv_tile_of(row, &r);
        for (ptrdiff_t s = 0; s < ns; ++s) {
            const uint8_t *blk = raw + (size_t)(row * ns + s) * PKV_Q8F16_GROUP_BYTES;
            const size_t sb = (size_t)(t * ns + s);
            pkv_pgemv_put_span(blk + 2, PKV_Q8F16_GROUP, PKV_PGEMV_SBYTE, r, codes + sb * blk_bytes);
            scales[sb * PKV_PGEMV_TILE_ROWS + r] = (uint16_t)pkv_load_u16le(blk);
        }
    }
}

/* Rows [row0, row1) of Q4K super-blocks (K % 256 == 0) into spans of 32 (kind NIBBLE32):
 * sub-block j of a super-block is span 8g + j. Its 6-bit scale sc and minimum m are kept
 * as bytes, the super-block's f32(d) and -f32(dmin) as the factors of its 8 spans
 * (PKV_PG_PARAM_U8X8): the kernels form scale = f32(d) * sc and min = -(f32(dmin) * m),
 * the products of ggml's dequantize_row_q4_K (pkv_q4k_decode_group; exact in f32: 11 x 6
 * significant bits), so scale * q + min is the decoded weight. 4.75 bits per weight to
 * read instead of 6 with an f32 scale and minimum per span. Q4K stores sub-blocks 2c and
 * 2c + 1 in the low and high nibbles of the same 32 bytes; each becomes its own span (its
 * codes re-paired low/high within the span). */
static void pkv_pgemv_pack_q4k(const uint8_t *raw, ptrdiff_t row0, ptrdiff_t row1, ptrdiff_t k,
                               uint8_t *codes, uint8_t *scales, uint8_t *mins,
                               float *scale_factors, float *min_factors) {
    const uint32_t sub = PKV_PGEMV_UNIT32_CODES, subs = PKV_Q4K_GROUP / sub;
    const ptrdiff_t groups_per_row = k / (ptrdiff_t)PKV_Q4K_GROUP, ns = k / (ptrdiff_t)sub;
    const size_t blk_bytes = (size_t)PKV_PGEMV_TILE_ROWS * pkv_pgemv_span_row_bytes(PKV_PGEMV_NIBBLE32, sub);
    uint8_t q[32];
    /* super-blocks are row-major and a row holds whole ones: walk them in storage order */
    for (ptrdiff_t i = row0 * groups_per_row; i < row1 * groups_per_row; ++i) {
        const uint8_t *grp = raw + (size_t)i * PKV_Q4K_GROUP_BYTES;
        uint32_t r;
        const ptrdiff_t t = pkv_pgemv_tile_of(i / groups_per_row, &r);
        const ptrdiff_t g = i % groups_per_row, s0 = g * (ptrdiff_t)subs;   /* its first span */
        const size_t f = (size_t)(t * groups_per_row + g) * PKV_PGEMV_TILE_ROWS + r;
        scale_factors[f] = pkv_f16_to_f32(pkv_load_u16le(grp));
        min_factors[f] = -pkv_f16_to_f32(pkv_load_u16le(grp + 2));
        for (uint32_t j = 0; j < subs; ++j) {
            uint32_t sc, m;
            pkv_q4k_scale_min(grp + 4, j, &sc, &m);
            const uint8_t *qs = grp + 16u + 32u * (j / 2u);
            for (uint32_t l = 0; l < sub; ++l) q[l] = (uint8_t)((qs[l] >> (4u * (j & 1u))) & 0xFu);
            const size_t sb = (size_t)(t * ns + s0 + (ptrdiff_t)j);
            pkv_pgemv_put_span(q, sub, PKV_PGEMV_NIBBLE32, r, codes + sb * blk_bytes);
            scales[sb * PKV_PGEMV_TILE_ROWS + r] = (uint8_t)sc;
            mins[sb * PKV_PGEMV_TILE_ROWS + r] = (uint8_t)m;
        }
    }
}

#endif /* PAGEDKV_QUANT_PREPARED_GEMV_PACK_H */
