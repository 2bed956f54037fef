# cython: freethreading_compatible = True
"""``PreparedGemv``: ``y = x · Wᵀ`` with int8 activations over a prepared weight layout.

The weights are repacked once (``prepared_gemv_pack.h``) into the tiles of
``pagedkv/cpu_gemv.h``; each call quantizes x to int8 per span (rotating it first for
the MQ formats), runs integer dot products (``prepared_gemv_loops.h``) and applies the
scales and minimums per span in float. docs/formats/cpu-gemv.md is the reference
(layout, arithmetic, error bound).
"""

import os

import numpy as np

cimport numpy as cnp
from libc.math cimport isfinite
from libc.stdint cimport int8_t, int32_t, uint8_t, uint16_t
from libc.stdlib cimport free, malloc

from pagedkv.argument_checks import is_int
from pagedkv.quant.cpu_pool cimport job_parts, pool_run
from pagedkv.quant.fwht cimport rotate256
from pagedkv.quant.quant_header cimport pkv_first_nonfinite

cnp.import_array()

from pagedkv.errors import InvalidArgument, InvalidArgumentType

cdef extern from "pagedkv/cpu_gemv.h" nogil:
    const unsigned PKV_PGEMV_TILE_ROWS
    const int PKV_PGEMV_NIBBLE
    const int PKV_PGEMV_UBYTE
    const int PKV_PGEMV_SBYTE
    const int PKV_PGEMV_NIBBLE32
    unsigned pkv_pgemv_span_row_bytes(int kind, unsigned span)

cdef extern from "prepared_gemv_loops.h" nogil:
    const int PKV_ISA_SCALAR
    const int PKV_ISA_COUNT
    const char *const pkv_pgemv_isa_names[]
    const int PKV_PG_PARAM_F32
    const int PKV_PG_PARAM_F16
    const int PKV_PG_PARAM_U8X8
    ctypedef struct pkv_pgemv_w:
        const uint8_t *codes
        const void *scales
        const void *mins
        const float *scale_factors
        const float *min_factors
        Py_ssize_t m, k, n_tiles, n_spans
        unsigned span
        int kind
        int param
        int32_t center
    ctypedef struct pkv_pgemv_x:
        const int8_t *xq
        const float *dx
        const float *xsum
        const int32_t *xqsum
        Py_ssize_t nb
        Py_ssize_t ldx
    Py_ssize_t pkv_pgemv_x_stride(Py_ssize_t k)
    Py_ssize_t pkv_pgemv_quantize_x(const float *x, Py_ssize_t k, unsigned span, int8_t *xq,
                                    float *dx, float *xsum, int32_t *xqsum)
    int pkv_pgemv_isa_supported(int isa)
    int pkv_pgemv_best_isa()
    void pkv_pgemv_tiles(const pkv_pgemv_w *w, const pkv_pgemv_x *x, float *y, Py_ssize_t ldy,
                         Py_ssize_t t0, Py_ssize_t t1, int isa)

cdef extern from "prepared_gemv_pack.h" nogil:
    void pkv_pgemv_pack_affine(const uint8_t *raw, Py_ssize_t row0, Py_ssize_t row1,
                               Py_ssize_t k, int family, unsigned bits, unsigned G,
                               uint8_t *codes, void *scales, void *mins)
    void pkv_pgemv_pack_q8f16(const uint8_t *raw, Py_ssize_t row0, Py_ssize_t row1,
                              Py_ssize_t k, uint8_t *codes, uint16_t *scales)
    void pkv_pgemv_pack_q4k(const uint8_t *raw, Py_ssize_t row0, Py_ssize_t row1,
                            Py_ssize_t k, uint8_t *codes, uint8_t *scales, uint8_t *mins,
                            float *scale_factors, float *min_factors)

cdef enum:
    FAMILY_HFQ = 0
    FAMILY_MQ_V2 = 2
    FAMILY_MQ4C = 3
    ALIGN_BYTES = 64        # one cache line: a chunk load never splits two
    # Buffers of 4 MiB or more start on a 2 MiB boundary: NumPy advises the kernel to back
    # its large allocations with transparent huge pages, but only whole aligned 2 MiB
    # pages of them; aligned, 94% of 29 prepared 4096x4096 HFQ4G256 copies were huge
    # pages instead of 71%, and a GEMV streaming its weights from DRAM (a model's decode
    # step) took 3-12% less time (Zen 4 VM, docs/performance.md "Weights from DRAM").
    HUGE_PAGE_BYTES = 2 << 20
    HUGE_PAGE_MIN_BYTES = 4 << 20

