"""Fuzz target: the cold sidecar decoder (docs/cold.md, "Object format").

Every input is decoded by ``decode_sidecar`` under each group label and by the
header-first path of ``pagedkv cold verify`` (``parse_sidecar_header`` +
``checksum_of_stream``); the two must agree and only ``FormatError`` is expected. What
the decoder accepts must be a layout ``ColdSidecarLayout`` accepts too (every dim
positive, counts in range), whose bound covers the object, and must survive a re-encode.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from cold_inputs import (
    ABI,
    FP_HEX,
    KEYS,
    LAYOUTS,
    TAG,
    object_from,
    sidecar_object,
    streamed_checksum_ok,
)

from pagedkv.cold import ColdGroup, ColdSidecarLayout
from pagedkv.cold.codec import (
    decode_sidecar,
    encode_sidecar,
    parse_sidecar_header,
)
from pagedkv.errors import FormatError

SEEDS = [sidecar_object(layout, i) for i, layout in enumerate(LAYOUTS)]
_GROUPS = [g for g in ColdGroup if g is not ColdGroup.KV]


def _streamed_ok(obj: bytes, group: str) -> bool:
    try:
        return streamed_checksum_ok(obj, parse_sidecar_header(obj, len(obj), abi=ABI, group=group))
    except FormatError:
        return False


def one_input(data: bytes) -> None:
    obj = object_from(data, SEEDS)
    for group in _GROUPS:
        try:
            fields, payload = decode_sidecar(obj, abi=ABI, checksum_tag=TAG,
                                             group=group.label)
        except FormatError:
            fields = payload = None
        streamed = _streamed_ok(obj, group.label)
        if streamed != (fields is not None):
            raise AssertionError(f"decode_sidecar (accepts: {fields is not None}) and the "
                                 f"verify path (accepts: {streamed}) disagree")
        if fields is None:
            continue
        layout = ColdSidecarLayout(group, **fields)  # raises if the decoder was laxer
        if len(obj) > layout.bound:
            raise AssertionError(f"accepted a {len(obj)}-byte object over its layout's "
                                 f"bound {layout.bound}")
        if not layout.matches(fields) or payload.shape != (layout.tensor_count,
                                                           layout.bytes_per_tensor):
            raise AssertionError("decoded fields and payload disagree with their layout")
        rows = np.array(payload, dtype=np.uint8)
        header, body = encode_sidecar(ABI, TAG, KEYS[1].hex(), FP_HEX, layout, rows)
        again_fields, again = decode_sidecar(header + bytes(body), abi=ABI, checksum_tag=TAG,
                                             group=group.label)
        if again_fields != fields or not np.array_equal(again, rows):
            raise AssertionError("an accepted sidecar does not survive a re-encode")


def seeds() -> Iterable[tuple[str, bytes]]:
    for i, (layout, obj) in enumerate(zip(LAYOUTS, SEEDS, strict=True)):
        yield f"raw-{layout.group.label}", b"\0" + obj
        yield f"structured-{layout.group.label}", b"\x80" + bytes([i]) + b"\1\0\0\0"
    yield "empty", b""


if __name__ == "__main__":
    from runner import main
    main(one_input, seeds)
