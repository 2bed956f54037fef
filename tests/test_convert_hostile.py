"""Hostile inputs to `pagedkv convert` (issue 10): JSON side files that are not UTF-8, not
JSON or nested too deep, and safetensors headers checked exactly as strictly as the
safetensors loader checks them. Each is one line on stderr naming the file, exit 1, no
output file (docs/cli.md, "pagedkv convert")."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from hfqm_samples import write_minimal
from pagedkv.cli import main as cli_main
from pagedkv.errors import FormatError, UnsupportedQuantType
from pagedkv.hfqm import HfqmFile
from pagedkv.hfqm.arch import arch_id_for
from pagedkv.hfqm.safetensors_source import SafetensorsSource

DEEP = "[" * 100_000 + "]" * 100_000


def _model(root, *, config=None, side=None) -> None:
    """A one-tensor F32 model: config.json (a dict, or text/bytes as given) and side files."""
    root.mkdir(exist_ok=True)
    data = np.linspace(-1, 1, 256, dtype="<f4").tobytes()
    head = json.dumps({"w.weight": {"dtype": "F32", "shape": [1, 256],
                                    "data_offsets": [0, len(data)]}}).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + data)
    config = {"model_type": "llama"} if config is None else config
    for name, content in {"config.json": config, **(side or {})}.items():
        if isinstance(content, dict):
            content = json.dumps(content)
        if isinstance(content, str):
            content = content.encode("utf-8", "surrogatepass")
        (root / name).write_bytes(content)


def _convert_fails(capsys, tmp_path, root) -> str:
    out = tmp_path / "out.hfq"
    assert cli_main(["convert", str(root), "-o", str(out), "--no-progress"]) == 1
    stdout, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert stdout == "" and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("pagedkv convert: error: ")
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    return lines[0]


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json"])
@pytest.mark.parametrize("content,message", [
    (DEEP, "nests arrays/objects deeper than the JSON parser allows"),
    (b'{"a": "\xff\xfe"}', "is not UTF-8 (invalid start byte at byte 7)"),
    ('{"a": 1,}', "is not valid JSON (Expecting property name"),
    ("", "is not valid JSON (Expecting value"),
    ('{"a": NaN}', "is not valid JSON (NaN is not JSON"),
    ('{"a": 1e999}', "is not valid JSON (1e999 does not fit a float64"),
    ("[1, 2]", "not an object"),
])
def test_side_files_that_are_not_json_objects(tmp_path, capsys, name, content, message):
    root = tmp_path / "m"
    if name == "config.json":
        _model(root, config=content)
    else:
        _model(root, side={name: content})
    line = _convert_fails(capsys, tmp_path, root)
    assert str(root / name) in line and message in line


def test_config_model_type_must_be_a_string(tmp_path, capsys):
    _model(tmp_path / "m", config={"model_type": ["llama"]})
    assert "config.json model_type is a JSON list, not a string" in _convert_fails(
        capsys, tmp_path, tmp_path / "m")


def test_bom_and_lone_surrogate_escapes_are_carried(tmp_path, capsys):
    """A UTF-8 BOM is allowed; a JSON escape of a lone surrogate ("\\ud800") parses to a
    str with no UTF-8 form, which the HFQM writer stores back as the same escape."""
    root = tmp_path / "m"
    _model(root, config='\ufeff{"model_type": "llama", "note": "\\ud800"}',
           side={"tokenizer.json": '\ufeff{"model": {}}'})
    out = tmp_path / "out.hfq"
    assert cli_main(["convert", str(root), "-o", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    from pagedkv.hfqm import HfqmFile
    with HfqmFile(out) as f:
        assert f.metadata["config"]["note"] == "\ud800"
        assert f.metadata["tokenizer"] == '{"model": {}}'


def test_arch_text_forms():
    assert arch_id_for("007") == 7 and arch_id_for(" 0x15 ") == 21 and arch_id_for("5") == 5
    from pagedkv.errors import InvalidArgument
    for text in ("²", "٣", "1_0", "0b1", "-0x1"):
        with pytest.raises(InvalidArgument):
            arch_id_for(text)


# --- the safetensors header, differential against the loader ---------------------------------

BASE = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


def _entry(**kw):
    return {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **kw}}


HEADERS = {
    "ok": (BASE, 8),
    "float dim": (_entry(shape=[2.0]), 8),
    "bool dim": (_entry(shape=[True, 2]), 8),
    "string dim": (_entry(shape=["2"]), 8),
    "negative dim": (_entry(shape=[-2]), 8),
    "dim above u64": (_entry(shape=[2**64]), 8),
    "float offset": (_entry(data_offsets=[0, 8.0]), 8),
    "bool offset": (_entry(data_offsets=[False, 8]), 8),
    "three offsets": (_entry(data_offsets=[0, 8, 8]), 8),
    "offsets not a list": (_entry(data_offsets="0,8"), 8),
    "unknown dtype": (_entry(dtype="F33"), 8),
    "lower-case dtype": (_entry(dtype="f32"), 8),
    "size mismatch": (_entry(shape=[3]), 8),
    "trailing bytes": (BASE, 12),
    "gap": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8),
    "overlap": ({**BASE, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8),
    "runs past the file": ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8),
    "end before start": ({"a": {"dtype": "U8", "shape": [0], "data_offsets": [8, 0]}}, 8),
    "metadata not strings": ({"__metadata__": {"x": 1}, **BASE}, 8),
    "metadata strings": ({"__metadata__": {"x": "1"}, **BASE}, 8),
    "extra field": (_entry(zz=1), 8),
    "entry not an object": ({"a": [1, 2]}, 8),
    "header a list": ([1], 0),
    "empty": ({}, 0),
    "empty with trailing byte": ({}, 1),
    "F4 odd count": ({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, 1),
    "F4 even count": ({"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, 2),
    "zero-size tensor": ({**BASE, "z": {"dtype": "F32", "shape": [0, 5],
                                        "data_offsets": [8, 8]}}, 8),
}


def _safetensors(path, header, data_bytes: int, *, raw_header: bytes | None = None) -> None:
    head = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + bytes(data_bytes))


def _loader_accepts(path) -> bool:
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                f.get_slice(name)
    except SafetensorError:
        return False
    return True


def _ours_accepts(path) -> bool:
    try:
        SafetensorsSource(path)
    except UnsupportedQuantType:
        return True  # a valid header with a dtype convert refuses (F4, FP8): not a header error
    except FormatError:
        return False
    return True


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_header_check_agrees_with_the_safetensors_loader(tmp_path, case):
    header, data_bytes = HEADERS[case]
    path = tmp_path / "x.safetensors"
    _safetensors(path, header, data_bytes)
    assert _ours_accepts(path) == _loader_accepts(path), case


@pytest.mark.parametrize("name,raw", [
    ("duplicate key, last wins and leaves bytes over",
     (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
      b'"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}')),
    ("not UTF-8", b'{"a\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
    ("padded with spaces", json.dumps(BASE).encode() + b"    "),
    ("leading space", b" " + json.dumps(BASE).encode()),
    ("deep", b'{"__metadata__": ' + DEEP.encode() + b"}"),
    ("127 deep (an ignored field)", json.dumps(_entry(zz=json.loads("[" * 125 + "]" * 125)))
     .encode()),
    ("128 deep (an ignored field)", json.dumps(_entry(zz=json.loads("[" * 126 + "]" * 126)))
     .encode()),
])
def test_raw_header_check_agrees_with_the_safetensors_loader(tmp_path, name, raw):
    path = tmp_path / "x.safetensors"
    _safetensors(path, None, 8, raw_header=raw)
    assert _ours_accepts(path) == _loader_accepts(path), name


@pytest.mark.parametrize("case", ["float dim", "trailing bytes", "gap", "unknown dtype",
                                  "size mismatch", "metadata not strings"])
def test_convert_refuses_what_the_loader_refuses_in_one_line(tmp_path, capsys, case):
    root = tmp_path / "m"
    _model(root)
    header, data_bytes = HEADERS[case]
    _safetensors(root / "model.safetensors", header, data_bytes)
    line = _convert_fails(capsys, tmp_path, root)
    assert str(root / "model.safetensors") in line


def test_loader_errors_that_slip_past_the_check_are_explained(tmp_path, monkeypatch):
    """The safety net: a SafetensorError from the loader becomes one BadMetadata line."""
    root = tmp_path / "m"
    _model(root)
    source = SafetensorsSource(root)
    (root / "model.safetensors").write_bytes(b"\x08" + bytes(7) + b"not json")
    from pagedkv.errors import BadMetadata
    with pytest.raises(BadMetadata, match="the safetensors loader refuses the file: "):
        source.read(source.tensors[0])


def _model_with_weight(root, values: np.ndarray) -> None:
    _model(root)
    data = values.astype("<f4").tobytes()
    head = json.dumps({"w.weight": {"dtype": "F32", "shape": list(values.shape),
                                    "data_offsets": [0, len(data)]}}).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + data)


def test_large_weights_do_not_overflow_the_error_measure(tmp_path, capsys):
    """Found by the fuzz campaign (regressions/convert_safetensors): the relative error
    squared float32 values, so weights above ~1.8e19 printed a RuntimeWarning and made
    the error NaN."""
    root = tmp_path / "m"
    _model_with_weight(root, np.linspace(-1e30, 1e30, 256, dtype=np.float32).reshape(1, 256))
    out = tmp_path / "out.hfq"
    assert cli_main(["convert", str(root), "-o", str(out), "--no-progress"]) == 0
    stdout, err = capsys.readouterr()
    assert err == ""
    row = next(line for line in stdout.splitlines()
               if line.startswith(("attention", "other")))
    assert "nan" not in row and float(row.split()[-1]) < 0.1


def test_weights_no_format_can_store_name_the_tensor(tmp_path, capsys):
    root = tmp_path / "m"
    _model_with_weight(root, np.full((1, 256), 3e38, np.float32) * np.where(
        np.arange(256) % 2, 1, -1).astype(np.float32))
    line = _convert_fails(capsys, tmp_path, root)
    assert f"{root / 'model.safetensors'}: tensor 'w.weight': array: group 0" in line
    assert "cannot be stored in hfq4g256" in line


def test_a_norm_beyond_the_f16_range_is_refused_not_stored_as_inf(tmp_path, capsys):
    """Norms, biases and 1-D tensors are stored as F16 by truncation: a finite 65536 or
    more became ±inf in the file, reported only as an `inf` error (and not at all with
    --no-error)."""
    root = tmp_path / "m"
    _model_with_weight(root, np.array([1, 65504, 65535.99, 65536, -7e4], np.float32))
    line = _convert_fails(capsys, tmp_path, root)
    assert line == (
        f"pagedkv convert: error: {root / 'model.safetensors'}: tensor 'w.weight': value "
        "65536 at index (3,) does not fit F16, the qt the tensor is stored in (hipfire's "
        "f32 -> f16 truncation makes |x| >= 65536 ±inf); rescale the tensor in the source")
    out = tmp_path / "out.hfq"
    assert cli_main(["convert", str(root), "-o", str(out), "--no-progress", "--no-error"]) == 1
    assert capsys.readouterr().err.strip() == line
    assert os.listdir(tmp_path) == ["m"]
    # The largest values F16 holds (65535.99 truncates to 65504) still convert.
    _model_with_weight(root, np.array([1, 65504, 65535.99, -65535.99], np.float32))
    assert cli_main(["convert", str(root), "-o", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    with HfqmFile(out) as f:
        assert f["w.weight"].tolist() == [1, 65504, 65504, -65504]


@pytest.mark.parametrize("magic,what", [
    (b"HFQM", "an HFQM file, already converted (pagedkv inspect shows it)"),
    (b"HFQ!", "an HFQM file whose write was interrupted; convert the source model again"),
])
def test_an_hfqm_file_as_the_source_is_named_as_such(tmp_path, capsys, magic, what):
    """Its magic and version, read as a safetensors header length, gave "safetensors
    header length 5592139336 is above the loader's limit": no hint of the real mistake."""
    root = tmp_path / "m"
    root.mkdir()
    write_minimal(root / "model.hfq")
    data = bytearray((root / "model.hfq").read_bytes())
    data[:4] = magic
    (root / "model.hfq").write_bytes(bytes(data))
    line = _convert_fails(capsys, tmp_path, root / "model.hfq")
    assert line == (f"pagedkv convert: error: {root / 'model.hfq'}, offset 0: not a "
                    f"safetensors file but {what}")
    assert os.listdir(root) == ["model.hfq"]