#: Kernel names, in the order of the ``PKV_ISA_*`` constants.
ISA_NAMES = tuple(pkv_pgemv_isa_names[i].decode() for i in range(PKV_ISA_COUNT))


def supported_isas():
    """The kernels this CPU runs, e.g. ``('scalar', 'avx2', 'avx-vnni', 'avx512-vnni')``."""
    return tuple(ISA_NAMES[i] for i in range(PKV_ISA_COUNT) if pkv_pgemv_isa_supported(i))


def default_isa():
    """The kernel ``prepare_gemv`` picks: the best this CPU runs, or ``PAGEDKV_CPU_ISA``
    (a kernel name) when that environment variable is set."""
    name = os.environ.get("PAGEDKV_CPU_ISA")
    return ISA_NAMES[pkv_pgemv_best_isa()] if not name else name


cdef int _isa_index(isa) except -1:
    if not isinstance(isa, str):
        raise InvalidArgumentType(f"isa must be a kernel name (str), got {type(isa).__name__}")
    if isa not in ISA_NAMES:
        raise InvalidArgument(f"isa {isa!r} is not a kernel name; valid: {', '.join(ISA_NAMES)}")
    i = ISA_NAMES.index(isa)
    if not pkv_pgemv_isa_supported(i):
        raise InvalidArgument(f"isa {isa!r} does not run on this CPU; supported: "
                              f"{', '.join(supported_isas())}")
    return i


#: The most ``threads=`` a call takes (the kernels keep it in a C int; more threads than
#: any CPU has are refused rather than wrapped).
MAX_THREADS = 1 << 16


def check_threads(threads):
    """``threads`` as an int in 1..:data:`MAX_THREADS`; raises InvalidArgumentType /
    InvalidArgument."""
    if not is_int(threads):
        raise InvalidArgumentType(f"threads must be an int >= 1, got {type(threads).__name__} "
                                  f"{threads!r}")
    if threads < 1:
        raise InvalidArgument(f"threads = {threads}: pass 1 (the calling thread only) or more")
    if threads > MAX_THREADS:
        raise InvalidArgument(f"threads = {threads}: at most {MAX_THREADS}")
    return int(threads)


def _aligned(alloc, Py_ssize_t n, dtype):
    itemsize = np.dtype(dtype).itemsize
    align = HUGE_PAGE_BYTES if n * itemsize >= HUGE_PAGE_MIN_BYTES else ALIGN_BYTES
    buf = alloc(n * itemsize + align, np.uint8)
    start = (-buf.ctypes.data) % align
    return buf[start:start + n * itemsize].view(dtype)


def _aligned_zeros(Py_ssize_t n, dtype):
    """Zeroed ``dtype[n]`` starting on a 64-byte boundary (numpy only promises 16)."""
    return _aligned(np.zeros, n, dtype)


def aligned_empty(shape, dtype):
    """Uninitialised C-contiguous ``dtype`` array of ``shape`` starting on a 64-byte
    boundary (a cache line; NumPy's large arrays start 16 bytes past a page), so that
    vector kernels can store whole lines to it (``dequantize`` allocates its output so);
    from 4 MiB on, on a 2 MiB boundary (whole transparent huge pages)."""
    n = 1
    for d in shape:
        n *= d
    return _aligned(np.empty, n, dtype).reshape(shape)


cdef struct _PackJob:
    const uint8_t *raw
    Py_ssize_t m, k
    int family, kind
    unsigned bits, G
    uint8_t *codes
    void *scales
    void *mins
    float *scale_factors
    float *min_factors


cdef void _pack_part(void *ctx, int part, int n_parts) noexcept nogil:
    cdef _PackJob *job = <_PackJob *>ctx
    cdef Py_ssize_t r0 = job.m * part // n_parts, r1 = job.m * (part + 1) // n_parts
    if job.kind == PKV_PGEMV_SBYTE:
        pkv_pgemv_pack_q8f16(job.raw, r0, r1, job.k, job.codes, <uint16_t *>job.scales)
    elif job.kind == PKV_PGEMV_NIBBLE32:
        pkv_pgemv_pack_q4k(job.raw, r0, r1, job.k, job.codes, <uint8_t *>job.scales,
                           <uint8_t *>job.mins, job.scale_factors, job.min_factors)
    else:
        pkv_pgemv_pack_affine(job.raw, r0, r1, job.k, job.family, job.bits, job.G, job.codes,
                              job.scales, job.mins)


