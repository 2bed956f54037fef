# cython: language_level=3
"""C declarations of the quant-type register of pagedkv/hfqm.h (``PKV_QT_LIST``): its
accessors and codes. pagedkv.hfqm.index cimports them; pagedkv.quant owns them because the
codecs own their types and the container only uses them."""

from libc.stdint cimport uint32_t, uint64_t


cdef extern from "pagedkv/hfqm.h" nogil:
    enum:
        PKV_QT_SIZE_NONE
        PKV_QT_SIZE_GROUPS
        PKV_QT_SIZE_ROW_HEADER
        PKV_QT_SIZE_ROW_PAD128
        PKV_QT_SIZE_HESSIAN
        PKV_QT_STATUS_UNKNOWN
        PKV_QT_STATUS_P1
        PKV_QT_STATUS_P2
        PKV_QT_STATUS_REFUSE
        PKV_QT_STATUS_RESERVED
        PKV_QT_STATUS_CALIB
        PKV_QT_FLAG_ROTATED
        PKV_QT_FLAG_K_MULT_256
        PKV_QT_FLAG_RAW

    uint32_t pkv_qt_group_size(uint32_t qt)
    uint32_t pkv_qt_group_bytes(uint32_t qt)
    uint32_t pkv_qt_size_rule(uint32_t qt)
    uint32_t pkv_qt_status(uint32_t qt)
    uint32_t pkv_qt_flags(uint32_t qt)
    uint64_t pkv_qt_expected_nbytes(uint32_t qt, uint64_t numel, uint64_t k)
