# cython: language_level=3
"""Cold-object codec (docs/contracts/cold-tier.md, '6. Object format'): safetensors containers of
one KV block.

Encoding never copies the payload: :func:`encode_block` returns the header bytes and the
caller hands ``(header, tokens, buffer)`` to one ``os.writev``. The payload checksum is
SHA-256 over memoryview slices of the pool's ``read_block`` buffer (hashlib releases the
GIL for them). Decoding is fail-closed in the order of docs/contracts/cold-tier.md, '6.6 Decoding'
and returns zero-copy NumPy
views of the bytes it was given; every failure raises a :class:`pagedkv.errors.FormatError`.
"""

import hashlib
import json
import re
import struct
from typing import NamedTuple

import numpy as np

from libc.stdint cimport uint8_t, uint64_t

from pagedkv.errors import (BadMetadata, CountMismatch, FormatError, InvalidArgument,
                            InvalidArgumentType, SizeMismatch, Truncated)
from pagedkv.quant.kv import side_row_bytes, split_kv_dtype

__all__ = ["BlockGeometry", "DecodedBlock", "DTYPE_CODES", "LAYOUTS", "block_bound",
           "block_checksum", "encode_block", "decode_block", "header_overhead",
           "checksum_of_named", "sidecar_checksum", "encode_sidecar", "decode_sidecar",
           "ObjectHeader", "header_length", "parse_block_header", "parse_sidecar_header",
           "checksum_of_stream", "kv_slab_bytes"]

DTYPE_CODES = {"float16": PKV_COLD_FLOAT16, "bfloat16": PKV_COLD_BFLOAT16,
               "float32": PKV_COLD_FLOAT32, "q8": PKV_COLD_Q8}
LAYOUTS = frozenset({"nhd"})

cdef object _U64 = struct.Struct("<Q")
# Used with fullmatch only: `$` also matches before a trailing newline ("256\n").
cdef object _DECIMAL = re.compile(r"0|[1-9][0-9]{0,18}")
cdef object _HEX64 = re.compile(r"[0-9a-f]{64}")
cdef str _ZERO_HEX = "0" * 64
# Geometry limits a decoder accepts before it believes any length (forged counts).
cdef Py_ssize_t _MAX_LAYERS = 4096
cdef Py_ssize_t _MAX_BLOCK_SIZE = 1 << 16
cdef Py_ssize_t _MAX_HEADS = 1 << 12
cdef Py_ssize_t _MAX_HEAD_DIM = 1 << 16
_METADATA_KEYS = ("abi", "kind", "key", "fingerprint", "checksum", "block_size",
                  "num_layers", "num_kv_heads", "head_dim", "dtype", "layout",
                  "key_bytes", "value_bytes")


cdef bint _known_dtype(str dtype):
    if dtype in DTYPE_CODES:
        return True
    try:
        split_kv_dtype(dtype)
    except InvalidArgument:
        return False
    return True


def kv_slab_bytes(Py_ssize_t block_size, Py_ssize_t num_kv_heads, Py_ssize_t head_dim,
                  str dtype):
    """``(key_bytes, value_bytes)`` of one layer's block of a pool dtype: ``float16``,
    ``bfloat16``, ``float32``, ``q8``, or a ``<K>/<V>`` pair of KV modes (docs/kv-quant.md);
    ``(0, 0)`` when the dtype is unknown or cannot store ``head_dim``."""
    if dtype in DTYPE_CODES:
        s = pkv_cold_slab_bytes(block_size, num_kv_heads, head_dim, DTYPE_CODES[dtype])
        return s, s
    try:
        k, v = split_kv_dtype(dtype)
        return (block_size * num_kv_heads * side_row_bytes(k, head_dim),
                block_size * num_kv_heads * side_row_bytes(v, head_dim))
    except (InvalidArgument, InvalidArgumentType):
        return 0, 0


def header_overhead(Py_ssize_t n_tensors):
    """``256*n + 1024 + 15``: the header budget of an object with ``n_tensors`` tensors."""
    if n_tensors < 0:
        raise InvalidArgument(f"n_tensors = {n_tensors} must be >= 0")
    return pkv_cold_header_overhead(n_tensors)


