"""The cold-object codec: safetensors round trip and fail-closed decoding
(docs/contracts/cold-tier.md, '6. Object format'; O1, O2)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors import safe_open

from pagedkv.cold import DEFAULT_FORMAT, BlockGeometry, decode_block
from pagedkv.cold.codec import block_checksum, checksum_of_named, encode_block
from pagedkv.errors import FormatError, InvalidArgument, InvalidArgumentType

TAG = DEFAULT_FORMAT.tag("cold-cache-payload")
ABI = DEFAULT_FORMAT.abi
KEY, FPH = "ab" * 32, "cd" * 32
G = BlockGeometry(4, 2, 1, 8, "float16")


def _block(g=G, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 2**32, g.block_size, dtype=np.uint32)
    buf = rng.integers(0, 256, (g.num_layers, 2, g.slab_bytes), dtype=np.uint8)
    return toks, buf


def _encode(g=G, seed=0):
    toks, buf = _block(g, seed)
    h, t, p = encode_block(ABI, TAG, KEY, FPH, g, toks, buf)
    return h + bytes(t) + bytes(p), toks, buf


def _decode(data, **kw):
    kw.setdefault("expected", G)
    return decode_block(data, abi=ABI, checksum_tag=TAG, key_hex=KEY, fingerprint_hex=FPH, **kw)


@pytest.mark.parametrize("g", [G, BlockGeometry(16, 3, 2, 64, "bfloat16"),
                               BlockGeometry(8, 1, 1, 4, "float32"),
                               BlockGeometry(4, 2, 2, 64, "q8")], ids=repr)
def test_round_trip_opens_with_safetensors(tmp_path, g):
    data, toks, buf = _encode(g)
    assert len(data) <= g.bound
    d = _decode(data, expected=g)
    assert np.array_equal(d.tokens, toks) and np.array_equal(d.payload, buf)
    assert d.nbytes == len(data) and d.geometry == g
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), "numpy") as f:
        meta = f.metadata()
        assert meta == {"abi": ABI, "kind": "block", "key": KEY, "fingerprint": FPH,
                        "checksum": d.checksum, "block_size": str(g.block_size),
                        "num_layers": str(g.num_layers), "num_kv_heads": str(g.num_kv_heads),
                        "head_dim": str(g.head_dim), "dtype": g.dtype, "layout": "nhd",
                        "key_bytes": str(g.slab_bytes), "value_bytes": str(g.slab_bytes)}
        assert sorted(f.keys()) == sorted(
            ["tokens"] + [f"layer.{i}.{kv}" for i in range(g.num_layers)
                          for kv in ("key", "value")])
        assert f.get_tensor("tokens").view("<u4").tolist() == toks.tolist()
        for i in range(g.num_layers):
            assert np.array_equal(f.get_tensor(f"layer.{i}.key"), buf[i, 0])
            assert np.array_equal(f.get_tensor(f"layer.{i}.value"), buf[i, 1])
    # The checksum is the recipe of docs/contracts/cold-tier.md, '6.4 Payload checksum', over the
    # named tensors.
    named = [("tokens", toks)] + [(f"layer.{i}.{kv}", buf[i, j]) for i in range(g.num_layers)
                                  for j, kv in enumerate(("key", "value"))]
    assert d.checksum == checksum_of_named(TAG, named) == block_checksum(TAG, g, toks, buf)


def test_header_is_padded_and_contiguous():
    data, _, _ = _encode()
    n = struct.unpack_from("<Q", data)[0]
    assert n % 8 == 0
    header = json.loads(data[8:8 + n])
    assert list(header)[:2] == ["__metadata__", "tokens"]


def test_encode_validates_before_returning():
    toks, buf = _block()
    with pytest.raises(InvalidArgument, match="full blocks only"):
        encode_block(ABI, TAG, KEY, FPH, G, toks[:3].copy(), buf)
    with pytest.raises(InvalidArgument):
        encode_block(ABI, TAG, KEY, FPH, G, toks, buf[:1].copy())
    with pytest.raises(InvalidArgumentType):
        encode_block(ABI, TAG, KEY, FPH, G, toks.astype(np.int64), buf)
    with pytest.raises(InvalidArgument):
        encode_block(ABI, TAG, "xy", FPH, G, toks, buf)


def test_every_single_byte_flip_is_rejected():
    data, _, _ = _encode()
    for i in range(len(data)):
        for bit in (0x01, 0x80):
            bad = bytearray(data)
            bad[i] ^= bit
            with pytest.raises(FormatError):
                _decode(bytes(bad))


def test_truncation_and_trailing_bytes_are_rejected():
    data, _, _ = _encode()
    for n in range(len(data)):
        with pytest.raises(FormatError):
            _decode(data[:n])
    with pytest.raises(FormatError):
        _decode(data + b"\0")
    with pytest.raises(FormatError, match="bound"):
        _decode(data, bound=len(data) - 1)


def _rebuild(data, edit_header=None, payload=None):
    """A hand-made safetensors file from ``data`` with its header edited."""
    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:] if payload is None else payload
    if edit_header:
        header = edit_header(header) or header
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js + body


def _meta(**kv):
    def edit(h):
        for k, v in kv.items():
            if v is None:
                del h["__metadata__"][k]
            else:
                h["__metadata__"][k] = v
    return edit


HANDMADE = {
    "missing checksum": _meta(checksum=None),
    "wrong abi": _meta(abi="mlx-paged-v1"),
    "wrong kind": _meta(kind="sidecar"),
    "other key": _meta(key="ef" * 32),
    "other fingerprint": _meta(fingerprint="00" * 32),
    "forged num_layers": _meta(num_layers="1000000"),
    "negative count": _meta(num_layers="-2"),
    "leading zero": _meta(block_size="04"),
    "key_bytes disagree": _meta(key_bytes="65"),
    "other layout": _meta(layout="hnd"),
    "other dtype": _meta(dtype="bfloat16"),
    "unknown dtype": _meta(dtype="int8"),
    "no metadata": lambda h: h.pop("__metadata__"),
    "non-U8 tensor": lambda h: h["tokens"].update(dtype="U32", shape=[4]),
    "2-D tensor": lambda h: h["layer.0.key"].update(shape=[8, 8]),
    "gap between tensors": lambda h: (h["layer.0.key"].update(data_offsets=[16, 80]),
                                      h["layer.0.value"].update(data_offsets=[81, 145])),
    "swapped order": lambda h: {k: h[k] for k in ["__metadata__", "layer.0.key", "tokens",
                                                  "layer.0.value", "layer.1.key",
                                                  "layer.1.value"]},
    "renamed tensor": lambda h: {("layer.0.k" if k == "layer.0.key" else k): v
                                 for k, v in h.items()},
    "extra tensor": lambda h: h.update({"extra": {"dtype": "U8", "shape": [0],
                                                  "data_offsets": [272, 272]}}),
    "header not an object": lambda h: [h],
}


@pytest.mark.parametrize("what", list(HANDMADE))
def test_handmade_rule_violations_are_rejected(what):
    data, _, _ = _encode()
    bad = _rebuild(data, HANDMADE[what])
    with pytest.raises(FormatError):
        _decode(bad)
    with pytest.raises(FormatError):  # even without a pool geometry to compare against
        decode_block(bad, abi=ABI, checksum_tag=TAG, key_hex=KEY, fingerprint_hex=FPH) \
            if what not in ("other dtype",) else _decode(bad)


def test_other_geometry_is_rejected_against_the_pool():
    data, _, _ = _encode()
    with pytest.raises(FormatError, match="geometry"):
        _decode(data, expected=BlockGeometry(4, 2, 1, 8, "bfloat16"))
    with pytest.raises(FormatError):
        _decode(data, expected=BlockGeometry(4, 1, 1, 8, "float16"))


def test_duplicate_json_keys_and_garbage_headers_are_rejected():
    data, _, _ = _encode()
    n = struct.unpack_from("<Q", data)[0]
    js = data[8:8 + n].rstrip(b" ")
    dup = js[:-1] + b',"tokens":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}}'
    dup += b" " * (-len(dup) % 8)
    with pytest.raises(FormatError, match="duplicate"):
        _decode(struct.pack("<Q", len(dup)) + dup + data[8 + n:])
    with pytest.raises(FormatError):
        _decode(struct.pack("<Q", 2**63 + 5) + data[8:])
    with pytest.raises(FormatError):
        _decode(b"\xff" * 64)


def test_forged_huge_counts_are_rejected_before_allocating():
    # num_layers claims a 256 GiB payload; decode compares with the bytes present first.
    data, _, _ = _encode()
    bad = _rebuild(data, _meta(num_layers="4096", head_dim="65536", num_kv_heads="4096"))
    with pytest.raises(FormatError):
        decode_block(bad, abi=ABI, checksum_tag=TAG)


from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=40)
@given(bs=st.sampled_from([1, 4, 8, 16]), layers=st.integers(1, 4), heads=st.integers(1, 3),
       dtype=st.sampled_from(["float16", "bfloat16", "float32", "q8"]),
       seed=st.integers(0, 2**32 - 1), pos=st.floats(0, 1), bit=st.integers(0, 7))
def test_any_geometry_round_trips_and_any_bit_flip_is_rejected(bs, layers, heads, dtype, seed,
                                                                pos, bit):
    g = BlockGeometry(bs, layers, heads, 32, dtype)
    data, toks, buf = _encode(g, seed)
    d = _decode(data, expected=g)
    assert np.array_equal(d.tokens, toks) and np.array_equal(d.payload, buf)
    bad = bytearray(data)
    i = min(int(pos * len(bad)), len(bad) - 1)
    bad[i] ^= 1 << bit
    with pytest.raises(FormatError):
        _decode(bytes(bad), expected=g)


def test_public_header_bound_matches_the_spec_formula():
    from pathlib import Path

    import pagedkv
    assert (Path(pagedkv.get_include()) / "pagedkv" / "cold.h").is_file()
    for g in (G, BlockGeometry(16, 32, 8, 128, "bfloat16"), BlockGeometry(16, 2, 8, 128, "q8")):
        n = 1 + 2 * g.num_layers
        assert g.bound == g.bytes_per_block + 4 * g.block_size + 256 * n + 1024 + 15
    assert BlockGeometry(16, 2, 8, 128, "q8").slab_bytes == 16 * 8 * 128 // 32 * 34
    with pytest.raises(InvalidArgument, match="multiple of 32"):
        BlockGeometry(16, 2, 8, 48, "q8")


@pytest.mark.parametrize("data", ["text", None, 12, [0, 1]])
def test_decoding_a_non_bytes_object_is_a_type_error_naming_it(data):
    from pagedkv.cold.codec import decode_block, decode_sidecar
    from pagedkv.errors import InvalidArgumentType
    match = rf"data must be a bytes-like object .*got {type(data).__name__}"
    with pytest.raises(InvalidArgumentType, match=match):
        decode_block(data, abi="a", checksum_tag=b"t")
    with pytest.raises(InvalidArgumentType, match=match):
        decode_sidecar(data, abi="a", checksum_tag=b"t", group="gdn_state")


def test_geometry_of_something_else_and_a_negative_tensor_count_are_refused():
    from pagedkv.cold.codec import BlockGeometry, block_bound, header_overhead
    from pagedkv.errors import InvalidArgument, InvalidArgumentType
    with pytest.raises(InvalidArgumentType, match=r"geometry must be a PoolGeometry or "
                                                  r"BlockGeometry .*got int"):
        block_bound(5)
    with pytest.raises(InvalidArgumentType, match="got dict"):
        BlockGeometry.of({"block_size": 4})
    assert header_overhead(0) == 1039 and header_overhead(2) == 1551
    with pytest.raises(InvalidArgument, match=r"n_tensors = -1 must be >= 0"):
        header_overhead(-1)
