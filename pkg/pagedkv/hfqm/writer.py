"""``HfqmWriter``: streaming HFQM v1 writer (docs/contracts/hfqm-and-quant.md, '2.6 Writer
(pagedkv)' to '2.7 quantization_hash').

Payloads are written as they come, at ``data_offset`` onward, into a temporary
file next to the target; ``close()`` writes metadata, index and header into the
reserved region and renames the file into place, so an interrupted write never
leaves a partial file under the target name (the temporary file starts with the
``HFQ!`` incomplete-write magic until then).

With a ``plan`` (every tensor's name, qt, shape, group_size and data_size, in
order) the final metadata and index sizes are known up front and the file is
byte-identical to hipfire's writer. Without one, payloads are held in memory
up to ``buffer_bytes`` (the file is then exact too); past that, the writer
fixes ``data_offset`` with ``index_reserve_bytes`` of room for the rest of the
index and streams: ``data_offset`` may then exceed the docs/contracts/hfqm-and-quant.md, '2.6 Writer
(pagedkv)' formula by whole
4096-byte pages of zeros (valid for every reader), and an index that outgrows
the reservation moves the payloads once at close.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Self

import numpy as np

from pagedkv.atomic_write import AtomicFile
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.hfqm import strict_json
from pagedkv.hfqm.arch import arch_id_for
from pagedkv.hfqm.index import (
    DATA_ALIGN_BYTES,
    HEADER_BYTES,
    INCOMPLETE_MAGIC,
    MAX_DIMS,
    MAX_NUMEL,
    json_end,
    pack_header,
)
from pagedkv.hfqm.quantization_hash import QuantizationHasher
from pagedkv.hfqm.reader import canonical_name
from pagedkv.quant.qtypes import QuantType, expected_nbytes, qtype

__all__ = ["HfqmWriter", "PlannedTensor", "plan_of"]

_COPY_CHUNK_BYTES = 16 << 20
_U32_MAX = 0xFFFFFFFF


class PlannedTensor(NamedTuple):
    """One tensor a writer will receive: what the index entry will hold."""

    name: str
    qt: int
    shape: tuple[int, ...]
    group_size: int
    data_size: int


def plan_of(file) -> list[PlannedTensor]:
    """The plan that rewrites an open :class:`~pagedkv.hfqm.reader.HfqmFile` exactly."""
    return [PlannedTensor(t.name, t.qt, t.shape, t.group_size, t.nbytes) for t in file.tensors]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _index_entry(name_utf8: bytes, qt: int, shape: Sequence[int], group_size: int,
                 data_size: int) -> bytes:
    return (struct.pack("<H", len(name_utf8)) + name_utf8
            + struct.pack(f"<BB{len(shape)}IIQ", qt, len(shape), *shape, group_size, data_size))


def _check_alias(name: str, earlier: str) -> None:
    """Refuse ``name`` when an ``earlier`` tensor's name differs from it but is the same
    name for readers (``model.language_model.X``, ``model.X`` and ``X``; the reader
    refuses a file holding both)."""
    if earlier != name:
        raise InvalidArgument(f"tensor {name!r} is the same name as the earlier tensor "
                              f"{earlier!r} for readers (model.language_model.X, model.X "
                              "and X are one name); rename one of them")


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


class HfqmWriter:
    """Write one HFQM v1 file.

    ``HfqmWriter(path, *, arch_id, metadata, plan=None, add_quantization_hash=False)``;
    ``metadata`` is a dict (serialized compactly, non-ASCII kept as UTF-8) or the
    JSON text itself (``str``/``bytes``, strict JSON: no ``NaN``/``Infinity``; written
    verbatim). ``add(name, qt, shape,
    data)`` streams one tensor; ``close()`` finishes and renames; ``abort()`` (or
    leaving a ``with`` block by an exception) deletes the temporary file.
    """

    def __init__(self, path: str | os.PathLike[str], *, arch_id: int | str,
                 metadata: dict | str | bytes,
                 plan: Iterable[PlannedTensor | Sequence[Any]] | None = None,
                 add_quantization_hash: bool = False, index_reserve_bytes: int = 64 << 10,
                 buffer_bytes: int = 64 << 20, fsync: bool = True) -> None:
        self.path = os.fspath(path)
        self.arch_id = arch_id_for(arch_id)
        self._metadata = self._check_metadata(metadata, self.path)
        self.add_quantization_hash = bool(add_quantization_hash)
        if self.add_quantization_hash and not isinstance(self._metadata, dict):
            self._metadata = json.loads(self._metadata)
        self._plan = None if plan is None else [self._check_planned(p) for p in plan]
        if self._plan is not None:
            planned: dict[str, str] = {}
            for p in self._plan:
                _check_alias(p.name, planned.setdefault(canonical_name(p.name), p.name))
        self._fsync = bool(fsync)
        self._entries: list[bytes] = []
        self._names: set[str] = set()
        # canonical name (the reader's lookup key) -> the name added under it
        self._canonical: dict[str, str] = {}
        self._hasher = QuantizationHasher()
        self._payload_bytes = 0          # payload bytes received so far
        self._pending: list[bytes] = []  # payloads held until data_offset is fixed
        self._pending_bytes = 0
        self._buffer_bytes = int(buffer_bytes)
        self._index_reserve_bytes = int(index_reserve_bytes)
        # Upper bound of the metadata size (exact with a plan: the counts are known).
        self._meta_len_bound = len(self._metadata_json(self._hasher_for_sizing()))
        self.data_offset: int | None = None
        if self._plan is not None:
            index_len = 4 + sum(len(_index_entry(p.name.encode(), p.qt, p.shape, p.group_size,
                                                 p.data_size)) for p in self._plan)
            self.data_offset = _round_up(HEADER_BYTES + self._meta_len_bound + index_len,
                                         DATA_ALIGN_BYTES)
        directory = os.path.dirname(os.path.abspath(self.path))
        # Checked now, not at the final rename: a conversion must not fail after the work.
        if not self.path:
            raise InvalidArgument("the output path is empty; pass a file name such as "
                                  "'model.hfq'")
        if self.path.endswith(("/", os.sep)) and not os.path.isdir(self.path):
            # abspath drops the slash: a file named like the directory the caller meant.
            raise InvalidArgument(f"path {self.path!r} ends with a separator but is no "
                                  f"directory; pass a file name such as "
                                  f"{os.path.join(self.path, 'model.hfq')!r} (create the "
                                  f"directory first)")
        if os.path.isdir(self.path):
            raise InvalidArgument(f"path {self.path!r} is a directory; pass a file name such "
                                  f"as {os.path.join(self.path, 'model.hfq')!r}")
        if not os.path.isdir(directory):
            raise FileNotFoundError(errno.ENOENT,
                                    f"directory {directory} does not exist; create it first",
                                    self.path)
        self._file: AtomicFile | None = AtomicFile(self.path, sync=self._fsync)
        self.temp_path = self._file.temp_path
        _pwrite_all(self._file.fd, INCOMPLETE_MAGIC, 0)
        self.closed = False

    # --- argument checks ------------------------------------------------------------

    @staticmethod
    def _check_metadata(metadata: dict | str | bytes, path: str) -> dict | bytes:
        if isinstance(metadata, dict):
            return metadata
        if isinstance(metadata, str):
            metadata = metadata.encode("utf-8")
        if not isinstance(metadata, (bytes, bytearray, memoryview)):
            raise InvalidArgumentType(f"metadata must be a dict or JSON text, got "
                                      f"{type(metadata).__name__}")
        raw = bytes(metadata)
        if not raw or json_end(raw, 0, len(raw)) != len(raw):
            raise InvalidArgument(f"{path}: metadata JSON text must be exactly one JSON "
                                  "object (nothing after its closing '}')")
        try:
            # Strict: the text is written verbatim, and NaN/Infinity (which json.loads
            # takes) would make metadata that hipfire's JSON parser refuses.
            value = strict_json.loads(raw)
        except ValueError as exc:
            raise InvalidArgument(f"{path}: metadata JSON text does not parse as strict "
                                  f"JSON: {exc}") from None
        except RecursionError:
            raise InvalidArgument(f"{path}: metadata JSON text nests arrays/objects deeper "
                                  "than the JSON parser allows") from None
        if not isinstance(value, dict):
            raise InvalidArgument(f"{path}: metadata JSON text must be an object")
        return raw

    def _check_tensor(self, name: str, qt: int | str | QuantType, shape: Sequence[int],
                      group_size: int | None) -> tuple[bytes, QuantType, tuple[int, ...], int]:
        if not isinstance(name, str):
            raise InvalidArgumentType(f"tensor name must be a str, got {type(name).__name__}")
        try:
            name_utf8 = name.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"tensor name {name!r} is not encodable as UTF-8") from None
        if not 0 < len(name_utf8) <= 0xFFFF:
            raise InvalidArgument(f"tensor name {name!r} must be 1..65535 UTF-8 bytes")
        row = qtype(qt)
        if not row.registered:
            raise InvalidArgument(f"quant type {row.id} ({row.name}) is reserved, not "
                                  "writable (docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register')")
        try:
            dims = tuple(int(d) for d in shape)
        except TypeError:
            raise InvalidArgumentType(f"shape of {name!r} must be a sequence of ints, got "
                                      f"{shape!r}") from None
        if len(dims) > MAX_DIMS or any(not 0 <= d <= _U32_MAX for d in dims):
            raise InvalidArgument(f"shape {dims} of {name!r}: at most {MAX_DIMS} dims, each "
                                  f"in 0..{_U32_MAX}")
        if math.prod(d for d in dims if d) > MAX_NUMEL:
            raise InvalidArgument(f"shape {dims} of {name!r}: its non-zero dims multiply past "
                                  "2**48, the most the reader accepts")
        gs = row.index_group_size if group_size is None else int(group_size)
        if not 0 <= gs <= _U32_MAX:
            raise InvalidArgument(f"group_size {gs} of {name!r} is outside 0..{_U32_MAX}")
        return name_utf8, row, dims, gs

    def _check_planned(self, planned) -> PlannedTensor:
        p = PlannedTensor(*planned)
        _, row, dims, gs = self._check_tensor(p.name, p.qt, p.shape, p.group_size)
        need = expected_nbytes(row, dims)
        if need is not None and int(p.data_size) != need:
            raise InvalidArgument(f"plan entry {p.name!r}: data_size {p.data_size} != {need} "
                                  f"bytes required by {row.name} {dims}")
        return PlannedTensor(p.name, row.id, dims, gs, int(p.data_size))

    def _hasher_for_sizing(self) -> QuantizationHasher:
        """A hasher whose counts have the final width (the plan's, or the widest)."""
        sizing = QuantizationHasher()
        if self._plan is not None:
            sizing.tensor_count = len(self._plan)
            sizing.payload_bytes = sum(p.data_size for p in self._plan)
        else:
            sizing.tensor_count = sizing.payload_bytes = 2**64 - 1
        return sizing

    def _metadata_json(self, hasher: QuantizationHasher) -> bytes:
        if not isinstance(self._metadata, dict):
            return self._metadata
        meta = self._metadata
        if self.add_quantization_hash:
            meta = dict(meta)
            meta["quantization_hash"] = hasher.metadata_entry()
        try:
            # A lone surrogate (a JSON escape like "\\ud800" in a source file) has no UTF-8
            # form; backslashreplace writes it back as that same JSON escape.
            return json.dumps(meta, ensure_ascii=False, separators=(",", ":"),
                              allow_nan=False).encode("utf-8", "backslashreplace")
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"{self.path}: metadata is not JSON-serializable: "
                                  f"{exc}") from None
        except RecursionError:
            raise InvalidArgument(f"{self.path}: metadata nests lists/dicts deeper than the "
                                  "JSON encoder allows (or refers to itself)") from None

    # --- streaming ------------------------------------------------------------------

    def add(self, name: str, qt: int | str | QuantType, shape: Sequence[int], data: Any, *,
            group_size: int | None = None) -> None:
        """Append one tensor. ``data``: a C-contiguous buffer (NumPy array, bytes) holding
        exactly the bytes docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register' requires for
        ``qt`` and ``shape``, or an iterable of such
        buffers (written one after the other, for tensors quantized in chunks).
        ``group_size`` defaults to the register's (G, 0 for raw types).
        On any error nothing is written and the writer is unchanged."""
        if self.closed:
            raise InvalidArgument(f"HfqmWriter for {self.path!r} is closed")
        name_utf8, row, dims, gs = self._check_tensor(name, qt, shape, group_size)
        if name in self._names:
            raise InvalidArgument(f"tensor {name!r} was already added")
        canonical = canonical_name(name)
        _check_alias(name, self._canonical.get(canonical, name))
        chunks = self._as_chunks(name, data)
        need = expected_nbytes(row, dims)
        if self._plan is not None:
            if len(self._entries) >= len(self._plan):
                raise InvalidArgument(f"tensor {name!r} is beyond the plan's "
                                      f"{len(self._plan)} tensors")
            p = self._plan[len(self._entries)]
            if (p.name, p.qt, p.shape, p.group_size) != (name, row.id, dims, gs):
                raise InvalidArgument(f"tensor #{len(self._entries)} {name!r} {row.name} "
                                      f"{dims} group_size {gs} differs from the plan's "
                                      f"{p.name!r} qt {p.qt} {p.shape} group_size "
                                      f"{p.group_size}")
            need = p.data_size
        if need is None and not isinstance(chunks, list):
            chunks = list(chunks)  # no size rule: the size must be known before hashing
        if isinstance(chunks, list):
            given = sum(c.nbytes for c in chunks)
            if need is not None and given != need:
                raise InvalidArgument(f"tensor {name!r}: {given} bytes given, {row.name} "
                                      f"{dims} needs {need}")
            need = given
        assert need is not None, "set by the size rule, or by listing the chunks when none"
        start = self._payload_bytes
        saved = (self._hasher.snapshot(), len(self._pending), self._pending_bytes)
        written = 0
        try:
            # The hash covers the index fields, then the payload.
            self._hasher.begin_tensor(name_utf8, row.id, dims, gs, need)
            for chunk in chunks:
                self._write_payload(chunk, start + written)
                self._hasher.update(chunk)
                written += chunk.nbytes
            if written != need:
                raise InvalidArgument(f"tensor {name!r}: {written} bytes given, "
                                      f"{row.name} {dims} needs {need}")
        except BaseException:
            # Bytes already on disk past `start` are overwritten by the next tensor or
            # cut at close; held bytes are dropped here.
            self._hasher.restore(saved[0])
            if self.data_offset is None:
                del self._pending[saved[1]:]
                self._pending_bytes = saved[2]
            raise
        self._entries.append(_index_entry(name_utf8, row.id, dims, gs, need))
        self._names.add(name)
        self._canonical[canonical] = name
        self._payload_bytes = start + need

    def _write_payload(self, chunk: memoryview, rel_offset: int) -> None:
        if self.data_offset is not None:
            _pwrite_all(self._open_fd, chunk, self.data_offset + rel_offset)
            return
        self._pending.append(bytes(chunk))
        self._pending_bytes += chunk.nbytes
        if self._pending_bytes > self._buffer_bytes:
            # Too much to hold: fix data_offset with room for the index so far plus the
            # reserve, and stream from here on.
            index_len = 4 + sum(map(len, self._entries)) + self._index_reserve_bytes
            self._fix_data_offset(_round_up(HEADER_BYTES + self._meta_len_bound + index_len,
                                            DATA_ALIGN_BYTES))

    @property
    def _open_fd(self) -> int:
        """The temporary file's descriptor, held from ``__init__`` until close or abort."""
        assert self._file is not None, "writes happen only while the writer is open"
        return self._file.fd

    def _fix_data_offset(self, data_offset: int) -> None:
        self.data_offset = data_offset
        pos = data_offset
        fd = self._open_fd
        for held in self._pending:
            _pwrite_all(fd, held, pos)
            pos += len(held)
        self._pending = []
        self._pending_bytes = 0

    @staticmethod
    def _as_chunks(name: str, data: Any):
        def as_bytes(buf: Any) -> memoryview:
            try:
                view = memoryview(buf)
            except TypeError:
                raise InvalidArgumentType(f"tensor {name!r}: data must be a buffer (NumPy "
                                          f"array, bytes), got {type(buf).__name__}") from None
            if not view.c_contiguous:
                raise InvalidArgument(f"tensor {name!r}: data must be C-contiguous "
                                      "(np.ascontiguousarray)")
            return view.cast("B") if view.ndim != 1 or view.format != "B" else view
        if isinstance(data, (bytes, bytearray, memoryview, np.ndarray)):
            return [as_bytes(data)]
        try:
            return (as_bytes(c) for c in iter(data))
        except TypeError:
            return [as_bytes(data)]

    # --- finishing ------------------------------------------------------------------

    def close(self) -> None:
        """Write metadata, index and header, then rename into place. A writer with a
        plan must have received every planned tensor; if it has not, the temporary file
        is deleted (as for every other failure of ``close``) and ``InvalidArgument``
        raised: the writer is closed either way."""
        if self.closed:
            return
        if self._plan is not None and len(self._entries) != len(self._plan):
            expected = self._plan[len(self._entries)].name
            # A `with` block ends in close(): raising without aborting would keep the
            # temporary file (and its descriptor) until the writer is garbage-collected.
            self.abort()
            raise InvalidArgument(f"{len(self._entries)} of the plan's {len(self._plan)} "
                                  f"tensors were added; next expected: {expected!r}; "
                                  f"nothing was written to {self.path}")
        try:
            meta = self._metadata_json(self._hasher)
            index = struct.pack("<I", len(self._entries)) + b"".join(self._entries)
            needed = _round_up(HEADER_BYTES + len(meta) + len(index), DATA_ALIGN_BYTES)
            if self.data_offset is None:
                self._fix_data_offset(needed)
            elif needed > self.data_offset:
                self._move_payloads(needed)
            data_offset = self.data_offset
            assert data_offset is not None, "fixed or moved just above"
            fd = self._open_fd
            region = meta + index
            _pwrite_all(fd, region + bytes(data_offset - HEADER_BYTES - len(region)),
                        HEADER_BYTES)
            os.ftruncate(fd, data_offset + self._payload_bytes)
            _pwrite_all(fd, pack_header(self.arch_id, len(self._entries), data_offset), 0)
            assert self._file is not None, "open: _open_fd checked it"
            self._file.commit()
            self._file = None
        except BaseException:
            self.abort()
            raise
        self.closed = True

    def _move_payloads(self, new_data_offset: int) -> None:
        """Shift the payloads forward (copying from the end) to make room for the index."""
        old = self.data_offset
        assert old is not None, "payloads move only once their offset is fixed"
        fd = self._open_fd
        delta = new_data_offset - old
        end = old + self._payload_bytes
        while end > old:
            start = max(old, end - _COPY_CHUNK_BYTES)
            _pwrite_all(fd, os.pread(fd, end - start, start), start + delta)
            end = start
        self.data_offset = new_data_offset

    def abort(self) -> None:
        """Discard the file being written (the target path is left untouched)."""
        if self._file is not None:
            self._file.abort()
            self._file = None
        self.closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        if getattr(self, "_file", None) is not None:
            self.abort()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (f"<HfqmWriter {self.path!r} arch {self.arch_id}, {len(self._entries)} tensors, "
                f"{self._payload_bytes} payload bytes, {state}>")
