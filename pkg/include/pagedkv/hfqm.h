/* HFQM v1 container layout and the quant-type (qt) register.
 *
 * Source: docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register' (register) and
 * docs/contracts/hfqm-and-quant.md, '2. HFQM v1 container' (container).
 * This header is the only statement of both: pagedkv.quant.qtypes reads the register
 * from PKV_QT_LIST at import (through pagedkv.quant.qt_register) and the NumPy twins
 * of the structs are built from them (pagedkv.hfqm.index); both include this file.
 *
 * Usable from C (Cython), HIP/CUDA and Metal: no libc, no host-only types in the
 * functions, every function PKV_FN.
 */
#ifndef PAGEDKV_HFQM_H
#define PAGEDKV_HFQM_H

#include "portability.h"

/* ---------------------------------------------------------------------------
 * Container constants (docs/contracts/hfqm-and-quant.md, '2.1 Header (32 bytes) and body' and '2.8
 * Embedded sections and MTP bundle')
 * ------------------------------------------------------------------------- */

#define PKV_HFQM_MAGIC_U32          0x4D514648u  /* "HFQM" read as a little-endian u32 */
#define PKV_HFQM_INCOMPLETE_U32     0x21514648u  /* "HFQ!": fork's in-progress marker  */
#define PKV_HFQM_VERSION            1u
#define PKV_HFQM_HEADER_BYTES       32u
#define PKV_HFQM_METADATA_OFFSET    32u          /* what writers store */
#define PKV_HFQM_DATA_ALIGN_BYTES   4096u        /* data_offset is a multiple of this */
#define PKV_HFQM_MAX_DIMS           8u           /* n_dims is a u8; pagedkv caps it at 8 */
/* pagedkv's cap on a shape: the product of its NON-ZERO dims (so an empty tensor of
 * shape [0, 2^32-1, 2^32-1] is refused too: no array library can allocate it). */
#define PKV_HFQM_MAX_NUMEL          (1ull << 48)
#define PKV_HFQM_MTP_TRAILER_BYTES  16u          /* "HFBNDMTP" ++ u64 mtp_off */

/* On-disk header, 32 bytes, little-endian. Offsets are relative to `base`,
 * the byte where the HFQM section starts (0 for a plain file, mtp_off for the
 * MTP head of a bundle). */
typedef struct pkv_hfqm_header {
    uint8_t  magic[4];          /* "HFQM" */
    uint32_t version;           /* 1 */
    uint32_t arch_id;           /* docs/contracts/hfqm-and-quant.md, '2.5 arch_id' */
    uint32_t n_tensors;         /* == index count */
    uint64_t metadata_offset;   /* bytes from base; writers: 32 */
    uint64_t data_offset;       /* bytes from base; multiple of 4096 */
} pkv_hfqm_header;

PKV_STATIC_ASSERT(sizeof(pkv_hfqm_header) == 32, "HFQM header is 32 bytes");

/* Field offsets of the header, bytes. */
#define PKV_HFQM_HDR_MAGIC_OFF            0u
#define PKV_HFQM_HDR_VERSION_OFF          4u
#define PKV_HFQM_HDR_ARCH_ID_OFF          8u
#define PKV_HFQM_HDR_N_TENSORS_OFF       12u
#define PKV_HFQM_HDR_METADATA_OFFSET_OFF 16u
#define PKV_HFQM_HDR_DATA_OFFSET_OFF     24u

/* Tensor index (variable-length entries, packed, little-endian):
 *   u32 count
 *   per tensor: u16 name_len | u8 name[name_len] | u8 quant_type | u8 n_dims |
 *               u32 shape[n_dims] | u32 group_size | u64 data_size
 * An entry therefore takes PKV_HFQM_INDEX_ENTRY_FIXED_BYTES + name_len + 4*n_dims. */
#define PKV_HFQM_INDEX_COUNT_BYTES        4u
#define PKV_HFQM_INDEX_NAME_LEN_BYTES     2u
#define PKV_HFQM_INDEX_QT_BYTES           1u
#define PKV_HFQM_INDEX_NDIMS_BYTES        1u
#define PKV_HFQM_INDEX_DIM_BYTES          4u
#define PKV_HFQM_INDEX_GROUP_SIZE_BYTES   4u
#define PKV_HFQM_INDEX_DATA_SIZE_BYTES    8u
#define PKV_HFQM_INDEX_ENTRY_FIXED_BYTES  16u  /* 2 + 1 + 1 + 4 + 8 */

