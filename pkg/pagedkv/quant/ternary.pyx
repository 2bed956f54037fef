# cython: freethreading_compatible = True
"""Bonsai's passthrough formats, decode only: TQ2G128 (qt 40, ternary, ``w = (code - 1)·d``)
and BQ1G128 (qt 41, binary, ``w = ±d``). 128 weights per group, an f16 ``d`` then the
codes LSB-first. The bit order and BQ1's sign sense are unverified upstream; pagedkv's
choice is documented in docs/formats/quant.md, "TQ2G128 and BQ1G128".
"""

cimport numpy as cnp
from libc.stdint cimport uint8_t, uint32_t

from pagedkv.quant.quant_header cimport pkv_bq1_decode_elem, pkv_tq2_decode_elem

cnp.import_array()

from pagedkv.errors import InvalidArgument, SizeMismatch


def decode(const uint8_t[::1] raw, float[::1] out, int bits):
    """Decode ``len(out)`` weights: ``bits`` = 2 (TQ2G128, 34 B per 128) or 1 (BQ1G128,
    18 B per 128)."""
    if bits != 1 and bits != 2:
        raise InvalidArgument(f"bits = {bits}: 2 (tq2g128) or 1 (bq1g128)")
    cdef Py_ssize_t n = out.shape[0], i
    cdef Py_ssize_t B = 2 + 16 * bits
    cdef Py_ssize_t n_groups = (n + 127) // 128
    if raw.shape[0] != n_groups * B:
        raise SizeMismatch(f"raw has {raw.shape[0]} bytes, {n} weights need {n_groups * B}")
    with nogil:
        if bits == 2:
            for i in range(n):
                out[i] = pkv_tq2_decode_elem(&raw[(i // 128) * B], <uint32_t>(i % 128))
        else:
            for i in range(n):
                out[i] = pkv_bq1_decode_elem(&raw[(i // 128) * B], <uint32_t>(i % 128))
