"""Launchers for ``hip/weights.hip``: weight dequantization, fused dequant-GEMV, FWHT-256.

Formats: ``hfq4g256``, ``mq4g256`` (HFQ4 bytes of rotated weights), ``mq4g256v2``,
``hfq6g256``, ``q8f16``; :func:`dequantize` also takes the Lloyd codebook formats
(``mq2g256lloyd``, ``mq3g256lloyd``, ``mq4g256lloyd``, ``mq2g256lloydu``) and the P2
formats (``hfp4g32``, ``mfp4g32``, ``mfp4g32p``, ``mq2g256gl``, ``mq3g256gl``, ``mq8g256``,
``q8hfq``, ``q4f16g64``, ``q4k``, ``tq2g128``, ``bq1g128``; docs/formats/quant.md, "P2
formats"), none of them with a GEMV. Kernels
emit rotated formats in their stored (rotated)
basis, like ``pagedkv.quant.dequantize(..., basis="rotated")``; the GEMV of a
rotated format rotates ``x`` once (FWHT-256 per 256-segment), then runs the
plain affine GEMV, which equals ``W·x`` in the original basis (docs/contracts/hfqm-and-quant.md,
'3.6 FWHT rotation').
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.env_knobs import env_bool
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.kernels.device import Device, Stream, amd_matrix_unit, sm_version
from pagedkv.kernels.device_array import DeviceArray, need_array, need_on_device, need_writable
from pagedkv.kernels.launch_constants import gemv_rows_per_block, launch_constant
from pagedkv.quant.qtypes import qtype

__all__ = ["DEQUANT_ONLY_FORMATS", "WEIGHT_FORMATS", "Gemv", "GemvWeights", "PreparedX",
           "dequantize", "fwht256", "gemv_f16_fills_sms", "gemv_f16_shared_bytes", "max_batch",
           "pipe_shared_bytes", "raw_nbytes"]

SOURCE = "weights"
# pagedkv/launch.h; module attributes so that hip/tune.py can set a swept variant's values.
GEMV_THREADS = launch_constant("PKV_GEMV_THREADS")
GEMV_BATCHES = (1, 2, 4, 8)
DEQUANT_SPAN = launch_constant("PKV_DEQUANT_SPAN")  # weights decoded per thread
DEQUANT_THREADS = launch_constant("PKV_DEQUANT_THREADS")
GEMV_MMA_ROWS = launch_constant("PKV_GEMV_MMA_ROWS")  # rows per block (one m16 tile)
GEMV_MMA_MAX_WARPS = launch_constant("PKV_GEMV_MMA_MAX_WARPS")
GEMV_MMA_WARP_TARGET = 2048  # warps per launch it aims at (132 SMs x ~16), see _mma_warps
GEMV_X_WORDS = launch_constant("PKV_GEMV_X_WORDS")  # prepared-x words per lane, group, n-tile
GEMV_MMA_MAX_TILES = launch_constant("PKV_GEMV_MMA_MAX_TILES")  # n-tiles of the batch 1-8 kernel
#: Batch rows of one tensor-core GEMV call: 1-8 run gemv_mma (n1-n3), 9-32 on NVIDIA the
#: pipelined kernel (gemv_mma_pipe, n6/n9/n12) or the staged one (gemv_mma_staged, n6 up to 16
#: rows, n12 up to 32: each weight tile read once for all rows, x copied into shared memory
#: once per block of 8 tiles), the tiled MFMA / WMMA kernel on AMD.
GEMV_MMA_MAX_BATCH = 32
#: Most group splits of the staged kernel: each split writes batch x M f32 partials (at
#: batch 32 and 4 splits, 512 bytes per row against 2176 per row of a 4096-long 4-bit row).
GEMV_STAGED_MAX_SPLITS = 4
#: The pipelined batch 9-32 kernel (gemv_mma_pipe, NVIDIA; opt-in, slower than the staged one on
#: the H200: ``PAGEDKV_GEMV_PIPE=1`` or ``Gemv(pipe=True)``; docs/kernels.md says why): groups in flight in its shared-memory ring and 16-row tiles per warp
#: (pagedkv/launch.h), most group splits, its n-tiles (n9 for batch 17-24) and the switch
#: that selects it.
GEMV_PIPE_STAGES = launch_constant("PKV_GEMV_PIPE_STAGES")
GEMV_PIPE_TILES_PER_WARP = launch_constant("PKV_GEMV_PIPE_TILES_PER_WARP")
GEMV_PIPE_MAX_SPLITS = 8
PIPE_ENV = "PAGEDKV_GEMV_PIPE"
#: The f16-activation GEMV (gemv_f16, NVIDIA sm_80+, batch 1-32; docs/kernels.md,
#: "f16-activation GEMV"): x rounded once to f16 (error at most 2^-11 of each |x|) instead of
#: the exact int8 planes, one B column per batch row. The default above 8 batch rows (1.1-2.3x
#: the int8 kernels' speed there on the H200); ``Gemv(f16_x=...)`` or ``PAGEDKV_GEMV_F16X``
#: choose. 16-row tiles per warp (its kernels exist for 1 and 2) and most group splits.
F16X_ENV = "PAGEDKV_GEMV_F16X"
GEMV_F16_TILES_PER_WARP = 1
GEMV_F16_X_STAGES = launch_constant("PKV_GEMV_F16_X_STAGES")
GEMV_F16_MAX_SPLITS = 8
#: The f16 GEMV's bound on |y - W x| relative to sum |w||x| (the f16 rounding of x, 2^-11,
#: and the f32 sums' error below 2^-15); the int8 kernels' is 2e-5.
GEMV_F16_ERROR = 5.5e-4
#: The fused-x kernels (pkv_gemv_mma_x_*_n1, NVIDIA sm_80+, batch 1-2, every tensor-core
#: format; docs/kernels.md, "Fused x"): :meth:`Gemv.run` in one launch, each warp preparing
#: its groups' x itself, bit for bit the prep + GEMV pair. ``Gemv(fused_x=...)`` or
#: ``PAGEDKV_GEMV_FUSED_X`` choose; unset, :func:`fused_x_by_default`: batch 1 of the
#: kernels in :data:`GEMV_FUSED_X_KERNELS` with x not rotated, where an H100 measured the
#: one launch faster (2026-12-07, at the default row tiles: HFQ4G256 0.91-0.97x, HFQ6G256
#: 0.87-0.92x, Q8F16 0.85-0.94x the two launches' time at 4096x4096, 4096x14336 and
#: 14336x4096; MQ4G256V2, whose every block rotates x again, 1.05-1.26x; at batch 2 the
#: 4-bit formats are slower fused and HFQ6G256 / Q8F16 0.87-1.02x: two launches there).
FUSED_X_ENV = "PAGEDKV_GEMV_FUSED_X"
GEMV_FUSED_X_KERNELS = ("hfq4g256", "hfq6g256", "q8f16")
#: 16-row tiles per block of the fused-x kernels (``PKV_GEMV_X_ROW_TILES``, ``_WIDE`` for
#: HFQ6G256 / Q8F16; launch.h): each warp prepares a group's x once for all of them.
GEMV_X_ROW_TILES = launch_constant("PKV_GEMV_X_ROW_TILES")
GEMV_X_ROW_TILES_WIDE = launch_constant("PKV_GEMV_X_ROW_TILES_WIDE")
GEMV_MAX_BATCH = 8  # the CUDA-core kernel (AMD, sm < 80, HFQ6/Q8F16)
_TILED_TILES = (6, 12)
_PIPE_TILES = (6, 9, 12)
_TILE_UNITS = GEMV_MMA_ROWS * 136 // 16  # a packed 4-bit tile-group in 16-byte units
_MMA_KERNELS = ("hfq4g256", "mq4g256v2")
#: HFQ6G256 and Q8F16 on the int8 tensor cores (gemv_mma's n1-n3 kernels at batch 1-8,
#: gemv_mma_staged's n6 / n12 at 9-32, NVIDIA sm_80+; on AMD gemv_amd_mc's, where the unit's
#: opt-in is on too; docs/kernels.md, "HFQ6 and Q8F16 on tensor cores"): the default since
#: their GPU tests and compute-sanitizer memcheck passed on an H100 (2026-12-06), where they
#: took 0.36-0.94x the CUDA-core kernel's time at batch 1-8. The variable, set to 0, turns
#: both formats back to the CUDA-core kernel (batch 1-8).
WIDE_MMA_ENV = "PAGEDKV_GEMV_MMA_HFQ6_Q8F16"
_WIDE_MMA_KERNELS = ("hfq6g256", "q8f16")
#: Warps per block of the staged batch 9-32 kernel for HFQ6G256 / Q8F16 (the 4-bit formats:
#: GEMV_MMA_MAX_WARPS). On an H100 (2026-12-06, 4096^2, 4096x14336, 14336x4096 at batch 16
#: and 32) 4 warps were the fastest or tied at every shape, 2 slower; with the splits
#: counted for two blocks an SM the launch took 0.87-1.00x the time of the 8-warp one;
#: the default since the GPU test of any warps a block (the same bits) passed there.
_WIDE_STAGED_WARPS = 4


class _WeightFormat:
    __slots__ = ("group_bytes", "group_size", "kernel", "name", "p2", "rotated")

    def __init__(self, name, kernel, p2=False):
        # group geometry and rotation: the qt register (pagedkv/hfqm.h, PKV_QT_LIST)
        row = qtype(name)
        self.name, self.kernel, self.rotated = name, kernel, row.rotated
        self.group_size, self.group_bytes = row.group_size, row.group_bytes
        self.p2 = p2  # a P2 kernel: (raw, out, n, K); sizes from pagedkv.quant's register

    def __repr__(self) -> str:
        return f"WeightFormat({self.name!r}, G={self.group_size}, B={self.group_bytes})"


WEIGHT_FORMATS = {f.name: f for f in (
    _WeightFormat("hfq4g256", "hfq4g256"),
    _WeightFormat("mq4g256", "hfq4g256"),
    _WeightFormat("mq4g256v2", "mq4g256v2"),
    _WeightFormat("hfq6g256", "hfq6g256"),
    _WeightFormat("q8f16", "q8f16"),
)}

#: Formats with a dequantize kernel but no GEMV (docs/formats/quant.md, "Lloyd codebooks").
DEQUANT_ONLY_FORMATS = {f.name: f for f in (
    _WeightFormat("mq2g256lloyd", "lloyd2"),
    _WeightFormat("mq3g256lloyd", "lloyd3"),
    _WeightFormat("mq4g256lloyd", "lloyd4"),
    _WeightFormat("mq2g256lloydu", "lloyd2"),
)}


def _p2(name: str, kernel: str) -> _WeightFormat:
    return _WeightFormat(name, kernel, p2=True)


#: The P2 formats' kernels (docs/formats/quant.md, "P2 formats"): exact per-weight decoders.
DEQUANT_ONLY_FORMATS.update({f.name: f for f in (
    _p2("hfp4g32", "hfp4"), _p2("mfp4g32", "hfp4"), _p2("mfp4g32p", "mfp4p"),
    _p2("mq2g256gl", "gl2"), _p2("mq3g256gl", "gl3"), _p2("mq8g256", "mq8"),
    _p2("q8hfq", "q8hfq"), _p2("q4f16g64", "q4f16g64"), _p2("q4k", "q4k"),
    _p2("tq2g128", "tq2"), _p2("bq1g128", "bq1"),
)})


def _format(fmt: str | int, *, dequant: bool = False) -> _WeightFormat:
    # the same spellings as pagedkv.quant: a qt name in any case, or a qt id
    from pagedkv.quant.formats import resolve
    name = resolve(fmt).name
    f = WEIGHT_FORMATS.get(name) or (DEQUANT_ONLY_FORMATS.get(name) if dequant else None)
    if f is None:
        took = [*WEIGHT_FORMATS, *(DEQUANT_ONLY_FORMATS if dequant else ())]
        raise InvalidArgument(f"fmt={fmt!r}: the GPU kernels take {took}")
    return f


def raw_nbytes(fmt: str | int, numel: int, k: int | None = None) -> int:
    """Bytes of a tensor of ``numel`` weights in ``fmt`` (last group padded). The row
    formats (``hfp4g32``, ``mfp4g32``, ``mfp4g32p``, ``q8hfq``) need the row length ``k``."""
    f = _format(fmt, dequant=True)
    if f.p2:
        from pagedkv.quant.formats import check_k, resolve
        codec = resolve(f.name)
        if codec.row_multiple and k is None:
            raise InvalidArgument(f"{f.name} stores rows: pass the row length k")
        shape = (numel // k, k) if codec.row_multiple and k else (numel,)
        if codec.row_multiple and k and numel % k:
            raise InvalidArgument(f"{numel} weights are not whole rows of k = {k}")
        check_k(codec, shape)
        return codec.payload_nbytes(shape)
    return math.ceil(numel / f.group_size) * f.group_bytes


def _raw(raw, fmt: _WeightFormat, numel: int, k: int | None = None, device=None) -> None:
    need_array(raw, "raw", np.uint8, device=device)
    want = raw_nbytes(fmt.name, numel, k)
    if raw.nbytes != want:
        raise InvalidArgument(f"raw: {raw.nbytes} bytes, {fmt.name} of {numel} weights takes "
                              f"{want}")
    if raw.ptr % 8:
        raise InvalidArgument(f"raw: device address 0x{raw.ptr:x} is not 8-byte aligned")


def dequantize(device: Device, raw: DeviceArray, fmt: str | int, out: DeviceArray,
               *, stream: Stream | None = None) -> None:
    """Decode ``raw`` into ``out`` (``float32`` or ``float16``, any shape: its size is the
    weight count; groups run over the flattened tensor; the row formats take the row
    length K from ``out.shape[-1]``, GL needs whole 256-groups). Every kernel writes the
    stored basis."""
    f = _format(fmt, dequant=True)
    need_writable(out, "out", device)
    if out.dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise InvalidArgument(f"out: dtype {out.dtype}, expected float32 or float16")
    n = out.size
    row_k = out.shape[-1] if out.shape else 1
    _raw(raw, f, n, row_k, device)
    if n == 0:
        return
    suffix = "f32" if out.dtype == np.float32 else "f16"
    per_block = DEQUANT_SPAN * DEQUANT_THREADS
    grid = (math.ceil(n / per_block),)
    if f.p2:
        k = device.kernel(SOURCE, f"pkv_dequant_{f.kernel}_{suffix}", "ppqq")
        k(grid, (DEQUANT_THREADS,), raw, out, n, row_k, stream=stream)
        return
    k = device.kernel(SOURCE, f"pkv_dequant_{f.kernel}_{suffix}", "ppq")
    k(grid, (DEQUANT_THREADS,), raw, out, n, stream=stream)


def fwht256(device: Device, x: DeviceArray, out: DeviceArray,
            *, stream: Stream | None = None) -> None:
    """``out`` = FWHT-256 of each 256-segment of ``x`` (``float32``, size a multiple of 256;
    ``out`` may be ``x``). Bit-exact with ``pagedkv.quant.fwht256``."""
    need_array(x, "x", np.float32, device=device)
    need_array(out, "out", np.float32, writable=True, device=device)
    if x.size % 256 or out.size != x.size:
        raise InvalidArgument(f"x/out: sizes {x.size}/{out.size}, expected equal multiples "
                              f"of 256")
    groups = x.size // 256
    if groups == 0:
        return
    warps_per_block = 256 // device.properties.warp_size
    k = device.kernel(SOURCE, "pkv_fwht256_f32", "ppq")
    k((math.ceil(groups / warps_per_block),), (256,), x, out, groups, stream=stream)


class PreparedX(NamedTuple):
    """Where a :class:`Gemv` on the tensor-core kernel reads its prepared x, for a kernel that
    writes it while producing x (hip/gemv_prep_x.h, ``gemv_prep_x_warp``): ``xq`` the int8
    byte planes (``uint32``), ``xs`` per (group, batch row) the step and the sums of x
    (``float32[groups * batch, 4]``), ``tiles`` the n-tiles per group, ``rotate`` whether
    x is rotated (FWHT-256) first, for ``batch`` rows of ``K`` values."""

    xq: DeviceArray
    xs: DeviceArray
    tiles: int
    rotate: bool
    batch: int
    K: int


def check_prepared(prepared: PreparedX, rows: int, k: int, device: Device | None = None) -> None:
    """A fused producer's check that ``prepared`` is a :class:`PreparedX` for its ``rows``
    rows of ``k`` values, of a Gemv on ``device`` when given (``InvalidArgument``
    otherwise)."""
    if not isinstance(prepared, PreparedX):
        raise InvalidArgument(f"prepared: expected Gemv.prepared_x()'s PreparedX, got "
                              f"{type(prepared).__name__}")
    need_on_device(prepared.xq, "prepared", device)
    if (prepared.batch, prepared.K) != (rows, k):
        raise InvalidArgument(f"prepared: a Gemv of batch {prepared.batch} and K {prepared.K}; "
                              f"x has {rows} rows of {k}")


class GemvWeights:
    """A weight matrix on the device in the layout one :class:`Gemv` configuration reads
    (made by :meth:`Gemv.upload`): ``array`` holds :meth:`Gemv.pack`'s bytes."""

    __slots__ = ("K", "M", "array", "fmt", "packed")

    def __init__(self, array: DeviceArray, fmt: str, M: int, K: int, packed: bool) -> None:
        self.array, self.fmt, self.M, self.K, self.packed = array, fmt, M, K, packed

    def __repr__(self) -> str:
        layout = "packed 16-row tiles" if self.packed else "raw rows"
        return (f"GemvWeights({self.fmt!r}, M={self.M}, K={self.K}, {layout}, "
                f"{self.array.nbytes} bytes)")

    def free(self) -> None:
        self.array.free()


