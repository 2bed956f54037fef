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

cdef extern from "kv_rotated_loops.h" nogil:
    void pkv_cpu_kv_encode_rows(const float *x32, const uint16_t *x16, Py_ssize_t n_rows,
                                uint32_t hd, uint32_t mode, uint8_t *out)
    void pkv_cpu_kv_encode_rows_reference(const float *x32, const uint16_t *x16,
                                          Py_ssize_t n_rows, uint32_t hd, uint32_t mode,
                                          uint8_t *out)
    void pkv_cpu_kv_decode_rows(const uint8_t *rec, Py_ssize_t n_rows, uint32_t hd,
                                uint32_t mode, int rotated_basis, float *out)
    void pkv_cpu_kv_downshift_rows(const uint8_t *src, Py_ssize_t n_rows, uint32_t hd,
                                   uint32_t src_mode, uint32_t dst_mode, uint8_t *dst)
