"""`pagedkv convert MODEL.gguf` (docs/formats/gguf.md): GGUF files written by the gguf
package's own GGUFWriter, read back through pagedkv.hfqm.gguf_source and checked against
that package's dequantization; name mapping, Q/K un-permutation, expert splitting, the
edge-layer 6-bit promotion, parameter_counts, and broken files."""

from __future__ import annotations

import functools
import itertools
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from hfqm_samples import check_row_index
from pagedkv.cli import main as cli_main
from pagedkv.errors import (
    BadMagic,
    BadMetadata,
    BadName,
    CountMismatch,
    InvalidArgument,
    SizeMismatch,
    Truncated,
    UnknownQuantType,
    UnsupportedQuantType,
)
from pagedkv.hfqm import HfqmFile, compute_quantization_hash, gguf_source, qtype
from pagedkv.hfqm.convert import convert_gguf, parameter_counts
from pagedkv.hfqm.gguf_source import (
    GGUF_ARCH_IDS,
    PERMUTED_QK_ARCHS,
    GgufSource,
    hf_name,
    unpermute_rows,
)
from pagedkv.hfqm.policy import plan_tensor, promoted, resolve_format
from pagedkv.hfqm.safetensors_source import SafetensorsSource
from pagedkv.quant import dequantize, fwht256, quantize

H, I, V = 256, 512, 64           # hidden, intermediate, vocab
N_HEAD, N_KV = 4, 2              # head_dim 64


def _kquant_bytes(qt: T, rows: int, k: int, rng) -> np.ndarray:
    """Random K-quant blocks with finite, moderate f16 super-block scales (the gguf
    package has no K-quant encoder); layout from GGML_QUANT_SIZES."""
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    d = np.float16(0.01 + 0.001 * rng.random())
    dmin = np.float16(0.002)
    if qt in (T.Q4_K, T.Q5_K):   # [0,2) d, [2,4) dmin
        raw[..., 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        raw[..., 2:4] = np.frombuffer(dmin.tobytes(), np.uint8)
    elif qt == T.Q6_K:           # d is the last 2 bytes
        raw[..., size - 2:] = np.frombuffer(d.tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def encode(values: np.ndarray, qt: T, rng) -> np.ndarray:
    """Bytes (or a float array) of ``values`` [rows, K] in GGUF type ``qt``."""
    if qt == T.F32:
        return values.astype(np.float32)
    if qt == T.F16:
        return values.astype(np.float16)
    if qt == T.F64:
        return values.astype(np.float64)
    if qt in (T.Q4_K, T.Q5_K, T.Q6_K):
        return _kquant_bytes(qt, values.shape[0], values.shape[-1], rng)
    return gguf_quantize(values.astype(np.float32), qt)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (the oracle)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path, arch: str, tensors: list[tuple[str, np.ndarray, T | None]],
               kv: dict | None = None, endianess=gguf.GGUFEndian.LITTLE) -> None:
    w = gguf.GGUFWriter(str(path), arch, endianess=endianess)
    for key, value in (kv or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    for name, data, qt in tensors:
        if qt is None or data.dtype != np.uint8:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_kv(n_layers: int) -> dict:
    return {"llama.embedding_length": H, "llama.block_count": n_layers,
            "llama.attention.head_count": N_HEAD, "llama.attention.head_count_kv": N_KV,
            "llama.feed_forward_length": I, "llama.context_length": 4096,
            "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.tokens": [f"t{i}" for i in range(V)]}


def make_llama(path, n_layers: int = 2, weight_type: T = T.Q8_0, seed: int = 0):
    """A tiny llama GGUF; returns {hf name: the float32 values the file decodes to}."""
    rng = np.random.default_rng(seed)
    tensors: list[tuple[str, np.ndarray, T | None]] = []
    expected: dict[str, np.ndarray] = {}

    def add(gguf_name, hf, shape, qt, permute=0):
        values = rng.standard_normal(shape).astype(np.float32) * 0.05
        data = encode(values, qt, rng)
        decoded = gguf_dequantize(data, qt) if data.dtype == np.uint8 else data
        decoded = np.asarray(decoded, dtype=np.float32).reshape(shape)
        stored = data
        if permute:
            # The file holds llama.cpp's permuted rows; HF order is the un-permuted one.
            stored = encode(llama_permute(decoded, permute), qt, rng) if qt in (
                T.F32, T.F16) else data
            decoded = (decoded if qt in (T.F32, T.F16) else
                       unpermute_rows(decoded, permute))
        tensors.append((gguf_name, stored, qt if stored.dtype == np.uint8 else None))
        expected[hf] = decoded

    add("token_embd.weight", "model.embed_tokens.weight", (V, H), T.F16)
    for li in range(n_layers):
        b, m = f"blk.{li}.", f"model.layers.{li}."
        add(b + "attn_norm.weight", m + "input_layernorm.weight", (H,), T.F32)
        add(b + "attn_q.weight", m + "self_attn.q_proj.weight", (H, H), weight_type, N_HEAD)
        add(b + "attn_k.weight", m + "self_attn.k_proj.weight", (128, H), weight_type, N_KV)
        add(b + "attn_v.weight", m + "self_attn.v_proj.weight", (128, H), weight_type)
        add(b + "attn_output.weight", m + "self_attn.o_proj.weight", (H, H), T.Q4_0)
        add(b + "ffn_norm.weight", m + "post_attention_layernorm.weight", (H,), T.F32)
        add(b + "ffn_gate.weight", m + "mlp.gate_proj.weight", (I, H), T.Q4_K)
        add(b + "ffn_up.weight", m + "mlp.up_proj.weight", (I, H), T.Q5_K)
        add(b + "ffn_down.weight", m + "mlp.down_proj.weight", (H, I), T.Q6_K)
    add("output_norm.weight", "model.norm.weight", (H,), T.F32)
    add("output.weight", "lm_head.weight", (V, H), T.Q8_0)
    write_gguf(path, "llama", tensors, llama_kv(n_layers))
    return expected


# --- the source ----------------------------------------------------------------------


@pytest.mark.parametrize("qt", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K,
                                T.F64])
def test_each_type_reads_back_as_the_gguf_package_dequantizes_it(tmp_path, qt):
    rng = np.random.default_rng(int(qt))
    values = rng.standard_normal((6, 512)).astype(np.float32)
    data = encode(values, qt, rng)
    write_gguf(tmp_path / "t.gguf", "qwen3", [("blk.0.ffn_up.weight", data, qt)])
    src = GgufSource(tmp_path / "t.gguf")
    (t,) = src.tensors
    assert (t.name, t.shape, t.ggml_type) == ("model.layers.0.mlp.up_proj.weight", (6, 512),
                                              qt.name)
    assert t.nbytes == data.nbytes
    oracle = gguf_dequantize(data, qt) if data.dtype == np.uint8 else data
    whole = src.read(t)
    assert whole.dtype == (np.float16 if qt == T.F16 else np.float32)
    np.testing.assert_array_equal(whole, oracle)
    # Row blocks are the same rows (bounded reads).
    np.testing.assert_array_equal(np.concatenate([src.read(t, (slice(r, r + 4),))
                                                  for r in range(0, 6, 4)]), oracle)
    if qt in (T.F32, T.F64, T.BF16, T.Q8_0, T.Q4_0):  # the package's encoder round trip
        assert np.abs(whole.astype(np.float32) - values).max() <= (
            0 if qt in (T.F32, T.F64) else 0.02 if qt == T.BF16 else 0.5)


def test_names_map_to_the_hf_names_of_the_policy():
    assert hf_name("token_embd.weight") == ("model.embed_tokens.weight", None)
    assert hf_name("output.weight") == ("lm_head.weight", None)
    assert hf_name("output_norm.weight") == ("model.norm.weight", None)
    assert hf_name("blk.3.attn_q.weight") == ("model.layers.3.self_attn.q_proj.weight", None)
    assert hf_name("blk.3.attn_q.bias") == ("model.layers.3.self_attn.q_proj.bias", None)
    assert hf_name("blk.0.ffn_norm.weight") == (
        "model.layers.0.post_attention_layernorm.weight", None)
    assert hf_name("blk.1.ffn_gate_inp.weight") == ("model.layers.1.mlp.gate.weight", None)
    assert hf_name("blk.1.ffn_down_exps.weight") == ("model.layers.1.mlp.experts",
                                                     "down_proj.weight")
    assert hf_name("blk.2.ffn_up_shexp.weight") == (
        "model.layers.2.mlp.shared_expert.up_proj.weight", None)
    assert hf_name("blk.2.ssm_a") == ("blk.2.ssm_a", None)  # unknown: kept as is


def test_llama_qk_rows_are_unpermuted_on_any_row_range(tmp_path):
    rng = np.random.default_rng(5)
    hf_q = rng.standard_normal((H, H)).astype(np.float32)
    hf_k = rng.standard_normal((128, H)).astype(np.float32)
    write_gguf(tmp_path / "l.gguf", "llama", [
        ("blk.0.attn_q.weight", llama_permute(hf_q, N_HEAD), None),
        ("blk.0.attn_k.weight", llama_permute(hf_k, N_KV), None),
        ("blk.0.attn_v.weight", hf_k, None)], llama_kv(1))
    src = GgufSource(tmp_path / "l.gguf")
    by = {t.name: t for t in src.tensors}
    q, k = by["model.layers.0.self_attn.q_proj.weight"], by["model.layers.0.self_attn.k_proj.weight"]
    assert (q.permute_heads, k.permute_heads) == (N_HEAD, N_KV)
    np.testing.assert_array_equal(src.read(q), hf_q)
    np.testing.assert_array_equal(src.read(k), hf_k)
    for lo, hi in [(0, 1), (3, 70), (63, 65), (100, 256)]:  # straddling heads
        np.testing.assert_array_equal(src.read(q, (slice(lo, hi),)), hf_q[lo:hi])
    np.testing.assert_array_equal(src.read(by["model.layers.0.self_attn.v_proj.weight"]), hf_k)
    # qwen3 files are not permuted by llama.cpp: rows pass through unchanged.
    write_gguf(tmp_path / "q.gguf", "qwen3", [("blk.0.attn_q.weight", hf_q, None)])
    (t,) = GgufSource(tmp_path / "q.gguf").tensors
    assert t.permute_heads == 0


@pytest.mark.parametrize("arch", sorted(PERMUTED_QK_ARCHS) + ["qwen3", "llama4", "gemma3"])
def test_qk_rows_of_every_llama_family_arch_are_unpermuted(tmp_path, arch):
    """Found by a review: only llama (and 'mistral', which is no llama.cpp arch) were
    un-permuted, but llama.cpp's converter permutes Q/K for granite, granitemoe, deci,
    mistral3 (LlamaModel subclasses) and the others of PERMUTED_QK_ARCHS too: their rows
    were stored in llama.cpp's rope order under HF names. Other archs pass through."""
    rng = np.random.default_rng(11)
    hf_q = rng.standard_normal((H, H)).astype(np.float32)
    hf_k = rng.standard_normal((128, H)).astype(np.float32)
    permuted = arch in PERMUTED_QK_ARCHS
    stored_q = llama_permute(hf_q, N_HEAD) if permuted else hf_q
    stored_k = llama_permute(hf_k, N_KV) if permuted else hf_k
    kv = {f"{arch}.attention.head_count": N_HEAD, f"{arch}.attention.head_count_kv": N_KV}
    write_gguf(tmp_path / "m.gguf", arch, [("blk.0.attn_q.weight", stored_q, None),
                                           ("blk.0.attn_k.weight", stored_k, None)], kv)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "o.hfq", fmt="f32", arch=0,
                 measure_error=False)
    with HfqmFile(tmp_path / "o.hfq") as f:
        np.testing.assert_array_equal(f["model.layers.0.self_attn.q_proj.weight"], hf_q)
        np.testing.assert_array_equal(f["model.layers.0.self_attn.k_proj.weight"], hf_k)
    assert "mistral" not in PERMUTED_QK_ARCHS and "mistral" not in GGUF_ARCH_IDS


