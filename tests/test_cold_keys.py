"""Cold keys, fingerprints, names and the family allowlist (docs/contracts/cold-tier.md, '2.
Enablement' to '5. Directory layout'; K1–K6)."""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
import pytest

from pagedkv.cold import (
    COLD_RESTORE_FAMILIES,
    DEFAULT_FORMAT,
    UPSTREAM_KEY_FORMAT,
    ColdFormat,
    ColdGroup,
    FamilyColdProfile,
    OutOfPoolState,
    WeightProvenance,
    cold_fingerprint,
    cold_key_chain,
    cold_restore_supported,
    model_fingerprint,
    parse_object_name,
    resolve_persist,
    sidecar_key,
)
from pagedkv.cold.codec import checksum_of_named
from pagedkv.cold.profiles import builtin_profiles
from pagedkv.errors import InvalidArgument, InvalidArgumentType

MLX, PKV = UPSTREAM_KEY_FORMAT, DEFAULT_FORMAT
RECONCILE_TOKENS = [700 + 3 * i for i in range(64)]


def _first_row(fmt, group=ColdGroup.KV, **kw):
    fp = cold_fingerprint(fmt, [b"model", b"tokenizer"])
    return cold_key_chain(fmt, group, fp, [1, 2, 3, 4], 4, **kw)[0].hex()


# K1 --------------------------------------------------------------------------------------

def test_upstream_goldens_reproduce_exactly():
    assert _first_row(MLX) == "150ac769fca99a77c26a4b3776143c1912d837c90fad2889719e83ef7896a6d7"
    fp = cold_fingerprint(MLX, [b"qwen3-reconcile-down"])
    chain = cold_key_chain(MLX, ColdGroup.KV, fp, RECONCILE_TOKENS, 8)
    assert len(chain) == 8
    assert chain[0].hex() == "9c0f9450e1009988c9d57755602a22748e3dac5db7e699ace16d771485ef31e2"
    assert chain[7].hex() == "328dd15556c4bfb1769c44531356803bfdad94bf2b0d121ce8ebf9aabc809802"


DERIVED = [  # (what, mlx-node:, pagedkv:)
    ("fp", "cd5c8fbc60c9cb844bdc3b7d1b161f8326b515cdcb46cfd8e4424840f39d3768",
     "0378bb86a257c0c96fe0fe05c853ab580d975ca4bcf7c8ac59a63ec0d69378da"),
    ("kv", "150ac769fca99a77c26a4b3776143c1912d837c90fad2889719e83ef7896a6d7",
     "e287f11b51ca361e680df1338738eec0d13a109df7c615165441d0647bd758e4"),
    ("gdn", "a8669c43620d41d539355e03aeb397fb170c0610a818a1b54d8c43bf21156385",
     "64227243933841a959a36a9066ba25cdbaf4060484215d1a585a25a7f840b8b2"),
    ("sliding", "861f2adf34cb792f32228ffa851566b243f631939bd05516846003c5b4ea1f3c",
     "2998e8bcd7255d84142a9cb73285d0859b65a9858ea24ef0f5950c07b982d3e2"),
    ("salt42", "d7e89a83235bdf9063bca7b8896420cfbb35eb8459b4c017e63f9e4ef80fd39b",
     "71e0022b4223ceb93a8f750d671ac1a0d4884e5528989f816244755c3c8517c6"),
    ("keys79", "eca21dd1ead47403da47ecf285beaa048b8097c81912d7ad3701a85cca0a4100",
     "1c5a83e70a9365ecd1feaa81ddd7a135615ae3653d6b1724aac922e0aced446d"),
    ("fp_reconcile", "f87b2297b5c9778d5cd699e0be4497589db06ee658db62dd7a2cbdf33c391836",
     "58dffff5fe9f74247953b853ed22c73cd2442b9c073faab0b402c04f41783389"),
    ("chain0", "9c0f9450e1009988c9d57755602a22748e3dac5db7e699ace16d771485ef31e2",
     "434ac3cb2d0479abe04a2a3dd639542a5d9efbc6df310e11883544a41a0c285e"),
    ("chain7", "328dd15556c4bfb1769c44531356803bfdad94bf2b0d121ce8ebf9aabc809802",
     "d731fcd45e9ebb5062becde36156ad4f78e39cceaed69886725490b9c0aaf5c2"),
    ("gdn_boundary32", "da44cf19fc92ad6058bb0c471c73e28c49b2d504db36aa0304e373fb3a978db6",
     "fb36d7ec3622bfc0d92709579b00e082ee0a9b9c154d2810624acf037c4c6a2f"),
]


