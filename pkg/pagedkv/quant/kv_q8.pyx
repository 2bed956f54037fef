# cython: freethreading_compatible = True
"""KV-cache q8 (docs/contracts/hfqm-and-quant.md, '6.3 q8 (K and V)'), the CPU codec of the q8 pool
dtype.

Per 32 dims of a K or V row: ``d = amax/127`` stored as f16 (round to nearest even),
then 32 int8 codes ``clamp(round_half_even(v * 127/amax), -127, 127)``; a row of
``head_dim`` values is ``head_dim/32`` such 34-byte records. The math is
``pagedkv/kvquant.h``, the text the GPU kernels (hip/kvcache.hip) compile, so the
GPU write and this encoder give the same bytes; ``kv_q8_loops.h`` runs the encode
vectorized (float16 input widened in place, no float32 copy).
"""

cimport numpy as cnp
from libc.stdint cimport int8_t, uint8_t, uint16_t, uint32_t

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.quant.quant_header cimport (
    pkv_f16_to_f32, pkv_first_nonfinite, pkv_first_nonfinite_f16,
)

cnp.import_array()

#: Values per q8 record, and the record's bytes (f16 scale + BLOCK_VALUES int8): the
#: PKV_KVQ8_BLOCK / PKV_KVQ8_RECORD_BYTES of pagedkv/kvquant.h, the one statement of the
#: q8 layout every Python module uses.
BLOCK_VALUES = PKV_KVQ8_BLOCK
RECORD_BYTES = PKV_KVQ8_RECORD_BYTES


def row_bytes(Py_ssize_t head_dim):
    """Bytes of one q8 K or V row of ``head_dim`` values (a positive multiple of
    BLOCK_VALUES): ``head_dim / BLOCK_VALUES * RECORD_BYTES``."""
    if head_dim <= 0 or head_dim > 1 << 20 or head_dim % PKV_KVQ8_BLOCK:
        raise InvalidArgument(f"head_dim={head_dim}: must be a positive multiple of "
                              f"{PKV_KVQ8_BLOCK} up to 2**20 for q8 KV")
    return pkv_kvq8_row_bytes(<uint32_t>head_dim)


cdef extern from "kv_q8_loops.h" nogil:
    Py_ssize_t pkv_cpu_kvq8_encode(const float *x32, const uint16_t *x16, Py_ssize_t n_records,
                                   uint8_t *out)


cdef void _decode(const uint8_t *rec, Py_ssize_t n_records, float *out) noexcept nogil:
    cdef Py_ssize_t r
    cdef int i
    cdef float d
    cdef const uint8_t *one
    for r in range(n_records):
        one = rec + r * PKV_KVQ8_RECORD_BYTES
        d = pkv_f16_to_f32(one[0] | (one[1] << 8))
        for i in range(PKV_KVQ8_BLOCK):
            out[r * PKV_KVQ8_BLOCK + i] = pkv_kvq8_value(d, <int8_t>one[2 + i])