cdef class BlockGeometry:
    """Geometry of one block object: what must equal the pool's at restore
    (docs/contracts/cold-tier.md, '6.6 Decoding' step 6).

    ``key_bytes``/``value_bytes`` are one layer's K and V bytes (``block_size *
    num_kv_heads`` rows of the side's dtype: ``head_dim * itemsize``, 34/32 per element for
    ``q8``, a record of a KV mode); ``slab_bytes`` is their common value, 0 when they differ
    (``<K>/<V>`` dtypes such as ``fwht4/q8``).
    """

    def __init__(self, Py_ssize_t block_size, Py_ssize_t num_layers, Py_ssize_t num_kv_heads,
                 Py_ssize_t head_dim, str dtype, str layout="nhd"):
        if not _known_dtype(dtype):
            raise InvalidArgument(f"dtype = {dtype!r}; valid: {sorted(DTYPE_CODES)} or "
                                  f"'<K mode>/<V mode>' (docs/kv-quant.md)")
        if layout not in LAYOUTS:
            raise InvalidArgument(f"layout = {layout!r}; valid: {sorted(LAYOUTS)}")
        for name, v, hi in (("block_size", block_size, _MAX_BLOCK_SIZE),
                            ("num_layers", num_layers, _MAX_LAYERS),
                            ("num_kv_heads", num_kv_heads, _MAX_HEADS),
                            ("head_dim", head_dim, _MAX_HEAD_DIM)):
            if not 1 <= v <= hi:
                raise InvalidArgument(f"{name} = {v} is outside [1, {hi}]")
        self.block_size = block_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.layout = layout
        self.key_bytes, self.value_bytes = kv_slab_bytes(block_size, num_kv_heads, head_dim,
                                                         dtype)
        self.slab_bytes = self.key_bytes if self.key_bytes == self.value_bytes else 0
        if self.key_bytes == 0:
            raise InvalidArgument(f"head_dim = {head_dim} cannot be stored as {dtype} (q8: a "
                                  f"multiple of 32; KV modes: docs/kv-quant.md)")

    @classmethod
    def of(cls, geometry):
        """From a ``PoolGeometry`` (or anything with the same fields)."""
        if isinstance(geometry, BlockGeometry):
            return geometry
        try:
            fields = (int(geometry.block_size), int(geometry.num_layers),
                      int(geometry.num_kv_heads), int(geometry.head_dim), str(geometry.dtype),
                      str(getattr(geometry, "layout", "nhd")))
        except AttributeError as exc:
            raise InvalidArgumentType(
                f"geometry must be a PoolGeometry or BlockGeometry (block_size, num_layers, "
                f"num_kv_heads, head_dim, dtype), got {type(geometry).__name__}: {exc}") from None
        return cls(*fields)

    @property
    def bytes_per_block(self):
        """K and V of every layer: ``num_layers * (key_bytes + value_bytes)``."""
        return self.num_layers * (self.key_bytes + self.value_bytes)

    @property
    def buffer_shape(self):
        """The pool's block buffer: ``(num_layers, 2, slab_bytes)``, or ``(num_layers,
        key_bytes + value_bytes)`` when K and V differ."""
        if self.slab_bytes:
            return (self.num_layers, 2, self.slab_bytes)
        return (self.num_layers, self.key_bytes + self.value_bytes)

    @property
    def bound(self):
        """Largest valid encoded object in bytes (docs/contracts/cold-tier.md, '6.5 Size
        bounds')."""
        return pkv_cold_block_bound_kv(self.block_size, self.num_layers, self.key_bytes,
                                       self.value_bytes)

    def as_tuple(self):
        return (self.block_size, self.num_layers, self.num_kv_heads, self.head_dim,
                self.dtype, self.layout)

    def __eq__(self, other):
        return isinstance(other, BlockGeometry) and self.as_tuple() == other.as_tuple()

    def __hash__(self):
        return hash(self.as_tuple())

    def __reduce__(self):
        return (BlockGeometry, self.as_tuple())

    def __repr__(self):
        return (f"BlockGeometry(block_size={self.block_size}, num_layers={self.num_layers}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype!r}, layout={self.layout!r}, key_bytes={self.key_bytes}, "
                f"value_bytes={self.value_bytes})")


def block_bound(geometry):
    """Largest valid block object of ``geometry`` in bytes; loads read at most this + 1."""
    return BlockGeometry.of(geometry).bound


cdef list _tensor_names(Py_ssize_t num_layers):
    cdef list names = ["tokens"]
    cdef Py_ssize_t i
    for i in range(num_layers):
        names.append(f"layer.{i}.key")
        names.append(f"layer.{i}.value")
    return names


cdef object _object_bytes(data):
    """``data`` as a flat byte view: an object read from disk is bytes, mmap or a buffer."""
    try:
        return memoryview(data).cast("B")
    except TypeError:
        raise InvalidArgumentType(
            f"data must be a bytes-like object (bytes, bytearray, mmap, memoryview), got "
            f"{type(data).__name__}") from None


def checksum_of_named(bytes tag, tensors):
    """SHA-256 of ``tag`` then, per ``(name, data)`` in order, u64 name length, name,
    u64 data length, data — as 64 lowercase hex (docs/contracts/cold-tier.md, '6.4 Payload
    checksum')."""
    h = hashlib.sha256(tag)
    for name, data in tensors:
        raw = name.encode("ascii")
        mv = memoryview(data).cast("B")
        h.update(_U64.pack(len(raw)))
        h.update(raw)
        h.update(_U64.pack(mv.nbytes))
        h.update(mv)
    return h.hexdigest()


