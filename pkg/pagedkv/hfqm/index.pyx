# cython: language_level=3
"""HFQM v1 header and tensor-index parser (docs/contracts/hfqm-and-quant.md, '2.1 Header (32 bytes)
and body' to '2.4 Reader validation').

The index is parsed in one nogil pass into a structured array of
``pkv_hfqm_tensor_record`` (``TENSOR_RECORD_DTYPE``); only the names become
Python strings. Every field read is bounds-checked against the section, so a
truncated or corrupt file raises a :class:`~pagedkv.errors.FormatError`
subclass and never reads past the buffer it was given.
"""

import numpy as np

from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t

from pagedkv.struct_fields cimport field_table, pkv_struct_field

from pagedkv.c_struct_dtype import dtype_of_c_struct
from pagedkv.errors import (
    BadMagic, BadMetadata, BadName, CountMismatch, SizeMismatch, Truncated,
    UnknownQuantType, UnsupportedVersion,
)


cdef extern from *:
    """
    #include "pagedkv/hfqm.h"
    #include "pagedkv/struct_fields.h"
    /* The members the NumPy views carry (the record's pad_ is not one of them). */
    static const pkv_struct_field pkv_hfqm_record_fields[] = {
        PKV_STRUCT_FIELD(pkv_hfqm_tensor_record, offset),
        PKV_STRUCT_FIELD(pkv_hfqm_tensor_record, nbytes),
        PKV_STRUCT_FIELD(pkv_hfqm_tensor_record, name_offset),
        PKV_STRUCT_FIELD(pkv_hfqm_tensor_record, shape),
        PKV_STRUCT_FIELD(pkv_hfqm_tensor_record, name_len),
        PKV_STRUCT_FIELD(pkv_hfqm_tensor_record, group_size),
        PKV_STRUCT_FIELD(pkv_hfqm_tensor_record, qt),
        PKV_STRUCT_FIELD(pkv_hfqm_tensor_record, ndim)};
    static const pkv_struct_field pkv_hfqm_header_fields[] = {
        PKV_STRUCT_FIELD(pkv_hfqm_header, magic),
        PKV_STRUCT_FIELD(pkv_hfqm_header, version),
        PKV_STRUCT_FIELD(pkv_hfqm_header, arch_id),
        PKV_STRUCT_FIELD(pkv_hfqm_header, n_tensors),
        PKV_STRUCT_FIELD(pkv_hfqm_header, metadata_offset),
        PKV_STRUCT_FIELD(pkv_hfqm_header, data_offset)};
    #define PKV_N_HFQM_RECORD_FIELDS PKV_COUNT_OF(pkv_hfqm_record_fields)
    #define PKV_N_HFQM_HEADER_FIELDS PKV_COUNT_OF(pkv_hfqm_header_fields)
    """
    const pkv_struct_field pkv_hfqm_record_fields[]
    const pkv_struct_field pkv_hfqm_header_fields[]
    Py_ssize_t PKV_N_HFQM_RECORD_FIELDS
    Py_ssize_t PKV_N_HFQM_HEADER_FIELDS


#: NumPy twin of ``pkv_hfqm_tensor_record`` (pagedkv/hfqm.h), built from the struct as
#: compiled; offsets are absolute file offsets in bytes, ``shape`` is zero past ``ndim``.
TENSOR_RECORD_DTYPE = dtype_of_c_struct(
    sizeof(pkv_hfqm_tensor_record),
    field_table(pkv_hfqm_record_fields, PKV_N_HFQM_RECORD_FIELDS))

#: NumPy twin of ``pkv_hfqm_header`` (pagedkv/hfqm.h), the 32-byte on-disk header.
HEADER_DTYPE = dtype_of_c_struct(
    sizeof(pkv_hfqm_header), field_table(pkv_hfqm_header_fields, PKV_N_HFQM_HEADER_FIELDS))

