"""Hostile HFQM files (issue 10): MTP trailers that point anywhere but at a head, forged
offsets on the plain-read path (sparse files, bounded memory), short reads, forged
tensor counts, and metadata no JSON parser can take (docs/formats/hfqm.md,
"Validation" and "MTP bundles")."""

from __future__ import annotations

import json
import os
import struct
import tracemalloc

import numpy as np
import pytest

from hfqm_samples import hfq4g256_ramp_group, write_minimal, write_mixed, write_odd_summary
from pagedkv.cli import main as cli_main
from pagedkv.errors import (
    BadBundle,
    BadMetadata,
    InvalidArgument,
    SizeMismatch,
    Truncated,
)
from pagedkv.hfqm import HfqmFile, HfqmWriter, positional_reads, reader, write_mtp_bundle
from pagedkv.hfqm.positional_reads import pread_exact

GiB = 1 << 30
READ_PATH = {"_whole_file_mmap_limit_bytes": 0}   # force the plain-read path


def _one_line_error(capsys, argv) -> str:
    assert cli_main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


# --- MTP bundle trailers ------------------------------------------------------------------


@pytest.fixture
def parts(tmp_path):
    write_minimal(tmp_path / "trunk.hfq")
    write_minimal(tmp_path / "head.hfq", arch_id=21)
    return (tmp_path / "trunk.hfq").read_bytes(), (tmp_path / "head.hfq").read_bytes()


def _trailer(offset: int) -> bytes:
    return b"HFBNDMTP" + struct.pack("<Q", offset)


@pytest.mark.parametrize("where,message", [
    (lambda t, h: 0, ("points at byte 0; the head must start after the trunk's last "
                      "payload (byte 4240)")),
    (lambda t, h: 100, "points at byte 100"),                  # inside the trunk
    (lambda t, h: len(t) - 1, f"points at byte {4240 - 1}"),   # the trunk's last byte
    (lambda t, h: len(t) + len(h), "leave room for its 32-byte header"),   # the trailer
    (lambda t, h: len(t) + len(h) - 8, "leave room"),          # header would cross it
    (lambda t, h: 2**64 - 1, "points at byte 18446744073709551615"),
    (lambda t, h: len(t) + 4, "holds b'\\x01\\x00\\x00\\x00', not an HFQM header"),
])
def test_trailer_must_point_past_the_trunk_at_an_hfqm_header(tmp_path, capsys, parts, where,
                                                             message):
    trunk, head = parts
    path = tmp_path / "b.hfq"
    path.write_bytes(trunk + head + _trailer(where(trunk, head)))
    with HfqmFile(path) as f:
        assert f.names == ["a.weight", "a.norm"]         # the trunk itself stays readable
        with pytest.raises(BadBundle) as info:
            f.mtp  # noqa: B018
        assert message in str(info.value) and str(path) in str(info.value)
        with pytest.raises(BadBundle):                   # not cached as "no head"
            f.mtp  # noqa: B018
    for argv in (["inspect", str(path)], ["inspect", str(path), "--json"]):
        assert message in _one_line_error(capsys, argv)


def test_trailer_at_offset_0_no_longer_recurses(tmp_path, capsys, parts):
    """The campaign's case: a valid file + HFBNDMTP + u64 0 made `f.mtp` the trunk itself,
    and `pagedkv inspect` died of RecursionError."""
    trunk, _ = parts
    path = tmp_path / "self.hfq"
    path.write_bytes(trunk + _trailer(0))
    with HfqmFile(path) as f, pytest.raises(BadBundle, match="points at byte 0"):
        f.mtp  # noqa: B018
    assert "points at byte 0" in _one_line_error(capsys, ["inspect", str(path)])


def test_head_must_be_the_mtp_arch_and_end_before_the_trailer(tmp_path, parts):
    trunk, head = parts
    write_minimal(tmp_path / "arch0.hfq")
    wrong_arch = tmp_path / "w.hfq"
    wrong_arch.write_bytes(trunk + (tmp_path / "arch0.hfq").read_bytes() + _trailer(len(trunk)))
    with HfqmFile(wrong_arch) as f, pytest.raises(BadBundle, match="arch_id 0, not the MTP "
                                                                   "arch 21"):
        f.mtp  # noqa: B018
    # The head's last payload (the 8-byte F16 norm) runs into the trailer.
    cut = tmp_path / "c.hfq"
    cut.write_bytes(trunk + head[:-4] + _trailer(len(trunk)))
    with HfqmFile(cut) as f, pytest.raises(BadBundle, match="inside the trailer"):
        f.mtp  # noqa: B018
    # write_mtp_bundle refuses a trunk whose trailer is broken (a FormatError).
    with pytest.raises(BadBundle):
        write_mtp_bundle(cut, tmp_path / "head.hfq", tmp_path / "out.hfq")
    assert not (tmp_path / "out.hfq").exists()