/* One parsed index entry, as pagedkv holds it in memory (the NumPy dtype
 * pagedkv.hfqm.index.TENSOR_RECORD_DTYPE matches this struct field by field).
 * Offsets are absolute byte offsets in the file (base included): payloads
 * follow one another from base + data_offset by running sum. */
typedef struct pkv_hfqm_tensor_record {
    uint64_t offset;        /* payload start, bytes from the start of the file */
    uint64_t nbytes;        /* payload size (index data_size), bytes */
    uint64_t name_offset;   /* name start, bytes from the start of the file */
    uint32_t shape[PKV_HFQM_MAX_DIMS];  /* outermost first; unused dims are 0 */
    uint32_t name_len;      /* bytes (u16 on disk) */
    uint32_t group_size;    /* informational, as stored */
    uint8_t  qt;            /* quant type id, docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register' */
    uint8_t  ndim;
    uint8_t  pad_[6];
} pkv_hfqm_tensor_record;

PKV_STATIC_ASSERT(sizeof(pkv_hfqm_tensor_record) == 72, "tensor record is 72 bytes");

/* ---------------------------------------------------------------------------
 * Quant-type register (docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register')
 *
 * PKV_QT_LIST(X) expands X(id, NAME, G, B, SIZE_RULE, STATUS, FLAGS) once per
 * registered or reserved id:
 *   G         weights per group (1 for raw types, 0 where docs/contracts/hfqm-and-quant.md, '1.1
 * Quant-type register' gives none)
 *   B         bytes per group   (element bytes for raw types, 0 where none)
 *   SIZE_RULE how data_size follows from the shape (PKV_QT_SIZE_*)
 *   STATUS    what pagedkv does with it (PKV_QT_STATUS_*)
 *   FLAGS     PKV_QT_FLAG_* bits
 * ------------------------------------------------------------------------- */

/* Size rules (checked by the reader, docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register'
 * "Tensor size"). M = numel / K, K = last dim. */
#define PKV_QT_SIZE_NONE        0  /* no rule: any data_size is accepted */
#define PKV_QT_SIZE_GROUPS      1  /* ceil(numel / G) * B, last group padded */
#define PKV_QT_SIZE_ROW_HEADER  2  /* HFP4 family: M * (16 + B * ceil(K / G)) */
#define PKV_QT_SIZE_ROW_PAD128  3  /* Q8HFQ: M * round_up(B * ceil(K / G), 128) */
#define PKV_QT_SIZE_HESSIAN     4  /* qt 130: [K, K] -> 4*K + 2*K*(K-1)/2 */

/* Status: what pagedkv does with the id. */
#define PKV_QT_STATUS_UNKNOWN   0  /* not in the register: UnknownQuantType at open */
#define PKV_QT_STATUS_P1        1  /* registered, decoded by pagedkv now */
#define PKV_QT_STATUS_P2        2  /* registered, raw bytes only (decode later) */
#define PKV_QT_STATUS_REFUSE    3  /* registered, raw bytes only (no wire spec) */
#define PKV_QT_STATUS_RESERVED  4  /* never assign: UnknownQuantType at open */
#define PKV_QT_STATUS_CALIB     5  /* only valid inside a *.calib.hfq file */

/* Flags. */
#define PKV_QT_FLAG_ROTATED     1  /* stored after the FWHT-256 rotation (docs/contracts/hfqm-and-quant.md, '3.6 FWHT rotation') */
#define PKV_QT_FLAG_K_MULT_256  2  /* requires K % 256 == 0 (V2, MQ4C, GL) */
#define PKV_QT_FLAG_RAW         4  /* one element per "group": F16, F32, BF16, TidI32 */