HEADER_BYTES = PKV_HFQM_HEADER_BYTES
#: The 4 magic bytes of a complete file, and of one still being written.
MAGIC = (<uint32_t>PKV_HFQM_MAGIC_U32).to_bytes(4, "little")
INCOMPLETE_MAGIC = (<uint32_t>PKV_HFQM_INCOMPLETE_U32).to_bytes(4, "little")
DATA_ALIGN_BYTES = PKV_HFQM_DATA_ALIGN_BYTES
MAX_DIMS = PKV_HFQM_MAX_DIMS
VERSION = PKV_HFQM_VERSION

#: Cap on the product of a shape's non-zero dims (PKV_HFQM_MAX_NUMEL): far above any
#: real tensor, it keeps every size computation inside u64 and every shape allocatable.
MAX_NUMEL = PKV_HFQM_MAX_NUMEL
#: Bytes of an MTP bundle's trailer ("HFBNDMTP" ++ u64 mtp_off).
MTP_TRAILER_BYTES = PKV_HFQM_MTP_TRAILER_BYTES

cdef enum IndexFault:
    FAULT_NONE = 0
    FAULT_INDEX_TRUNCATED
    FAULT_NDIM
    FAULT_NUMEL
    FAULT_UNKNOWN_QT
    FAULT_CALIB_QT
    FAULT_K_MULTIPLE
    FAULT_NOT_SQUARE
    FAULT_SIZE
    FAULT_PAYLOAD_TRUNCATED

cdef struct IndexError_:
    int fault
    Py_ssize_t tensor      # entry being parsed
    uint64_t offset        # section-relative byte offset of the faulty field/payload
    uint64_t value
    uint64_t expected


cdef inline uint16_t load_u16(const uint8_t* p) noexcept nogil:
    return <uint16_t>(p[0] | (<uint16_t>p[1] << 8))


cdef inline uint32_t load_u32(const uint8_t* p) noexcept nogil:
    return (<uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16)
            | (<uint32_t>p[3] << 24))


cdef inline uint64_t load_u64(const uint8_t* p) noexcept nogil:
    return <uint64_t>load_u32(p) | (<uint64_t>load_u32(p + 4) << 32)


cdef struct BraceState:
    Py_ssize_t depth
    bint in_str
    bint esc


cdef Py_ssize_t scan_braces(const uint8_t* buf, Py_ssize_t start, Py_ssize_t limit,
                            BraceState* st) noexcept nogil:
    """The docs/contracts/hfqm-and-quant.md, '2.2 End of the metadata JSON' brace scan over
    ``buf[start:limit]``, resuming from ``st``: the offset one
    past the '}' that closes the object, or -1 when the bytes run out first."""
    # The state lives in locals during the loop: buf is a byte pointer, which may alias
    # *st, so fields read through st would be reloaded after every byte.
    cdef Py_ssize_t p, found = -1
    cdef Py_ssize_t depth = st.depth
    cdef bint in_str = st.in_str
    cdef bint esc = st.esc
    cdef uint8_t c
    for p in range(start, limit):
        c = buf[p]
        if in_str:
            if esc:
                esc = False
            elif c == b'\\':
                esc = True
            elif c == b'"':
                in_str = False
        elif c == b'"':
            in_str = True
        elif c == b'{':
            depth += 1
        elif c == b'}':
            depth -= 1
            if depth == 0:
                found = p + 1
                break
    st.depth = depth
    st.in_str = in_str
    st.esc = esc
    return found


cdef Py_ssize_t scan_json_end(const uint8_t* buf, Py_ssize_t start,
                              Py_ssize_t limit) noexcept nogil:
    """docs/contracts/hfqm-and-quant.md, '2.2 End of the metadata JSON' brace scan: the offset one
    past the closing '}', -1 if unterminated
    below ``limit``, -2 if ``buf[start]`` is not '{'."""
    cdef BraceState st
    if start >= limit or buf[start] != b'{':
        return -2
    st.depth = 0
    st.in_str = False
    st.esc = False
    return scan_braces(buf, start, limit, &st)


