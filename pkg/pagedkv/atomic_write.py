"""Atomic file replacement: a file is written under a temporary name next to its target,
synced, renamed onto the target and the directory synced, so a reader (or a restart after
a power loss) sees either the previous file or the whole new one, never part of one.

One routine for every writer of the package: the HFQM writer and MTP bundle, the cold
tier's objects and its weight-digest cache. Base layer: imports nothing of pagedkv but
:mod:`pagedkv.errors`.
"""

from __future__ import annotations

import errno
import os
import sys
import uuid
from typing import Self

from pagedkv.errors import InvariantViolation

__all__ = ["AtomicFile", "sync_directory", "sync_file", "temp_name_beside"]

_TEMP_FLAGS = (os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
# fsync on a directory fails with these where the filesystem cannot sync one at all (some
# network and FUSE filesystems): nothing more durable can be had there, so it is not an error.
_DIRECTORY_SYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


def sync_file(fd: int, *, full: bool = False) -> None:
    """``fsync(fd)``; with ``full`` on macOS, ``F_FULLFSYNC`` (also flushes the drive's
    write cache, which plain fsync does not there)."""
    if full and sys.platform == "darwin":
        import fcntl
        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
    else:
        os.fsync(fd)


def sync_directory(directory: str | os.PathLike[str] | int) -> None:
    """fsync a directory, given by path or by an open descriptor, so that the names created
    or renamed in it survive a power loss. Raises ``OSError`` on failure, except where the
    filesystem cannot sync a directory at all (EINVAL, ENOTSUP) or the platform cannot
    open one (Windows)."""
    if sys.platform == "win32":
        return
    owned = not isinstance(directory, int)
    fd = os.open(directory, _DIR_FLAGS) if owned else int(directory)  # type: ignore[arg-type]
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _DIRECTORY_SYNC_UNSUPPORTED:
            raise
    finally:
        if owned:
            os.close(fd)


def temp_name_beside(name: str) -> str:
    """A fresh hidden temporary name for ``name`` in the same directory:
    ``dir/.base.<12 hex>.tmp``."""
    directory, base = os.path.split(name)
    return os.path.join(directory, f".{base}.{uuid.uuid4().hex[:12]}.tmp")


class AtomicFile:
    """One file written atomically onto ``path``.

    ``AtomicFile(path)`` creates the temporary file at once (``O_EXCL``, never following a
    link) and exposes its descriptor as ``fd`` (open read-write); ``write`` appends,
    ``os.pwrite(fd, ...)`` writes anywhere. ``commit()`` = ``finish()`` (fsync and close the
    file) + ``rename()`` (onto ``path``) + ``sync_directory()``; the three steps are public
    for callers that act between them. ``abort()`` closes and deletes the temporary file
    and leaves ``path`` as it was. As a context manager it commits on success and aborts
    on an exception.

    ``dir_fd``: ``path`` (and ``temp_name``) are names relative to that open directory.
    ``sync=False`` skips both fsyncs (tests, scratch files); ``full_sync`` uses
    ``F_FULLFSYNC`` on macOS. ``mode``: permission bits of the new file (before umask).
    """

    def __init__(self, path: str | os.PathLike[str], *, dir_fd: int | None = None,
                 temp_name: str | None = None, mode: int = 0o644, sync: bool = True,
                 full_sync: bool = False) -> None:
        self.path = os.fspath(path)
        self.dir_fd = dir_fd
        if dir_fd is None:
            self.path = os.path.abspath(self.path)
        self.temp_path = temp_name if temp_name is not None else temp_name_beside(self.path)
        self.sync = bool(sync)
        self.full_sync = bool(full_sync)
        self.state = "open"
        try:
            self.fd: int = os.open(self.temp_path, _TEMP_FLAGS, mode, dir_fd=dir_fd)
        except OSError as e:  # name the file the caller asked for, not our temporary one
            raise OSError(e.errno, f"{e.strerror} (creating the temporary file "
                          f"{os.path.basename(self.temp_path)} next to it)", self.path) from e

    def write(self, data) -> None:
        """Append all of ``data`` (any bytes-like object) at the current file position."""
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(self.fd, view):]

    def finish(self) -> None:
        """fsync (unless ``sync=False``) and close the temporary file."""
        self._expect("open")
        if self.sync:
            sync_file(self.fd, full=self.full_sync)
        # close(2) releases the descriptor even when it reports an error (EIO on NFS): the
        # state moves on first, so abort() never closes the number again (by then it may be
        # another thread's file) and still deletes the temporary file.
        self.state = "finished"
        os.close(self.fd)

    def rename(self) -> None:
        """Rename the finished temporary file onto ``path`` (replacing what was there)."""
        self._expect("finished")
        os.replace(self.temp_path, self.path, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        self.state = "renamed"

    def sync_directory(self) -> None:
        """fsync the directory holding ``path`` (unless ``sync=False``), making the rename
        durable."""
        self._expect("renamed")
        if self.sync:
            sync_directory(self.dir_fd if self.dir_fd is not None
                           else os.path.dirname(self.path))
        self.state = "committed"

    def commit(self) -> None:
        """``finish()``, ``rename()``, ``sync_directory()``; on an error before the rename the
        temporary file is deleted (``abort``) and the error raised."""
        try:
            self.finish()
            self.rename()
        except BaseException:
            self.abort()
            raise
        self.sync_directory()

    def abort(self) -> None:
        """Close and delete the temporary file; ``path`` is left untouched. Idempotent;
        after ``rename()`` there is nothing left to delete."""
        if self.state == "open":
            self.state = "finished"  # released whatever close reports: never closed twice
            try:
                os.close(self.fd)
            except OSError:
                pass  # the descriptor is gone anyway; the temporary file still goes
        if self.state == "finished":
            try:
                os.unlink(self.temp_path, dir_fd=self.dir_fd)
            except FileNotFoundError:
                pass
            self.state = "aborted"

    def _expect(self, state: str) -> None:
        if self.state != state:
            raise InvariantViolation(f"AtomicFile for {self.path!r} is {self.state}, "
                               f"this step needs it {state}")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def __repr__(self) -> str:
        return f"<AtomicFile {self.path!r} via {self.temp_path!r}, {self.state}>"
