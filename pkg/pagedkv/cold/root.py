"""Opening a cold root safely (docs/contracts/cold-tier.md, '5.2 Opening'): no symlinks, owned by
us, mode 0700.

Every later file operation goes through the returned directory fd (``dir_fd=``), so
swapping the root's path for a symlink after opening cannot redirect any I/O.
"""

from __future__ import annotations

import logging
import os
import stat
import time

from pagedkv.cold.names import is_writer_temp, temp_pid
from pagedkv.errors import InvalidArgument

__all__ = [
    "MANAGED_CHILD",
    "STALE_TEMP_SECONDS",
    "clean_writer_temps",
    "open_managed_root",
    "platform_supported",
]

log = logging.getLogger("pagedkv.cold")

MANAGED_CHILD = "pagedkv-v1"
#: A temp file this old is abandoned even if its pid was reused by a live process.
STALE_TEMP_SECONDS = 60.0
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) \
    | getattr(os, "O_CLOEXEC", 0)


def platform_supported() -> bool:
    """dir_fd support for open/rename/unlink/utime and O_NOFOLLOW (else the tier is off)."""
    return (hasattr(os, "O_NOFOLLOW") and hasattr(os, "O_DIRECTORY")
            and {os.open, os.rename, os.unlink, os.stat, os.mkdir} <= os.supports_dir_fd
            and os.utime in os.supports_fd)


def _open_child(parent_fd: int, name: str, shown_path: str, what: str) -> int:
    """Open (creating with 0700 if missing) directory ``name`` under ``parent_fd``;
    ``shown_path`` is the full path errors name, ``what`` the kind of directory."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            raise InvalidArgument(f"{what} {shown_path!r} cannot be opened after creating it "
                                  f"({exc.strerror}); choose another directory") \
                from None
    except OSError as exc:
        # ELOOP (a symlink) or ENOTDIR (a regular file in its place): refuse.
        raise InvalidArgument(
            f"{what} {shown_path!r} is not a plain directory ({exc.strerror}); a {what} must "
            "not be a symlink or a file — remove it or choose another directory") from None


def open_managed_root(base: str, child: str | None, *, what: str = "cold root") -> int:
    """Open ``<realpath(base)>/<child>`` (or ``base`` itself as the managed dir when
    ``child`` is None, its parent acting as the base) and return the root fd.

    Raises ``InvalidArgument`` (tier disabled) for a symlinked or foreign-owned root.
    ``what`` names the directory in messages (the turn trace opens its directory with the
    same rules: "metrics dir").
    """
    if not platform_supported():
        raise InvalidArgument("this platform lacks dir_fd or O_NOFOLLOW; cold tier disabled")
    base = os.fspath(base)
    if not base or not base.strip():
        raise InvalidArgument(f"{what} base = {base!r} is blank")
    if child is None:
        parent, child = os.path.split(os.path.abspath(base).rstrip(os.sep) or os.sep)
        if not child:
            raise InvalidArgument(f"{what} {base!r} has no final component")
        base = parent
    real = os.path.realpath(base)
    try:
        os.makedirs(real, mode=0o700, exist_ok=True)
        base_fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileExistsError, NotADirectoryError):
        raise InvalidArgument(f"{what} base {real!r} is not a directory (a file is in its "
                              f"place); choose a directory for the {what}") from None
    except OSError as exc:
        raise InvalidArgument(f"{what} base {real!r} cannot be opened ({exc.strerror}); "
                              "choose a directory this user can create and write") from None
    try:
        root_fd = _open_child(base_fd, child, os.path.join(real, child), what)
    finally:
        os.close(base_fd)
    try:
        st = os.fstat(root_fd)
        if not stat.S_ISDIR(st.st_mode):
            raise InvalidArgument(f"{what} {os.path.join(real, child)!r} is not a directory; "
                                  "remove it or choose another directory")
        if st.st_uid != os.geteuid():
            raise InvalidArgument(
                f"{what} {os.path.join(real, child)!r} is owned by uid {st.st_uid}, not by "
                f"this process's effective uid {os.geteuid()}; chown it to this user or "
                "choose another directory")
        os.fchmod(root_fd, 0o700)
    except BaseException:
        os.close(root_fd)
        raise
    return root_fd


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_writer_temps(root_fd: int) -> int:
    """Delete writer temp files whose writer is dead (or that are stale); return the count.

    Only names of the writer temp pattern are touched; unknown files are never deleted.
    """
    removed = 0
    now = time.time()
    for name in os.listdir(root_fd):
        if not is_writer_temp(name):
            continue
        try:
            st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            pid = temp_pid(name)
            if pid is not None and _pid_alive(pid) and now - st.st_mtime < STALE_TEMP_SECONDS:
                continue  # a live writer's object in progress
            os.unlink(name, dir_fd=root_fd)
            removed += 1
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cold tier: cannot remove writer temp %s: %s", name, exc)
    return removed