def test_valid_bundle_and_a_head_never_looks_for_its_own_head(tmp_path, parts):
    trunk, head = parts
    path = tmp_path / "ok.hfq"
    # The head region itself ends in a trailer pointing at 0: irrelevant, heads have none.
    path.write_bytes(trunk + head + _trailer(0) + _trailer(len(trunk)))
    with HfqmFile(path) as f:
        mtp = f.mtp
        assert mtp is not None and mtp.base == len(trunk) and mtp.arch_id == 21
        assert mtp.mtp is None
        assert mtp.raw("a.weight").tobytes() == hfq4g256_ramp_group().tobytes()


# --- the plain-read path: sparse files, forged offsets, short reads ------------------------


def _sparse_copy(tmp_path, name, data: bytes, *, data_offset: int, size: int):
    """``data`` (header, metadata, index) with its data_offset moved to ``data_offset`` and
    its payloads after it, in a sparse file of ``size`` bytes."""
    path = tmp_path / name
    head = bytearray(data[:4096])
    struct.pack_into("<Q", head, 24, data_offset)
    with open(path, "wb") as f:
        f.write(head)
        f.seek(data_offset)
        f.write(data[4096:])
        f.truncate(size)
    return path


def _peak_python_bytes(fn) -> int:
    """Peak bytes Python and NumPy allocate while ``fn`` runs (both report to tracemalloc)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("forged_gib", [1, 40])
def test_forged_data_offset_costs_no_memory_on_the_read_path(tmp_path, forged_gib):
    """The campaign's case: one pread(data_offset) before validation cost RSS equal to a
    forged data_offset (1 GiB from a sparse file; a bare MemoryError at 40 GiB)."""
    write_minimal(tmp_path / "m.hfq")
    data = (tmp_path / "m.hfq").read_bytes()
    offset = forged_gib * GiB
    path = _sparse_copy(tmp_path, "sparse.hfq", data, data_offset=offset,
                        size=offset + len(data) - 4096)
    opened = {}

    def open_it():
        with HfqmFile(path, **READ_PATH) as f:
            opened["names"] = f.names
            opened["raw"] = f.raw("a.weight").tobytes()
    assert _peak_python_bytes(open_it) < 8 << 20
    assert opened["names"] == ["a.weight", "a.norm"]
    assert opened["raw"] == hfq4g256_ramp_group().tobytes()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_peak_rss_of_opening_a_forged_file_stays_small(tmp_path):
    """The same 1 GiB forged data_offset, measured as the OS sees it: the peak resident
    set (VmHWM) of a fresh process that opens the file on the read path grows by less
    than 64 MiB. (Not ru_maxrss: Linux carries the parent's peak across fork and exec.)"""
    import subprocess
    import sys
    write_minimal(tmp_path / "m.hfq")
    data = (tmp_path / "m.hfq").read_bytes()
    path = _sparse_copy(tmp_path, "sparse.hfq", data, data_offset=GiB,
                        size=GiB + len(data) - 4096)
    script = (
        "import sys\n"
        "from pagedkv.hfqm import HfqmFile\n"
        "def peak_kib():\n"
        "    status = open('/proc/self/status').read()\n"
        "    return int(status.split('VmHWM:')[1].split()[0])\n"
        "before = peak_kib()\n"
        "with HfqmFile(sys.argv[1], _whole_file_mmap_limit_bytes=0) as f:\n"
        "    assert f.names == ['a.weight', 'a.norm'], f.names\n"
        "print(peak_kib() - before)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) < 64 << 10, f"peak RSS grew by {proc.stdout.strip()} KiB"


def test_unterminated_metadata_is_scanned_in_bounded_chunks(tmp_path):
    path = tmp_path / "open_brace.hfq"
    data_offset = 128 << 20
    with open(path, "wb") as f:
        f.write(struct.pack("<4sIIIQQ", b"HFQM", 1, 0, 0, 32, data_offset) + b'{"a": "')
        f.truncate(data_offset + 16)

    def open_it():
        with pytest.raises(BadMetadata, match=f"no closing '}}' before data_offset "
                                              f"{data_offset}"):
            HfqmFile(path, **READ_PATH)
    assert _peak_python_bytes(open_it) < 8 << 20


def test_forged_tensor_count_allocates_only_for_entries_that_parse(tmp_path):
    """n_tensors = 2**31 under a data_offset forged to 40 GiB: records for 2**31 entries
    would be 154 GiB; the third entry (zeros of the sparse file) fails first."""
    write_minimal(tmp_path / "m.hfq")
    data = bytearray((tmp_path / "m.hfq").read_bytes())
    struct.pack_into("<I", data, 12, 2**31)                 # header n_tensors
    struct.pack_into("<I", data, 88, 2**31)                 # index count
    path = _sparse_copy(tmp_path, "count.hfq", bytes(data), data_offset=40 * GiB,
                        size=40 * GiB + 4096)
    for kwargs in ({}, READ_PATH):                          # mapped and read paths
        def open_it(kwargs=kwargs):
            with pytest.raises(SizeMismatch) as info:
                HfqmFile(path, **kwargs)
            assert "tensor '', offset" in str(info.value)   # entry #2: an empty name
        assert _peak_python_bytes(open_it) < 8 << 20


@pytest.mark.parametrize("largest_read", [1, 7, 4096])
def test_short_reads_are_looped(tmp_path, monkeypatch, largest_read):
    """A read may return fewer bytes than asked (one call stops just under 2 GiB on Linux):
    every read of the plain-read path loops, and the result equals the mapped path's."""
    arrays = write_mixed(tmp_path / "m.hfq")
    with HfqmFile(tmp_path / "m.hfq") as mapped:
        want = (mapped.names, mapped.tensors, mapped.metadata)
    calls = []
    real_preadv = os.preadv

    def short_preadv(fd, buffers, offset):
        calls.append(offset)
        (view,) = buffers
        return real_preadv(fd, [memoryview(view)[:largest_read]], offset)
    monkeypatch.setattr(os, "preadv", short_preadv)
    with HfqmFile(tmp_path / "m.hfq", **READ_PATH) as f:
        assert (f.names, f.tensors, f.metadata) == want
        for name, data in arrays.items():
            assert f.raw(name).tobytes() == data.tobytes()
    assert len(calls) > 4096 // largest_read


def test_pread_exact_loops_and_reports_the_end_of_the_file(tmp_path, monkeypatch):
    path = tmp_path / "ten"
    path.write_bytes(bytes(range(10)))
    monkeypatch.setattr(positional_reads, "MAX_READ_CALL_BYTES", 3)   # 4 calls for 10 bytes
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_exact(fd, 10, 0, path=str(path)) == bytes(range(10))
        assert pread_exact(fd, 4, 6, path=str(path)) == bytes(range(6, 10))
        with pytest.raises(Truncated, match="the file ends at byte 10, inside a 6-byte read "
                                            "at byte 5") as info:
            pread_exact(fd, 6, 5, path=str(path))
        assert info.value.offset == 10 and info.value.path == str(path)
    finally:
        os.close(fd)


def test_read_path_errors_match_the_mapped_path(tmp_path):
    write_minimal(tmp_path / "m.hfq")
    data = bytearray((tmp_path / "m.hfq").read_bytes())
    cases = {
        "count": (12, "<I", 3),             # CountMismatch
        "qt": (88 + 4 + 2 + 8, "<B", 99),   # UnknownQuantType
        "meta": (16, "<Q", 33),             # metadata does not start with '{'
        "empty_meta": (16, "<Q", 4096),     # metadata_offset == data_offset
        "entry": (88 + 4, "<H", 0xFFFF),    # an entry running past data_offset
    }
    for name, (offset, fmt, value) in cases.items():
        broken = bytearray(data)
        struct.pack_into(fmt, broken, offset, value)
        path = tmp_path / f"{name}.hfq"
        path.write_bytes(bytes(broken))
        messages = []
        for kwargs in ({}, READ_PATH):
            with pytest.raises(Exception) as info:
                HfqmFile(path, **kwargs)
            messages.append((type(info.value), str(info.value)))
        assert messages[0] == messages[1], name


# --- metadata no parser can take --------------------------------------------------------------


def _deep(depth: int) -> str:
    return '{"config": {"x": ' + "[" * depth + "]" * depth + "}}"


def _one_tensor_file(path, metadata_text: bytes) -> None:
    """An HFQM file with ``metadata_text`` verbatim and one F16 tensor ``n`` = [1.0]."""
    index = struct.pack("<IH", 1, 1) + b"n" + struct.pack("<BBIIQ", 1, 1, 1, 0, 2)
    data_offset = -(-(32 + len(metadata_text) + len(index)) // 4096) * 4096
    header = struct.pack("<4sIIIQQ", b"HFQM", 1, 0, 1, 32, data_offset)
    body = header + metadata_text + index
    path.write_bytes(body + bytes(data_offset - len(body)) + np.float16(1).tobytes())


def test_deeply_nested_metadata_is_bad_metadata_everywhere(tmp_path, capsys):
    path = tmp_path / "deep.hfq"
    _one_tensor_file(path, _deep(100_000).encode())
    with HfqmFile(path) as f:
        assert f.names == ["n"] and f["n"].tolist() == [1.0]
        with pytest.raises(BadMetadata, match="deeper than the JSON parser allows"):
            f.metadata  # noqa: B018
    assert cli_main(["inspect", str(path)]) == 0
    assert "          error: " in capsys.readouterr().out
    assert cli_main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metadata"].startswith("error: ")
    with pytest.raises(InvalidArgument, match="w.hfq: metadata JSON text nests"):
        HfqmWriter(tmp_path / "w.hfq", arch_id=0, metadata=_deep(100_000))
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(InvalidArgument, match="w.hfq: metadata nests lists/dicts deeper"):
        HfqmWriter(tmp_path / "w.hfq", arch_id=0, metadata={"x": nested})
    assert os.listdir(tmp_path) == ["deep.hfq"]             # no temporary file left


def test_inspect_json_of_non_json_metadata_stays_json(tmp_path, capsys):
    """NaN in the metadata (no JSON; hipfire refuses it) was parsed as nan, and
    `inspect --json` printed `"config.rope_theta": NaN`, which no JSON parser reads."""
    path = tmp_path / "nan.hfq"
    _one_tensor_file(path, b'{"architecture":"llama","config":{"rope_theta":NaN}}')
    assert cli_main(["inspect", str(path), "--json"]) == 0
    out = capsys.readouterr().out
    info = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in the output"))
    assert info["metadata"] == (f"error: {path}, offset 32: metadata is not valid UTF-8 JSON "
                                "(NaN is not JSON)")
    assert info["tensors"][0]["name"] == "n"
    with HfqmFile(path) as f:
        with pytest.raises(BadMetadata):
            f.metadata  # noqa: B018
        assert f._metadata is None and f["n"].tolist() == [1.0]


def test_metadata_larger_than_the_limit_is_refused(tmp_path, monkeypatch):
    write_minimal(tmp_path / "m.hfq")
    monkeypatch.setattr(reader, "MAX_METADATA_BYTES", 55)
    with HfqmFile(tmp_path / "m.hfq") as f, pytest.raises(BadMetadata, match="56 bytes"):
        f.metadata  # noqa: B018


def test_inspect_text_mode_summarises_any_json_value(tmp_path, capsys):
    """The campaign's case: a summarised value that is a list of non-strings crashed the
    text mode (--json worked)."""
    path = tmp_path / "odd.hfq"
    write_odd_summary(path)
    assert cli_main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "          architecture: list of 1 items\n" in text
    assert "          config.model_type: llama, 2\n" in text
    assert "          config.hidden_size: 1, 2.5, null, true\n" in text
    assert "          config.num_hidden_layers: object with 1 keys\n" in text
    assert "          config.vocab_size: list of 100 items\n" in text
    assert "          config.rope_theta: \\ud800lone surrogate\n" in text
    assert "          config.head_dim: tab\\there\n" in text
    assert f"          config.max_position_embeddings: {'x' * 200}... (1000 characters)\n" \
        in text
    assert cli_main(["inspect", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["metadata"]
    assert summary["config.hidden_size"] == [1, 2.5, None, True]
    assert summary["config.rope_theta"] == "\\ud800lone surrogate"
    # the writer kept the lone surrogate as its JSON escape: it reads back as written
    with HfqmFile(path) as f:
        assert f.metadata["config"]["rope_theta"] == "\ud800lone surrogate"


def test_empty_shape_whose_other_dims_no_array_can_hold_is_refused(tmp_path):
    """Found while writing the reader's fuzz target: an F16 tensor of shape
    (0, 2**32-1, 2**32-1) has 0 elements and a 0-byte payload, but NumPy cannot even
    make an empty array of that shape, so file[name] leaked its ValueError."""
    dims = (0, 2**32 - 1, 2**32 - 1)
    entry = struct.pack("<H", 1) + b"t" + struct.pack(f"<BB{len(dims)}IIQ", 1, len(dims),
                                                      *dims, 0, 0)
    meta = b"{}"
    header = struct.pack("<4sIIIQQ", b"HFQM", 1, 0, 1, 32, 4096)
    body = header + meta + struct.pack("<I", 1) + entry
    path = tmp_path / "empty.hfq"
    path.write_bytes(body + bytes(4096 - len(body)))
    for kwargs in ({}, READ_PATH):
        with pytest.raises(SizeMismatch, match="more than 2\\*\\*48 elements \\(counting only "
                                               "its non-zero dims\\)"):
            HfqmFile(path, **kwargs)
    with pytest.raises(InvalidArgument, match="non-zero dims multiply past 2\\*\\*48"):
        HfqmWriter(tmp_path / "w.hfq", arch_id=0, metadata={}).add("t", "f16", dims, b"")


def test_empty_tensors_are_read_only_on_both_paths(tmp_path):
    """Found by the fuzz campaign (regressions/hfqm_reader): on the plain-read path a
    0-byte payload came back as a writable array, every other view is read-only."""
    with HfqmWriter(tmp_path / "e.hfq", arch_id=0, metadata={}) as w:
        w.add("x", "mq4g256v2", [1, 0], b"")
        w.add("h", "f16", [0], b"")
    for kwargs in ({}, READ_PATH):
        with HfqmFile(tmp_path / "e.hfq", **kwargs) as f:
            for name in ("x", "h"):
                assert f.raw(name).size == 0 and not f.raw(name).flags.writeable
                assert not f[name].flags.writeable


def test_verify_fails_when_the_mtp_head_mismatches(tmp_path, capsys):
    """Found by the fuzz campaign (regressions/inspect): `inspect --verify` printed the
    head's MISMATCH but exited 0, looking only at the trunk's check."""
    write_minimal(tmp_path / "trunk.hfq")
    write_minimal(tmp_path / "head.hfq", arch_id=21, add_quantization_hash=True)
    head = bytearray((tmp_path / "head.hfq").read_bytes())
    head[-1] ^= 1                                         # a payload bit: hash mismatch
    (tmp_path / "head.hfq").write_bytes(bytes(head))
    write_mtp_bundle(tmp_path / "trunk.hfq", tmp_path / "head.hfq", tmp_path / "b.hfq")
    for mode in ([], ["--json"]):
        assert cli_main(["inspect", str(tmp_path / "b.hfq"), "--verify", *mode]) == 1
        out = capsys.readouterr().out
        assert "MISMATCH" in out and "absent" in out       # trunk absent, head mismatch


def test_the_mtp_head_is_read_the_way_its_trunk_is(tmp_path, parts):
    """A bundle over the mapping limit must not map its head whole either."""
    trunk, head = parts
    path = tmp_path / "b.hfq"
    path.write_bytes(trunk + head + _trailer(len(trunk)))
    with HfqmFile(path, **READ_PATH) as f:
        assert f._bytes is None and f.mtp is not None
        assert f.mtp._bytes is None                      # plain reads, no whole-file map
        assert f.mtp.raw("a.weight").tobytes() == hfq4g256_ramp_group().tobytes()


def test_scalar_tensors_decode_to_0d_arrays(tmp_path):
    """Found by the fuzz campaign (regressions/hfqm_reader): a tensor with n_dims 0 is
    valid, file[name] gave a 0-d array, but dequantize passed the empty shape on to
    the codecs, which take at least one dim, and raised InvalidArgument."""
    path = tmp_path / "s.hfq"
    with HfqmWriter(path, arch_id=0, metadata={}) as w:
        w.add("f", "f16", [], np.float16(1.5).reshape(1))
        w.add("q", "hfq4g256", [], np.frombuffer(np.float32(1).tobytes() + np.float32(-2)
                                                 .tobytes() + bytes(128), np.uint8))
    for kwargs in ({}, READ_PATH):
        with HfqmFile(path, **kwargs) as f:
            assert f["f"].shape == () and float(f["f"]) == 1.5
            for name, value in (("f", 1.5), ("q", -2.0)):
                out = f.dequantize(name)
                assert out.shape == () and out.dtype == np.float32 and float(out) == value
