# cython: language_level=3
"""SlotCopier: the per-layer token write and gather of a NumPy pool in C.

:class:`~pagedkv.pool.LayerKVPool` validates every argument in Python, which costs ~10 us per
call: more than copying a decode token, or a whole block of one layer. An engine calls
``write_tokens``/``gather`` once per layer per sequence per step, so that overhead decides
the speed of the per-layer forms. This module is their fast path for the common exact case:
C-contiguous ``ndarray`` payloads of the storage dtype and shape, 1-D contiguous int32/int64
slot or block id arrays, an ``int`` layer. Each method checks all of that (dtype identity,
flags, dims) and every id's range with C comparisons *before* it copies anything, and answers
``False``/``None`` without touching the pool when any check fails or the input is of another
kind. The caller then runs the validating path, which either handles the input (a list, a
strided view) or raises its usual error: the fast path accepts a subset of what the
validating path accepts, writes the same bytes, and never raises on bad input itself.

Copies are ``memcpy`` per run of consecutive slots, in argument order, so duplicate slots
keep NumPy's last-write-wins. Large copies release the GIL.
"""

cimport numpy as cnp
from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy

cnp.import_array()

cdef enum:
    # Below this many bytes releasing and re-taking the GIL costs more than it frees.
    NOGIL_BYTES = 262144


cdef inline bint _exact_int(object x, long long* out):
    """``x`` is an exact ``int`` (not bool, not np.integer) that fits a long long."""
    if type(x) is not int:
        return False
    cdef int overflow = 0
    out[0] = PyLong_AsLongLongAndOverflow(x, &overflow)
    return overflow == 0


cdef inline bint _ids_ok(object ids):
    """1-D C-contiguous native int32/int64 ndarray (not a subclass)."""
    if not cnp.PyArray_CheckExact(ids):
        return False
    cdef cnp.ndarray a = <cnp.ndarray>ids
    cdef int t = cnp.PyArray_TYPE(a)
    return (cnp.PyArray_NDIM(a) == 1 and cnp.PyArray_IS_C_CONTIGUOUS(a)
            and cnp.PyArray_ISNOTSWAPPED(a) and (t == cnp.NPY_INT32 or t == cnp.NPY_INT64))


cdef inline Py_ssize_t _id_at(cnp.ndarray a, Py_ssize_t i) noexcept:
    if cnp.PyArray_TYPE(a) == cnp.NPY_INT32:
        return (<int32_t*>cnp.PyArray_DATA(a))[i]
    return <Py_ssize_t>(<int64_t*>cnp.PyArray_DATA(a))[i]


cdef void _copy_runs(char* dst, char* src, const Py_ssize_t* slots, Py_ssize_t n,
                     Py_ssize_t token_bytes, bint scatter) noexcept nogil:
    """Copy token ``i`` of ``src`` to slot ``slots[i]`` of ``dst`` (``scatter``), or slot
    ``slots[i]`` of ``src`` to token ``i`` of ``dst``, one memcpy per run of consecutive
    slots, runs in order (so a duplicate slot's last write wins)."""
    cdef Py_ssize_t i = 0, j
    while i < n:
        j = i + 1
        while j < n and slots[j] == slots[j - 1] + 1:
            j += 1
        if scatter:
            memcpy(dst + slots[i] * token_bytes, src + i * token_bytes, (j - i) * token_bytes)
        else:
            memcpy(dst + i * token_bytes, src + slots[i] * token_bytes, (j - i) * token_bytes)
        i = j


cdef void _copy_kv(char* dst_k, char* src_k, char* dst_v, char* src_v,
                   const Py_ssize_t* slots, Py_ssize_t n, Py_ssize_t token_bytes,
                   bint scatter) noexcept:
    """K then V through :func:`_copy_runs`, without the GIL when the copy is large."""
    if n * token_bytes >= NOGIL_BYTES:
        with nogil:
            _copy_runs(dst_k, src_k, slots, n, token_bytes, scatter)
            _copy_runs(dst_v, src_v, slots, n, token_bytes, scatter)
    else:
        _copy_runs(dst_k, src_k, slots, n, token_bytes, scatter)
        _copy_runs(dst_v, src_v, slots, n, token_bytes, scatter)


