"""Which codec encodes and decodes each quant type (docs/contracts/hfqm-and-quant.md, '1.1
Quant-type register' and '4. Weight codecs').

Group geometry (weights and bytes per group, rotation, the K % 256 rule) comes
from the register, :mod:`pagedkv.quant.qtypes`; this table only adds what the
codecs need on top of it: the codec family and the code width in bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.errors import (
    InvalidArgument,
    InvalidArgumentType,
    UnknownQuantType,
    UnsupportedQuantType,
)
from pagedkv.quant.affine import AffineFamily
from pagedkv.quant.qtypes import QTYPES, QuantType

__all__ = ["CODECS", "FP4", "GL", "LLOYD", "MQ8", "Q4F16G64", "Q4K", "Q8HFQ", "TERNARY",
           "Codec", "check_k", "resolve"]

RAW = "raw"
AFFINE = "affine"
Q8 = "q8"
LLOYD = "lloyd"
# P2 formats (docs/formats/quant.md, "P2 formats")
FP4 = "fp4"            # HFP4G32, MFP4G32, MFP4G32P: rows of a 16 B header + 17 B blocks
GL = "gl"              # MQ2G256GL, MQ3G256GL: structure-of-arrays groups
MQ8 = "mq8"            # MQ8G256
Q8HFQ = "q8hfq"        # rows of scales, codes, padding
Q4F16G64 = "q4f16g64"
Q4K = "q4k"            # GGML Q4_K (ggml's reference encoder, no importance matrix)
TERNARY = "ternary"    # TQ2G128, BQ1G128, decode only

#: Quant types pagedkv does not decode, and what is missing (the UnsupportedQuantType text).
UNSUPPORTED_WHY: dict[int, str] = {
    28: "PARO4G128 stores an AWQ 4-bit matrix for activations rotated by learned pairwise "
        "Givens rotations (pairs, theta) and channel scales; the order of those operations "
        "and the rotation's pair convention are not specified well enough to fold them into "
        "a weight decode, and pagedkv has no GEMV that rotates x that way",
    29: "PARO4G128T is PARO4G128 tiled for one engine's kernels; its tiling is not specified",
    32: "MFP4G32Lloyd's 32-byte per-tensor codebook has no published meaning (entry width, "
        "order, how it replaces the E2M1 table)",
    34: "the E8-lattice formats (qt 34-37) have no published wire format",
    35: "the E8-lattice formats (qt 34-37) have no published wire format",
    36: "the E8-lattice formats (qt 34-37) have no published wire format",
    37: "the E8-lattice formats (qt 34-37) have no published wire format",
    130: "qt 130 is a calibration Hessian (a .calib.hfq side file), not a weight: read its raw "
         "bytes (K f32 diagonal, then the strict lower triangle as truncated bf16)",
}


@dataclass(frozen=True, slots=True)
class Codec:
    """A P1 quant type as the codecs see it."""

    qt: QuantType
    kind: str                     # "raw", "affine", "q8", "lloyd" or a P2 kind above
    bits: int = 0                 # code width (affine) or element bits (raw)
    family: AffineFamily | None = None
    encodes: bool = True          # False: decode only (TQ2G128, BQ1G128)
    row_multiple: int = 0         # row formats (FP4, Q8HFQ): K must be a multiple of this

    @property
    def name(self) -> str:
        """Lower-case qt name, e.g. ``"mq4g256v2"``."""
        return self.qt.key

    @property
    def group_size(self) -> int:
        """Weights per group (1 for raw types)."""
        return self.qt.group_size

    @property
    def group_bytes(self) -> int:
        """Bytes per group (element bytes for raw types)."""
        return self.qt.group_bytes

    @property
    def rotated(self) -> bool:
        """Stored after the FWHT-256 rotation (docs/contracts/hfqm-and-quant.md, '3.6 FWHT
        rotation')."""
        return self.qt.rotated

    @property
    def affine_family(self) -> AffineFamily:
        """The family of an affine codec (raw and Q8 codecs have none)."""
        assert self.family is not None, f"{self.name} is not an affine codec"
        return self.family

    def nbytes(self, numel: int) -> int:
        """Payload bytes of ``numel`` weights: ``ceil(numel / G) * B``
        (docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register'). Row formats
        (``row_multiple``) depend on K too: use :meth:`payload_nbytes`."""
        return -(-numel // self.group_size) * self.group_bytes

    def payload_nbytes(self, shape: tuple[int, ...]) -> int:
        """Payload bytes of a tensor of ``shape``: the register's size rule (FP4 rows
        ``M·(16 + 17·K/32)``, Q8HFQ rows ``M·round_up(2·K/32 + K, 128)``, else
        :meth:`nbytes`)."""
        if self.row_multiple:
            from pagedkv.quant.qtypes import expected_nbytes
            nbytes = expected_nbytes(self.qt, shape)
            assert nbytes is not None
            return nbytes
        numel = 1
        for d in shape:
            numel *= d
        return self.nbytes(numel)

    def __repr__(self) -> str:
        return (f"<Codec {self.name} (qt {self.qt.id}): {self.kind}, {self.bits} bits, "
                f"G={self.group_size}, B={self.group_bytes}{', rotated' if self.rotated else ''}>")


def _affine(qt_id: int, family: AffineFamily, bits: int) -> Codec:
    qt = QTYPES[qt_id]
    # the register and the codec must agree on the group size (8 B header + codes)
    assert qt.group_bytes == 8 + bits * qt.group_size // 8, qt
    return Codec(qt, AFFINE, bits, family)


HFQ, MQ_V1, MQ_V2, MQ4C = (AffineFamily.HFQ, AffineFamily.MQ_V1, AffineFamily.MQ_V2,
                           AffineFamily.MQ4C)

#: Every quant type pagedkv encodes and decodes, by qt id.
CODECS: dict[int, Codec] = {c.qt.id: c for c in (
    Codec(QTYPES[1], RAW, 16),          # F16
    Codec(QTYPES[2], RAW, 32),          # F32
    Codec(QTYPES[16], RAW, 16),         # BF16
    Codec(QTYPES[3], Q8, 8),            # Q8F16
    _affine(6, HFQ, 4), _affine(7, HFQ, 4), _affine(8, HFQ, 6),
    _affine(9, HFQ, 2), _affine(10, HFQ, 2), _affine(11, HFQ, 3), _affine(12, HFQ, 3),
    _affine(13, MQ_V1, 4), _affine(15, MQ_V1, 6), _affine(17, MQ_V1, 3),
    _affine(18, MQ_V1, 2), _affine(31, MQ_V1, 5),
    _affine(44, MQ_V2, 4), _affine(47, MQ_V2, 6), _affine(48, MQ_V2, 5),
    _affine(49, MQ_V2, 3), _affine(50, MQ_V2, 2),
    _affine(45, MQ4C, 4),
    Codec(QTYPES[19], LLOYD, 2), Codec(QTYPES[20], LLOYD, 3), Codec(QTYPES[30], LLOYD, 4),
    Codec(QTYPES[51], LLOYD, 2),  # MQ2G256LloydU: qt 19's bytes, not rotated
    Codec(QTYPES[21], FP4, 4, row_multiple=32),     # HFP4G32
    Codec(QTYPES[24], FP4, 4, row_multiple=256),    # MFP4G32
    Codec(QTYPES[33], FP4, 4, row_multiple=256),    # MFP4G32P
    Codec(QTYPES[38], GL, 2), Codec(QTYPES[39], GL, 3),
    Codec(QTYPES[14], MQ8, 8),
    Codec(QTYPES[5], Q8HFQ, 8, row_multiple=32),
    Codec(QTYPES[0], Q4F16G64, 4),
    Codec(QTYPES[4], Q4K, 4),
    Codec(QTYPES[40], TERNARY, 2, encodes=False), Codec(QTYPES[41], TERNARY, 1, encodes=False),
)}

_BY_NAME: dict[str, Codec] = {c.name: c for c in CODECS.values()}
_REGISTER_BY_NAME: dict[str, QuantType] = {q.key: q for q in QTYPES.values() if q.registered}


def resolve(fmt: str | int | np.integer) -> Codec:
    """The codec of a format given as lower-case qt name (``"hfq4g256"``) or qt id (``6``).

    Raises :class:`~pagedkv.errors.UnknownQuantType` for a name or id that is not
    in the register (or is reserved), :class:`~pagedkv.errors.UnsupportedQuantType`
    for a registered qt pagedkv does not encode or decode yet (P2, refuse),
    :class:`~pagedkv.errors.InvalidArgumentType` for anything but ``str``/``int``.
    """
    if isinstance(fmt, str):
        key = fmt.lower()
        codec = _BY_NAME.get(key)
        if codec is not None:
            return codec
        qt = _REGISTER_BY_NAME.get(key)
        if qt is None:
            raise UnknownQuantType(
                f"unknown quant format {fmt!r}; implemented formats: "
                f"{', '.join(sorted(_BY_NAME))} (or their qt ids)")
    elif is_int(fmt):
        codec = CODECS.get(int(fmt))
        if codec is not None:
            return codec
        qt = QTYPES.get(int(fmt))
        if qt is None or not qt.registered:
            raise UnknownQuantType(
                f"quant type id {int(fmt)} is not in the register (docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register'); "
                f"implemented ids: {', '.join(str(i) for i in sorted(CODECS))}")
    else:
        raise InvalidArgumentType(
            f"fmt must be a quant format name (str) or qt id (int), got "
            f"{type(fmt).__name__} {fmt!r}")
    why = UNSUPPORTED_WHY.get(qt.id, f"status {qt.status}")
    raise UnsupportedQuantType(
        f"quant type {qt.name} (qt {qt.id}) is registered but pagedkv does not decode it: "
        f"{why}; its raw bytes stay readable (HfqmFile.raw); implemented: "
        f"{', '.join(sorted(_BY_NAME))}")


def check_k(codec: Codec, shape: tuple[int, ...]) -> None:
    """V2, MQ4C (and GL) need the last dimension K to be a multiple of 256
    (docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register'); the row formats a
    positive multiple of their ``row_multiple`` (HFP4G32, Q8HFQ 32; MFP4G32, MFP4G32P 256:
    docs/formats/quant.md, "P2 formats")."""
    if codec.row_multiple:
        k = shape[-1] if shape else 1
        numel = 1
        for d in shape:
            numel *= d
        if numel and (k % codec.row_multiple or k // 32 > 65535):
            raise InvalidArgument(
                f"{codec.name} stores rows of K weights with K a multiple of "
                f"{codec.row_multiple}{' (at most 2097120)' if codec.kind == FP4 else ''}, got "
                f"shape {shape}")
        return
    if codec.qt.k_multiple_of_256:
        k = shape[-1] if shape else 1
        if k % 256 != 0:
            raise InvalidArgument(
                f"{codec.name} needs the last dimension K to be a multiple of 256, got shape "
                f"{shape}; use the G128 fallback of docs/contracts/hfqm-and-quant.md, '2.9 Quantizer tensor policy' (e.g. hfq4g128)")
