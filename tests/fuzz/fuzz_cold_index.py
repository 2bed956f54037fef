"""Fuzz target: rebuilding the cold index over a directory of planted files
(docs/cold.md, "Layout on disk").

The input plants up to 12 entries in a fresh root: object names (KV and sidecar) of three
keys, writer temps of dead and live writers, quarantine names, the weight-digest cache,
names with a trailing newline or upper-case hex, and free names; as regular files (valid
objects from pagedkv's writers, edited ones, raw bytes, empty), symlinks (to a file
outside the root, to another entry, dangling), hard links to the outside file, nested
directories and FIFOs. Then it opens the root, checks it (``pagedkv cold verify``, with or
without ``--prune``), loads every indexed object under its own group and another one,
removes quarantine and evicts all.

Checked after every step: ``total_bytes`` is the sum of the entries, every entry is a
regular file of exactly its size under its own canonical name, every canonical regular
file is indexed (or listed as unowned when quarantine was not asked for), nothing outside
the root changed, and no descriptor leaked. Nothing may raise.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cold_inputs import (
    FP_HEX,
    GEOMETRIES,
    KEYS,
    LAYOUTS,
    ByteReader,
    block_object,
    sidecar_object,
    structured,
)

from pagedkv.cold import ColdGroup, object_name
from pagedkv.cold.names import parse_object_name
from pagedkv.cold.offline import verify_store
from pagedkv.cold.stats import ColdCounters
from pagedkv.cold.store import ColdStore

_WORK: dict[str, str] = {}
_LOG = logging.getLogger("pagedkv.cold")
_OUTSIDE_BYTES = b"outside the root: never touched\n"
_SIDE_GROUPS = [ColdGroup.GDN_STATE, ColdGroup.SLIDING_WINDOW, ColdGroup.CONV_STATE]
_VALID = {(k, g): (block_object(GEOMETRIES[i % len(GEOMETRIES)], i, k) if g is ColdGroup.KV
                   else sidecar_object(LAYOUTS[_SIDE_GROUPS.index(g)], i, k))
          for i, k in enumerate(KEYS) for g in [ColdGroup.KV, *_SIDE_GROUPS]}
_SEED_OBJECTS = list(_VALID.values())


def _workdir() -> str:
    """One scratch directory per process: the outside file and a root per input."""
    if "dir" not in _WORK:
        # tmpfs when there is one: a disk filesystem's rmdir dominates the cost of an input.
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        base = tempfile.mkdtemp(prefix="pagedkv-fuzz-index-", dir=shm)
        atexit.register(shutil.rmtree, base, True)
        with open(os.path.join(base, "outside"), "wb") as f:
            f.write(_OUTSIDE_BYTES)
        _WORK["dir"] = base
    return _WORK["dir"]


def _name(r: ByteReader, key: bytes, group: ColdGroup) -> str:
    kind = r.u8() % 12
    if kind <= 3:
        return object_name(key, group)
    if kind == 4:
        return object_name(key, r.pick(list(ColdGroup)))
    if kind == 5:
        return f".{key.hex()}.{r.pick([1, 999_999_999, os.getpid()])}.{r.u16()}.tmp"
    if kind == 6:
        return ".blocked." + object_name(key, group) + f".{r.u8()}.1"
    if kind == 7:
        return "weight-digests.json"
    if kind == 8:
        return object_name(key, group) + "\n"
    if kind == 9:
        return object_name(key, group).upper().replace(".SAFETENSORS", ".safetensors")
    if kind == 10:
        return object_name(key, group) + ".tmp"
    raw = r.take(1 + r.u8() % 12).replace(b"/", b"_").replace(b"\0", b"_")
    name = raw.decode("latin-1")
    return name if name not in ("", ".", "..") else "x"


def _content(r: ByteReader, key: bytes, group: ColdGroup) -> bytes:
    kind = r.u8() % 6
    if kind <= 1:
        return _VALID[(key, group)]
    if kind == 2:
        return _VALID[(r.pick(KEYS), r.pick(list(ColdGroup)))]
    if kind == 3:
        return structured(r.take(1 + r.u8() % 24), _SEED_OBJECTS)
    if kind == 4:
        return r.take(r.u16() % 2048)
    return b""


def _plant(root: str, outside: str, r: ByteReader, planted: list[str]) -> None:
    key, group = r.pick(KEYS), r.pick(list(ColdGroup))
    name = _name(r, key, group)
    path = os.path.join(root, name)
    kind = r.u8() % 10
    try:
        if kind <= 4:
            with open(path, "xb") as f:
                f.write(_content(r, key, group))
            if kind == 4:
                os.chmod(path, 0)
        elif kind == 5:
            os.symlink(r.pick([outside, os.path.join(root, "nowhere"), *[
                os.path.join(root, p) for p in planted[:4]]]), path)
        elif kind == 6:
            os.link(outside, path)
        elif kind == 7:
            os.mkdir(path)
            deep = path
            for i in range(r.u8() % 6):
                deep = os.path.join(deep, f"d{i}")
                os.mkdir(deep)
                with open(os.path.join(deep, "f"), "wb") as f:
                    f.write(b"x")
        elif kind == 8:
            os.mkfifo(path)
        else:
            with open(path, "xb") as f:
                f.write(_VALID[(key, group)])
            os.utime(path, ns=(r.u16() * 10**9, r.u16() * 10**9))
        planted.append(name)
    except OSError:
        pass  # a repeated name, or a name the filesystem refuses: nothing planted


def _check(store: ColdStore, root: str) -> None:
    entries = store.index.snapshot()
    names = [e.file_name for _, e in entries]
    if len(set(names)) != len(names):
        raise AssertionError(f"two index entries share a file: {names}")
    if store.index.total_bytes != sum(e.size for _, e in entries):
        raise AssertionError(f"total_bytes {store.index.total_bytes} != the entries' sum "
                             f"{sum(e.size for _, e in entries)}")
    for key, e in entries:
        if parse_object_name(e.file_name) != (key, e.group):
            raise AssertionError(f"entry {e!r} is not under its own canonical name")
        st = os.stat(os.path.join(root, e.file_name), follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_size != e.size:
            raise AssertionError(f"entry {e!r} is not a regular file of its size on disk")
    on_disk = {n for n in os.listdir(root) if parse_object_name(n) is not None
               and stat.S_ISREG(os.stat(os.path.join(root, n), follow_symlinks=False).st_mode)}
    # Every canonical file is indexed or reported unowned (a load may since have dropped
    # a bad unowned file: reported, gone, fine); every entry was checked on disk above.
    known = set(names) | {n for n, _ in store.unowned}
    if not on_disk <= known:
        raise AssertionError(f"canonical files {sorted(on_disk - known)} are neither "
                             f"indexed nor reported unowned")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


def one_input(data: bytes) -> None:
    # Every planted defect is logged by design: quiet for this input only (a process that
    # imports the target, such as the test suite, keeps its logging as it was).
    level = _LOG.level
    _LOG.setLevel(logging.CRITICAL)
    try:
        _one_input(data)
    finally:
        _LOG.setLevel(level)


def _one_input(data: bytes) -> None:
    work = _workdir()
    outside = os.path.join(work, "outside")
    root = tempfile.mkdtemp(dir=work)
    fds = _open_fds()
    r = ByteReader(data)
    try:
        planted: list[str] = []
        for _ in range(r.u8() % 13):
            _plant(root, outside, r, planted)
        quarantine = bool(r.u8() & 1)
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        store = ColdStore(root_fd, root, ColdCounters(), quota_bytes=1 << 30,
                          reserve_bytes=0)
        try:
            store.scan(quarantine_unowned=quarantine)
            if quarantine and store.unowned:
                raise AssertionError(f"unowned names left after quarantine: {store.unowned}")
            _check(store, root)
            prune = bool(r.u8() & 1)
            result = verify_store(store, prune=prune)
            if result.checked != len(store.index) + len(store.unowned) or result.vanished:
                raise AssertionError(f"verify checked {result.checked} (vanished "
                                     f"{result.vanished}) of {len(store.index)} entries "
                                     f"and {len(store.unowned)} unowned names")
            if prune:  # what a server opening the root next finds
                store.scan(quarantine_unowned=True)
                _check(store, root)
            for key, e in store.index.snapshot():
                # Under its own group, and (as a walk may ask) under another one.
                for group in (e.group, r.pick(list(ColdGroup))):
                    if group is ColdGroup.KV:
                        store.load_block(key, fingerprint_hex=FP_HEX,
                                         expected=r.pick(GEOMETRIES))
                    else:
                        store.load_sidecar(key, LAYOUTS[_SIDE_GROUPS.index(group)],
                                           fingerprint_hex=FP_HEX)
                    _check(store, root)
            store.remove_quarantine()
            store.evict_to(0)
            _check(store, root)
            if any(not e.unclearable for _, e in store.index.snapshot()):
                raise AssertionError("evict_to(0) left a clearable entry")
            if any(n.startswith(".blocked.") for n in os.listdir(root)):
                raise AssertionError(f"quarantine left after its removal: {os.listdir(root)}")
        finally:
            store.close()
        with open(outside, "rb") as f:
            if f.read() != _OUTSIDE_BYTES:
                raise AssertionError("a file outside the root was modified")
        if sorted(os.listdir(work)) != sorted(["outside", os.path.basename(root)]):
            raise AssertionError(f"the scratch directory changed: {os.listdir(work)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if _open_fds() != fds:
        raise AssertionError(f"descriptors leaked: {fds} before, {_open_fds()} after")


def seeds() -> Iterable[tuple[str, bytes]]:
    # entry = key, group, name kind, planting kind, content kind (…): see _plant
    yield "one valid block", bytes([1, 0, 0, 0, 0, 0, 0, 0])
    yield "block and sidecar of one key", bytes([2, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1])
    yield "symlink, temp, quarantine", bytes([4, 0, 0, 0, 5, 0, 1, 1, 5, 0, 0, 1, 6, 7,
                                              0, 2, 3, 0, 9, 0])
    yield "everything", bytes(range(256))
    yield "empty", b""


if __name__ == "__main__":
    from runner import main
    main(one_input, seeds)
