"""The CDNA code objects this build made hold the MFMA instructions the lane emulations assume
(tests/test_attention_mfma_simulated.py, tests/test_attention_codes_amd_simulated.py,
tests/test_gemv_amd_simulated.py): each AMD matrix-core kernel disassembled (hipcc's
clang-offload-bundler and llvm-objdump, both installed with it), its MFMAs counted. What it
cannot do: run them (no AMD GPU here; docs/kernels.md, "AMD matrix cores").

Skipped without a gfx90a / gfx940 object or the tools, except under CI's
PAGEDKV_EXPECT_BACKENDS=hip, where a missing one fails."""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

EXPECT_HIP = "hip" in os.environ.get("PAGEDKV_EXPECT_BACKENDS", "").split(",")
LLVM_BIN = Path("/usr/lib/llvm-15/bin")  # Debian's hipcc depends on llvm-15, clang-tools-15


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    return found or (str(LLVM_BIN / name) if (LLVM_BIN / name).exists() else None)


def _skip_or_fail(why: str):
    if EXPECT_HIP:
        pytest.fail(f"PAGEDKV_EXPECT_BACKENDS has hip but {why}")
    pytest.skip(why)


def mfma_counts(source: str, arch: str, tmp_path: Path) -> dict[str, collections.Counter]:
    """Each kernel of ``source``'s code object for ``arch``: its MFMA mnemonics, counted."""
    from pagedkv.kernels import code_objects
    if f"{source}.{arch}.hsaco" not in code_objects.list_objects():
        _skip_or_fail(f"no {source}.{arch}.hsaco in this build")
    bundler, objdump = _tool("clang-offload-bundler"), _tool("llvm-objdump")
    if bundler is None or objdump is None:
        _skip_or_fail("clang-offload-bundler / llvm-objdump missing")
    bundle, co = tmp_path / f"{source}.{arch}.hsaco", tmp_path / f"{source}.{arch}.co"
    bundle.write_bytes(code_objects.read_object(source, "hip", arch))
    subprocess.run([bundler, "--unbundle", "--type=o", f"--input={bundle}", f"--output={co}",
                    f"--targets=hipv4-amdgcn-amd-amdhsa--{arch}"], check=True)
    listing = subprocess.run([objdump, "-d", f"--mcpu={arch}", str(co)], check=True,
                             capture_output=True, text=True).stdout
    counts = {}
    for body in re.split(r"\n(?=[0-9a-f]+ <[^>]+>:)", listing):
        m = re.match(r"[0-9a-f]+ <([^>]+)>:", body)
        if m:
            counts[m.group(1)] = collections.Counter(re.findall(r"\b(v_mfma\w*)", body))
    return counts


@pytest.fixture(scope="module")
def kvcache_gfx90a(tmp_path_factory):
    return mfma_counts("kvcache", "gfx90a", tmp_path_factory.mktemp("mfma"))


def test_the_attention_kernels_are_mfma_where_the_emulations_say(kvcache_gfx90a):
    from pagedkv.kernels import kvcache
    found = {n: c for n, c in kvcache_gfx90a.items() if c}
    f16, bf16 = "v_mfma_f32_16x16x16f16", "v_mfma_f32_16x16x16bf16_1k"
    want = {}
    for g in (1, 2, 4, 8):
        # f16 / bf16 / q8: 8 k-steps of pass 1, 8 m-tiles of pass 2 (q8: 2 per record each)
        want[f"pkv_paged_attention_f16mfma_g{g}"] = {f16: 16}
        want[f"pkv_paged_attention_q8mfma_g{g}"] = {f16: 16}
        want[f"pkv_paged_attention_bf16mfma_g{g}"] = {bf16: 16}
        # the compressed pairs' _mma kernels: pass 1's 8 k-steps and, for a rotated V, pass
        # 2's 8 m-tiles, each as a hi and a lo MFMA (a q8 V keeps the CUDA-core pass 2)
        for d in kvcache.QUANT_KV_DTYPES:
            if kvcache.qkv_mma_applies(d):
                n = 16 if d.endswith("/q8") else 32
                want[f"pkv_paged_attention_{d.replace('/', '_')}_mma_g{g}"] = {f16: n}
    assert {n: dict(c) for n, c in found.items()} == want


def test_the_int8_gemv_kernels_are_mfma(tmp_path):
    counts = mfma_counts("weights", "gfx90a", tmp_path)
    mma = {n: c for n, c in counts.items() if n.startswith("pkv_gemv_mma_")}
    want = {}
    for fmt in ("hfq4g256", "mq4g256v2", "hfq6g256", "q8f16"):
        names = [f"pkv_gemv_mma_{fmt}_n{n}" for n in (1, 2, 3)]
        names += [f"pkv_gemv_mma_tiled_{fmt}_n{n}" for n in (6, 12)]  # batch 9-32
        # gfx90a: v_mfma_i32_16x16x16i8, two k-16 steps per k-32 group step, 8 of those.
        # Q8F16 twice: a lane holds one k-quad, so each step runs once per 32-weight block
        # with the other block's lanes zeroed (MfmaI8::product_blocks)
        n = 32 if fmt == "q8f16" else 16
        want.update({name: {"v_mfma_i32_16x16x16i8": n} for name in names})
    assert {n: dict(c) for n, c in mma.items()} == want
    assert all(not c for n, c in counts.items() if n not in mma)
