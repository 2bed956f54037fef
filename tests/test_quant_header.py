"""pagedkv/quant.h is one text for C, C++ and the CUDA/HIP kernels: it must compile cleanly
with each toolchain present (the GPU compilers are optional and skipped when absent)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import pagedkv

DEVICE_SOURCE = r"""
#include <pagedkv/quant.h>
__global__ void quant_h_smoke(const uint8_t *raw, float *out) {
    unsigned i = threadIdx.x;
    float y[256];
    uint8_t q[256];
    out[i] = pkv_hfq_decode_elem(raw, 4, i) + pkv_mqv2_decode_elem(raw, 4, i)
           + pkv_mq4c_decode_elem(raw, i) + pkv_q8f16_decode_elem(raw, i % 32)
           + pkv_sign1(i) * pkv_sign2(i) + pkv_f16_to_f32(pkv_f16_trunc(out[i]))
           + pkv_bf16_to_f32(pkv_f16_rne(1.0f));
    pkv_fwht(out, y, 256);
    pkv_ifwht(y, y, 256);
    pkv_hfq_encode_group(y, 256, 4, 256, q, (uint8_t *)out);
    pkv_mqv2_encode_group(y, 4, q, (uint8_t *)out);
    pkv_q8f16_encode_group(y, 32, (uint8_t *)out);
}
"""
HOST_SOURCE = "#include <pagedkv/quant.h>\nint main(void) { return (int)pkv_f16_trunc(1.0f) != 0x3C00; }\n"

# The per-element accessors (what GPU kernels call per thread) must agree with the
# group decoders the CPU codecs use, and the table-free FWHT with the table one.
# Exit status: 0 when all agree, else the number of the failed check.
SELF_CHECK_SOURCE = r"""
#include <pagedkv/quant.h>
#include <stdio.h>
#include <string.h>

static uint32_t rng_state = 12345u;
static uint32_t next_u32(void) { rng_state = rng_state * 1664525u + 1013904223u; return rng_state; }
static float next_f32(void) { return ((float)(next_u32() >> 8) / 16777216.0f - 0.5f) * 8.0f; }