#define PKV_QT_LIST(X) \
    X(  0, Q4F16G64,       64,  36, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       0) \
    X(  1, F16,             1,   2, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_RAW) \
    X(  2, F32,             1,   4, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_RAW) \
    X(  3, Q8F16,          32,  34, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       0) \
    X(  4, Q4K,           256, 144, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       0) \
    X(  5, Q8HFQ,          32,  34, PKV_QT_SIZE_ROW_PAD128, PKV_QT_STATUS_P1,       0) \
    X(  6, HFQ4G256,      256, 136, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       0) \
    X(  7, HFQ4G128,      128,  72, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       0) \
    X(  8, HFQ6G256,      256, 200, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       0) \
    X(  9, HFQ2G256,      256,  72, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       0) \
    X( 10, HFQ2G128,      128,  40, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       0) \
    X( 11, HFQ3G256,      256, 104, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       0) \
    X( 12, HFQ3G128,      128,  56, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       0) \
    X( 13, MQ4G256,       256, 136, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED) \
    X( 14, MQ8G256,       256, 258, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED) \
    X( 15, MQ6G256,       256, 200, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED) \
    X( 16, BF16,            1,   2, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_RAW) \
    X( 17, MQ3G256,       256, 104, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED) \
    X( 18, MQ2G256,       256,  72, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED) \
    X( 19, MQ2G256Lloyd,  256,  72, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED) \
    X( 20, MQ3G256Lloyd,  256, 112, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED) \
    X( 21, HFP4G32,        32,  17, PKV_QT_SIZE_ROW_HEADER, PKV_QT_STATUS_P1,       0) \
    X( 22, TidI32,          1,   4, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_RAW) \
    X( 23, Reserved23,      0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_RESERVED, 0) \
    X( 24, MFP4G32,        32,  17, PKV_QT_SIZE_ROW_HEADER, PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED) \
    X( 25, Reserved25,      0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_RESERVED, 0) \
    X( 26, Reserved26,      0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_RESERVED, 0) \
    X( 27, Reserved27,      0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_RESERVED, 0) \
    X( 28, PARO4G128,       0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_P2,       0) \
    X( 29, PARO4G128T,      0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_P2,       0) \
    X( 30, MQ4G256Lloyd,  256, 160, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED) \
    X( 31, MQ5G256,       256, 168, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED) \
    X( 32, MFP4G32Lloyd,    0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_P2,       PKV_QT_FLAG_ROTATED) \
    X( 33, MFP4G32P,       32,  17, PKV_QT_SIZE_ROW_HEADER, PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED) \
    X( 34, MFP4G32E8,       0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_REFUSE,   PKV_QT_FLAG_ROTATED) \
    X( 35, MFP4G32E8SOA,    0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_REFUSE,   PKV_QT_FLAG_ROTATED) \
    X( 36, MFP3G32E8,       0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_REFUSE,   PKV_QT_FLAG_ROTATED) \
    X( 37, MFP2G32E8,       0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_REFUSE,   PKV_QT_FLAG_ROTATED) \
    X( 38, MQ2G256GL,     256,  66, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED | PKV_QT_FLAG_K_MULT_256) \
    X( 39, MQ3G256GL,     256,  98, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED | PKV_QT_FLAG_K_MULT_256) \
    X( 40, TQ2G128,       128,  34, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       0) \
    X( 41, BQ1G128,       128,  18, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       0) \
    X( 42, Reserved42,      0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_RESERVED, 0) \
    X( 43, Reserved43,      0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_RESERVED, 0) \
    X( 44, MQ4G256V2,     256, 136, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED | PKV_QT_FLAG_K_MULT_256) \
    X( 45, MQ4CG256,      256, 136, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED | PKV_QT_FLAG_K_MULT_256) \
    X( 46, Reserved46,      0,   0, PKV_QT_SIZE_NONE,       PKV_QT_STATUS_RESERVED, 0) \
    X( 47, MQ6G256V2,     256, 200, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED | PKV_QT_FLAG_K_MULT_256) \
    X( 48, MQ5G256V2,     256, 168, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED | PKV_QT_FLAG_K_MULT_256) \
    X( 49, MQ3G256V2,     256, 104, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED | PKV_QT_FLAG_K_MULT_256) \
    X( 50, MQ2G256V2,     256,  72, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       PKV_QT_FLAG_ROTATED | PKV_QT_FLAG_K_MULT_256) \
    X( 51, MQ2G256LloydU, 256,  72, PKV_QT_SIZE_GROUPS,     PKV_QT_STATUS_P1,       0) \
    X(130, CalibHessian,    0,   0, PKV_QT_SIZE_HESSIAN,    PKV_QT_STATUS_CALIB,    0)

