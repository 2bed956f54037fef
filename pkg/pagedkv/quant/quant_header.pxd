# Declarations of pagedkv/quant.h (the per-element quant math shared with the
# GPU kernels). Declarations only: there is no quant_header module.
from libc.stdint cimport int32_t, uint8_t, uint16_t, uint32_t, uint64_t

cdef extern from "pagedkv/quant.h" nogil:
    const uint32_t PKV_FWHT_N
    const uint32_t PKV_AFFINE_HEADER_BYTES
    const uint32_t PKV_Q8F16_GROUP
    const uint32_t PKV_Q8F16_GROUP_BYTES
    const int PKV_ENCODE_OK
    const int PKV_ENCODE_UNREPRESENTABLE

    uint32_t pkv_f32_bits(float x)
    int pkv_f32_is_nonfinite(float x)
    Py_ssize_t pkv_first_nonfinite(const float *x, Py_ssize_t n)
    Py_ssize_t pkv_first_nonfinite_f16(const uint16_t *h, Py_ssize_t n)
    uint32_t pkv_f16_trunc(float x)
    uint32_t pkv_f16_rne(float x)
    float pkv_f16_to_f32(uint32_t h)
    float pkv_bf16_to_f32(uint32_t h)
    uint32_t pkv_bf16_trunc(float x)

    uint32_t pkv_round_affine(float x, float base, float inv, float L)
    int32_t pkv_round_q8(float v)

    uint32_t pkv_unpack_code(const uint8_t *payload, uint32_t j, uint32_t bits)
    void pkv_pack_codes(const uint8_t *q, uint32_t n, uint32_t bits, uint8_t *out)
    void pkv_unpack_codes(const uint8_t *payload, uint32_t n, uint32_t bits, uint8_t *q)

    uint32_t pkv_sign_lcg_next(uint32_t state)
    void pkv_signs_generate(uint32_t seed, uint32_t n, float *out)
    uint32_t pkv_signs1_word(uint32_t w)
    uint32_t pkv_signs2_word(uint32_t w)

    void pkv_fwht_butterflies(float *y, uint32_t n)
    void pkv_fwht_with_tables(const float *x, float *y, uint32_t n, const float *pre,
                              const float *post)
    void pkv_fwht(const float *x, float *y, uint32_t n)
    void pkv_ifwht(const float *x, float *y, uint32_t n)

    float pkv_hfq_scale(const uint8_t *blk)
    float pkv_hfq_min(const uint8_t *blk)
    int pkv_hfq_encode_group(const float *x, uint32_t n, uint32_t bits, uint32_t G,
                             uint8_t *q, uint8_t *blk)
    void pkv_hfq_decode_group(const uint8_t *blk, uint32_t bits, uint32_t G, uint8_t *q, float *out)

    int pkv_mqv1_encode_group(const float *r, uint32_t bits, uint8_t *q, uint8_t *blk)
    int pkv_mqv2_encode_group(const float *r, uint32_t bits, uint8_t *q, uint8_t *blk)
    int pkv_mq4c_encode_group(const float *r, uint8_t *q, uint8_t *blk)
    float pkv_mqv2_scale(const uint8_t *blk, uint32_t half)
    float pkv_mqv2_zero(const uint8_t *blk, uint32_t half)
    void pkv_mqv2_decode_group(const uint8_t *blk, uint32_t bits, uint8_t *q, float *out)
    void pkv_mq4c_decode_group(const uint8_t *blk, uint8_t *q, float *out)

    int pkv_q8f16_encode_group(const float *x, uint32_t n, uint8_t *blk)
    void pkv_q8f16_decode_group(const uint8_t *blk, float *out)
    uint32_t pkv_q8_block_codes(const float *x, uint32_t n, uint8_t *codes_out)
    void pkv_store_u16le(uint8_t *p, uint32_t v)
    int PKV_F16_IS_NONFINITE(uint32_t h)

    # P2 formats (docs/formats/quant.md, "P2 formats")
    const uint32_t PKV_FP4_FLAGS_PLAIN
    const uint32_t PKV_FP4_FLAGS_ROTATED
    const uint32_t PKV_FP4_UE8M0_RESERVED
    float pkv_e2m1_value(uint32_t n)
    uint32_t pkv_e2m1_nearest(float v)
    float pkv_e4m3u_value(uint32_t b)
    uint32_t pkv_e4m3u_ceil(float s)
    void pkv_fp4_decode_row(const uint8_t *row, uint32_t K, int e4m3, float *out)
    float pkv_gl_codebook(uint32_t bits, uint32_t k)
    void pkv_gl_decode_group(const uint8_t *raw, uint32_t bits, uint64_t n_groups, uint64_t g,
                             uint8_t *q, float *out)
    int pkv_mq8_encode_group(const float *r, uint8_t *blk)
    void pkv_mq8_decode_group(const uint8_t *blk, float *out)
    int pkv_q8hfq_encode_row(const float *x, uint32_t K, uint8_t *row)
    float pkv_q8hfq_decode_elem(const uint8_t *row, uint32_t K, uint32_t j)
    int pkv_q4f16g64_encode_group(const float *x, uint32_t n, uint8_t *blk)
    void pkv_q4f16g64_decode_group(const uint8_t *blk, float *out)
    void pkv_q4k_decode_group(const uint8_t *blk, float *out)
    float pkv_tq2_decode_elem(const uint8_t *blk, uint32_t i)
    float pkv_bq1_decode_elem(const uint8_t *blk, uint32_t i)
