/* pagedkv cold-object layout (docs/contracts/cold-tier.md, '6. Object format'): the fixed parts of
 * a block object.
 *
 * A cold object is a safetensors container: u64 LE header length N, N bytes of
 * compact JSON padded with spaces to a multiple of 8, then the tensor bytes in
 * canonical order (tokens, layer.0.key, layer.0.value, ...). Geometry lives in the
 * JSON metadata; these helpers are the size arithmetic native readers need to
 * bound a read before parsing anything.
 */
#ifndef PAGEDKV_COLD_H
#define PAGEDKV_COLD_H

#include "portability.h"

#define PKV_COLD_HEADER_LEN_BYTES 8u   /* the u64 LE header length prefix */
#define PKV_COLD_HEADER_ALIGN 8u       /* header JSON padded with ' ' to this */
#define PKV_COLD_CHECKSUM_HEX 64u      /* SHA-256 as lowercase hex */
#define PKV_COLD_MAX_SIDECAR_TENSORS_PER_LAYER 16u
#define PKV_COLD_MAX_SIDECAR_DIMS 8u

/* dtype codes of a slab element; q8 is 34 bytes per 32 elements. */
enum pkv_cold_dtype {
    PKV_COLD_FLOAT16 = 0,
    PKV_COLD_BFLOAT16 = 1,
    PKV_COLD_FLOAT32 = 2,
    PKV_COLD_Q8 = 3,
};

/* header_overhead(n) = 256*n + 1024 + 15 bytes for n tensors (docs/contracts/cold-tier.md, '6.5
 * Size bounds'). */
PKV_FN uint64_t pkv_cold_header_overhead(uint64_t n_tensors) {
    return 256u * n_tensors + 1024u + 15u;
}

/* Bytes of one layer's K (or V) slab; 0 when the geometry is invalid
 * (q8 needs head_dim % 32 == 0). */
PKV_FN uint64_t pkv_cold_slab_bytes(uint64_t block_size, uint64_t num_kv_heads,
                                    uint64_t head_dim, int dtype) {
    uint64_t row;
    switch (dtype) {
    case PKV_COLD_FLOAT16:
    case PKV_COLD_BFLOAT16: row = head_dim * 2u; break;
    case PKV_COLD_FLOAT32: row = head_dim * 4u; break;
    case PKV_COLD_Q8:
        if (head_dim % 32u) return 0;
        row = head_dim / 32u * 34u; break;
    default: return 0;
    }
    return block_size * num_kv_heads * row;
}

/* Largest valid block object: payload + tokens + header overhead (docs/contracts/cold-tier.md, '6.5
 * Size bounds'). */
PKV_FN uint64_t pkv_cold_block_bound(uint64_t block_size, uint64_t num_layers,
                                     uint64_t slab_bytes) {
    return 2u * num_layers * slab_bytes + 4u * block_size
         + pkv_cold_header_overhead(1u + 2u * num_layers);
}

/* The same bound when a layer's K and V slabs differ (KV modes such as fwht4/q8). */
PKV_FN uint64_t pkv_cold_block_bound_kv(uint64_t block_size, uint64_t num_layers,
                                        uint64_t key_bytes, uint64_t value_bytes) {
    return num_layers * (key_bytes + value_bytes) + 4u * block_size
         + pkv_cold_header_overhead(1u + 2u * num_layers);
}

#endif /* PAGEDKV_COLD_H */
