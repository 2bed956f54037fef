"""The quant-type (qt) register of docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register', as
Python data.

One row per registered or reserved id. The same table exists once in C
(``PKV_QT_LIST`` in ``pagedkv/hfqm.h``); ``tests/test_quant_qtypes.py`` checks
every id of both against each other, so edit both together.

Vocabulary:

* ``name``: upstream spelling (``"MQ4G256V2"``); ``key``: its lower-case form
  (``"mq4g256v2"``), the format name the codecs and the CLI accept.
* ``group_size`` (G): weights per group; 1 for the raw types, 0 where
docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register'
  gives none. ``group_bytes`` (B): bytes per group (element bytes for raw types).
* ``size_rule``: how a tensor's payload size follows from its shape
  (:func:`expected_nbytes`).
* ``status``: ``"p1"`` decoded by pagedkv now; ``"p2"`` registered, raw bytes
  only for now; ``"refuse"`` registered, no wire spec (raw bytes only);
  ``"reserved"`` never assigned (a file using it fails at open);
  ``"calib"`` only valid inside a ``*.calib.hfq`` file.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = [
    "QTYPES",
    "SIZE_RULES",
    "STATUSES",
    "QuantType",
    "expected_nbytes",
    "is_registered",
    "qtype",
]

SIZE_RULES = ("none", "groups", "row_header", "row_pad128", "hessian")
STATUSES = ("unknown", "p1", "p2", "refuse", "reserved", "calib")


@dataclass(frozen=True, slots=True)
class QuantType:
    """One row of the quant-type register (docs/contracts/hfqm-and-quant.md, '1.1 Quant-type
    register')."""

    id: int
    name: str
    group_size: int
    group_bytes: int
    size_rule: str
    status: str
    rotated: bool = False
    k_multiple_of_256: bool = False
    raw_dtype: str | None = None  # NumPy dtype of a raw qt's elements ("uint16" = bf16 bits)

    @property
    def key(self) -> str:
        """Lower-case name: the format name the codecs and CLI accept."""
        return self.name.lower()

    @property
    def decodable(self) -> bool:
        """True where pagedkv decodes this qt now (P1)."""
        return self.status == "p1"

    @property
    def registered(self) -> bool:
        """True where a file may use this id (reserved ids fail at open)."""
        return self.status in ("p1", "p2", "refuse", "calib")

    @property
    def index_group_size(self) -> int:
        """The ``group_size`` writers store in the index: G, or 0 for raw types
        (docs/contracts/hfqm-and-quant.md, '2.1 Header (32 bytes) and body')."""
        return self.group_size if self.group_size > 1 else 0

    def __repr__(self) -> str:
        geometry = (f"G={self.group_size}, B={self.group_bytes}" if self.group_size
                    else "no fixed group")
        return f"<qt {self.id} {self.name}: {geometry}, {self.size_rule}, {self.status}>"


def _row(qt_id: int, name: str, g: int, b: int, rule: str, status: str, *,
         rot: bool = False, k256: bool = False, raw: str | None = None) -> QuantType:
    return QuantType(qt_id, name, g, b, rule, status, rot, k256, raw)


_ROWS: tuple[QuantType, ...] = (
    _row(0, "Q4F16G64", 64, 36, "groups", "p2"),
    _row(1, "F16", 1, 2, "groups", "p1", raw="float16"),
    _row(2, "F32", 1, 4, "groups", "p1", raw="float32"),
    _row(3, "Q8F16", 32, 34, "groups", "p1"),
    _row(4, "Q4K", 256, 144, "groups", "p2"),
    _row(5, "Q8HFQ", 32, 34, "row_pad128", "p2"),
    _row(6, "HFQ4G256", 256, 136, "groups", "p1"),
    _row(7, "HFQ4G128", 128, 72, "groups", "p1"),
    _row(8, "HFQ6G256", 256, 200, "groups", "p1"),
    _row(9, "HFQ2G256", 256, 72, "groups", "p1"),
    _row(10, "HFQ2G128", 128, 40, "groups", "p1"),
    _row(11, "HFQ3G256", 256, 104, "groups", "p1"),
    _row(12, "HFQ3G128", 128, 56, "groups", "p1"),
    _row(13, "MQ4G256", 256, 136, "groups", "p1", rot=True),
    _row(14, "MQ8G256", 256, 258, "groups", "p2", rot=True),
    _row(15, "MQ6G256", 256, 200, "groups", "p1", rot=True),
    _row(16, "BF16", 1, 2, "groups", "p1", raw="uint16"),
    _row(17, "MQ3G256", 256, 104, "groups", "p1", rot=True),
    _row(18, "MQ2G256", 256, 72, "groups", "p1", rot=True),
    _row(19, "MQ2G256Lloyd", 256, 72, "groups", "p1", rot=True),
    _row(20, "MQ3G256Lloyd", 256, 112, "groups", "p1", rot=True),
    _row(21, "HFP4G32", 32, 17, "row_header", "p2"),
    _row(22, "TidI32", 1, 4, "groups", "p1", raw="uint32"),
    _row(23, "Reserved23", 0, 0, "none", "reserved"),
    _row(24, "MFP4G32", 32, 17, "row_header", "p2", rot=True),
    _row(25, "Reserved25", 0, 0, "none", "reserved"),
    _row(26, "Reserved26", 0, 0, "none", "reserved"),
    _row(27, "Reserved27", 0, 0, "none", "reserved"),
    _row(28, "PARO4G128", 0, 0, "none", "p2"),
    _row(29, "PARO4G128T", 0, 0, "none", "p2"),
    _row(30, "MQ4G256Lloyd", 256, 160, "groups", "p1", rot=True),
    _row(31, "MQ5G256", 256, 168, "groups", "p1", rot=True),
    _row(32, "MFP4G32Lloyd", 0, 0, "none", "p2", rot=True),
    _row(33, "MFP4G32P", 32, 17, "row_header", "p2", rot=True),
    _row(34, "MFP4G32E8", 0, 0, "none", "refuse", rot=True),
    _row(35, "MFP4G32E8SOA", 0, 0, "none", "refuse", rot=True),
    _row(36, "MFP3G32E8", 0, 0, "none", "refuse", rot=True),
    _row(37, "MFP2G32E8", 0, 0, "none", "refuse", rot=True),
    _row(38, "MQ2G256GL", 256, 66, "groups", "p2", rot=True, k256=True),
    _row(39, "MQ3G256GL", 256, 98, "groups", "p2", rot=True, k256=True),
    _row(40, "TQ2G128", 128, 34, "groups", "p2"),
    _row(41, "BQ1G128", 128, 18, "groups", "p2"),
    _row(42, "Reserved42", 0, 0, "none", "reserved"),
    _row(43, "Reserved43", 0, 0, "none", "reserved"),
    _row(44, "MQ4G256V2", 256, 136, "groups", "p1", rot=True, k256=True),
    _row(45, "MQ4CG256", 256, 136, "groups", "p1", rot=True, k256=True),
    _row(46, "Reserved46", 0, 0, "none", "reserved"),
    _row(47, "MQ6G256V2", 256, 200, "groups", "p1", rot=True, k256=True),
    _row(48, "MQ5G256V2", 256, 168, "groups", "p1", rot=True, k256=True),
    _row(49, "MQ3G256V2", 256, 104, "groups", "p1", rot=True, k256=True),
    _row(50, "MQ2G256V2", 256, 72, "groups", "p1", rot=True, k256=True),
    _row(51, "MQ2G256LloydU", 256, 72, "groups", "p1"),
    _row(130, "CalibHessian", 0, 0, "hessian", "calib"),
)

#: Every registered or reserved qt, by id.
QTYPES: dict[int, QuantType] = {row.id: row for row in _ROWS}
_BY_KEY: dict[str, QuantType] = {row.key: row for row in _ROWS}


def qtype(name_or_id: int | str | QuantType) -> QuantType:
    """The register row for a qt id (``44``) or name (``"mq4g256v2"``, any case).

    Reserved ids are returned too (their ``status`` says so); an id or name not
    in the register raises :class:`~pagedkv.errors.InvalidArgument`.
    """
    if isinstance(name_or_id, QuantType):
        return name_or_id
    if isinstance(name_or_id, str):
        row = _BY_KEY.get(name_or_id.lower())
        if row is None:
            raise InvalidArgument(
                f"quant type name {name_or_id!r} is not in the register "
                f"(docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register'); "
                f"valid names: {', '.join(r.key for r in _ROWS if r.registered)}")
        return row
    if isinstance(name_or_id, (bool, np.bool_)) or not isinstance(name_or_id, (int, np.integer)):
        raise InvalidArgumentType(
            f"quant type must be an int id or a str name, got {type(name_or_id).__name__} "
            f"{name_or_id!r}")
    row = QTYPES.get(int(name_or_id))
    if row is None:
        raise InvalidArgument(
            f"quant type id {int(name_or_id)} is not in the register (docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register'); "
            f"registered ids: 0-22, 24, 28-41, 44, 45, 47-51, 130")
    return row


def is_registered(qt_id: int) -> bool:
    """True where a file may use qt ``qt_id`` (ids outside the table and reserved ids: False)."""
    row = QTYPES.get(int(qt_id))
    return row is not None and row.registered


def expected_nbytes(qt: int | str | QuantType, shape: Iterable[int]) -> int | None:
    """Payload bytes a tensor of ``qt`` and ``shape`` must have (docs/contracts/hfqm-and-quant.md,
    '1.1 Quant-type register' "Tensor size").

    ``None`` where the register gives no size rule (any size is accepted).
    Raises :class:`~pagedkv.errors.InvalidArgument` where the shape is invalid for
    the qt (V2, MQ4C and GL need the last dim K to be a multiple of 256).
    """
    row = qtype(qt)
    dims = [int(d) for d in shape]
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"shape {tuple(dims)} has a negative dimension")
    numel = 1
    for d in dims:
        numel *= d
    k = dims[-1] if dims else 1
    if row.k_multiple_of_256 and k % 256 != 0:
        raise InvalidArgument(
            f"{row.name} needs the last dimension K to be a multiple of 256, got shape "
            f"{tuple(dims)}; use the G128 fallback of docs/contracts/hfqm-and-quant.md, '2.9 Quantizer tensor policy'")
    g, b = row.group_size, row.group_bytes
    if row.size_rule == "groups":
        return -(-numel // g) * b
    if row.size_rule == "row_header":
        return 0 if k == 0 else (numel // k) * (16 + b * -(-k // g))
    if row.size_rule == "row_pad128":
        return 0 if k == 0 else (numel // k) * (-(-(b * -(-k // g)) // 128) * 128)
    if row.size_rule == "hessian":
        return 4 * k + k * max(k - 1, 0)
    return None