cdef class JsonEndScanner:
    """The docs/contracts/hfqm-and-quant.md, '2.2 End of the metadata JSON' brace scan fed chunk by
    chunk (the read path of files too large to map:
    the metadata is scanned in bounded chunks, never held whole).

    ``feed(chunk)`` returns the offset in ``chunk`` one past the closing '}', -1 when
    more bytes are needed, or -2 when the first byte fed is not '{'."""

    cdef BraceState st
    cdef bint started

    def __cinit__(self):
        self.st.depth = 0
        self.st.in_str = False
        self.st.esc = False
        self.started = False

    def feed(self, const uint8_t[::1] chunk not None):
        cdef Py_ssize_t n = chunk.shape[0]
        cdef Py_ssize_t end
        if n == 0:
            return -1
        if not self.started:
            if chunk[0] != b'{':
                return -2
            self.started = True
        with nogil:
            end = scan_braces(&chunk[0], 0, n, &self.st)
        return end


cdef uint64_t parse_entries(const uint8_t* reg, uint64_t reg_start, uint64_t pos,
                            uint64_t index_limit, uint64_t first, uint64_t n,
                            uint64_t* payload_pos, uint64_t section_bytes,
                            uint64_t abs_base, bint calib_ok,
                            pkv_hfqm_tensor_record* recs, IndexError_* err) noexcept nogil:
    """Parse entries ``first .. first + n - 1`` starting at section offset ``pos``, into
    ``recs[first ..]``. ``reg`` holds the section's bytes from ``reg_start`` up to at
    least ``index_limit``; entries must end by ``index_limit``, payloads (the next at
    ``*payload_pos``, advanced here) by ``section_bytes``. Returns the offset after the
    last entry (section-relative), or 0 with ``err`` filled."""
    cdef uint64_t i, d, numel, nonzero, k, expected
    cdef uint64_t payload = payload_pos[0]
    cdef uint32_t name_len, status, flags
    cdef uint8_t qt, ndim
    cdef pkv_hfqm_tensor_record* rec
    for i in range(first, first + n):
        rec = &recs[i]
        err.tensor = <Py_ssize_t>i
        err.offset = pos
        if index_limit - pos < 2:
            err.fault = FAULT_INDEX_TRUNCATED
            return 0
        name_len = load_u16(reg + (pos - reg_start))
        pos += 2
        err.offset = pos
        if index_limit - pos < name_len:
            err.fault = FAULT_INDEX_TRUNCATED
            return 0
        rec.name_offset = abs_base + pos
        rec.name_len = name_len
        pos += name_len
        err.offset = pos
        if index_limit - pos < 2:
            err.fault = FAULT_INDEX_TRUNCATED
            return 0
        qt = reg[pos - reg_start]
        ndim = reg[pos + 1 - reg_start]
        rec.qt = qt
        if ndim > PKV_HFQM_MAX_DIMS:
            err.offset = pos + 1
            err.value = ndim
            err.fault = FAULT_NDIM
            return 0
        rec.ndim = ndim
        pos += 2
        err.offset = pos
        if index_limit - pos < 4 * <uint64_t>ndim + 12:
            err.fault = FAULT_INDEX_TRUNCATED
            return 0
        numel = 1
        nonzero = 1
        for d in range(ndim):
            rec.shape[d] = load_u32(reg + (pos - reg_start) + 4 * d)
            # nonzero <= 2**48 and a dim < 2**32: test before multiplying (no u64 wrap).
            if rec.shape[d] != 0:
                if nonzero > PKV_HFQM_MAX_NUMEL // rec.shape[d]:
                    err.fault = FAULT_NUMEL
                    return 0
                nonzero *= rec.shape[d]
            numel *= rec.shape[d]
        pos += 4 * <uint64_t>ndim
        rec.group_size = load_u32(reg + (pos - reg_start))
        rec.nbytes = load_u64(reg + (pos - reg_start) + 4)
        err.offset = pos + 4
        pos += 12
        status = pkv_qt_status(qt)
        if status == PKV_QT_STATUS_UNKNOWN or status == PKV_QT_STATUS_RESERVED:
            err.offset = rec.name_offset - abs_base + name_len
            err.value = qt
            err.fault = FAULT_UNKNOWN_QT
            return 0
        if status == PKV_QT_STATUS_CALIB and not calib_ok:
            err.offset = rec.name_offset - abs_base + name_len
            err.value = qt
            err.fault = FAULT_CALIB_QT
            return 0
        k = rec.shape[ndim - 1] if ndim > 0 else 1
        flags = pkv_qt_flags(qt)
        if (flags & PKV_QT_FLAG_K_MULT_256) and k % 256 != 0:
            err.value = k
            err.fault = FAULT_K_MULTIPLE
            return 0
        # A Hessian is [K, K] (docs/contracts/hfqm-and-quant.md, '4.7 P2 formats'): K <= 2**24 then,
        # where any K < 2**32 of another shape overflowed its u64 size (4K + K(K-1)).
        if (pkv_qt_size_rule(qt) == PKV_QT_SIZE_HESSIAN
                and (ndim != 2 or rec.shape[0] != rec.shape[1])):
            err.fault = FAULT_NOT_SQUARE
            return 0
        if pkv_qt_size_rule(qt) != PKV_QT_SIZE_NONE:
            expected = pkv_qt_expected_nbytes(qt, numel, k)
            if rec.nbytes != expected:
                err.value = rec.nbytes
                err.expected = expected
                err.fault = FAULT_SIZE
                return 0
        if rec.nbytes > section_bytes - payload:
            err.offset = payload
            err.value = rec.nbytes
            err.expected = section_bytes - payload
            err.fault = FAULT_PAYLOAD_TRUNCATED
            return 0
        rec.offset = abs_base + payload
        payload += rec.nbytes
    payload_pos[0] = payload
    err.fault = FAULT_NONE
    return pos


