# cython: language_level=3
"""The quant-type register of pagedkv/hfqm.h (``PKV_QT_LIST``), read from C for
:mod:`pagedkv.quant.qtypes`: the one table of every qt's geometry, size rule, status and
flags (docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register')."""

import numpy as np

from libc.stdint cimport uint32_t, uint64_t


cdef extern from *:
    """
    #include "pagedkv/hfqm.h"
    /* The register's spelling of each id (NULL outside it). */
    #define PKV_QT_NAME_CASE_(id, name, g, b, rule, status, flags) case id: return #name;
    static const char *pkv_qt_name(uint32_t qt) {
        switch (qt) { PKV_QT_LIST(PKV_QT_NAME_CASE_) default: return NULL; }
    }
    #undef PKV_QT_NAME_CASE_
    """
    const char* pkv_qt_name(uint32_t qt)


def c_register():
    """The C register (``PKV_QT_LIST``) for ids 0-255, as a structured array with
    fields ``group_size, group_bytes, size_rule, status, flags`` (the PKV_QT_* codes)."""
    out = np.zeros(256, dtype=[("group_size", "<u4"), ("group_bytes", "<u4"),
                               ("size_rule", "<u4"), ("status", "<u4"), ("flags", "<u4")])
    cdef uint32_t qt
    for qt in range(256):
        out[qt] = (pkv_qt_group_size(qt), pkv_qt_group_bytes(qt), pkv_qt_size_rule(qt),
                   pkv_qt_status(qt), pkv_qt_flags(qt))
    return out


def c_expected_nbytes(uint32_t qt, uint64_t numel, uint64_t k):
    """``pkv_qt_expected_nbytes`` (0 where the qt has no size rule)."""
    return pkv_qt_expected_nbytes(qt, numel, k)


def c_register_names():
    """``{qt id: name}`` of every id in the C register (``PKV_QT_LIST``), reserved ones
    included, in id order."""
    cdef uint32_t qt
    cdef const char* name
    out = {}
    for qt in range(256):
        name = pkv_qt_name(qt)
        if name != NULL:
            out[qt] = name.decode("ascii")
    return out


def c_constants():
    """The PKV_QT_SIZE_*, PKV_QT_STATUS_* and PKV_QT_FLAG_* codes by lower-case name."""
    return {
        "size_none": PKV_QT_SIZE_NONE, "size_groups": PKV_QT_SIZE_GROUPS,
        "size_row_header": PKV_QT_SIZE_ROW_HEADER, "size_row_pad128": PKV_QT_SIZE_ROW_PAD128,
        "size_hessian": PKV_QT_SIZE_HESSIAN,
        "status_unknown": PKV_QT_STATUS_UNKNOWN, "status_p1": PKV_QT_STATUS_P1,
        "status_p2": PKV_QT_STATUS_P2, "status_refuse": PKV_QT_STATUS_REFUSE,
        "status_reserved": PKV_QT_STATUS_RESERVED, "status_calib": PKV_QT_STATUS_CALIB,
        "flag_rotated": PKV_QT_FLAG_ROTATED, "flag_k_mult_256": PKV_QT_FLAG_K_MULT_256,
        "flag_raw": PKV_QT_FLAG_RAW,
    }
