"""Hybrid reference model (docs/tiny-model.md): configuration, weights, the forward pass
against a float64 oracle, chunking invariance bit for bit, the flat KV path and snapshots."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json

import numpy as np
import pytest

from hybrid_oracle import oracle_logits
from pagedkv.errors import (
    BadMetadata,
    DuplicateLayer,
    InvalidArgument,
    InvalidArgumentType,
    MissingSharedKVAnchor,
    SharedKVAnchorIsAlias,
    SharedKVIncompatible,
)
from pagedkv.tiny_model import (
    NUMPY_MLX_LOGITS_ATOL,
    FlatKV,
    HybridConfig,
    HybridFlatKV,
    HybridSnapshot,
    ReferenceConfig,
    ReferenceModel,
    config_from_json_dict,
)
from pagedkv.tiny_model.weights import weight_shapes

W = 24                                     # the default sliding window
PROMPT = (np.arange(70) * 37 + 5) % 512    # longer than the window


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(HybridConfig())


@pytest.fixture(scope="module")
def straight(model):
    """PROMPT + 10 greedy tokens run straight through, and the flat path it leaves."""
    kv = model.new_flat_kv()
    return model.generate(PROMPT, 10, kv), kv


def same(a, b) -> bool:
    return a.tokens.tobytes() == b.tokens.tobytes() and a.logits.tobytes() == b.logits.tobytes()


def full_rows(model, kv, b):
    """K/V of positions [0, b) of every physical full layer (what the pool's blocks hold)."""
    return {layer: tuple(np.asarray(a)[:b] for a in kv.read(layer))
            for layer in model.config.physical_full_layers}


# --- configuration -----------------------------------------------------------------------


def test_default_layout_and_state_shapes():
    c = HybridConfig()
    assert c.layer_types == ("linear_attention", "sliding_attention", "full_attention",
                             "linear_attention", "sliding_attention", "full_attention")
    assert c.kv_shared_layers == ((5, 2),) and c.kv_anchor(5) == 2 and c.kv_anchor(2) is None
    assert c.physical_kv_layer(5) == 2 and c.physical_kv_layer(1) == 1
    assert c.full_attention_layers == (2, 5) and c.physical_full_layers == (2,)
    assert c.sliding_attention_layers == c.physical_sliding_layers == (1, 4)
    assert c.linear_attention_layers == (0, 3)
    assert c.conv_dim == 2 * 2 * 16 + 4 * 16 == 128
    assert c.conv_state_shape == (3, 128) and c.recurrent_state_shape == (4, 16, 16)


def test_plain_config_json_and_weights_are_unchanged():
    # The hybrid fields live on the subclass: the plain model's config.json (which the cold
    # tier fingerprints) and its seeded weights stay what they were.
    assert "layer_types" not in ReferenceConfig().to_json_dict()
    h = hashlib.sha256()
    for name, w in ReferenceModel().weights.items():
        h.update(name.encode())
        h.update(w.tobytes())
    assert h.hexdigest() == "836bf442892b16faba04a8f16595202482d3e8cd7ee61f5896696d42ba56acda"


def test_json_round_trip_gives_a_hybrid_config():
    c = HybridConfig(sliding_window=7, seed=5)
    d = json.loads(c.to_json())
    assert d["model_type"] == "pagedkv_reference"
    assert d["layer_types"][0] == "linear_attention" and d["kv_shared_layers"] == [[5, 2]]
    back = config_from_json_dict(d)
    assert type(back) is HybridConfig and back == c and hash(back) == hash(c)
    assert HybridConfig.from_json_dict(d) == c
    # Read as a plain config it would lose its layer kinds: refused, naming the reader to use.
    with pytest.raises(BadMetadata, match="layer_types .*config_from_json_dict"):
        ReferenceConfig.from_json_dict(d)
    plain = ReferenceConfig(seed=5)
    back = config_from_json_dict(json.loads(plain.to_json()))
    assert type(back) is ReferenceConfig and back == plain


@pytest.mark.parametrize(("kwargs", "error", "attrs"), [
    ({"layer_types": ("full_attention",) * 5}, InvalidArgument, {}),
    ({"layer_types": ("full_attention",) * 5 + ("mamba",)}, InvalidArgument, {}),
    ({"sliding_window": 0}, InvalidArgument, {}),
    ({"linear_conv_kernel_dim": 1}, InvalidArgument, {}),
    ({"linear_num_value_heads": 3}, InvalidArgument, {}),
    ({"kv_shared_layers": ((5, 2), (5, 2))}, DuplicateLayer, {"layer": 5}),
    ({"kv_shared_layers": ((5, 9),)}, MissingSharedKVAnchor, {"layer": 5, "anchor": 9}),
    ({"kv_shared_layers": ((5, 2), (2, 1))}, SharedKVAnchorIsAlias,
     {"layer": 5, "anchor": 2, "anchor_of_anchor": 1}),
    ({"kv_shared_layers": ((4, 2),)}, SharedKVIncompatible, {"layer": 4, "anchor": 2}),
    ({"kv_shared_layers": ((3, 0),)}, SharedKVIncompatible, {"layer": 3, "anchor": 0}),
    ({"kv_shared_layers": ((2, 5),)}, InvalidArgument, {}),
    ({"kv_shared_layers": ((6, 2),)}, InvalidArgument, {}),
])
def test_config_validation_names_the_layers(kwargs, error, attrs):
    with pytest.raises(error) as info:
        HybridConfig(**kwargs)
    for name, value in attrs.items():
        assert getattr(info.value, name) == value


def test_weights_follow_the_layer_kinds(model):
    shapes = weight_shapes(model.config)
    assert list(model.weights) == list(shapes)
    assert shapes["model.layers.0.linear_attn.conv1d.weight"] == (128, 1, 4)
    assert shapes["model.layers.0.linear_attn.in_proj_qkv.weight"] == (128, 64)
    assert shapes["model.layers.3.linear_attn.A_log"] == (4,)
    assert "model.layers.0.self_attn.q_proj.weight" not in shapes
    # The alias has its own query and output projections and no K/V projections.
    assert "model.layers.5.self_attn.q_proj.weight" in shapes
    assert "model.layers.5.self_attn.k_proj.weight" not in shapes
    assert "model.layers.2.self_attn.k_proj.weight" in shapes
    assert all(w.dtype == np.float32 for w in model.weights.values())
    again = ReferenceModel(HybridConfig()).weights
    assert all(again[k].tobytes() == w.tobytes() for k, w in model.weights.items())


def test_save_load_round_trip_and_bad_configs(tmp_path, model):
    model.save(tmp_path)
    loaded = ReferenceModel.load(tmp_path)
    assert type(loaded.config) is HybridConfig and loaded.config == model.config
    a = model.forward(PROMPT[:30], model.new_flat_kv())
    b = loaded.forward(PROMPT[:30], loaded.new_flat_kv())
    assert a.tobytes() == b.tobytes()
    cfg = json.loads((tmp_path / "config.json").read_text())
    for bad in ({"kv_shared_layers": [[5, 2], [2, 1]]}, {"layer_types": ["full_attention"]},
                {"sliding_window": -1}):
        (tmp_path / "config.json").write_text(json.dumps(dict(cfg, **bad)))
        with pytest.raises(BadMetadata, match="invalid reference config"):
            ReferenceModel.load(tmp_path)


def test_weights_load_from_an_hfqm_file(tmp_path, model):
    from pagedkv.hfqm.convert import convert_safetensors

    model.save(tmp_path)
    convert_safetensors(tmp_path, tmp_path / "q8.hfq", fmt="q8", arch="llama",
                        measure_error=False)
    loaded = ReferenceModel.load_hfqm(tmp_path / "q8.hfq")
    assert type(loaded.config) is HybridConfig and loaded.config == model.config
    for name, w in model.weights.items():   # the conv taps and A_log included
        q = loaded.weights[name]
        assert q.dtype == np.float32 and q.shape == w.shape
        assert np.abs(q - w).max() <= 5e-3 * np.abs(w).max(), name


def test_repr_names_the_layer_kinds(model):
    assert repr(model) == (
        "ReferenceModel(backend='numpy', layers=6 (2 full + 2 sliding(window=24) + 2 linear, "
        "1 kv-shared), hidden=64, heads=4/2, head_dim=16, vocab=512, seed=0)")
    assert repr(model.new_flat_kv()) == "HybridFlatKV(backend='numpy', num_tokens=0)"


# --- the forward pass --------------------------------------------------------------------


@pytest.mark.parametrize("config", [HybridConfig(), HybridConfig(seed=3, sliding_window=5)],
                         ids=["default", "window5"])
def test_forward_matches_the_float64_oracle(config):
    m = ReferenceModel(config)
    got = m.forward(PROMPT, m.new_flat_kv())
    want = oracle_logits(config, m.weights, PROMPT)
    assert np.abs(got - want).max() < 1e-4
    assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))
    # The oracle tells windows apart: one more position of context is far outside tolerance.
    wider = oracle_logits(dataclasses.replace(config, sliding_window=config.sliding_window + 1),
                          m.weights, PROMPT)
    assert np.abs(got - wider).max() > 1e-2


