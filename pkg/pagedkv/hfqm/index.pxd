# cython: language_level=3
"""C declarations of pagedkv/hfqm.h (HFQM header, tensor record); the qt register's come from
pagedkv.quant.qt_register."""

from libc.stdint cimport uint8_t, uint32_t, uint64_t

from pagedkv.quant.qt_register cimport (
    PKV_QT_FLAG_K_MULT_256, PKV_QT_FLAG_RAW, PKV_QT_FLAG_ROTATED, PKV_QT_SIZE_GROUPS,
    PKV_QT_SIZE_HESSIAN, PKV_QT_SIZE_NONE, PKV_QT_SIZE_ROW_HEADER, PKV_QT_SIZE_ROW_PAD128,
    PKV_QT_STATUS_CALIB, PKV_QT_STATUS_P1, PKV_QT_STATUS_P2, PKV_QT_STATUS_REFUSE,
    PKV_QT_STATUS_RESERVED, PKV_QT_STATUS_UNKNOWN, pkv_qt_expected_nbytes, pkv_qt_flags,
    pkv_qt_group_bytes, pkv_qt_group_size, pkv_qt_size_rule, pkv_qt_status,
)


cdef extern from "pagedkv/hfqm.h" nogil:
    enum:
        PKV_HFQM_MAGIC_U32
        PKV_HFQM_INCOMPLETE_U32
        PKV_HFQM_VERSION
        PKV_HFQM_HEADER_BYTES
        PKV_HFQM_METADATA_OFFSET
        PKV_HFQM_DATA_ALIGN_BYTES
        PKV_HFQM_MAX_DIMS
        PKV_HFQM_MTP_TRAILER_BYTES
        PKV_HFQM_HDR_MAGIC_OFF
        PKV_HFQM_HDR_VERSION_OFF
        PKV_HFQM_HDR_ARCH_ID_OFF
        PKV_HFQM_HDR_N_TENSORS_OFF
        PKV_HFQM_HDR_METADATA_OFFSET_OFF
        PKV_HFQM_HDR_DATA_OFFSET_OFF
        PKV_HFQM_INDEX_COUNT_BYTES
        PKV_HFQM_INDEX_ENTRY_FIXED_BYTES

    const uint64_t PKV_HFQM_MAX_NUMEL

    ctypedef struct pkv_hfqm_header:
        uint8_t magic[4]
        uint32_t version
        uint32_t arch_id
        uint32_t n_tensors
        uint64_t metadata_offset
        uint64_t data_offset

    ctypedef struct pkv_hfqm_tensor_record:
        uint64_t offset
        uint64_t nbytes
        uint64_t name_offset
        uint32_t shape[8]
        uint32_t name_len
        uint32_t group_size
        uint8_t qt
        uint8_t ndim


cdef Py_ssize_t scan_json_end(const uint8_t* buf, Py_ssize_t start, Py_ssize_t limit) noexcept nogil