cdef class ParsedIndex:
    """What :func:`parse_index` found. Offsets ending in ``_abs`` are absolute file
    offsets; ``metadata_offset``/``data_offset`` are as stored (relative to base)."""

    cdef readonly uint32_t version
    cdef readonly uint32_t arch_id
    cdef readonly uint32_t n_tensors
    cdef readonly uint64_t metadata_offset
    cdef readonly uint64_t data_offset
    cdef readonly uint64_t json_end_abs
    cdef readonly uint64_t index_end_abs
    cdef readonly object records
    cdef readonly list names
    cdef readonly dict index_of

    def __repr__(self):
        return (f"ParsedIndex(version={self.version}, arch_id={self.arch_id}, "
                f"n_tensors={self.n_tensors}, metadata_offset={self.metadata_offset}, "
                f"data_offset={self.data_offset})")


def parse_header(const uint8_t[::1] section not None, str path):
    """Validate the 32-byte header at the start of ``section`` (docs/contracts/hfqm-and-quant.md,
    '2.4 Reader validation' rule 1).

    Returns ``(version, arch_id, n_tensors, metadata_offset, data_offset)``.
    """
    cdef Py_ssize_t n = section.shape[0]
    cdef const uint8_t* p
    if n < PKV_HFQM_HEADER_BYTES:
        raise Truncated(f"file holds {n} bytes from the section start, the HFQM header "
                        f"needs {PKV_HFQM_HEADER_BYTES}", path=path, offset=n)
    p = &section[0]
    magic = load_u32(p)
    if magic == PKV_HFQM_INCOMPLETE_U32:
        raise BadMagic("magic is 'HFQ!', the marker of an incomplete (interrupted) write; "
                       "re-export the file", path=path, offset=0)
    if magic != PKV_HFQM_MAGIC_U32:
        raise BadMagic(f"magic is {bytes(section[:4])!r}, expected b'HFQM': not an HFQM "
                       "file (a safetensors model converts with `pagedkv convert`)",
                       path=path, offset=0)
    version = load_u32(p + PKV_HFQM_HDR_VERSION_OFF)
    if version == 2:
        raise UnsupportedVersion("HFQM v2 (xynexus fork layout) is not supported; "
                                 "re-export as HFQM v1", path=path,
                                 offset=PKV_HFQM_HDR_VERSION_OFF)
    if version != PKV_HFQM_VERSION:
        raise UnsupportedVersion(f"HFQM version {version} is not supported (pagedkv reads "
                                 f"version 1)", path=path, offset=PKV_HFQM_HDR_VERSION_OFF)
    return (version, load_u32(p + PKV_HFQM_HDR_ARCH_ID_OFF),
            load_u32(p + PKV_HFQM_HDR_N_TENSORS_OFF),
            load_u64(p + PKV_HFQM_HDR_METADATA_OFFSET_OFF),
            load_u64(p + PKV_HFQM_HDR_DATA_OFFSET_OFF))


