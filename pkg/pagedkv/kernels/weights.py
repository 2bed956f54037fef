"""Launchers for ``hip/weights.hip``: weight dequantization, fused dequant-GEMV, FWHT-256.

Formats: ``hfq4g256``, ``mq4g256`` (HFQ4 bytes of rotated weights), ``mq4g256v2``,
``hfq6g256``, ``q8f16``. Kernels emit rotated formats in their stored (rotated)
basis, like ``pagedkv.quant.dequantize(..., basis="rotated")``; the GEMV of a
rotated format rotates ``x`` once (FWHT-256 per 256-segment), then runs the
plain affine GEMV, which equals ``W·x`` in the original basis (§3.6).
"""

from __future__ import annotations

import math

import numpy as np

from pagedkv.errors import InvalidArgument
from pagedkv.kernels.device import Device, Stream
from pagedkv.kernels.device_array import DeviceArray
from pagedkv.kernels.kvcache import _need

__all__ = ["WEIGHT_FORMATS", "raw_nbytes", "dequantize", "fwht256", "Gemv"]

SOURCE = "weights"
GEMV_THREADS = 128
GEMV_BATCHES = (1, 2, 4, 8)


class _WeightFormat:
    __slots__ = ("name", "kernel", "group_size", "group_bytes", "rotated")

    def __init__(self, name, kernel, group_size, group_bytes, rotated):
        self.name, self.kernel, self.rotated = name, kernel, rotated
        self.group_size, self.group_bytes = group_size, group_bytes

    def __repr__(self) -> str:
        return f"WeightFormat({self.name!r}, G={self.group_size}, B={self.group_bytes})"


WEIGHT_FORMATS = {f.name: f for f in (
    _WeightFormat("hfq4g256", "hfq4g256", 256, 136, False),
    _WeightFormat("mq4g256", "hfq4g256", 256, 136, True),
    _WeightFormat("mq4g256v2", "mq4g256v2", 256, 136, True),
    _WeightFormat("hfq6g256", "hfq6g256", 256, 200, False),
    _WeightFormat("q8f16", "q8f16", 32, 34, False),
)}


def _format(fmt: str | int) -> _WeightFormat:
    # the same spellings as pagedkv.quant: a qt name in any case, or a qt id
    from pagedkv.quant.formats import resolve
    f = WEIGHT_FORMATS.get(resolve(fmt).name)
    if f is None:
        raise InvalidArgument(f"fmt={fmt!r}: the GPU kernels take {list(WEIGHT_FORMATS)}")
    return f


def raw_nbytes(fmt: str | int, numel: int) -> int:
    """Bytes of a tensor of ``numel`` weights in ``fmt`` (last group padded)."""
    f = _format(fmt)
    return math.ceil(numel / f.group_size) * f.group_bytes


def _raw(raw, fmt: _WeightFormat, numel: int) -> None:
    _need(raw, "raw", np.uint8)
    want = raw_nbytes(fmt.name, numel)
    if raw.nbytes != want:
        raise InvalidArgument(f"raw: {raw.nbytes} bytes, {fmt.name} of {numel} weights takes "
                              f"{want}")
    if raw.ptr % 8:
        raise InvalidArgument(f"raw: device address 0x{raw.ptr:x} is not 8-byte aligned")


def dequantize(device: Device, raw: DeviceArray, fmt: str | int, out: DeviceArray,
               *, stream: Stream | None = None) -> None:
    """Decode ``raw`` into ``out`` (``float32`` or ``float16``, any shape: its size is the
    weight count; groups run over the flattened tensor)."""
    f = _format(fmt)
    if out.dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise InvalidArgument(f"out: dtype {out.dtype}, expected float32 or float16")
    n = out.size
    _raw(raw, f, n)
    if n == 0:
        return
    suffix = "f32" if out.dtype == np.float32 else "f16"
    k = device.kernel(SOURCE, f"pkv_dequant_{f.kernel}_{suffix}", "ppq")
    k((math.ceil(n / (16 * 256)),), (256,), raw, out, n, stream=stream)  # 16 weights a thread


def fwht256(device: Device, x: DeviceArray, out: DeviceArray,
            *, stream: Stream | None = None) -> None:
    """``out`` = FWHT-256 of each 256-segment of ``x`` (``float32``, size a multiple of 256;
    ``out`` may be ``x``). Bit-exact with ``pagedkv.quant.fwht256``."""
    _need(x, "x", np.float32)
    _need(out, "out", np.float32)
    if x.size % 256 or out.size != x.size:
        raise InvalidArgument(f"x/out: sizes {x.size}/{out.size}, expected equal multiples "
                              f"of 256")
    groups = x.size // 256
    if groups == 0:
        return
    warps_per_block = 256 // device.properties.warp_size
    k = device.kernel(SOURCE, "pkv_fwht256_f32", "ppq")
    k((math.ceil(groups / warps_per_block),), (256,), x, out, groups, stream=stream)


class Gemv:
    """``y[b] = W · x[b]`` for ``W`` of shape ``[M, K]`` in ``fmt`` and ``batch`` (1–8)
    activations: ``x`` ``float32[batch, K]``, ``y`` ``float32[batch, M]``. ``K`` must be a
    multiple of the group size (every row starts a group). Rotated formats keep a
    ``[batch, K]`` scratch for the rotated ``x``."""

    def __init__(self, device: Device, fmt: str | int, M: int, K: int, batch: int = 1) -> None:
        self.fmt = f = _format(fmt)
        if M < 1 or K < 1 or K % f.group_size or K % 32:
            raise InvalidArgument(f"M={M}, K={K}: need M >= 1 and K a positive multiple of "
                                  f"{max(f.group_size, 32)} for {f.name}")
        if not 1 <= batch <= 8:
            raise InvalidArgument(f"batch={batch}: expected 1..8")
        self.device, self.M, self.K, self.batch = device, M, K, batch
        bmax = next(b for b in GEMV_BATCHES if b >= batch)
        self._kernel = device.kernel(SOURCE, f"pkv_gemv_{f.kernel}_b{bmax}", "pppiii")
        self._scratch = device.empty((batch, K), np.float32) if f.rotated else None
        rows = 8 if bmax <= 2 else 4  # GEMV_ROWS_FOR in weights.hip
        self._grid = (math.ceil(M / rows),)  # a block per `rows` rows; its threads split K

    def __repr__(self) -> str:
        return f"Gemv({self.fmt.name!r}, M={self.M}, K={self.K}, batch={self.batch})"

    @property
    def weight_bytes(self) -> int:
        return raw_nbytes(self.fmt.name, self.M * self.K)

    def run(self, w: DeviceArray, x: DeviceArray, y: DeviceArray,
            *, stream: Stream | None = None, x_rotated: bool = False) -> None:
        """``y = W·x``. For a rotated format, ``x_rotated=True`` says ``x`` already holds
        the rotated activations (one rotation shared by several GEMVs on the same x)."""
        _raw(w, self.fmt, self.M * self.K)
        _need(x, "x", np.float32)
        _need(y, "y", np.float32)
        if x.shape != (self.batch, self.K) or y.shape != (self.batch, self.M):
            raise InvalidArgument(f"x/y: shapes {x.shape}/{y.shape}, expected "
                                  f"{(self.batch, self.K)}/{(self.batch, self.M)}")
        xin = x
        if self._scratch is not None and not x_rotated:
            fwht256(self.device, x, self._scratch, stream=stream)
            xin = self._scratch
        self._kernel(self._grid, (GEMV_THREADS,), w, xin, y, self.M, self.K, self.batch,
                     stream=stream)