def test_greedy_output_is_not_degenerate(straight):
    gen, _ = straight
    assert len(set(gen.tokens.tolist())) >= 6
    assert np.array_equal(gen.tokens, gen.logits.argmax(axis=1))


def test_all_full_hybrid_is_the_plain_model_bit_for_bit():
    # Same tensor names in the same order -> same seeded weights; a full layer of the hybrid
    # forward is the plain model's layer.
    hybrid = ReferenceModel(HybridConfig(num_layers=2, layer_types=("full_attention",) * 2,
                                         kv_shared_layers=()))
    plain = ReferenceModel(ReferenceConfig())
    assert all(hybrid.weights[k].tobytes() == w.tobytes() for k, w in plain.weights.items())
    a = hybrid.generate(PROMPT, 5, hybrid.new_flat_kv())
    b = plain.generate(PROMPT, 5, plain.new_flat_kv())
    assert same(a, b)


def test_a_window_wider_than_the_sequence_is_full_attention_bit_for_bit():
    kinds = HybridConfig().layer_types
    wide = ReferenceModel(HybridConfig(sliding_window=len(PROMPT)))
    full = ReferenceModel(HybridConfig(layer_types=tuple(
        "full_attention" if k == "sliding_attention" else k for k in kinds)))
    a = wide.forward(PROMPT, wide.new_flat_kv())
    assert a.tobytes() == full.forward(PROMPT, full.new_flat_kv()).tobytes()
    narrow = ReferenceModel(HybridConfig())
    b = narrow.forward(PROMPT, narrow.new_flat_kv())
    assert b[:W].tobytes() == a[:W].tobytes()       # identical while the window covers all
    assert np.abs(b[W:] - a[W:]).max() > 1e-2       # then the window bites