class Gemv:
    """``y[b] = W · x[b]`` for ``W`` of shape ``[M, K]`` in ``fmt`` and ``batch``
    activations (1–8; 1–32 on the tensor-core kernel, see :func:`max_batch`): ``x`` ``float32[batch, K]``, ``y`` ``float32[batch, M]``. ``K`` must be a
    multiple of the group size (every row starts a group).

    Weights go up once with :meth:`upload` (host bytes as stored; the tensor-core kernel
    reads them re-packed in 16-row tiles, see :meth:`pack`). :meth:`run` is
    :meth:`prepare` then :meth:`run_prepared`. Preparing x rotates it for
    the rotated formats and, on NVIDIA sm_80+ and AMD gfx908/gfx90a/gfx940-942/gfx11 for the
    4-bit formats (the tensor-core kernel; MFMA or WMMA on AMD, compile-checked and emulated
    only, opt-in) and for HFQ6G256 / Q8F16 with ``wide_mma``,
    quantizes it per 256-group into exact 22-bit integers (error at most 2^-23
    of the group's largest ``|x|``, then exact integer dot products). Several weights
    multiplied by the same x (Q/K/V, gate/up) need one :meth:`prepare` and one
    :meth:`run_prepared` each; the prepared x lives in this object's scratch."""

    _grid: tuple[int, ...]  # the kernel's launch grid

    def __init__(self, device: Device, fmt: str | int, M: int, K: int, batch: int = 1, *,
                 warps: int | None = None, pipe: bool | None = None,
                 splits: int | None = None, f16_x: bool | None = None,
                 wide_mma: bool | None = None, fused_x: bool | None = None) -> None:
        """``warps``: warps per block of the tensor-core kernel (wavefronts of 64 on AMD;
        1-8; ``None``: chosen from M, the fastest measured on the H200; the batch 9-32
        kernels on NVIDIA: 8, HFQ6G256 / Q8F16's staged one 4). Ignored by the f32 kernel.

        ``pipe`` (NVIDIA, batch 9-32): ``None`` runs the staged kernel unless
        ``PAGEDKV_GEMV_PIPE=1`` (then the pipelined one where its shared memory fits the
        device; opt-in: slower than the staged one on the H200,
        docs/kernels.md), ``True`` requires the pipelined kernel,
        ``False`` runs the staged kernel. ``splits``: group splits of those
        kernels (1 to 4 staged, 1 to 8 pipelined or f16; ``None``: chosen from the grid). The
        two int8 kernels give the same outputs bit for bit at the same splits (docs/kernels.md,
        "Pipelined tensor-core GEMV").

        ``f16_x`` (NVIDIA sm_80+, 4-bit formats, any batch 1-32): ``True`` runs the
        f16-activation kernel (x rounded once to f16 per group, scaled by a power of two:
        error at most :data:`GEMV_F16_ERROR` of sum |w||x| instead of 2e-5), ``False`` the
        exact int8 kernels. ``None``: ``False`` when ``pipe`` is given (it picks an int8
        kernel), else ``PAGEDKV_GEMV_F16X`` when set, else ``True`` above 8 batch rows
        (unless ``PAGEDKV_GEMV_PIPE=1`` asks for the pipelined int8 kernel), where it exists.

        ``wide_mma`` (HFQ6G256 and Q8F16, batch 1-32, K a multiple of 256; NVIDIA sm_80+, or
        AMD gfx908/gfx90a/gfx940-942 / gfx11 with ``PAGEDKV_GEMV_MFMA=1`` /
        ``PAGEDKV_GEMV_WMMA=1``, whose kernels no AMD GPU has run): ``True`` runs them on the
        int8 tensor / matrix cores (docs/kernels.md, "HFQ6 and Q8F16 on tensor cores";
        refused elsewhere), ``False`` on the f32 CUDA-core kernel (batch 1-8), ``None``
        reads ``PAGEDKV_GEMV_MMA_HFQ6_Q8F16`` (unset: on the tensor cores where they
        exist).

        ``fused_x`` (NVIDIA sm_80+, the int8 tensor-core kernels at batch 1-2): ``True`` makes
        :meth:`run` one launch that prepares x inside the GEMV (the same bits as the prep and
        GEMV launches; :meth:`prepare` / :meth:`run_prepared` are unchanged), ``False`` two
        launches; ``None`` reads ``PAGEDKV_GEMV_FUSED_X`` (unset:
        :func:`fused_x_by_default`) where the kernel exists."""
        self.fmt = f = _format(fmt)
        for name, value, optional in (("M", M, False), ("K", K, False), ("batch", batch, False),
                                      ("warps", warps, True), ("splits", splits, True)):
            if not (is_int(value) or (optional and value is None)):
                raise InvalidArgumentType(f"{name}={value!r}: expected an int"
                                          + (" or None" if optional else "")
                                          + f", got {type(value).__name__}")
        M, K, batch = int(M), int(K), int(batch)
        warps = None if warps is None else int(warps)
        splits = None if splits is None else int(splits)
        if M < 1 or K < 1 or K % f.group_size or K % 32:
            raise InvalidArgument(f"M={M}, K={K}: need M >= 1 and K a positive multiple of "
                                  f"{max(f.group_size, 32)} for {f.name}")
        most = max_batch(device, f.name, wide_mma)
        if not 1 <= batch <= most:
            raise InvalidArgument(f"batch={batch}: expected 1..{most} for {f.name} on this "
                                  f"device; split larger batches into calls of {most} rows")
        if warps is not None and not 1 <= warps <= 8:
            raise InvalidArgument(f"warps={warps}: expected 1..8 (GEMV_MMA_MAX_WARPS)")
        choice = _choose_kernel(device, f, batch, warps, pipe, splits, f16_x, K, wide_mma,
                                fused_x)
        if batch > GEMV_MAX_BATCH and not choice.tensor_cores:  # Q8F16, K not whole groups
            raise InvalidArgument(f"batch={batch}: {f.name} with K={K} runs the CUDA-core "
                                  f"kernel (the tensor-core one takes K a multiple of 256), "
                                  f"1..{GEMV_MAX_BATCH} rows a call; split the batch")
        tensor_cores, use_f16, use_pipe, wide = (choice.tensor_cores, choice.f16, choice.pipe,
                                                  choice.wide)
        self.device, self.M, self.K, self.batch = device, M, K, batch
        self.tensor_cores = tensor_cores
        self.pipe = use_pipe
        self.f16_x = use_f16
        self.fused_x = choice.fused
        self.packed = False  # whether run() reads pack()'s layout instead of the raw rows
        # The x run_prepared reads (the f32 kernel), or the one last quantized into the
        # scratch (tensor cores); None before the first prepare().
        self._x: DeviceArray | None = None
        self._prepared_elsewhere = False  # prepared_x() handed the scratch to a writer
        if self.tensor_cores:
            groups = K // 256
            tiles = math.ceil(3 * batch / 8)  # B columns: 3 byte planes per batch row
            if use_f16:  # one B column per batch row; the prep's f16 layout is tiles == 0
                tiles = 0
            elif use_pipe:
                tiles = _pipe_tiles(batch)
            elif tiles > GEMV_MMA_MAX_TILES:  # the tiled kernel: whole chunks of 3 n-tiles
                tiles = next(n for n in _TILED_TILES if n >= tiles)
            self._xq = device.empty((groups * batch * 128,) if use_f16 else
                                    (groups * tiles * 32 * GEMV_X_WORDS,), np.uint32)
            self._xs = device.empty((groups * batch, 4), np.float32)
            # the prep and the batch 1-8 kernel wait for the previous grid themselves (PDL);
            # the staged and tiled kernels do not, so they launch after it completes
            self._prep = device.kernel(SOURCE, "pkv_gemv_prep_x", "pppiiii",
                                       dependent_launch=True)
            self._tiles = tiles
            self._prep_grid = (math.ceil(groups * batch / 8),)  # a warp per (group, batch row)
            self.packed = True
            row_tiles = math.ceil(M / GEMV_MMA_ROWS)
            # the staged kernel's split-K scratch (none elsewhere), see _staged_splits
            self._split_args: tuple[DeviceArray, ...] = ()
            self._shared = 0  # dynamic shared bytes of the launch (the pipelined kernel's ring)
            if use_f16:
                # gemv_f16: a block's warps take TPW 16-row tiles each and share the f16 x it
                # copies to shared memory; blockIdx.y splits the groups
                # 8 warps up to 4096 rows, else 4 (more, smaller blocks): the faster of the
                # two on every Llama-3-8B shape on the H200 (docs/kernels.md); except where
                # 128-row blocks alone cover every SM (gemv_f16_fills_sms: the gate/up
                # projection's 28672 rows): no group split, and 4 warps of 2 tiles (each x
                # fragment feeds two tiles' mmas)
                fills = warps is None and gemv_f16_fills_sms(
                    row_tiles, self.device.properties.multiprocessor_count)
                n_warps = warps or (GEMV_MMA_MAX_WARPS if M <= 4096 else 4)
                tpw = GEMV_F16_TILES_PER_WARP
                if fills:
                    n_warps, tpw = GEMV_MMA_MAX_WARPS // 2, 2
                    if splits is None:
                        splits = 1
                self._split_launch(row_tiles, groups, n_warps, tpw, splits, choice.most_splits)
                self._kernel = device.kernel(
                    SOURCE, f"pkv_gemv_f16_{f.kernel}_n{math.ceil(batch / 8)}_t{tpw}",
                    "ppppppiii", dependent_launch=True)
                self._shared = gemv_f16_shared_bytes(math.ceil(batch / 8))
                self._kernel.reserve_shared(self._shared)
            elif wide:
                # gemv_mma_staged: a block's warps take one 16-row tile each and share the
                # x it copies to shared memory; gemv_mma_pipe: TILES_PER_WARP tiles each, x
                # and weights copied STAGES - 1 groups ahead; blockIdx.y splits the groups
                n_warps = warps or (_WIDE_STAGED_WARPS if f.kernel in _WIDE_MMA_KERNELS
                                    else GEMV_MMA_MAX_WARPS)
                # the staged kernel is built for 255 registers at 8 warps: 8 // warps blocks
                # share an SM; the pipelined one's shared ring keeps it to one
                self._split_launch(row_tiles, groups, n_warps,
                                   GEMV_PIPE_TILES_PER_WARP if use_pipe else 1, splits,
                                   choice.most_splits,
                                   1 if use_pipe else GEMV_MMA_MAX_WARPS // n_warps)
                name = "pipe" if use_pipe else "staged"
                self._kernel = device.kernel(SOURCE, f"pkv_gemv_mma_{name}_{f.kernel}_n{tiles}",
                                             "ppppppiii", dependent_launch=use_pipe)
                if use_pipe:
                    self._shared = pipe_shared_bytes(tiles, n_warps)
                    self._kernel.reserve_shared(self._shared)
            else:
                tiled = "tiled_" if tiles > GEMV_MMA_MAX_TILES else ""
                self._kernel = device.kernel(SOURCE, f"pkv_gemv_mma_{tiled}{f.kernel}_n{tiles}",
                                             "ppppiii", dependent_launch=not tiled)
                self._grid = (row_tiles,)
                # warps of 32 lanes on NVIDIA, wavefronts of 64 (MFMA) or 32 (WMMA) on AMD
                self._block = (device.properties.warp_size
                               * (warps or _mma_warps(row_tiles, groups)),)
                if choice.fused:  # run(): x prepared by each warp, once for its block's tiles
                    self._fused = device.kernel(SOURCE, f"pkv_gemv_mma_x_{f.kernel}_n1",
                                                "pppiiii", dependent_launch=True)
                    blocks, fused_warps = fused_x_grid(f.kernel, M, K, warps)
                    self._fused_grid = (blocks,)
                    self._fused_block = (device.properties.warp_size * fused_warps,)
        else:
            bmax = next(b for b in GEMV_BATCHES if b >= batch)
            self._kernel = device.kernel(SOURCE, f"pkv_gemv_{f.kernel}_b{bmax}", "pppiii")
            self._scratch = device.empty((batch, K), np.float32) if f.rotated else None
            rows = gemv_rows_per_block(bmax)
            self._grid = (math.ceil(M / rows),)  # a block per `rows` rows; its threads split K
            self._block = (GEMV_THREADS,)

    def _split_launch(self, row_tiles: int, groups: int, n_warps: int, tiles_per_warp: int,
                      splits: int | None, most_splits: int, blocks_per_sm: int = 1) -> None:
        """Grid ``(row blocks, group splits)`` and block of a batch 9-32 kernel on NVIDIA
        (``splits`` None: :func:`_staged_splits`'s choice for ``blocks_per_sm`` resident
        blocks per SM), with its split-K scratch: ``partial[split][batch][M]`` and a zeroed
        arrival counter per row block (the last block of a row block resets it for the next
        launch)."""
        row_blocks = math.ceil(row_tiles / (n_warps * tiles_per_warp))
        if splits is None:
            splits = _staged_splits(
                row_blocks, groups,
                blocks_per_sm * self.device.properties.multiprocessor_count, most_splits)
        self._grid = (row_blocks, splits)
        self._split_args = (
            self.device.empty((splits * self.batch * self.M if splits > 1 else 1,), np.float32),
            self.device.array(np.zeros(row_blocks, np.uint32)))
        self._block = (32 * n_warps,)

    def __repr__(self) -> str:
        cores = "matrix" if getattr(self.device, "backend", None) == "hip" else "tensor"
        kernel = f", int8 {cores} cores" if self.tensor_cores else ""
        if self.f16_x:
            kernel = f", f16 x, {cores} cores"
        elif self.tensor_cores and len(self._grid) == 2:  # the batch 9-32 kernels on NVIDIA
            kernel += ", pipelined" if self.pipe else ", staged"
        elif self.fused_x:
            kernel += ", fused x"
        return f"Gemv({self.fmt.name!r}, M={self.M}, K={self.K}, batch={self.batch}{kernel})"

    @property
    def launch(self) -> str:
        """The launch :meth:`run_prepared` makes: ``"<kernel> <grid> x <threads>"``, e.g.
        ``"pkv_gemv_f16_hfq4g256_n4_t2 224x1 x 128"`` (row blocks x group splits for the
        batch 9-32 kernels), so a figure can say which launch made it."""
        return _launch_text(self._kernel, self._grid, self._block)

    @property
    def fused_launch(self) -> str | None:
        """The launch :meth:`run` makes where :attr:`fused_x` (as :attr:`launch`, e.g.
        ``"pkv_gemv_mma_x_hfq4g256_n1 256 x 256"``), else ``None``."""
        if not self.fused_x:
            return None
        return _launch_text(self._fused, self._fused_grid, self._fused_block)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights :meth:`run` reads (the packed layout when :attr:`packed`)."""
        if self.packed:
            return raw_nbytes(self.fmt.name, math.ceil(self.M / 16) * 16 * self.K)
        return raw_nbytes(self.fmt.name, self.M * self.K)

    def pack(self, raw: np.ndarray) -> np.ndarray:
        """The weights in the layout :meth:`run` reads, from the stored bytes (``uint8``,
        ``raw_nbytes(fmt, M * K)`` of them, row-major groups). The tensor-core kernel reads
        16-row tiles: per tile and group, the 16 group headers then the code bytes in the
        order its lanes load them, so a warp streams each tile-group as one contiguous
        run (rows past M are zero groups). Otherwise the bytes are returned unchanged.
        Pack once when the weights are loaded, then upload."""
        raw = np.asarray(raw)
        want = raw_nbytes(self.fmt.name, self.M * self.K)
        if raw.dtype != np.uint8 or raw.size != want:
            raise InvalidArgument(f"raw: {raw.dtype}[{raw.size}], expected uint8[{want}] "
                                  f"({self.fmt.name} of {self.M}x{self.K})")
        if not self.packed:
            return raw.reshape(-1)
        if self.fmt.kernel in _WIDE_MMA_KERNELS:
            from pagedkv.kernels import gemv_pack
            pack = (gemv_pack.pack_tiles_q8f16 if self.fmt.kernel == "q8f16"
                    else gemv_pack.pack_tiles_hfq6)
            return pack(np.ascontiguousarray(raw.reshape(self.M, -1)), self.K // 256)
        return _pack_tiles(raw, self.M, self.K, self.fmt.group_bytes)

    def upload(self, raw: np.ndarray) -> GemvWeights:
        """Copy the stored weight bytes to the device in the layout :meth:`run` reads."""
        return GemvWeights(self.device.array(self.pack(raw)), self.fmt.name, self.M, self.K,
                           self.packed)

    def _check_x(self, x: DeviceArray) -> None:
        need_array(x, "x", np.float32, device=self.device)
        if x.shape != (self.batch, self.K):
            raise InvalidArgument(f"x: shape {x.shape}, expected {(self.batch, self.K)}")

    def _check_wy(self, w: GemvWeights | DeviceArray, y: DeviceArray) -> DeviceArray:
        """The device array of ``w`` after checking it fits this GEMV; ``y`` checked too."""
        if isinstance(w, GemvWeights):
            if (w.fmt, w.M, w.K, w.packed) != (self.fmt.name, self.M, self.K, self.packed):
                raise InvalidArgument(f"w: {w!r} was uploaded for another GEMV; this one is "
                                      f"{self!r}")
            arr = w.array
            need_array(arr, "w", np.uint8, device=self.device)
            if arr.nbytes != self.weight_bytes:
                raise InvalidArgument(f"w: {arr.nbytes} bytes, expected {self.weight_bytes}")
            if arr.ptr % 16:
                raise InvalidArgument(f"w: device address 0x{arr.ptr:x} is not 16-byte aligned")
        elif self.packed:
            need_array(w, "w", np.uint8)  # a DeviceArray of any other type says so first
            raise InvalidArgument("w: a DeviceArray of raw rows; the tensor-core GEMV reads "
                                  "Gemv.upload(raw) (the rows packed in 16-row tiles once)")
        else:
            arr = w
            _raw(arr, self.fmt, self.M * self.K, device=self.device)
        need_array(y, "y", np.float32, writable=True, device=self.device)
        if y.shape != (self.batch, self.M):
            raise InvalidArgument(f"y: shape {y.shape}, expected {(self.batch, self.M)}")
        return arr

    @staticmethod
    def _check_apart(x: DeviceArray, y: DeviceArray) -> None:
        """``y`` must not overlap ``x``: the f32 and fused-x kernels read x while they write
        y, so an overlapping y gives wrong sums (the other paths refuse it alike)."""
        if x.nbytes and y.nbytes and x.ptr < y.ptr + y.nbytes and y.ptr < x.ptr + x.nbytes:
            raise InvalidArgument(f"y overlaps x ({y!r}, {x!r}): the GEMV reads x while it "
                                  f"writes y; pass a separate y")

    def prepare(self, x: DeviceArray, *, stream: Stream | None = None,
                x_rotated: bool = False) -> None:
        """Make ``x`` (``float32[batch, K]``) the activations of the next
        :meth:`run_prepared` calls. For a rotated format, ``x_rotated=True`` says ``x``
        already holds the rotated activations. Without the tensor-core kernel, an
        unrotated ``x`` is used in place: keep it unchanged until the GEMVs ran."""
        self._check_x(x)
        self._prepare(x, stream, x_rotated)

    def _prepare(self, x: DeviceArray, stream: Stream | None, x_rotated: bool) -> None:
        """:meth:`prepare` after its checks."""
        rotate = self.fmt.rotated and not x_rotated
        if self.tensor_cores:
            self._prep(self._prep_grid, (256,), x, self._xq, self._xs, self.K, self.batch,
                       self._tiles, int(rotate), stream=stream)
            self._x = x
        elif rotate:
            assert self._scratch is not None
            fwht256(self.device, x, self._scratch, stream=stream)
            self._x = self._scratch
        else:
            self._x = x

    def prepared_x(self) -> PreparedX:
        """The scratch :meth:`prepare` writes, for a kernel that writes the prepared x itself
        while producing x (the decode step's RMSNorm and SiLU·up, ``pagedkv.kernels.decode``),
        saving the prep launch: launch it, then :meth:`run_prepared` on the same stream.
        Tensor-core GEMV only (``InvalidArgument`` otherwise: the f32 kernel reads x as is)."""
        if not self.tensor_cores:
            raise InvalidArgument(f"{self!r}: no prepared x off the tensor-core kernel; call "
                                  f"run(w, x, y) or prepare(x)")
        self._prepared_elsewhere = True
        return PreparedX(self._xq, self._xs, self._tiles, self.fmt.rotated, self.batch, self.K)

    def run_prepared(self, w: GemvWeights | DeviceArray, y: DeviceArray, *,
                     stream: Stream | None = None) -> None:
        """``y = W·x`` for the x of the last :meth:`prepare`. ``w``: :meth:`upload`'s
        result (or, off the tensor-core kernel, a DeviceArray of the stored bytes)."""
        arr = self._check_wy(w, y)
        if self._x is None and not self._prepared_elsewhere:
            raise InvalidArgument("Gemv.run_prepared: no prepared x; call prepare(x) first")
        if not self.tensor_cores and self._x is not None:  # the f32 kernel reads x in place
            self._check_apart(self._x, y)
        self._launch(arr, y, stream)

    def _launch(self, arr: DeviceArray, y: DeviceArray, stream: Stream | None) -> None:
        """The GEMV launch of :meth:`run_prepared`, after its checks."""
        if self.tensor_cores:
            self._kernel(self._grid, self._block, arr, self._xq, self._xs, y, *self._split_args,
                         self.M, self.K, self.batch, shared_bytes=self._shared, stream=stream)
        else:
            self._kernel(self._grid, self._block, arr, self._x, y, self.M, self.K, self.batch,
                         stream=stream)

    def run(self, w: GemvWeights | DeviceArray, x: DeviceArray, y: DeviceArray,
            *, stream: Stream | None = None, x_rotated: bool = False) -> None:
        """``y = W·x``: :meth:`prepare` then :meth:`run_prepared`, every argument checked
        before anything is launched (``y`` must not overlap ``x``); with :attr:`fused_x` one launch that prepares x in the
        GEMV (the same bits), after which :meth:`run_prepared` needs a :meth:`prepare` again
        (the scratch holds no x of this call)."""
        arr = self._check_wy(w, y)
        self._check_x(x)
        self._check_apart(x, y)
        if self.fused_x:
            self._fused(self._fused_grid, self._fused_block, arr, x, y, self.M, self.K, self.batch,
                        int(self.fmt.rotated and not x_rotated), stream=stream)
            self._x = None
            return
        # every argument was checked above: the prep and the GEMV without checking again
        self._prepare(x, stream, x_rotated)
        self._launch(arr, y, stream)


def _pack_tiles(raw: np.ndarray, M: int, K: int, group_bytes: int) -> np.ndarray:
    """Gemv.pack for the tensor-core kernel (weights.hip, gemv_mma): gemv_pack's C loop
    over 8-byte words (a 4-bit group is 17 of them)."""
    from pagedkv.kernels.gemv_pack import pack_tiles_4bit
    groups = K // 256
    flat = raw.reshape(-1)
    if flat.flags.c_contiguous and flat.ctypes.data % 8 == 0:
        rows = flat.view(np.uint64).reshape(M, -1)
    else:  # words need 8-byte alignment: copy once
        rows = np.empty((M, groups * group_bytes // 8), np.uint64)
        rows.view(np.uint8)[:] = flat.reshape(M, -1)
    return pack_tiles_4bit(rows, groups).view(np.uint8)


def max_batch(device: Device, fmt: str | int, wide_mma: bool | None = None) -> int:
    """Most batch rows one :class:`Gemv` takes for ``fmt`` on ``device``: 32 on the
    tensor-core kernel (NVIDIA sm_80+; AMD gfx908/gfx90a/gfx940-942 and gfx11, opt-in; 4-bit
    formats, and HFQ6G256 / Q8F16 unless ``wide_mma`` (``Gemv``'s) is False or, None,
    ``PAGEDKV_GEMV_MMA_HFQ6_Q8F16=0``), 8 on the CUDA-core one."""
    f = _format(fmt)
    return GEMV_MMA_MAX_BATCH if _uses_tensor_cores(device, f, wide_mma) else GEMV_MAX_BATCH


def _mma_warps(row_tiles: int, groups: int) -> int:
    """Warps per block (each takes a contiguous share of the groups): enough for about
    GEMV_MMA_WARP_TARGET warps in all, a power of two from 1 to 8 and at most one per
    group. On the H200 that picks the fastest of 4/8/16 for M = 4096 (8) and 14336 (4)."""
    want = max(1, math.ceil(GEMV_MMA_WARP_TARGET / row_tiles))
    return min(8, groups, 1 << (want - 1).bit_length())


def _staged_splits(row_blocks: int, groups: int, sms: int,
                   most: int = GEMV_STAGED_MAX_SPLITS) -> int:
    """Group splits of the batch 9-32 kernels (gridDim.y): the fewest, up to ``most``
    (GEMV_STAGED_MAX_SPLITS, GEMV_PIPE_MAX_SPLITS), that minimise waves x groups per block,
    ``sms`` the blocks resident at once (one per SM at 8 warps: 255 registers x 256 threads
    fill an SM's register file; two at 4 warps). Staged (8 warps, 128 rows per block) on 132
    SMs: 4096x4096 (32 row blocks, 16 groups) 4; 6144x4096 (48) 2;
    14336x4096 (112) 1; 28672x4096 (224) 4; 4096x14336 (56 groups) 4. Pipelined (256 rows):
    4096x4096 (16) 8; 6144x4096 (24) 4; 14336x4096 (56) 2; 4096x14336 (16) 8."""
    def cost(s: int) -> int:
        return math.ceil(row_blocks * s / sms) * math.ceil(groups / s)
    return min(range(1, min(groups, most) + 1), key=lambda s: (cost(s), s))


def _pipe_tiles(batch: int) -> int:
    """n-tiles of the pipelined kernel: 3 byte-plane columns per batch row in whole chunks of
    3 n-tiles (n6 up to 16 rows, n9 up to 24, n12 up to 32)."""
    return next(n for n in _PIPE_TILES if 8 * n >= 3 * batch)


def pipe_shared_bytes(tiles: int, warps: int) -> int:
    """Dynamic shared bytes per block of the pipelined kernel (gemv_mma_pipe's PipeStage):
    GEMV_PIPE_STAGES stages of [tiles x 128 units of x][8 tiles / 3 units of (step, sums)]
    [warps x GEMV_PIPE_TILES_PER_WARP tile-groups of 136 units], 16 bytes a unit, or the
    end's reduction ([block rows][8 tiles] f32) where that is more. 142,080 / 160,896 /
    179,712 bytes at n6 / n9 / n12, 8 warps, 3 stages, 2 tiles per warp."""
    block_tiles = warps * GEMV_PIPE_TILES_PER_WARP
    stage = tiles * 128 + 8 * tiles // 3 + block_tiles * _TILE_UNITS
    return max(16 * GEMV_PIPE_STAGES * stage, 4 * block_tiles * GEMV_MMA_ROWS * 8 * tiles)


def gemv_f16_fills_sms(row_tiles: int, sms: int) -> bool:
    """Whether gemv_f16's 128-row blocks (8 tiles of 16 rows) number at least one per SM:
    then the launch takes no group split, since the split's partial sums and the last
    block's re-read only cost there, and 4 warps of 2 tiles. H200 (132 SMs), 28672 x 4096, kernel
    alone, µs, HFQ4 / MQ4 V2: batch 32 45.5 / 47.7 (4 warps of 1 tile, 2 splits) -> 41.4 /
    43.8 (8 warps of 1 tile, unsplit); batch 16 35.3 / 37.4 -> 30.8 / 32.1 (docs/kernels.md,
    "f16-activation GEMV"); then 4 warps of 2 tiles (each x fragment feeds two tiles' mmas),
    with the ring of 6 half groups (PKV_GEMV_F16_PREFETCH), batch 32: 55.2 / 57.8 -> 40.3 /
    41.2, batch 16: 30.9 / 31.7 -> 30.0 / 30.4 (2026-12-05, `python hip/tune.py gemvf16`;
    with the ring of 4, batch 16 MQ4 V2 had been 38.9 that way).
    Unsplit, each output adds its groups in order, as every unsplit launch of the kernel
    does. Below that (6144 rows: 48 blocks) the split pays. Measured at 1.7 blocks per SM
    (224 on 132); the threshold of one per SM, where every SM has a block without a split,
    is the rule's choice, not a measured optimum."""
    return row_tiles >= GEMV_MMA_MAX_WARPS * sms



def gemv_f16_shared_bytes(n_tiles: int) -> int:
    """Dynamic shared bytes per block of the f16-activation GEMV (gemv_f16's ring):
    GEMV_F16_X_STAGES slots of [8 n_tiles batch rows x 32 units of f16 x][8 n_tiles units of
    (step, sums)], 16 bytes a unit: 33,792 bytes at 2 slots and 4 n-tiles (above 48 KiB the
    launcher opts in). Any warps and tiles per warp: the kernel's end stores its sums from
    the registers, not through shared memory."""
    return 16 * GEMV_F16_X_STAGES * 8 * n_tiles * 33


def _launch_text(kernel, grid: tuple[int, ...], block: tuple[int, ...]) -> str:
    """``"<kernel> <grid> x <threads>"`` (grid dimensions joined by ``x``)."""
    return f"{kernel.name} {'x'.join(str(n) for n in grid)} x {block[0]}"


def fused_x_grid(kernel: str, M: int, K: int, warps: int | None = None) -> tuple[int, int]:
    """(blocks, warps per block) of ``kernel``'s fused-x GEMV: a block per
    :data:`GEMV_X_ROW_TILES` (HFQ4G256, MQ4G256V2) or :data:`GEMV_X_ROW_TILES_WIDE`
    (HFQ6G256, Q8F16) 16-row tiles, its warps splitting the groups unless ``warps``: the
    warps the two-launch kernel takes for the same M x K (:func:`_mma_warps` on the 16-row
    tiles), since the warps' partial sums meet in an order set by how many there are, and
    y is the two launches' bit for bit only at equal warps (a decode step fused or not must
    give the same logits). The ctypes :class:`Gemv` and the MLX CUDA launcher share it."""
    tiles = GEMV_X_ROW_TILES_WIDE if kernel in _WIDE_MMA_KERNELS else GEMV_X_ROW_TILES
    row_tiles = math.ceil(M / GEMV_MMA_ROWS)
    return math.ceil(row_tiles / tiles), warps or _mma_warps(row_tiles, K // 256)


def fused_x_by_default(kernel: str, rotated: bool, batch: int) -> bool:
    """Whether a batch 1-2 tensor-core GEMV of ``kernel`` (``hfq4g256`` for MQ4G256's bytes
    too) prepares x in the GEMV launch unless told: ``PAGEDKV_GEMV_FUSED_X`` where set,
    else batch 1 of :data:`GEMV_FUSED_X_KERNELS` with x not rotated (see there). The ctypes
    :class:`Gemv` and the MLX CUDA launcher ask the same question."""
    default = batch == 1 and not rotated and kernel in GEMV_FUSED_X_KERNELS
    return bool(env_bool(FUSED_X_ENV, default))


class _KernelChoice(NamedTuple):
    """Which kernel a :class:`Gemv` runs: ``Gemv.__init__``'s switches, checked."""

    tensor_cores: bool  # the int8 / f16 matrix-unit path, else the f32 kernel
    f16: bool  # gemv_f16
    wide: bool  # the batch 9-32 int8 kernels on NVIDIA (staged or pipelined)
    pipe: bool  # ... the pipelined one
    most_splits: int  # the most group splits of the batch 9-32 kernel chosen
    fused: bool = False  # run() is the fused-x kernel (batch 1-2 on NVIDIA)


def _choose_kernel(device: Device, f: _WeightFormat, batch: int, warps: int | None,
                   pipe: bool | None, splits: int | None,
                   f16_x: bool | None, K: int = 256,
                   wide_mma: bool | None = None, fused_x: bool | None = None) -> _KernelChoice:
    """The kernel for ``Gemv(device, f, M, K, batch, warps=, pipe=, splits=, f16_x=)`` (see
    there), or :class:`InvalidArgument` naming a switch this device or batch cannot honour."""
    # the tensor-core kernels take whole 256-groups of K (Q8F16's K may be any multiple of 32)
    tensor_cores = _uses_tensor_cores(device, f, wide_mma) and K % 256 == 0
    if wide_mma and (f.kernel not in _WIDE_MMA_KERNELS or not tensor_cores):
        raise InvalidArgument(_wide_mma_refusal(device, f, K))
    # batch 9-32 on NVIDIA (more n-tiles than gemv_mma's): the staged or pipelined kernel
    wide = (tensor_cores and math.ceil(3 * batch / 8) > GEMV_MMA_MAX_TILES
            and device.backend == "cuda")
    if f16_x is not None:
        use_f16 = f16_x
    else:
        use_f16 = pipe is None and bool(env_bool(
            F16X_ENV, batch > GEMV_MAX_BATCH and not env_bool(PIPE_ENV, False)))
    if use_f16 and not (tensor_cores and device.backend == "cuda" and f.kernel in _MMA_KERNELS):
        if f16_x:
            raise InvalidArgument(
                f"f16_x=True: the f16-activation GEMV runs {list(_MMA_KERNELS)} on NVIDIA "
                f"sm_80+; this is {f.name} on {getattr(device.properties, 'arch', '?')}")
        use_f16 = False  # the variable asks for it where it exists
    if use_f16 and pipe:
        raise InvalidArgument("pipe=True and f16_x=True: the pipelined kernel is an int8 "
                              "one; choose one of them")
    wide = wide and not use_f16
    # the pipelined kernel exists for the 4-bit formats; HFQ6G256 / Q8F16 run the staged one
    use_pipe = wide and f.kernel in _MMA_KERNELS and (
        pipe if pipe is not None else env_bool(PIPE_ENV, False))
    if pipe and not use_pipe:
        raise InvalidArgument(f"pipe=True: the pipelined GEMV runs batch 9-32 of "
                              f"{list(_MMA_KERNELS)} on NVIDIA sm_80+; this is batch={batch} "
                              f"of {f.name} on {getattr(device.properties, 'arch', '?')}")
    if use_pipe:  # where the ring does not fit (sm_80 at n12, sm_86/89), the staged kernel
        need = pipe_shared_bytes(_pipe_tiles(batch), warps or GEMV_MMA_MAX_WARPS)
        limit = _optin_shared_bytes(device)
        if pipe and need > limit:
            raise InvalidArgument(
                f"pipe=True: the pipelined GEMV needs {need} bytes of shared memory per "
                f"block, {device.properties.name} ({device.properties.arch}) allows "
                f"{limit}; use fewer warps, or pipe=None")
        use_pipe = need <= limit
    most_splits = (GEMV_F16_MAX_SPLITS if use_f16 else
                   GEMV_PIPE_MAX_SPLITS if use_pipe else GEMV_STAGED_MAX_SPLITS)
    if splits is not None and (not (wide or use_f16) or not 1 <= splits <= most_splits):
        kind = "f16" if use_f16 else "pipelined" if use_pipe else "staged"
        raise InvalidArgument(f"splits={splits}: expected 1..{most_splits} (the {kind} "
                              f"batch 9-32 kernel on NVIDIA only)")
    # the fused-x kernel: gemv_mma's one n-tile (batch 1-2) on NVIDIA
    fusable = (tensor_cores and device.backend == "cuda" and not (use_f16 or wide)
               and math.ceil(3 * batch / 8) == 1)
    if fused_x and not fusable:
        raise InvalidArgument(
            f"fused_x=True: the fused-x GEMV runs the int8 tensor-core kernel at batch 1-2 on "
            f"NVIDIA sm_80+ (not the f16-activation one); this is batch={batch} of {f.name} on "
            f"{getattr(device.properties, 'arch', '?')}{', f16_x' if use_f16 else ''}")
    fused = fusable and (fused_x if fused_x is not None
                         else fused_x_by_default(f.kernel, f.rotated, batch))
    return _KernelChoice(tensor_cores, use_f16, wide, bool(use_pipe), most_splits, fused)


def _optin_shared_bytes(device: Device) -> int:
    """Shared bytes per block a kernel may opt in to on ``device`` (0 where unknown)."""
    props = device.properties
    return max(getattr(props, "max_shared_memory_per_block_optin_bytes", 0),
               getattr(props, "max_shared_memory_per_block_bytes", 0))


#: The opt-in variable of the never-run AMD matrix-core GEMV, per unit (amd_matrix_unit).
_GEMV_AMD_OPT_IN = {"mfma": "PAGEDKV_GEMV_MFMA", "wmma": "PAGEDKV_GEMV_WMMA"}


def _wide_mma_refusal(device: Device, f: _WeightFormat, K: int) -> str:
    """Why ``wide_mma=True`` cannot run on ``device``: the first missing piece, and how to
    supply it where a switch can."""
    arch = getattr(device.properties, "arch", "?")
    where = (f"{list(_WIDE_MMA_KERNELS)} with K a multiple of 256 on NVIDIA sm_80+, AMD "
             f"gfx908/gfx90a/gfx940-942 (PAGEDKV_GEMV_MFMA=1) or gfx11 (PAGEDKV_GEMV_WMMA=1)")
    unit = amd_matrix_unit(device)
    if f.kernel in _WIDE_MMA_KERNELS and K % 256 == 0 and unit is not None:
        return (f"wide_mma=True: the {unit.upper()} GEMV on {arch} is opt-in until an AMD "
                f"device run vouches for it (docs/kernels.md, \"AMD matrix cores\"); set "
                f"{_GEMV_AMD_OPT_IN[unit]}=1")
    return (f"wide_mma=True: the int8 tensor-core GEMV runs {where}; this is {f.name}, K={K} "
            f"on {arch}")


def _uses_tensor_cores(device: Device, f: _WeightFormat, wide_mma: bool | None = None) -> bool:
    """The int8 matrix-unit GEMV, 4-bit formats: NVIDIA compute capability 8.0 and newer
    (mma.sync); AMD CDNA (MFMA: gfx908, gfx90a, gfx940-942) and RDNA3 (WMMA: gfx11), both
    compile-checked and emulated only (docs/kernels.md, "AMD matrix cores"): opt-in with
    ``PAGEDKV_GEMV_MFMA=1`` / ``PAGEDKV_GEMV_WMMA=1`` until an AMD device run vouches for
    them. RDNA2 and RDNA4 (gfx10, gfx12) run the CUDA-core kernel. HFQ6G256 and Q8F16 (batch
    1-32): where the 4-bit formats take it (on AMD: its unit's opt-in on), unless the wide
    switch says no: ``wide_mma`` False, or None and ``PAGEDKV_GEMV_MMA_HFQ6_Q8F16=0``."""
    backend = getattr(device, "backend", None)
    wide = f.kernel in _WIDE_MMA_KERNELS
    if backend not in ("cuda", "hip") or not (wide or f.kernel in _MMA_KERNELS):
        return False
    if wide and not (env_bool(WIDE_MMA_ENV, True) if wide_mma is None else wide_mma):
        return False
    arch = device.properties.arch  # "sm_90", "gfx90a"
    if backend == "hip":  # weights.hip builds gemv_amd_mc under the gemv_mma names there
        unit = amd_matrix_unit(device)
        return unit is not None and env_bool(_GEMV_AMD_OPT_IN[unit], False)
    return sm_version(arch) >= 80
