"""HFQM v1 reader and writer (docs/contracts/hfqm-and-quant.md, '2. HFQM v1 container'): exact
bytes, API, validation, fuzzing."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hfqm_samples import (
    MINIMAL_METADATA,
    MINIMAL_QUANTIZATION_HASH,
    MINIMAL_SHA256,
    hfq4g256_ramp_group,
    write_minimal,
    write_mixed,
)
from pagedkv.errors import (
    BadBundle,
    BadMagic,
    BadMetadata,
    BadName,
    CorruptPayload,
    CountMismatch,
    FormatError,
    InvalidArgument,
    SizeMismatch,
    TensorNotFound,
    Truncated,
    UnknownQuantType,
    UnsupportedVersion,
)
from pagedkv.hfqm import (
    HfqmFile,
    HfqmWriter,
    PlannedTensor,
    compute_quantization_hash,
    plan_of,
    verify_quantization_hash,
    write_mtp_bundle,
)
from pagedkv.hfqm import index as hfqm_index
from pagedkv.quant import qtypes


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# --- docs/contracts/hfqm-and-quant.md, '5.4 Minimal HFQM v1 file (layout verified, hashes derived)'
# minimal file ---


def test_ramp_group_is_the_verified_hfq4g256_vector():
    assert hashlib.sha256(hfq4g256_ramp_group().tobytes()).hexdigest()[:16] == "9b951e76fb1696b7"


@pytest.mark.parametrize("use_plan", [False, True])
def test_minimal_file_is_reproduced_exactly(tmp_path, use_plan):
    path = tmp_path / "min.hfq"
    plan = [PlannedTensor("a.weight", 6, (1, 256), 256, 136),
            PlannedTensor("a.norm", 1, (4,), 0, 8)] if use_plan else None
    write_minimal(path, plan=plan)
    data = path.read_bytes()
    assert len(data) == 4240
    assert data[:32].hex() == ("4846514d" "01000000" "00000000" "02000000"
                               "2000000000000000" "0010000000000000")
    assert data[32:88] == json.dumps(MINIMAL_METADATA, separators=(",", ":")).encode()
    assert data[88:150].hex() == (
        "02000000" "0800" "612e776569676874" "06" "02" "01000000" "00010000" "00010000"
        "8800000000000000" "0600" "612e6e6f726d" "01" "01" "04000000" "00000000"
        "0800000000000000")
    assert data[150:4096] == bytes(4096 - 150)
    assert data[4232:4240].hex() == "003c004000420044"
    assert sha256(path) == MINIMAL_SHA256
    assert compute_quantization_hash(path) == MINIMAL_QUANTIZATION_HASH
    assert os.listdir(tmp_path) == ["min.hfq"]  # no temp file left behind


def test_minimal_file_reads_back(tmp_path):
    path = tmp_path / "min.hfq"
    write_minimal(path)
    with HfqmFile(path) as f:
        assert (f.version, f.arch_id, len(f), f.data_offset, f.metadata_offset) == (1, 0, 2, 4096, 32)
        assert f.metadata == MINIMAL_METADATA
        assert f.metadata_bytes == 56
        assert [tuple(t) for t in f.tensors] == [
            ("a.weight", 6, "HFQ4G256", (1, 256), 256, 136, 4096),
            ("a.norm", 1, "F16", (4,), 0, 8, 4232)]
        norm = f["a.norm"]
        assert norm.dtype == np.float16 and norm.tolist() == [1, 2, 3, 4]
        assert f["a.weight"].dtype == np.uint8 and f["a.weight"].shape == (136,)
        assert f["a.weight"].tobytes() == hfq4g256_ramp_group().tobytes()
        assert f.mtp is None
        assert repr(f) == (f"<HfqmFile {str(path)!r} HFQM v1, arch 0 (LLaMA/Mistral dense), "
                           "2 tensors, 144 payload bytes, 4240 bytes>")


def test_quantization_hash_key_is_added_and_matches_the_recomputed_value(tmp_path):
    path = tmp_path / "h.hfq"
    write_minimal(path, add_quantization_hash=True)
    with HfqmFile(path) as f:
        qh = f.metadata["quantization_hash"]
        assert qh["value"] == MINIMAL_QUANTIZATION_HASH == compute_quantization_hash(f)
        assert {k: qh[k] for k in ("algorithm", "seed", "scope", "tensor_count",
                                   "payload_bytes")} == {
            "algorithm": "xxh64", "seed": 0, "scope": "hfq_tensor_index_and_payload_v1",
            "tensor_count": 2, "payload_bytes": 144}
        assert qh["producer"]["package"] == "pagedkv"
        assert list(f.metadata) == ["architecture", "config", "quantization_hash"]
        assert f.data_offset == 4096


def test_verify_quantization_hash(tmp_path):
    write_minimal(tmp_path / "h.hfq", add_quantization_hash=True)
    write_minimal(tmp_path / "plain.hfq")
    assert verify_quantization_hash(tmp_path / "h.hfq") is True
    assert verify_quantization_hash(tmp_path / "plain.hfq") is None
    data = bytearray((tmp_path / "h.hfq").read_bytes())
    data[-1] ^= 1  # one payload bit
    (tmp_path / "h.hfq").write_bytes(bytes(data))
    with pytest.raises(BadMetadata, match="value 43f356738983a9fd != "):
        verify_quantization_hash(tmp_path / "h.hfq")


# --- round trips and the streaming paths -------------------------------------------------


def _rewrite(src, dst, **kwargs):
    with HfqmFile(src) as f:
        start = f.metadata_offset
        meta = bytes(f._read(start, f.metadata_bytes))
        with HfqmWriter(dst, arch_id=f.arch_id, metadata=meta, plan=plan_of(f), **kwargs) as w:
            for t in f.tensors:
                w.add(t.name, t.qt, t.shape, f.raw(t.name), group_size=t.group_size)


def test_round_trip_is_byte_identical(tmp_path):
    arrays = write_mixed(tmp_path / "a.hfq")
    _rewrite(tmp_path / "a.hfq", tmp_path / "b.hfq")
    assert (tmp_path / "a.hfq").read_bytes() == (tmp_path / "b.hfq").read_bytes()
    with HfqmFile(tmp_path / "b.hfq") as f:
        for name, data in arrays.items():
            assert f.raw(name).tobytes() == data.tobytes()
        assert f.metadata["tokenizer"] == "{\"x\": \"é\"}"   # stays a string


@pytest.mark.parametrize("kwargs", [
    {"buffer_bytes": 0},                             # stream at once, 64 KiB reserve
    {"buffer_bytes": 0, "index_reserve_bytes": 0},   # index outgrows it: payloads move
])
def test_streaming_paths_give_the_same_tensors(tmp_path, kwargs):
    arrays = write_mixed(tmp_path / "exact.hfq")
    write_mixed(tmp_path / "stream.hfq", **kwargs)
    with HfqmFile(tmp_path / "exact.hfq") as a, HfqmFile(tmp_path / "stream.hfq") as b:
        assert a.names == b.names
        assert b.data_offset % 4096 == 0 and b.data_offset >= a.data_offset
        for name in arrays:
            assert b.raw(name).tobytes() == a.raw(name).tobytes() == arrays[name].tobytes()
        assert compute_quantization_hash(a) == compute_quantization_hash(b)
    if kwargs.get("index_reserve_bytes") == 0:
        assert (tmp_path / "exact.hfq").read_bytes() == (tmp_path / "stream.hfq").read_bytes()


def test_chunked_tensor_data_is_concatenated(tmp_path):
    group = hfq4g256_ramp_group()
    with HfqmWriter(tmp_path / "c.hfq", arch_id=0, metadata=MINIMAL_METADATA) as w:
        w.add("a.weight", "hfq4g256", [1, 256], iter([group[:100], group[100:]]))
        w.add("a.norm", "f16", [4], np.array([1, 2, 3, 4], dtype=np.float16))
    assert sha256(tmp_path / "c.hfq") == MINIMAL_SHA256


# --- reader API --------------------------------------------------------------------------


def test_typed_views_are_zero_copy_and_read_only_or_copied_when_misaligned(tmp_path):
    arrays = write_mixed(tmp_path / "m.hfq")
    with HfqmFile(tmp_path / "m.hfq") as f:
        info = {t.name: t for t in f.tensors}
        norm = f["model.layers.0.input_layernorm.weight"]
        assert info["model.layers.0.input_layernorm.weight"].offset % 4 != 0  # after 34 B
        assert norm.dtype == np.float32 and norm.tolist() == [1.5, -2, 3]
        assert norm.flags.owndata or norm.base is not None
        assert not norm.flags.writeable
        bf16 = f["lm_head.weight"]
        assert bf16.dtype == np.uint16 and bf16.shape == (2, 3)
        assert bf16.tobytes() == arrays["lm_head.weight"].tobytes()
        assert f["tid2eid"].dtype == np.uint32 and f["tid2eid"].tolist() == [0, 7, 14, 21]
        h = f["h.norm"]
        assert h.shape == (2, 2) and h.dtype == np.float16
        for name in f:
            view = f[name]
            assert not view.flags.writeable
            with pytest.raises(ValueError):
                view.reshape(-1)[:1] = 0
            raw = f.raw(name)
            assert raw.dtype == np.uint8 and raw.nbytes == info[name].nbytes
            if info[name].offset % view.itemsize == 0:
                assert np.shares_memory(view, raw)     # zero-copy
            else:
                assert not np.shares_memory(view, raw)  # copied


def test_name_aliases_and_lookup_errors(tmp_path):
    write_mixed(tmp_path / "m.hfq")
    with HfqmFile(tmp_path / "m.hfq") as f:
        full = f.raw("model.language_model.embed_tokens.weight")
        for alias in ("model.embed_tokens.weight", "embed_tokens.weight"):
            assert alias in f
            assert np.shares_memory(f.raw(alias), full)
        assert f.info("layers.0.mlp.up_proj.weight").name == "model.layers.0.mlp.up_proj.weight"
        assert "nope" not in f and 3 not in f
        with pytest.raises(TensorNotFound, match="'nope'"):
            f["nope"]
        with pytest.raises(KeyError):
            f.raw("nope")
        with pytest.raises(InvalidArgument, match="outside 0..6"):
            f.raw(7)
        assert f.raw(0).nbytes == 34


def test_views_outlive_close_and_closed_access_raises(tmp_path):
    write_minimal(tmp_path / "min.hfq")
    f = HfqmFile(tmp_path / "min.hfq")
    view = f["a.norm"]
    f.close()
    f.close()  # idempotent
    assert f.closed and "closed" in repr(f)
    assert view.tolist() == [1, 2, 3, 4]
    with pytest.raises(InvalidArgument, match="closed"):
        f["a.norm"]


def test_large_file_path_reads_the_same(tmp_path):
    arrays = write_mixed(tmp_path / "m.hfq")
    with HfqmFile(tmp_path / "m.hfq", _whole_file_mmap_limit_bytes=0) as f:
        for name, data in arrays.items():
            assert f.raw(name).tobytes() == data.tobytes()
        assert f["lm_head.weight"].shape == (2, 3)
        assert f.metadata["architecture"] == "qwen2"


def test_mtp_bundle_trailer(tmp_path):
    write_minimal(tmp_path / "trunk.hfq")
    with HfqmWriter(tmp_path / "head.hfq", arch_id=21, metadata={"architecture": "qwen3_5_mtp"}) as w:
        w.add("enorm", "f32", [2], np.array([0.25, 4], np.float32))
    trunk = (tmp_path / "trunk.hfq").read_bytes()
    head = (tmp_path / "head.hfq").read_bytes()
    bundle = tmp_path / "b.mq4-mtp"
    bundle.write_bytes(trunk + head + b"HFBNDMTP" + struct.pack("<Q", len(trunk)))
    with HfqmFile(bundle) as f:
        assert f.names == ["a.weight", "a.norm"]
        mtp = f.mtp
        assert mtp is not None and mtp.base == len(trunk) and mtp.arch_id == 21
        assert mtp["enorm"].tolist() == [0.25, 4]
        assert mtp.info("enorm").offset == len(trunk) + 4096
        assert mtp.mtp is None
    # write_mtp_bundle produces the same bytes, atomically, and checks its inputs.
    assert write_mtp_bundle(tmp_path / "trunk.hfq", tmp_path / "head.hfq",
                            tmp_path / "w.mq4-mtp") == len(trunk)
    assert (tmp_path / "w.mq4-mtp").read_bytes() == bundle.read_bytes()
    with pytest.raises(InvalidArgument, match="arch_id 0; an MTP head has arch_id 21"):
        write_mtp_bundle(tmp_path / "trunk.hfq", tmp_path / "trunk.hfq", tmp_path / "x.hfq")
    with pytest.raises(InvalidArgument, match="not bundles"):
        write_mtp_bundle(bundle, tmp_path / "head.hfq", tmp_path / "x.hfq")
    assert not (tmp_path / "x.hfq").exists()
    assert sorted(os.listdir(tmp_path)) == ["b.mq4-mtp", "head.hfq", "trunk.hfq", "w.mq4-mtp"]
    # A trailer that does not point past the trunk at an HFQM section is a broken bundle
    # (issue 10); tests/test_hfqm_hostile.py covers every way to get it wrong.
    bad = tmp_path / "bad.hfq"
    bad.write_bytes(trunk + head + b"HFBNDMTP" + struct.pack("<Q", 5))
    with HfqmFile(bad) as f, pytest.raises(BadBundle, match="points at byte 5"):
        f.mtp  # noqa: B018


# --- validation (docs/contracts/hfqm-and-quant.md, '2.4 Reader validation') -----------------------


def _minimal_bytes(tmp_path) -> bytearray:
    write_minimal(tmp_path / "src.hfq")
    return bytearray((tmp_path / "src.hfq").read_bytes())


def _open_bytes(tmp_path, data, name="x.hfq"):
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return HfqmFile(path)


def _patch(data, offset, fmt, value):
    struct.pack_into(fmt, data, offset, value)
    return data


@pytest.mark.parametrize("mutate,exc,message", [
    (lambda d: d[:31], Truncated, "offset 31: file holds 31 bytes"),
    (lambda d: b"", Truncated, "offset 0: file holds 0 bytes"),
    (lambda d: b"GGUF" + d[4:], BadMagic, "offset 0: magic is b'GGUF'"),
    (lambda d: b"HFQ!" + d[4:], BadMagic, "incomplete"),
    (lambda d: _patch(d, 4, "<I", 2), UnsupportedVersion, "xynexus fork layout"),
    (lambda d: _patch(d, 4, "<I", 0), UnsupportedVersion, "version 0"),
    (lambda d: _patch(d, 12, "<I", 3), CountMismatch, "offset 88: index count 2 != header n_tensors 3"),
    (lambda d: _patch(d, 16, "<Q", 8), Truncated, "metadata_offset (8)"),
    (lambda d: _patch(d, 24, "<Q", 8192), Truncated, "data section at byte 8192"),
    (lambda d: _patch(d, 24, "<Q", 80), BadMetadata, "unterminated"),
    (lambda d: _patch(d, 16, "<Q", 33), BadMetadata, "does not start with '{'"),
    (lambda d: d[:4236], Truncated, "tensor 'a.norm', offset 4232: payload of 8 bytes"),
    (lambda d: d[:4100], Truncated, "tensor 'a.weight', offset 4096: payload of 136 bytes"),
    (lambda d: _patch(d, 88 + 4 + 2 + 8, "<B", 99), UnknownQuantType,
     "tensor 'a.weight', offset 102: quant type 99"),
    (lambda d: _patch(d, 88 + 4 + 2 + 8, "<B", 23), UnknownQuantType, "quant type 23"),
    (lambda d: _patch(d, 88 + 4 + 2 + 8, "<B", 130), UnknownQuantType, "calibration"),
    (lambda d: _patch(d, 88 + 4 + 2 + 8, "<B", 8), SizeMismatch,
     "data_size 136 != 200 bytes required by quant type 8 and shape (1, 256)"),
    (lambda d: _patch(d, 88 + 4 + 2 + 8 + 2, "<I", 2), SizeMismatch, "!= 272"),
    (lambda d: _patch(_patch(d, 88 + 4 + 2 + 8, "<B", 44), 88 + 4 + 2 + 8 + 2 + 4, "<I", 128),
     SizeMismatch, "multiple of 256, got K=128"),
    (lambda d: _patch(d, 88 + 4 + 2 + 8 + 1, "<B", 9), SizeMismatch, "n_dims 9"),
    (lambda d: _patch(d, 88 + 4 + 2 + 8 + 1, "<B", 200), SizeMismatch, "n_dims 200"),
    (lambda d: _patch(d, 88 + 4, "<H", 0xFFFF), Truncated, "index entry #0 runs past"),
    (lambda d: _patch(_patch(d, 104, "<I", 0xFFFFFFFF), 108, "<I", 0xFFFFFFFF), SizeMismatch,
     "more than 2**48 elements"),
    (lambda d: _patch(d, 88 + 4 + 2, "<B", 0xFF), BadName, "is not UTF-8"),
])
def test_broken_files_raise_the_specific_error(tmp_path, mutate, exc, message):
    data = bytearray(mutate(_minimal_bytes(tmp_path)))
    with pytest.raises(exc) as info:
        _open_bytes(tmp_path, data)
    text = str(info.value)
    assert text.startswith(str(tmp_path / "x.hfq"))
    if message is not None:
        assert message in text
    assert info.value.offset is not None


def test_duplicate_names_are_refused(tmp_path):
    with HfqmWriter(tmp_path / "d.hfq", arch_id=0, metadata=MINIMAL_METADATA) as w:
        w.add("a.aaaa", "f16", [1], np.ones(1, np.float16))
        w.add("a.bbbb", "f16", [1], np.ones(1, np.float16))
    data = bytearray((tmp_path / "d.hfq").read_bytes())
    pos = data.index(b"a.bbbb")
    data[pos:pos + 6] = b"a.aaaa"
    with pytest.raises(BadName, match="appears twice"):
        _open_bytes(tmp_path, data)


def test_names_that_are_one_name_for_lookups_are_refused(tmp_path):
    """Found by a review: the writer took `model.a.norm`, `a.norm` and
    `model.language_model.a.norm` into one file and the reader opened it, so which tensor
    a lookup returned depended on the spelling asked for (lookups treat the three as one
    name). The writer refuses the second, naming both; the reader refuses such a file."""
    path = tmp_path / "a.hfq"
    one = np.ones(1, np.float16)
    for first, second in [("model.a.norm", "a.norm"), ("a.norm", "model.a.norm"),
                          ("model.a.norm", "model.language_model.a.norm"),
                          ("model.language_model.a.norm", "a.norm")]:
        w = HfqmWriter(path, arch_id=0, metadata=MINIMAL_METADATA)
        w.add(first, "f16", [1], one)
        with pytest.raises(InvalidArgument, match=rf"tensor '{re.escape(second)}' is the "
                                                  rf"same name as the earlier tensor "
                                                  rf"'{re.escape(first)}'"):
            w.add(second, "f16", [1], one)
        w.add("b.norm", "f16", [1], one)   # the writer is unchanged by the refusal
        w.close()
        with HfqmFile(path) as f:
            assert f.names == [first, "b.norm"]
        plan = [PlannedTensor(first, 1, (1,), 0, 2), PlannedTensor(second, 1, (1,), 0, 2)]
        with pytest.raises(InvalidArgument, match="same name as the earlier tensor"):
            HfqmWriter(tmp_path / "p.hfq", arch_id=0, metadata=MINIMAL_METADATA, plan=plan)
        assert not (tmp_path / "p.hfq").exists()
    # A file written by another tool: patch a name into an alias of another.
    with HfqmWriter(tmp_path / "d.hfq", arch_id=0, metadata=MINIMAL_METADATA) as w:
        w.add("model.qq.w", "f16", [1], one)
        w.add("x" * 21 + "qq.w", "f16", [1], one)
    data = bytearray((tmp_path / "d.hfq").read_bytes())
    pos = data.index(b"x" * 21)
    data[pos:pos + 25] = b"model.language_model.qq.w"
    with pytest.raises(BadName, match=r"tensor names 'model.qq.w' \(entry #0\) and "
                                      r"'model.language_model.qq.w' \(entry #1\) are one "
                                      r"name for lookups"):
        _open_bytes(tmp_path, data)


def test_qt_130_is_accepted_only_in_calib_files(tmp_path):
    with HfqmWriter(tmp_path / "w.calib.hfq", arch_id=0, metadata={}) as w:
        w.add("w.hessian", 130, [4, 4], np.zeros(28, np.uint8))
    with HfqmFile(tmp_path / "w.calib.hfq") as f:
        assert f.info("w.hessian").qt_name == "CalibHessian"
    os.rename(tmp_path / "w.calib.hfq", tmp_path / "w.hfq")
    with pytest.raises(UnknownQuantType, match="calibration"):
        HfqmFile(tmp_path / "w.hfq")


@pytest.mark.parametrize("shape", [[0xFFFFFFFF], [4, 3], [2, 2, 2]])
def test_a_calibration_hessian_must_be_square(tmp_path, shape):
    # qt 130's size rule 4K + K(K-1) wrapped u64 at K = 2**32 - 1, so a one-dim "Hessian"
    # with data_size 2**32 - 2 opened (found by a review); [K, K] keeps K <= 2**24.
    with pytest.raises(InvalidArgument, match=r"square \[K, K\]"):
        qtypes.expected_nbytes(130, shape)
    k = shape[-1]
    size = (4 * k + k * (k - 1)) % (1 << 64)
    meta = json.dumps({"architecture": "llama", "config": {"model_type": "llama"}}).encode()
    entry = (struct.pack("<H", 1) + b"h" + struct.pack("<BB", 130, len(shape))
             + struct.pack(f"<{len(shape)}I", *shape) + struct.pack("<IQ", 0, size))
    path = tmp_path / "x.calib.hfq"
    head = (b"HFQM" + struct.pack("<IIIQQ", 1, 0, 1, 32, 4096) + meta
            + struct.pack("<I", 1) + entry)
    path.write_bytes(head.ljust(4096, b"\0"))  # the data section starts; no payload
    with pytest.raises(SizeMismatch, match=r"needs a square \[K, K\] shape, got "
                                           + re.escape(str(tuple(shape)))):
        HfqmFile(path)


def test_registered_p2_qt_parses_gives_raw_bytes_and_refuses_decoding(tmp_path):
    arrays = write_mixed(tmp_path / "m.hfq")
    with HfqmFile(tmp_path / "m.hfq") as f:
        name = "model.layers.0.self_attn.q_proj.weight"
        assert f.info(name).qt_name == "HFP4G32"
        assert f[name].tobytes() == arrays[name].tobytes()
        # random bytes: the FP4 row header does not say 1 block with flags 0
        with pytest.raises(CorruptPayload, match="tensor 'model.layers.0.self_attn"
                                                 ".q_proj.weight', offset 4442: hfp4g32 row 0"):
            f.dequantize(name)
        decoded = f.dequantize("h.norm")
        assert decoded.dtype == np.float32 and decoded.tolist() == [[1, -1], [0.5, 65504]]
        bf16 = f.dequantize("lm_head.weight")
        assert bf16[0, 0] == 1.0 and bf16.shape == (2, 3)


@pytest.mark.parametrize("meta,arch,message", [
    (b'{"a":tru}', 0, "not valid UTF-8 JSON"),
    # No JSON (hipfire's loader refuses them; json.loads took them as nan/inf)
    (b'{"a":NaN}', 0, r"not valid UTF-8 JSON \(NaN is not JSON\)"),
    (b'{"a":[-Infinity]}', 0, r"not valid UTF-8 JSON \(-Infinity is not JSON\)"),
    (b'{"a":1e999}', 0, r"not valid UTF-8 JSON \(1e999 does not fit a float64\)"),
    (b'{"architecture":"qwen3_5"}', 0, "arch_id is 0"),
    (b'{"config":{"model_type":"qwen3_5_moe_text"}}', 1, "arch_id is 1"),
    (b'{"config":{"architectures":["Qwen3_5ForConditionalGeneration"]}}', 7, "arch_id is 7"),
])
def test_bad_metadata_is_reported_when_parsed(tmp_path, meta, arch, message):
    path = tmp_path / "m.hfq"
    # Bypass the writer's own metadata check to build the broken file.
    data = bytearray(b"HFQM" + struct.pack("<IIIQQ", 1, arch, 0, 32, 4096))
    body = meta + struct.pack("<I", 0)
    data += body + bytes(4096 - len(data) - len(body))
    path.write_bytes(bytes(data))
    f = HfqmFile(path)          # opening does not parse the JSON
    assert len(f) == 0
    with pytest.raises(BadMetadata, match=message):
        _ = f.metadata
    assert f._metadata is None


@pytest.mark.parametrize("qwen_arch", [5, 6])
def test_qwen35_metadata_with_its_arch_ids_is_fine(tmp_path, qwen_arch):
    with HfqmWriter(tmp_path / "q.hfq", arch_id=qwen_arch,
                    metadata={"architecture": "qwen3_5"}) as w:
        w.add("x", "f32", [1], np.ones(1, np.float32))
    with HfqmFile(tmp_path / "q.hfq") as f:
        assert f.metadata == {"architecture": "qwen3_5"}


def _check_opened_file_stays_in_bounds(f: HfqmFile, size: int) -> None:
    for t in f.tensors:
        assert t.offset + t.nbytes <= size
        assert f.raw(t.name).nbytes == t.nbytes
        _ = f[t.name]
    try:
        _ = f.metadata
    except BadMetadata:
        pass


def test_truncation_at_every_offset_raises_a_format_error(tmp_path):
    data = bytes(_minimal_bytes(tmp_path))
    path = tmp_path / "t.hfq"
    for n in list(range(200)) + list(range(200, 4096, 97)) + list(range(4096, len(data))):
        path.write_bytes(data[:n])
        with pytest.raises(FormatError):
            HfqmFile(path)


def test_bit_flips_in_header_metadata_and_index_never_escape_the_file(tmp_path):
    data = bytes(_minimal_bytes(tmp_path))
    path = tmp_path / "f.hfq"
    outcomes = {"ok": 0, "error": 0}
    for pos in range(150):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[pos] ^= 1 << bit
            path.write_bytes(bytes(flipped))
            try:
                f = HfqmFile(path)
            except FormatError:
                outcomes["error"] += 1
                continue
            outcomes["ok"] += 1
            with f:
                _check_opened_file_stays_in_bounds(f, len(flipped))
    # Flips inside string values or in group_size/arch_id are legal files.
    assert outcomes["ok"] > 0 and outcomes["error"] > 0


def test_json_brace_scan_handles_strings_and_escapes():
    buf = np.frombuffer(b'{"a":"}\\"{","b":{"c":"\xc3\xa9"}}XYZ', np.uint8)
    assert hfqm_index.json_end(buf, 0, len(buf)) == len(buf) - 3
    assert hfqm_index.json_end(buf, 0, 10) == -1
    assert hfqm_index.json_end(buf, 1, len(buf)) == -2


# --- writer errors leave the writer unchanged -------------------------------------------


def test_writer_rejects_bad_tensors_without_changing_state(tmp_path):
    path = tmp_path / "w.hfq"
    w = HfqmWriter(path, arch_id=0, metadata=MINIMAL_METADATA)
    with pytest.raises(InvalidArgument, match="needs 136"):
        w.add("a.weight", "hfq4g256", [1, 256], np.zeros(135, np.uint8))
    with pytest.raises(InvalidArgument, match="needs 136"):
        w.add("a.weight", "hfq4g256", [1, 256], iter([np.zeros(100, np.uint8)] * 2))
    with pytest.raises(InvalidArgument, match="reserved"):
        w.add("a.weight", 23, [1], b"")
    with pytest.raises(InvalidArgument, match="multiple of 256"):
        w.add("a.weight", "mq4g256v2", [1, 128], np.zeros(136, np.uint8))
    with pytest.raises(InvalidArgument, match="at most 8 dims"):
        w.add("a.weight", "f16", [1] * 9, np.zeros(2, np.uint8))
    with pytest.raises(InvalidArgument, match="not in the register"):
        w.add("a.weight", "q9", [1], b"")
    w.add("a.weight", "hfq4g256", [1, 256], hfq4g256_ramp_group())
    with pytest.raises(InvalidArgument, match="already added"):
        w.add("a.weight", "f16", [4], np.zeros(4, np.float16))
    w.add("a.norm", "f16", [4], np.array([1, 2, 3, 4], dtype=np.float16))
    w.close()
    assert sha256(path) == MINIMAL_SHA256


def test_writer_plan_is_enforced(tmp_path):
    plan = [("a.weight", 6, (1, 256), 256, 136), ("a.norm", 1, (4,), 0, 8)]
    w = HfqmWriter(tmp_path / "p.hfq", arch_id=0, metadata=MINIMAL_METADATA, plan=plan)
    with pytest.raises(InvalidArgument, match="differs from the plan"):
        w.add("a.norm", "f16", [4], np.zeros(4, np.float16))
    w.add("a.weight", "hfq4g256", [1, 256], hfq4g256_ramp_group())
    w.add("a.norm", "f16", [4], np.array([1, 2, 3, 4], dtype=np.float16))
    w.close()
    assert sha256(tmp_path / "p.hfq") == MINIMAL_SHA256
    with pytest.raises(InvalidArgument, match="data_size 9 != 8"):
        HfqmWriter(tmp_path / "q.hfq", arch_id=0, metadata={}, plan=[("n", 1, (4,), 0, 9)])


def test_close_with_an_incomplete_plan_deletes_the_temporary_file(tmp_path):
    """Found by a review: close() refused an incomplete plan before its abort path, so the
    temporary file (and descriptor) outlived a `with` block until garbage collection."""
    plan = [("a.weight", 6, (1, 256), 256, 136), ("a.norm", 1, (4,), 0, 8)]
    (tmp_path / "p.hfq").write_bytes(b"previous")
    w = HfqmWriter(tmp_path / "p.hfq", arch_id=0, metadata=MINIMAL_METADATA, plan=plan)
    message = (r"^1 of the plan's 2 tensors were added; next expected: 'a.norm'; nothing "
               r"was written to .*p\.hfq$")
    with pytest.raises(InvalidArgument, match=message), w:
        w.add("a.weight", "hfq4g256", [1, 256], hfq4g256_ramp_group())
    assert w.closed and w._file is None
    assert os.listdir(tmp_path) == ["p.hfq"]
    assert (tmp_path / "p.hfq").read_bytes() == b"previous"
    with pytest.raises(InvalidArgument, match="is closed"):
        w.add("a.norm", "f16", [4], np.ones(4, np.float16))
    w.close()  # closed: a no-op


def test_interrupted_write_leaves_no_file(tmp_path):
    path = tmp_path / "out.hfq"
    with (pytest.raises(KeyboardInterrupt),
          HfqmWriter(path, arch_id=0, metadata=MINIMAL_METADATA) as w):
        w.add("a.norm", "f16", [4], np.ones(4, np.float16))
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []
    w = HfqmWriter(path, arch_id=0, metadata=MINIMAL_METADATA, buffer_bytes=0)
    w.add("a.norm", "f16", [4], np.ones(4, np.float16))
    (temp,) = os.listdir(tmp_path)
    assert temp.startswith(".out.hfq.") and temp.endswith(".tmp")
    assert (tmp_path / temp).read_bytes()[:4] == b"HFQ!"
    with pytest.raises(BadMagic):
        HfqmFile(tmp_path / temp)
    w.abort()
    assert os.listdir(tmp_path) == []


def test_writer_metadata_arguments(tmp_path):
    with pytest.raises(InvalidArgument, match="exactly one JSON object"):
        HfqmWriter(tmp_path / "a.hfq", arch_id=0, metadata='{"a":1} ')
    with pytest.raises(InvalidArgument, match="exactly one JSON object"):
        HfqmWriter(tmp_path / "a.hfq", arch_id=0, metadata="[1]")
    with pytest.raises(InvalidArgument, match="no arch_id mapping"):
        HfqmWriter(tmp_path / "a.hfq", arch_id="gpt2", metadata={})
    assert os.listdir(tmp_path) == []
    with HfqmWriter(tmp_path / "a.hfq", arch_id="qwen3_5_moe", metadata='{"k":"\\u00e9"}'):
        pass
    data = (tmp_path / "a.hfq").read_bytes()
    assert data[32:46] == b'{"k":"\\u00e9"}'  # JSON text is written verbatim
    with HfqmFile(tmp_path / "a.hfq") as f:
        assert f.arch_id == 6 and f.metadata == {"k": "é"} and len(f) == 0


@pytest.mark.parametrize("text,constant", [
    ('{"config":{"rope_theta":NaN}}', "NaN"),
    ('{"a":[1,Infinity]}', "Infinity"),
    ('{"a":-Infinity}', "-Infinity"),
    ('{"a":1e999}', "1e999 does not fit a float64"),
])
def test_writer_refuses_metadata_text_that_is_not_strict_json(tmp_path, text, constant):
    """Found by a review: JSON text with NaN/Infinity (which json.loads takes) was written
    verbatim, making metadata hipfire's serde_json cannot parse; a dict with the same
    value was already refused."""
    for metadata in (text, text.encode()):
        with pytest.raises(InvalidArgument) as info:
            HfqmWriter(tmp_path / "a.hfq", arch_id=0, metadata=metadata)
        assert str(info.value).startswith(f"{tmp_path / 'a.hfq'}: metadata JSON text does "
                                          "not parse as strict JSON: ")
        assert constant in str(info.value)
    assert os.listdir(tmp_path) == []


# --- property: random corruption of a richer file ---------------------------------------


_MIXED_CACHE: dict[str, bytes] = {}


def _mixed_bytes(tmp_path_factory) -> bytes:
    if "data" not in _MIXED_CACHE:
        path = tmp_path_factory.mktemp("mixed") / "m.hfq"
        write_mixed(path)
        _MIXED_CACHE["data"] = path.read_bytes()
    return _MIXED_CACHE["data"]


@given(edits=st.lists(st.tuples(st.integers(0, 600), st.integers(0, 255)), min_size=1,
                      max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 5000)))
def test_random_corruption_raises_a_format_error_or_stays_in_bounds(tmp_path_factory, edits,
                                                                   cut):
    data = bytearray(_mixed_bytes(tmp_path_factory))
    for pos, value in edits:  # header, metadata and index of the mixed file: bytes 0..456
        data[pos] = value
    if cut is not None:
        data = data[:cut]
    path = tmp_path_factory.getbasetemp() / "fuzz.hfq"
    path.write_bytes(bytes(data))
    try:
        f = HfqmFile(path)
    except FormatError:
        return
    with f:
        _check_opened_file_stays_in_bounds(f, len(data))
