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
from pagedkv.errors import InvalidArgument
from pagedkv.hfqm.mtp_trailer import MTP_ARCH_ID, MTP_TRAILER_MAGIC
from pagedkv.hfqm.reader import HfqmFile

__all__ = ["write_mtp_bundle"]

_COPY_CHUNK_BYTES = 16 << 20


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
    with AtomicFile(out) as dst:
        for src in (trunk, head):
            with open(src, "rb") as f:
                while chunk := f.read(_COPY_CHUNK_BYTES):
                    dst.write(chunk)
        dst.write(MTP_TRAILER_MAGIC + struct.pack("<Q", trunk_bytes))
    return trunk_bytes