cdef str _checksum_block(bytes tag, const uint8_t[::1] tokens_bytes,
                         const uint8_t[::1] payload, BlockGeometry g):
    # Per-tensor updates on slices of one buffer: no copy, GIL released inside hashlib.
    cdef Py_ssize_t i, off
    cdef Py_ssize_t kb = g.key_bytes, vb = g.value_bytes
    h = hashlib.sha256(tag)
    h.update(_U64.pack(6))
    h.update(b"tokens")
    h.update(_U64.pack(tokens_bytes.shape[0]))
    h.update(tokens_bytes)
    key_len, value_len = _U64.pack(kb), _U64.pack(vb)
    for i in range(g.num_layers):
        off = i * (kb + vb)
        name = f"layer.{i}.key".encode("ascii")
        h.update(_U64.pack(len(name)))
        h.update(name)
        h.update(key_len)
        h.update(payload[off:off + kb])
        name = f"layer.{i}.value".encode("ascii")
        h.update(_U64.pack(len(name)))
        h.update(name)
        h.update(value_len)
        h.update(payload[off + kb:off + kb + vb])
    return h.hexdigest()


cdef tuple _check_block_inputs(BlockGeometry g, tokens, buffer):
    if not isinstance(tokens, np.ndarray) or tokens.dtype != np.uint32 or tokens.ndim != 1 \
            or not tokens.flags.c_contiguous:
        raise InvalidArgumentType("tokens must be a C-contiguous uint32[block_size] array")
    if tokens.shape[0] != g.block_size:
        raise InvalidArgument(f"tokens has {tokens.shape[0]} tokens; a cold block holds "
                              f"exactly block_size = {g.block_size} (full blocks only)")
    if not isinstance(buffer, np.ndarray) or buffer.dtype != np.uint8 \
            or not buffer.flags.c_contiguous:
        raise InvalidArgumentType("buffer must be a C-contiguous uint8 array "
                                  "(pool.read_block's block buffer)")
    if buffer.shape != g.buffer_shape:
        raise InvalidArgument(f"buffer shape {buffer.shape} != the block buffer {g.buffer_shape}")
    tok_le = tokens if tokens.dtype.byteorder in "=<|" else tokens.astype("<u4")
    return (tok_le.view(np.uint8), buffer.reshape(-1))


def block_checksum(bytes tag, BlockGeometry geometry, tokens, buffer):
    """Payload checksum (docs/contracts/cold-tier.md, '6.4 Payload checksum') of a block: ``tag`` is
    ``fmt.tag("cold-cache-payload")``."""
    tok_bytes, flat = _check_block_inputs(geometry, tokens, buffer)
    return _checksum_block(tag, tok_bytes, flat, geometry)


cdef bytes _header_bytes(str abi, str key_hex, str fingerprint_hex, BlockGeometry geometry,
                         str checksum):
    """u64 length + the canonical compact JSON header, padded with spaces to 8 bytes."""
    cdef Py_ssize_t ks = geometry.key_bytes, vs = geometry.value_bytes
    cdef Py_ssize_t off = 4 * geometry.block_size
    cdef Py_ssize_t i
    meta = {"abi": abi, "kind": "block", "key": key_hex, "fingerprint": fingerprint_hex,
            "checksum": checksum, "block_size": str(geometry.block_size),
            "num_layers": str(geometry.num_layers), "num_kv_heads": str(geometry.num_kv_heads),
            "head_dim": str(geometry.head_dim), "dtype": geometry.dtype,
            "layout": geometry.layout, "key_bytes": str(ks), "value_bytes": str(vs)}
    parts = ['{"__metadata__":', json.dumps(meta, separators=(",", ":")),
             f',"tokens":{{"dtype":"U8","shape":[{off}],"data_offsets":[0,{off}]}}']
    for i in range(geometry.num_layers):
        parts.append(f',"layer.{i}.key":{{"dtype":"U8","shape":[{ks}],'
                     f'"data_offsets":[{off},{off + ks}]}}')
        off += ks
        parts.append(f',"layer.{i}.value":{{"dtype":"U8","shape":[{vs}],'
                     f'"data_offsets":[{off},{off + vs}]}}')
        off += vs
    parts.append("}")
    js = "".join(parts).encode("ascii")
    js += b" " * ((8 - len(js) % 8) % 8)
    return _U64.pack(len(js)) + js


cdef dict _TEMPLATES = {}


cdef tuple _template(str abi, BlockGeometry g):
    """The canonical header of ``g`` with placeholder key, fingerprint and checksum, and
    the offsets of those three 64-hex fields (cached: one per geometry and ABI)."""
    k = (abi, g.as_tuple())
    t = _TEMPLATES.get(k)
    if t is None:
        tpl = _header_bytes(abi, _ZERO_HEX, _ZERO_HEX, g, _ZERO_HEX)
        t = (tpl, tpl.find(b'"key":"') + 7, tpl.find(b'"fingerprint":"') + 15,
             tpl.find(b'"checksum":"') + 12)
        _TEMPLATES[k] = t
    return t