def test_deci_per_layer_head_counts_unpermute_each_layer(tmp_path):
    """deci (and granitehybrid) store head counts per layer; K of each layer is
    permuted with that layer's KV heads, and a layer without heads cannot be split."""
    rng = np.random.default_rng(12)
    hf = {li: (rng.standard_normal((H, H)).astype(np.float32),
               rng.standard_normal((128, H)).astype(np.float32)) for li in range(2)}
    kv_heads = [2, 1]
    tensors = []
    for li, (q, k) in hf.items():
        tensors += [(f"blk.{li}.attn_q.weight", llama_permute(q, N_HEAD), None),
                    (f"blk.{li}.attn_k.weight", llama_permute(k, kv_heads[li]), None)]
    write_gguf(tmp_path / "d.gguf", "deci", tensors,
               {"deci.attention.head_count": [N_HEAD, N_HEAD],
                "deci.attention.head_count_kv": kv_heads})
    src = GgufSource(tmp_path / "d.gguf")
    by = {t.name: t for t in src.tensors}
    for li, (q, k) in hf.items():
        kt = by[f"model.layers.{li}.self_attn.k_proj.weight"]
        assert kt.permute_heads == kv_heads[li]
        np.testing.assert_array_equal(src.read(by[f"model.layers.{li}.self_attn.q_proj.weight"]),
                                      q)
        np.testing.assert_array_equal(src.read(kt), k)
        np.testing.assert_array_equal(src.read(kt, (slice(60, 70),)), k[60:70])
    write_gguf(tmp_path / "z.gguf", "deci", tensors,
               {"deci.attention.head_count": [N_HEAD, N_HEAD],
                "deci.attention.head_count_kv": [2, 0]})
    with pytest.raises(BadMetadata, match=r"blk\.1\.attn_k\.weight.*128 rows do not split "
                                          r"into 0 heads of an even size "
                                          r"\(deci\.attention\.head_count_kv\)"):
        GgufSource(tmp_path / "z.gguf")


def test_llama_qk_biases_are_unpermuted_like_the_weights(tmp_path):
    """Found by a review: llama.cpp permutes q_proj.bias/k_proj.bias as it permutes the
    weights (LlamaModel.modify_tensors), but only 2-D tensors were un-permuted."""
    hf_bq = np.arange(H, dtype=np.float32) / 64          # exact in f16
    hf_bk = np.arange(128, dtype=np.float32) / 32 - 2
    hf_q = np.arange(H * H, dtype=np.float32).reshape(H, H) / 1e4
    write_gguf(tmp_path / "b.gguf", "llama", [
        ("blk.0.attn_q.weight", llama_permute(hf_q, N_HEAD), None),
        ("blk.0.attn_q.bias", llama_permute(hf_bq, N_HEAD), None),
        ("blk.0.attn_k.bias", llama_permute(hf_bk, N_KV), None),
        ("blk.0.attn_v.bias", hf_bk, None)], llama_kv(1))
    src = GgufSource(tmp_path / "b.gguf")
    by = {t.name: t for t in src.tensors}
    assert by["model.layers.0.self_attn.q_proj.bias"].permute_heads == N_HEAD
    assert by["model.layers.0.self_attn.k_proj.bias"].permute_heads == N_KV
    assert by["model.layers.0.self_attn.v_proj.bias"].permute_heads == 0
    convert_gguf(tmp_path / "b.gguf", tmp_path / "b.hfq", fmt="q8", measure_error=False)
    with HfqmFile(tmp_path / "b.hfq") as f:
        assert f["model.layers.0.self_attn.q_proj.bias"].tobytes() == hf_bq.astype(
            np.float16).tobytes()
        assert f["model.layers.0.self_attn.k_proj.bias"].tobytes() == hf_bk.astype(
            np.float16).tobytes()
        assert f["model.layers.0.self_attn.v_proj.bias"].tobytes() == hf_bk.astype(
            np.float16).tobytes()
        assert f.raw("model.layers.0.self_attn.q_proj.weight").tobytes() == quantize(
            hf_q, "q8f16").tobytes()