@pytest.mark.parametrize("splits", [[1], [5], [23], [24], [25], [47], [69], [3, 10, 24, 50],
                                    list(range(2, 70, 9))])
def test_chunked_prefill_is_bit_identical_to_one_call(model, splits):
    whole = model.forward(PROMPT, model.new_flat_kv())
    kv = model.new_flat_kv()
    bounds = [0, *splits, len(PROMPT)]
    parts = [model.forward(PROMPT[a:b], kv) for a, b in itertools.pairwise(bounds)]
    assert np.concatenate(parts).tobytes() == whole.tobytes()


def test_token_by_token_is_bit_identical_to_one_call(model):
    whole = model.forward(PROMPT, model.new_flat_kv())
    kv = model.new_flat_kv()
    rows = [model.forward(PROMPT[i:i + 1], kv)[0] for i in range(len(PROMPT))]
    assert np.stack(rows).tobytes() == whole.tobytes()


def test_generate_resumes_from_a_prefilled_path(model, straight):
    gen, _ = straight
    kv = model.new_flat_kv()
    model.forward(PROMPT[:41], kv)
    assert same(model.generate(PROMPT, 10, kv), gen)
    assert kv.num_tokens == len(PROMPT) + 9


def test_a_plain_kv_path_is_refused_and_left_unchanged(model):
    kv = FlatKV(ReferenceConfig())
    with pytest.raises(InvalidArgumentType, match="HybridKVPath"):
        model.forward(PROMPT[:4], kv)
    assert kv.num_tokens == 0
    plain = ReferenceModel()
    hkv = model.new_flat_kv()
    with pytest.raises(InvalidArgumentType, match="KVPath"):
        plain.forward(PROMPT[:4], hkv)
    assert hkv.num_tokens == 0