cdef class SlotCopier:
    """Token copies between caller arrays and one NumPy storage array
    ``[num_layers, 2, num_blocks, block_size, num_kv_heads, row]`` (C-contiguous). Built per
    pool generation; it holds a reference to the array it copies into."""

    def __cinit__(self, cnp.ndarray array):
        if cnp.PyArray_NDIM(array) != 6 or not cnp.PyArray_IS_C_CONTIGUOUS(array) \
                or cnp.PyArray_DIMS(array)[1] != 2:
            raise ValueError("SlotCopier needs a C-contiguous "
                             "[num_layers, 2, num_blocks, block_size, kv_heads, row] array")
        cdef cnp.npy_intp* d = cnp.PyArray_DIMS(array)
        self.array = array
        self.base = <char*>cnp.PyArray_DATA(array)
        self.end = self.base + cnp.PyArray_NBYTES(array)
        self.descr = cnp.PyArray_DESCR(array)
        self.type_num = cnp.PyArray_TYPE(array)
        self.num_layers = d[0]
        self.num_blocks = d[2]
        self.block_size = d[3]
        self.num_slots = d[2] * d[3]
        self.num_kv_heads = d[4]
        self.row_elements = d[5]
        self.token_bytes = d[4] * d[5] * cnp.PyArray_ITEMSIZE(array)
        self.kv_stride_bytes = self.num_slots * self.token_bytes
        self.layer_stride_bytes = 2 * self.kv_stride_bytes

    def __repr__(self):
        return (f"SlotCopier(num_layers={self.num_layers}, num_slots={self.num_slots}, "
                f"token_bytes={self.token_bytes})")

    cdef Py_ssize_t _layer(self, object layer):
        """``layer`` as an index, or -1 unless it is an in-range exact ``int``."""
        cdef long long i
        if not _exact_int(layer, &i):
            return -1
        if i < 0 or i >= self.num_layers:
            return -1
        return <Py_ssize_t>i

    cdef bint _is_tokens(self, object x, Py_ssize_t n):
        """``x`` is a C-contiguous ``[n, kv_heads, row]`` ndarray of the storage dtype that
        does not overlap the pool (an overlapping source needs NumPy's buffered copy)."""
        if not cnp.PyArray_CheckExact(x):
            return False
        cdef cnp.ndarray a = <cnp.ndarray>x
        cdef cnp.PyArray_Descr* descr = cnp.PyArray_DESCR(a)
        if descr != self.descr and not cnp.PyArray_EquivTypes(
                <cnp.dtype>descr, <cnp.dtype>self.descr):
            return False
        if cnp.PyArray_NDIM(a) != 3 or not cnp.PyArray_IS_C_CONTIGUOUS(a):
            return False
        cdef cnp.npy_intp* d = cnp.PyArray_DIMS(a)
        if d[0] != n or d[1] != self.num_kv_heads or d[2] != self.row_elements:
            return False
        cdef char* p = <char*>cnp.PyArray_DATA(a)
        return p + n * self.token_bytes <= self.base or p >= self.end

    cdef bint _scatter(self, Py_ssize_t layer, const Py_ssize_t* slots, Py_ssize_t n,
                       object k, object v):
        cdef char* dst_k = self.base + layer * self.layer_stride_bytes
        cdef char* dst_v = dst_k + self.kv_stride_bytes
        cdef char* src_k = <char*>cnp.PyArray_DATA(<cnp.ndarray>k)
        cdef char* src_v = <char*>cnp.PyArray_DATA(<cnp.ndarray>v)
        _copy_kv(dst_k, src_k, dst_v, src_v, slots, n, self.token_bytes, True)
        return True

    def write_slots(self, layer, slots, k, v) -> bool:
        """Write ``k``, ``v`` (``[len(slots), kv_heads, row]``) of ``layer`` into ``slots``.
        ``False`` (nothing written) unless every argument is of the exact fast kind and every
        slot is in range."""
        cdef Py_ssize_t li = self._layer(layer)
        if li < 0 or not _ids_ok(slots):
            return False
        cdef cnp.ndarray ids = <cnp.ndarray>slots
        cdef Py_ssize_t n = cnp.PyArray_DIMS(ids)[0], i, s
        if not (self._is_tokens(k, n) and self._is_tokens(v, n)):
            return False
        cdef cnp.ndarray idx = cnp.PyArray_EMPTY(1, cnp.PyArray_DIMS(ids), cnp.NPY_INTP, 0)
        cdef Py_ssize_t* out = <Py_ssize_t*>cnp.PyArray_DATA(idx)
        for i in range(n):
            s = _id_at(ids, i)
            if s < 0 or s >= self.num_slots:
                return False
            out[i] = s
        return self._scatter(li, out, n, k, v)

    cdef object _table_slots(self, object block_ids, Py_ssize_t start, Py_ssize_t n):
        """intp slots of positions ``[start, start + n)`` of a block table row, or None when
        ``block_ids`` is not of the fast kind or a used entry is out of range."""
        if not _ids_ok(block_ids) or start < 0 or n < 0:
            return None
        cdef cnp.ndarray ids = <cnp.ndarray>block_ids
        cdef Py_ssize_t bs = self.block_size, i, p, b
        cdef Py_ssize_t capacity = cnp.PyArray_DIMS(ids)[0] * bs
        if start > capacity or n > capacity - start:
            return None
        cdef cnp.npy_intp dims = n
        cdef cnp.ndarray idx = cnp.PyArray_EMPTY(1, &dims, cnp.NPY_INTP, 0)
        cdef Py_ssize_t* out = <Py_ssize_t*>cnp.PyArray_DATA(idx)
        for i in range(n):
            p = start + i
            b = _id_at(ids, p // bs)
            if b < 0 or b >= self.num_blocks:
                return None
            out[i] = b * bs + p % bs
        return idx

    def write_positions(self, layer, block_ids, start, k, v) -> bool:
        """Write ``k``, ``v`` (``[n, kv_heads, row]``) of ``layer`` at positions
        ``[start, start + n)`` of the sequence whose block table row is ``block_ids``.
        ``False`` (nothing written) unless all is of the fast kind and in range."""
        cdef Py_ssize_t li = self._layer(layer)
        cdef long long first
        if li < 0 or not _exact_int(start, &first) or not cnp.PyArray_CheckExact(k) \
                or cnp.PyArray_NDIM(<cnp.ndarray>k) != 3:
            return False
        cdef Py_ssize_t n = cnp.PyArray_DIMS(<cnp.ndarray>k)[0]
        if not (self._is_tokens(k, n) and self._is_tokens(v, n)):
            return False
        slots = self._table_slots(block_ids, first, n)
        if slots is None:
            return False
        return self._scatter(li, <Py_ssize_t*>cnp.PyArray_DATA(<cnp.ndarray>slots), n, k, v)

    def gather(self, layer, block_ids, num_tokens):
        """``(k, v)``: new C-contiguous ``[num_tokens, kv_heads, row]`` copies of positions
        ``[0, num_tokens)`` of the sequence whose block table row is ``block_ids``, or None
        when an argument is not of the fast kind or out of range."""
        cdef Py_ssize_t li = self._layer(layer)
        cdef long long n
        if li < 0 or not _exact_int(num_tokens, &n):
            return None
        slots = self._table_slots(block_ids, 0, n) if n >= 0 else None
        if slots is None:
            return None
        cdef cnp.npy_intp dims[3]
        dims[0] = n
        dims[1] = self.num_kv_heads
        dims[2] = self.row_elements
        cdef cnp.ndarray k = cnp.PyArray_EMPTY(3, dims, self.type_num, 0)
        cdef cnp.ndarray v = cnp.PyArray_EMPTY(3, dims, self.type_num, 0)
        cdef char* src_k = self.base + li * self.layer_stride_bytes
        cdef char* src_v = src_k + self.kv_stride_bytes
        cdef const Py_ssize_t* s = <Py_ssize_t*>cnp.PyArray_DATA(<cnp.ndarray>slots)
        cdef char* dk = <char*>cnp.PyArray_DATA(k)
        cdef char* dv = <char*>cnp.PyArray_DATA(v)
        _copy_kv(dk, src_k, dv, src_v, s, n, self.token_bytes, False)
        return k, v
