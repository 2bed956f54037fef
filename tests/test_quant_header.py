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
#include <math.h>
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
        /* 9: q8 rounding vs libm: half away from zero (roundf) and half to even (rintf),
         * on random values and on exact halves */
        for (int i = 0; i < 256; ++i) {
            float v = i < 128 ? x[i] * 40.0f : (float)(i - 192) + 0.5f;
            float ra = roundf(v), re = rintf(v);
            int32_t qa = ra < -128.0f ? -128 : ra > 127.0f ? 127 : (int32_t)ra;
            int32_t qe = re < -127.0f ? -127 : re > 127.0f ? 127 : (int32_t)re;
            if (pkv_round_q8(v) != qa || pkv_round_q8_kv(v) != qe) return 9;
        }
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
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)
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
                            f"-I{pagedkv.get_include()}", str(src), "-o", str(exe), "-lm"],
                           capture_output=True, text=True, check=False, timeout=120)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=False, timeout=120)
    assert run.returncode == 0, f"self-check {run.returncode} failed"


# The CPU loop headers with the clones disabled, built once per x86-64 level: every
# level must print the same bits (gemv, FWHT, group decode), as cpu_simd.h promises.
ISA_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include "cpu_simd.h"
#undef PKV_CPU_CLONES
#define PKV_CPU_CLONES
#include "gemv_loops.h"
#include "fwht_loops.h"
#include "affine_loops.h"

static uint32_t st = 99u;
static uint32_t next_u32(void) { st = st * 1664525u + 1013904223u; return st; }
static float next_f32(void) { return ((float)(next_u32() >> 8) / 16777216.0f - 0.5f) * 4.0f; }
static uint64_t fold(const float *v, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; ++i) { h ^= pkv_f32_bits(v[i]); h *= 1099511628211ull; }
    return h;
}

int main(void) {
    enum { M = 8, K = 512 };
    static uint8_t w[M * K];                  /* big enough for every width at G 256 */
    static float x[4 * K], xs[4 * K], y[4 * M], rows[16 * 256], s1[256], s2[256], out[M * K];
    for (size_t i = 0; i < sizeof w; ++i) w[i] = (uint8_t)next_u32();
    for (int i = 0; i < 4 * K; ++i) { x[i] = next_f32(); xs[i] = next_f32(); }
    for (int i = 0; i < 16 * 256; ++i) rows[i] = next_f32();
    for (uint32_t i = 0; i < 256; ++i) { s1[i] = pkv_sign1(i); s2[i] = pkv_sign2(i) * 0.0625f; }
    for (int family = 0; family < 4; ++family)
        for (uint32_t bits = 2; bits <= 6; ++bits) {
            if (family == 3 && bits != 4) continue;
            /* finite headers for this layout (random codes stay random); a NaN
             * header would make the bits depend on NaN payload propagation */
            for (uint32_t g = 0; g < (uint32_t)(M * K / 256); ++g) {
                uint8_t *h = w + (8u + 32u * bits) * g;
                if (family < 2) {
                    pkv_store_f32le(h, 0.01f + 0.001f * (float)(g % 7));
                    pkv_store_f32le(h + 4, next_f32());
                } else {
                    for (int j = 0; j < 4; ++j) pkv_store_u16le(h + 2 * j, pkv_f16_trunc(next_f32()));
                }
            }
            pkv_cpu_gemv_affine(w, M, K, bits, 256u, family, x, xs, 3, y);
            printf("gemv %d %u %016llx\n", family, bits, (unsigned long long)fold(y, 3 * M));
            pkv_cpu_affine_decode_groups(w, M * K / 256 / 2, family, bits, 256u, out);
            printf("decode %d %u %016llx\n", family, bits,
                   (unsigned long long)fold(out, (size_t)M * K / 2));
        }
    pkv_cpu_gemv_q8f16(w, M, K, x, 3, y);
    printf("q8 %016llx\n", (unsigned long long)fold(y, 3 * M));
    pkv_cpu_fwht256_rows(rows, rows, 16, s1, s2);
    printf("fwht %016llx\n", (unsigned long long)fold(rows, 16 * 256));
    return 0;
}
"""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_every_isa_level_gives_the_same_bits(tmp_path):
    import platform
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("gcc") is None:
        pytest.skip("x86-64 with gcc only")
    flags = _cpu_flags()
    levels = ["x86-64"]
    if {"avx2", "fma", "bmi2"} <= flags:
        levels.append("x86-64-v3")
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        levels.append("x86-64-v4")
    if len(levels) < 2:
        pytest.skip("only one x86-64 level runs on this CPU")
    # The loop headers are private (not installed): use the package's own folder in an
    # editable install, else the source tree next to these tests (a clone, as in CI).
    candidates = [Path(pagedkv.__file__).resolve().parent / "quant",
                  Path(__file__).resolve().parents[1] / "pkg" / "pagedkv" / "quant"]
    quant_dir = next((d for d in candidates if (d / "gemv_loops.h").exists()), None)
    if quant_dir is None:
        pytest.skip("private loop headers are neither installed nor in a source tree here")
    src = tmp_path / "isa.c"
    src.write_text(ISA_SOURCE)
    outputs = {}
    for level in levels:
        exe = tmp_path / f"isa_{level}"
        build = subprocess.run(
            ["gcc", "-std=gnu11", "-O3", "-ffp-contract=off", "-fno-trapping-math",
             f"-march={level}", f"-I{pagedkv.get_include()}", f"-I{quant_dir}", str(src),
             "-o", str(exe)], capture_output=True, text=True, check=False, timeout=300)
        assert build.returncode == 0, build.stderr
        run = subprocess.run([str(exe)], capture_output=True, text=True, check=False, timeout=60)
        assert run.returncode == 0
        outputs[level] = run.stdout
    assert outputs["x86-64"].count("\n") == 34       # 3 families x 5 widths x 2 + MQ4C 2 + q8 + fwht
    for level in levels[1:]:
        assert outputs[level] == outputs["x86-64"], level


@pytest.mark.parametrize("compiler", ["nvcc", "hipcc"])
def test_header_compiles_as_device_code(tmp_path, compiler):
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not found")
    _compile(tmp_path, [compiler], DEVICE_SOURCE, ".cu")
