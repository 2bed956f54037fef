"""Sidecar policies and state codecs (docs/cold.md, "Sidecar policies", "GDN-style recurrent
sidecar", "Sliding-window sidecar"): S1, S3, plus the install side and its bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagedkv.cold import (
    DEFAULT_FORMAT,
    ColdGroup,
    ColdSidecarLayout,
    ColdSidecarPolicy,
    RestoredSidecar,
    SlidingWindowCodec,
    cold_sidecar_stats,
    conv_state_codec,
    gdn_state_codec,
)
from pagedkv.cold.codec import decode_sidecar, encode_sidecar
from pagedkv.errors import InvalidArgument, InvalidArgumentType, SidecarLayoutMismatch

TAG = DEFAULT_FORMAT.tag("cold-cache-payload")


def _bf16(rng, shape):
    return rng.integers(0, 1 << 16, shape, dtype=np.uint16)


# --- S1 policies -------------------------------------------------------------------------

def test_policy_expected_at_matches_layout_at_on_every_candidate_boundary():
    codec = SlidingWindowCodec(window=1024, num_layers=3, kv_heads=2, head_dim=8)
    policy = codec.policy
    row = 2 * 8 * 2  # kv_heads * head_dim * bf16 bytes
    want = {0: 0, 16: 16, 256: 256, 512: 512, 1008: 1008, 1024: 1024, 1040: 1024,
            2048: 1024, 65536: 1024}
    for b, rows in want.items():
        assert policy.scaled_extent(b) == rows
        got = policy.expected_at(b)
        if b == 0:
            assert got is None  # an empty payload: nothing matches
            continue
        assert got.dims == (1, 2, rows, 8) and got.bytes_per_tensor == rows * row
        assert got.boundary_tokens == b and got.tensors_per_layer == 2
        assert got == codec.layout_at(b) and policy.allows(got)
    # At and above the window the scaling is the identity (objects from before scaling match).
    assert dataclasses.replace(policy.template, boundary_tokens=5000) == policy.expected_at(5000)
    assert not policy.allows(dataclasses.replace(policy.expected_at(512), dims=(1, 2, 1024, 8)))


def test_unscaled_policy_changes_only_the_boundary():
    t = ColdSidecarLayout(ColdGroup.GDN_STATE, 7, 4, 1, "bfloat16", (3, 8, 2, 4, 4), 112)
    p = ColdSidecarPolicy.unscaled(t)
    for b in (16, 32, 4096):
        assert p.expected_at(b) == dataclasses.replace(t, boundary_tokens=b)
    assert p.expected_at(0) is None and p.scaled_extent(64) is None and p.extent is None
    assert "unscaled" in repr(p) and "GDN_STATE" in repr(p)
    with pytest.raises(InvalidArgument):
        p.expected_at(-16)
    with pytest.raises(InvalidArgumentType):
        p.expected_at(16.0)


def test_boundary_scaled_policy_rejects_bad_axes():
    t = ColdSidecarLayout(ColdGroup.SLIDING_WINDOW, 64, 2, 2, "bfloat16", (1, 2, 64, 8), 2048)
    with pytest.raises(InvalidArgument):
        ColdSidecarPolicy.boundary_scaled(t, 9)
    with pytest.raises(InvalidArgument):
        ColdSidecarPolicy.boundary_scaled(t, -1)
    with pytest.raises(InvalidArgumentType):
        ColdSidecarPolicy.boundary_scaled(t, "2")
    with pytest.raises(InvalidArgument):  # 2048 bytes are not divisible by dims[1] = 3
        ColdSidecarPolicy.boundary_scaled(dataclasses.replace(t, dims=(1, 3, 64, 8)), 1)
    with pytest.raises(InvalidArgument):  # a zero dim never makes a template
        ColdSidecarLayout(ColdGroup.SLIDING_WINDOW, 64, 2, 2, "bfloat16", (1, 0, 64, 8), 2048)
    with pytest.raises(InvalidArgumentType):
        ColdSidecarPolicy.unscaled({"dims": (1,)})
    assert ColdSidecarPolicy.boundary_scaled(t, 2).extent == 64


# --- S3 GDN payload ---------------------------------------------------------------------------

def test_the_48_layer_example_costs_78_446_592_bytes():
    codec = gdn_state_codec(48, conv_kernel=4, conv_dim=10240, num_v_heads=48, v_head_dim=128,
                            k_head_dim=128)
    assert codec.bytes_per_layer == 1_634_304
    assert codec.bytes_per_checkpoint == 78_446_592
    lay = codec.layout_at(1392)
    assert lay.dims == (3, 10240, 48, 128, 128) and lay.tensors_per_layer == 1
    assert lay.group is ColdGroup.GDN_STATE and lay.dtype == "bfloat16"


def test_gdn_payload_round_trips_bit_exactly_and_layer_major():
    rng = np.random.default_rng(0)
    codec = gdn_state_codec(3, conv_kernel=4, conv_dim=8, num_v_heads=2, v_head_dim=4,
                            k_head_dim=4)
    conv, rec = _bf16(rng, (3, 3, 8)), _bf16(rng, (3, 2, 4, 4))
    lay, payload = codec.pack((conv, rec), 32)
    assert payload.shape == (3, 2 * (24 + 32)) and payload.dtype == np.uint8
    for layer in range(3):  # tensor `layer` = conv bytes then recurrent bytes of that layer
        assert payload[layer].tobytes() == conv[layer].tobytes() + rec[layer].tobytes()
    # Per-layer arrays with a batch axis of 1 (as families keep them) pack to the same bytes.
    per_layer = ([c[None] for c in conv], [r[None] for r in rec])
    assert np.array_equal(codec.pack(per_layer, 32)[1], payload)
    # Through the object codec and back.
    key = "ab" * 32
    header, body = encode_sidecar(DEFAULT_FORMAT.abi, TAG, key, "cd" * 32, lay, payload)
    fields, got = decode_sidecar(header + bytes(body), abi=DEFAULT_FORMAT.abi,
                                 checksum_tag=TAG, group="gdn_state")
    assert lay.matches(fields)
    side = RestoredSidecar(lay, got, bytes.fromhex(key))
    c2, r2 = codec.unpack(side)
    assert np.array_equal(c2, conv) and np.array_equal(r2, rec) and c2.dtype == np.uint16
    for dtype, np_dtype in (("float32", np.float32), ("float16", np.float16)):
        cdc = gdn_state_codec(2, conv_kernel=2, conv_dim=4, num_v_heads=1, v_head_dim=2,
                              k_head_dim=2, dtype=dtype)
        state = (rng.standard_normal((2, 1, 4)).astype(np_dtype),
                 rng.standard_normal((2, 1, 2, 2)).astype(np_dtype))
        lay2, pay2 = cdc.pack(state, 16)
        back = cdc.unpack(RestoredSidecar(lay2, pay2, b"k" * 32))
        assert all(np.array_equal(a, b) for a, b in zip(back, state, strict=True))


def test_gdn_capture_side_refuses_wrong_dtype_and_shape_without_writing():
    rng = np.random.default_rng(1)
    codec = gdn_state_codec(2, conv_kernel=3, conv_dim=4, num_v_heads=1, v_head_dim=2,
                            k_head_dim=2)
    conv, rec = _bf16(rng, (2, 2, 4)), _bf16(rng, (2, 1, 2, 2))
    out = np.zeros((2, codec.bytes_per_layer), np.uint8)
    bad = [(conv.astype(np.float32), rec),          # float32 offered under bf16: skipped
           (conv, rec[:, :, :1]),                   # a short recurrent state
           (conv[:1], rec),                         # a missing layer
           (conv,),                                 # a missing part
           ([conv[0]], rec)]                        # one per-layer array for two layers
    for state in bad:
        with pytest.raises(SidecarLayoutMismatch):
            codec.pack(state, 16, out=out)
        assert not out.any()
    with pytest.raises(InvalidArgument):
        codec.pack((conv, rec), 0)
    with pytest.raises(InvalidArgument):
        codec.pack((conv, rec), 16, out=np.zeros((3, 5), np.uint8))


def test_install_copies_into_family_state_and_counts_installed_only_on_success():
    rng = np.random.default_rng(2)
    codec = gdn_state_codec(2, conv_kernel=3, conv_dim=4, num_v_heads=1, v_head_dim=2,
                            k_head_dim=2)
    conv, rec = _bf16(rng, (2, 2, 4)), _bf16(rng, (2, 1, 2, 2))
    side = RestoredSidecar(*codec.pack((conv, rec), 48), b"\x01" * 32)
    before = cold_sidecar_stats().installed
    t_conv, t_rec = np.zeros_like(conv), np.zeros_like(rec)
    for targets in ((t_conv, np.zeros((2, 1, 2, 2), np.float32)),   # wrong dtype
                    (t_conv, np.zeros((2, 2, 2, 2), np.uint16)),     # wrong shape
                    (t_conv,)):                                      # missing target
        with pytest.raises(SidecarLayoutMismatch):
            codec.install(side, *targets)
        assert not t_conv.any()
    assert cold_sidecar_stats().installed == before
    codec.install(side, t_conv, t_rec)
    assert np.array_equal(t_conv, conv) and np.array_equal(t_rec, rec)
    assert cold_sidecar_stats().installed == before + 1
    # A payload short of the layout, or a sidecar of another layout (same bytes, another
    # split of the dims), is refused.
    short = RestoredSidecar(side.layout, side.payload[:, :-2], side.key)
    other = RestoredSidecar(dataclasses.replace(side.layout, dims=(2, 4, 2, 2, 1)),
                            side.payload, side.key)
    conv_only = conv_state_codec(2, conv_kernel=3, conv_dim=4)
    for bad, cdc in ((short, codec), (other, codec), (side, conv_only)):
        with pytest.raises(SidecarLayoutMismatch):
            cdc.unpack(bad)
    assert cold_sidecar_stats().installed == before + 1


def test_conv_state_codec_is_one_tensor_per_conv_layer():
    rng = np.random.default_rng(3)
    codec = conv_state_codec(4, conv_kernel=4, conv_dim=6, dtype="float16")
    state = rng.standard_normal((4, 3, 6)).astype(np.float16)
    lay, pay = codec.pack(state, 64)
    assert lay.group is ColdGroup.CONV_STATE and lay.dims == (3, 6)
    assert lay.bytes_per_tensor == 36 and pay.shape == (4, 36)
    (back,) = codec.unpack(RestoredSidecar(lay, pay, b"\x02" * 32))
    assert np.array_equal(back, state)


@pytest.mark.parametrize("kw", [{"conv_kernel": 1}, {"conv_dim": 0}, {"num_v_heads": -1},
                                {"dtype": "q8"}, {"dtype": "int8"}])
def test_gdn_codec_rejects_bad_geometry(kw):
    args = {"conv_kernel": 4, "conv_dim": 8, "num_v_heads": 2, "v_head_dim": 4,
            "k_head_dim": 4}
    args.update(kw)
    with pytest.raises(InvalidArgument):
        gdn_state_codec(2, **args)


# --- sliding-window codec -----------------------------------------------------------------------

def test_sliding_payload_is_k_then_v_per_layer_head_major():
    rng = np.random.default_rng(4)
    codec = SlidingWindowCodec(window=32, num_layers=2, kv_heads=2, head_dim=4)
    k, v = _bf16(rng, (2, 16, 2, 4)), _bf16(rng, (2, 16, 2, 4))
    lay, pay = codec.pack((k, v), 16)
    assert lay.dims == (1, 2, 16, 4) and pay.shape == (4, 2 * 16 * 4 * 2)
    for layer in range(2):
        assert pay[2 * layer].tobytes() == k[layer].transpose(1, 0, 2).tobytes()
        assert pay[2 * layer + 1].tobytes() == v[layer].transpose(1, 0, 2).tobytes()
    k2, v2 = codec.unpack(RestoredSidecar(lay, pay, b"\x03" * 32))
    assert np.array_equal(k2, k) and np.array_equal(v2, v)
    # Past the window a payload holds exactly the window.
    kw, vw = _bf16(rng, (2, 32, 2, 4)), _bf16(rng, (2, 32, 2, 4))
    assert codec.pack((kw, vw), 80)[0].dims == (1, 2, 32, 4)
    with pytest.raises(SidecarLayoutMismatch):  # rows of another boundary
        codec.pack((k, v), 80)
    with pytest.raises(SidecarLayoutMismatch):  # not bf16
        codec.pack((k.astype(np.float32), v), 16)
    with pytest.raises(InvalidArgument):  # q8 records have no element type
        SlidingWindowCodec(window=32, num_layers=2, kv_heads=2, head_dim=4, dtype="q8")


def test_sliding_float32_sidecar_records_its_dtype_and_round_trips_bit_exactly():
    rng = np.random.default_rng(5)
    codec = SlidingWindowCodec(window=32, num_layers=2, kv_heads=2, head_dim=4, dtype="float32")
    k = rng.standard_normal((2, 16, 2, 4)).astype(np.float32)
    v = rng.standard_normal((2, 16, 2, 4)).astype(np.float32)
    lay, pay = codec.pack((k, v), 16)
    assert (lay.dtype, lay.dims, lay.bytes_per_tensor) == ("float32", (1, 2, 16, 4), 512)
    assert pay.shape == (4, 512)
    assert pay[2].tobytes() == k[1].transpose(1, 0, 2).tobytes()
    k2, v2 = codec.unpack(RestoredSidecar(lay, pay, b"\x04" * 32))
    assert k2.dtype == np.float32 and k2.tobytes() == k.tobytes() and v2.tobytes() == v.tobytes()
    with pytest.raises(SidecarLayoutMismatch):  # bf16 bits under a float32 layout
        codec.pack((_bf16(rng, (2, 16, 2, 4)), v), 16)
    bf16 = SlidingWindowCodec(window=32, num_layers=2, kv_heads=2, head_dim=4)
    with pytest.raises(SidecarLayoutMismatch):  # a float32 sidecar never decodes as bf16
        bf16.unpack(RestoredSidecar(lay, pay, b"\x04" * 32))