def check_offsets(uint64_t metadata_offset, uint64_t data_offset, uint64_t section_bytes,
                  uint64_t abs_base, str path):
    """docs/contracts/hfqm-and-quant.md, '2.4 Reader validation' rule 2: ``32 <= metadata_offset <=
    data_offset <= section_bytes``, checked from
    the header alone, before any byte past it is read."""
    if (PKV_HFQM_HEADER_BYTES <= metadata_offset <= data_offset
            and data_offset > section_bytes):
        raise Truncated(
            f"the file is truncated: its header puts the data section at byte "
            f"{data_offset} of the section but only {section_bytes} bytes are there "
            "(an interrupted copy or download?)",
            path=path, offset=abs_base + PKV_HFQM_HDR_DATA_OFFSET_OFF)
    if not (PKV_HFQM_HEADER_BYTES <= metadata_offset <= data_offset <= section_bytes):
        raise Truncated(
            f"header offsets out of range: need 32 <= metadata_offset ({metadata_offset}) "
            f"<= data_offset ({data_offset}) <= bytes from section start "
            f"({section_bytes})", path=path, offset=abs_base + PKV_HFQM_HDR_METADATA_OFFSET_OFF)


def raise_json_end_error(Py_ssize_t code, uint64_t metadata_offset, uint64_t data_offset,
                         uint64_t abs_base, str path):
    """The BadMetadata of a failed docs/contracts/hfqm-and-quant.md, '2.2 End of the metadata JSON'
    scan: ``code`` -2 (no '{') or -1 (unterminated)."""
    if code == -2:
        raise BadMetadata("metadata does not start with '{'", path=path,
                          offset=abs_base + metadata_offset)
    raise BadMetadata("unterminated HFQM metadata JSON: no closing '}' before "
                      f"data_offset {data_offset}", path=path,
                      offset=abs_base + metadata_offset)


def parse_index(const uint8_t[::1] section not None, uint64_t section_bytes,
                uint64_t abs_base, str path, bint calib_ok=False):
    """Parse header, metadata extent and tensor index of one HFQM section.

    ``section`` holds the section's bytes from its start (``abs_base`` in the
    file) at least up to ``data_offset``; ``section_bytes`` is the number of file
    bytes from ``abs_base`` to EOF (payload bounds). ``calib_ok`` admits qt 130
    (``*.calib.hfq`` files). Raises a :class:`~pagedkv.errors.FormatError` subclass
    on any violation of docs/contracts/hfqm-and-quant.md, '2.4 Reader validation' rules 1-5.
    """
    cdef Py_ssize_t have = section.shape[0]
    cdef Py_ssize_t json_end
    header = parse_header(section, path)
    cdef uint64_t metadata_offset = header[3]
    cdef uint64_t data_offset = header[4]
    check_offsets(metadata_offset, data_offset, section_bytes, abs_base, path)
    if <uint64_t>have < data_offset:
        raise Truncated(f"buffer holds {have} bytes, the index region ends at data_offset "
                        f"{data_offset}", path=path, offset=abs_base + have)
    with nogil:
        json_end = scan_json_end(&section[0], <Py_ssize_t>metadata_offset,
                                 <Py_ssize_t>data_offset)
    if json_end < 0:
        raise_json_end_error(json_end, metadata_offset, data_offset, abs_base, path)
    return _parse_index_region(header, section, 0, <uint64_t>json_end, section_bytes,
                               abs_base, path, calib_ok)