# --- the flat path -----------------------------------------------------------------------


def test_layers_hold_what_their_kind_needs(model):
    kv = model.new_flat_kv()
    model.forward(PROMPT[:50], kv)
    assert kv.held_positions(2) == kv.held_positions(5) == (0, 50)  # full, and its alias
    assert kv.held_positions(1) == kv.held_positions(4) == (0, 50)  # one chunk: all of it
    model.forward(PROMPT[50:60], kv)
    assert kv.held_positions(1) == (50 - W, 60)                      # W rows + the chunk
    for t in range(60, 70):
        model.forward(PROMPT[t:t + 1], kv)
    assert kv.held_positions(4) == (69 - W, 70)                      # W + 1 rows in decode
    k, _ = kv.read(4, 70 - W)
    assert np.asarray(k).shape == (W, 2, 16)
    with pytest.raises(InvalidArgument, match="holds"):
        kv.read(4, 69 - W - 1)


def test_alias_reads_its_anchor_and_cannot_be_written(model):
    kv = model.new_flat_kv()
    model.forward(PROMPT[:10], kv)
    anchor, alias = kv.read(2), kv.read(5)
    assert np.asarray(alias[0]).tobytes() == np.asarray(anchor[0]).tobytes()
    kv.extend(PROMPT[10:12])
    rows = np.zeros((2, 2, 16), np.float32)
    for layer, match in ((5, "alias of layer 2"), (0, "linear_attention layer"),
                         (9, "outside")):
        with pytest.raises(InvalidArgument, match=match):
            kv.write(layer, rows, rows)
    assert kv.held_positions(2) == (0, 10)
    with pytest.raises(InvalidArgument, match="no recurrent state"):
        kv.linear_state(1)
    with pytest.raises(InvalidArgument, match="no recurrent state"):
        kv.set_linear_state(2, rows, rows)


def test_flat_path_needs_a_hybrid_config():
    with pytest.raises(InvalidArgumentType, match="HybridConfig"):
        HybridFlatKV(ReferenceConfig())
    with pytest.raises(InvalidArgument, match="backend"):
        HybridFlatKV(HybridConfig(), backend="cuda")


# --- snapshots ---------------------------------------------------------------------------


@pytest.mark.parametrize("b", [0, 1, 16, 23, 24, 25, 48, 69])
def test_resuming_from_a_snapshot_is_bit_identical(model, straight, b):
    gen, kv_straight = straight
    kv = model.new_flat_kv()
    if b:
        model.forward(PROMPT[:b], kv)
    snap = kv.snapshot()
    resumed = HybridFlatKV.from_snapshot(model.config, snap, full_rows(model, kv_straight, b))
    assert resumed.num_tokens == b
    assert same(model.generate(PROMPT, 10, resumed), gen)
    # The snapshot is left as it was and can serve a second resume.
    assert kv.snapshot() == snap
    again = HybridFlatKV.from_snapshot(model.config, snap, full_rows(model, kv_straight, b))
    assert same(model.generate(PROMPT, 10, again), gen)


def test_snapshot_layout(model):
    c = model.config
    b = 40
    kv = model.new_flat_kv()
    model.forward(PROMPT[:b], kv)
    snap = kv.snapshot()
    assert snap.boundary_tokens == b
    assert [a.shape for a in snap.conv_states] == [(3, 128)] * 2
    assert [a.shape for a in snap.recurrent_states] == [(4, 16, 16)] * 2
    assert [a.shape for a in snap.sliding_keys + snap.sliding_values] == [(2, W, 16)] * 4
    assert all(a.dtype == np.float32 and not a.flags.writeable and a.flags.c_contiguous
               for a in snap.conv_states + snap.sliding_keys)
    # Sliding rows are positions [b - W, b), heads-major, in physical sliding-layer order.
    for i, layer in enumerate(c.physical_sliding_layers):
        k, v = (np.asarray(a).transpose(1, 0, 2) for a in kv.read(layer, b - W))
        assert snap.sliding_keys[i].tobytes() == k.tobytes()
        assert snap.sliding_values[i].tobytes() == v.tobytes()
    # The conv state is the last K - 1 conv inputs, oldest first: layer 0's in_proj_qkv rows
    # of tokens b-3 .. b-1.
    rows_of = model._impl.rows
    w = rows_of.layers[0]
    rows = [rows_of.rms_norm(rows_of.embed[t], w["attn_norm"]) @ w["w_qkv"]
            for t in PROMPT[b - 3:b]]
    assert snap.conv_states[0].tobytes() == np.stack(rows).tobytes()
    assert np.any(snap.recurrent_states[1] != 0)
    assert snap.nbytes == 4 * (2 * (3 * 128 + 4 * 16 * 16) + 4 * 2 * W * 16) == 23_552
    assert repr(snap) == ("HybridSnapshot(boundary_tokens=40, linear_layers=2, "
                          "sliding_layers=2 x 24 rows, nbytes=23,552)")
    short = model.new_flat_kv()
    model.forward(PROMPT[:5], short)
    assert [a.shape for a in short.snapshot().sliding_keys] == [(2, 5, 16)] * 2


