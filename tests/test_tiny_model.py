"""Reference transformer: determinism, chunking independence, persistence, NumPy vs MLX."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from pagedkv.errors import (
    BadMetadata,
    FormatError,
    InvalidArgument,
    InvalidArgumentType,
    SizeMismatch,
)
from pagedkv.tiny_model import (
    MODEL_TYPE,
    NUMPY_MLX_LOGITS_ATOL,
    FlatKV,
    ReferenceConfig,
    ReferenceModel,
)
from pagedkv.tiny_model.weights import weight_shapes

PROMPT = (np.arange(40) * 37 + 5) % 512


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel()


def test_import_pagedkv_reference_does_not_import_mlx():
    import subprocess
    code = ("import sys, pagedkv, pagedkv.tiny_model; "
            "from pagedkv.tiny_model import ReferenceModel; ReferenceModel(); "
            "print('mlx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_weights_are_seeded_and_seed_changes_them():
    a = ReferenceModel(ReferenceConfig(seed=3)).weights
    b = ReferenceModel(ReferenceConfig(seed=3)).weights
    c = ReferenceModel(ReferenceConfig(seed=4)).weights
    assert list(a) == list(weight_shapes(ReferenceConfig()))
    for name in a:
        assert a[name].dtype == np.float32
        assert a[name].tobytes() == b[name].tobytes()
    assert a["model.embed_tokens.weight"].tobytes() != c["model.embed_tokens.weight"].tobytes()


def test_greedy_output_is_not_degenerate(model):
    gen = model.generate(PROMPT, 12, model.new_flat_kv())
    assert gen.tokens.dtype == np.int64 and gen.tokens.shape == (12,)
    assert len(set(gen.tokens.tolist())) >= 4
    assert np.array_equal(gen.tokens, gen.logits.argmax(axis=1))


@pytest.mark.parametrize("split", [1, 7, 16, 39])
def test_prefill_in_chunks_is_bit_identical_to_one_chunk(model, split):
    whole = model.forward(PROMPT, model.new_flat_kv())
    kv = model.new_flat_kv()
    first = model.forward(PROMPT[:split], kv)
    rest = model.forward(PROMPT[split:], kv)
    assert np.concatenate([first, rest]).tobytes() == whole.tobytes()


def test_token_by_token_equals_one_chunk(model):
    whole = model.forward(PROMPT[:20], model.new_flat_kv())
    kv = model.new_flat_kv()
    rows = [model.forward(PROMPT[i:i + 1], kv)[0] for i in range(20)]
    assert np.stack(rows).tobytes() == whole.tobytes()


def test_generate_resumes_from_a_prefilled_kv(model):
    fresh = model.generate(PROMPT, 6, model.new_flat_kv())
    kv = model.new_flat_kv()
    model.forward(PROMPT[:25], kv)
    resumed = model.generate(PROMPT, 6, kv)
    assert resumed.tokens.tolist() == fresh.tokens.tolist()
    assert resumed.logits.tobytes() == fresh.logits.tobytes()
    assert kv.num_tokens == len(PROMPT) + 5


def test_save_load_round_trip(tmp_path, model):
    model.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == MODEL_TYPE == "pagedkv_reference"
    assert cfg["num_kv_heads"] == 2 and cfg["dtype"] == "float32"
    loaded = ReferenceModel.load(tmp_path)
    assert loaded.config == model.config
    a = model.generate(PROMPT, 4, model.new_flat_kv())
    b = loaded.generate(PROMPT, 4, loaded.new_flat_kv())
    assert a.logits.tobytes() == b.logits.tobytes()


def test_load_rejects_other_model_types_and_bad_tensors(tmp_path, model):
    model.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    with pytest.raises(BadMetadata, match="'llama'"):
        ReferenceModel.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, hidden_size=32)))
    with pytest.raises(SizeMismatch, match="embed_tokens"):
        ReferenceModel.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(FormatError):
        ReferenceModel.load(tmp_path)


@pytest.mark.parametrize("kwargs", [{"num_heads": 3}, {"head_dim": 7}, {"num_layers": 0},
                                    {"num_layers": True}, {"vocab_size": True},
                                    {"seed": False}, {"rope_theta": True}])
def test_config_validation(kwargs):
    with pytest.raises(InvalidArgument):
        ReferenceConfig(**kwargs)
    # a config.json with the same value (JSON true/false used to load as 1/0)
    with pytest.raises(BadMetadata, match="invalid reference config"):
        ReferenceConfig.from_json_dict({"model_type": MODEL_TYPE, **kwargs})


def test_bad_tokens_are_rejected_before_kv_changes(model):
    kv = model.new_flat_kv()
    for bad in ([512], [-1], [], [[1, 2]]):
        with pytest.raises(InvalidArgument):
            model.forward(np.asarray(bad), kv)
    with pytest.raises(InvalidArgumentType):
        model.forward(np.asarray([1.5]), kv)
    assert kv.num_tokens == 0
    with pytest.raises(InvalidArgument, match="max_tokens=len"):
        model.forward(PROMPT, kv)
        model.generate(PROMPT, 3, kv)


@pytest.mark.parametrize("count, error", [(2.5, InvalidArgumentType), (True, InvalidArgumentType),
                                          (None, InvalidArgumentType), ("3", InvalidArgumentType),
                                          (0, InvalidArgument), (-1, InvalidArgument)])
def test_generate_refuses_a_bad_count_before_kv_changes(model, count, error):
    # A float/bool/None count used to fail (TypeError) only after the prompt was recorded.
    kv = model.new_flat_kv()
    model.forward(PROMPT[:5], kv)
    with pytest.raises(error, match="max_new_tokens"):
        model.generate(PROMPT, count, kv)
    assert kv.num_tokens == 5
    assert model.generate(PROMPT, np.int64(2), kv).tokens.shape == (2,)


def test_generate_refuses_a_0d_prompt(model):
    with pytest.raises(InvalidArgument, match="1-D"):
        model.generate(np.array(5), 2, model.new_flat_kv())


def test_constructor_checks_the_config_and_weights(model):
    # A dict config used to fail with AttributeError, a missing tensor with KeyError and a
    # wrong-shaped one only somewhere inside the first forward.
    with pytest.raises(InvalidArgumentType, match="ReferenceConfig"):
        ReferenceModel({"vocab_size": 5})
    with pytest.raises(InvalidArgumentType, match="dict"):
        ReferenceModel(model.config, [])
    with pytest.raises(FormatError, match="embed_tokens"):
        ReferenceModel(model.config, {})
    name = "model.layers.0.self_attn.q_proj.weight"
    for bad in (model.weights[name][:-1], model.weights[name].astype(np.float64),
                model.weights[name].tolist()):
        with pytest.raises(SizeMismatch, match="q_proj"):
            ReferenceModel(model.config, {**model.weights, name: bad})


def test_numpy_and_mlx_agree_within_tolerance(model):
    pytest.importorskip("mlx.core")
    mlx_model = ReferenceModel(model.config, model.weights, backend="mlx")
    a = model.generate(PROMPT, 8, model.new_flat_kv())
    b = mlx_model.generate(PROMPT, 8, FlatKV(model.config, "mlx"))
    assert np.abs(a.logits - b.logits).max() <= NUMPY_MLX_LOGITS_ATOL
    assert a.tokens.tolist() == b.tokens.tolist()


def test_mlx_chunked_prefill_is_bit_identical():
    pytest.importorskip("mlx.core")
    m = ReferenceModel(backend="mlx")
    whole = m.forward(PROMPT, m.new_flat_kv())
    kv = m.new_flat_kv()
    parts = np.concatenate([m.forward(PROMPT[:11], kv), m.forward(PROMPT[11:], kv)])
    assert parts.tobytes() == whole.tobytes()


def test_weights_load_from_an_hfqm_file_and_keep_parity(tmp_path, model):
    from pagedkv.hfqm.convert import convert_safetensors
    from pagedkv.tiny_model import PagedKV
    from pagedkv.tiny_model.serving import build_paged_adapter

    model.save(tmp_path)
    out = tmp_path / "model.q8.hfq"
    convert_safetensors(tmp_path, out, fmt="q8", arch="llama", measure_error=False)
    loaded = ReferenceModel.load_hfqm(out)
    assert loaded.config == model.config
    for name, w in model.weights.items():
        q = loaded.weights[name]
        assert q.dtype == np.float32 and q.shape == w.shape
        # Q8 (matrices) and F16 (norms) keep every weight within 0.5% of the tensor's max.
        assert np.abs(q - w).max() <= 5e-3 * np.abs(w).max(), name
    flat = loaded.generate(PROMPT, 6, loaded.new_flat_kv())
    adapter = build_paged_adapter(loaded, num_blocks=8, hash_seed=0)
    adapter.reset_for_new_request("s")
    adapter.find_cached_prefix("s", PROMPT)
    adapter.allocate_suffix_blocks("s", len(PROMPT))
    paged = loaded.generate(PROMPT, 6, PagedKV(adapter, "s"))
    assert paged.logits.tobytes() == flat.logits.tobytes()
    (tmp_path / "config.json").write_text(
        (tmp_path / "config.json").read_text().replace("pagedkv_reference", "llama"))
    other = tmp_path / "llama.hfq"
    convert_safetensors(tmp_path, other, fmt="q8", measure_error=False)
    with pytest.raises(BadMetadata, match="'llama'"):
        ReferenceModel.load_hfqm(other)
