"""MTP bundles (hfqm-and-quant.md §2.8): ``[trunk HFQM][MTP HFQM, arch 21]`` then
16 bytes ``"HFBNDMTP" ++ u64 mtp_off`` (``mtp_off`` = trunk size, no padding).

Trunk readers ignore everything after the trunk's last payload, so a bundle is
a valid trunk file; the head is the HFQM section at ``base = mtp_off``.
"""

from __future__ import annotations

import os
import shutil
import struct
import uuid

from pagedkv.errors import InvalidArgument

__all__ = ["MTP_ARCH_ID", "MTP_TRAILER_MAGIC", "mtp_offset", "write_mtp_bundle"]

MTP_TRAILER_MAGIC = b"HFBNDMTP"
MTP_ARCH_ID = 21
_TRAILER_BYTES = 16


def mtp_offset(fd: int, file_bytes: int) -> int | None:
    """``mtp_off`` when the open file ``fd`` is a bundle: its last 16 bytes start with
    ``HFBNDMTP``, ``mtp_off < size - 16`` and ``HFQM`` sits at ``mtp_off``; else None."""
    if file_bytes < _TRAILER_BYTES:
        return None
    trailer = os.pread(fd, _TRAILER_BYTES, file_bytes - _TRAILER_BYTES)
    if trailer[:8] != MTP_TRAILER_MAGIC:
        return None
    (offset,) = struct.unpack("<Q", trailer[8:])
    if offset >= file_bytes - _TRAILER_BYTES or os.pread(fd, 4, offset) != b"HFQM":
        return None
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
    out = os.fspath(out)
    directory, base = os.path.split(os.path.abspath(out))
    temp = os.path.join(directory, f".{base}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(temp, "wb") as dst:
            for src in (trunk, head):
                with open(src, "rb") as f:
                    shutil.copyfileobj(f, dst, 16 << 20)
            dst.write(MTP_TRAILER_MAGIC + struct.pack("<Q", trunk_bytes))
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(temp, out)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    return trunk_bytes