# --- conversion -----------------------------------------------------------------------


def test_convert_llama_gguf_writes_the_policy_payloads_and_metadata(tmp_path, capsys):
    expected = make_llama(tmp_path / "m.gguf")
    out = tmp_path / "m.hfq"
    assert cli_main(["convert", str(tmp_path / "m.gguf"), "-o", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"wrote {out}: {os.path.getsize(out):,} bytes, arch 0, format hf4")
    with HfqmFile(out) as f:
        qts = {t.name: t.qt for t in f.tensors}
        assert qts == {name: (3 if "embed" in name or "lm_head" in name else
                              1 if v.ndim == 1 else 6) for name, v in expected.items()}
        for t in f.tensors:
            shape = expected[t.name].shape
            assert t.shape == shape
            want = quantize(expected[t.name], qtype(t.qt).key)
            assert f.raw(t.name).tobytes() == want.tobytes(), t.name
        meta = f.metadata
        assert meta["architecture"] == "llama" and meta["source"] == "gguf"
        assert meta["config"] == {
            "model_type": "llama", "hidden_size": H, "num_hidden_layers": 2,
            "num_attention_heads": N_HEAD, "num_key_value_heads": N_KV,
            "intermediate_size": I, "vocab_size": V, "max_position_embeddings": 4096,
            "rope_theta": 10000.0, "rms_norm_eps": float(np.float32(1e-5)), "head_dim": 64,
            "bos_token_id": 1, "eos_token_id": 2}
        assert meta["gguf_meta"]["general.architecture"] == "llama"
        assert meta["gguf_meta"]["tokenizer.ggml.tokens"][:3] == ["t0", "t1", "t2"]
        assert meta["quantization_hash"]["value"] == compute_quantization_hash(f)
        total = sum(v.size for v in expected.values())
        quantized = sum(v.size for v in expected.values() if v.ndim == 2)
        assert meta["parameter_counts"] == {
            "schema": "hipfire.parameter_counts.v1", "total_params": total,
            "source_total_params": total, "active_params": total, "effective_params": total,
            "quantized_params": quantized, "skipped_params": 0}
        assert meta["pagedkv"]["promote_6bit"] is False
    lines = text.splitlines()
    assert lines[2].split() == ["format", "qt", "tensors", "bytes", "share"]
    assert "mean rel. error" in text


def test_convert_gguf_in_row_blocks_is_byte_identical(tmp_path):
    make_llama(tmp_path / "m.gguf", weight_type=T.Q8_0)
    a = convert_gguf(tmp_path / "m.gguf", tmp_path / "a.hfq", fmt="mq4", chunk_bytes=1,
                     measure_error=False)
    b = convert_gguf(tmp_path / "m.gguf", tmp_path / "b.hfq", fmt="mq4")
    assert (tmp_path / "a.hfq").read_bytes() == (tmp_path / "b.hfq").read_bytes()
    assert a.source_bytes == b.source_bytes == GgufSource(tmp_path / "m.gguf").total_bytes
    assert 0 < b.mean_rel_error()["mlp"][1] < 0.2


def test_convert_gguf_progress_counts_source_bytes(tmp_path):
    make_llama(tmp_path / "m.gguf")
    seen = []
    report = convert_gguf(tmp_path / "m.gguf", tmp_path / "o.hfq", measure_error=False,
                          chunk_bytes=1 << 16, progress=lambda d, t, n: seen.append((d, t)))
    assert seen[-1] == (report.source_bytes, report.source_bytes)
    assert all(b[0] >= a[0] for a, b in itertools.pairwise(seen))


def make_moe(path, n_layers: int = 4, experts: int = 4):
    rng = np.random.default_rng(9)
    kv = {"qwen3moe.embedding_length": H, "qwen3moe.block_count": n_layers,
          "qwen3moe.attention.head_count": N_HEAD, "qwen3moe.attention.head_count_kv": N_KV,
          "qwen3moe.expert_count": experts, "qwen3moe.expert_used_count": 2,
          "qwen3moe.expert_feed_forward_length": 256}
    tensors: list[tuple[str, np.ndarray, T | None]] = [
        ("token_embd.weight", rng.standard_normal((V, H)).astype(np.float16), None)]
    for li in range(n_layers):
        b = f"blk.{li}."
        tensors += [
            (b + "attn_q.weight", gguf_quantize(rng.standard_normal((H, H)).astype(np.float32),
                                                T.Q8_0), T.Q8_0),
            (b + "ffn_gate_inp.weight", rng.standard_normal((experts, H)).astype(np.float32),
             None),
            (b + "ffn_gate_exps.weight",
             gguf_quantize(rng.standard_normal((experts, 256, H)).astype(np.float32), T.Q8_0),
             T.Q8_0),
            (b + "ffn_down_exps.weight",
             rng.standard_normal((experts, H, 256)).astype(np.float16), None),
        ]
    write_gguf(path, "qwen3moe", tensors, kv)


def test_moe_experts_split_and_promote_with_exact_parameter_counts(tmp_path):
    make_moe(tmp_path / "moe.gguf")
    with pytest.raises(InvalidArgument, match="qwen3moe.*pass --arch"):
        convert_gguf(tmp_path / "moe.gguf", tmp_path / "o.hfq")
    assert not (tmp_path / "o.hfq").exists()
    src = GgufSource(tmp_path / "moe.gguf")
    report = convert_gguf(tmp_path / "moe.gguf", tmp_path / "o.hfq", arch=6, promote=True,
                          measure_error=False)
    with HfqmFile(tmp_path / "o.hfq") as f:
        qts = {t.name: t.qt for t in f.tensors}
        # MoE, promoted: every expert 6-bit, edge layers' attention too.
        assert qts["model.layers.0.mlp.experts.3.gate_proj.weight"] == 8
        assert qts["model.layers.2.mlp.experts.0.down_proj.weight"] == 8
        assert qts["model.layers.0.self_attn.q_proj.weight"] == 8
        assert qts["model.layers.3.self_attn.q_proj.weight"] == 8
        # n_layers = 4: layers 0, 1 and 2, 3 are all edges; routers stay Q8F16.
        assert qts["model.layers.1.mlp.gate.weight"] == 3
        assert len(qts) == 1 + 4 * (2 + 2 * 4)
        exp = next(t for t in src.tensors
                   if t.name == "model.layers.1.mlp.experts.2.gate_proj.weight")
        assert (exp.gguf_name, exp.expert, exp.shape) == ("blk.1.ffn_gate_exps.weight", 2,
                                                          (256, H))
        stacked = gguf.GGUFReader(tmp_path / "moe.gguf").tensors[exp.file_index].data
        np.testing.assert_array_equal(src.read(exp), gguf_dequantize(stacked[2], T.Q8_0))
        counts = f.metadata["parameter_counts"]
    routed = 4 * 4 * (256 * H + H * 256)
    total = V * H + 4 * (H * H + 4 * H) + routed
    assert counts == {
        "schema": "hipfire.parameter_counts.v1", "total_params": total,
        "source_total_params": total, "active_params": total - routed + routed * 2 // 4,
        "effective_params": total - routed + routed * 2 // 4, "quantized_params": total,
        "skipped_params": 0,
        "moe": {"num_experts": 4, "num_experts_per_tok": 2, "routed_expert_params": routed,
                "routed_expert_active_params": routed * 2 // 4,
                "active_rule": "dense_and_shared_full_plus_routed_top_k_over_num_experts",
                "routed_active_fraction": {"numerator": routed * 2, "denominator": 4}}}
    assert report.per_qt["HFQ6G256"]["tensors"] == 4 * (1 + 2 * 4)
    convert_gguf(tmp_path / "moe.gguf", tmp_path / "u.hfq", arch=6, promote=False,
                 measure_error=False)
    with HfqmFile(tmp_path / "u.hfq") as f:
        assert {t.qt for t in f.tensors} == {3, 6}


@pytest.mark.parametrize("arch", [6, 13])
def test_promotion_is_off_by_default_for_every_arch(tmp_path, capsys, arch):
    """Found by a review: the MoE (6) and Gemma4 (13) arch ids were promoted by default,
    so a default 'mq4'/'hf4' file was mostly 6-bit, while the contract's defaults are the
    format alone (promotion P2, on request)."""
    make_moe(tmp_path / "moe.gguf")
    out = tmp_path / "d.hfq"
    assert cli_main(["convert", str(tmp_path / "moe.gguf"), "-o", str(out), "--arch",
                     str(arch), "--no-progress", "--no-error"]) == 0
    with HfqmFile(out) as f:
        qts = {t.name: t.qt for t in f.tensors}
        assert f.metadata["pagedkv"]["promote_6bit"] is False
    assert set(qts.values()) == {3, 6}
    assert qts["model.layers.0.mlp.experts.3.gate_proj.weight"] == 6
    assert "HFQ6G256" not in capsys.readouterr().out
    report = convert_gguf(tmp_path / "moe.gguf", tmp_path / "e.hfq", arch=arch,
                          measure_error=False)
    assert set(report.per_qt) == {"HFQ4G256", "Q8F16"}
    assert (tmp_path / "e.hfq").read_bytes() == out.read_bytes()


GEMMA_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


@pytest.mark.parametrize("arch,plus_one", [("gemma2", True), ("gemma3", True),
                                           ("gemma-embedding", True), ("gemma3n", False),
                                           ("gemma4", False)])
def test_gemma_norms_map_to_their_own_names_and_lose_llama_cpps_plus_one(tmp_path, arch,
                                                                         plus_one):
    """Found by a review: in gemma2+ GGUF files ffn_norm (HF pre_feedforward_layernorm) and
    post_attention_norm both became post_attention_layernorm and post_ffw_norm kept its
    GGUF name. llama.cpp also stores gemma/gemma2/gemma3 norms as w + 1 (its
    conversion/gemma.py; not gemma3n/gemma4): the HF weight is the stored value - 1."""
    hf = {slot: np.arange(H, dtype=np.float32) / 256 - 0.5 + i / 8
          for i, slot in enumerate(GEMMA_NORMS)}
    shift = np.float32(plus_one)
    tensors = [(f"blk.0.{slot}.weight", (v + shift).astype(np.float32), None)
               for slot, v in hf.items()]
    tensors.append(("output_norm.weight", (hf["attn_norm"] + shift).astype(np.float16), None))
    tensors.append(("blk.0.attn_q.weight", np.ones((H, H), np.float32), None))
    write_gguf(tmp_path / "g.gguf", arch, tensors)
    src = GgufSource(tmp_path / "g.gguf")
    assert [t.name for t in src.tensors] == [
        *(f"model.layers.0.{name}.weight" for name in GEMMA_NORMS.values()),
        "model.norm.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert [t.norm_plus_one for t in src.tensors] == [plus_one] * 7 + [False]
    convert_gguf(tmp_path / "g.gguf", tmp_path / "g.hfq", arch=255, measure_error=False)
    with HfqmFile(tmp_path / "g.hfq") as f:
        for slot, name in GEMMA_NORMS.items():
            assert f[f"model.layers.0.{name}.weight"].tobytes() == hf[slot].astype(
                np.float16).tobytes(), slot
        assert f["model.norm.weight"].tobytes() == hf["attn_norm"].astype(np.float16).tobytes()
        assert f.dequantize("model.layers.0.self_attn.q_proj.weight").min() == 1.0


def test_gemma1_ffn_norm_is_the_post_attention_norm_plus_one_removed(tmp_path):
    """Gemma 1 has two norms a block: ffn_norm is HF's post_attention_layernorm."""
    w = np.arange(H, dtype=np.float32) / 256
    write_gguf(tmp_path / "g.gguf", "gemma", [("blk.0.ffn_norm.weight", w + 1, None)])
    (t,) = GgufSource(tmp_path / "g.gguf").tensors
    assert (t.name, t.norm_plus_one) == ("model.layers.0.post_attention_layernorm.weight", True)
    np.testing.assert_array_equal(GgufSource(tmp_path / "g.gguf").read(t), w)
    # llama norms are stored as they are
    write_gguf(tmp_path / "l.gguf", "llama", [("blk.0.ffn_norm.weight", w + 1, None)])
    (t,) = GgufSource(tmp_path / "l.gguf").tensors
    assert not t.norm_plus_one
    np.testing.assert_array_equal(GgufSource(tmp_path / "l.gguf").read(t), w + 1)


def test_two_tensors_mapped_to_one_name_are_refused_before_encoding(tmp_path, monkeypatch):
    """Found by a review (the gemma norm collision): a repeated output name failed in the
    writer after earlier tensors were encoded; it is refused at planning, naming both."""
    calls = []
    monkeypatch.setattr("pagedkv.quant.quantize", lambda *a: calls.append(a))
    rng = np.random.default_rng(14)
    write_gguf(tmp_path / "m.gguf", "llama", [
        ("token_embd.weight", rng.standard_normal((V, H)).astype(np.float32), None),
        ("blk.0.ffn_norm.weight", np.ones(H, np.float32), None),
        ("blk.0.post_attention_norm.weight", np.ones(H, np.float32), None)], llama_kv(1))
    (tmp_path / "o.hfq").write_bytes(b"previous")
    with pytest.raises(BadMetadata) as info:
        convert_gguf(tmp_path / "m.gguf", tmp_path / "o.hfq")
    assert str(info.value) == (
        f"{tmp_path / 'm.gguf'}, tensor 'model.layers.0.post_attention_layernorm.weight': "
        "source tensors 'blk.0.ffn_norm.weight' and 'blk.0.post_attention_norm.weight' both "
        "map to the output name 'model.layers.0.post_attention_layernorm.weight'")
    assert calls == []
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "o.hfq"]
    assert (tmp_path / "o.hfq").read_bytes() == b"previous"


def test_big_endian_files_convert_like_little_endian_ones(tmp_path):
    """Found by a review: a big-endian GGUF (the package maps it as '>f4' views) failed
    mid-conversion with a codec error naming neither file nor tensor. Whole-element
    types are swapped to native order; quantized blocks are refused up front."""
    rng = np.random.default_rng(15)
    tensors = [("blk.0.attn_norm.weight", rng.standard_normal(H).astype(np.float32), None),
               ("blk.0.attn_q.weight", llama_permute(
                   rng.standard_normal((H, H)).astype(np.float32), N_HEAD), None),
               ("blk.0.ffn_up.weight", rng.standard_normal((64, H)).astype(np.float16), None),
               ("blk.0.ffn_down.weight", rng.standard_normal((H, 64)), None),
               ("blk.0.ids", np.arange(8, dtype=np.int32), None)]
    for order in ("le", "be"):
        (tmp_path / order).mkdir()
        # The writer swaps the arrays it is given into the file's byte order.
        write_gguf(tmp_path / order / "m.gguf", "llama", [(n, v.copy(), q) for n, v, q in tensors],
                   llama_kv(1), gguf.GGUFEndian.BIG if order == "be" else gguf.GGUFEndian.LITTLE)
    be = GgufSource(tmp_path / "be" / "m.gguf")
    assert gguf.GGUFReader(tmp_path / "be" / "m.gguf").tensors[0].data.dtype.str == ">f4"
    le = GgufSource(tmp_path / "le" / "m.gguf")
    for a, b in zip(le.tensors, be.tensors, strict=True):
        x, y = le.read(a), be.read(b)
        assert y.dtype.isnative and y.dtype == x.dtype
        np.testing.assert_array_equal(x, y)
    for order in ("le", "be"):
        convert_gguf(tmp_path / order / "m.gguf", tmp_path / order / "o.hfq", fmt="q8",
                     measure_error=False)
    assert (tmp_path / "be" / "o.hfq").read_bytes() == (tmp_path / "le" / "o.hfq").read_bytes()
    write_gguf(tmp_path / "q.gguf", "llama",
               [("blk.0.attn_norm.weight", np.ones(H, np.float32), None),
                ("blk.0.ffn_up.weight", gguf_quantize(np.ones((2, H), np.float32), T.Q8_0),
                 T.Q8_0)], llama_kv(1), gguf.GGUFEndian.BIG)
    with pytest.raises(UnsupportedQuantType) as info:
        convert_gguf(tmp_path / "q.gguf", tmp_path / "q.hfq")
    assert str(info.value) == (
        f"{tmp_path / 'q.gguf'}, tensor 'blk.0.ffn_up.weight': big-endian GGUF with a Q8_0 "
        "tensor: its blocks would be decoded as little-endian; convert the file to "
        "little-endian first (gguf-py's gguf_convert_endian.py)")
    assert not (tmp_path / "q.hfq").exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_type_the_package_cannot_dequantize_is_refused_before_any_work(tmp_path):
    """gguf knows types it has no dequantizer for (0.19: Q8_1, Q8_K, Q1_0): such a
    tensor was refused only when its rows were read, after every tensor before it had
    been quantized (hours into a large model); now the open refuses it."""
    qt = next((q for q in (T.Q8_K, T.Q8_1, T.Q1_0) if q in gguf.GGML_QUANT_SIZES
               and not gguf_source._has_dequantizer(q.name)), None)
    if qt is None:
        pytest.skip("this gguf package dequantizes every type tried")
    _, size = gguf.GGML_QUANT_SIZES[qt]
    write_gguf(tmp_path / "q.gguf", "qwen3",
               [("blk.0.ffn_up.weight", np.ones((4, H), np.float32), None),
                ("blk.0.ffn_down.weight", np.zeros((4, size), np.uint8), qt)])
    message = (f"{tmp_path / 'q.gguf'}, tensor 'blk.0.ffn_down.weight': GGUF type {qt.name} "
               "has no dequantizer in the gguf package; re-export the model as F16/BF16/Q8_0 "
               "or upgrade gguf")
    with pytest.raises(UnsupportedQuantType) as info:
        GgufSource(tmp_path / "q.gguf")
    assert str(info.value) == message
    calls = []
    with pytest.raises(UnsupportedQuantType) as info:
        convert_gguf(tmp_path / "q.gguf", tmp_path / "q.hfq",
                     progress=lambda *args: calls.append(args))
    assert str(info.value) == message
    assert calls == []                      # nothing was quantized
    assert os.listdir(tmp_path) == ["q.gguf"]


def test_a_gguf_file_without_the_suffix_is_converted_as_gguf(tmp_path, capsys):
    """convert picked GGUF by the .gguf suffix alone: model.bin went to the safetensors
    reader, which said "safetensors header length 14064895815 is above the loader's
    limit". The magic decides now; the safetensors reader names a GGUF file as one."""
    values = np.linspace(-1, 1, 2 * H, dtype=np.float32).reshape(2, H)
    write_gguf(tmp_path / "model.bin", "qwen3", [("blk.0.ffn_up.weight", values, None)])
    assert cli_main(["convert", str(tmp_path / "model.bin"), "-o", str(tmp_path / "o.hfq"),
                     "--no-progress", "--format", "q8"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'o.hfq'}: ")
    with HfqmFile(tmp_path / "o.hfq") as f:
        assert f.names == ["model.layers.0.mlp.up_proj.weight"]
        assert f.metadata["source"] == "gguf" and f.arch_id == 1
        np.testing.assert_array_equal(f.dequantize(0), dequantize(quantize(values, "q8f16"),
                                                                  "q8f16", (2, H)))
    with pytest.raises(BadMagic) as info:
        SafetensorsSource(tmp_path / "model.bin")
    assert str(info.value) == (f"{tmp_path / 'model.bin'}, offset 0: not a safetensors file "
                               "but a GGUF file; convert it with convert_gguf (convert_model "
                               "and pagedkv convert pick GGUF by this magic)")


def _split_model(directory, n_layers=3, **writer_args) -> dict[str, np.ndarray]:
    """A llama model written by the gguf package's own splitter (GGUFWriter's
    split_max_tensors, llama.cpp's gguf-split layout), two tensors a shard."""
    rng = np.random.default_rng(16)
    tensors = {}
    w = gguf.GGUFWriter(str(directory / "model.gguf"), "llama", split_max_tensors=2,
                        **writer_args)
    for key, value in llama_kv(n_layers).items():
        if key not in ("tokenizer.ggml.tokens", "llama.rope.freq_base",
                       "llama.attention.layer_norm_rms_epsilon"):
            w.add_uint32(key, value)
    for li in range(n_layers):
        tensors[f"blk.{li}.ffn_up.weight"] = rng.standard_normal((64, H)).astype(np.float32)
        tensors[f"blk.{li}.attn_norm.weight"] = rng.standard_normal(H).astype(np.float32)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_split_gguf_reads_every_shard(tmp_path, capsys):
    """Found by a review: a gguf-split model converted only its first shard, exit 0."""
    (tmp_path / "s").mkdir()
    tensors = _split_model(tmp_path / "s")
    shards = [f"model-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    assert sorted(os.listdir(tmp_path / "s")) == shards
    write_gguf(tmp_path / "whole.gguf", "llama", [(n, v, None) for n, v in tensors.items()],
               {k: v for k, v in llama_kv(3).items() if isinstance(v, int)})
    convert_gguf(tmp_path / "whole.gguf", tmp_path / "whole.hfq", measure_error=False)
    for k, shard in enumerate(shards):
        src = GgufSource(tmp_path / "s" / shard)
        assert src.shards == [str(tmp_path / "s" / name) for name in shards]
        assert [t.gguf_name for t in src.tensors] == list(tensors)
        assert [os.path.basename(t.shard) for t in src.tensors] == [
            shards[i // 2] for i in range(6)]
        out = tmp_path / f"o{k}.hfq"
        assert cli_main(["convert", str(tmp_path / "s" / shard), "-o", str(out),
                         "--no-progress", "--no-error"]) == 0
        with HfqmFile(out) as f, HfqmFile(tmp_path / "whole.hfq") as whole:
            assert f.names == whole.names and len(f.names) == 6
            for name in f.names:
                assert f.raw(name).tobytes() == whole.raw(name).tobytes(), name
            assert f.metadata["pagedkv"]["source_files"] == shards
            assert f.metadata["gguf_meta"] == whole.metadata["gguf_meta"]
            assert not [key for key in f.metadata["gguf_meta"] if key.startswith("split.")]
            assert f.metadata["config"] == whole.metadata["config"]
    capsys.readouterr()


def _shard(path, no: int, count: int, total: int, names: list[str]) -> None:
    write_gguf(path, "llama", [(n, np.ones(H, np.float32), None) for n in names],
               {"split.no": no, "split.count": count, "split.tensors.count": total})


def test_broken_split_ggufs_are_refused_and_write_nothing(tmp_path, capsys):
    d = tmp_path / "s"
    d.mkdir()
    out = tmp_path / "o.hfq"
    first, second = d / "m-00001-of-00002.gguf", d / "m-00002-of-00002.gguf"

    def refused(exc, given) -> str:
        with pytest.raises(exc) as info:
            convert_gguf(given, out)
        assert sorted(os.listdir(tmp_path)) == ["s"]
        return str(info.value)

    _shard(first, 0, 2, 2, ["blk.0.attn_norm.weight"])
    assert refused(InvalidArgument, first) == (
        f"shard 2 of 2 of the split GGUF {str(first)!r} is missing: {str(second)!r}")
    _shard(second, 0, 2, 2, ["blk.1.attn_norm.weight"])  # its keys say shard 1
    assert refused(BadMetadata, first) == (
        f"{second}: split keys (split.no, split.count, split.tensors.count) are (0, 2, 2), "
        "expected (1, 2, 2) for shard 2 of 2")
    assert "is shard 1 of a 2-file split GGUF, but its name" in refused(InvalidArgument,
                                                                        second)
    _shard(first, 0, 2, 3, ["blk.0.attn_norm.weight"])
    _shard(second, 1, 2, 3, ["blk.1.attn_norm.weight"])
    assert refused(CountMismatch, second) == (
        f"{first}: the 2 shards hold 2 tensors, split.tensors.count says 3")
    _shard(second, 1, 2, 3, ["blk.0.attn_norm.weight"])
    assert refused(BadMetadata, first) == (
        f"{second}, tensor 'blk.0.attn_norm.weight': tensor appears in more than one shard")
    # a shard renamed so that its siblings cannot be found
    os.rename(first, d / "renamed.gguf")
    assert cli_main(["convert", str(d / "renamed.gguf"), "-o", str(out), "--no-progress"]) == 1
    assert capsys.readouterr().err == (
        f"pagedkv convert: error: {str(d / 'renamed.gguf')!r} is shard 1 of a 2-file split "
        "GGUF, but its name does not follow llama.cpp's NAME-00001-of-00002.gguf, so its "
        "siblings cannot be found; rename the shards or merge them with llama-gguf-split "
        "--merge\n")
    assert sorted(os.listdir(tmp_path)) == ["s"]


def test_stacked_expert_biases_split_per_expert(tmp_path):
    """Found by a review: blk.N.ffn_{gate,up,down}_exps.bias [E, M] (gpt-oss) all mapped
    to 'model.layers.N.mlp.experts' and the conversion failed on the repeated name."""
    rng = np.random.default_rng(13)
    experts = 3
    tensors, biases = [], {}
    for proj in ("gate", "up", "down"):
        tensors.append((f"blk.0.ffn_{proj}_exps.weight",
                        rng.standard_normal((experts, 256, H)).astype(np.float32), None))
        biases[proj] = (np.arange(experts * 256, dtype=np.float32).reshape(experts, 256) / 8
                        - 40 * (proj == "up"))
        tensors.append((f"blk.0.ffn_{proj}_exps.bias", biases[proj], None))
    write_gguf(tmp_path / "m.gguf", "qwen3", tensors)
    src = GgufSource(tmp_path / "m.gguf")
    by = {t.name: t for t in src.tensors}
    assert len(by) == len(src.tensors) == 2 * 3 * experts
    for proj, b in biases.items():
        for e in range(experts):
            t = by[f"model.layers.0.mlp.experts.{e}.{proj}_proj.bias"]
            assert (t.gguf_name, t.expert, t.shape, t.nbytes) == (
                f"blk.0.ffn_{proj}_exps.bias", e, (256,), 256 * 4)
            np.testing.assert_array_equal(src.read(t), b[e])
    convert_gguf(tmp_path / "m.gguf", tmp_path / "o.hfq", measure_error=False)
    with HfqmFile(tmp_path / "o.hfq") as f:
        assert sorted(f.names) == sorted(by)
        for proj, b in biases.items():
            for e in range(experts):
                name = f"model.layers.0.mlp.experts.{e}.{proj}_proj.bias"
                assert f.info(name)[1:4] == (1, "F16", (256,))
                assert f[name].tobytes() == b[e].astype(np.float16).tobytes()
    write_gguf(tmp_path / "bad.gguf", "qwen3",
               [("blk.0.ffn_up_exps.bias", np.ones((2, 3, 4), np.float32), None)])
    with pytest.raises(BadMetadata, match=r"blk\.0\.ffn_up_exps\.bias.*stacked expert tensor "
                                          r"has shape \(2, 3, 4\), not \[E, M\] with E > 0"):
        GgufSource(tmp_path / "bad.gguf")


# --- promotion decisions --------------------------------------------------------------


def _qts(names, fmt, n_layers, is_moe, k=256):
    target = resolve_format(fmt)
    return {n: plan_tensor(n, "BF16", (512, k), target, promote=True, n_layers=n_layers,
                           is_moe=is_moe)[0].qt for n in names}


def test_promotion_matches_hipfire_kmap_full_mode_on_a_small_config():
    names = [f"model.layers.{i}.{p}.weight" for i in range(6)
             for p in ("self_attn.q_proj", "mlp.down_proj")]
    dense = _qts(names, "hf4", 6, False)
    assert {n for n, q in dense.items() if q == 8} == {
        f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1, 4, 5)}
    assert {q for q in dense.values()} == {6, 8}
    moe = _qts(names, "mq4", 6, True)
    assert {n for n, q in moe.items() if q == 15} == {
        n for n in names if int(n.split(".")[2]) in (0, 1, 4, 5)}
    assert set(_qts(names, "mq4g256", 6, False).values()) == {13, 15}
    assert set(_qts(names, "mq3g256v2", 6, False).values()) == {49, 47}
    assert set(_qts(names, "q8", 6, True).values()) == {3}     # not promoted
    # K % 256 != 0 keeps the K fallback (hipfire promotes only 256-aligned K).
    assert set(_qts(names, "mq4", 6, True, k=384).values()) == {7}
    # Experts of a MoE model, any layer; routers and embeddings are never promoted.
    assert promoted("model.layers.30.mlp.experts.5.down_proj.weight", 64, True)
    assert not promoted("model.layers.30.mlp.experts.5.down_proj.weight", 64, False)
    assert not promoted("model.layers.2.mlp.gate_proj.weight", 64, False)
    assert promoted("blk.63.ffn_gate.weight", 64, False)
    assert not promoted("blk.0.attn_q.weight", 64, False)
    assert promoted("blk.0.attn_q.weight", 64, True)
    assert not promoted("model.layers.0.mlp.gate_proj.weight", 0, False)
    target = resolve_format("hf4")
    assert plan_tensor("model.layers.0.mlp.gate.weight", "F32", (8, 256), target,
                       promote=True, n_layers=4, is_moe=True)[0].qt == 3
    assert plan_tensor("model.embed_tokens.weight", "F32", (8, 256), target,
                       promote=True, n_layers=4, is_moe=True)[0].qt == 3


def test_parameter_counts_without_experts_config():
    target = resolve_format("hf4")
    plans = plan_tensor("model.layers.0.mlp.experts.gate_up_proj", "F32", (2, 4, 256), target)
    counts = parameter_counts(plans, 7, {})
    assert counts["moe"] == {"routed_expert_params": 2048,
                             "active_rule": "unknown_top_k_or_num_experts"}
    assert (counts["total_params"], counts["source_total_params"]) == (2048, 2055)


def test_cli_promote_flag_on_a_dense_gguf(tmp_path, capsys):
    make_llama(tmp_path / "m.gguf", n_layers=5)
    out = tmp_path / "p.hfq"
    assert cli_main(["convert", str(tmp_path / "m.gguf"), "-o", str(out), "--no-progress",
                     "--no-error", "--promote-6bit"]) == 0
    with HfqmFile(out) as f:
        six = sorted(t.name for t in f.tensors if t.qt == 8)
        assert f.metadata["pagedkv"]["promote_6bit"] is True
    # Dense: the FFN of layers 0, 1 and 3, 4 of 5 (down_proj's K = 512 is aligned too).
    assert set(six) == {f"model.layers.{i}.mlp.{p}_proj.weight" for i in (0, 1, 3, 4)
                        for p in ("gate", "up", "down")}
    assert "HFQ6G256" in capsys.readouterr().out


# --- broken input ---------------------------------------------------------------------


def test_broken_gguf_files_raise_specific_errors_and_write_nothing(tmp_path, capsys):
    make_llama(tmp_path / "m.gguf")
    good = (tmp_path / "m.gguf").read_bytes()
    out = tmp_path / "o.hfq"
    out.write_bytes(b"previous")
    cases = {
        "magic.gguf": (b"GGUX" + good[4:], BadMagic),
        "short.gguf": (good[: len(good) // 2], Truncated),
        "header.gguf": (good[:200], Truncated),
    }
    # An unknown tensor type id: patch the type field of the first tensor info.
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    field = reader.tensors[0].field
    type_offset = field.offset + sum(p.nbytes for p in field.parts[:4])
    bad = bytearray(good)
    bad[type_offset:type_offset + 4] = (250).to_bytes(4, "little")
    cases["type.gguf"] = (bytes(bad), UnknownQuantType)
    for name, (data, error) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(error):
            convert_gguf(tmp_path / name, out)
        assert out.read_bytes() == b"previous"
        assert cli_main(["convert", str(tmp_path / name), "-o", str(out)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("pagedkv convert: error: ") and name in err, err
    assert sorted(os.listdir(tmp_path)) == sorted([*cases, "m.gguf", "o.hfq"])
    with pytest.raises(InvalidArgument, match="does not exist"):
        GgufSource(tmp_path / "missing.gguf")
    with pytest.raises(InvalidArgument, match="--format 'zz'"):
        convert_gguf(tmp_path / "m.gguf", out, fmt="zz")
    assert out.read_bytes() == b"previous"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), [1.0, float("-inf")]])
def test_non_finite_float_keys_are_refused_naming_the_key(tmp_path, capsys, value):
    """Found by a review: a NaN float key/value failed at the writer with a message naming
    the output file, not the GGUF key."""
    write_gguf(tmp_path / "m.gguf", "qwen3", [("blk.0.attn_norm.weight", np.ones(H, np.float32),
                                                None)],
               {"qwen3.block_count": 1, "qwen3.rope.freq_base": value})
    with pytest.raises(BadMetadata) as info:
        GgufSource(tmp_path / "m.gguf")
    assert info.value.path == str(tmp_path / "m.gguf")
    assert "key 'qwen3.rope.freq_base' holds a NaN or infinite float" in str(info.value)
    out = tmp_path / "o.hfq"
    assert cli_main(["convert", str(tmp_path / "m.gguf"), "-o", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err == (f"pagedkv convert: error: {tmp_path / 'm.gguf'}: key 'qwen3.rope.freq_base' "
                   "holds a NaN or infinite float, which HFQM metadata (JSON) cannot store\n")
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]


def test_output_that_is_the_gguf_source_is_refused(tmp_path):
    """Found by a review: `-o x.gguf` for the source x.gguf replaced it with the output."""
    make_llama(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    with pytest.raises(InvalidArgument, match=r"^output '.*m\.gguf' is the source file "
                                              r"'.*m\.gguf': the conversion would replace it"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "m.gguf")
    assert (tmp_path / "m.gguf").read_bytes() == data
    assert os.listdir(tmp_path) == ["m.gguf"]


def test_qwen35_moe_safetensors_default_is_uniform_mq4(tmp_path):
    """The review's case: a Qwen3.5-MoE model converted without flags was 98.7 % MQ6G256
    (every routed expert and the edge layers promoted); the default is MQ4G256V2 alone."""
    from safetensors.numpy import save_file

    from pagedkv.hfqm.convert import convert_safetensors
    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32)}
    for li in range(4):
        p = f"model.layers.{li}."
        tensors[p + "self_attn.q_proj.weight"] = rng.standard_normal((H, H)).astype(np.float32)
        tensors[p + "mlp.gate.weight"] = rng.standard_normal((4, H)).astype(np.float32)
        tensors[p + "mlp.experts.gate_up_proj"] = rng.standard_normal((4, 512, H)).astype(
            np.float32)
    (tmp_path / "m").mkdir()
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    (tmp_path / "m" / "config.json").write_text(
        '{"model_type": "qwen3_5_moe", "num_hidden_layers": 4, "num_experts": 4, '
        '"num_experts_per_tok": 2}')
    report = convert_safetensors(tmp_path / "m", tmp_path / "o.hfq", measure_error=False)
    assert (report.format, report.arch_id) == ("mq4", 6)
    assert {k: v["tensors"] for k, v in report.per_qt.items()} == {
        "Q8F16": 1 + 4, "MQ4G256V2": 4 + 4 * 4}


def test_safetensors_conversion_writes_parameter_counts_and_promotes_on_request(tmp_path):
    from pagedkv.hfqm.convert import convert_safetensors
    from test_hfqm_cli import make_model
    values = make_model(tmp_path / "m")
    convert_safetensors(tmp_path / "m", tmp_path / "a.hfq", fmt="hf4", measure_error=False)
    convert_safetensors(tmp_path / "m", tmp_path / "b.hfq", fmt="hf4", promote=True,
                        measure_error=False)
    skipped = 4 + 4 * 256  # position_ids (I64) and the MTP head
    total = sum(v.size for v in values.values())
    routed = values["model.layers.0.mlp.experts.gate_up_proj"].size
    with HfqmFile(tmp_path / "a.hfq") as a, HfqmFile(tmp_path / "b.hfq") as b:
        assert a.metadata["parameter_counts"] == {
            "schema": "hipfire.parameter_counts.v1", "total_params": total,
            "source_total_params": total + skipped, "active_params": total,
            "effective_params": total, "quantized_params": total - 256,
            "skipped_params": skipped,
            "moe": {"routed_expert_params": routed,
                    "active_rule": "unknown_top_k_or_num_experts"}}
        qa = {t.name: t.qt for t in a.tensors}
        qb = {t.name: t.qt for t in b.tensors}
    # num_hidden_layers = 1: layer 0 is an edge; dense, so only the FFN-named weights
    # with K % 256 == 0 are promoted (down_proj has K = 384: its fallback stands).
    assert {n for n in qa if qa[n] != qb[n]} == {
        "model.layers.0.mlp.experts.0.gate_up_proj.weight",
        "model.layers.0.mlp.experts.1.gate_up_proj.weight"}
    assert {qb[n] for n in qb if qa[n] != qb[n]} == {8}


def test_quality_bench_measures_each_codec_on_the_same_tensors():
    from pagedkv.bench.quality import measure, rel_error, weight_sets
    w = np.array([[3.0, 4.0]], np.float32)
    assert rel_error(w, np.zeros_like(w)) == 1.0
    assert rel_error(w, np.array([[3.0, 4.5]], np.float32)) == pytest.approx(0.1)
    rows = {r["codec"]: r for r in measure(4, 256, 1, None)}
    sets = weight_sets(4, 256, 1)
    for fmt in ("hfq4g256", "mq4g256v2", "q8f16"):
        want = np.mean([rel_error(x, dequantize(quantize(x, fmt), fmt, x.shape))
                        for x in sets["llm-like"]])
        assert rows[f"pagedkv {fmt}"]["llm-like"] == want
    fwht_q4k = np.mean([rel_error(x, fwht256(dequantize(quantize(fwht256(x), "q4k"), "q4k",
                                                            x.shape), inverse=True))
                        for x in sets["gaussian"]])
    assert rows["experiment: FWHT-256 + q4k"]["gaussian"] == fwht_q4k
    q4_0 = rows["ggml q4_0"]
    assert q4_0["bpw"] == 4.5 and q4_0["library"] == "ggml"
    assert rows["pagedkv mq4g256v2"]["bpw"] == 4.25
    assert rows["pagedkv q8f16"]["gaussian"] < 0.01 < rows["pagedkv hfq4g256"]["gaussian"]


def test_duplicate_names_and_partial_blocks_are_named_not_called_truncation(tmp_path, capsys):
    """Found by a review: the gguf package's refusal of a duplicated tensor name, a
    duplicated key and a row that does not split into whole quant blocks all came out
    as Truncated, 'GGUF header or tensor data run past the end of the file'."""
    make_llama(tmp_path / "m.gguf", n_layers=1)
    good = (tmp_path / "m.gguf").read_bytes()
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    by_name = {t.name: t for t in reader.tensors}
    # blk.0.attn_k.weight renamed blk.0.attn_q.weight (same length).
    dup = bytearray(good)
    field = by_name["blk.0.attn_k.weight"].field
    name_at = field.offset + field.parts[0].nbytes
    dup[name_at:name_at + 19] = b"blk.0.attn_q.weight"
    # blk.0.attn_v.weight (Q8_0, ne0 256) given ne0 48: not a multiple of 32.
    part = bytearray(good)
    field = by_name["blk.0.attn_v.weight"].field
    ne0_at = field.offset + sum(p.nbytes for p in field.parts[:3])
    part[ne0_at:ne0_at + 8] = (48).to_bytes(8, "little")
    # One key renamed to another of the same length.
    keys = [f for f in reader.fields.values() if not f.name.startswith("GGUF.")]
    a, b = next((a, b) for a, b in itertools.combinations(keys, 2)
                if len(a.name) == len(b.name))
    dkey = bytearray(good)
    dkey[b.offset + 8:b.offset + 8 + len(b.name)] = a.name.encode()
    dup_detail = "Found duplicated tensor with name blk.0.attn_q.weight"
    part_detail = "Quantized tensor row size (48) is not a multiple of Q8_0 block size (32)"
    cases = {"dup.gguf": (dup, BadName, dup_detail),
             "part.gguf": (part, SizeMismatch, part_detail),
             "key.gguf": (dkey, BadMetadata, f"Duplicate {a.name} already in list")}
    for name, (data, error, detail) in cases.items():
        (tmp_path / name).write_bytes(bytes(data))
        with pytest.raises(error) as info:
            GgufSource(tmp_path / name)
        assert type(info.value) is error
        assert detail in str(info.value) and "past the end" not in str(info.value)
        assert cli_main(["convert", str(tmp_path / name), "-o", str(tmp_path / "o.hfq"),
                         "--no-progress"]) == 1
        assert detail in capsys.readouterr().err
    assert not (tmp_path / "o.hfq").exists()


@pytest.mark.parametrize("qt", [T.F32, T.BF16, T.Q8_0, T.Q4_K, T.Q6_K])
def test_zero_size_tensors_read_and_convert_as_empty(tmp_path, qt):
    """Found by a review: a zero-size BF16 or quantized tensor (one the gguf package
    writes) let the package's bare ValueError 'cannot reshape array of size 0' out of
    read and convert, and a zero-row llama attn_q raised ZeroDivisionError in read."""
    block, size = gguf.GGML_QUANT_SIZES[qt]
    norm = ("blk.0.attn_norm.weight", np.ones(H, np.float32), None)
    for slot, shape in (("ffn_up", (4, 0)), ("ffn_down", (0,)), ("attn_q", (0, 256))):
        if qt == T.F32:
            data, raw = np.zeros(shape, np.float32), None
        else:
            data, raw = np.zeros((*shape[:-1], shape[-1] // block * size), np.uint8), qt
        path = tmp_path / f"{slot}.gguf"
        write_gguf(path, "llama", [norm, (f"blk.0.{slot}.weight", data, raw)], llama_kv(1))
        src = GgufSource(path)
        t = src.tensors[1]
        assert t.shape == shape
        whole = src.read(t)
        assert (whole.dtype, whole.shape) == (np.float32, shape)
        out = tmp_path / f"{slot}.hfq"
        convert_gguf(path, out)
        assert tuple(HfqmFile(out).info(t.name).shape) == shape


def test_a_shape_no_array_can_have_is_refused(tmp_path):
    """Found by a review: a zero dim beside a dim near 2**61 passed the size check (no
    bytes) and read raised numpy's bare ValueError 'array is too big'."""
    write_gguf(tmp_path / "m.gguf", "qwen3", [("blk.0.ffn_up.weight",
                                               np.zeros((0, 68), np.uint8), T.Q8_0)])
    good = (tmp_path / "m.gguf").read_bytes()
    field = gguf.GGUFReader(tmp_path / "m.gguf").tensors[0].field
    ne0_at = field.offset + sum(p.nbytes for p in field.parts[:3])
    bad = bytearray(good)
    bad[ne0_at:ne0_at + 8] = (1 << 61).to_bytes(8, "little")
    (tmp_path / "m.gguf").write_bytes(bytes(bad))
    with pytest.raises(BadMetadata, match=r"tensor 'blk.0.ffn_up.weight': shape "
                                          r"\(0, 2305843009213693952\) is too large"):
        GgufSource(tmp_path / "m.gguf")


def test_overlapping_tensor_data_is_refused(tmp_path, capsys):
    """Found by a review: a tensor info whose data offset points into another tensor's
    data (llama.cpp's loader refuses it) converted silently, the other tensor's bytes
    written under its name."""
    make_llama(tmp_path / "m.gguf", n_layers=1)
    bad = bytearray((tmp_path / "m.gguf").read_bytes())
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    field = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight").field
    offset_at = field.offset + sum(p.nbytes for p in field.parts[:5])
    bad[offset_at:offset_at + 8] = (0).to_bytes(8, "little")   # token_embd's data
    (tmp_path / "m.gguf").write_bytes(bytes(bad))
    with pytest.raises(BadMetadata, match="the data of tensors 'token_embd.weight' and "
                                          "'blk.0.attn_v.weight' overlap"):
        GgufSource(tmp_path / "m.gguf")
    assert cli_main(["convert", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "o.hfq"),
                     "--no-progress"]) == 1
    assert "overlap" in capsys.readouterr().err
    assert not (tmp_path / "o.hfq").exists()


def test_a_misaligned_tensor_data_offset_is_refused(tmp_path, capsys):
    """Found by a review: a tensor offset that is not a multiple of general.alignment
    (llama.cpp's loader refuses it) was decoded from the shifted bytes: garbage weights
    converted silently, or a NaN error that blamed the weights."""
    make_llama(tmp_path / "m.gguf", n_layers=1)
    bad = bytearray((tmp_path / "m.gguf").read_bytes())
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight")
    offset_at = t.field.offset + sum(p.nbytes for p in t.field.parts[:5])
    rel = int(t.data_offset) - int(reader.data_offset)
    bad[offset_at:offset_at + 8] = (rel + 3).to_bytes(8, "little")
    (tmp_path / "m.gguf").write_bytes(bytes(bad))
    with pytest.raises(BadMetadata, match=rf"tensor 'blk.0.attn_v.weight', offset "
                                          rf"{t.data_offset + 3}: tensor data offset "
                                          rf"{rel + 3} is not a multiple of the file's "
                                          r"alignment \(32\)"):
        GgufSource(tmp_path / "m.gguf")
    assert cli_main(["convert", str(tmp_path / "m.gguf"), "-o", str(tmp_path / "o.hfq"),
                     "--no-progress"]) == 1
    assert "alignment" in capsys.readouterr().err
    assert not (tmp_path / "o.hfq").exists()


def test_read_checks_the_row_index(tmp_path):
    """Found by a review: GgufSource.read took row 300 of a 256-row tensor as an empty
    block (or a bare ValueError from a reshape for llama's Q rows), row -1 raised a bare
    ValueError, a slice step was ignored (rows 0..9, not 0, 2, .., 8), and a 1-D tensor
    came back whole whatever rows were asked for."""
    expected = make_llama(tmp_path / "m.gguf", n_layers=1)
    src = GgufSource(tmp_path / "m.gguf")
    by_name = {t.name: t for t in src.tensors}
    for name in ("model.layers.0.self_attn.q_proj.weight",    # un-permuted
                 "model.layers.0.self_attn.v_proj.weight",
                 "model.layers.0.input_layernorm.weight"):     # 1-D
        check_row_index(functools.partial(src.read, by_name[name]), name, expected[name],
                        lambda want, row: want[row:row + 1 or None])   # a one-row block


def test_a_nested_string_array_key_keeps_its_strings(tmp_path):
    """Found by a review: an array of string arrays was read as the first byte of each
    string ([97, 99, 100] for [["ab", "c"], ["def"]]) into gguf_meta; it now reads as
    the gguf package's ReaderField.contents() does (flattened strings)."""
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3")
    w.add_array("x.nested", [["ab", "c"], ["def"]])
    w.add_array("x.nested_int", [[1, 2], [3]])
    w.add_tensor("blk.0.attn_norm.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    src = GgufSource(tmp_path / "m.gguf")
    package = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert src.metadata["x.nested"] == package["x.nested"].contents() == ["ab", "c", "def"]
    assert src.metadata["x.nested_int"] == package["x.nested_int"].contents() == [1, 2, 3]
