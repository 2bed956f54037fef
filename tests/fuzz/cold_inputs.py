"""What the cold-tier fuzz targets share: seed objects written by pagedkv's own encoders,
a reader that turns fuzz bytes into choices, and structure-aware edits of an object's
JSON header and payload.

The codec is Cython, which atheris does not instrument, so coverage guidance alone would
rarely get past the header length. Half of every target's input space is therefore
"structured": the bytes pick a seed object and a list of edits (a metadata value replaced
by an interesting string, a tensor entry's shape or offsets changed, a key duplicated,
the payload flipped or cut, the header length forged) and the target decodes the result.
"""

from __future__ import annotations

import json
import struct

import numpy as np

from pagedkv.cold import DEFAULT_FORMAT, BlockGeometry, ColdGroup, ColdSidecarLayout
from pagedkv.cold.codec import checksum_of_stream, encode_block, encode_sidecar

ABI = DEFAULT_FORMAT.abi
TAG = DEFAULT_FORMAT.tag("cold-cache-payload")
FP_HEX = "f0" * 32
KEYS = [bytes([i + 1]) * 32 for i in range(3)]

GEOMETRIES = [
    BlockGeometry(4, 2, 1, 8, "float16"),
    BlockGeometry(2, 1, 2, 8, "bfloat16"),
    BlockGeometry(1, 3, 1, 4, "float32"),
    BlockGeometry(4, 1, 1, 32, "q8"),
]
LAYOUTS = [
    ColdSidecarLayout(ColdGroup.GDN_STATE, 16, 2, 2, "bfloat16", (4, 2), 16),
    ColdSidecarLayout(ColdGroup.SLIDING_WINDOW, 8, 1, 1, "float16", (8,), 24),
    ColdSidecarLayout(ColdGroup.CONV_STATE, 4, 1, 3, "float32", (2, 1, 2), 8),
]

#: Strings a metadata value is replaced by: off-by-one, sign, whitespace, newline, other
#: scripts, huge, the other valid enum values.
INTERESTING_STRINGS = [
    "", "0", "1", "2", "3", "4", "8", "16", "32", "64", "-1", "+4", "04", " 4", "4 ", "4\n",
    "256\n", "0\n", "1e3", "4.0", "0x10", "\u0664", "18446744073709551615",
    "18446744073709551616", "9" * 40, "4096", "4097", "65536", "1099511627776",
    "float16", "bfloat16", "float32", "q8", "F16", "nhd", "hnd", "block", "sidecar",
    "gdn_state", "sliding_window", "conv_state", "kv", "pagedkv-v1", "mlx-paged-v1",
    "4,2", "4,0", "0,4", ",", "4,", "1,2,3,4,5,6,7,8", "1,2,3,4,5,6,7,8,9", FP_HEX,
    "0" * 64, "F" * 64, "a" * 63, "a" * 65,
]
#: JSON values a field is replaced by (non-strings where strings are expected and back).
INTERESTING_VALUES = [None, True, False, 0, 1, -1, 4, 1 << 31, 1 << 63, 1 << 64, 1.5,
                      float("1e300"), "U8", "F16", [], [0], [0, 0], [0, 1 << 40], [-1, 0],
                      [1.0], [True], [[4]], {}, {"dtype": "U8"}]


def streamed_checksum_ok(obj: bytes, header) -> bool:
    """The verify path's step 5 over ``obj`` held in memory: its payload streamed in
    64-byte chunks through ``checksum_of_stream``, compared with the stored checksum."""
    offset = header.payload_start

    def readinto(view: memoryview) -> int:
        nonlocal offset
        chunk = obj[offset:offset + len(view)]
        view[:len(chunk)] = chunk
        offset += len(chunk)
        return len(chunk)
    return checksum_of_stream(TAG, header.tensors, readinto, 64) == header.checksum


def block_object(geometry: BlockGeometry, seed: int, key: bytes = KEYS[0]) -> bytes:
    """A valid block object written by pagedkv's encoder."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1 << 32, geometry.block_size, dtype=np.uint32)
    buf = rng.integers(0, 256, (geometry.num_layers, 2, geometry.slab_bytes), dtype=np.uint8)
    header, toks, payload = encode_block(ABI, TAG, key.hex(), FP_HEX, geometry, tokens, buf)
    return header + bytes(toks) + bytes(payload)


def sidecar_object(layout: ColdSidecarLayout, seed: int, key: bytes = KEYS[0]) -> bytes:
    """A valid sidecar object written by pagedkv's encoder."""
    rng = np.random.default_rng(seed)
    payload = rng.integers(0, 256, (layout.tensor_count, layout.bytes_per_tensor),
                           dtype=np.uint8)
    header, body = encode_sidecar(ABI, TAG, key.hex(), FP_HEX, layout, payload)
    return header + bytes(body)