def parse_index_region(tuple header not None, const uint8_t[::1] region not None,
                       uint64_t json_end, uint64_t section_bytes, uint64_t abs_base, str path,
                       bint calib_ok=False):
    """Parse the tensor index from ``region``, the section's bytes from ``json_end`` (the
    first byte after the metadata JSON) on; for readers that cannot map the file.

    ``header`` is :func:`parse_header`'s tuple, already checked by
    :func:`check_offsets`. ``region`` may end before ``data_offset``: when the index
    runs past its end (but not past ``data_offset``) this returns None, and the caller
    reads a longer region and calls again. Otherwise as :func:`parse_index`.
    """
    return _parse_index_region(header, region, json_end, json_end, section_bytes, abs_base,
                               path, calib_ok)


cdef enum:
    RECORDS_FIRST_BATCH = 1024   # records allocated before any entry has parsed


cdef object _parse_index_region(tuple header, const uint8_t[::1] region, uint64_t reg_start,
                                uint64_t json_end, uint64_t section_bytes, uint64_t abs_base,
                                str path, bint calib_ok):
    cdef ParsedIndex out = ParsedIndex.__new__(ParsedIndex)
    cdef uint64_t count, pos, max_entries, limit, done, batch, payload
    cdef uint64_t index_end = 0
    cdef IndexError_ err
    cdef pkv_hfqm_tensor_record* recs = NULL
    cdef uint8_t[::1] rec_bytes
    cdef const uint8_t* reg = &region[0] if region.shape[0] else NULL
    (out.version, out.arch_id, out.n_tensors, out.metadata_offset,
     out.data_offset) = header
    # The region may stop short of data_offset only on the read path; then an index that
    # runs past it needs more bytes, not an error.
    limit = min(reg_start + <uint64_t>region.shape[0], out.data_offset)
    cdef bint complete = limit == out.data_offset
    out.json_end_abs = abs_base + json_end
    pos = json_end
    if limit - pos < PKV_HFQM_INDEX_COUNT_BYTES:
        if not complete:
            return None
        raise Truncated("tensor index count runs past data_offset "
                        f"{out.data_offset}", path=path, offset=abs_base + pos)
    count = load_u32(reg + (pos - reg_start))
    if count != out.n_tensors:
        raise CountMismatch(f"index count {count} != header n_tensors {out.n_tensors}",
                            path=path, offset=abs_base + pos)
    pos += PKV_HFQM_INDEX_COUNT_BYTES
    # Each entry takes at least 16 bytes: refuse a count the region cannot hold.
    max_entries = (out.data_offset - pos) // PKV_HFQM_INDEX_ENTRY_FIXED_BYTES
    if count > max_entries:
        raise Truncated(f"index declares {count} tensors, the {out.data_offset - pos} bytes "
                        f"before data_offset hold at most {max_entries}", path=path,
                        offset=abs_base + pos)
    # Records grow with the entries that parse (a batch, then doubling): a forged count
    # under a forged data_offset costs memory only for entries that are really there.
    records = np.zeros(min(count, RECORDS_FIRST_BATCH), dtype=TENSOR_RECORD_DTYPE)
    payload = out.data_offset
    done = 0
    err.fault = FAULT_NONE
    err.offset = pos
    while done < count:
        if done == <uint64_t>len(records):
            records = np.concatenate([records, np.zeros(min(count - done, done),
                                                        dtype=TENSOR_RECORD_DTYPE)])
        rec_bytes = records.view(np.uint8)
        recs = <pkv_hfqm_tensor_record*>&rec_bytes[0]
        batch = <uint64_t>len(records) - done
        with nogil:
            index_end = parse_entries(reg, reg_start, pos, limit, done, batch, &payload,
                                      section_bytes, abs_base, calib_ok, recs, &err)
        if err.fault != FAULT_NONE:
            if err.fault == FAULT_INDEX_TRUNCATED and not complete:
                return None
            _raise_index_fault(&err, records, region, reg_start, abs_base, path)
        pos = index_end
        done += batch
    if count == 0:
        index_end = pos
    out.records = records
    out.index_of = {}
    out.names = _decode_names(records, region, reg_start, abs_base, path, out.index_of)
    out.index_end_abs = abs_base + index_end
    return out


