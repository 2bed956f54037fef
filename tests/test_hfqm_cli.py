"""`pagedkv inspect` and `pagedkv convert` (docs/contracts/hfqm-and-quant.md, '2.9 Quantizer tensor
policy'), plus the tensor policy
and the lazy safetensors source they use."""

from __future__ import annotations

import functools
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from hfqm_samples import check_row_index, safetensors_bytes, write_minimal, write_mixed
from pagedkv.cli import main as cli_main
from pagedkv.errors import BadMetadata, InvalidArgument
from pagedkv.hfqm import HfqmFile, compute_quantization_hash, qtype
from pagedkv.hfqm.policy import default_format, plan_tensor, resolve_format
from pagedkv.hfqm.safetensors_source import SafetensorsSource

try:
    from pagedkv.quant import dequantize, quantize
except ImportError:  # the codecs land separately (pagedkv.quant)
    quantize = dequantize = None
needs_codecs = pytest.mark.skipif(quantize is None, reason="pagedkv.quant codecs not built yet")


# --- inspect -----------------------------------------------------------------------------

MINIMAL_INSPECT = """\
file      {path} (4,240 bytes)
format    HFQM v1, arch 0 (LLaMA/Mistral dense)
metadata  56 bytes at 32; data_offset 4,096
          architecture: llama
          config.model_type: llama

name      qt        shape  bytes  offset
a.weight  HFQ4G256  1x256    136   4,096
a.norm    F16       4          8   4,232

format    qt  tensors  bytes   share
HFQ4G256   6        1    136   94.4%
F16        1        1      8    5.6%
total               2    144  100.0%
"""


def test_inspect_prints_the_exact_table(tmp_path, capsys):
    path = tmp_path / "min.hfq"
    write_minimal(path)
    assert cli_main(["inspect", str(path)]) == 0
    assert capsys.readouterr().out == MINIMAL_INSPECT.format(path=path)


def test_inspect_json(tmp_path, capsys):
    path = tmp_path / "min.hfq"
    write_minimal(path, add_quantization_hash=True)
    assert cli_main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {k: info[k] for k in ("version", "arch_id", "n_tensors", "data_offset",
                                 "payload_bytes", "mtp")} == {
        "version": 1, "arch_id": 0, "n_tensors": 2, "data_offset": 4096, "payload_bytes": 144,
        "mtp": None}
    assert info["tensors"][0] == {"name": "a.weight", "qt": 6, "qt_name": "HFQ4G256",
                                  "shape": [1, 256], "group_size": 256, "nbytes": 136,
                                  "offset": 4096}
    assert info["totals"] == {"HFQ4G256": {"qt": 6, "tensors": 1, "bytes": 136},
                              "F16": {"qt": 1, "tensors": 1, "bytes": 8}}
    assert info["metadata"] == {"architecture": "llama", "config.model_type": "llama",
                                "quantization_hash": "43f356738983a9fd"}


