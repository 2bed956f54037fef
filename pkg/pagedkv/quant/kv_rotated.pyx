# cython: freethreading_compatible = True
"""CPU codec of the rotated KV-cache modes: fwhtN (K) and lloydN (V) (docs/kv-quant.md).

Per (token, kv-head) row of ``head_dim`` values: the norm, the FWHT rotation of the
normalized row (R128 per 128-half for fwht4/fwht2, R256 for fwht3 and lloyd*), one
Lloyd-Max code per value (how many thresholds it exceeds), and the corrected norm
``norm / ||C[codes]||``; stored as ``[f32 cnorm][codes, LSB first]``. The math is
``pagedkv/kvquant.h`` (the text hip/kvcache.hip compiles); ``kv_rotated_loops.h`` runs it
vectorized with the same bits. Modes are the header's ids (``MODE_IDS``); the named API
is :mod:`pagedkv.quant.kv`.
"""

cimport numpy as cnp
from libc.stdint cimport uint8_t, uint16_t, uint32_t

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.quant.quant_header cimport pkv_first_nonfinite, pkv_first_nonfinite_f16

# The CPU loops stay private to this module: the .pxd holds only kvquant.h's public API,
# which other Cython code may cimport.
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

cnp.import_array()

#: Mode name -> the header's id (``PKV_KV_MODE_*``).
MODE_IDS = {"q8": PKV_KV_MODE_Q8, "fwht4": PKV_KV_MODE_FWHT4, "fwht3": PKV_KV_MODE_FWHT3,
            "fwht2": PKV_KV_MODE_FWHT2, "lloyd4": PKV_KV_MODE_LLOYD4,
            "lloyd3": PKV_KV_MODE_LLOYD3, "lloyd2": PKV_KV_MODE_LLOYD2}
CNORM_BYTES = PKV_KV_CNORM_BYTES
_NAMES = {v: k for k, v in MODE_IDS.items()}


def mode_bits(uint32_t mode):
    """Code width of ``mode``: 8 (q8), 4, 3 or 2; 0 for an unknown id."""
    return pkv_kv_mode_bits(mode)


def mode_rotation(uint32_t mode):
    """0 (q8: none), 128 (R128 per 128-half) or 256 (R256); also the table family."""
    return pkv_kv_mode_rotation(mode)


def row_bytes(uint32_t mode, Py_ssize_t head_dim):
    """Bytes of one (token, kv-head) row; 0 when ``mode`` cannot store ``head_dim``."""
    if head_dim <= 0 or head_dim > 1 << 20:
        return 0
    return pkv_kv_row_bytes(mode, <uint32_t>head_dim)


def tables(uint32_t bits, uint32_t family):
    """``(centroids, thresholds)`` of ``bits`` (2, 3, 4) and ``family`` (128, 256) as new
    float32 arrays of 2**bits and 2**bits - 1 values: the header's tables."""
    if bits not in (2, 3, 4) or family not in (128, 256):
        raise InvalidArgument(f"bits={bits}, family={family}: expected bits 2, 3 or 4 and "
                              f"family 128 or 256")
    cdef Py_ssize_t i, nc = 1 << bits
    cdef uint32_t co = pkv_kv_centroid_offset(bits, family)
    cdef uint32_t to = pkv_kv_threshold_offset(bits, family)
    c = np.empty(nc, np.float32)
    t = np.empty(nc - 1, np.float32)
    for i in range(nc):
        c[i] = pkv_kv_centroids[co + i]
    for i in range(nc - 1):
        t[i] = pkv_kv_thresholds[to + i]
    return c, t


cdef uint32_t _rotated_mode(object mode, Py_ssize_t head_dim) except 0xFFFFFFFF:
    if not is_int(mode) or mode not in _NAMES \
            or mode == PKV_KV_MODE_Q8:
        raise InvalidArgument(f"mode={mode!r}: expected a rotated mode id "
                              f"({ {k: v for k, v in MODE_IDS.items() if k != 'q8'} })")
    if head_dim <= 0 or head_dim > 1 << 20 or pkv_kv_row_bytes(mode, <uint32_t>head_dim) == 0:
        need = "128 or 256" if pkv_kv_mode_rotation(mode) == 128 else "256"
        raise InvalidArgument(f"head_dim={head_dim}: {_NAMES[mode]} needs head_dim {need}")
    return mode


cdef Py_ssize_t _first_overflow(const uint8_t[::1] rec, Py_ssize_t n_rows,
                                uint32_t row_bytes) noexcept nogil:
    """The first row whose stored cnorm is Inf (its norm overflowed float32), or -1."""
    cdef Py_ssize_t r
    cdef const uint8_t *p
    for r in range(n_rows):
        p = &rec[r * row_bytes]
        if (p[3] & 0x7F) == 0x7F and (p[2] & 0x80):
            return r
    return -1


