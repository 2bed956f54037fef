"""The MTP bundle trailer (docs/contracts/hfqm-and-quant.md, '2.8 Embedded sections and MTP
bundle'): the last 16 bytes of a bundle, ``"HFBNDMTP" ++ u64 mtp_off``, and their parse.

Its own module because both sides use it: :mod:`pagedkv.hfqm.reader` finds the head of a
bundle with :func:`mtp_offset`, and :mod:`pagedkv.hfqm.mtp_bundle` writes the trailer.
"""

from __future__ import annotations

import struct

from pagedkv.errors import BadBundle
from pagedkv.hfqm.index import HEADER_BYTES, MAGIC, MTP_TRAILER_BYTES
from pagedkv.hfqm.positional_reads import pread_exact

__all__ = ["MTP_ARCH_ID", "MTP_TRAILER_MAGIC", "TRAILER_BYTES", "mtp_offset"]

MTP_TRAILER_MAGIC = b"HFBNDMTP"
MTP_ARCH_ID = 21
TRAILER_BYTES = MTP_TRAILER_BYTES


def mtp_offset(fd: int, file_bytes: int, trunk_end: int, *, path: str) -> int | None:
    """``mtp_off`` of the open file ``fd`` when its last 16 bytes are a bundle trailer,
    None when they are not. ``trunk_end`` is the byte after the trunk's last payload.

    Raises :class:`~pagedkv.errors.BadBundle` when the trailer does not point at an HFQM
    header that starts at or after ``trunk_end`` and ends before the trailer."""
    if file_bytes < TRAILER_BYTES:
        return None
    trailer_at = file_bytes - TRAILER_BYTES
    trailer = pread_exact(fd, TRAILER_BYTES, trailer_at, path=path)
    if trailer[:8] != MTP_TRAILER_MAGIC:
        return None
    (offset,) = struct.unpack("<Q", trailer[8:])
    if not trunk_end <= offset <= trailer_at - HEADER_BYTES:
        raise BadBundle(f"MTP bundle trailer points at byte {offset}; the head must start "
                        f"after the trunk's last payload (byte {trunk_end}) and leave room "
                        f"for its {HEADER_BYTES}-byte header before the trailer (byte "
                        f"{trailer_at})", path=path, offset=trailer_at + 8)
    magic = pread_exact(fd, 4, offset, path=path)
    if magic != MAGIC:
        raise BadBundle(f"MTP bundle trailer points at byte {offset}, which holds "
                        f"{bytes(magic)!r}, not an HFQM header", path=path, offset=offset)
    return offset
