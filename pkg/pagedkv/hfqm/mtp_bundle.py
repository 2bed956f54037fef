"""MTP bundles (docs/contracts/hfqm-and-quant.md, '2.8 Embedded sections and MTP bundle'): ``[trunk
HFQM][MTP HFQM, arch 21]`` then
16 bytes ``"HFBNDMTP" ++ u64 mtp_off`` (``mtp_off`` = trunk size, no padding).

Trunk readers ignore everything after the trunk's last payload, so a bundle is
a valid trunk file; the head is the HFQM section at ``base = mtp_off``. A file
that ends in the trailer magic claims to be a bundle: a trailer pointing
anywhere but past the trunk, inside the file, at an HFQM header raises
:class:`~pagedkv.errors.BadBundle` (docs/formats/hfqm.md, "MTP bundles"). In
particular ``mtp_off = 0`` would make the trunk its own head, recursively.
"""

from __future__ import annotations

import os
import struct

from pagedkv.atomic_write import AtomicFile
from pagedkv.errors import BadBundle, InvalidArgument
from pagedkv.hfqm.index import HEADER_BYTES, MAGIC, MTP_TRAILER_BYTES
from pagedkv.hfqm.positional_reads import pread_exact

__all__ = ["MTP_ARCH_ID", "MTP_TRAILER_MAGIC", "mtp_offset", "write_mtp_bundle"]

MTP_TRAILER_MAGIC = b"HFBNDMTP"
MTP_ARCH_ID = 21
TRAILER_BYTES = MTP_TRAILER_BYTES
_COPY_CHUNK_BYTES = 16 << 20


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


def write_mtp_bundle(trunk: str | os.PathLike[str], head: str | os.PathLike[str],
                     out: str | os.PathLike[str]) -> int:
    """Concatenate ``trunk`` and the MTP ``head`` (arch 21) and append the trailer, into
    ``out`` (temp file + rename). Both inputs are validated first. Returns ``mtp_off``."""
    from pagedkv.hfqm.reader import HfqmFile
    with HfqmFile(trunk) as t, HfqmFile(head) as h:
        if h.arch_id != MTP_ARCH_ID:
            raise InvalidArgument(f"head {os.fspath(head)!r} has arch_id {h.arch_id}; an MTP "
                                  f"head has arch_id {MTP_ARCH_ID}")
        if t.mtp is not None or h.mtp is not None:
            raise InvalidArgument("inputs must be plain HFQM files, not bundles")
        trunk_bytes = t.file_bytes
    with AtomicFile(out) as dst:
        for src in (trunk, head):
            with open(src, "rb") as f:
                while chunk := f.read(_COPY_CHUNK_BYTES):
                    dst.write(chunk)
        dst.write(MTP_TRAILER_MAGIC + struct.pack("<Q", trunk_bytes))
    return trunk_bytes