/* Ids: PKV_QT_<NAME>; per-qt group geometry: PKV_QT_<NAME>_GROUP (weights per
 * group) and PKV_QT_<NAME>_GROUP_BYTES (bytes per group), 0 where docs/contracts/hfqm-and-quant.md,
 * '1.1 Quant-type register' gives none. */
#define PKV_QT_ENUM_ITEM_(id, name, g, b, rule, status, flags) \
    PKV_QT_##name = id, PKV_QT_##name##_GROUP = g, PKV_QT_##name##_GROUP_BYTES = b,
enum pkv_qt_ids { PKV_QT_LIST(PKV_QT_ENUM_ITEM_) PKV_QT_ID_LIMIT_ = 256 };
#undef PKV_QT_ENUM_ITEM_

/* Register lookups by id (switches the compiler folds into tables). An id not
 * in the register gives 0 (status PKV_QT_STATUS_UNKNOWN, no size rule). */
#define PKV_QT_CASE_(id, name, g, b, rule, status, flags) case id: return PKV_QT_FIELD_(g, b, rule, status, flags);

#define PKV_QT_FIELD_(g, b, rule, status, flags) (g)
PKV_FN uint32_t pkv_qt_group_size(uint32_t qt) { switch (qt) { PKV_QT_LIST(PKV_QT_CASE_) default: return 0; } }
#undef PKV_QT_FIELD_
#define PKV_QT_FIELD_(g, b, rule, status, flags) (b)
PKV_FN uint32_t pkv_qt_group_bytes(uint32_t qt) { switch (qt) { PKV_QT_LIST(PKV_QT_CASE_) default: return 0; } }
#undef PKV_QT_FIELD_
#define PKV_QT_FIELD_(g, b, rule, status, flags) (rule)
PKV_FN uint32_t pkv_qt_size_rule(uint32_t qt) { switch (qt) { PKV_QT_LIST(PKV_QT_CASE_) default: return PKV_QT_SIZE_NONE; } }
#undef PKV_QT_FIELD_
#define PKV_QT_FIELD_(g, b, rule, status, flags) (status)
PKV_FN uint32_t pkv_qt_status(uint32_t qt) { switch (qt) { PKV_QT_LIST(PKV_QT_CASE_) default: return PKV_QT_STATUS_UNKNOWN; } }
#undef PKV_QT_FIELD_
#define PKV_QT_FIELD_(g, b, rule, status, flags) (flags)
PKV_FN uint32_t pkv_qt_flags(uint32_t qt) { switch (qt) { PKV_QT_LIST(PKV_QT_CASE_) default: return 0; } }
#undef PKV_QT_FIELD_
#undef PKV_QT_CASE_

/* Payload bytes a tensor of qt needs, from its element count and last dim K
 * (docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register' "Tensor size"). Returns 0 when the
 * qt has no size rule (PKV_QT_SIZE_NONE):
 * callers then accept any data_size. Rows: M = numel / K (K > 0). */
PKV_FN uint64_t pkv_qt_expected_nbytes(uint32_t qt, uint64_t numel, uint64_t k)
{
    const uint64_t g = pkv_qt_group_size(qt);
    const uint64_t b = pkv_qt_group_bytes(qt);
    switch (pkv_qt_size_rule(qt)) {
    case PKV_QT_SIZE_GROUPS:
        return (numel + g - 1) / g * b;
    case PKV_QT_SIZE_ROW_HEADER:
        return k == 0 ? 0 : (numel / k) * (16 + b * ((k + g - 1) / g));
    case PKV_QT_SIZE_ROW_PAD128:
        return k == 0 ? 0 : (numel / k) * ((b * ((k + g - 1) / g) + 127) / 128 * 128);
    case PKV_QT_SIZE_HESSIAN:
        return 4 * k + k * (k > 0 ? k - 1 : 0);
    default:
        return 0;
    }
}

#endif /* PAGEDKV_HFQM_H */