def quantize(x):
    """``float32`` or ``float16[..., head_dim]`` → ``uint8[..., head_dim/32*34]`` records.

    ``head_dim`` must be a multiple of 32; NaN or Inf raises :class:`InvalidArgument`."""
    if not isinstance(x, np.ndarray) or x.dtype not in (np.float32, np.float16):
        raise InvalidArgumentType(
            f"x must be a float32 or float16 numpy.ndarray, got "
            f"{getattr(x, 'dtype', type(x).__name__)}")
    # (the module compiles with wraparound=False: no negative indices)
    if x.ndim == 0 or x.shape[x.ndim - 1] % PKV_KVQ8_BLOCK:
        raise InvalidArgument(f"x: shape {x.shape}: the last axis (head_dim) must be a "
                              f"positive multiple of 32 for q8 KV")
    cdef Py_ssize_t head_dim = x.shape[x.ndim - 1]
    cdef const float[::1] flat
    cdef const uint16_t[::1] flat16
    cdef Py_ssize_t n = x.size, bad = -1
    if x.dtype == np.float32:
        flat = np.ascontiguousarray(x).reshape(-1)
        with nogil:
            bad = pkv_first_nonfinite(&flat[0], n) if n else -1
    else:
        flat16 = np.ascontiguousarray(x).reshape(-1).view(np.uint16)
        with nogil:
            bad = pkv_first_nonfinite_f16(&flat16[0], n) if n else -1
    if bad >= 0:
        raise InvalidArgument(f"x holds a non-finite value at flat index {bad}; q8 KV takes "
                              f"finite values only")
    out = np.empty(x.shape[:x.ndim - 1] + (pkv_kvq8_row_bytes(<uint32_t>head_dim),),
                   dtype=np.uint8)
    cdef uint8_t[::1] o = out.reshape(-1)
    cdef Py_ssize_t over = -1
    if n:
        if x.dtype == np.float32:
            with nogil:
                over = pkv_cpu_kvq8_encode(&flat[0], NULL, n // PKV_KVQ8_BLOCK, &o[0])
        else:
            with nogil:
                over = pkv_cpu_kvq8_encode(NULL, &flat16[0], n // PKV_KVQ8_BLOCK, &o[0])
    # A block whose largest |value| exceeds about 127 * 65504 (8.3e6) has no float16 scale:
    # it would decode to Inf and NaN. Refused, as q8f16 weights refuse it.
    if over >= 0:
        raise InvalidArgument(
            f"x: block {over} (values {over * PKV_KVQ8_BLOCK}.."
            f"{over * PKV_KVQ8_BLOCK + PKV_KVQ8_BLOCK - 1} of the flat input) has a largest "
            f"|value| above ~8.3e6, past q8 KV's float16 scale")
    return out


def check_scales(records):
    """``InvalidArgument`` naming the first q8 record (of ``uint8[..., k * 34]`` records)
    whose float16 scale is Inf or NaN: such a record decodes to Inf/NaN, and no encoder
    writes one (records written raw, or damaged, can hold one)."""
    if not isinstance(records, np.ndarray) or records.dtype != np.uint8:
        raise InvalidArgumentType(f"records must be a uint8 numpy.ndarray, got "
                                  f"{getattr(records, 'dtype', type(records).__name__)}")
    flat = records.reshape(-1, PKV_KVQ8_RECORD_BYTES)
    bits = flat[:, 0].astype(np.uint16) | (flat[:, 1].astype(np.uint16) << 8)
    bad = np.flatnonzero((bits & 0x7C00) == 0x7C00)
    if len(bad):
        raise InvalidArgument(f"records: q8 record {int(bad[0])} has a non-finite float16 "
                              f"scale (0x{int(bits[bad[0]]):04x}); it decodes to Inf/NaN")


def dequantize(records, Py_ssize_t head_dim):
    """``uint8[..., head_dim/32*34]`` records → ``float32[..., head_dim]``."""
    if not isinstance(records, np.ndarray) or records.dtype != np.uint8:
        raise InvalidArgumentType(f"records must be a uint8 numpy.ndarray, got "
                                  f"{getattr(records, 'dtype', type(records).__name__)}")
    row_bytes(head_dim)  # a positive multiple of 32 up to 2**20
    if records.ndim == 0 or records.shape[records.ndim - 1] != pkv_kvq8_row_bytes(head_dim):
        raise InvalidArgument(f"records: shape {records.shape}, the last axis must be "
                              f"{pkv_kvq8_row_bytes(head_dim)} bytes for head_dim {head_dim}")
    cdef const uint8_t[::1] flat = np.ascontiguousarray(records).reshape(-1)
    out = np.empty(records.shape[:records.ndim - 1] + (head_dim,), dtype=np.float32)
    cdef float[::1] o = out.reshape(-1)
    cdef Py_ssize_t n_records = flat.shape[0] // PKV_KVQ8_RECORD_BYTES
    if n_records:
        with nogil:
            _decode(&flat[0], n_records, &o[0])
    return out