def test_inspect_mixed_file_summary_and_bundle(tmp_path, capsys):
    write_mixed(tmp_path / "m.hfq")
    trunk = (tmp_path / "m.hfq").read_bytes()
    write_minimal(tmp_path / "head.hfq", arch_id=21)
    bundle = tmp_path / "b.hfq"
    bundle.write_bytes(trunk + (tmp_path / "head.hfq").read_bytes() + b"HFBNDMTP"
                       + struct.pack("<Q", len(trunk)))
    assert cli_main(["inspect", str(bundle), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["metadata"]["tokenizer_bytes"] == len('{"x": "é"}'.encode())
    assert info["totals"]["F16"] == {"qt": 1, "tensors": 1, "bytes": 8}
    assert info["mtp"]["base"] == len(trunk) and info["mtp"]["n_tensors"] == 2
    assert cli_main(["inspect", str(bundle)]) == 0
    text = capsys.readouterr().out
    assert f"MTP head (HFBNDMTP bundle) at byte {len(trunk):,}:" in text
    assert "  a.weight  HFQ4G256  1x256    136  " in text


def test_inspect_verify(tmp_path, capsys):
    path = tmp_path / "h.hfq"
    write_minimal(path, add_quantization_hash=True)
    assert cli_main(["inspect", str(path), "--verify"]) == 0
    assert "verify    quantization_hash: ok\n" in capsys.readouterr().out
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert cli_main(["inspect", str(path), "--verify", "--json"]) == 1
    check = json.loads(capsys.readouterr().out)["quantization_hash_check"]
    assert check.startswith("MISMATCH: ") and "43f356738983a9fd != " in check
    write_minimal(tmp_path / "plain.hfq")
    assert cli_main(["inspect", str(tmp_path / "plain.hfq"), "--verify"]) == 0
    assert "quantization_hash: absent" in capsys.readouterr().out


def test_inspect_broken_file_exits_1_with_the_reason(tmp_path, capsys):
    path = tmp_path / "bad.hfq"
    path.write_bytes(b"GGUF" + bytes(40))
    assert cli_main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == (f"pagedkv inspect: error: {path}, offset 0: magic is b'GGUF', expected "
                   "b'HFQM': not an HFQM file (a safetensors model converts with "
                   "`pagedkv convert`)\n")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX pipes and FIFOs")
@pytest.mark.parametrize("kind", ["pipe", "fifo"])
def test_inspect_refuses_a_pipe_or_fifo_in_one_line(tmp_path, capsys, kind):
    # `pagedkv inspect <(cat f.hfq)` said "file holds 0 bytes" (a pipe has no size), and a
    # FIFO with no writer blocked the open forever.
    import threading
    write_minimal(tmp_path / "min.hfq")
    if kind == "pipe":
        r, w = os.pipe()
        os.write(w, (tmp_path / "min.hfq").read_bytes()[:4096])
        path = f"/proc/self/fd/{r}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{r}"
    else:
        path = str(tmp_path / "fifo")
        os.mkfifo(path)

        def unblock():  # only an open that blocks (the old reader) is still waiting by then
            import time
            time.sleep(3)
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass

        threading.Thread(target=unblock, daemon=True).start()
    try:
        assert cli_main(["inspect", path]) == 1
    finally:
        if kind == "pipe":
            os.close(r)
            os.close(w)
    assert capsys.readouterr().err == (
        f"pagedkv inspect: error: path {path!r} is not a regular file (a pipe, FIFO or "
        "device); pass an HFQM file on disk\n")


# --- tensor policy -----------------------------------------------------------------------


def _qt(name, dtype, shape, fmt="mq4"):
    return [(p.name, p.qt, p.role) for p in plan_tensor(name, dtype, shape, resolve_format(fmt))]


def test_policy_of_section_2_9():
    assert _qt("model.embed_tokens.weight", "BF16", (10, 256)) == [
        ("model.embed_tokens.weight", 3, "embedding")]
    assert _qt("lm_head.weight", "F16", (10, 512), "hf6") == [("lm_head.weight", 3, "lm_head")]
    assert _qt("model.layers.0.mlp.gate.weight", "F32", (8, 256))[0][1] == 3
    assert _qt("model.layers.0.mlp.shared_expert_gate.weight", "F32", (1, 256))[0][1] == 3
    assert _qt("model.layers.0.input_layernorm.weight", "F32", (256,))[0][1] == 1
    assert _qt("bert.embeddings.LayerNorm.weight", "F32", (256, 2))[0][1] == 1  # case-insensitive
    assert _qt("model.layers.0.self_attn.q_proj.bias", "F32", (256,))[0][1] == 1
    assert _qt("model.layers.0.linear_attn.A_log", "F32", (4, 4))[0][1] == 1     # no "weight"
    assert _qt("model.layers.0.self_attn.q_proj.weight", "BF16", (256, 512)) == [
        ("model.layers.0.self_attn.q_proj.weight", 44, "attention")]
    # K % 256 != 0 fallbacks
    assert _qt("model.layers.0.mlp.down_proj.weight", "F32", (256, 384))[0][1] == 7
    assert _qt("x.weight", "F32", (4, 384), "mq6")[0][1] == 8
    assert _qt("x.weight", "F32", (4, 384), "mq3g256v2")[0][1] == 12
    assert _qt("x.weight", "F32", (4, 384), "mq5g256")[0][1] == 8
    assert _qt("x.weight", "F32", (4, 384), "mq2g256v2")[0][1] == 10
    assert _qt("x.weight", "F32", (4, 384), "hf4")[0][1] == 6     # v1 groups straddle rows
    assert _qt("x.weight", "F32", (4, 384), "q8")[0][1] == 3
    # skipped
    assert _qt("mtp.fc.weight", "BF16", (4, 256)) == [("mtp.fc.weight", None, "skipped")]
    assert _qt("model.visual.patch.weight", "F32", (4, 256))[0][1] is None
    assert plan_tensor("model.visual.patch.weight", "F32", (4, 256), resolve_format("hf4"),
                       include_visual=True)[0].qt == 6
    assert _qt("bert.embeddings.position_ids", "I64", (1, 512))[0][1] is None


def test_stacked_experts_are_split():
    plans = plan_tensor("model.layers.3.mlp.experts.gate_up_proj", "BF16", (2, 512, 256),
                        resolve_format("mq4"))
    assert [(p.name, p.shape, p.qt, p.expert) for p in plans] == [
        ("model.layers.3.mlp.experts.0.gate_up_proj.weight", (512, 256), 44, 0),
        ("model.layers.3.mlp.experts.1.gate_up_proj.weight", (512, 256), 44, 1)]
    down = plan_tensor("model.layers.3.mlp.experts.down_proj", "BF16", (2, 256, 384),
                       resolve_format("mq4"))
    assert [p.qt for p in down] == [7, 7]


def test_format_names_and_defaults():
    assert [resolve_format(f).id for f in ("mq4", "mq6", "mq6v2", "hf4", "hf6", "q8",
                                           "hfq4g256", "MQ4G256V2", "mq3g256")] == [
        44, 15, 47, 6, 8, 3, 6, 44, 17]
    with pytest.raises(InvalidArgument, match="'mq9' is not a format"):
        resolve_format("mq9")
    with pytest.raises(InvalidArgument, match="does not encode"):
        resolve_format("paro4g128")
    with pytest.raises(InvalidArgument, match="only decodes it"):
        resolve_format("tq2g128")
    assert resolve_format("q4k").id == 4
    with pytest.raises(InvalidArgument, match="not a convert target"):
        resolve_format("mq2g256gl")
    assert resolve_format("mfp4g32").id == 24
    assert default_format({"model_type": "qwen3_5"}) == "mq4"
    assert default_format({"architectures": ["Qwen3_5MoeForCausalLM"]}) == "mq4"
    assert default_format({"model_type": "llama"}) == "hf4"


def test_format_without_a_codec_is_one_line_error(tmp_path, capsys):
    """Found by a review: --format tidi32 (a lower-case qt name of the register, read raw,
    no codec) raised a bare KeyError out of resolve_format: a traceback on the CLI."""
    message = ("--format 'tidi32': TidI32 is not a weight format (pagedkv reads it raw and "
               "has no codec that writes it)")
    with pytest.raises(InvalidArgument) as info:
        resolve_format("tidi32")
    assert str(info.value) == message
    write_safetensors(tmp_path / "m.safetensors",
                      {"a.weight": ("F32", (2, 256), np.ones((2, 256), "<f4").tobytes())})
    out = tmp_path / "o.hfq"
    assert cli_main(["convert", str(tmp_path / "m.safetensors"), "-o", str(out), "--arch", "0",
                     "--format", "tidi32", "--no-progress"]) == 1
    assert capsys.readouterr().err == f"pagedkv convert: error: {message}\n"
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


# --- safetensors source ------------------------------------------------------------------


def write_safetensors(path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file written by hand (the numpy backend cannot write bf16)."""
    with open(path, "wb") as f:
        f.write(safetensors_bytes(tensors))


def _bf16(x: np.ndarray) -> bytes:
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()


def make_model(root, *, dtype_weights="BF16") -> dict[str, np.ndarray]:
    """A tiny llama-like checkpoint in two shards; returns the float32 values."""
    rng = np.random.default_rng(3)
    root.mkdir(exist_ok=True)

    def val(*shape, offset=0.0):
        x = rng.standard_normal(shape).astype(np.float32) * np.float32(0.05) + np.float32(offset)
        return (x.view(np.uint32) & 0xFFFF0000).view(np.float32)  # exactly bf16-representable

    values = {
        "model.embed_tokens.weight": val(16, 256),
        "model.layers.0.input_layernorm.weight": val(256, offset=1.0),
        "model.layers.0.self_attn.q_proj.weight": val(256, 256),
        "model.layers.0.mlp.down_proj.weight": val(8, 384),
        "model.layers.0.mlp.experts.gate_up_proj": val(2, 4, 256),
        "lm_head.weight": val(16, 256),
    }
    enc = {"BF16": _bf16, "F32": lambda x: x.astype("<f4").tobytes(),
           "F16": lambda x: x.astype("<f2").tobytes()}[dtype_weights]
    shard1 = {n: (dtype_weights, v.shape, enc(v)) for n, v in list(values.items())[:3]}
    shard1["model.embeddings.position_ids"] = ("I64", (4,), np.arange(4, dtype="<i8").tobytes())
    shard2 = {n: (dtype_weights, v.shape, enc(v)) for n, v in list(values.items())[3:]}
    shard2["mtp.fc.weight"] = (dtype_weights, (4, 256), enc(val(4, 256)))
    write_safetensors(root / "model-00001-of-00002.safetensors", shard1)
    write_safetensors(root / "model-00002-of-00002.safetensors", shard2)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 256,
                                                  "num_hidden_layers": 1}))
    (root / "tokenizer.json").write_text('{"model": {"type": "BPE"}, "é": 1}', encoding="utf-8")
    (root / "generation_config.json").write_text('{"eos_token_id": 2}')
    if dtype_weights == "F16":
        values = {n: v.astype(np.float16).astype(np.float32) for n, v in values.items()}
    return values


def test_safetensors_source_reads_rows_lazily_and_widens_bf16_exactly(tmp_path):
    values = make_model(tmp_path / "m")
    src = SafetensorsSource(tmp_path / "m")
    by_name = {t.name: t for t in src.tensors}
    assert len(src.shards) == 2 and len(by_name) == 8
    q = by_name["model.layers.0.self_attn.q_proj.weight"]
    assert (q.dtype, q.shape) == ("BF16", (256, 256))
    np.testing.assert_array_equal(src.read(q, (slice(3, 9),)), values[q.name][3:9])
    ex = by_name["model.layers.0.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(src.read(ex, (1, slice(1, 3))), values[ex.name][1, 1:3])
    np.testing.assert_array_equal(src.read(ex, (1,)), values[ex.name][1])
    norm = by_name["model.layers.0.input_layernorm.weight"]
    np.testing.assert_array_equal(src.read(norm), values[norm.name])
    assert src.tokenizer == '{"model": {"type": "BPE"}, "é": 1}'
    assert src.generation_config == {"eos_token_id": 2} and src.tokenizer_config is None


def test_safetensors_source_f32_rows_use_the_library(tmp_path):
    values = make_model(tmp_path / "m", dtype_weights="F32")
    src = SafetensorsSource(tmp_path / "m")
    t = next(t for t in src.tensors if t.name == "model.layers.0.mlp.down_proj.weight")
    block = src.read(t, (slice(2, 5),))
    assert block.dtype == np.float32
    np.testing.assert_array_equal(block, values[t.name][2:5])


@pytest.mark.parametrize("dtype", ["BF16", "F32", "F16"])
def test_safetensors_source_read_checks_the_row_index(tmp_path, dtype):
    """Found by a review: SafetensorsSource.read did not check its index as
    GgufSource.read does. BF16 rows past the end were read from the next tensor's bytes
    (or a Truncated), F32/F16 ones raised BadMetadata claiming the loader refuses the
    file, a slice past the end was refused instead of clipped, a reversed slice raised
    SystemError, a step was honoured (BF16: a bare message) and a float index was blamed
    on the file."""
    values = make_model(tmp_path / "m", dtype_weights=dtype)
    src = SafetensorsSource(tmp_path / "m")
    by_name = {t.name: t for t in src.tensors}
    for name in ("model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.input_layernorm.weight"):   # 1-D
        check_row_index(functools.partial(src.read, by_name[name]), name, values[name],
                        lambda want, row: want[row])   # NumPy's: an int drops the dim
    ex = by_name["model.layers.0.mlp.experts.gate_up_proj"]        # (2, 4, 256)
    want = values[ex.name]
    np.testing.assert_array_equal(src.read(ex, (-1, slice(2, 9))), want[1, 2:])
    np.testing.assert_array_equal(src.read(ex, (0, -1)), want[0, 3])
    with pytest.raises(InvalidArgument, match=r"row 4 of '.*gate_up_proj' \(dim 1\) is out "
                                              r"of range: the dim has 4 rows, pass -4..3"):
        src.read(ex, (1, 4))
    with pytest.raises(InvalidArgument, match="row 2 of .* the tensor has 2 rows"):
        src.read(ex, (2, slice(0, 1)))
    with pytest.raises(InvalidArgument, match="a slice must be its last entry"):
        src.read(ex, (slice(0, 1), 0))
    with pytest.raises(InvalidArgument, match="has 4 entries, the tensor 3 dims"):
        src.read(ex, (0, 0, 0, 0))


def test_safetensors_source_errors(tmp_path):
    with pytest.raises(InvalidArgument, match="does not exist; pass a .safetensors file"):
        SafetensorsSource(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgument, match="no \\*.safetensors"):
        SafetensorsSource(tmp_path / "empty")


def _f32(shape, start=0.0) -> tuple[str, tuple[int, ...], bytes]:
    values = start + np.arange(np.prod(shape), dtype="<f4").reshape(shape) / 1024
    return "F32", shape, values.tobytes()


def test_a_directory_with_an_index_reads_only_the_shards_it_names(tmp_path, capsys):
    """Found by a review: a directory with model.safetensors.index.json (a Mistral repo:
    HF shards plus consolidated.safetensors) globbed every *.safetensors, so the model was
    converted twice under two sets of names."""
    root = tmp_path / "m"
    root.mkdir()
    q, norm = _f32((256, 256)), _f32((256,), 1.0)
    write_safetensors(root / "model-00001-of-00002.safetensors", {"q.weight": q})
    write_safetensors(root / "model-00002-of-00002.safetensors", {"norm.weight": norm})
    write_safetensors(root / "consolidated.safetensors",
                      {"layers.0.attention.wq.weight": q, "norm.weight": norm})
    index = {"metadata": {}, "weight_map": {"q.weight": "model-00001-of-00002.safetensors",
                                            "norm.weight": "model-00002-of-00002.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text('{"model_type": "mistral"}')
    src = SafetensorsSource(root)
    assert [os.path.basename(s) for s in src.shards] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert [t.name for t in src.tensors] == ["q.weight", "norm.weight"]
    out = tmp_path / "o.hfq"
    assert cli_main(["convert", str(root), "-o", str(out), "--no-progress", "--no-error"]) == 0
    with HfqmFile(out) as f:
        assert f.names == ["q.weight", "norm.weight"]
        assert f.metadata["pagedkv"]["source_files"] == [
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # An index that names a missing shard, or a tensor its shard does not hold, is refused.
    index["weight_map"]["k.weight"] = "model-00003-of-00003.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidArgument, match="names the shard 'model-00003-of-00003"
                                              ".safetensors', which is not a file"):
        SafetensorsSource(root)
    index["weight_map"]["k.weight"] = "model-00002-of-00002.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(BadMetadata, match="puts the tensor in model-00002-of-00002"
                                          ".safetensors, which does not hold it") as info:
        SafetensorsSource(root)
    assert info.value.tensor == "k.weight"
    (root / "model.safetensors.index.json").write_text('{"weight_map": [1]}')
    with pytest.raises(BadMetadata, match="has no weight_map object"):
        SafetensorsSource(root)
    capsys.readouterr()
    assert cli_main(["convert", str(root), "-o", str(tmp_path / "p.hfq"), "--no-progress"]) == 1
    assert "has no weight_map object" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["m", "o.hfq"]


@needs_codecs
def test_f64_weights_are_converted_and_integer_buffers_left_out(tmp_path, capsys):
    """Found by a review: F64 weights were left out as 'buffers' (exit 0, a file without
    them); the contract leaves out only integer (and bool) buffers."""
    rng = np.random.default_rng(3)
    down = rng.standard_normal((256, 256))
    norm = 1 + np.arange(256) / 256
    root = tmp_path / "m"
    root.mkdir()
    write_safetensors(root / "model.safetensors", {
        "model.layers.0.mlp.down_proj.weight": ("F64", (256, 256), down.astype("<f8").tobytes()),
        "model.norm.weight": ("F64", (256,), norm.astype("<f8").tobytes()),
        "model.mask": ("BOOL", (4,), bytes([1, 0, 1, 1])),
        "model.ids": ("U8", (4,), bytes(4))})
    (root / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 1}')
    out = tmp_path / "o.hfq"
    assert cli_main(["convert", str(root), "-o", str(out), "--no-progress", "--no-error"]) == 0
    assert capsys.readouterr().out.splitlines()[-3:] == [
        "left out (2):", "  model.mask: BOOL buffer, not a floating-point weight",
        "  model.ids: U8 buffer, not a floating-point weight"]
    with HfqmFile(out) as f:
        assert {t.name: (t.qt, t.shape) for t in f.tensors} == {
            "model.layers.0.mlp.down_proj.weight": (6, (256, 256)),
            "model.norm.weight": (1, (256,))}
        assert f.raw("model.layers.0.mlp.down_proj.weight").tobytes() == quantize(
            down.astype(np.float32), "hfq4g256").tobytes()
        assert f.raw("model.norm.weight").tobytes() == quantize(
            norm.astype(np.float32), "f16").tobytes()


@pytest.mark.parametrize("dtype,nbytes", [("F8_E4M3", 1), ("F8_E5M2", 1), ("F8_E8M0", 1),
                                          ("F8_E4M3FNUZ", 1), ("F6_E2M3", 0.75), ("F4", 0.5),
                                          ("C64", 8)])
def test_fp8_and_other_float_formats_are_refused_naming_the_tensor(tmp_path, capsys, dtype,
                                                                   nbytes):
    """Found by a review: FP8 (and other non-standard float) weights were silently left out
    as buffers, exit 0, while their F32 *.weight_scale_inv tensors were quantized as
    weights. They are refused (UnsupportedQuantType) before anything is written."""
    from pagedkv.errors import UnsupportedQuantType
    root = tmp_path / "m"
    root.mkdir()
    write_safetensors(root / "model.safetensors", {
        "model.layers.0.mlp.up_proj.weight": (dtype, (256, 256), bytes(int(256 * 256 * nbytes))),
        "model.layers.0.mlp.up_proj.weight_scale_inv": ("F32", (2, 2), bytes(16))})
    (root / "config.json").write_text('{"model_type": "llama"}')
    message = (f"{root / 'model.safetensors'}, tensor 'model.layers.0.mlp.up_proj.weight': "
               f"dtype {dtype} is not converted (floating-point weights must be F32, F16, BF16 "
               "or F64; integer and bool buffers are left out); dequantize the checkpoint to "
               "BF16 first")
    with pytest.raises(UnsupportedQuantType) as info:
        SafetensorsSource(root)
    assert str(info.value) == message
    out = tmp_path / "o.hfq"
    assert cli_main(["convert", str(root), "-o", str(out), "--no-progress"]) == 1
    assert capsys.readouterr() == ("", f"pagedkv convert: error: {message}\n")
    assert sorted(os.listdir(tmp_path)) == ["m"]


# --- convert -----------------------------------------------------------------------------


@needs_codecs
@pytest.mark.parametrize("fmt,weight_qt,k384_qt", [("hf4", 6, 6), ("mq4", 44, 7),
                                                   ("q8", 3, 3), ("mq6", 15, 8), ("hf6", 8, 8),
                                                   ("q4k", 4, 7)])
def test_convert_applies_the_policy_and_writes_exact_payloads(tmp_path, capsys, fmt, weight_qt,
                                                              k384_qt):
    values = make_model(tmp_path / "m")
    out = tmp_path / "out.hfq"
    rc = cli_main(["convert", str(tmp_path / "m"), "-o", str(out), "--format", fmt,
                   "--no-progress"])
    assert rc == 0
    with HfqmFile(out) as f:
        qts = {t.name: t.qt for t in f.tensors}
        assert qts == {
            "model.embed_tokens.weight": 3,
            "model.layers.0.input_layernorm.weight": 1,
            "model.layers.0.self_attn.q_proj.weight": weight_qt,
            "model.layers.0.mlp.down_proj.weight": k384_qt,
            "model.layers.0.mlp.experts.0.gate_up_proj.weight": weight_qt,
            "model.layers.0.mlp.experts.1.gate_up_proj.weight": weight_qt,
            "lm_head.weight": 3,
        }
        for t in f.tensors:
            source = values.get(t.name)
            if source is None:  # a split expert
                e = int(t.name.split(".experts.")[1].split(".")[0])
                source = values["model.layers.0.mlp.experts.gate_up_proj"][e]
            expected = quantize(source, qtype(t.qt).key)
            assert f.raw(t.name).tobytes() == expected.tobytes(), t.name
        meta = f.metadata
        assert meta["architecture"] == "llama" and meta["config"]["hidden_size"] == 256
        assert meta["tokenizer"] == '{"model": {"type": "BPE"}, "é": 1}'
        assert meta["generation_config"] == {"eos_token_id": 2}
        assert meta["tokenizer_config"] is None
        assert meta["quantization_hash"]["value"] == compute_quantization_hash(f)
        assert meta["pagedkv"]["skipped"] == ["model.embeddings.position_ids", "mtp.fc.weight"]
        assert f.data_offset == 4096 * -(-(32 + f.metadata_bytes + f.index_bytes) // 4096)
    text = capsys.readouterr().out
    assert text.startswith(f"wrote {out}: {os.path.getsize(out):,} bytes, arch 0, format {fmt}")
    assert "left out (2):\n  model.embeddings.position_ids: I64 buffer, not a " in text
    assert "  mtp.fc.weight: MTP head" in text
    assert [line.split()[0] for line in text.split("class")[1].splitlines()[1:6]] == [
        "attention", "embedding", "expert", "lm_head", "mlp"]
    assert os.listdir(tmp_path) == ["m", "out.hfq"]


@needs_codecs
def test_convert_size_table_is_exact(tmp_path, capsys):
    make_model(tmp_path / "m")
    out = tmp_path / "o.hfq"
    assert cli_main(["convert", str(tmp_path / "m"), "-o", str(out), "--format", "hf4",
                     "--no-progress", "--no-error"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:8] == [
        "",
        "format    qt  tensors   bytes   share",
        "HFQ4G256   6        4  37,536   80.3%",
        "Q8F16      3        2   8,704   18.6%",
        "F16        1        1     512    1.1%",
        "total               7  46,752  100.0%",
        "",
    ]


@needs_codecs
def test_convert_errors_and_interrupt_leave_no_output(tmp_path, capsys, monkeypatch):
    make_model(tmp_path / "m")
    out = tmp_path / "o.hfq"
    assert cli_main(["convert", str(tmp_path / "m"), "-o", str(out), "--format", "zz"]) == 1
    assert "--format 'zz' is not a format" in capsys.readouterr().err
    assert cli_main(["convert", str(tmp_path / "m"), "-o", str(out), "--arch", "gpt2"]) == 1
    assert "no arch_id mapping" in capsys.readouterr().err
    calls = []

    def interrupting_quantize(block, fmt):
        calls.append(fmt)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return quantize(block, fmt)

    monkeypatch.setattr("pagedkv.quant.quantize", interrupting_quantize)
    assert cli_main(["convert", str(tmp_path / "m"), "-o", str(out), "--no-progress"]) == 130
    assert "interrupted; " in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["m"]


@needs_codecs
def test_convert_refuses_the_never_assigned_arch_ids(tmp_path, capsys):
    """docs/contracts/hfqm-and-quant.md '2.5 arch_id': 2-4 are never assigned. ``--arch 2``
    (3, 4) wrote a file of that arch_id (found by a review); it is refused now, naming the
    known ids, and nothing is written (the writer refuses them too)."""
    from pagedkv.hfqm import HfqmWriter
    make_model(tmp_path / "m")
    out = tmp_path / "o.hfq"
    known = ("known arch ids: 0, 1, 5-14, 20-23, 255, 4294967295, or a name: llama, mistral, "
             "qwen2, qwen3, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text")
    for text, arch_id in (("2", 2), ("3", 3), ("0x4", 4)):
        assert cli_main(["convert", str(tmp_path / "m"), "-o", str(out), "--arch", text,
                         "--no-progress"]) == 1
        assert capsys.readouterr().err == (
            f"pagedkv convert: error: arch_id {arch_id} is never assigned (2-4 are reserved: "
            f"docs/contracts/hfqm-and-quant.md, '2.5 arch_id'); {known}\n")
        with pytest.raises(InvalidArgument, match=f"arch_id {arch_id} is never assigned"):
            HfqmWriter(out, arch_id=arch_id, metadata={})
    assert sorted(os.listdir(tmp_path)) == ["m"]
    assert cli_main(["convert", str(tmp_path / "m"), "-o", str(out), "--arch", "5",
                     "--no-progress", "--no-error"]) == 0
    with HfqmFile(out) as f:
        assert f.arch_id == 5


@needs_codecs
def test_convert_progress_bar_reports_bytes_per_second(tmp_path, capsys):
    make_model(tmp_path / "m")
    assert cli_main(["convert", str(tmp_path / "m"), "-o", str(tmp_path / "o.hfq"),
                     "--progress", "--no-error"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("\r[") and "100.0%" in err and "/s " in err and err.endswith("\n")


@needs_codecs
def test_convert_bounds_memory_with_row_blocks(tmp_path):
    from pagedkv.hfqm.convert import convert_safetensors
    values = make_model(tmp_path / "m")
    a = convert_safetensors(tmp_path / "m", tmp_path / "a.hfq", fmt="mq4", chunk_bytes=1)
    b = convert_safetensors(tmp_path / "m", tmp_path / "b.hfq", fmt="mq4")
    assert (tmp_path / "a.hfq").read_bytes() == (tmp_path / "b.hfq").read_bytes()
    errors_a, errors_b = a.mean_rel_error(), b.mean_rel_error()
    assert errors_a.keys() == errors_b.keys()
    for role in errors_a:
        assert errors_a[role][0] == errors_b[role][0]
        assert errors_a[role][1] == pytest.approx(errors_b[role][1], rel=1e-12)
    assert 0 < a.mean_rel_error()["attention"][1] < 0.2
    assert values  # the source values were used above through the files


def test_cli_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "pagedkv", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "inspect" in out and "convert" in out


@needs_codecs
def test_convert_single_file_without_config_needs_arch(tmp_path, capsys):
    weight = (np.arange(512, dtype=np.float32) / 512).reshape(2, 256)
    write_safetensors(tmp_path / "one.safetensors", {
        "w.weight": ("F32", (2, 256), weight.astype("<f4").tobytes()),
        "scale": ("F32", (), np.float32(0.5).tobytes()),
    })
    out = tmp_path / "one.hfq"
    assert cli_main(["convert", str(tmp_path / "one.safetensors"), "-o", str(out),
                     "--no-progress"]) == 1
    assert "has no config.json model_type: pass --arch" in capsys.readouterr().err
    assert cli_main(["convert", str(tmp_path / "one.safetensors"), "-o", str(out),
                     "--arch", "llama", "--no-progress", "--format", "hfq4g128"]) == 0
    with HfqmFile(out) as f:
        assert f.arch_id == 0 and f.metadata["architecture"] == "llama"
        assert f.metadata["config"] == {} and f.metadata["tokenizer"] == "{}"
        assert f.info("scale")[1:4] == (1, "F16", ())
        assert f["scale"].tolist() == 0.5
        assert f.info("w.weight").qt_name == "HFQ4G128"
        assert f.raw("w.weight").tobytes() == quantize(weight, "hfq4g128").tobytes()


def test_output_that_is_a_source_file_is_refused(tmp_path, capsys):
    """Found by a review: `-o` naming the source file (or a shard of the source directory)
    made the final rename replace the source with the HFQM output, exit 0."""
    data = safetensors_bytes({"a.weight": ("F32", (2, 256), np.ones((2, 256), "<f4").tobytes())})
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(data)
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama"}')
    os.symlink(tmp_path / "m" / "model.safetensors", tmp_path / "link.hfq")
    for source, out in [(tmp_path / "m" / "model.safetensors",) * 2,
                        (tmp_path / "m", tmp_path / "m" / "model.safetensors"),
                        (tmp_path / "m", tmp_path / "link.hfq")]:
        assert cli_main(["convert", str(source), "-o", str(out), "--no-progress"]) == 1
        shard = tmp_path / "m" / "model.safetensors"
        assert capsys.readouterr().err == (
            f"pagedkv convert: error: output {str(out)!r} is the source file {str(shard)!r}: "
            "the conversion would replace it; write to another path\n")
        assert shard.read_bytes() == data
        assert sorted(os.listdir(tmp_path / "m")) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["link.hfq", "m"]