cdef object _canonical_checksum(const uint8_t[::1] raw, str abi, str key_hex,
                                str fingerprint_hex, BlockGeometry g):
    """The checksum field if ``raw`` starts with exactly the header pagedkv writes for this
    key, fingerprint and geometry (so docs/contracts/cold-tier.md, '6.6 Decoding' steps 1-4 hold by
    construction), else ``None``."""
    cdef bytes tpl
    cdef Py_ssize_t n, at_key, at_fp, at_cs
    tpl, at_key, at_fp, at_cs = _template(abi, g)
    n = len(tpl)
    if raw.shape[0] != n + 4 * g.block_size + g.bytes_per_block:
        return None
    head = bytes(raw[:n])
    if (head[:at_key] != tpl[:at_key] or head[at_key + 64:at_fp] != tpl[at_key + 64:at_fp]
            or head[at_fp + 64:at_cs] != tpl[at_fp + 64:at_cs]
            or head[at_cs + 64:] != tpl[at_cs + 64:]
            or head[at_key:at_key + 64] != key_hex.encode("ascii")
            or head[at_fp:at_fp + 64] != fingerprint_hex.encode("ascii")):
        return None
    cs = head[at_cs:at_cs + 64].decode("latin-1")
    return cs if _HEX64.fullmatch(cs) else None


def encode_block(str abi, bytes checksum_tag, str key_hex, str fingerprint_hex,
                 BlockGeometry geometry, tokens, buffer, str checksum=None):
    """Encode one block; returns ``(header, tokens_bytes, payload)`` for ``os.writev``.

    ``header`` holds the u64 length and the padded JSON; ``tokens_bytes`` and ``payload``
    are views of the caller's arrays (nothing copied). ``checksum`` (hex) is computed here
    unless the capture path already did. Bad input raises before anything is returned.
    """
    if not _HEX64.fullmatch(key_hex):
        raise InvalidArgument(f"key_hex = {key_hex!r} must be 64 lowercase hex digits")
    if not _HEX64.fullmatch(fingerprint_hex):
        raise InvalidArgument(f"fingerprint_hex = {fingerprint_hex!r} must be 64 lowercase hex")
    tok_bytes, flat = _check_block_inputs(geometry, tokens, buffer)
    if checksum is None:
        checksum = _checksum_block(checksum_tag, tok_bytes, flat, geometry)
    elif not _HEX64.fullmatch(checksum):
        raise InvalidArgument(f"checksum = {checksum!r} must be 64 lowercase hex digits")
    header = _header_bytes(abi, key_hex, fingerprint_hex, geometry, checksum)
    return (header, memoryview(tok_bytes), memoryview(flat))


cdef class DecodedBlock:
    """A verified block object: zero-copy views of the bytes it was decoded from.

    ``tokens``: ``uint32[block_size]``; ``payload``: the block buffer ``pool.write_block``
    takes (``geometry.buffer_shape``); ``nbytes``: encoded size.
    """

    def __repr__(self):
        return (f"DecodedBlock({self.geometry!r}, nbytes={self.nbytes}, "
                f"checksum={self.checksum[:16]}...)")


def _reject_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise BadMetadata(f"duplicate JSON key {k!r}")
        out[k] = v
    return out


cdef Py_ssize_t _decimal(dict meta, str field, Py_ssize_t lo, Py_ssize_t hi) except -1:
    v = meta.get(field)
    if not isinstance(v, str) or not _DECIMAL.fullmatch(v):
        raise BadMetadata(f"metadata {field} = {v!r} is not a non-negative decimal")
    n = int(v)
    if not lo <= n <= hi:
        raise BadMetadata(f"metadata {field} = {n} is outside [{lo}, {hi}]")
    return n


cdef Py_ssize_t _header_length(const uint8_t[::1] raw, Py_ssize_t size, str path) except -1:
    """Step 2a: the u64 header length, which must leave room for itself in an object of
    ``size`` bytes. ``raw`` holds the object or at least its first 8 bytes."""
    cdef Py_ssize_t n
    if size < 8 or raw.shape[0] < 8:
        raise Truncated(f"object is {size} bytes, shorter than the 8-byte header length",
                        path=path, offset=0)
    n = <Py_ssize_t>(<uint64_t>raw[0] | (<uint64_t>raw[1] << 8) | (<uint64_t>raw[2] << 16)
                     | (<uint64_t>raw[3] << 24) | (<uint64_t>raw[4] << 32)
                     | (<uint64_t>raw[5] << 40) | (<uint64_t>raw[6] << 48)
                     | (<uint64_t>raw[7] << 56)) if raw[7] < 0x80 else -1
    if n < 2 or n > size - 8 or n > (1 << 24):
        raise Truncated(f"header length {n} does not fit the {size}-byte object",
                        path=path, offset=0)
    return n


