"""KV mode resolution (PAGEDKV_KV_MODE > config > registry > q8, HIPFIRE_* aliases) and
kv_adaptive (presets, tiers, capacities, thresholds, in-place downshift): docs/kv-quant.md."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pagedkv import errors, kv_mode
from pagedkv.kv_adaptive import KVAdaptive, KVAdaptivePlan, parse_adaptive
from pagedkv.kv_mode import (
    register_model_kv_defaults,
    registered_model_kv_defaults,
    resolve_kv_modes,
)
from pagedkv.quant import kv


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(kv_mode, "_warned", set())
    monkeypatch.setattr(kv_mode, "_REGISTRY", {})


def test_defaults_are_q8_and_off():
    c = resolve_kv_modes(environ={})
    assert (c.k, c.v, c.adaptive, c.kv_dtype) == ("q8", "q8", "off", "q8")
    assert c.sources == {"k": "default", "v": "default", "adaptive": "default"}


def test_the_order_argument_env_alias_model_global_registry_default():
    register_model_kv_defaults("m", kv_cache="fwht2", kv_v="lloyd2")
    env = {"PAGEDKV_KV_MODE": "fwht3", "HIPFIRE_KV_MODE": "fwht2", "HIPFIRE_KV_V": "lloyd3"}
    model, glob = {"kv_cache": "fwht4", "kv_v": "lloyd4"}, {"kv_cache": "q8", "kv_v": "q8"}
    c = resolve_kv_modes(k="fwht4", environ=env, model_config=model, global_config=glob,
                         model="m")
    assert (c.k, c.sources["k"]) == ("fwht4", "argument k")
    assert (c.v, c.sources["v"]) == ("lloyd3", "HIPFIRE_KV_V")  # alias: PAGEDKV_KV_V unset
    c = resolve_kv_modes(environ=env, model_config=model, global_config=glob, model="m")
    assert (c.k, c.sources["k"]) == ("fwht3", "PAGEDKV_KV_MODE")  # alias not read
    c = resolve_kv_modes(environ={}, model_config=model, global_config=glob, model="m")
    assert (c.kv_dtype, c.sources["k"]) == ("fwht4/lloyd4", "model config kv_cache")
    c = resolve_kv_modes(environ={}, global_config=glob, model="m")
    assert (c.kv_dtype, c.sources["v"]) == ("q8", "global config kv_v")
    c = resolve_kv_modes(environ={}, model="m")
    assert (c.kv_dtype, c.sources["k"]) == ("fwht2/lloyd2", "registry 'm'")
    # the registry fills in a knob set to auto, and a final auto is q8
    c = resolve_kv_modes(environ={"PAGEDKV_KV_MODE": "auto"}, model="m")
    assert (c.k, c.sources["k"]) == ("fwht2", "registry 'm'")
    c = resolve_kv_modes(environ={"PAGEDKV_KV_MODE": "AUTO"})
    assert (c.k, c.sources["k"]) == ("q8", "PAGEDKV_KV_MODE (auto)")


def test_bad_pagedkv_or_config_values_raise_naming_the_source(caplog):
    with pytest.raises(errors.InvalidArgument,
                       match=r"PAGEDKV_KV_MODE = 'fwht5': accepted values are q8, fwht4"):
        resolve_kv_modes(environ={"PAGEDKV_KV_MODE": "fwht5"})
    with pytest.raises(errors.InvalidArgument, match=r"PAGEDKV_KV_V = 'fp8' is not supported"):
        resolve_kv_modes(environ={"PAGEDKV_KV_V": "fp8"})
    with pytest.raises(errors.InvalidArgument, match=r"model config kv_cache = 'legacy-asym3'"):
        resolve_kv_modes(environ={}, model_config={"kv_cache": "legacy-asym3"})
    with pytest.raises(errors.InvalidArgument, match=r"PAGEDKV_KV_ADAPTIVE = 'fast'"):
        resolve_kv_modes(environ={"PAGEDKV_KV_ADAPTIVE": "fast"})
    with pytest.raises(errors.InvalidArgument, match=r"argument v = 'turbo4'"):
        resolve_kv_modes(v="turbo4", environ={})  # upstream's K alias is no V value


def test_a_bad_alias_is_logged_and_skipped_and_an_alias_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="pagedkv")
    env = {"HIPFIRE_KV_MODE": "fp8", "HIPFIRE_KV_V": "lloyd4"}
    c = resolve_kv_modes(environ=env, model_config={"kv_cache": "fwht4"})
    assert (c.k, c.sources["k"]) == ("fwht4", "model config kv_cache")
    assert (c.v, c.sources["v"]) == ("lloyd4", "HIPFIRE_KV_V")
    resolve_kv_modes(environ=env, model_config={"kv_cache": "fwht4"})
    text = [r.getMessage() for r in caplog.records]
    assert sum("ignoring HIPFIRE_KV_MODE='fp8'" in t for t in text) == 1
    assert sum("using HIPFIRE_KV_V='lloyd4'" in t for t in text) == 1


@pytest.mark.parametrize("alias,mode", [("asym4", "fwht4"), ("turbo", "fwht3"),
                                        ("turbo2", "fwht2"), ("asym3", "fwht3")])
def test_deprecated_upstream_names_mean_fwht_and_warn_once(caplog, alias, mode):
    caplog.set_level(logging.WARNING, logger="pagedkv")
    for _ in range(2):
        assert resolve_kv_modes(environ={"PAGEDKV_KV_MODE": alias}).k == mode
    assert sum("deprecated name" in r.getMessage() for r in caplog.records) == 1


def test_arguments_of_the_wrong_type_are_type_errors_and_register_nothing():
    """A list as ``model`` raised a builtin TypeError (unhashable), a list or str as a config
    or ``environ`` an AttributeError (``.get``), and an int model name was registered
    (found by a review)."""
    with pytest.raises(errors.InvalidArgumentType, match="model: expected a model name "
                                                         r"\(a str, e.g. a model_type\), got list"):
        resolve_kv_modes(model=["qwen3"], environ={})
    for bad in (["qwen3"], 3):
        with pytest.raises(errors.InvalidArgumentType, match="model: expected a model name"):
            register_model_kv_defaults(bad, kv_cache="fwht4")
    assert kv_mode._REGISTRY == {}
    with pytest.raises(errors.InvalidArgumentType, match="model: expected a model name"):
        registered_model_kv_defaults(["qwen3"])
    for kwargs, name in (({"model_config": [("kv_cache", "q8")]}, "model_config"),
                         ({"global_config": "fwht4"}, "global_config")):
        with pytest.raises(errors.InvalidArgumentType,
                           match=f"{name}: expected a mapping with the keys kv_cache, kv_v, "
                                 "kv_adaptive, got"):
            resolve_kv_modes(environ={}, **kwargs)
    with pytest.raises(errors.InvalidArgumentType,
                       match="environ: expected a mapping of variables, like os.environ, got "
                             "list"):
        resolve_kv_modes(environ=[("PAGEDKV_KV_MODE", "fwht4")])
    assert resolve_kv_modes(model_config={"kv_cache": "fwht4"}, environ={}).k == "fwht4"


def test_pairing_rules():
    with pytest.raises(errors.InvalidArgument, match="V 'lloyd4' .*needs a rotated K"):
        resolve_kv_modes(environ={"PAGEDKV_KV_V": "lloyd4"})
    c = resolve_kv_modes(environ={"PAGEDKV_KV_MODE": "bf16"})
    assert (c.kv_dtype, c.v) == ("bfloat16", "bf16")
    with pytest.raises(errors.InvalidArgument, match="bf16 on both sides"):
        resolve_kv_modes(environ={"PAGEDKV_KV_MODE": "bf16", "PAGEDKV_KV_V": "lloyd2"})


def test_adaptive_forces_the_start_tier_and_refuses_an_explicit_mode():
    c = resolve_kv_modes(environ={"PAGEDKV_KV_ADAPTIVE": "Balanced"})
    assert (c.adaptive, c.kv_dtype) == ("balanced", "fwht4/q8")
    with pytest.raises(errors.InvalidArgument, match="unset one of them"):
        resolve_kv_modes(environ={"PAGEDKV_KV_ADAPTIVE": "balanced"},
                         model_config={"kv_v": "lloyd4"})
    c = resolve_kv_modes(adaptive="advanced: v=lloyd3 ,k=fwht2", environ={})
    assert c.adaptive == "advanced:k=fwht2,v=lloyd3"
    c = resolve_kv_modes(adaptive="advanced:k =fwht2, v =lloyd3", environ={})  # was refused
    assert c.adaptive == "advanced:k=fwht2,v=lloyd3"


def test_a_registry_default_yields_to_an_explicit_setting_of_the_other_side():
    # Found by a review: a registry mode blocked kv_adaptive (and the other way round)
    # with "unset one of them", which a user cannot do to a registry entry.
    register_model_kv_defaults("reg", kv_cache="fwht4")
    c = resolve_kv_modes(model="reg", environ={"PAGEDKV_KV_ADAPTIVE": "balanced"})
    assert (c.adaptive, c.kv_dtype) == ("balanced", "fwht4/q8")
    register_model_kv_defaults("reg2", kv_adaptive="balanced")
    c = resolve_kv_modes(model="reg2", environ={"PAGEDKV_KV_MODE": "fwht2"})
    assert (c.adaptive, c.k) == ("off", "fwht2")
    assert "overridden by an explicit K/V mode" in c.sources["adaptive"]
    with pytest.raises(errors.InvalidArgument, match="unset one of them"):  # both explicit
        resolve_kv_modes(environ={"PAGEDKV_KV_ADAPTIVE": "balanced", "PAGEDKV_KV_MODE": "fwht2"})


def test_auto_is_unset_next_to_kv_adaptive():
    """``auto`` leaves the mode to pagedkv ("only while the value is unset or auto"): with
    kv_adaptive set it raised "unset one of them" as if the user had chosen a mode (found by
    a review)."""
    c = resolve_kv_modes(environ={"PAGEDKV_KV_ADAPTIVE": "balanced", "PAGEDKV_KV_MODE": "auto",
                                  "PAGEDKV_KV_V": "auto"})
    assert (c.adaptive, c.kv_dtype) == ("balanced", "fwht4/q8")
    register_model_kv_defaults("reg3", kv_adaptive="conservative")
    c = resolve_kv_modes(model="reg3", environ={"PAGEDKV_KV_MODE": "auto"})
    assert (c.adaptive, c.kv_dtype) == ("conservative", "fwht4/q8")


def test_a_registry_mode_that_cannot_pair_with_an_explicit_one_yields_to_its_default():
    """Found by a review: an explicit K with a registry entry whose V is rotated raised
    "needs a rotated K", which no user can fix by unsetting a registry entry; the registry
    side yields to its knob's default, as it does to an explicit kv_adaptive. Explicit
    settings of both sides still conflict."""
    register_model_kv_defaults("rot", kv_cache="fwht4", kv_v="lloyd4")
    for k in ({"k": "q8"}, {"environ": {"PAGEDKV_KV_MODE": "q8"}},
              {"model_config": {"kv_cache": "q8"}}):
        args = {"environ": {}, **k}
        c = resolve_kv_modes(model="rot", **args)
        assert (c.k, c.v, c.kv_dtype) == ("q8", "q8", "q8")
        assert c.sources["v"].startswith("default, registry 'rot' V mode 'lloyd4' overridden")
    c = resolve_kv_modes(k="bf16", model="rot", environ={})  # V follows K bf16 as a default
    assert (c.kv_dtype, c.v) == ("bfloat16", "bf16")
    register_model_kv_defaults("q8v", kv_v="q8")
    assert resolve_kv_modes(k="bf16", model="q8v", environ={}).kv_dtype == "bfloat16"
    # a registry side that pairs stays, and the registry alone is used as registered
    assert resolve_kv_modes(k="fwht2", model="rot", environ={}).kv_dtype == "fwht2/lloyd4"
    assert resolve_kv_modes(v="lloyd3", model="rot", environ={}).kv_dtype == "fwht4/lloyd3"
    assert resolve_kv_modes(model="rot", environ={}).kv_dtype == "fwht4/lloyd4"
    assert registered_model_kv_defaults("rot") == {"k": "fwht4", "v": "lloyd4"}  # unchanged
    # an explicit rotated V over a K that is q8 (explicit, default or a yielding registry K)
    register_model_kv_defaults("bf", kv_cache="bf16", kv_v="bf16")
    for args in ({"k": "q8", "v": "lloyd4"}, {"v": "lloyd4", "model": "bf"}):
        with pytest.raises(errors.InvalidArgument, match="V 'lloyd4' .*needs a rotated K"):
            resolve_kv_modes(environ={}, **args)


def test_a_registry_v_without_k_yields_to_a_k_nobody_set():
    """Found by a review: a registry entry holding only a rotated V (or bf16) failed every
    resolution that set no K ("needs a rotated K; K is 'q8' (default)"), with K auto too,
    while an explicit K q8 made it yield: no user setting was in conflict. It yields to a
    default or auto K now; a K the user chose still decides, and an entry whose own K and V
    cannot pair still fails."""
    register_model_kv_defaults("v", kv_v="lloyd4")
    for args, k_source in (({}, "default"), ({"k": "auto"}, "argument k (auto)"),
                           ({"environ": {"PAGEDKV_KV_MODE": "auto"}}, "PAGEDKV_KV_MODE (auto)"),
                           ({"model_config": {"kv_cache": "auto"}},
                            "model config kv_cache (auto)")):
        c = resolve_kv_modes(model="v", **{"environ": {}, **args})
        assert (c.k, c.v, c.adaptive, c.kv_dtype) == ("q8", "q8", "off", "q8")
        assert c.sources == {
            "k": k_source, "adaptive": "default",
            "v": f"default, registry 'v' V mode 'lloyd4' overridden by K mode 'q8' ({k_source})"}
    c = resolve_kv_modes(k="fwht2", model="v", environ={})
    assert (c.kv_dtype, c.sources["v"]) == ("fwht2/lloyd4", "registry 'v'")
    register_model_kv_defaults("b", kv_v="bf16")
    c = resolve_kv_modes(model="b", environ={})
    assert (c.kv_dtype, c.sources["v"]) == (
        "q8", "default, registry 'b' V mode 'bf16' overridden by K mode 'q8' (default)")
    assert resolve_kv_modes(k="bf16", model="b", environ={}).kv_dtype == "bfloat16"
    register_model_kv_defaults("k", kv_cache="bf16")  # a registry K keeps a default V
    c = resolve_kv_modes(model="k", environ={})
    assert (c.kv_dtype, c.sources["v"]) == ("bfloat16", "follows K bf16 (registry 'k')")
    register_model_kv_defaults("kv", kv_cache="q8", kv_v="lloyd4")
    with pytest.raises(errors.InvalidArgument) as err:
        resolve_kv_modes(model="kv", environ={})
    assert str(err.value) == ("V 'lloyd4' (registry 'kv') is a rotated V, which needs a rotated "
                              "K (fwht4, fwht3, fwht2 or lloydN); K is 'q8' (registry 'kv')")
    assert registered_model_kv_defaults("v") == {"v": "lloyd4"}  # unchanged


@pytest.mark.parametrize("spec,tiers", [
    ("conservative", ["fwht4/q8", "fwht4/lloyd4"]),
    ("balanced", ["fwht4/q8", "fwht4/lloyd4", "fwht4/lloyd3", "fwht2/lloyd3", "fwht2/lloyd2"]),
    ("aggressive", ["fwht4/q8", "fwht2/q8", "fwht2/lloyd4", "fwht2/lloyd3", "fwht2/lloyd2"]),
    ("advanced:k=fwht4,v=lloyd3", ["fwht4/q8", "fwht4/lloyd4", "fwht4/lloyd3"]),
    ("advanced:k=fwht2,v=q8", ["fwht4/q8", "fwht2/q8"]),
    ("advanced:k=fwht2,v=lloyd4", ["fwht4/q8", "fwht4/lloyd4", "fwht2/lloyd4"]),
])
def test_presets_and_their_tiers(spec, tiers):
    assert [kv.join_kv_dtype(*t) for t in parse_adaptive(spec).tiers] == tiers


@pytest.mark.parametrize("bad,match", [("advanced:k=fwht3,v=lloyd2", "re-rotating"),
                                       ("advanced:k=fwht2", "name both floors"),
                                       ("advanced:k=fwht2,v=lloyd5", "expected off"),
                                       ("balance", "expected off")])
def test_bad_adaptive_values(bad, match):
    with pytest.raises(errors.InvalidArgument, match=match):
        parse_adaptive(bad)


def test_plan_capacities_and_thresholds_follow_the_budget():
    # docs/kv-quant.md: bytes per head at hd 256 for balanced are 404 -> 264 -> 232 -> 168
    # -> 136; budget = max_seq * kv_heads * 136; cap = budget // (kv_heads * bytes).
    plan = KVAdaptivePlan("balanced", head_dim=256, num_kv_heads=4, max_seq=40000)
    assert plan.bytes_per_head == [404, 264, 232, 168, 136]
    assert plan.budget_bytes == 40000 * 4 * 136
    assert plan.caps == [40000 * 136 // b for b in (404, 264, 232, 168, 136)]
    assert plan.caps[0] == 13465  # 136/404 = 0.337 of max_seq
    assert plan.thresholds == [c - 64 for c in plan.caps[:-1]]
    assert plan.tier_before_append(0, 13000, 1) == 0
    assert plan.tier_before_append(0, 13400, 2) == 1  # 13402 > 13401
    assert plan.tier_before_append(0, 0, 30000) == 3  # one append crossing several
    assert plan.tier_before_append(0, 0, 33000) == 4
    assert plan.tier_before_append(2, 100, 1) == 2  # never back up
    aggressive = KVAdaptivePlan("aggressive", head_dim=256, num_kv_heads=1, max_seq=1000)
    assert aggressive.bytes_per_head == [404, 340, 200, 168, 136]
    with pytest.raises(errors.InvalidArgument, match=r"head_dim 256 \(lloyd V\) or 128"):
        KVAdaptivePlan("balanced", head_dim=64, num_kv_heads=4, max_seq=100)
    with pytest.raises(errors.InvalidArgument, match="off"):
        KVAdaptivePlan("off", head_dim=256, num_kv_heads=4, max_seq=100)


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"head_dim": "256"}, "head_dim"), ({"head_dim": 256.0}, "head_dim"),
    ({"num_kv_heads": "4"}, "num_kv_heads"), ({"num_kv_heads": True}, "num_kv_heads"),
    ({"max_seq": 1000.5}, "max_seq"), ({"max_seq": True}, "max_seq")])
def test_plan_arguments_of_the_wrong_type_are_type_errors(kwargs, name):
    """Found by a review: a str where an int is expected leaked a builtin TypeError, a bool
    or float max_seq gave a plan of 1-token or float capacities."""
    args = {"head_dim": 256, "num_kv_heads": 4, "max_seq": 1000, **kwargs}
    with pytest.raises(errors.InvalidArgumentType, match=f"{name} must be an int, got"):
        KVAdaptivePlan("balanced", **args)
    with pytest.raises(errors.InvalidArgument, match="num_kv_heads = 0 must be >= 1"):
        KVAdaptivePlan("balanced", head_dim=256, num_kv_heads=0, max_seq=100)
    for preset in (3, None, b"balanced"):
        with pytest.raises(errors.InvalidArgumentType, match="kv_adaptive .*: expected a string"):
            KVAdaptivePlan(preset, head_dim=256, num_kv_heads=4, max_seq=100)
    assert KVAdaptivePlan("balanced", head_dim=np.int64(256), num_kv_heads=np.int32(4),
                          max_seq=40000).caps[0] == 13465


def test_before_append_of_the_wrong_type_changes_nothing():
    ad = KVAdaptive.create("balanced", num_layers=1, num_kv_heads=2, head_dim=256,
                           block_size=16, max_seq=512, hash_seed=0)
    before = (ad.tier, ad.kv_dtype, ad.pool.num_blocks, ad.allocator.num_blocks)
    for seq_pos, n, error in (("0", 3, errors.InvalidArgumentType),
                              (0, True, errors.InvalidArgumentType),
                              (400.5, 3, errors.InvalidArgumentType),
                              (-1, 3, errors.InvalidArgument)):
        with pytest.raises(error, match="seq_pos|n "):
            ad.before_append(seq_pos, n)
        with pytest.raises(error):
            ad.plan.tier_before_append(0, seq_pos, n)
    assert (ad.tier, ad.kv_dtype, ad.pool.num_blocks, ad.allocator.num_blocks) == before
    with pytest.raises(errors.InvalidArgumentType, match="num_seqs must be an int"):
        KVAdaptive.create("balanced", num_layers=1, num_kv_heads=2, head_dim=256,
                          block_size=16, max_seq=512, num_seqs="2")
    with pytest.raises(errors.InvalidArgumentType, match="plan: expected a KVAdaptivePlan"):
        KVAdaptive("balanced", ad.pool, ad.allocator)


def test_a_pool_or_allocator_that_does_not_fit_the_plan_is_refused():
    """KVAdaptive(plan, pool, allocator) took any pool and allocator (found by a review): a
    pool of another head count got the plan's capacities (wrong ones), one of head_dim 128
    under a head_dim-256 plan failed only at its first step, an allocator of other sizes
    was taken, ``None`` raised AttributeError, and regions whose floor holds more blocks than
    max_num_blocks stepped the pool to 51 blocks while ``grow_by`` (capped) left the
    allocator at 21, silently. Each is refused when the controller is built now."""
    from pagedkv.allocator import BlockAllocator
    from pagedkv.pool import LayerKVPool, PoolGeometry
    plan = KVAdaptivePlan("balanced", head_dim=256, num_kv_heads=1, max_seq=256,
                          block_size=4)
    start = plan.kv_dtype(0)
    for geometry, name, have, want in (
            (PoolGeometry(1, 2, 256, 4, start), "num_kv_heads", 2, 1),
            (PoolGeometry(1, 1, 128, 4, start), "head_dim", 128, 256),
            (PoolGeometry(1, 1, 256, 8, start), "block_size", 8, 4)):
        pool = LayerKVPool(geometry, 4)
        with pytest.raises(errors.InvalidArgument,
                           match=rf"pool.geometry.{name} = {have} differs from the plan's "
                                 rf"{name} = {want}: build the KVAdaptivePlan with the "):
            KVAdaptive(plan, pool, BlockAllocator(4, 4, geometry.block_size))
    pool = LayerKVPool(PoolGeometry(1, 1, 256, 4, start), 4, 8)
    for allocator, name in ((BlockAllocator(3, 8, 4), "num_blocks"),
                            (BlockAllocator(4, 4, 4), "max_num_blocks")):
        with pytest.raises(errors.InvalidArgument,
                           match=rf"allocator.{name} = \d+ differs from pool.{name}"):
            KVAdaptive(plan, pool, allocator)
    with pytest.raises(errors.InvalidArgumentType, match="pool: expected a LayerKVPool"):
        KVAdaptive(plan, None, BlockAllocator(4, 4, 4))
    with pytest.raises(errors.InvalidArgumentType, match="allocator: expected a BlockAl"):
        KVAdaptive(plan, pool, None)
    g = PoolGeometry(1, 1, 256, 4, start)
    blocks = plan.budget_bytes // (g.k_slab_bytes + g.v_slab_bytes)
    assert blocks == 21
    regions = LayerKVPool(g, blocks, layer_region_bytes=plan.budget_bytes)  # max = 21
    with pytest.raises(errors.InvalidArgument,
                       match="max_num_blocks = 21: the pool's layer regions hold 64 blocks at "
                             "the floor fwht2/lloyd2.*max_num_blocks=64"):
        KVAdaptive(plan, regions, BlockAllocator(blocks, blocks, 4))
    assert (regions.geometry.dtype, regions.num_blocks, regions.generation) == (start, 21, 0)
    assert regions.layer_region_bytes == plan.budget_bytes and pool.layer_region_bytes is None
    regions = LayerKVPool(g, blocks, 64, layer_region_bytes=plan.budget_bytes)
    ad = KVAdaptive(plan, regions, BlockAllocator(blocks, 64, 4))
    assert ad.before_append(0, 256)[-1] == "fwht2/lloyd2"
    assert regions.num_blocks == ad.allocator.num_blocks == 64


def test_adaptive_pool_downshifts_in_place_and_keeps_every_token():
    ad = KVAdaptive.create("balanced", num_layers=2, num_kv_heads=2, head_dim=256,
                           block_size=16, max_seq=512, hash_seed=0)
    pool, alloc = ad.pool, ad.allocator
    region = pool._storage.region
    assert pool.num_blocks == ad.plan.budget_bytes // (16 * 2 * 404)  # 10 blocks of 16
    assert alloc.num_blocks == pool.num_blocks
    seen = []
    ad.add_listener(lambda old, new: seen.append((old, new)))
    rng = np.random.default_rng(0)
    vals = rng.standard_normal((2, 2, 480, 2, 256)).astype(np.float32)  # layer, k/v, tokens
    ids = alloc.allocate_many(min(alloc.num_free_blocks, 30))
    assert ad.before_append(0, 90) == []
    slots = (ids[:6, None] * 16 + np.arange(16)).reshape(-1)[:90]
    for layer in range(2):
        pool.write_tokens(layer, slots, vals[layer, 0, :90], vals[layer, 1, :90])
    cap0 = ad.plan.caps[0]  # 10 blocks of 16 at fwht4/q8
    assert cap0 == 160
    assert ad.before_append(90, cap0 - 64 - 90) == []  # up to the threshold: no step
    assert ad.before_append(90, cap0 - 64 - 89) == ["fwht4/lloyd4"]
    assert pool._storage.region is region and pool.geometry.dtype == "fwht4/lloyd4"
    assert alloc.num_blocks == pool.num_blocks > 10
    for layer in range(2):
        k, v = pool.decode_tokens(*pool.gather(layer, ids[:6], 90))
        want_k = kv.decode(kv.encode(vals[layer, 0, :90], "fwht4"), "fwht4", 256)
        want_v = kv.decode(kv.transcode(kv.encode(vals[layer, 1, :90], "q8"), "q8", "lloyd4",
                                        256), "lloyd4", 256)
        np.testing.assert_array_equal(k, want_k)
        np.testing.assert_array_equal(v, want_v)
    applied = ad.before_append(200, 300)  # 500 tokens: past every threshold but the floor's
    assert applied == ["fwht4/lloyd3", "fwht2/lloyd3", "fwht2/lloyd2"]
    assert seen[-1] == ("fwht2/lloyd3", "fwht2/lloyd2") and len(seen) == 4
    assert pool.num_blocks == alloc.num_blocks == 512 // 16
    with pytest.raises(errors.CapacityExceeded, match="513 tokens do not fit fwht2/lloyd2"):
        ad.before_append(512, 1)
    assert repr(ad).startswith("KVAdaptive(tier=4 'fwht2/lloyd2'")


def test_plan_at_head_dim_128_takes_the_fwht_v_ladder():
    # docs/kv-quant.md, "kv_adaptive": at hd 128 lloyd4 -> fwht4, lloyd2 -> fwht2 and lloyd3
    # is skipped. Bytes per head at hd 128: fwht4 K 68, fwht2 K 36, q8 136, fwht4 V 68,
    # fwht2 V 36.
    balanced = KVAdaptivePlan("balanced", head_dim=128, num_kv_heads=2, max_seq=1000)
    assert balanced.tiers == [("fwht4", "q8"), ("fwht4", "fwht4"), ("fwht2", "fwht4"),
                              ("fwht2", "fwht2")]
    assert balanced.bytes_per_head == [204, 136, 104, 72]
    assert balanced.budget_bytes == 1000 * 2 * 72
    assert balanced.caps == [1000 * 72 // b for b in (204, 136, 104, 72)]
    aggressive = KVAdaptivePlan("aggressive", head_dim=128, num_kv_heads=1, max_seq=1000)
    assert aggressive.tiers == [("fwht4", "q8"), ("fwht2", "q8"), ("fwht2", "fwht4"),
                                ("fwht2", "fwht2")]
    conservative = KVAdaptivePlan("conservative", head_dim=128, num_kv_heads=1, max_seq=64)
    assert conservative.tiers == [("fwht4", "q8"), ("fwht4", "fwht4")]
    cut = KVAdaptivePlan("advanced:k=fwht4,v=lloyd2", head_dim=128, num_kv_heads=1,
                         max_seq=64)
    assert [cut.kv_dtype(i) for i in range(len(cut.tiers))] == [
        "fwht4/q8", "fwht4/fwht4", "fwht4/fwht2"]
    with pytest.raises(errors.InvalidArgument, match="3-bit V floor has no head_dim 128"):
        KVAdaptivePlan("advanced:k=fwht4,v=lloyd3", head_dim=128, num_kv_heads=1, max_seq=64)
    with pytest.raises(errors.InvalidArgument, match="3-bit V floor has no head_dim 128"):
        KVAdaptivePlan("advanced:k=fwht2,v=lloyd3", head_dim=128, num_kv_heads=1, max_seq=64)
    # the same presets at hd 256 are unchanged
    assert KVAdaptivePlan("balanced", head_dim=256, num_kv_heads=1, max_seq=64).tiers[-1] == (
        "fwht2", "lloyd2")


def test_adaptive_pool_at_head_dim_128_downshifts_in_place():
    ad = KVAdaptive.create("balanced", num_layers=2, num_kv_heads=2, head_dim=128,
                           block_size=16, max_seq=512, hash_seed=0)
    pool, alloc = ad.pool, ad.allocator
    region = pool._storage.region
    assert pool.geometry.dtype == "fwht4/q8"
    assert pool.num_blocks == ad.plan.budget_bytes // (16 * 2 * 204)
    rng = np.random.default_rng(1)
    vals = rng.standard_normal((2, 2, 100, 2, 128)).astype(np.float32)
    ids = alloc.allocate_many(7)
    slots = (ids[:, None] * 16 + np.arange(16)).reshape(-1)[:100]
    for layer in range(2):
        pool.write_tokens(layer, slots, vals[layer, 0], vals[layer, 1])
    cap0 = ad.plan.caps[0]
    assert ad.before_append(100, cap0 - 64 - 99) == ["fwht4/fwht4"]
    assert pool._storage.region is region and pool.geometry.dtype == "fwht4/fwht4"
    for layer in range(2):
        k, v = pool.decode_tokens(*pool.gather(layer, ids, 100))
        want_k = kv.decode(kv.encode(vals[layer, 0], "fwht4"), "fwht4", 128)
        want_v = kv.decode(kv.transcode(kv.encode(vals[layer, 1], "q8"), "q8", "fwht4", 128),
                           "fwht4", 128)
        np.testing.assert_array_equal(k, want_k)
        np.testing.assert_array_equal(v, want_v)
    assert ad.before_append(200, 300) == ["fwht2/fwht4", "fwht2/fwht2"]
    assert pool.num_blocks == alloc.num_blocks == 512 // 16
    for layer in range(2):  # every token still there, at the floor's width
        k, v = pool.decode_tokens(*pool.gather(layer, ids, 100))
        assert np.isfinite(k).all() and np.isfinite(v).all()
        rel = np.linalg.norm(v - vals[layer, 1]) / np.linalg.norm(vals[layer, 1])
        assert 0.05 < rel < 0.6  # 2-bit V: coarse, but the row, not noise or zeros
    with pytest.raises(errors.CapacityExceeded, match="513 tokens do not fit fwht2/fwht2"):
        ad.before_append(512, 1)


@pytest.mark.parametrize("max_seq, block_size", [(100, 16), (250, 16), (1000, 128)])
def test_adaptive_holds_max_seq_at_the_floor_in_whole_blocks(max_seq, block_size):
    """A token-granular cap passed steps the pool could not hold: 100 tokens of blocks of 16
    failed at token 97, and with blocks of 128 tier 0's threshold (272) lay past its 2
    blocks, so no step ran and the sequence died at token 257 (found by a review). Caps are
    whole blocks now, the budget ceil(max_seq / bs) blocks."""
    from pagedkv.adapter import PagedKVCacheAdapter
    from pagedkv.tiny_model.kv_paths import PagedKV
    ad = KVAdaptive.create("balanced", num_layers=1, num_kv_heads=1, head_dim=256,
                           block_size=block_size, max_seq=max_seq, hash_seed=0)
    assert all(c % block_size == 0 for c in ad.plan.caps)
    assert ad.plan.caps[-1] == -(-max_seq // block_size) * block_size
    assert ad.pool.num_blocks * block_size >= ad.plan.caps[0]
    adapter = PagedKVCacheAdapter(ad.allocator, ad.pool, growth=False)
    adapter.reset_for_new_request(0)
    kvp = PagedKV(adapter, 0, adaptive=ad)
    for _ in range(max_seq):
        kvp.extend(np.array([1], np.int64))
    assert adapter.num_tokens(0) == max_seq and ad.tier == len(ad.plan.tiers) - 1


def test_an_adaptive_pool_never_grows_past_its_regions():
    """The fixed regions are the memory kv_adaptive promises; growth allocated a new,
    larger region (found by a review: 69,632 -> 187,456 bytes a layer for a 300-token
    prompt reserved through a growing adapter). Refused: nothing changes."""
    ad = KVAdaptive.create("balanced", num_layers=1, num_kv_heads=1, head_dim=256,
                           block_size=16, max_seq=512, hash_seed=0)
    pool = ad.pool
    region, blocks, gen = pool._storage.region, pool.num_blocks, pool.generation
    assert pool.grow_to(blocks + 1) is False
    assert (pool._storage.region is region, pool.num_blocks, pool.generation) == (
        True, blocks, gen)
    ad.before_append(0, 500)  # narrower modes: the same regions hold more blocks
    assert pool._storage.region is region and pool.num_blocks == 32 > blocks


def test_a_refused_in_place_transcode_changes_nothing():
    """A q8 record with an Inf scale (written raw) made the q8 -> lloyd4 step raise after
    earlier blocks were rewritten in the new layout under the old geometry (found by a
    review: block 0 then decoded to NaN). Every record is checked before any is written."""
    ad = KVAdaptive.create("balanced", num_layers=1, num_kv_heads=1, head_dim=256,
                           block_size=16, max_seq=512, hash_seed=0)
    pool = ad.pool
    vals = np.random.default_rng(0).standard_normal((48, 1, 256)).astype(np.float32)
    pool.write_tokens(0, np.arange(48), vals, vals)
    k_rec, v_rec = pool.gather(0, np.array([0, 1, 2]), 48)
    bad = v_rec[40:41].copy()
    bad[0, 0, 0:2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    pool.write_tokens(0, np.array([40]), k_rec[40:41], bad)
    before = [pool.read_block(b).copy() for b in range(pool.num_blocks)]
    state = (pool.geometry.dtype, pool.generation, pool.num_blocks, ad.tier)
    with pytest.raises(errors.InvalidArgument, match="non-finite float16 scale"):
        pool.transcode("fwht4/lloyd4")
    with pytest.raises(errors.InvalidArgument, match="non-finite float16 scale"):
        ad.before_append(0, 500)
    assert (pool.geometry.dtype, pool.generation, pool.num_blocks, ad.tier) == state
    for b, data in enumerate(before):
        np.testing.assert_array_equal(pool.read_block(b), data)


def test_a_step_the_memory_budget_cannot_hold_is_refused_before_any_change():
    """A pool without fixed regions builds the transcoded generation beside the old one
    (up to 2x the old bytes), and that copy was never debited: a step under a memory budget
    that could not hold it went ahead (found by a review). The budget is asked for the
    transient old + new bytes first now, as grow_to asks it: refused, the step raises
    PoolExhausted and the pool keeps its mode, bytes, generation and debit."""
    from pagedkv.allocator import BlockAllocator
    from pagedkv.pool import LayerKVPool, MemoryBudget, PoolGeometry
    plan = KVAdaptivePlan("balanced", head_dim=256, num_kv_heads=1, max_seq=512,
                          block_size=16)
    g = PoolGeometry(1, 1, 256, 16, plan.kv_dtype(0))
    new_bytes = PoolGeometry(1, 1, 256, 16, plan.kv_dtype(1)).pool_bytes(8)
    budget = MemoryBudget(g.pool_bytes(8) + new_bytes - 1)
    pool = LayerKVPool(g, 8, memory_budget=budget, pool_id="kv")
    ad = KVAdaptive(plan, pool, BlockAllocator(8, 8, 16, hash_seed=0))
    vals = np.random.default_rng(5).standard_normal((48, 1, 256)).astype(np.float32)
    pool.write_tokens(0, np.arange(48), vals, vals)
    before = [pool.read_block(b).copy() for b in range(pool.num_blocks)]
    state = (pool.geometry.dtype, pool.generation, pool.num_blocks, pool.total_bytes, ad.tier,
             budget.debit("kv"))
    for step in (lambda: pool.transcode(plan.kv_dtype(1)),
                 lambda: ad.before_append(0, plan.thresholds[0] + 1)):
        with pytest.raises(errors.PoolExhausted, match=r"fwht4/q8 -> fwht4/lloyd4 builds a "
                                                       rf"{new_bytes}-byte generation.*"
                                                       r"nothing changed"):
            step()
        assert (pool.geometry.dtype, pool.generation, pool.num_blocks, pool.total_bytes,
                ad.tier, budget.debit("kv")) == state
        for b, data in enumerate(before):
            np.testing.assert_array_equal(pool.read_block(b), data)
    budget2 = MemoryBudget(g.pool_bytes(8) + new_bytes)  # exactly the transient peak
    pool2 = LayerKVPool(g, 8, memory_budget=budget2, pool_id="kv")
    KVAdaptive(plan, pool2, BlockAllocator(8, 8, 16, hash_seed=0)).before_append(
        0, plan.thresholds[0] + 1)
    assert (pool2.geometry.dtype, budget2.debit("kv")) == (plan.kv_dtype(1), new_bytes)


def test_an_append_past_the_floor_is_refused_before_any_step():
    """An append that could not fit even at the floor transcoded every block down to the
    floor first and only then raised CapacityExceeded (found by the KV-modes review: from
    fwht4/q8, before_append(0, 600) with max_seq=512 left the pool at fwht2/lloyd2): a
    refused request irreversibly coarsened every other sequence's KV. Refused first now."""
    ad = KVAdaptive.create("balanced", num_layers=1, num_kv_heads=1, head_dim=256,
                           block_size=16, max_seq=512, hash_seed=0)
    pool = ad.pool
    vals = np.random.default_rng(3).standard_normal((48, 1, 256)).astype(np.float32)
    pool.write_tokens(0, np.arange(48), vals, vals)
    before = [pool.read_block(b).copy() for b in range(pool.num_blocks)]
    state = (pool.geometry.dtype, pool.generation, pool.num_blocks, ad.allocator.num_blocks,
             ad.tier)
    seen = []
    ad.add_listener(lambda old, new: seen.append((old, new)))
    with pytest.raises(errors.CapacityExceeded,
                       match="600 tokens do not fit fwht2/lloyd2 .512 tokens at the floor"):
        ad.before_append(0, 600)
    with pytest.raises(errors.CapacityExceeded, match="513 tokens do not fit fwht2/lloyd2"):
        ad.before_append(500, 13)
    assert (pool.geometry.dtype, pool.generation, pool.num_blocks, ad.allocator.num_blocks,
            ad.tier) == state == ("fwht4/q8", state[1], 10, 10, 0)
    assert seen == []
    for b, data in enumerate(before):
        np.testing.assert_array_equal(pool.read_block(b), data)
    assert ad.before_append(0, 512) == ["fwht4/lloyd4", "fwht4/lloyd3", "fwht2/lloyd3",
                                        "fwht2/lloyd2"]  # exactly the floor still fits