cdef str _name_for_message(object records, const uint8_t[::1] region, uint64_t reg_start,
                           uint64_t abs_base, Py_ssize_t i):
    cdef uint64_t start
    rec = records[i]
    if rec["name_offset"] == 0:
        return f"#{i}"
    start = int(rec["name_offset"]) - abs_base - reg_start
    return bytes(region[start:start + int(rec["name_len"])]).decode("utf-8", "replace")


cdef list _decode_names(object records, const uint8_t[::1] region, uint64_t reg_start,
                        uint64_t abs_base, str path, dict index_of):
    """Names as str, in index order; fills ``index_of`` (name -> position). Raises
    BadName for non-UTF-8 or duplicate names."""
    cdef Py_ssize_t i, n = len(records)
    cdef const pkv_hfqm_tensor_record* recs
    cdef const uint8_t[::1] rec_bytes
    cdef uint64_t start
    cdef list names = [None] * n
    if n == 0:
        return names
    rec_bytes = records.view(np.uint8)
    recs = <const pkv_hfqm_tensor_record*>&rec_bytes[0]
    for i in range(n):
        start = recs[i].name_offset - abs_base - reg_start
        try:
            name = PyUnicode_DecodeUTF8(<const char*>&region[0] + start, recs[i].name_len,
                                        NULL)
        except UnicodeDecodeError as exc:
            chunk = bytes(region[start:start + recs[i].name_len])
            raise BadName(f"tensor #{i} name {chunk!r} is not UTF-8 ({exc.reason})",
                          path=path, tensor=chunk.decode("utf-8", "replace"),
                          offset=recs[i].name_offset) from None
        if name in index_of:
            raise BadName(f"tensor name {name!r} appears twice (entries #{index_of[name]} "
                          f"and #{i})", path=path, tensor=name, offset=recs[i].name_offset)
        index_of[name] = i
        names[i] = name
    return names


cdef _raise_index_fault(IndexError_* err, object records, const uint8_t[::1] region,
                        uint64_t reg_start, uint64_t abs_base, str path):
    name = _name_for_message(records, region, reg_start, abs_base, err.tensor)
    offset = abs_base + err.offset
    fault = err.fault
    if fault == FAULT_INDEX_TRUNCATED:
        raise Truncated(f"index entry #{err.tensor} runs past the index region",
                        path=path, tensor=name, offset=offset)
    if fault == FAULT_NDIM:
        raise SizeMismatch(f"n_dims {err.value} exceeds the {PKV_HFQM_MAX_DIMS} dims "
                           "pagedkv reads", path=path, tensor=name, offset=offset)
    if fault == FAULT_NUMEL:
        raise SizeMismatch("shape has more than 2**48 elements (counting only its non-zero "
                           "dims)", path=path, tensor=name,
                           offset=offset)
    if fault == FAULT_UNKNOWN_QT:
        raise UnknownQuantType(
            f"quant type {err.value} is not a registered id "
            "(docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register')",
            path=path, tensor=name, offset=offset)
    if fault == FAULT_CALIB_QT:
        raise UnknownQuantType(
            f"quant type {err.value} exists only in calibration files (*.calib.hfq)",
            path=path, tensor=name, offset=offset)
    if fault == FAULT_K_MULTIPLE:
        raise SizeMismatch(f"quant type {records[err.tensor]['qt']} needs the last dim K "
                           f"to be a multiple of 256, got K={err.value}", path=path,
                           tensor=name, offset=offset)
    if fault == FAULT_NOT_SQUARE:
        rec = records[err.tensor]
        shape = tuple(int(d) for d in rec['shape'][:rec['ndim']])
        raise SizeMismatch(f"quant type {rec['qt']} (a calibration Hessian) needs a square "
                           f"[K, K] shape, got {shape}", path=path, tensor=name, offset=offset)
    if fault == FAULT_SIZE:
        rec = records[err.tensor]
        shape = tuple(int(d) for d in rec['shape'][:rec['ndim']])
        raise SizeMismatch(f"data_size {err.value} != {err.expected} bytes required by "
                           f"quant type {rec['qt']} and shape {shape}",
                           path=path, tensor=name, offset=offset)
    if fault == FAULT_PAYLOAD_TRUNCATED:
        raise Truncated(f"payload of {err.value} bytes runs past the end of the file "
                        f"({err.expected} bytes left)", path=path, tensor=name, offset=offset)
    raise AssertionError(f"unhandled index fault {fault}")