int main(void) {
    float x[256], r[256], a[256], b[256], s1[256], s2[256];
    uint8_t blk[300], q[256], p[256];
    for (int trial = 0; trial < 200; ++trial) {
        for (int i = 0; i < 256; ++i) x[i] = next_f32();
        /* 1: packed sign words == generator */
        pkv_signs_generate(PKV_SIGNS1_SEED, 256, s1);
        pkv_signs_generate(PKV_SIGNS2_SEED, 256, s2);
        for (uint32_t i = 0; i < 256; ++i)
            if (pkv_sign1(i) != s1[i] || pkv_sign2(i) != s2[i]) return 1;
        /* 2: table-free fwht/ifwht == table versions, bit for bit */
        pkv_fwht(x, a, 256);
        pkv_fwht_with_tables(x, b, 256, s1, s2);
        if (memcmp(a, b, sizeof a)) return 2;
        pkv_ifwht(x, a, 256);
        pkv_fwht_with_tables(x, b, 256, s2, s1);
        if (memcmp(a, b, sizeof a)) return 2;
        /* 3: generic butterflies == the 256-specialised schedule */
        memcpy(a, x, sizeof a); memcpy(b, x, sizeof b);
        pkv_fwht_butterflies(a, 256); pkv_fwht256_butterflies(b);
        if (memcmp(a, b, sizeof a)) return 3;
        for (uint32_t bits = 1; bits <= 8; ++bits) {
            /* 4: pack -> unpack_codes / unpack_code round trip, every width */
            for (int i = 0; i < 256; ++i) q[i] = (uint8_t)(next_u32() & ((1u << bits) - 1u));
            memset(p, 0, sizeof p);
            pkv_pack_codes(q, 256, bits, p);
            uint8_t u[256];
            pkv_unpack_codes(p, 256, bits, u);
            for (uint32_t j = 0; j < 256; ++j)
                if (u[j] != q[j] || pkv_unpack_code(p, j, bits) != q[j]) return 4;
        }
        pkv_fwht(x, r, 256);
        for (uint32_t bits = 2; bits <= 6; ++bits) {
            /* 5: v1 element accessor == group decode (G 256 and 128) */
            for (uint32_t G = 128; G <= 256; G += 128) {
                pkv_hfq_encode_group(x, G, bits, G, q, blk);
                pkv_hfq_decode_group(blk, bits, G, q, a);
                for (uint32_t i = 0; i < G; ++i)
                    if (pkv_hfq_decode_elem(blk, bits, i) != a[i]) return 5;
            }
            /* 6: V2 element accessor == group decode */
            pkv_mqv2_encode_group(r, bits, q, blk);
            pkv_mqv2_decode_group(blk, bits, q, a);
            for (uint32_t i = 0; i < 256; ++i)
                if (pkv_mqv2_decode_elem(blk, bits, i) != a[i]) return 6;
        }
        /* 7: MQ4C and Q8F16 element accessors */
        pkv_mq4c_encode_group(r, q, blk);
        pkv_mq4c_decode_group(blk, q, a);
        for (uint32_t i = 0; i < 256; ++i) if (pkv_mq4c_decode_elem(blk, i) != a[i]) return 7;
        if (blk[4] | blk[5] | blk[6] | blk[7]) return 7;
        pkv_q8f16_encode_group(x, 32, blk);
        pkv_q8f16_decode_group(blk, a);
        for (uint32_t i = 0; i < 32; ++i) if (pkv_q8f16_decode_elem(blk, i) != a[i]) return 7;
        /* 8: f16 widen(trunc(v)) never grows |v|; rne within half an ulp of trunc */
        for (int i = 0; i < 256; ++i) {
            float v = x[i] * 1000.0f, t = pkv_f16_to_f32(pkv_f16_trunc(v));
            if ((t < 0 ? -t : t) > (v < 0 ? -v : v)) return 8;
        }
    }
    return 0;
}
"""


def _compile(tmp_path: Path, argv: list[str], source: str, suffix: str) -> None:
    src = tmp_path / f"quant_h{suffix}"
    src.write_text(source)
    cmd = argv + [f"-I{pagedkv.get_include()}", "-c", str(src), "-o", str(tmp_path / "out.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv,suffix", [
    (["cc", "-std=c11", "-Wall", "-Wextra", "-Wpedantic", "-Werror"], ".c"),
    (["c++", "-std=c++17", "-Wall", "-Wextra", "-Werror"], ".cpp"),
])
def test_header_compiles_as_c_and_cxx(tmp_path, argv, suffix):
    if shutil.which(argv[0]) is None:
        pytest.skip(f"{argv[0]} not found")
    _compile(tmp_path, argv, HOST_SOURCE, suffix)


def test_element_accessors_agree_with_group_decoders(tmp_path):
    """Runs the portable text as C: the per-element decoders GPU kernels use equal the
    group decoders, the table-free FWHT equals the table one, packing round-trips."""
    if shutil.which("cc") is None:
        pytest.skip("cc not found")
    src = tmp_path / "self_check.c"
    src.write_text(SELF_CHECK_SOURCE)
    exe = tmp_path / "self_check"
    build = subprocess.run(["cc", "-std=c11", "-O1", "-ffp-contract=off", "-Wall", "-Werror",
                            f"-I{pagedkv.get_include()}", str(src), "-o", str(exe)],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"self-check {run.returncode} failed"


@pytest.mark.parametrize("compiler", ["nvcc", "hipcc"])
def test_header_compiles_as_device_code(tmp_path, compiler):
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not found")
    _compile(tmp_path, [compiler], DEVICE_SOURCE, ".cu")
