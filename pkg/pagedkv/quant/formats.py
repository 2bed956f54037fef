"""Which codec encodes and decodes each quant type (docs/contracts/hfqm-and-quant.md, '1.1
Quant-type register' and '4. Weight codecs').

Group geometry (weights and bytes per group, rotation, the K % 256 rule) comes
from the register, :mod:`pagedkv.quant.qtypes`; this table only adds what the
codecs need on top of it: the codec family and the code width in bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedkv.errors import (
    InvalidArgument,
    InvalidArgumentType,
    UnknownQuantType,
    UnsupportedQuantType,
)
from pagedkv.quant.affine import AffineFamily
from pagedkv.quant.qtypes import QTYPES, QuantType

__all__ = ["CODECS", "LLOYD", "Codec", "check_k", "resolve"]

RAW = "raw"
AFFINE = "affine"
Q8 = "q8"
LLOYD = "lloyd"


@dataclass(frozen=True, slots=True)
class Codec:
    """A P1 quant type as the codecs see it."""

    qt: QuantType
    kind: str                     # "raw", "affine", "q8" or "lloyd"
    bits: int = 0                 # code width (affine) or element bits (raw)
    family: AffineFamily | None = None

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
        (docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register')."""
        return -(-numel // self.group_size) * self.group_bytes

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
    elif isinstance(fmt, (int, np.integer)) and not isinstance(fmt, (bool, np.bool_)):
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
    raise UnsupportedQuantType(
        f"quant type {qt.name} (qt {qt.id}) is registered but pagedkv does not encode or "
        f"decode it yet (status {qt.status}); implemented: {', '.join(sorted(_BY_NAME))}")


def check_k(codec: Codec, shape: tuple[int, ...]) -> None:
    """V2, MQ4C (and GL) need the last dimension K to be a multiple of 256
    (docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register')."""
    if codec.qt.k_multiple_of_256:
        k = shape[-1] if shape else 1
        if k % 256 != 0:
            raise InvalidArgument(
                f"{codec.name} needs the last dimension K to be a multiple of 256, got shape "
                f"{shape}; use the G128 fallback of docs/contracts/hfqm-and-quant.md, '2.9 Quantizer tensor policy' (e.g. hfq4g128)")
