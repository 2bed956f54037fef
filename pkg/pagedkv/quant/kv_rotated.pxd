# Rotated KV-cache modes (fwhtN K, lloydN V): the declarations of pagedkv/kvquant.h.
from libc.stdint cimport uint8_t, uint16_t, uint32_t

cdef extern from "pagedkv/kvquant.h" nogil:
    const uint32_t PKV_KV_MODE_Q8
    const uint32_t PKV_KV_MODE_FWHT4
    const uint32_t PKV_KV_MODE_FWHT3
    const uint32_t PKV_KV_MODE_FWHT2
    const uint32_t PKV_KV_MODE_LLOYD4
    const uint32_t PKV_KV_MODE_LLOYD3
    const uint32_t PKV_KV_MODE_LLOYD2
    const uint32_t PKV_KV_MODE_COUNT
    const uint32_t PKV_KV_CNORM_BYTES
    const uint32_t PKV_KV_CENTROID_COUNT
    const uint32_t PKV_KV_THRESHOLD_COUNT
    const float pkv_kv_centroids[]
    const float pkv_kv_thresholds[]
    uint32_t pkv_kv_mode_bits(uint32_t mode)
    uint32_t pkv_kv_mode_rotation(uint32_t mode)
    uint32_t pkv_kv_row_bytes(uint32_t mode, uint32_t head_dim)
    uint32_t pkv_kv_centroid_offset(uint32_t bits, uint32_t family)
    uint32_t pkv_kv_threshold_offset(uint32_t bits, uint32_t family)