def _derived(fmt, what):
    fp_r = cold_fingerprint(fmt, [b"qwen3-reconcile-down"])
    return {
        "fp": lambda: cold_fingerprint(fmt, [b"model", b"tokenizer"]).hex(),
        "kv": lambda: _first_row(fmt),
        "gdn": lambda: _first_row(fmt, ColdGroup.GDN_STATE),
        "sliding": lambda: _first_row(fmt, ColdGroup.SLIDING_WINDOW),
        "salt42": lambda: _first_row(fmt, cache_salt=42),
        "keys79": lambda: _first_row(fmt, extra_keys=(7, 9)),
        "fp_reconcile": lambda: fp_r.hex(),
        "chain0": lambda: cold_key_chain(fmt, ColdGroup.KV, fp_r, RECONCILE_TOKENS, 8)[0].hex(),
        "chain7": lambda: cold_key_chain(fmt, ColdGroup.KV, fp_r, RECONCILE_TOKENS, 8)[7].hex(),
        "gdn_boundary32": lambda: sidecar_key(fmt, ColdGroup.GDN_STATE, fp_r, RECONCILE_TOKENS,
                                              8, 32).hex(),
    }[what]()


@pytest.mark.parametrize("what,mlx,pkv", DERIVED, ids=[d[0] for d in DERIVED])
def test_derived_rows_reproduce_in_both_namespaces(what, mlx, pkv):
    assert _derived(MLX, what) == mlx
    assert _derived(PKV, what) == pkv


def test_payload_checksum_vector():
    tensors = [("tokens", np.array([1, 2, 3, 4], "<u4")), ("layer.0.key", bytes([1, 2, 3, 4])),
               ("layer.0.value", bytes([5, 6, 7, 8])), ("layer.1.key", bytes([9, 10, 11, 12])),
               ("layer.1.value", bytes([13, 14, 15, 16]))]
    assert checksum_of_named(MLX.tag("cold-cache-payload"), tensors) == \
        "2fb64cd3e91c2babafdb6ccbcc54451a287aff1909e258237046d81c5d656a64"
    assert checksum_of_named(PKV.tag("cold-cache-payload"), tensors) == \
        "894f2005be62d78f64e5b8e8f0b8b5c5aaa120948fa459b18b1011dc9dff5580"


# K2 --------------------------------------------------------------------------------------

