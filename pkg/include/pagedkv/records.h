/* Public records of the hot block allocator (docs/contracts/paged-kv.md, '2.3 Block identity and
 * verification' and '4. BlockAllocator'; docs/development.md, 'Core layouts').
 *
 * These structs are the embedding contract and the only statement of the layout:
 * pagedkv.allocator.BLOCK_DTYPE and PREFIX_SLOT_DTYPE are NumPy structured dtypes built
 * from them at import (PKV_STRUCT_FIELD, pagedkv/struct_fields.h). Native code that reads
 * BlockAllocator.block_records / prefix_slots includes this header.
 *
 * All fields are naturally aligned and the structs have explicit tail padding, so the
 * layout is the same on every C11 ABI pagedkv supports.
 */
#ifndef PAGEDKV_RECORDS_H
#define PAGEDKV_RECORDS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Sentinel for "no block" in the intrusive lists and in empty prefix slots. */
#define PKV_NO_BLOCK (-1)

/* pkv_block_record.flags */
#define PKV_BLOCK_FREE   0x1u  /* linked into the free queue */
#define PKV_BLOCK_CACHED 0x2u  /* holds a prefix-table entry (hot_hash is its key) */
#define PKV_BLOCK_NULL   0x4u  /* the reserved null block of a sliding group (docs/contracts/paged-kv.md, '8.6 Sliding null sentinel') */

/* Bytes of a non-empty extra-keys digest (BLAKE2b-128). */
#define PKV_EXTRA_KEYS_DIGEST_BYTES 16

/* One block's metadata: one element of the allocator's block array (80 bytes). The
 * block's token identity (bs uint32 ids) lives in row `id` of the separate
 * uint32[max_num_blocks, block_size] token array, so this record stays fixed-size. */
typedef struct pkv_block_record {
    uint64_t hot_hash;          /* prefix-table key while PKV_BLOCK_CACHED */
    uint64_t parent_hash;       /* identity: hot hash of the previous chain block, 0 for block 0 */
    uint64_t cache_salt;        /* identity: domain id of the publishing request */
    int64_t  block_index;       /* identity: position in the chain */
    uint8_t  extra_keys_digest[PKV_EXTRA_KEYS_DIGEST_BYTES]; /* identity: BLAKE2b-128 or zeros */
    int32_t  refcount;          /* references held, the cache's one included; 0 when free */
    int32_t  token_count;       /* tokens of the identity row that are valid (bs while cached) */
    int32_t  lru_prev;          /* towards the least recently used entry, or PKV_NO_BLOCK */
    int32_t  lru_next;          /* towards the most recently used entry, or PKV_NO_BLOCK */
    int32_t  free_prev;         /* towards the free-queue front, or PKV_NO_BLOCK */
    int32_t  free_next;         /* towards the free-queue back, or PKV_NO_BLOCK */
    uint32_t flags;             /* PKV_BLOCK_* bits */
    uint32_t extra_keys_digest_len; /* 0 (no extra keys) or PKV_EXTRA_KEYS_DIGEST_BYTES */
} pkv_block_record;

/* One slot of the open-addressing prefix table (16 bytes). The table is a power-of-two
 * array with linear probing and backward-shift deletion, so there are no tombstones:
 * a slot is either empty (block == PKV_NO_BLOCK) or holds a live entry. */
typedef struct pkv_prefix_slot {
    uint64_t key;     /* hot block hash */
    int32_t  block;   /* block id, or PKV_NO_BLOCK when the slot is empty */
    int32_t  _pad;    /* explicit tail padding; always 0 */
} pkv_prefix_slot;

#ifdef __cplusplus
}
#endif

#endif /* PAGEDKV_RECORDS_H */
