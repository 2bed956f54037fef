# KV-cache q8 records (docs/contracts/hfqm-and-quant.md, '6.3 q8 (K and V)'): the per-element math
# of kvquant.h.
from libc.stdint cimport int32_t, uint32_t

cdef extern from "pagedkv/kvquant.h" nogil:
    enum:
        PKV_KVQ8_BLOCK          # values per record
        PKV_KVQ8_RECORD_BYTES   # bytes per record: f16 scale + PKV_KVQ8_BLOCK int8
    uint32_t pkv_kvq8_row_bytes(uint32_t head_dim)
    float pkv_kvq8_inv_scale(float amax)
    uint32_t pkv_kvq8_scale_bits(float amax)
    int32_t pkv_kvq8_code(float v, float inv_scale)
    float pkv_kvq8_value(float scale, int32_t code)