def json_end(const uint8_t[::1] buf not None, Py_ssize_t start, Py_ssize_t limit):
    """The docs/contracts/hfqm-and-quant.md, '2.2 End of the metadata JSON' brace scan over
    ``buf[start:limit]``: the offset one past the closing
    '}' (the first byte of the index); -1 if unterminated, -2 if ``buf[start]`` is
    not '{'."""
    if start < 0 or limit > buf.shape[0] or start > limit:
        raise ValueError(f"bad range [{start}, {limit}) for a {buf.shape[0]}-byte buffer")
    if start == limit:
        return -2
    return scan_json_end(&buf[0], start, limit)


def record_layout():
    """``{"itemsize": sizeof, field: offsetof, ...}`` of ``pkv_hfqm_tensor_record``."""
    return {"itemsize": sizeof(pkv_hfqm_tensor_record),
            **{f[0]: f[1] for f in field_table(pkv_hfqm_record_fields, PKV_N_HFQM_RECORD_FIELDS)}}


def header_layout():
    """``{"itemsize": sizeof, field: offsetof, ...}`` of ``pkv_hfqm_header``, plus the
    ``PKV_HFQM_HDR_*_OFF`` constants under ``"const_<field>"``."""
    layout = {"itemsize": sizeof(pkv_hfqm_header),
              **{f[0]: f[1] for f in field_table(pkv_hfqm_header_fields, PKV_N_HFQM_HEADER_FIELDS)}}
    layout.update(const_magic=PKV_HFQM_HDR_MAGIC_OFF, const_version=PKV_HFQM_HDR_VERSION_OFF,
                  const_arch_id=PKV_HFQM_HDR_ARCH_ID_OFF,
                  const_n_tensors=PKV_HFQM_HDR_N_TENSORS_OFF,
                  const_metadata_offset=PKV_HFQM_HDR_METADATA_OFFSET_OFF,
                  const_data_offset=PKV_HFQM_HDR_DATA_OFFSET_OFF)
    return layout


def pack_header(arch_id, n_tensors, data_offset):
    """The 32-byte v1 header a writer stores (docs/contracts/hfqm-and-quant.md, '2.1 Header
    (32 bytes) and body'): ``HEADER_DTYPE`` with magic "HFQM", version 1 and the metadata
    at ``PKV_HFQM_METADATA_OFFSET``; :func:`parse_header` reads it back."""
    header = np.zeros((), HEADER_DTYPE)
    header["magic"] = np.frombuffer(MAGIC, np.uint8)
    header["version"] = PKV_HFQM_VERSION
    header["arch_id"] = arch_id
    header["n_tensors"] = n_tensors
    header["metadata_offset"] = PKV_HFQM_METADATA_OFFSET
    header["data_offset"] = data_offset
    return header.tobytes()