def encode(x, mode, *, bint reference=False):
    """``float32`` or ``float16[..., head_dim]`` -> ``uint8[..., row_bytes]`` records.

    ``mode``: a rotated mode id of :data:`MODE_IDS`. NaN or Inf, or a row whose norm
    overflows float32, raises :class:`InvalidArgument` naming the flat index or the row.
    ``reference=True`` runs the scalar header loop instead of the vectorized one (same
    bytes; for tests)."""
    if not isinstance(x, np.ndarray) or x.dtype not in (np.float32, np.float16):
        raise InvalidArgumentType(
            f"x must be a float32 or float16 numpy.ndarray, got "
            f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim == 0:
        raise InvalidArgument("x must have a last axis (head_dim)")
    cdef Py_ssize_t hd = x.shape[x.ndim - 1]
    cdef uint32_t m = _rotated_mode(mode, hd)
    cdef uint32_t rb = pkv_kv_row_bytes(m, <uint32_t>hd)
    cdef Py_ssize_t bad, n_rows
    cdef const float[::1] f32
    cdef const uint16_t[::1] f16
    out = np.empty(x.shape[:x.ndim - 1] + (rb,), dtype=np.uint8)
    cdef uint8_t[::1] o = out.reshape(-1)
    n_rows = out.size // rb if rb else 0
    if x.dtype == np.float32:
        f32 = np.ascontiguousarray(x).reshape(-1)
        with nogil:
            bad = pkv_first_nonfinite(&f32[0], f32.shape[0]) if f32.shape[0] else -1
    else:
        f16 = np.ascontiguousarray(x).reshape(-1).view(np.uint16)
        with nogil:
            bad = pkv_first_nonfinite_f16(&f16[0], f16.shape[0]) if f16.shape[0] else -1
    if bad >= 0:
        raise InvalidArgument(f"x holds a non-finite value at flat index {bad}; "
                              f"{_NAMES[m]} KV takes finite values only")
    if n_rows == 0:
        return out
    if x.dtype == np.float32:
        with nogil:
            if reference:
                pkv_cpu_kv_encode_rows_reference(&f32[0], NULL, n_rows, hd, m, &o[0])
            else:
                pkv_cpu_kv_encode_rows(&f32[0], NULL, n_rows, hd, m, &o[0])
    else:
        with nogil:
            if reference:
                pkv_cpu_kv_encode_rows_reference(NULL, &f16[0], n_rows, hd, m, &o[0])
            else:
                pkv_cpu_kv_encode_rows(NULL, &f16[0], n_rows, hd, m, &o[0])
    with nogil:
        bad = _first_overflow(o, n_rows, rb)
    if bad >= 0:
        raise InvalidArgument(f"x: row {bad} (flat, of {n_rows} rows of {hd}) has a norm "
                              f"beyond float32; {_NAMES[m]} KV needs rows whose sum of "
                              f"squares fits float32 (|x| below about 1e18)")
    return out


cdef const uint8_t[::1] _records(records, uint32_t mode, Py_ssize_t head_dim, str name):
    if not isinstance(records, np.ndarray) or records.dtype != np.uint8:
        raise InvalidArgumentType(f"{name} must be a uint8 numpy.ndarray, got "
                                  f"{getattr(records, 'dtype', type(records).__name__)}")
    cdef uint32_t rb = pkv_kv_row_bytes(mode, <uint32_t>head_dim)
    if records.ndim == 0 or records.shape[records.ndim - 1] != rb:
        raise InvalidArgument(f"{name}: shape {records.shape}, the last axis must be {rb} "
                              f"bytes for {_NAMES[mode]} at head_dim {head_dim}")
    return np.ascontiguousarray(records).reshape(-1)


def decode(records, mode, Py_ssize_t head_dim, *, bint rotated=False):
    """``uint8[..., row_bytes]`` -> ``float32[..., head_dim]``: ``cnorm * Rᵀ C[codes]``, or
    ``cnorm * C[codes]`` in the rotated basis with ``rotated=True`` (what attention over
    compressed KV multiplies). Exact: the scalar header math with ``-ffp-contract=off``."""
    cdef uint32_t m = _rotated_mode(mode, head_dim)
    cdef const uint8_t[::1] flat = _records(records, m, head_dim, "records")
    cdef uint32_t rb = pkv_kv_row_bytes(m, <uint32_t>head_dim)
    out = np.empty(records.shape[:records.ndim - 1] + (head_dim,), dtype=np.float32)
    cdef float[::1] o = out.reshape(-1)
    cdef Py_ssize_t n_rows = flat.shape[0] // rb
    if n_rows:
        with nogil:
            pkv_cpu_kv_decode_rows(&flat[0], n_rows, head_dim, m, rotated, &o[0])
    return out


def downshift(records, src_mode, dst_mode, Py_ssize_t head_dim):
    """Re-code ``uint8[..., row_bytes(src)]`` records to a narrower mode of the same table
    family (fwht4 -> fwht2; lloyd4 -> lloyd3 -> lloyd2, or lloyd4 -> lloyd2): codes shift
    right by the width difference, ``cnorm`` keeps the row's norm. No rotation runs."""
    cdef uint32_t s = _rotated_mode(src_mode, head_dim)
    cdef uint32_t d = _rotated_mode(dst_mode, head_dim)
    if pkv_kv_mode_rotation(s) != pkv_kv_mode_rotation(d) or \
            pkv_kv_mode_bits(d) >= pkv_kv_mode_bits(s) or \
            (s <= PKV_KV_MODE_FWHT2) != (d <= PKV_KV_MODE_FWHT2):
        raise InvalidArgument(f"{_NAMES[s]} -> {_NAMES[d]}: a downshift stays in one table "
                              f"family and narrows the codes (fwht4 -> fwht2, lloyd4 -> "
                              f"lloyd3 -> lloyd2)")
    cdef const uint8_t[::1] flat = _records(records, s, head_dim, "records")
    cdef uint32_t sb = pkv_kv_row_bytes(s, <uint32_t>head_dim)
    cdef uint32_t db = pkv_kv_row_bytes(d, <uint32_t>head_dim)
    out = np.empty(records.shape[:records.ndim - 1] + (db,), dtype=np.uint8)
    cdef uint8_t[::1] o = out.reshape(-1)
    cdef Py_ssize_t n_rows = flat.shape[0] // sb
    if n_rows:
        with nogil:
            pkv_cpu_kv_downshift_rows(&flat[0], n_rows, head_dim, s, d, &o[0])
    return out
