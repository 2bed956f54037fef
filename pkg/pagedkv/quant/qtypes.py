"""The quant-type (qt) register of docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register', as
Python data.

One row per registered or reserved id, read at import from the one table, ``PKV_QT_LIST``
in ``pagedkv/hfqm.h`` (through :func:`pagedkv.quant.qt_register.c_register`): edit the header,
never this module. Only the NumPy dtype of the raw types' elements is Python's own.

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

from pagedkv.argument_checks import is_int
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.quant import qt_register as _index

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


#: NumPy dtype of a raw qt's elements (PKV_QT_FLAG_RAW), by register name.
_RAW_DTYPES = {"F16": "float16", "F32": "float32", "BF16": "uint16", "TidI32": "uint32"}


def _rows_of_the_c_register() -> tuple[QuantType, ...]:
    codes = _index.c_constants()
    table = _index.c_register()
    size_rules = {codes["size_" + rule]: rule for rule in SIZE_RULES}
    statuses = {codes["status_" + status]: status for status in STATUSES}
    rows = []
    for qt_id, name in _index.c_register_names().items():
        c = table[qt_id]
        flags = int(c["flags"])
        raw = _RAW_DTYPES.get(name) if flags & codes["flag_raw"] else None
        rows.append(QuantType(qt_id, name, int(c["group_size"]), int(c["group_bytes"]),
                              size_rules[int(c["size_rule"])], statuses[int(c["status"])],
                              rotated=bool(flags & codes["flag_rotated"]),
                              k_multiple_of_256=bool(flags & codes["flag_k_mult_256"]),
                              raw_dtype=raw))
    return tuple(rows)


def _id_ranges(ids: Iterable[int]) -> str:
    """``"0-22, 24, 28-41"``: sorted ids with runs collapsed."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a + 1 else (f"{a}, {b}" if b > a else f"{a}")
                     for a, b in runs)


_ROWS: tuple[QuantType, ...] = _rows_of_the_c_register()

#: Every registered or reserved qt, by id.
QTYPES: dict[int, QuantType] = {row.id: row for row in _ROWS}
_BY_KEY: dict[str, QuantType] = {row.key: row for row in _ROWS}
_REGISTERED_IDS = _id_ranges(row.id for row in _ROWS if row.registered)


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
    if not is_int(name_or_id):
        raise InvalidArgumentType(
            f"quant type must be an int id or a str name, got {type(name_or_id).__name__} "
            f"{name_or_id!r}")
    row = QTYPES.get(int(name_or_id))
    if row is None:
        raise InvalidArgument(
            f"quant type id {int(name_or_id)} is not in the register (docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register'); "
            f"registered ids: {_REGISTERED_IDS}")
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
        if len(dims) != 2 or dims[0] != dims[1]:
            raise InvalidArgument(f"{row.name} (a calibration Hessian) needs a square [K, K] "
                                  f"shape, got {tuple(dims)}")
        return 4 * k + k * max(k - 1, 0)
    return None
