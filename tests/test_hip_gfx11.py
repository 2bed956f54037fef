"""The hip/ kernels compiled for gfx1100 (RDNA3), which this machine's HIP cannot finish alone:
hipcc's optimized device IR, machine code from llvmlite's newer LLVM (hip/gfx11_codegen.py).
What it proves: the sources type-check for gfx11, the WMMA GEMV (weights.hip's gemv_amd_mc
with WmmaI8) and the WMMA attention (kvcache.hip's qk_scores_wmma / pv_wmma and their q8
versions) turn into v_wmma instructions, and those kernels do not spill to scratch. What it
cannot: run them (no AMD GPU; tests/test_gemv_amd_simulated.py and
tests/test_attention_wmma_simulated.py emulate the WMMA kernels lane by lane instead).

Skipped where hipcc or llvmlite is missing, except under CI's PAGEDKV_EXPECT_BACKENDS=hip
(the README's test command installs llvmlite), where a missing tool fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernels_support import load_tree_script

ROOT = Path(__file__).resolve().parents[1]
EXPECT_HIP = "hip" in os.environ.get("PAGEDKV_EXPECT_BACKENDS", "").split(",")


@pytest.fixture(scope="module")
def codegen():
    mod = load_tree_script("hip/gfx11_codegen.py", "pagedkv_gfx11_codegen")
    missing = []
    if mod.find_hipcc() is None:
        missing.append("hipcc")
    try:
        import llvmlite.binding as llvm
        if llvm.llvm_version_info < (17,):  # gfx11 WMMA code generation matured in LLVM 17
            missing.append(f"llvmlite with LLVM >= 17 (has {llvm.llvm_version_info})")
    except ImportError:
        missing.append("llvmlite")
    if missing:
        if EXPECT_HIP:
            pytest.fail(f"PAGEDKV_EXPECT_BACKENDS has hip but {', '.join(missing)} is missing")
        pytest.skip(f"needs {', '.join(missing)}")
    return mod


@pytest.fixture(scope="module")
def weights_gfx1100(codegen, compiled_ahead):
    return codegen.load_json(compiled_ahead.output("gfx1100:weights"))["weights.hip"]


LISTING = """
	.text
pkv_k:                                  ; @pkv_k
; %bb.0:
	v_wmma_i32_16x16x16_iu8 v[0:7], v[8:11], v[12:15], v[0:7] neg_lo:[1,1,0]
	v_wmma_i32_16x16x16_iu8 v[0:7], v[8:11], v[12:15], v[0:7] neg_lo:[1,1,0]
.LBB0_1:
	s_endpgm
.Lfunc_end0:
	.size	pkv_k, .Lfunc_end0-pkv_k
amdhsa.kernels:
  - .args:
      - .address_space:  global
        .name:           w
        .offset:         0
    .name:           pkv_k
    .private_segment_fixed_size: 12
    .sgpr_count:     20
    .vgpr_count:     40
