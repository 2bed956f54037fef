"""pkg/include/pagedkv/launch.h is the one definition of the hip/ kernels' launch constants
(docs/kernels.md, "Launch constants"): no kernel source defines one of its names again, every
launcher's value is the header's, and the compiled attention kernels use, per KV dtype, the
partition and minimum blocks the launchers size their launches with. The MLX CUDA launcher's
geometry is checked against the same header in tests/test_kernels_mlx_cuda.py (it needs mlx).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from pagedkv.kernels import decode, kvcache, weights
from pagedkv.kernels.launch_constants import (
    KV_SUFFIX,
    attn_min_blocks,
    attn_partition_tokens,
    gemv_rows_per_block,
    launch_constant,
    launch_constants,
)

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "pkg" / "include" / "pagedkv" / "launch.h"
KERNEL_TEXTS = (sorted((ROOT / "hip").glob("*.hip")) + sorted((ROOT / "hip").glob("*.h"))
                + sorted((ROOT / "metal").glob("*.metal")) + [ROOT / "metal" / "pagedkv_metal.h"])


def test_the_header_is_parsed_whole():
    text = HEADER.read_text()
    # every #define of a value in the header is one the parser returns, with its value
    defines = dict(re.findall(r"^#define (PKV_\w+) (\S+)", text, re.MULTILINE))
    assert {k: int(v) for k, v in defines.items()} == launch_constants()
    for kv_dtype, suffix in KV_SUFFIX.items():
        assert attn_partition_tokens(kv_dtype) == launch_constants()[f"PKV_ATTN_PARTITION_{suffix}"]
        assert attn_min_blocks(kv_dtype) == launch_constants()[f"PKV_ATTN_MIN_BLOCKS_{suffix}"]
    with pytest.raises(LookupError, match="PKV_NO_SUCH"):
        launch_constant("PKV_NO_SUCH")


@pytest.mark.parametrize("path", KERNEL_TEXTS, ids=lambda p: p.name)
def test_no_kernel_source_defines_a_launch_constant_again(path):
    text = path.read_text()
    again = [name for name in launch_constants()
             if re.search(rf"^\s*#\s*define\s+{name}\b", text, re.MULTILINE)]
    assert again == [], f"{path.name} defines {again}: they belong to pagedkv/launch.h alone"
    used = [name for name in launch_constants() if re.search(rf"\b{name}\b", text)]
    if used:  # metal/ sources get it through pagedkv_metal.h
        assert "#include <pagedkv/launch.h>" in text or '#include "pagedkv_metal.h"' in text, \
            f"{path.name} uses {used}"


def test_the_attention_kernel_picks_each_kinds_own_constants():
    # KIND != KV_Q8 ? ..._F16 : ... once gave bf16 the f16 values in the kernel and the
    # q8 ones in the MLX launcher: the kernel names no per-kind constant directly.
    text = (ROOT / "hip" / "kvcache.hip").read_text()
    for name in launch_constants():
        if name.endswith(tuple(f"_{s}" for s in KV_SUFFIX.values())):
            assert not re.search(rf"\b{name}\b", text), name
    assert "PKV_ATTN_OF_KIND(PKV_ATTN_PARTITION, KIND)" in text
    assert "PKV_ATTN_OF_KIND(PKV_ATTN_MIN_BLOCKS, KIND)" in text


def test_every_ctypes_launcher_uses_the_header_values():
    for kv_dtype in KV_SUFFIX:
        assert kvcache.ATTN_PARTITION_TOKENS[kv_dtype] == attn_partition_tokens(kv_dtype)
        assert kvcache.ATTN_MIN_BLOCKS[kv_dtype] == attn_min_blocks(kv_dtype)
    for pair in kvcache.QUANT_KV_DTYPES:  # compressed K/V pairs: one setting (PKV_*_QKV)
        assert kvcache.ATTN_PARTITION_TOKENS[pair] == launch_constant("PKV_ATTN_PARTITION_QKV")
        assert kvcache.ATTN_MIN_BLOCKS[pair] == launch_constant("PKV_ATTN_MIN_BLOCKS_QKV")
    # and their NVIDIA _mma kernels' own
    assert kvcache.ATTN_PARTITION_TOKENS_QKV_MMA == launch_constant("PKV_ATTN_PARTITION_QKV_MMA")
    assert kvcache.ATTN_MIN_BLOCKS_QKV_MMA == launch_constant("PKV_ATTN_MIN_BLOCKS_QKV_MMA")
    assert set(kvcache.KV_DTYPES) == set(KV_SUFFIX)
    assert set(kvcache.ATTN_PARTITION_TOKENS) == set(KV_SUFFIX) | set(kvcache.QUANT_KV_DTYPES)
    assert kvcache.ATTN_THREADS == launch_constant("PKV_ATTN_THREADS")
    assert weights.GEMV_THREADS == launch_constant("PKV_GEMV_THREADS")
    assert weights.DEQUANT_SPAN == launch_constant("PKV_DEQUANT_SPAN")
    assert weights.DEQUANT_THREADS == launch_constant("PKV_DEQUANT_THREADS")
    assert weights.GEMV_MMA_ROWS == launch_constant("PKV_GEMV_MMA_ROWS")
    assert weights.GEMV_MMA_MAX_WARPS == launch_constant("PKV_GEMV_MMA_MAX_WARPS")
    assert weights.GEMV_X_WORDS == launch_constant("PKV_GEMV_X_WORDS")
    assert decode.NORM_THREADS == launch_constant("PKV_NORM_THREADS")
    assert [gemv_rows_per_block(b) for b in weights.GEMV_BATCHES] == [
        launch_constant("PKV_GEMV_ROWS_B2")] * 2 + [launch_constant("PKV_GEMV_ROWS_B8")] * 2


def test_the_metal_launcher_uses_the_header_values():
    metal = pytest.importorskip("pagedkv.kernels.mlx.metal")
    simd = launch_constant("PKV_METAL_SIMD_WIDTH")
    assert metal.ATTN_PARTITION_TOKENS == launch_constant("PKV_METAL_ATTN_PARTITION")
    assert metal.ATTN_THREADS == launch_constant("PKV_METAL_ATTN_SIMDGROUPS") * simd
    assert metal.GEMV_THREADS == launch_constant("PKV_METAL_GEMV_SIMDGROUPS") * simd
    assert metal.GEMV_ROWS_PER_THREADGROUP == (launch_constant("PKV_METAL_GEMV_ROWS")
                                               * launch_constant("PKV_METAL_GEMV_SIMDGROUPS"))


@pytest.mark.parametrize("kv_dtype", list(KV_SUFFIX))
def test_attention_shared_memory_holds_a_partition_of_scores(kv_dtype):
    gmax = kvcache.attention_group_slots(32, 8)
    assert gmax == 4 and kvcache.attention_group_slots(24, 8) == 4
    assert kvcache.attention_shared_bytes(kv_dtype, gmax, 128, warp_size=32) == \
        4 * max(attn_partition_tokens(kv_dtype) * 4, 4 * 4 * 128)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.compile_ahead("ptx:kvcache")
def test_the_compiled_attention_kernels_match_the_launch_tables(compiled_ahead):
    """Per kind, the PTX of hip/kvcache.hip has ``.minnctapersm`` = the launchers' minimum
    blocks and a ``rows[PARTITION]`` table of int64 = the launchers' partition tokens."""
    text = compiled_ahead.output("ptx:kvcache").read_text()
    kinds = {"f16": 0, "bf16": 1, "q8": 2}  # KvKind in kvcache.hip
    for kv_dtype, short in kvcache.KV_DTYPES.items():
        for gmax in (1, 2, 4, 8):
            entry = text.split(f".entry pkv_paged_attention_{short}_g{gmax}(", 1)[1]
            entry = entry.split(".entry ", 1)[0]
            blocks = re.search(r"\.minnctapersm (\d+)", entry)
            assert blocks is not None and int(blocks.group(1)) == \
                kvcache.ATTN_MIN_BLOCKS[kv_dtype], (kv_dtype, gmax)
            assert re.search(rf"\.maxntid {kvcache.ATTN_THREADS}, 1, 1", entry)
            # the entry names its partition instantiation; that instantiation's shared
            # table is declared once in the module (before the first entry using it: the
            # q8 and q8cc kernels of 8 heads per KV head share one instantiation)
            used = set(re.findall(rf"(paged_attention_partitionILi{kinds[short]}ELi{gmax}"
                                  r"ELb[01]E\w*?)E4rows", entry))
            rows = [r for inst in used
                    for r in re.findall(rf"{inst}E4rows\[(\d+)\]", text)]
            assert rows and {int(r) for r in rows} == \
                {8 * kvcache.ATTN_PARTITION_TOKENS[kv_dtype]}, (kv_dtype, gmax, rows)
    # the compressed pairs' partitions: MMA_OK instantiations (template argument true) hold
    # the _mma partition's rows, the CUDA-core ones the pairs' (sm_80+ PTX: MMA_OK needs GMAX <= 4)
    quant = re.findall(r"paged_attention_quant_partitionILi\d+ELi\d+ELi\d+ELi\d+ELi(\d)ELb([01])E"
                       r"\w*?E4rows\[(\d+)\]", text)
    assert len(quant) > 100, len(quant)  # every pair, both kernels, 4 group sizes
    by_mma = {}
    for gmax, mma, n in quant:
        by_mma.setdefault(mma, set()).add(int(n))
        assert mma == "0" or int(gmax) <= 4, (gmax, mma)
    pair = kvcache.QUANT_KV_DTYPES[0]
    assert by_mma == {"1": {8 * kvcache.ATTN_PARTITION_TOKENS_QKV_MMA},
                      "0": {8 * kvcache.ATTN_PARTITION_TOKENS[pair]}}