def test_groups_never_collide_and_inputs_matter():
    keys = {_first_row(PKV, g) for g in (ColdGroup.KV, ColdGroup.GDN_STATE,
                                         ColdGroup.SLIDING_WINDOW)}
    assert len(keys) == 3
    fp = bytearray(cold_fingerprint(PKV, [b"model", b"tokenizer"]))
    base = cold_key_chain(PKV, ColdGroup.KV, bytes(fp), range(8), 4)
    fp[5] ^= 1
    assert cold_key_chain(PKV, ColdGroup.KV, bytes(fp), range(8), 4)[0] != base[0]
    # A different block 0 gives block 1 another parent key, hence another key.
    other = cold_key_chain(PKV, ColdGroup.KV, cold_fingerprint(PKV, [b"model", b"tokenizer"]),
                           [9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert other[1] != base[1]


def test_salt_enters_block_zero_only():
    fp = cold_fingerprint(PKV, [b"x"])
    toks = list(range(16))
    a = cold_key_chain(PKV, ColdGroup.KV, fp, toks, 4, cache_salt=0)
    b = cold_key_chain(PKV, ColdGroup.KV, fp, toks, 4, cache_salt=2**64 - 1)
    assert a[0] != b[0]
    # At index 3 the salt field is 0 for both; only the parent chain differs, so compare
    # the field itself: the key at index 3 computed with parent a[2] ignores the salt.
    import hashlib
    import struct
    def key3(parent):
        h = hashlib.sha256(PKV.tag("cold-prefix-block") + fp + parent + struct.pack("<Q", 3)
                           + struct.pack("<Q", 4) + np.array(toks[12:16], "<u4").tobytes()
                           + struct.pack("<Q", 0) + struct.pack("<Q", 0))
        return h.digest()
    assert key3(a[2]) == a[3] and key3(b[2]) == b[3]


def test_per_block_extra_keys_stop_the_chain_and_bad_input_raises():
    fp = cold_fingerprint(PKV, [b"x"])
    assert len(cold_key_chain(PKV, ColdGroup.KV, fp, range(16), 4,
                              extra_keys_per_block=[(), ()])) == 2
    assert cold_key_chain(PKV, ColdGroup.KV, fp, range(16), 4, extra_keys_per_block=[()] * 4) \
        == cold_key_chain(PKV, ColdGroup.KV, fp, range(16), 4)
    with pytest.raises(InvalidArgument):
        cold_key_chain(PKV, ColdGroup.KV, fp, range(16), 4, extra_keys=(1,),
                       extra_keys_per_block=[()])
    with pytest.raises(InvalidArgumentType, match="salt_domain_id"):
        cold_key_chain(PKV, ColdGroup.KV, fp, range(16), 4, cache_salt="tenant")
    with pytest.raises(InvalidArgumentType):
        cold_key_chain(PKV, ColdGroup.KV, fp, [1.5, 2.0, 3.0, 4.0], 4)
    with pytest.raises(InvalidArgument):
        cold_key_chain(PKV, ColdGroup.KV, fp, [-1, 2, 3, 4], 4)
    with pytest.raises(InvalidArgument):
        cold_key_chain(PKV, ColdGroup.KV, fp[:31], range(4), 4)
    with pytest.raises(InvalidArgument):
        ColdFormat("bad\0ns")
    # counts are ints: a float block size was truncated, a zero one divided by zero
    for kwargs, error in (({"block_size": 0}, InvalidArgument),
                          ({"block_size": 4.9}, InvalidArgumentType),
                          ({"block_size": None}, InvalidArgumentType),
                          ({"block_size": 4, "max_blocks": "x"}, InvalidArgumentType),
                          ({"block_size": 4, "max_blocks": -1}, InvalidArgument)):
        with pytest.raises(error, match="block_size|max_blocks"):
            cold_key_chain(PKV, ColdGroup.KV, fp, range(16), **kwargs)
    with pytest.raises(InvalidArgument, match="block_size = 0 must be >= 1"):
        sidecar_key(PKV, ColdGroup.GDN_STATE, fp, range(16), 0, 8)
    with pytest.raises(InvalidArgumentType, match="boundary_tokens must be an int"):
        sidecar_key(PKV, ColdGroup.GDN_STATE, fp, range(16), 4, 8.0)


# K3 --------------------------------------------------------------------------------------

def test_names_parse_only_canonical_objects():
    h = "ab" * 32
    assert parse_object_name(f"{h}.safetensors") == (bytes.fromhex(h), ColdGroup.KV)
    assert parse_object_name(f"{h}.gdn_state.safetensors") == (bytes.fromhex(h),
                                                               ColdGroup.GDN_STATE)
    for bad in (f"{h}.kv.safetensors", f"{h}.bogus.safetensors", f"{h}.safetensors.tmp",
                f"{'g' * 64}.safetensors", f"{h[:-1]}.safetensors", f"{h.upper()}.safetensors"):
        assert parse_object_name(bad) is None, bad


# K4 / K5 ---------------------------------------------------------------------------------

class Profile:
    family = "pagedkv_reference"
    sidecar_descriptor = ""


GEOM = type("G", (), {"block_size": 4, "num_layers": 2, "num_kv_heads": 1, "head_dim": 8,
                          "dtype": "float16", "layout": "nhd"})()


def _model(tmp_path, shards=(("model.safetensors", b"\x01" * 4096),)):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text('{"model_type": "pagedkv_reference"}')
    for name, data in shards:
        (d / name).write_bytes(data)
    return d


def test_fingerprint_full_digest_tracks_weight_bytes(tmp_path):
    d = _model(tmp_path)
    a = model_fingerprint(PKV, str(d), Profile, GEOM)
    assert a == model_fingerprint(PKV, str(d), Profile, GEOM) and len(a) == 32
    data = bytearray((d / "model.safetensors").read_bytes())
    data[2048] ^= 1
    st = os.stat(d / "model.safetensors")
    (d / "model.safetensors").write_bytes(bytes(data))
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_fingerprint(PKV, str(d), Profile, GEOM) != a
    other_geom = type("G", (), dict(vars(type(GEOM)), dtype="bfloat16"))()
    assert model_fingerprint(PKV, str(d), Profile, other_geom) != \
        model_fingerprint(PKV, str(d), Profile, GEOM)
    assert model_fingerprint(UPSTREAM_KEY_FORMAT, str(d), Profile, GEOM) != \
        model_fingerprint(PKV, str(d), Profile, GEOM)


def _manifest(d, **over):
    m = {"repo": "org/model", "revision": "a" * 40, "files": ["model.safetensors"],
         "completed_at": "2026-01-01"}
    m.update(over)
    (d / ".pagedkv-download-complete.json").write_text(json.dumps(m))


def test_manifest_path_reads_no_weight_bytes(tmp_path, monkeypatch):
    d = _model(tmp_path)
    _manifest(d)
    import pagedkv.cold.fingerprint as fpmod
    def no_read(*a, **k):
        raise AssertionError("weight bytes were read")
    monkeypatch.setattr(fpmod, "_shard_digest", no_read)
    a = model_fingerprint(PKV, str(d), Profile, GEOM)
    _manifest(d, completed_at="2027-05-05")
    assert model_fingerprint(PKV, str(d), Profile, GEOM) == a
    _manifest(d, revision="b" * 40)
    assert model_fingerprint(PKV, str(d), Profile, GEOM) != a
    _manifest(d)
    os.utime(d / "model.safetensors", ns=(1, 12345))
    assert model_fingerprint(PKV, str(d), Profile, GEOM) != a
    prov = WeightProvenance("org/model", "c" * 40, ["model.safetensors"])
    assert model_fingerprint(PKV, str(d), Profile, GEOM, provenance=prov) != a


@pytest.mark.parametrize("bad", [{"revision": "main"}, {"files": []},
                                 {"files": ["sub/model.safetensors"]}])
def test_invalid_manifest_falls_back_to_full_digest(tmp_path, bad):
    d = _model(tmp_path)
    _manifest(d, **bad)
    import pagedkv.cold.fingerprint as fpmod
    ident = fpmod.weight_identity(PKV, str(d))
    assert ident.startswith(b"cold-identity:full-digest:v1\0")
    assert b"download-marker\0org/model\0" in ident


def test_no_weights_means_no_fingerprint(tmp_path, caplog):
    d = _model(tmp_path, shards=())
    with caplog.at_level(logging.WARNING, "pagedkv.cold"):
        assert model_fingerprint(PKV, str(d), Profile, GEOM) is None
    (d / "model.safetensors").write_bytes(b"")
    assert model_fingerprint(PKV, str(d), Profile, GEOM) is None
    (d / "model.safetensors").write_bytes(b"x")
    if os.geteuid() != 0:
        os.chmod(d / "model.safetensors", 0)
        assert model_fingerprint(PKV, str(d), Profile, GEOM) is None
        os.chmod(d / "model.safetensors", 0o600)


def test_digest_cache_avoids_rereading(tmp_path, monkeypatch):
    import pagedkv.cold.fingerprint as fpmod
    from pagedkv.cold import WeightDigestCache
    from pagedkv.cold.root import open_managed_root
    d = _model(tmp_path)
    fd = open_managed_root(str(tmp_path / "root"), None)
    try:
        cache = WeightDigestCache(fd)
        a = model_fingerprint(PKV, str(d), Profile, GEOM, digest_cache=cache)
        monkeypatch.setattr(fpmod, "_shard_digest",
                            lambda *a, **k: (_ for _ in ()).throw(AssertionError("reread")))
        assert model_fingerprint(PKV, str(d), Profile, GEOM,
                                 digest_cache=WeightDigestCache(fd)) == a
        assert (tmp_path / "root" / "weight-digests.json").is_file()
    finally:
        os.close(fd)


def test_digest_cache_misses_weights_rewritten_in_place_with_mtime_put_back(tmp_path):
    """Same inode, same size, mtime restored (`cp -p`, `rsync --inplace -t`): the cache
    keyed on (dev, inode, size, mtime) gave the old weights' fingerprint, and with it every
    cold object of the old weights (found by a review)."""
    from pagedkv.cold import WeightDigestCache
    from pagedkv.cold.root import open_managed_root
    d = _model(tmp_path)
    w = next(d.glob("*.safetensors"))
    fd = open_managed_root(str(tmp_path / "root"), None)
    try:
        old = model_fingerprint(PKV, str(d), Profile, GEOM, digest_cache=WeightDigestCache(fd))
        st = os.stat(w)
        data = bytearray(w.read_bytes())
        data[-1] ^= 0xFF
        time.sleep(0.01)  # a coarse ctime clock still moves
        with open(w, "r+b") as f:
            f.write(data)
        os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
        st2 = os.stat(w)
        assert (st2.st_ino, st2.st_size, st2.st_mtime_ns) == (st.st_ino, st.st_size,
                                                              st.st_mtime_ns)
        new = model_fingerprint(PKV, str(d), Profile, GEOM, digest_cache=WeightDigestCache(fd))
        assert new == model_fingerprint(PKV, str(d), Profile, GEOM) != old
    finally:
        os.close(fd)


# K6 --------------------------------------------------------------------------------------

def test_allowlist_admits_only_gated_families(monkeypatch):
    assert COLD_RESTORE_FAMILIES == frozenset(p.family for p in builtin_profiles()
                                              if cold_restore_supported(p))
    assert COLD_RESTORE_FAMILIES == frozenset({"pagedkv_reference", "pagedkv_reference_hybrid"})
    monkeypatch.setenv("PAGEDKV_PERSIST_PAGED_CACHE", "1")
    in_process = FamilyColdProfile("nemotron_h", OutOfPoolState.IN_PROCESS_ONLY,
                                   restore_admitted=True)
    not_admitted = FamilyColdProfile("qwen3", OutOfPoolState.NONE, restore_admitted=False)
    for p in (in_process, not_admitted, None):
        assert not cold_restore_supported(p)
        assert resolve_persist(p, config_value=True) is False
    ref = builtin_profiles()[0]
    assert resolve_persist(ref) is True
    monkeypatch.setenv("PAGEDKV_PERSIST_PAGED_CACHE", "off")
    assert resolve_persist(ref, config_value=True) is False
    monkeypatch.setenv("PAGEDKV_PERSIST_PAGED_CACHE", "maybe")
    assert resolve_persist(ref, config_value=True) is True
    monkeypatch.delenv("PAGEDKV_PERSIST_PAGED_CACHE")
    assert resolve_persist(ref) is False
    with pytest.raises(InvalidArgument):
        FamilyColdProfile("x", OutOfPoolState.SIDECAR, restore_admitted=True)


def test_hfqm_weight_identity_uses_the_quantization_hash(tmp_path):
    from pagedkv.hfqm import HfqmWriter
    d = _model(tmp_path, shards=())
    meta = {"architecture": "pagedkv_reference"}
    for name, add_hash in (("a.hfq", True), ("b.hfq", False)):
        with HfqmWriter(d / name, arch_id=0, metadata=meta,
                        add_quantization_hash=add_hash) as w:
            w.add("a.norm", "f16", [4], np.array([1, 2, 3, 4], dtype=np.float16))
    import pagedkv.cold.fingerprint as fpmod
    ident = fpmod.hfqm_weight_identity(PKV, str(d / "a.hfq"))
    from pagedkv.hfqm import compute_quantization_hash
    size = os.path.getsize(d / "a.hfq")
    assert ident == (b"cold-identity:hfqm:v1\0a.hfq\0" + size.to_bytes(8, "little")
                     + compute_quantization_hash(str(d / "a.hfq")).encode())
    plain = fpmod.hfqm_weight_identity(PKV, str(d / "b.hfq"))
    assert len(plain) == len(b"cold-identity:hfqm:v1\0b.hfq\0") + 8 + 32  # full digest
    a = model_fingerprint(PKV, str(d), Profile, GEOM, hfqm_file=str(d / "a.hfq"))
    b = model_fingerprint(PKV, str(d), Profile, GEOM, hfqm_file=str(d / "b.hfq"))
    assert a is not None and b is not None and a != b
    (d / "empty.hfq").write_bytes(b"")
    assert model_fingerprint(PKV, str(d), Profile, GEOM, hfqm_file=str(d / "empty.hfq")) is None


def test_cold_tier_for_model_resolves_persistence_end_to_end(tmp_path, monkeypatch, caplog):
    from pagedkv.cold import cold_tier_for_model
    d = _model(tmp_path)
    base = tmp_path / "base"
    monkeypatch.delenv("PAGEDKV_PERSIST_PAGED_CACHE", raising=False)
    assert cold_tier_for_model(str(d), "pagedkv_reference", GEOM, base=str(base)) is None
    ctx = cold_tier_for_model(str(d), "pagedkv_reference", GEOM, base=str(base),
                              persist_paged_cache=True)
    assert ctx is not None and ctx.fingerprint == model_fingerprint(PKV, str(d), Profile, GEOM)
    assert (base / "pagedkv-v1" / "weight-digests.json").is_file()
    assert cold_tier_for_model(str(d), "qwen3", GEOM, base=str(base),
                               persist_paged_cache=True) is None  # not an admitted family
    monkeypatch.setenv("PAGEDKV_PERSIST_PAGED_CACHE", "0")
    assert cold_tier_for_model(str(d), "pagedkv_reference", GEOM, base=str(base),
                               persist_paged_cache=True) is None
    monkeypatch.setenv("PAGEDKV_PERSIST_PAGED_CACHE", "sometimes")
    with caplog.at_level(logging.WARNING, "pagedkv.cold"):
        assert cold_tier_for_model(str(d), "pagedkv_reference", GEOM, base=str(base),
                                   persist_paged_cache=True) is not None
    assert any("PAGEDKV_PERSIST_PAGED_CACHE" in r.getMessage() and "sometimes" in r.getMessage()
               for r in caplog.records)
    ctx.tier.close()


def test_capture_budget_env_parsing(monkeypatch, caplog):
    from pagedkv.cold import knobs
    from pagedkv.cold.knobs import capture_budget_from_env
    monkeypatch.setattr(knobs, "_installed_budget", None)
    monkeypatch.delenv("PAGEDKV_COLD_CAPTURE_BLOCKS_PER_TURN", raising=False)
    monkeypatch.delenv("PAGEDKV_COLD_CAPTURE_BUDGET_MS", raising=False)
    assert capture_budget_from_env() == (128, 250)
    assert capture_budget_from_env(16, 100) == (16, 100)
    monkeypatch.setenv("PAGEDKV_COLD_CAPTURE_BLOCKS_PER_TURN", " 64 ")
    monkeypatch.setenv("PAGEDKV_COLD_CAPTURE_BUDGET_MS", "-5")
    with caplog.at_level(logging.WARNING, "pagedkv.cold"):
        assert capture_budget_from_env(16, 100) == (64, 100)
    assert any("PAGEDKV_COLD_CAPTURE_BUDGET_MS" in r.getMessage() for r in caplog.records)
