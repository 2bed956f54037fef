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
import shutil
import struct
import uuid

from pagedkv.errors import InvalidArgument
from pagedkv.hfqm.mtp_trailer import MTP_ARCH_ID, MTP_TRAILER_MAGIC
from pagedkv.hfqm.reader import HfqmFile
from pagedkv.hfqm.writer import fsync_parent_directory

__all__ = ["write_mtp_bundle"]


def write_mtp_bundle(trunk: str | os.PathLike[str], head: str | os.PathLike[str],
                     out: str | os.PathLike[str]) -> int:
    """Concatenate ``trunk`` and the MTP ``head`` (arch 21) and append the trailer, into
    ``out`` (temp file + rename). Both inputs are validated first. Returns ``mtp_off``."""
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
        fsync_parent_directory(out)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    return trunk_bytes
