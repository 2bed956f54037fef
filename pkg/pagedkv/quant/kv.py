"""KV-cache quantization modes: names, record layouts, encode and decode (docs/kv-quant.md).

A *mode* says how one (token, kv-head) row of ``head_dim`` values is stored:

========  =====  ====  ========================  ==========================================
mode      side   bits  rotation                  row bytes
========  =====  ====  ========================  ==========================================
q8        K, V   8     none                      ``head_dim/32 * 34``
fwht4     K, V   4     R128 per 128-half         ``4 + head_dim/2`` (hd 128 or 256)
fwht3     K, V   3     R256                      ``4 + 3*head_dim/8`` (hd 256)
fwht2     K, V   2     R128 per 128-half         ``4 + head_dim/4`` (hd 128 or 256)
lloyd4/3/2 V     4/3/2 R256                      ``4 + head_dim*b/8`` (hd 256)
========  =====  ====  ========================  ==========================================

A pool's *KV dtype* names both sides: ``"float16"``, ``"bfloat16"``, ``"float32"`` or
``"q8"`` for both, or ``"<K mode>/<V mode>"`` (``"fwht4/q8"``, ``"fwht4/lloyd4"``); a rotated
V needs a rotated K; K may also be a lloyd mode and V an fwht mode (pagedkv's extensions,
docs/kv-quant.md "Modes"). :func:`encode` and :func:`decode` take NumPy
arrays (the Cython codecs) or ``mx.array`` (MLX array ops, :mod:`pagedkv.quant.kv_mlx`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.argument_checks import int_argument
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.quant import kv_q8, kv_rotated

__all__ = [
    "KV_MODES",
    "K_MODES",
    "UNQUANTIZED_DTYPES",
    "V_MODES",
    "KVMode",
    "decode",
    "downshift",
    "encode",
    "join_kv_dtype",
    "kv_mode",
    "side_row_bytes",
    "split_kv_dtype",
    "transcode",
]

#: Unquantized pool dtypes and their bytes per element.
UNQUANTIZED_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}
#: K takes the lloyd modes too (pagedkv's extension, docs/kv-quant.md "Modes"): at head_dim
#: 256 they are the R256 quantizer with matched tables (lloyd3 writes fwht3's bytes).
K_MODES = ("q8", "fwht4", "fwht3", "fwht2", "lloyd4", "lloyd3", "lloyd2")
#: V takes the fwht modes too (pagedkv's extension, docs/kv-quant.md "Modes"): the fwhtN
#: K codec's records, bytes and head_dims unchanged (fwht4/fwht2: R128 per half, hd 128 or
#: 256; fwht3: R256, hd 256, lloyd3's bytes), so head_dim 128 has a 4- and 2-bit V.
V_MODES = ("q8", "lloyd4", "lloyd3", "lloyd2", "fwht4", "fwht3", "fwht2")


@dataclass(frozen=True, slots=True)
class KVMode:
    """One KV-cache mode: ``name``, the header's ``id`` (``PKV_KV_MODE_*``), ``sides``
    (``"KV"``, ``"K"`` or ``"V"``: the sides its table family is named for; fwhtN is ``"KV"``
    since V takes it too, lloydN stays ``"V"``), code ``bits`` and ``rotation`` (0, 128 or
    256)."""

    name: str
    id: int
    sides: str
    bits: int
    rotation: int

    @property
    def rotated(self) -> bool:
        return self.rotation != 0

    def supports(self, head_dim: int) -> bool:
        """Whether this mode stores rows of ``head_dim`` values."""
        return kv_rotated.row_bytes(self.id, head_dim) > 0

    def head_dims(self) -> str:
        """The head_dims this mode stores, in words (for error messages)."""
        if self.name == "q8":
            return "a multiple of 32"
        return "128 or 256" if self.rotation == 128 else "256"

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one (token, kv-head) row; ``InvalidArgument`` for a head_dim the mode
        cannot store."""
        n = kv_rotated.row_bytes(self.id, head_dim)
        if n == 0:
            raise InvalidArgument(f"head_dim={head_dim}: KV mode {self.name!r} needs head_dim "
                                  f"{self.head_dims()}")
        return n


def _mode(name: str, sides: str) -> KVMode:
    mid = kv_rotated.MODE_IDS[name]
    return KVMode(name, mid, sides, kv_rotated.mode_bits(mid), kv_rotated.mode_rotation(mid))


#: Every KV mode by name.
KV_MODES: dict[str, KVMode] = {
    "q8": _mode("q8", "KV"),
    **{n: _mode(n, "KV") for n in ("fwht4", "fwht3", "fwht2")},
    **{n: _mode(n, "V") for n in ("lloyd4", "lloyd3", "lloyd2")},
}


def kv_mode(name: str) -> KVMode:
    """The :class:`KVMode` called ``name``; ``InvalidArgument`` naming the valid ones."""
    try:
        return KV_MODES[name]
    except (KeyError, TypeError):
        raise InvalidArgument(f"KV mode {name!r}: expected one of {list(KV_MODES)}") from None


