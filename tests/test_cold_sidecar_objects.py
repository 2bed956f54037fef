"""Sidecar objects as codec, names and quota citizens (O3, E6). Policies and state codecs:
test_cold_sidecar_codecs.py; capture and reconcile-down: test_cold_sidecar_walks.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors import safe_open

from cold_support import FP, open_tier, persist_prompt
from pagedkv.cold import (
    DEFAULT_FORMAT,
    ColdGroup,
    ColdSidecarLayout,
    SidecarJob,
    object_name,
    sidecar_key,
)
from pagedkv.cold.codec import decode_sidecar, encode_sidecar
from pagedkv.errors import FormatError, InvalidArgument

TAG = DEFAULT_FORMAT.tag("cold-cache-payload")
TOKENS = np.arange(100, 132, dtype=np.uint32)


def _layout(**kw):
    d = {"group": ColdGroup.GDN_STATE, "boundary_tokens": 16, "num_layers": 3, "tensors_per_layer": 1,
             "dtype": "bfloat16", "dims": (3, 8, 2, 4, 4), "bytes_per_tensor": 2 * (3 * 8 + 2 * 4 * 4)}
    d.update(kw)
    return ColdSidecarLayout(**d)


def _payload(layout, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (layout.tensor_count, layout.bytes_per_tensor), dtype=np.uint8)


def test_gdn_sidecar_round_trips_and_opens_with_safetensors(tmp_path):
    lay = _layout()
    pay = _payload(lay)
    key = sidecar_key(DEFAULT_FORMAT, ColdGroup.GDN_STATE, FP, TOKENS, 4, 16)
    header, body = encode_sidecar(DEFAULT_FORMAT.abi, TAG, key.hex(), FP.hex(), lay, pay)
    data = header + bytes(body)
    assert len(data) <= lay.bound
    fields, got = decode_sidecar(data, abi=DEFAULT_FORMAT.abi, checksum_tag=TAG,
                                 group="gdn_state", key_hex=key.hex(), fingerprint_hex=FP.hex(),
                                 bound=lay.bound)
    assert lay.matches(fields) and np.array_equal(got, pay)
    assert fields["dtype"] == "bfloat16" and fields["dims"] == (3, 8, 2, 4, 4)
    p = tmp_path / object_name(key, ColdGroup.GDN_STATE)
    p.write_bytes(data)
    with safe_open(str(p), "numpy") as f:
        assert f.metadata()["kind"] == "sidecar" and f.metadata()["group"] == "gdn_state"
        assert np.array_equal(f.get_tensor("layer.2.state.0"), pay[2])
    for bad in ({"group": "sliding_window"}, {"key_hex": "00" * 32},
                {"fingerprint_hex": "11" * 32}):
        kw = {"group": "gdn_state", "key_hex": key.hex(), "fingerprint_hex": FP.hex()}
        kw.update(bad)
        with pytest.raises(FormatError):
            decode_sidecar(data, abi=DEFAULT_FORMAT.abi, checksum_tag=TAG, **kw)


@pytest.mark.parametrize("bad", [{"group": ColdGroup.KV}, {"num_layers": 0},
                                 {"tensors_per_layer": 0}, {"tensors_per_layer": 17},
                                 {"dims": ()}, {"dims": (1,) * 9}, {"dims": (3, 0, 2)},
                                 {"bytes_per_tensor": 0}, {"boundary_tokens": 0}])
def test_sidecar_layout_rejects_out_of_range_geometry(bad):
    with pytest.raises(InvalidArgument):
        _layout(**bad)


def test_sidecar_load_truncated_is_corrupt_and_other_layout_is_a_plain_miss(tmp_path):
    root = tmp_path / "root"
    lay = _layout()
    key = sidecar_key(DEFAULT_FORMAT, ColdGroup.GDN_STATE, FP, TOKENS, 4, 16)
    with open_tier(root) as tier:
        assert tier.enqueue(SidecarJob(key, FP.hex(), lay, _payload(lay))) and tier.drain(5.0)
        assert tier.contains_in(key, ColdGroup.GDN_STATE)
        got = tier.load_sidecar(key, lay)
        assert got is not None and np.array_equal(got, _payload(lay))
        assert tier.stats().hits == 0  # sidecar loads never count hits
        other = _layout(boundary_tokens=32)
        assert tier.load_sidecar(key, other) is None
        s = tier.stats()
        assert (s.misses, s.corruptions) == (1, 0) and tier.contains(key)
        path = root / object_name(key, ColdGroup.GDN_STATE)
        path.write_bytes(path.read_bytes()[:-7])
        assert tier.load_sidecar(key, lay) is None
        s = tier.stats()
        assert (s.misses, s.corruptions) == (2, 1)
        assert not path.exists() and not tier.contains(key)


def _two_blocks_and_a_sidecar(root):
    """Persist 2 KV blocks and one GDN sidecar at ``root``; returns the sidecar's key."""
    lay = _layout()
    key = sidecar_key(DEFAULT_FORMAT, ColdGroup.GDN_STATE, FP, TOKENS, 4, 16)
    with open_tier(root) as tier:
        persist_prompt(tier, TOKENS[:8])  # 2 blocks
        assert tier.enqueue(SidecarJob(key, FP.hex(), lay, _payload(lay))) and tier.drain(5.0)
    return key


def test_sidecars_are_indexed_and_accounted_across_restart(tmp_path):
    root = tmp_path / "root"
    key = _two_blocks_and_a_sidecar(root)
    sizes = {n: os.path.getsize(root / n) for n in os.listdir(root)}
    assert len(sizes) == 3
    with open_tier(root) as tier:
        snap = tier.store.index.snapshot()
        assert len(snap) == 3 and tier.store.index.total_bytes == sum(sizes.values())
        assert {e.group for _, e in snap} == {ColdGroup.KV, ColdGroup.GDN_STATE}
        # The sidecar is the oldest entry: a quota squeeze may take it.
        os.utime(root / object_name(key, ColdGroup.GDN_STATE), ns=(1, 1))
    with open_tier(root, quota_bytes=sum(sizes.values())) as tier:
        persist_prompt(tier, TOKENS[16:20], seed=9)
        assert not tier.contains(key) and tier.stats().evictions >= 1


def test_offline_verify_decodes_sidecars_too(tmp_path, capsys):
    """`pagedkv cold verify` checks every indexed object (docs/contracts/cold-tier.md, '9. Loads and
    corruption'), sidecars included."""
    from pagedkv.cli import main
    root = tmp_path / "pagedkv-v1"
    key = _two_blocks_and_a_sidecar(root)
    assert main(["cold", "verify", str(tmp_path)]) == 0
    assert "verified 3 objects: 3 ok, 0 bad" in capsys.readouterr().out
    name = object_name(key, ColdGroup.GDN_STATE)
    data = bytearray((root / name).read_bytes())
    data[-1] ^= 1
    (root / name).write_bytes(bytes(data))
    assert main(["cold", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"BAD {name}: " in out and "checksum" in out
    assert "verified 3 objects: 2 ok, 1 bad" in out