cdef tuple _parse_header(const uint8_t[::1] raw, Py_ssize_t payload_start, str path,
                         tuple expected_fields):
    """Steps 2b-3: the JSON header (duplicate keys rejected), ``__metadata__`` as a string
    map, and the identity fields equal to what the caller expects (``None``: any)."""
    try:
        header = json.loads(bytes(raw[8:payload_start]).decode("utf-8"),
                            object_pairs_hook=_reject_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        if isinstance(exc, BadMetadata):
            raise BadMetadata(str(exc), path=path) from None
        raise BadMetadata(f"header JSON does not parse: {exc}", path=path, offset=8) from None
    if not isinstance(header, dict):
        raise BadMetadata("header JSON is not an object", path=path, offset=8)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BadMetadata("__metadata__ missing or not a string map", path=path)
    for field, want in expected_fields:
        got = meta.get(field)
        if not isinstance(got, str):
            raise BadMetadata(f"metadata {field} missing", path=path)
        if want is not None and got != want:
            raise BadMetadata(f"metadata {field} = {got!r}, expected {want!r}", path=path)
        # Without an expected value (offline verify) the form still counts: an object no
        # loader can match is as bad as a corrupt one.
        if want is None and field in ("key", "fingerprint") and not _HEX64.fullmatch(got):
            raise BadMetadata(f"metadata {field} = {got!r} is not 64 lowercase hex digits",
                              path=path)
    return header, meta


cdef int _check_tensors(dict header, list names, list lengths, Py_ssize_t payload_start,
                        Py_ssize_t size, str path) except -1:
    """Step 4's tensor rules: exactly ``names`` after ``__metadata__``, in that order, each
    U8 and 1-D with its length, offsets contiguous from 0 to the end of the object."""
    cdef Py_ssize_t off = 0
    cdef Py_ssize_t i, length
    if len(header) != 1 + len(names):
        raise CountMismatch(f"{len(header) - 1} tensors, metadata implies {len(names)}",
                            path=path)
    it = iter(header)
    if next(it) != "__metadata__":
        raise BadMetadata("__metadata__ is not the first header entry", path=path)
    for i, name in enumerate(it):
        length = lengths[i]
        if name != names[i]:
            raise BadMetadata(f"tensor {i} is {name!r}, expected {names[i]!r} "
                              "(canonical order)", path=path)
        t = header[name]
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
            raise BadMetadata("tensor entry needs exactly dtype, shape, data_offsets",
                              path=path, tensor=name)
        if t["dtype"] != "U8":
            raise BadMetadata(f"dtype {t['dtype']!r}, expected 'U8'", path=path, tensor=name)
        shape, offs = t["shape"], t["data_offsets"]
        if (not isinstance(shape, list) or len(shape) != 1 or type(shape[0]) is not int
                or shape[0] != length):
            raise SizeMismatch(f"shape {shape!r}, expected [{length}]", path=path, tensor=name)
        if (not isinstance(offs, list) or len(offs) != 2 or type(offs[0]) is not int
                or type(offs[1]) is not int or offs[0] != off or offs[1] != off + length):
            raise SizeMismatch(f"data_offsets {offs!r}, expected [{off}, {off + length}]",
                               path=path, tensor=name)
        off += length
    if payload_start + off != size:
        raise SizeMismatch(f"tensors end at {payload_start + off}, the object at {size}",
                           path=path, offset=payload_start + off)
    return 0


cdef tuple _block_fields(const uint8_t[::1] raw, Py_ssize_t size, Py_ssize_t payload_start,
                         str abi, str key_hex, str fingerprint_hex, str path):
    """Steps 2b-4 of a block object of ``size`` bytes whose header ``raw`` holds: its
    geometry and stored checksum, after every structural check."""
    cdef Py_ssize_t nl, bs, heads, hd, ks, vs
    header, meta = _parse_header(raw, payload_start, path,
                                 (("abi", abi), ("kind", "block"), ("key", key_hex),
                                  ("fingerprint", fingerprint_hex)))
    bs = _decimal(meta, "block_size", 1, _MAX_BLOCK_SIZE)
    nl = _decimal(meta, "num_layers", 1, _MAX_LAYERS)
    heads = _decimal(meta, "num_kv_heads", 1, _MAX_HEADS)
    hd = _decimal(meta, "head_dim", 1, _MAX_HEAD_DIM)
    dtype, layout = meta.get("dtype"), meta.get("layout")
    if not isinstance(dtype, str) or not _known_dtype(dtype):
        raise BadMetadata(f"metadata dtype = {dtype!r}; valid: {sorted(DTYPE_CODES)} or "
                          f"'<K mode>/<V mode>'", path=path)
    if layout not in LAYOUTS:
        raise BadMetadata(f"metadata layout = {layout!r}; valid: {sorted(LAYOUTS)}", path=path)
    ks, vs = kv_slab_bytes(bs, heads, hd, dtype)
    if ks == 0:
        raise BadMetadata(f"metadata dtype {dtype!r} with head_dim = {hd} is invalid",
                          path=path)
    if _decimal(meta, "key_bytes", 0, 1 << 40) != ks \
            or _decimal(meta, "value_bytes", 0, 1 << 40) != vs:
        raise SizeMismatch(f"metadata key_bytes/value_bytes {meta.get('key_bytes')}/"
                           f"{meta.get('value_bytes')} != {ks}/{vs} of the geometry",
                           path=path)
    if size > <Py_ssize_t>pkv_cold_block_bound_kv(bs, nl, ks, vs):
        raise SizeMismatch(f"object is {size} bytes, over the bound "
                           f"{pkv_cold_block_bound_kv(bs, nl, ks, vs)} of its own geometry",
                           path=path)
    # The geometry must fit the bytes actually present before anything trusts it.
    if nl * (ks + vs) + 4 * bs != size - payload_start:
        raise SizeMismatch(f"geometry implies {nl * (ks + vs) + 4 * bs} payload bytes, the "
                           f"object holds {size - payload_start}", path=path,
                           offset=payload_start)
    _check_tensors(header, _tensor_names(nl), [4 * bs] + [ks, vs] * nl, payload_start,
                   size, path)
    cs = meta.get("checksum")
    if not isinstance(cs, str) or not _HEX64.fullmatch(cs):
        raise BadMetadata(f"metadata checksum missing or malformed: {cs!r}", path=path)
    return BlockGeometry(bs, nl, heads, hd, dtype, layout), cs


def decode_block(data, *, str abi, bytes checksum_tag, str key_hex=None,
                 str fingerprint_hex=None, BlockGeometry expected=None,
                 Py_ssize_t bound=-1, str path=None):
    """Decode and verify a block object held in ``data`` (bytes-like), fail-closed
    (docs/contracts/cold-tier.md, '6.6 Decoding').

    Checks, in order: size ≤ ``bound`` (default: the expected geometry's bound, else the
    bound implied by the metadata); header length and JSON before anything else; ``abi``,
    ``kind``, ``key``, ``fingerprint``; numeric fields, tensor names, dtypes, shapes and
    contiguous offsets that end at the end of ``data``; the payload checksum; and, when
    ``expected`` is given, geometry equality. Raises a ``FormatError`` subclass naming the
    field; returns a :class:`DecodedBlock` of views into ``data``.
    """
    cdef const uint8_t[::1] raw = _object_bytes(data)
    cdef Py_ssize_t size = raw.shape[0]
    cdef Py_ssize_t payload_start
    if expected is not None and bound < 0:
        bound = expected.bound
    if bound >= 0 and size > bound:
        raise SizeMismatch(f"object is {size} bytes, over the bound {bound}", path=path)
    payload_start = 8 + _header_length(raw, size, path)
    if expected is not None and key_hex is not None and fingerprint_hex is not None:
        # Fast path: byte-equal to the canonical header → only the checksum remains (step 5).
        cs = _canonical_checksum(raw, abi, key_hex, fingerprint_hex, expected)
        if cs is not None:
            return _verified(data, raw, checksum_tag, cs, expected, payload_start, size, path)
    geometry, cs = _block_fields(raw, size, payload_start, abi, key_hex, fingerprint_hex, path)
    out = _verified(data, raw, checksum_tag, cs, geometry, payload_start, size, path)
    if expected is not None and geometry != expected:
        raise SizeMismatch(f"object geometry {geometry!r} != pool geometry {expected!r}",
                           path=path)
    return out


cdef DecodedBlock _verified(data, const uint8_t[::1] raw, bytes checksum_tag, str cs,
                            BlockGeometry geometry, Py_ssize_t payload_start, Py_ssize_t size,
                            str path):
    """Step 5 (the checksum) and the zero-copy views of a structurally valid object."""
    cdef Py_ssize_t bs = geometry.block_size
    got = _checksum_block(checksum_tag, raw[payload_start:payload_start + 4 * bs],
                          raw[payload_start + 4 * bs:size], geometry)
    if got != cs:
        raise FormatError(f"payload checksum {got} != stored {cs}", path=path)
    cdef DecodedBlock out = DecodedBlock()
    out.geometry = geometry
    base = np.frombuffer(data, dtype=np.uint8)
    out.tokens = base[payload_start:payload_start + 4 * bs].view("<u4")
    out.payload = base[payload_start + 4 * bs:size].reshape(geometry.buffer_shape)
    out.checksum = cs
    out.nbytes = size
    return out


# --- sidecar objects (docs/contracts/cold-tier.md, '6.3 Sidecar object') --------------------------

cdef list _sidecar_names(Py_ssize_t num_layers, Py_ssize_t per_layer):
    cdef Py_ssize_t layer, t
    return [f"layer.{layer}.state.{t}" for layer in range(num_layers)
            for t in range(per_layer)]


cdef str _sidecar_checksum(bytes tag, Py_ssize_t num_layers, Py_ssize_t per_layer,
                           Py_ssize_t bpt, payload):
    flat = memoryview(payload).cast("B")
    return checksum_of_named(tag, [(n, flat[i * bpt:(i + 1) * bpt]) for i, n in
                                   enumerate(_sidecar_names(num_layers, per_layer))])


def sidecar_checksum(bytes tag, layout, payload):
    """Payload checksum (docs/contracts/cold-tier.md, '6.4 Payload checksum') of a sidecar: tensors
    ``layer.{l}.state.{s}``, layer-major,
    each ``layout.bytes_per_tensor`` bytes of ``payload`` (``uint8[tensor_count, bpt]``)."""
    return _sidecar_checksum(tag, layout.num_layers, layout.tensors_per_layer,
                             layout.bytes_per_tensor, payload)


def encode_sidecar(str abi, bytes checksum_tag, str key_hex, str fingerprint_hex, layout,
                   payload):
    """Encode one sidecar; returns ``(header, payload)`` for ``os.writev`` (no copy).
    ``payload``: C-contiguous ``uint8`` of ``layout.tensor_count * bytes_per_tensor``."""
    if not _HEX64.fullmatch(key_hex) or not _HEX64.fullmatch(fingerprint_hex):
        raise InvalidArgument("key_hex and fingerprint_hex must be 64 lowercase hex digits")
    if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8 \
            or not payload.flags.c_contiguous:
        raise InvalidArgumentType("payload must be a C-contiguous uint8 array")
    cdef Py_ssize_t n = layout.tensor_count
    cdef Py_ssize_t bpt = layout.bytes_per_tensor
    cdef Py_ssize_t i
    if payload.nbytes != n * bpt:
        raise InvalidArgument(f"payload is {payload.nbytes} bytes; the layout needs "
                              f"{n} tensors x {bpt} = {n * bpt}")
    flat = payload.reshape(-1)
    cs = _sidecar_checksum(checksum_tag, layout.num_layers, layout.tensors_per_layer, bpt,
                           flat)
    meta = {"abi": abi, "kind": "sidecar", "group": layout.group.label, "key": key_hex,
            "fingerprint": fingerprint_hex, "checksum": cs,
            "boundary_tokens": str(layout.boundary_tokens), "num_layers": str(layout.num_layers),
            "tensors_per_layer": str(layout.tensors_per_layer), "dtype": layout.dtype,
            "dims": ",".join(str(d) for d in layout.dims), "bytes_per_tensor": str(bpt)}
    parts = ['{"__metadata__":', json.dumps(meta, separators=(",", ":"))]
    for i, name in enumerate(_sidecar_names(layout.num_layers, layout.tensors_per_layer)):
        parts.append(f',"{name}":{{"dtype":"U8","shape":[{bpt}],'
                     f'"data_offsets":[{i * bpt},{(i + 1) * bpt}]}}')
    parts.append("}")
    js = "".join(parts).encode("ascii")
    js += b" " * ((8 - len(js) % 8) % 8)
    return _U64.pack(len(js)) + js, memoryview(flat)


cdef tuple _sidecar_fields(const uint8_t[::1] raw, Py_ssize_t size, Py_ssize_t payload_start,
                           str abi, str group, str key_hex, str fingerprint_hex, str path):
    """Steps 2b-4 of a sidecar object of ``size`` bytes whose header ``raw`` holds: its
    layout fields, stored checksum, tensor count and bytes per tensor."""
    cdef Py_ssize_t nl, per, bpt, b, n
    header, meta = _parse_header(raw, payload_start, path,
                                 (("abi", abi), ("kind", "sidecar"), ("group", group),
                                  ("key", key_hex), ("fingerprint", fingerprint_hex)))
    b = _decimal(meta, "boundary_tokens", 1, 1 << 40)
    nl = _decimal(meta, "num_layers", 1, _MAX_LAYERS)
    per = _decimal(meta, "tensors_per_layer", 1, 16)
    bpt = _decimal(meta, "bytes_per_tensor", 1, 1 << 40)
    dtype = meta.get("dtype")
    if dtype not in DTYPE_CODES:
        raise BadMetadata(f"metadata dtype = {dtype!r}; valid: {sorted(DTYPE_CODES)}", path=path)
    dims_text = meta.get("dims", "")
    dims = dims_text.split(",") if dims_text else []
    if not 1 <= len(dims) <= 8 or not all(_DECIMAL.fullmatch(d) and d != "0" for d in dims):
        raise BadMetadata(f"metadata dims = {dims_text!r}: 1-8 positive decimals", path=path)
    n = nl * per
    if n * bpt != size - payload_start or size > n * bpt + pkv_cold_header_overhead(n):
        raise SizeMismatch(f"layout implies {n * bpt} payload bytes, the object holds "
                           f"{size - payload_start}", path=path, offset=payload_start)
    _check_tensors(header, _sidecar_names(nl, per), [bpt] * n, payload_start, size, path)
    cs = meta.get("checksum")
    if not isinstance(cs, str) or not _HEX64.fullmatch(cs):
        raise BadMetadata(f"metadata checksum missing or malformed: {cs!r}", path=path)
    fields = {"boundary_tokens": b, "num_layers": nl, "tensors_per_layer": per,
              "dtype": dtype, "dims": tuple(int(d) for d in dims), "bytes_per_tensor": bpt}
    return fields, cs


def decode_sidecar(data, *, str abi, bytes checksum_tag, str group, str key_hex=None,
                   str fingerprint_hex=None, Py_ssize_t bound=-1, str path=None):
    """Decode and verify a sidecar object (docs/contracts/cold-tier.md, '6.6 Decoding'),
    fail-closed. Returns ``(fields, payload)``:
    the metadata's layout fields (``boundary_tokens``, ``num_layers``, ``tensors_per_layer``,
    ``dtype``, ``dims``, ``bytes_per_tensor``) and a ``uint8[tensors, bytes_per_tensor]``
    view of ``data``. Comparing them with the expected layout is the caller's step 6."""
    cdef const uint8_t[::1] raw = _object_bytes(data)
    cdef Py_ssize_t size = raw.shape[0]
    cdef Py_ssize_t payload_start, nl, per, bpt
    if bound >= 0 and size > bound:
        raise SizeMismatch(f"object is {size} bytes, over the bound {bound}", path=path)
    payload_start = 8 + _header_length(raw, size, path)
    fields, cs = _sidecar_fields(raw, size, payload_start, abi, group, key_hex,
                                 fingerprint_hex, path)
    nl, per, bpt = fields["num_layers"], fields["tensors_per_layer"], fields["bytes_per_tensor"]
    payload = np.frombuffer(data, dtype=np.uint8)[payload_start:size].reshape(nl * per, bpt)
    got = _sidecar_checksum(checksum_tag, nl, per, bpt, payload)
    if got != cs:
        raise FormatError(f"payload checksum {got} != stored {cs}", path=path)
    return fields, payload


# --- header-first verification (what `pagedkv cold verify` runs) ------------------------------

class ObjectHeader(NamedTuple):
    """What an object's header says, after steps 2-4: where the payload starts, the stored
    checksum, and the payload's tensors as ``(name, nbytes)`` in canonical order."""

    payload_start: int
    checksum: str
    tensors: list


def header_length(data, Py_ssize_t object_size, str path=None):
    """Step 2a from the first 8 bytes of an object of ``object_size`` bytes: the JSON
    header's length, checked to fit the object (and 16 MiB) before anything is read for
    it. A reader needs ``8 + header_length`` bytes for :func:`parse_block_header`."""
    return _header_length(_object_bytes(data), object_size, path)


cdef Py_ssize_t _header_prefix(const uint8_t[::1] raw, Py_ssize_t object_size,
                               str path) except -1:
    cdef Py_ssize_t payload_start = 8 + _header_length(raw, object_size, path)
    if raw.shape[0] < payload_start:  # e.g. the file shrank after its size was taken
        raise Truncated(f"{raw.shape[0]} bytes hold less than the header's "
                        f"{payload_start} (8 + header_length)", path=path, offset=0)
    return payload_start


def parse_block_header(data, Py_ssize_t object_size, *, str abi, str key_hex=None,
                       str fingerprint_hex=None, str path=None):
    """Steps 2-4 of a block object of ``object_size`` bytes from ``data``, its first
    ``8 + header_length`` bytes or more: every structural check, without the payload.
    Returns an :class:`ObjectHeader`; the caller checksums the payload
    (:func:`checksum_of_stream`)."""
    cdef const uint8_t[::1] raw = _object_bytes(data)
    cdef Py_ssize_t payload_start = _header_prefix(raw, object_size, path)
    geometry, cs = _block_fields(raw, object_size, payload_start, abi, key_hex,
                                 fingerprint_hex, path)
    cdef BlockGeometry g = geometry
    sizes = [4 * g.block_size] + [g.key_bytes, g.value_bytes] * g.num_layers
    tensors = list(zip(_tensor_names(g.num_layers), sizes, strict=True))
    return ObjectHeader(payload_start, cs, tensors)


def parse_sidecar_header(data, Py_ssize_t object_size, *, str abi, str group,
                         str key_hex=None, str fingerprint_hex=None, str path=None):
    """:func:`parse_block_header` for a sidecar object of group label ``group``."""
    cdef const uint8_t[::1] raw = _object_bytes(data)
    cdef Py_ssize_t payload_start = _header_prefix(raw, object_size, path)
    fields, cs = _sidecar_fields(raw, object_size, payload_start, abi, group, key_hex,
                                 fingerprint_hex, path)
    bpt = fields["bytes_per_tensor"]
    return ObjectHeader(payload_start, cs, [
        (n, bpt) for n in _sidecar_names(fields["num_layers"], fields["tensors_per_layer"])])


def checksum_of_stream(bytes tag, tensors, readinto, Py_ssize_t chunk_bytes=1 << 20,
                       str path=None):
    """The payload checksum (docs/contracts/cold-tier.md, '6.4 Payload checksum') of ``tensors``
    (``(name, nbytes)`` in order) whose bytes
    come, in order, from ``readinto(view) -> int`` (0 at the end): memory is one chunk of
    ``chunk_bytes``, whatever the payload's size. A short stream raises ``Truncated``."""
    h = hashlib.sha256(tag)
    buf = bytearray(max(1, min(chunk_bytes, 1 << 26)))
    view = memoryview(buf)
    cdef Py_ssize_t left, got
    for name, nbytes in tensors:
        raw = name.encode("ascii")
        h.update(_U64.pack(len(raw)))
        h.update(raw)
        h.update(_U64.pack(nbytes))
        left = nbytes
        while left > 0:
            got = readinto(view[:min(left, len(buf))])
            if got <= 0:
                raise Truncated(f"payload ended {left} bytes short in tensor {name!r}",
                                path=path, tensor=name)
            h.update(view[:got])
            left -= got
    return h.hexdigest()