amdhsa.target:   amdgcn-amd-amdhsa--gfx1100
"""


def test_the_listing_parser_reads_the_kernels_keys_not_its_arguments():
    mod = load_tree_script("hip/gfx11_codegen.py", "pagedkv_gfx11_codegen")
    (k,) = mod.kernels(LISTING).values()
    assert (k.name, k.vgprs, k.sgprs, k.scratch_bytes) == ("pkv_k", 40, 20, 12)
    assert k.count("v_wmma_i32") == 2 and k.count("s_endpgm") == 1 and k.count("v_mfma") == 0


def test_isa_versions_of_arch_names(codegen):
    assert [codegen.isa_version(a) for a in ("gfx1100", "gfx1151", "gfx90a", "gfx942")] == [
        11000, 11501, 9010, 9402]
    with pytest.raises(ValueError, match="not an AMD arch name"):
        codegen.isa_version("sm_90")


@pytest.mark.compile_ahead("gfx1100:weights")
def test_the_int8_gemv_is_wmma_on_gfx1100_without_scratch(weights_gfx1100):
    mma = {n: k for n, k in weights_gfx1100.items() if n.startswith("pkv_gemv_mma_")}
    # n1-n3 and the tiled n6 / n12 of every format with a tensor-core GEMV (mq4g256 runs
    # hfq4g256's on rotated x)
    assert sorted(mma) == sorted(
        f"pkv_gemv_mma_{t}{f}_n{n}" for f in ("hfq4g256", "mq4g256v2", "hfq6g256", "q8f16")
        for t, n in [("", 1), ("", 2), ("", 3), ("tiled_", 6), ("tiled_", 12)])
    for name, k in mma.items():
        # one 16-column tile per pass: 8 k-32 steps of 2 WMMAs each in the group loop (Q8F16
        # too: one WMMA per 32-weight block takes its two quads, WmmaI8::product_blocks)
        assert k.count("v_wmma_i32_16x16x16_iu8") == 16, name
        assert k.count("v_mfma") == 0, name
        assert k.scratch_bytes == 0 and k.vgprs <= 256, (name, k.scratch_bytes, k.vgprs)
    # the CUDA-core kernels have no matrix instructions, and nothing spills
    assert weights_gfx1100["pkv_gemv_hfq4g256_b8"].count("v_wmma") == 0
    assert {n: k.scratch_bytes for n, k in weights_gfx1100.items() if k.scratch_bytes} == {}


@pytest.mark.slow
@pytest.mark.compile_ahead("gfx1100:kvcache")
def test_the_wmma_attention_kernels_are_wmma_on_gfx1100_without_scratch(codegen, compiled_ahead):
    found = codegen.load_json(compiled_ahead.output("gfx1100:kvcache"))["kvcache.hip"]
    wmma = {n: k for n, k in found.items() if "wmma_g" in n}
    assert sorted(wmma) == sorted(f"pkv_paged_attention_{kind}wmma_g{g}"
                                  for kind in ("f16", "bf16", "q8") for g in (1, 2, 4, 8))
    for name, k in wmma.items():
        # pass 1: 8 k-steps of 16 dims; pass 2: 8 m-tiles of 16 dims (head_dim 128); q8: 2
        # per record in each pass, its codes made f16
        instr = "v_wmma_f32_16x16x16_" + ("bf16" if "bf16" in name else "f16")
        assert k.count(instr) == 16, (name, k.count(instr))
        assert k.scratch_bytes == 0 and k.vgprs <= 256, (name, k.scratch_bytes, k.vgprs)
    # the compressed pairs' _mma kernels: pass 1's 8 k-steps and, for a rotated V, pass 2's 8
    # m-tiles, each a hi and a lo WMMA (a q8 V keeps the CUDA-core pass 2)
    from pagedkv.kernels import kvcache
    codes = {n: k for n, k in found.items() if "_mma_g" in n}
    assert sorted(codes) == sorted(f"pkv_paged_attention_{d.replace('/', '_')}_mma_g{g}"
                                   for d in kvcache.QUANT_KV_DTYPES if kvcache.qkv_mma_applies(d)
                                   for g in (1, 2, 4, 8))
    for name, k in codes.items():
        want = 16 if name.rsplit("_mma_", 1)[0].endswith("_q8") else 32
        assert k.count("v_wmma_f32_16x16x16_f16") == want, (name, k.count("v_wmma"))
        assert k.scratch_bytes == 0 and k.vgprs <= 256, (name, k.scratch_bytes, k.vgprs)
    # every other kernel (the CUDA-core passes, the staged q8 kernels) has no matrix instruction
    others = [k for n, k in found.items() if n not in wmma and n not in codes]
    assert others and all(k.count("v_wmma") == 0 and k.count("v_mfma") == 0 for k in others)
    assert all(k.vgprs <= 256 for k in found.values())


@pytest.mark.slow
@pytest.mark.parametrize("source", ["decode.hip", "pool.hip", "bench.hip"])
def test_every_other_source_compiles_for_gfx1100(codegen, source):
    found = codegen.compile_kernels(ROOT / "hip" / source, "gfx1100")
    assert found and all(k.count("v_mfma") == 0 for k in found.values())
    assert all(k.vgprs <= 256 for k in found.values())