def split_kv_dtype(dtype: str) -> tuple[str, str]:
    """``(k, v)`` of a pool KV dtype: ``"fwht4/lloyd4"`` -> ``("fwht4", "lloyd4")``,
    ``"q8"`` -> ``("q8", "q8")``. Validates the pairing rules (docs/kv-quant.md "Modes")."""
    if not isinstance(dtype, str):
        raise InvalidArgumentType(f"dtype: expected a str, got {type(dtype).__name__}")
    k, sep, v = dtype.partition("/")
    if not sep:
        if dtype in UNQUANTIZED_DTYPES or dtype == "q8":
            return dtype, dtype
        hint = (f"; name both sides, e.g. "
                f"{dtype + '/q8' if dtype.startswith('fwht') else 'fwht4/' + dtype!r}"
                if dtype in KV_MODES else "")
        raise InvalidArgument(f"dtype {dtype!r} is not a pool dtype; use one of "
                              f"{sorted(UNQUANTIZED_DTYPES) + ['q8']} or '<K mode>/<V mode>' "
                              f"with K in {list(K_MODES)} and V in {list(V_MODES)}{hint}")
    if k not in K_MODES or v not in V_MODES:
        raise InvalidArgument(f"dtype {dtype!r}: K must be one of {list(K_MODES)} and V one "
                              f"of {list(V_MODES)}")
    if v != "q8" and k == "q8":
        raise InvalidArgument(f"dtype {dtype!r}: a rotated V ({v}) needs a rotated K (fwht4, "
                              f"fwht3, fwht2 or lloydN): the compressed attention kernels "
                              f"score a rotated K")
    return k, v


def join_kv_dtype(k: str, v: str) -> str:
    """The pool KV dtype of a K and a V side (``"q8"`` when both are q8)."""
    name = k if k == v and (k == "q8" or k in UNQUANTIZED_DTYPES) else f"{k}/{v}"
    split_kv_dtype(name)
    return name


def side_row_bytes(side_dtype: str, head_dim: int) -> int:
    """Bytes of one (token, kv-head) row of one side stored as ``side_dtype`` (an
    unquantized dtype or a mode name)."""
    head_dim = int_argument("head_dim", head_dim, 1)
    if side_dtype in UNQUANTIZED_DTYPES:
        return head_dim * UNQUANTIZED_DTYPES[side_dtype]
    return kv_mode(side_dtype).row_bytes(head_dim)


def _is_mlx(x) -> bool:
    return type(x).__module__.startswith("mlx")


def encode(x: Any, mode: str) -> Any:
    """``float32``/``float16[..., head_dim]`` values -> ``uint8[..., row_bytes]`` records of
    ``mode``. NumPy in, NumPy out (Cython codec); ``mx.array`` in, ``mx.array`` out."""
    m = kv_mode(mode)
    if _is_mlx(x):
        from pagedkv.quant import kv_mlx
        return kv_mlx.encode(x, m)
    if m.name == "q8":
        return kv_q8.quantize(x)
    return kv_rotated.encode(x, m.id)


def decode(records: Any, mode: str, head_dim: int, *, rotated: bool = False) -> Any:
    """``uint8[..., row_bytes]`` records of ``mode`` -> ``float32[..., head_dim]``.
    ``rotated=True`` keeps a rotated mode in its rotated basis (``cnorm * C[codes]``)."""
    m = kv_mode(mode)
    head_dim = int_argument("head_dim", head_dim, 1)
    m.row_bytes(head_dim)
    if _is_mlx(records):
        from pagedkv.quant import kv_mlx
        return kv_mlx.decode(records, m, head_dim, rotated=rotated)
    if m.name == "q8":
        return kv_q8.dequantize(records, head_dim)
    return kv_rotated.decode(records, m.id, head_dim, rotated=bool(rotated))


def downshift(records: np.ndarray, src: str, dst: str, head_dim: int) -> np.ndarray:
    """Re-code rotated records to a narrower mode of the same table family without
    decoding (fwht4 -> fwht2, lloyd4 -> lloyd3 -> lloyd2); docs/kv-quant.md "kv_adaptive"."""
    return kv_rotated.downshift(records, kv_mode(src).id, kv_mode(dst).id, head_dim)


def transcode(records: Any, src: str, dst: str, head_dim: int) -> Any:
    """Records of ``src`` as records of ``dst``: a downshift within a table family, or
    decode + fresh encode (q8 -> lloyd4, the first V step of kv_adaptive)."""
    head_dim = int_argument("head_dim", head_dim, 1)  # every branch, not only decode's
    s, d = kv_mode(src), kv_mode(dst)
    if s.name == d.name:
        return records
    if s.rotated and d.rotated and s.rotation == d.rotation and s.sides == d.sides:
        if _is_mlx(records):
            from pagedkv.quant import kv_mlx
            return kv_mlx.downshift(records, s, d, head_dim)
        return downshift(records, src, dst, head_dim)
    if s.name == "q8":
        return encode(decode(records, src, head_dim), dst)
    raise InvalidArgument(f"transcode {src} -> {dst}: supported are q8 -> any mode and "
                          f"narrowing within one table family (fwht4 -> fwht2, lloyd4 -> "
                          f"lloyd3 -> lloyd2)")