@pytest.mark.parametrize("part", ["conv_states", "recurrent_states", "sliding_keys"])
def test_every_part_of_the_snapshot_is_needed(model, straight, part):
    gen, kv_straight = straight
    b = 48
    kv = model.new_flat_kv()
    model.forward(PROMPT[:b], kv)
    snap = kv.snapshot()
    parts = {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap)}
    parts[part] = tuple(np.zeros_like(a) for a in parts[part])
    del parts["boundary_tokens"]
    broken = HybridSnapshot.build(model.config, b, **parts)
    assert broken != snap
    resumed = HybridFlatKV.from_snapshot(model.config, broken, full_rows(model, kv_straight, b))
    out = model.generate(PROMPT, 10, resumed)
    assert np.abs(out.logits[0] - gen.logits[0]).max() > 1e-3


def test_bad_snapshots_and_full_rows_are_refused(model, straight):
    _, kv_straight = straight
    c = model.config
    kv = model.new_flat_kv()
    model.forward(PROMPT[:30], kv)
    snap = kv.snapshot()
    full = full_rows(model, kv_straight, 30)
    parts = {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap)}
    del parts["boundary_tokens"]

    def build(b=30, **changes):
        return HybridSnapshot.build(c, b, **dict(parts, **changes))

    with pytest.raises(InvalidArgument, match=r"conv_states\[1\] \(layer 3\).*\(3, 128\)"):
        build(conv_states=(snap.conv_states[0], np.zeros((4, 128), np.float32)))
    with pytest.raises(InvalidArgumentType, match="float32"):
        build(recurrent_states=tuple(a.astype(np.float64) for a in snap.recurrent_states))
    with pytest.raises(InvalidArgument, match="1 arrays for the 2 layers"):
        build(sliding_keys=snap.sliding_keys[:1])
    with pytest.raises(InvalidArgument, match=r"\(2, 20, 16\)"):
        build(b=20)                                   # min(b, W) rows: 20, not 24
    with pytest.raises(InvalidArgument, match="max_position"):
        build(b=-1)
    with pytest.raises(InvalidArgumentType, match="int"):
        build(b=30.0)
    other = HybridConfig(linear_conv_kernel_dim=3)
    with pytest.raises(InvalidArgument, match=r"\(2, 128\)"):
        HybridFlatKV.from_snapshot(other, snap, full)
    with pytest.raises(InvalidArgument, match="physical full layers"):
        HybridFlatKV.from_snapshot(c, snap, {})
    with pytest.raises(InvalidArgument, match="physical full layers"):
        HybridFlatKV.from_snapshot(c, snap, {**full, 5: full[2]})
    with pytest.raises(InvalidArgument, match=r"full_kv\[2\] K"):
        HybridFlatKV.from_snapshot(c, snap, {2: (full[2][0][:29], full[2][1])})
    with pytest.raises(InvalidArgumentType, match="HybridSnapshot"):
        HybridFlatKV.from_snapshot(c, object(), full)  # type: ignore[arg-type]
    # Nothing above touched the snapshot or the path it came from.
    assert kv.snapshot() == snap and kv.num_tokens == 30


def test_snapshot_between_layers_of_one_call_is_refused(model):
    kv = model.new_flat_kv()
    model.forward(PROMPT[:8], kv)
    kv.extend(PROMPT[8:10])          # reserved, not computed
    with pytest.raises(InvalidArgument, match="between forward calls"):
        kv.snapshot()