def test_an_advanced_floor_at_the_start_tier_is_refused_when_parsed():
    """advanced:k=fwht4,v=q8 (a floor equal to the start tier: no step) was accepted by the
    resolution, which then forced fwht4/q8 and refused any explicit K/V mode as a conflict
    with a kv_adaptive that never steps, while KVAdaptivePlan refused it as "kv_adaptive is
    off" (found by the KV-modes review). Refused where it is parsed, naming the fix."""
    with pytest.raises(errors.InvalidArgument, match="floor of k=fwht4,v=q8 is the start tier"):
        parse_adaptive("advanced:k=fwht4,v=q8")
    with pytest.raises(errors.InvalidArgument,
                       match="PAGEDKV_KV_ADAPTIVE = 'advanced: k=FWHT4, v=q8'.*start tier"):
        resolve_kv_modes(environ={"PAGEDKV_KV_ADAPTIVE": "advanced: k=FWHT4, v=q8"})
    assert parse_adaptive("advanced:k=fwht4,v=lloyd4").steps == (("v", "lloyd4"),)
    assert parse_adaptive("advanced:k=fwht2,v=q8").steps == (("k", "fwht2"),)


def test_a_failing_listener_skips_neither_the_other_listeners_nor_the_steps(caplog):
    """A listener that raised escaped before_append after the first step: the listeners
    after it never heard of the step (one left on the old mode reads the new records as old
    ones), the remaining steps were skipped and the append failed though the step had been
    committed (found by the KV-modes review). Logged at ERROR now; everything still runs."""
    ad = KVAdaptive.create("balanced", num_layers=1, num_kv_heads=1, head_dim=256,
                           block_size=16, max_seq=512, hash_seed=0)
    seen = []

    def failing(old, new):
        raise RuntimeError("listener broke")

    ad.add_listener(failing)
    ad.add_listener(lambda old, new: seen.append((old, new)))
    with caplog.at_level(logging.ERROR, logger="pagedkv"):
        assert ad.before_append(0, 300) == ["fwht4/lloyd4", "fwht4/lloyd3", "fwht2/lloyd3"]
    assert seen == [("fwht4/q8", "fwht4/lloyd4"), ("fwht4/lloyd4", "fwht4/lloyd3"),
                    ("fwht4/lloyd3", "fwht2/lloyd3")]
    assert (ad.tier, ad.pool.geometry.dtype) == (3, "fwht2/lloyd3")
    assert sum("kv_adaptive listener" in r.getMessage() for r in caplog.records) == 3