cdef struct _Job:
    const pkv_pgemv_w *w
    const pkv_pgemv_x *x
    float *y
    Py_ssize_t ldy
    int isa


cdef void _run_part(void *ctx, int part, int n_parts) noexcept nogil:
    cdef _Job *job = <_Job *>ctx
    cdef Py_ssize_t n = job.w.n_tiles
    pkv_pgemv_tiles(job.w, job.x, job.y, job.ldy, n * part // n_parts,
                    n * (part + 1) // n_parts, job.isa)


cdef class PreparedGemv:
    """A quantized ``W`` of shape ``[M, K]`` prepared for ``y = x · Wᵀ`` on the CPU.

    Build it with :func:`pagedkv.quant.prepare_gemv`. Calling it with float32 ``x`` of
    shape ``[K]`` or ``[B, K]`` (any ``B >= 1``) returns float32 ``[M]`` or ``[B, M]``.
    x is quantized to int8 per span of K (the weights' scale span: 128 for MQ V2, the
    group size G for the v1 formats and MQ4C, 32 for Q8F16 and Q4K) after the FWHT rotation
    for MQ formats; the result differs from ``x · dequantize(W)ᵀ`` by at most the bound
    of docs/formats/cpu-gemv.md (about 0.5-1% of ``|y|`` on Gaussian data) and is the
    same, bit for bit, on every kernel (``isa``) and thread count.

    The prepared copy does not reference ``raw``. It is read-only after construction,
    so one object may be called from several threads at once.
    """

    cdef readonly str fmt
    cdef readonly int qt_id
    cdef readonly Py_ssize_t m
    cdef readonly Py_ssize_t k
    cdef readonly int span
    cdef readonly str isa
    cdef readonly int threads
    cdef readonly bint rotated
    cdef int _isa
    cdef bint _built
    cdef pkv_pgemv_w _w
    cdef object _codes, _scales, _mins, _factors

    def __init__(self, raw, fmt, shape, *, threads=1, isa=None):
        """See :func:`pagedkv.quant.prepare_gemv`."""
        # Read-only once built: a second __init__ would free the codes a call on another
        # thread is reading (a segfault, found by a review).
        if self._built:
            raise InvalidArgument("a PreparedGemv is read-only once built; call "
                                  "prepare_gemv for another one")
        from pagedkv.quant.formats import AFFINE, Q4K, Q8
        from pagedkv.quant.matvec import check_weights
        codec, data, m, k = check_weights(raw, fmt, shape)
        self.threads = check_threads(threads)
        self._isa = _isa_index(default_isa() if isa is None else isa)
        self.isa = ISA_NAMES[self._isa]
        if codec.kind not in (AFFINE, Q8, Q4K):
            raise InvalidArgument(
                f"prepare_gemv takes the quantized formats, not {codec.name}; multiply "
                f"{codec.name} weights with numpy (dequantize(raw, fmt, shape) @ x)")
        g = codec.group_size
        if k % g:
            raise InvalidArgument(
                f"prepare_gemv needs K to be a multiple of the group size ({g}) so that no "
                f"group straddles two rows, got shape ({m}, {k}); gemv() handles that layout")
        self.fmt = codec.name
        self.qt_id = codec.qt.id
        self.m = m
        self.k = k
        self.rotated = codec.rotated
        cdef int family = -1, bits = 8, kind
        if codec.kind == AFFINE:
            family = int(codec.affine_family)
            bits = codec.bits
            self.span = 128 if family == FAMILY_MQ_V2 else g
            kind = PKV_PGEMV_NIBBLE if bits <= 4 else PKV_PGEMV_UBYTE
            param = (PKV_PG_PARAM_F16 if family == FAMILY_MQ_V2 or family == FAMILY_MQ4C
                     else PKV_PG_PARAM_F32)
        elif codec.kind == Q4K:
            # each 32-weight sub-block is a span: its 6-bit sc and m as bytes, times the
            # super-block's f32 d and -dmin (factors per 8 spans)
            bits = 4
            self.span = 32
            kind = PKV_PGEMV_NIBBLE32
            param = PKV_PG_PARAM_U8X8
        else:
            self.span = 32
            kind = PKV_PGEMV_SBYTE
            param = PKV_PG_PARAM_F16
        cdef Py_ssize_t tiles = (m + PKV_PGEMV_TILE_ROWS - 1) // PKV_PGEMV_TILE_ROWS
        cdef Py_ssize_t n_spans = k // self.span
        cdef Py_ssize_t params = tiles * n_spans * PKV_PGEMV_TILE_ROWS
        self._codes = _aligned_zeros(
            tiles * n_spans * PKV_PGEMV_TILE_ROWS * pkv_pgemv_span_row_bytes(kind, self.span),
            np.uint8)
        param_type = {PKV_PG_PARAM_F32: np.float32, PKV_PG_PARAM_F16: np.uint16,
                      PKV_PG_PARAM_U8X8: np.uint8}[param]
        self._scales = _aligned_zeros(params, param_type)
        self._mins = None if kind == PKV_PGEMV_SBYTE else _aligned_zeros(params, param_type)
        # PKV_PG_PARAM_U8X8: an f32 factor per 8 spans (n_spans is a multiple of 8: K % 256)
        self._factors = (_aligned_zeros(2 * (params // 8), np.float32)
                         if param == PKV_PG_PARAM_U8X8 else None)
        self._w.m = m
        self._w.k = k
        self._w.n_tiles = tiles
        self._w.n_spans = n_spans
        self._w.span = self.span
        self._w.kind = kind
        self._w.param = param
        self._w.center = 0 if kind == PKV_PGEMV_SBYTE else 1 << (bits - 1)
        self._w.codes = <const uint8_t *>cnp.PyArray_DATA(self._codes)
        self._w.scales = cnp.PyArray_DATA(self._scales)
        self._w.mins = NULL if self._mins is None else cnp.PyArray_DATA(self._mins)
        self._w.scale_factors = NULL
        self._w.min_factors = NULL
        if self._factors is not None:
            self._w.scale_factors = <const float *>cnp.PyArray_DATA(self._factors)
            self._w.min_factors = self._w.scale_factors + params // 8
        if m == 0 or k == 0:
            self._built = True
            return
        cdef const uint8_t[::1] src = data
        cdef _PackJob pack
        pack.raw = &src[0]
        pack.m = m
        pack.k = k
        pack.family = family
        pack.kind = kind
        pack.bits = bits
        pack.G = g
        pack.codes = <uint8_t *>cnp.PyArray_DATA(self._codes)
        pack.scales = cnp.PyArray_DATA(self._scales)
        pack.mins = <void *>self._w.mins
        pack.scale_factors = <float *>self._w.scale_factors
        pack.min_factors = <float *>self._w.min_factors
        # the repacking runs on the object's threads too (whole rows per part)
        with nogil:
            pool_run(_pack_part, &pack, job_parts(pack.m, self.threads), self.threads)
        self._built = True

    @property
    def shape(self):
        """``(M, K)``."""
        return (self.m, self.k)

    @property
    def nbytes(self):
        """Bytes of the prepared copy (codes, scales, minimums and Q4K's per-super-block
        factors; padding rows included); 0 for an object that was never built."""
        if not self._built:
            return 0
        return self._codes.nbytes + self._scales.nbytes + (
            0 if self._mins is None else self._mins.nbytes) + (
            0 if self._factors is None else self._factors.nbytes)

    def __repr__(self):
        if not self._built:
            return "<PreparedGemv (not built: use prepare_gemv)>"
        return (f"<PreparedGemv {self.fmt} [{self.m}, {self.k}]: "
                f"{self.nbytes / 2**20:.2f} MiB prepared, x int8 per {self.span}"
                f"{' after FWHT-256' if self.rotated else ''}, kernel {self.isa}, "
                f"threads={self.threads}>")

    def __copy__(self):
        return self             # read-only once built: a copy is the object itself

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        # Cython's generated pickling raised a bare TypeError naming the C struct
        raise InvalidArgumentType(
            "a PreparedGemv cannot be pickled (its packed copy is for this process and "
            "CPU); pickle raw, fmt and shape and call prepare_gemv where it is needed")

    def __call__(self, x, *, out=None, threads=None):
        """``x · Wᵀ``: float32 ``x`` ``[K]`` or ``[B, K]`` → float32 ``[M]`` or ``[B, M]``.

        ``out``: a C-contiguous float32 array of the result shape to write into (returned).
        ``threads``: threads for this call (default: the object's ``threads``); the
        result is the same for any count. NaN/Inf in x raises ``InvalidArgument``
        before anything is written.
        """
        from pagedkv.quant.arguments import float32_out
        from pagedkv.quant.matvec import check_activations
        if not self._built:
            raise InvalidArgument("this PreparedGemv was never built (its __init__ failed or "
                                  "was not called); use prepare_gemv")
        x2, batch = check_activations(x, self.k)
        cdef int n_threads = self.threads if threads is None else check_threads(threads)
        shape = (self.m,) if x.ndim == 1 else (batch, self.m)
        y = np.empty(shape, np.float32) if out is None else float32_out(out, shape)
        if self.m == 0 or self.k == 0:
            if self.k:      # no tile to run, but a non-finite x is refused all the same
                bad_at = np.flatnonzero(~np.isfinite(x2))
                if bad_at.size:
                    row, col = divmod(int(bad_at[0]), self.k)
                    where = f"x[{col}]" if x.ndim == 1 else f"x[{row}, {col}]"
                    raise InvalidArgument(f"{where} is {float(x2[row, col])!r}; the GEMV takes "
                                          "finite activations only")
            y.fill(0.0)
            return y
        cdef const float[:, ::1] xv = x2
        cdef float[:, ::1] yv = y.reshape(batch, self.m)
        self._run(xv, yv, n_threads)
        return y

    cdef _run(self, const float[:, ::1] xv, float[:, ::1] yv, int n_threads):
        cdef Py_ssize_t nb = xv.shape[0], k = self.k, ns = self._w.n_spans, b
        cdef Py_ssize_t bad = -1, bad_row = 0
        cdef bint overflow = False
        cdef float bad_value = 0.0
        cdef size_t xf_bytes = nb * k * sizeof(float) if self.rotated else 0
        cdef Py_ssize_t ldx = pkv_pgemv_x_stride(k)
        cdef char *scratch = <char *>malloc(xf_bytes + nb * ldx + nb * ns * 12 + 64)
        cdef float *xf
        cdef const float *src
        cdef pkv_pgemv_x xs
        cdef _Job job
        if scratch == NULL:
            raise MemoryError()
        try:
            xf = <float *>scratch
            xs.dx = <float *>(scratch + xf_bytes)
            xs.xsum = xs.dx + nb * ns
            xs.xqsum = <int32_t *>(xs.xsum + nb * ns)
            xs.xq = <int8_t *>(xs.xqsum + nb * ns)
            xs.nb = nb
            xs.ldx = ldx
            with nogil:
                for b in range(nb):
                    src = &xv[b, 0]
                    if self.rotated:
                        bad = pkv_first_nonfinite(src, k)
                        if bad >= 0:
                            bad_row = b
                            bad_value = src[bad]
                            break
                        rotate256(src, xf + b * k, k // 256)
                        src = xf + b * k
                    bad = pkv_pgemv_quantize_x(src, k, self.span, <int8_t *>xs.xq + b * ldx,
                                               <float *>xs.dx + b * ns, <float *>xs.xsum + b * ns,
                                               <int32_t *>xs.xqsum + b * ns)
                    if bad >= 0:
                        bad_row = b
                        bad_value = src[bad]  # x', in the scratch freed below, when rotated
                        overflow = self.rotated and not isfinite(bad_value)
                        break
                if bad < 0:
                    job.w = &self._w
                    job.x = &xs
                    job.y = &yv[0, 0]
                    job.ldy = self.m
                    job.isa = self._isa
                    pool_run(_run_part, &job, job_parts(self._w.n_tiles, n_threads), n_threads)
        finally:
            free(scratch)
        if bad >= 0:
            where = f"x[{bad}]" if xv.shape[0] == 1 else f"x[{bad_row}, {bad}]"
            if overflow:
                raise InvalidArgument(
                    f"x row {bad_row} overflows float32 when rotated (FWHT-256); scale it down")
            if isfinite(bad_value):
                # docs/formats/cpu-gemv.md, 'What it accepts': the span's float32 sum of x
                # could overflow
                what = (f"x row {bad_row}, rotated (FWHT-256), holds {bad_value:.7g} at {bad}"
                        if self.rotated else f"{where} is {bad_value:.7g}")
                raise InvalidArgument(
                    f"{what}: the int8 GEMV takes |x| below 2**127 / {self.span} = "
                    f"{2.0 ** 127 / self.span:.3g} (a span's float32 sum of {self.span} values "
                    "must not overflow); scale x down")
            raise InvalidArgument(f"{where} is {xv[bad_row, bad]!r}; the GEMV takes finite "
                                  "activations only")