class ByteReader:
    """Choices drawn from fuzz bytes; an exhausted reader answers zeros."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def u8(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def u16(self) -> int:
        return self.u8() | self.u8() << 8

    def pick(self, seq):
        return seq[self.u8() % len(seq)]

    def take(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out

    def rest(self) -> bytes:
        return self.take(len(self.data))


def split(obj: bytes) -> tuple[list, bytes]:
    """The header of a valid object as ``[key, value]`` pairs in file order (metadata as
    pairs too, so a key can be repeated; tensor entries as dicts) and its payload."""
    n = struct.unpack_from("<Q", obj)[0]
    header = [[k, v] for k, v in json.loads(obj[8:8 + n],
                                            object_pairs_hook=lambda pairs: pairs)]
    for entry in header:
        if entry[0] == "__metadata__" and isinstance(entry[1], list):
            entry[1] = [list(p) for p in entry[1]]
        elif isinstance(entry[1], list):
            entry[1] = dict(entry[1])
    return header, obj[8 + n:]


def _pairs_json(pairs: list) -> str:
    return "{" + ",".join(json.dumps(k) + ":" + json.dumps(v, separators=(",", ":"))
                          for k, v in pairs) + "}"


def join(header: list, payload: bytes, length_delta: int = 0) -> bytes:
    """Header pairs and payload back to an object; ``length_delta`` forges the length."""
    js = "{" + ",".join(
        json.dumps(k) + ":" + (_pairs_json(v) if k == "__metadata__" and isinstance(v, list)
                               else json.dumps(v, separators=(",", ":")))
        for k, v in header) + "}"
    raw = js.encode("utf-8")
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return struct.pack("<Q", max(0, min(len(raw) + length_delta, (1 << 64) - 1))) + raw + \
        payload


def _edit_header(header: list, r: ByteReader) -> None:
    meta = header[0][1] if header and header[0][0] == "__metadata__" else None
    op = r.u8() % 10
    if op <= 2 and isinstance(meta, list) and meta:  # a metadata value
        entry = r.pick(meta)
        entry[1] = r.pick(INTERESTING_STRINGS) if op < 2 else r.pick(INTERESTING_VALUES)
    elif op == 3 and isinstance(meta, list) and meta:  # drop or repeat a metadata key
        i = r.u8() % len(meta)
        if r.u8() & 1:
            del meta[i]
        else:
            meta.append([meta[i][0], r.pick(INTERESTING_STRINGS)])
    elif op == 4 and isinstance(meta, list):  # an extra metadata key
        meta.append([r.pick(["extra", "checksum", "dims", "kind", "__metadata__"]),
                     r.pick(INTERESTING_STRINGS)])
    elif op in (5, 6) and len(header) > 1:  # a tensor entry's field
        _, entry = r.pick(header[1:])
        if isinstance(entry, dict) and entry:
            field = r.pick(sorted(entry))
            value = entry[field]
            if op == 5 and isinstance(value, list) and value and isinstance(value[-1], int):
                entry[field] = value[:-1] + [value[-1] + r.pick([-1, 1, 8, -8, 1 << 32])]
            elif op == 5 and r.u8() & 1:
                del entry[field]
            else:
                entry[field] = r.pick(INTERESTING_VALUES)
    elif op == 7 and len(header) > 2:  # swap two entries (tensor order, metadata first)
        i, j = r.u8() % len(header), r.u8() % len(header)
        header[i], header[j] = header[j], header[i]
    elif op == 8 and len(header) > 1:  # drop or repeat a tensor
        i = 1 + r.u8() % (len(header) - 1)
        if r.u8() & 1:
            del header[i]
        else:
            header.insert(i, [header[i][0], header[i][1]])
    elif op == 9 and len(header) > 1:  # rename a tensor
        header[1 + r.u8() % (len(header) - 1)][0] = r.pick(
            ["tokens", "layer.0.key", "layer.0.value", "layer.1.key", "layer.0.state.0",
             "layer.0.state.1", "layer.1.state.0", "__metadata__", "x"])


def _edit_payload(payload: bytes, r: ByteReader) -> bytes:
    op = r.u8() % 5
    if op == 0 or not payload:
        return payload + r.take(r.u8() % 16 + 1)
    at = r.u16() % len(payload)
    if op == 1:
        return payload[:at] + bytes([payload[at] ^ (r.u8() | 1)]) + payload[at + 1:]
    if op == 2:
        return payload[:at]
    if op == 3:
        return payload[:at] + payload[at + 1:]
    return payload + b"\0" * (r.u16() % 4096)


def structured(data: bytes, seeds: list[bytes]) -> bytes:
    """A seed object edited as ``data`` says (see the module docstring)."""
    r = ByteReader(data)
    header, payload = split(r.pick(seeds))
    for _ in range(r.u8() % 4):
        _edit_header(header, r)
    if r.u8() % 4 == 0:
        payload = _edit_payload(payload, r)
    delta = 0
    if r.u8() % 8 == 0:
        delta = r.pick([-8, -1, 1, 8, 1 << 24, 1 << 40, 1 << 63])
    obj = join(header, payload, delta)
    if r.u8() % 16 == 0:  # a raw byte edit anywhere, header included
        tail = r.rest()
        if tail and obj:
            at = (tail[0] << 8 | (tail[1] if len(tail) > 1 else 0)) % len(obj)
            obj = obj[:at] + tail[2:10] + obj[at + len(tail[2:10]):]
    return obj


def object_from(data: bytes, seeds: list[bytes]) -> bytes:
    """An input's object: the raw bytes after a first byte below 0x80, else a structured
    edit of a seed."""
    if not data:
        return b""
    return data[1:] if data[0] < 0x80 else structured(data[1:], seeds)
