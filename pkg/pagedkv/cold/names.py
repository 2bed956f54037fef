"""File names in a cold root (docs/contracts/cold-tier.md, '5.3 Names'): objects, writer temps,
quarantine."""

from __future__ import annotations

import re

from pagedkv.cold.groups import ColdGroup

__all__ = [
    "QUARANTINE_PREFIX",
    "WEIGHT_DIGESTS_NAME",
    "is_quarantine",
    "is_writer_temp",
    "object_name",
    "parse_object_name",
    "quarantine_name",
    "temp_name",
    "temp_pid",
]

# Whole names only (fullmatch): a `$` would also accept a trailing newline.
_OBJECT = re.compile(r"([0-9a-f]{64})(?:\.(gdn_state|sliding_window|conv_state))?\.safetensors")
_TEMP = re.compile(r"\.([0-9a-f]{64})\.([0-9]+)\.([0-9]+)\.tmp")
QUARANTINE_PREFIX = ".blocked."
WEIGHT_DIGESTS_NAME = "weight-digests.json"


def object_name(key: bytes, group: ColdGroup = ColdGroup.KV) -> str:
    """``<hex>.safetensors`` for a KV block, ``<hex>.<label>.safetensors`` for a sidecar."""
    if group is ColdGroup.KV:
        return key.hex() + ".safetensors"
    return f"{key.hex()}.{group.label}.safetensors"


def parse_object_name(name: str) -> tuple[bytes, ColdGroup] | None:
    """``(key, group)`` of a canonical object name, else ``None`` (never indexed)."""
    m = _OBJECT.fullmatch(name)
    if m is None:
        return None
    group = ColdGroup.KV if m.group(2) is None else ColdGroup.from_label(m.group(2))
    return bytes.fromhex(m.group(1)), group


def temp_name(key: bytes, pid: int, ns: int) -> str:
    """``.<hex>.<pid>.<ns>.tmp``: unique per writer, never indexed."""
    return f".{key.hex()}.{pid}.{ns}.tmp"


def is_writer_temp(name: str) -> bool:
    return _TEMP.fullmatch(name) is not None


def temp_pid(name: str) -> int | None:
    m = _TEMP.fullmatch(name)
    return int(m.group(2)) if m else None


def quarantine_name(name: str, pid: int, ns: int) -> str:
    """``.blocked.<name>.<pid>.<ns>``: where a bad object goes when it cannot be deleted."""
    return f"{QUARANTINE_PREFIX}{name}.{pid}.{ns}"


def is_quarantine(name: str) -> bool:
    return name.startswith(QUARANTINE_PREFIX)
