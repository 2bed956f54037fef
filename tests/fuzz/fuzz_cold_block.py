"""Fuzz target: the cold block decoder (docs/cold.md, "Decoding, fail-closed, in this order").

Every input is decoded three ways that must agree: ``decode_block`` with no expectation
(what is in the file), the header-first path of ``pagedkv cold verify``
(``parse_block_header`` + ``checksum_of_stream``), and the restore path with the seeds'
key, fingerprint and each seed geometry (the canonical fast path). Only ``FormatError`` is
expected. An accepted object must re-encode to one that decodes to the same tokens and
payload, and the restore path may accept only what the plain decode accepts.
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
    GEOMETRIES,
    KEYS,
    TAG,
    block_object,
    object_from,
    streamed_checksum_ok,
)

from pagedkv.cold.codec import (
    decode_block,
    encode_block,
    parse_block_header,
)
from pagedkv.errors import FormatError

SEEDS = [block_object(g, i) for i, g in enumerate(GEOMETRIES)]


def _streamed_ok(obj: bytes) -> bool:
    """The verify path: header first, then the payload streamed through the checksum."""
    try:
        return streamed_checksum_ok(obj, parse_block_header(obj, len(obj), abi=ABI))
    except FormatError:
        return False


def one_input(data: bytes) -> None:
    obj = object_from(data, SEEDS)
    try:
        plain = decode_block(obj, abi=ABI, checksum_tag=TAG)
    except FormatError:
        plain = None
    streamed = _streamed_ok(obj)
    if streamed != (plain is not None):
        raise AssertionError(f"decode_block (accepts: {plain is not None}) and the verify "
                             f"path (accepts: {streamed}) disagree")
    for g in GEOMETRIES:
        try:
            got = decode_block(obj, abi=ABI, checksum_tag=TAG, key_hex=KEYS[0].hex(),
                               fingerprint_hex=FP_HEX, expected=g)
        except FormatError:
            continue
        if plain is None or plain.geometry != g or got.checksum != plain.checksum:
            raise AssertionError("the restore path accepted what the plain decode did not")
    if plain is None:
        return
    tokens = np.array(plain.tokens, dtype=np.uint32)
    payload = np.array(plain.payload, dtype=np.uint8)
    header, toks, body = encode_block(ABI, TAG, "ab" * 32, FP_HEX, plain.geometry, tokens,
                                      payload)
    again = decode_block(header + bytes(toks) + bytes(body), abi=ABI, checksum_tag=TAG)
    if not (np.array_equal(again.tokens, tokens) and np.array_equal(again.payload, payload)
            and again.checksum == plain.checksum):
        raise AssertionError("an accepted object does not survive a re-encode")


def seeds() -> Iterable[tuple[str, bytes]]:
    for g, obj in zip(GEOMETRIES, SEEDS, strict=True):
        yield f"raw-{g.dtype}", b"\0" + obj
        yield f"structured-{g.dtype}", b"\x80" + bytes([GEOMETRIES.index(g)]) + b"\1\0\0\0"
    yield "metadata-edit", b"\x80\0\1\0\0\0"
    yield "empty", b""


if __name__ == "__main__":
    from runner import main
    main(one_input, seeds)
