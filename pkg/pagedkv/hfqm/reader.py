"""``HfqmFile``: the HFQM v1 reader (docs/contracts/hfqm-and-quant.md, '2. HFQM v1 container').

The file is memory-mapped read-only; header and index are validated and parsed
once at open (Cython, :mod:`pagedkv.hfqm.index`); tensors are handed out as
zero-copy read-only NumPy views of the mapping. Files above 64 GiB are opened
with plain reads of header and index and one small mapping per tensor, because
a whole-file mapping of such files hit unified-memory OOMs upstream. Those reads
are bounded by what the header justifies and grow only as the parse needs them,
so a forged ``data_offset`` costs no memory (docs/formats/hfqm.md, "Validation").
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Iterator
from typing import Literal, NamedTuple, Self

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.errors import (
    BadBundle,
    BadMetadata,
    BadName,
    InvalidArgument,
    TensorNotFound,
    Truncated,
)
from pagedkv.hfqm import index as _index
from pagedkv.hfqm import strict_json
from pagedkv.hfqm.arch import QWEN35_ARCH_IDS, arch_name, is_qwen35_metadata
from pagedkv.hfqm.mtp_trailer import MTP_ARCH_ID, TRAILER_BYTES, mtp_offset
from pagedkv.hfqm.positional_reads import pread_exact
from pagedkv.quant.qtypes import QTYPES

__all__ = ["HfqmFile", "TensorInfo", "canonical_name"]

WHOLE_FILE_MMAP_LIMIT_BYTES = 64 << 30
#: Largest metadata JSON ``.metadata`` parses (hipfire's largest, a tokenizer, is ~30 MB).
MAX_METADATA_BYTES = 1 << 30
# Read path: the metadata is brace-scanned in chunks of this size, and the index is
# read from a first region of this size, doubled while the parse needs more.
_READ_CHUNK_BYTES = 1 << 20
_ALIAS_PREFIXES = ("model.language_model.", "model.")


def canonical_name(name: str) -> str:
    """The name lookups compare: ``model.language_model.X``, ``model.X`` and ``X``
    are one name (docs/contracts/hfqm-and-quant.md, '2.4 Reader validation')."""
    for prefix in _ALIAS_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


class TensorInfo(NamedTuple):
    """One tensor of the index. ``offset`` is the absolute file offset, bytes."""

    name: str
    qt: int
    qt_name: str
    shape: tuple[int, ...]
    group_size: int
    nbytes: int
    offset: int


class HfqmFile:
    """A read-only HFQM v1 file.

    ``HfqmFile(path, base=0)``: ``base`` is the byte where the HFQM section starts
    (non-zero for the MTP head of a bundle, docs/contracts/hfqm-and-quant.md, '2.8 Embedded sections
    and MTP bundle'). Raises a
    :class:`~pagedkv.errors.FormatError` subclass for any broken file
    (docs/contracts/hfqm-and-quant.md, '2.4 Reader validation').

    * ``file[name]``: F16/F32/BF16/TidI32 as a read-only typed array of the tensor's
      shape (``float16``/``float32``/``uint16`` bf16 bits/``uint32``; zero-copy when
      the offset is a multiple of the itemsize, else a copy); every other qt as a
      zero-copy read-only ``uint8`` view of its bytes.
    * ``raw(name)``: always the ``uint8`` view.
    * ``tensors``, ``names``, ``records`` (the structured index), ``metadata``
      (parsed lazily), ``arch_id``, ``mtp`` (the bundled MTP head or ``None``).
    """

    def __init__(self, path: str | os.PathLike[str], *, base: int = 0,
                 _whole_file_mmap_limit_bytes: int = WHOLE_FILE_MMAP_LIMIT_BYTES) -> None:
        self.path = os.fspath(path)
        self.base = int(base)
        self._whole_file_mmap_limit_bytes = _whole_file_mmap_limit_bytes  # the head's too
        self._closed = True
        self._metadata: dict | None = None
        self._mtp: HfqmFile | None | Literal[False] = False  # False: not looked up yet
        self._tensors: list[TensorInfo] | None = None
        self._fd: int | None = None
        self._bytes: np.ndarray | None = None  # whole-file uint8 view of the mapping
        # O_NONBLOCK: a FIFO with no writer would block this open forever; a regular file
        # ignores the flag.
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0)
                     | getattr(os, "O_NONBLOCK", 0))
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise InvalidArgument(f"path {self.path!r} is a directory; pass an HFQM file")
            if not stat.S_ISREG(st.st_mode):
                # a pipe (`<(cat f)`), FIFO, socket or device has no size to read the
                # index against: it read as "file holds 0 bytes"
                raise InvalidArgument(f"path {self.path!r} is not a regular file (a pipe, "
                                      "FIFO or device); pass an HFQM file on disk")
            self.file_bytes = st.st_size
            if self.base < 0 or self.base > self.file_bytes:
                raise InvalidArgument(f"base {self.base} is outside the file "
                                      f"({self.file_bytes} bytes): pass 0..file size")
            section_bytes = self.file_bytes - self.base
            if section_bytes < _index.HEADER_BYTES:
                raise Truncated(f"file holds {section_bytes} bytes from the section start, "
                                f"the HFQM header needs {_index.HEADER_BYTES}",
                                path=self.path, offset=self.file_bytes)
            calib_ok = self.path.endswith(".calib.hfq")
            if self.file_bytes <= _whole_file_mmap_limit_bytes:
                mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                whole = np.frombuffer(mapping, dtype=np.uint8)
                self._index = _index.parse_index(whole[self.base:], section_bytes,
                                                 self.base, self.path, calib_ok)
                self._bytes = whole
            else:
                self._index = self._parse_with_reads(fd, section_bytes, calib_ok)
                self._fd, fd = fd, -1
        finally:
            if fd >= 0:
                os.close(fd)
        self.records = self._index.records
        self.names: list[str] = self._index.names
        self._by_name: dict[str, int] = self._index.index_of
        # Names that are one name for lookups are refused as duplicates are: with both
        # `model.X` and `X` in a file, which tensor `file["model.model.X"]`-style or
        # canonical lookups return would depend on the spelling or the index order.
        by_canonical: dict[str, int] = {}
        for i, name in enumerate(self.names):
            first = by_canonical.setdefault(canonical_name(name), i)
            if first != i:
                self._bytes = None
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
                raise BadName(f"tensor names {self.names[first]!r} (entry #{first}) and "
                              f"{name!r} (entry #{i}) are one name for lookups "
                              "(model.language_model.X, model.X and X are one name)",
                              path=self.path, tensor=name)
        self._by_canonical: dict[str, int] = by_canonical
        self._closed = False

    def _parse_with_reads(self, fd: int, section_bytes: int, calib_ok: bool):
        """Header, metadata extent and index with plain reads. Nothing past the header is
        read before the header's offsets are checked against the file; the metadata is
        scanned in bounded chunks and not kept; the index region grows (doubling) only
        while entries keep parsing, so memory follows the index really in the file."""
        header = _index.parse_header(
            pread_exact(fd, _index.HEADER_BYTES, self.base, path=self.path), self.path)
        metadata_offset, data_offset = header[3], header[4]
        _index.check_offsets(metadata_offset, data_offset, section_bytes, self.base,
                             self.path)
        scanner = _index.JsonEndScanner()
        pos, json_end = metadata_offset, -1
        while json_end == -1 and pos < data_offset:
            chunk = pread_exact(fd, min(_READ_CHUNK_BYTES, data_offset - pos),
                                self.base + pos, path=self.path)
            end = scanner.feed(chunk)
            json_end = pos + end if end >= 0 else end
            pos += len(chunk)
        if json_end < 0:
            _index.raise_json_end_error(-2 if metadata_offset == data_offset else json_end,
                                        metadata_offset, data_offset, self.base, self.path)
        index_room = data_offset - json_end
        want = min(_READ_CHUNK_BYTES, index_room)
        while True:
            region = pread_exact(fd, want, self.base + json_end, path=self.path)
            parsed = _index.parse_index_region(header, region, json_end, section_bytes,
                                               self.base, self.path, calib_ok)
            if parsed is not None:
                return parsed
            assert want < index_room, "a region reaching data_offset parses or raises"
            want = min(2 * want, index_room)

    # --- header fields --------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._index.version

    @property
    def arch_id(self) -> int:
        return self._index.arch_id

    @property
    def arch_name(self) -> str:
        return arch_name(self._index.arch_id)

    @property
    def metadata_offset(self) -> int:
        """As stored: bytes from ``base``."""
        return self._index.metadata_offset

    @property
    def data_offset(self) -> int:
        """As stored: bytes from ``base``."""
        return self._index.data_offset

    @property
    def metadata_bytes(self) -> int:
        """Length of the metadata JSON, bytes."""
        return self._index.json_end_abs - self.base - self._index.metadata_offset

    @property
    def index_bytes(self) -> int:
        """Length of the tensor index (count included), bytes."""
        return self._index.index_end_abs - self._index.json_end_abs

    @property
    def payload_bytes(self) -> int:
        return int(self.records["nbytes"].sum()) if len(self.records) else 0

    # --- metadata and MTP -----------------------------------------------------------

    @property
    def metadata(self) -> dict:
        """The metadata JSON object, parsed on first access (``tokenizer`` stays a
        string). Raises :class:`~pagedkv.errors.BadMetadata` if it is not a JSON
        object, or names Qwen3.5/3.6 with an arch_id other than 5 or 6."""
        if self._metadata is None:
            start = self.base + self._index.metadata_offset
            length = self._index.json_end_abs - start
            if length > MAX_METADATA_BYTES:
                raise BadMetadata(f"metadata JSON is {length} bytes, more than the "
                                  f"{MAX_METADATA_BYTES} pagedkv parses", path=self.path,
                                  offset=start)
            text = bytes(self._read(start, length))
            try:
                # Strict: NaN, Infinity and numbers past float64 are no JSON; hipfire's
                # loader refuses them, and `inspect --json` would print them as non-JSON.
                value = strict_json.loads(text.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                raise BadMetadata(f"metadata is not valid UTF-8 JSON ({exc})",
                                  path=self.path, offset=start) from None
            except RecursionError:
                raise BadMetadata("metadata JSON nests arrays/objects deeper than the "
                                  "JSON parser allows", path=self.path, offset=start) from None
            if not isinstance(value, dict):
                raise BadMetadata(f"metadata is a JSON {type(value).__name__}, not an object",
                                  path=self.path, offset=start)
            if is_qwen35_metadata(value) and self.arch_id not in QWEN35_ARCH_IDS:
                raise BadMetadata(
                    f"metadata names Qwen3.5/3.6 but arch_id is {self.arch_id} "
                    f"({self.arch_name}); Qwen3.5/3.6 files use arch_id 5 or 6",
                    path=self.path, offset=self.base + 8)
            self._metadata = value
        return self._metadata

    @property
    def mtp(self) -> HfqmFile | None:
        """The MTP head of a bundle (``[trunk][MTP HFQM]"HFBNDMTP" u64 mtp_off``),
        opened lazily with ``base = mtp_off``; ``None`` for a plain file and for a
        section that is itself a head (``base > 0``). Raises
        :class:`~pagedkv.errors.BadBundle` when the file ends in the trailer magic but
        the trailer does not point past the trunk, inside the file, at an HFQM section
        of arch 21 whose payloads end before the trailer."""
        if self._mtp is False:
            self._check_open()
            if self.base != 0:
                self._mtp = None
                return None
            trunk_end = self.data_offset + self.payload_bytes
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            try:
                offset = mtp_offset(fd, self.file_bytes, trunk_end, path=self.path)
            finally:
                os.close(fd)
            if offset is None:
                self._mtp = None
                return None
            head = HfqmFile(self.path, base=offset,
                            _whole_file_mmap_limit_bytes=self._whole_file_mmap_limit_bytes)
            head_end = head.base + head.data_offset + head.payload_bytes
            problem = None
            if head.arch_id != MTP_ARCH_ID:
                problem = f"has arch_id {head.arch_id}, not the MTP arch {MTP_ARCH_ID}"
            elif head_end > self.file_bytes - TRAILER_BYTES:
                problem = f"ends at byte {head_end}, inside the trailer"
            if problem is not None:
                head.close()
                raise BadBundle(f"the MTP head the bundle trailer points at (byte {offset}) "
                                f"{problem}", path=self.path, offset=offset)
            self._mtp = head
        return self._mtp

    # --- tensors --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"HfqmFile {self.path!r} is closed")

    def _resolve(self, name: str | int) -> int:
        if is_int(name):
            i = int(name)
            if not 0 <= i < len(self.names):
                raise InvalidArgument(f"tensor index {i} is outside 0..{len(self.names) - 1}")
            return i
        if not isinstance(name, str):
            raise InvalidArgument(f"tensor name must be a str, got {type(name).__name__}")
        found = self._by_name.get(name)
        if found is None:
            found = self._by_canonical.get(canonical_name(name))
        if found is None:
            canonical = canonical_name(name)
            tried = f" (also tried as {canonical!r})" if canonical != name else ""
            raise TensorNotFound(f"{self.path}: no tensor {name!r}{tried}; "
                                 f"{len(self.names)} tensors")
        return found

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        return name in self._by_name or canonical_name(name) in self._by_canonical

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def keys(self) -> list[str]:
        return list(self.names)

    def info(self, name: str | int) -> TensorInfo:
        """Index entry of one tensor (aliases accepted)."""
        i = self._resolve(name)
        return self._info(i, self.records[i])

    def _info(self, i: int, rec) -> TensorInfo:
        qt = int(rec["qt"])
        return TensorInfo(self.names[i], qt, QTYPES[qt].name,
                          tuple(int(d) for d in rec["shape"][:rec["ndim"]]),
                          int(rec["group_size"]), int(rec["nbytes"]), int(rec["offset"]))

    @property
    def tensors(self) -> list[TensorInfo]:
        """Every tensor in index order (name, qt, qt_name, shape, group_size, nbytes, offset)."""
        if self._tensors is None:
            self._tensors = [self._info(i, rec) for i, rec in enumerate(self.records)]
        return self._tensors

    def _read(self, offset: int, nbytes: int) -> np.ndarray:
        """Read-only uint8 view of file bytes [offset, offset + nbytes)."""
        self._check_open()
        if self._bytes is not None:
            return self._bytes[offset:offset + nbytes]
        # Large files: one mapping per request, aligned down to the allocation granularity.
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        if nbytes == 0:
            empty = np.zeros(0, dtype=np.uint8)
            empty.flags.writeable = False   # read-only like every view of the file
            return empty
        assert self._fd is not None, "an open file not read whole keeps its descriptor"
        mapping = mmap.mmap(self._fd, offset + nbytes - start, access=mmap.ACCESS_READ,
                            offset=start)
        return np.frombuffer(mapping, dtype=np.uint8)[offset - start:]

    def raw(self, name: str | int) -> np.ndarray:
        """Zero-copy read-only ``uint8`` view of a tensor's payload."""
        i = self._resolve(name)
        rec = self.records[i]
        return self._read(int(rec["offset"]), int(rec["nbytes"]))

    def __getitem__(self, name: str | int) -> np.ndarray:
        i = self._resolve(name)
        rec = self.records[i]
        view = self._read(int(rec["offset"]), int(rec["nbytes"]))
        raw_dtype = QTYPES[int(rec["qt"])].raw_dtype
        if raw_dtype is None:
            return view
        dtype = np.dtype(raw_dtype).newbyteorder("<")
        shape = tuple(int(d) for d in rec["shape"][:rec["ndim"]])
        if int(rec["offset"]) % dtype.itemsize != 0:
            view = view.copy()
            view.flags.writeable = False
        return view.view(dtype).reshape(shape)

    def dequantize(self, name: str | int, *, basis: str = "original") -> np.ndarray:
        """Decode one tensor to a new float32 array of its shape
        (:func:`pagedkv.quant.dequantize`); a scalar (n_dims 0) comes back 0-d. A
        registered qt pagedkv does not decode raises
        :class:`~pagedkv.errors.UnsupportedQuantType`, a payload whose bytes break its
        format :class:`~pagedkv.errors.CorruptPayload`, both naming the tensor."""
        from pagedkv.errors import CorruptPayload, InvalidArgument, UnsupportedQuantType
        from pagedkv.quant import dequantize
        from pagedkv.quant.formats import check_k, resolve
        i = self._resolve(name)
        info = self._info(i, self.records[i])
        # The codecs take at least one dim; a scalar is one element either way.
        shape = info.shape or (1,)
        try:
            try:
                check_k(resolve(info.qt), shape)   # a row format's K rule, from the file
            except InvalidArgument as exc:
                raise CorruptPayload(f"its shape does not fit its quant type: {exc}") from None
            return dequantize(self.raw(i), info.qt, shape, basis=basis).reshape(info.shape)
        except (UnsupportedQuantType, CorruptPayload) as exc:
            raise type(exc)(str(exc), path=self.path, tensor=info.name,
                            offset=info.offset) from None

    # --- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Drop this object's reference to the mapping. Views handed out stay valid
        (they keep the mapping alive until released)."""
        if self._closed:
            return
        self._closed = True
        self._bytes = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if isinstance(self._mtp, HfqmFile):
            self._mtp.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.file_bytes} bytes"
        base = f", base {self.base}" if self.base else ""
        return (f"<HfqmFile {self.path!r} HFQM v{self.version}, arch {self.arch_id} "
                f"({self.arch_name}), {len(self.names)} tensors, "
                f"{self.payload_bytes} payload bytes, {state}{base}>")
