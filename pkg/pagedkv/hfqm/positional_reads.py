"""Positional reads that never come back short by accident.

``os.pread`` may return fewer bytes than asked for: Linux stops one call at
0x7ffff000 bytes (just under 2 GiB), and signals or network file systems cut
reads too. The HFQM reader's plain-read path (files too large to map) reads
through :func:`pread_exact`, which loops until it has every byte or reaches the
end of the file, into one buffer allocated up front, so a read costs exactly the
bytes the caller asked for: callers bound ``nbytes`` by what the file's header
can justify before they ask.
"""

from __future__ import annotations

import os

from pagedkv.errors import Truncated

__all__ = ["MAX_READ_CALL_BYTES", "pread_exact", "pread_into"]

#: Bytes asked of one read call (below Linux's 0x7ffff000 cap).
MAX_READ_CALL_BYTES = 1 << 30


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` (a writable byte view) from file offset ``offset``; returns the bytes
    read, fewer than ``len(view)`` only at the end of the file."""
    got = 0
    total = len(view)
    while got < total:
        want = view[got:got + MAX_READ_CALL_BYTES]
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [want], offset + got)
        else:  # Windows: no preadv; read and copy
            chunk = os.pread(fd, len(want), offset + got)
            n = len(chunk)
            want[:n] = chunk
        if n == 0:
            break
        got += n
    return got


def pread_exact(fd: int, nbytes: int, offset: int, *, path: str) -> bytearray:
    """``nbytes`` bytes of the file from ``offset``. Raises
    :class:`~pagedkv.errors.Truncated` (naming ``path``) when the file ends first."""
    buf = bytearray(nbytes)
    got = pread_into(fd, memoryview(buf), offset)
    if got < nbytes:
        raise Truncated(f"the file ends at byte {offset + got}, inside a {nbytes}-byte read "
                        f"at byte {offset} (was it truncated while open?)", path=path,
                        offset=offset + got)
    return buf