# --- MLX ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_model(model):
    pytest.importorskip("mlx.core")
    return ReferenceModel(model.config, model.weights, backend="mlx")


def test_mlx_chunking_and_token_by_token_are_bit_identical(mlx_model):
    p = PROMPT[:40]
    whole = mlx_model.forward(p, mlx_model.new_flat_kv())
    kv = mlx_model.new_flat_kv()
    parts = [mlx_model.forward(p[a:b], kv) for a, b in ((0, 7), (7, 24), (24, 25), (25, 40))]
    assert np.concatenate(parts).tobytes() == whole.tobytes()
    kv = mlx_model.new_flat_kv()
    rows = [mlx_model.forward(p[i:i + 1], kv)[0] for i in range(len(p))]
    assert np.stack(rows).tobytes() == whole.tobytes()


def test_mlx_resumes_from_a_snapshot_bit_identically(mlx_model):
    p = PROMPT[:50]
    kv_straight = mlx_model.new_flat_kv()
    gen = mlx_model.generate(p, 4, kv_straight)
    kv = mlx_model.new_flat_kv()
    mlx_model.forward(p[:32], kv)
    snap = kv.snapshot()
    resumed = HybridFlatKV.from_snapshot(mlx_model.config, snap,
                                         full_rows(mlx_model, kv_straight, 32), backend="mlx")
    assert same(mlx_model.generate(p, 4, resumed), gen)


def test_numpy_and_mlx_agree_within_tolerance(model, mlx_model, straight):
    gen, _ = straight
    out = mlx_model.generate(PROMPT, 10, mlx_model.new_flat_kv())
    assert np.abs(out.logits - gen.logits).max() <= NUMPY_MLX_LOGITS_ATOL
    assert out.tokens.tolist() == gen.tokens.tolist()


def test_gated_delta_net_matches_mlx_lm(model):
    """The recurrent layer is mlx-lm's Qwen3.5 GatedDeltaNet (weights loaded as mlx-lm's
    sanitize would), up to float32 rounding: outputs and both states."""
    mx = pytest.importorskip("mlx.core")
    qwen3_5 = pytest.importorskip("mlx_lm.models.qwen3_5")
    from mlx_lm.models.cache import ArraysCache

    from pagedkv.tiny_model.gated_delta import gated_delta_token
    from pagedkv.tiny_model.weights import layer_operands

    c = model.config
    args = qwen3_5.TextModelArgs(
        hidden_size=c.hidden_size, rms_norm_eps=c.rms_norm_eps,
        linear_num_value_heads=c.linear_num_value_heads,
        linear_num_key_heads=c.linear_num_key_heads,
        linear_key_head_dim=c.linear_key_head_dim,
        linear_value_head_dim=c.linear_value_head_dim,
        linear_conv_kernel_dim=c.linear_conv_kernel_dim)
    gdn = qwen3_5.GatedDeltaNet(args)
    p = "model.layers.0.linear_attn."
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "norm"):
        getattr(gdn, name).weight = mx.array(model.weights[p + name + ".weight"])
    gdn.conv1d.weight = mx.array(np.moveaxis(model.weights[p + "conv1d.weight"], 2, 1))
    gdn.dt_bias = mx.array(model.weights[p + "dt_bias"])
    gdn.A_log = mx.array(model.weights[p + "A_log"])
    h = np.random.default_rng(0).standard_normal((40, c.hidden_size)).astype(np.float32)
    cache = ArraysCache(size=2)
    want = np.concatenate([np.array(gdn(mx.array(h[None, a:b]), cache=cache)[0])
                           for a, b in ((0, 25), (25, 40))])
    w = layer_operands(model.weights, 0)
    conv = np.zeros(c.conv_state_shape, np.float32)
    state = np.zeros(c.recurrent_state_shape, np.float32)
    got = []
    for row in h:
        out, conv, state = gated_delta_token(row, w, conv, state, (2, 4, 16, 16),
                                             c.rms_norm_eps, np)
        got.append(out)
    assert np.abs(np.stack(got) - want).max() < 1e-4
    assert np.abs(conv - np.array(cache[0][0])).max() < 1e-5
    assert np.abs(state - np.array(cache[1][0])).max() < 1e-5
