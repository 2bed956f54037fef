"""The CPU kernels of the prepared GEMV and the decoders, built from their headers in a C
harness: every kernel this CPU runs, every x86-64 level and (under qemu, where a cross
compiler and qemu-aarch64 are installed) arm64 with and without sdot print the same bits.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

import pagedkv
from kernels_support import quant_header_dir

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include "cpu_simd.h"
#undef PKV_CPU_CLONES
#define PKV_CPU_CLONES
#if !DECODERS_ONLY
#include "prepared_gemv_loops.h"
#include "prepared_gemv_pack.h"
#endif
#include "raw_decode_loops.h"
#include "affine_loops.h"
#include "fwht_loops.h"
#include "mq_decode_loops.h"
#include "kv_rotated_loops.h"

static uint32_t st = 12345u;
static uint32_t next_u32(void) { st = st * 1103515245u + 12345u; return st; }
static float rnd(void) { return (float)((int32_t)(next_u32() >> 8) - (1 << 23)) / (float)(1 << 22); }
static uint64_t fold(const void *p, size_t n) {
    const uint8_t *b = p; uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; ++i) { h ^= b[i]; h *= 1099511628211ull; }
    return h;
}

#if !DECODERS_ONLY
/* prepared GEMV: every format geometry, every supported kernel, batches 1..11
 * (family -1: Q8F16, -2: Q4K as arbitrary bytes with finite d and dmin) */
static void gemv_formats(void) {
    static const int fmts[][3] = {{0,4,256},{0,4,128},{1,4,256},{2,4,256},{3,4,256},{0,2,256},
                                  {0,3,128},{2,3,256},{0,6,256},{2,5,256},{2,6,256},{-1,8,32},
                                  {-2,4,256}};
    const ptrdiff_t M = 37, K = 512, NB = 11;
    for (size_t f = 0; f < sizeof fmts / sizeof fmts[0]; ++f) {
        int family = fmts[f][0]; uint32_t bits = (uint32_t)fmts[f][1], G = (uint32_t)fmts[f][2];
        int q8 = family == -1, q4k = family == -2;
        size_t B = q8 ? PKV_Q8F16_GROUP_BYTES : q4k ? PKV_Q4K_GROUP_BYTES
                                                   : PKV_AFFINE_GROUP_BYTES(bits, G);
        ptrdiff_t groups = M * K / G;
        uint8_t *raw = malloc(groups * B), q[256];
        float wbuf[256];
        for (ptrdiff_t g = 0; g < groups; ++g) {
            float amp = 0.01f + (float)(g % 7);
            for (uint32_t i = 0; i < G; ++i) wbuf[i] = rnd() * amp;
            uint8_t *blk = raw + g * B;
            if (q4k) {
                for (size_t i = 0; i < B; ++i) blk[i] = (uint8_t)next_u32();
                pkv_store_u16le(blk, pkv_f16_trunc(0.001f * amp));
                pkv_store_u16le(blk + 2, pkv_f16_trunc(0.002f * amp));
            } else if (q8) pkv_q8f16_encode_group(wbuf, 32, blk);
            else if (family == PKV_FAMILY_MQ_V2) pkv_mqv2_encode_group(wbuf, bits, q, blk);
            else if (family == PKV_FAMILY_MQ4C) pkv_mq4c_encode_group(wbuf, q, blk);
            else pkv_hfq_encode_group(wbuf, G, bits, G, q, blk);
        }
        int kind = q8 ? PKV_PGEMV_SBYTE : q4k ? PKV_PGEMV_NIBBLE32
                 : bits <= 4 ? PKV_PGEMV_NIBBLE : PKV_PGEMV_UBYTE;
        uint32_t span = q8 || q4k ? 32u : family == PKV_FAMILY_MQ_V2 ? 128u : G;
        int param = q4k ? PKV_PG_PARAM_U8X8
                  : q8 || family == PKV_FAMILY_MQ_V2 || family == PKV_FAMILY_MQ4C
                  ? PKV_PG_PARAM_F16 : PKV_PG_PARAM_F32;
        ptrdiff_t tiles = (M + 15) / 16, ns = K / span;
        uint8_t *codes = calloc((size_t)tiles * ns * 16 * pkv_pgemv_span_row_bytes(kind, span), 1);
        size_t np = (size_t)tiles * ns * 16;
        size_t psz = param == PKV_PG_PARAM_F16 ? 2 : param == PKV_PG_PARAM_U8X8 ? 1 : 4;
        void *scales = calloc(np, psz), *mins = calloc(np, psz);
        float *factors = calloc(np / 8 * 2, 4);      /* Q4K: d, then -dmin, per 8 spans */
        if (q8) pkv_pgemv_pack_q8f16(raw, 0, M, K, codes, scales);
        else if (q4k) pkv_pgemv_pack_q4k(raw, 0, M, K, codes, scales, mins, factors, factors + np / 8);
        else pkv_pgemv_pack_affine(raw, 0, M, K, family, bits, G, codes, scales, mins);
        pkv_pgemv_w w = {codes, scales, q8 ? NULL : mins, q4k ? factors : NULL,
                         q4k ? factors + np / 8 : NULL, M, K, tiles, ns, span, kind, param,
                         q8 ? 0 : (int32_t)(1u << (bits - 1))};
        float *x = malloc(NB * K * 4), *dx = malloc(NB * ns * 4), *xs = malloc(NB * ns * 4);
        float *y = malloc(NB * M * 4);
        const ptrdiff_t ldx = pkv_pgemv_x_stride(K);
        int8_t *xq = malloc(NB * ldx);
        int32_t *xqs = malloc(NB * ns * 4);
        for (ptrdiff_t i = 0; i < NB * K; ++i) x[i] = rnd() * (float)(1 + i % 5);
        for (ptrdiff_t b = 0; b < NB; ++b)
            pkv_pgemv_quantize_x(x + b * K, K, span, xq + b * ldx, dx + b * ns, xs + b * ns, xqs + b * ns);
        pkv_pgemv_x xx = {xq, dx, xs, xqs, NB, ldx};
        for (int isa = 0; isa < PKV_ISA_COUNT; ++isa) {
            if (!pkv_pgemv_isa_supported(isa)) continue;
            for (ptrdiff_t nb = 1; nb <= NB; ++nb) {
                xx.nb = nb;
                memset(y, 0xFF, NB * M * 4);
                pkv_pgemv_tiles(&w, &xx, y, M, 0, tiles, isa);
                printf("gemv %zu %td %016llx %s\n", f, nb,
                       (unsigned long long)fold(y, nb * M * 4), pkv_pgemv_isa_names[isa]);
            }
        }
        free(raw); free(codes); free(scales); free(mins); free(factors); free(x); free(dx); free(xs);
        free(y);
        free(xq); free(xqs);
    }
}
#endif

/* MQ 4-bit groups to the original basis: the one-pass kernels against decode + Rᵀ */
static void mq_decode(void) {
    enum { NG = 96 };
    static uint8_t raw[NG * 136];
    static float ref[NG * 256], s2[256], s1[256];
    static float got[NG * 256] __attribute__((aligned(64)));   /* streaming stores */
    st = 777u;
    for (uint32_t i = 0; i < 256; ++i) { s2[i] = pkv_sign2(i); s1[i] = pkv_sign1(i) * 0.0625f; }
    pkv_mqd_init_tables();
    for (int family = 1; family <= 3; ++family) {
        for (size_t i = 0; i < sizeof raw; ++i) raw[i] = (uint8_t)next_u32();
        for (int g = 0; g < NG; ++g) {         /* finite headers, some extreme */
            uint8_t *h = raw + 136 * g;
            float sc = g % 5 == 0 ? 1e-7f : g % 7 == 0 ? 3e3f : 0.01f * (float)(1 + g % 9);
            if (family == 1) { pkv_store_f32le(h, sc); pkv_store_f32le(h + 4, rnd() * 100.0f); }
            else for (int j = 0; j < 4; ++j)
                pkv_store_u16le(h + 2 * j, pkv_f16_trunc(j % 2 ? rnd() : sc));
            if (family == 3) pkv_store_u32le(h + 4, 0u);
        }
        pkv_cpu_affine_decode_groups(raw, NG, family, 4u, 256u, ref);
        pkv_cpu_fwht256_rows(ref, ref, NG, s2, s1);
        printf("mqref %d %016llx\n", family, (unsigned long long)fold(ref, sizeof ref));
#if defined(PKV_MQD_HAVE_X86)
        const unsigned feat = pkv_cpu_features();
        if (feat & PKV_CPU_AVX2) {
            for (int stream = 0; stream < 2; ++stream) {
                memset(got, 0, sizeof got);
                pkv_mqd_groups_avx2(raw, NG, family, 136, got, stream);
                printf("mq %d avx2 %d %d\n", family, stream, memcmp(got, ref, sizeof ref) == 0);
            }
        }
        if (feat & PKV_CPU_AVX512) {
            for (int stream = 0; stream < 2; ++stream) {
                memset(got, 0, sizeof got);
                pkv_mqd_groups_avx512(raw, NG, family, 136, got, stream);
                printf("mq %d avx512 %d %d\n", family, stream, memcmp(got, ref, sizeof ref) == 0);
            }
        }
#endif
    }
}

/* the cloned Q8F16 and half decoders (this build's -march level) */
static void raw_decoders(void) {
    enum { NB = 40 };
    static uint8_t raw[NB * 34];
    static uint16_t h[NB * 32];
    static float out[NB * 32];
    st = 4242u;
    for (size_t i = 0; i < sizeof raw; ++i) raw[i] = (uint8_t)next_u32();
    for (int b = 0; b < NB; ++b) pkv_store_u16le(raw + 34 * b, pkv_f16_trunc(rnd()));
    pkv_cpu_q8f16_decode_blocks(raw, NB, out);
    printf("q8 %016llx\n", (unsigned long long)fold(out, sizeof out));
    for (size_t i = 0; i < NB * 32; ++i) h[i] = (uint16_t)next_u32();
    pkv_cpu_f16_to_f32(h, NB * 32, out);
    printf("f16 %016llx\n", (unsigned long long)fold(out, sizeof out));
    pkv_cpu_bf16_to_f32(h, NB * 32, out);
    printf("bf16 %016llx\n", (unsigned long long)fold(out, sizeof out));
}

/* the rotated KV modes' encoders (this build's -march level) against the scalar
 * reference: a zero row, a row of f16 subnormals, then random rows */
static void kv_encode(void) {
    static const uint32_t modes[][2] = {
        {PKV_KV_MODE_FWHT4, 128u}, {PKV_KV_MODE_FWHT2, 128u}, {PKV_KV_MODE_FWHT4, 256u},
        {PKV_KV_MODE_FWHT3, 256u}, {PKV_KV_MODE_FWHT2, 256u}, {PKV_KV_MODE_LLOYD4, 256u},
        {PKV_KV_MODE_LLOYD3, 256u}, {PKV_KV_MODE_LLOYD2, 256u}};
    static uint16_t x[24 * 256];
    static uint8_t vec[24 * 256], ref[24 * 256];
    st = 99u;
    for (size_t i = 0; i < 24 * 256; ++i)
        x[i] = (uint16_t)((0x2800u + (next_u32() >> 20)) | (next_u32() & 0x8000u));
    for (size_t i = 0; i < 256; ++i) { x[i] = 0; x[256 + i] = (uint16_t)(1u + (next_u32() & 0x3FFu)); }
    for (size_t m = 0; m < sizeof modes / sizeof modes[0]; ++m) {
        const uint32_t mode = modes[m][0], hd = modes[m][1], rows = 24u * 256u / hd;
        const size_t n = (size_t)rows * pkv_kv_row_bytes(mode, hd);
        pkv_cpu_kv_encode_rows_reference(NULL, x, rows, hd, mode, ref);
        memset(vec, 0xAB, sizeof vec);
        pkv_cpu_kv_encode_rows(NULL, x, rows, hd, mode, vec);
        printf("kv %u %u %016llx %d\n", mode, hd, (unsigned long long)fold(vec, n),
               memcmp(vec, ref, n) == 0);
    }
}

int main(void) {
#if defined(__x86_64__)
    /* read once and kept: the cached bits are CPUID's */
    const unsigned f0 = pkv_cpu_features(), f1 = pkv_cpu_features();
    printf("features %d\n", f0 == f1 && f0 == pkv_cpu_features_read());
#endif
#if !DECODERS_ONLY
    gemv_formats();
#endif
    mq_decode();
    raw_decoders();
    kv_encode();
    return 0;
}
"""


def _build(tmp_path: Path, name: str, cc: list[str], decoders_only: bool = False) -> Path:
    quant_dir = quant_header_dir()
    if quant_dir is None:
        pytest.skip("private loop headers are neither installed nor in a source tree here")
    src = tmp_path / "harness.c"
    src.write_text(HARNESS)
    exe = tmp_path / name
    # -O1: the kernels are intrinsics in a fixed order, so the level changes no bit and
    # -O1 builds the unrolled kernels in half the time
    build = subprocess.run(
        [*cc, "-std=gnu11", "-O1", "-ffp-contract=off", "-fno-trapping-math",
         f"-DDECODERS_ONLY={int(decoders_only)}", f"-I{pagedkv.get_include()}",
         f"-I{quant_dir}", str(src), "-o", str(exe), "-lm"],
        capture_output=True, text=True, check=False, timeout=600)
    assert build.returncode == 0, build.stderr
    return exe


def _run(exe: Path, prefix: list[str]) -> list[str]:
    out = subprocess.run([*prefix, str(exe)], capture_output=True, text=True, check=False,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _gemv_hashes(lines: list[str]) -> dict[tuple[str, str], set[str]]:
    """(format, batch) -> the result hashes of every kernel that ran."""
    got: dict[tuple[str, str], set[str]] = {}
    for line in lines:
        if line.startswith("gemv "):
            _, fmt, nb, digest, _isa = line.split()
            got.setdefault((fmt, nb), set()).add(digest)
    return got


@pytest.fixture(scope="module")
def x86_lines(tmp_path_factory) -> list[str]:
    """The full harness at the baseline level (the kernels pick themselves at run time)."""
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("gcc") is None:
        pytest.skip("x86-64 with gcc only")
    tmp = tmp_path_factory.mktemp("x86")
    return _run(_build(tmp, "h_x86-64", ["gcc", "-march=x86-64"]), [])


def test_every_kernel_and_x86_level_gives_the_same_bits(x86_lines, tmp_path):
    base = x86_lines
    hashes = _gemv_hashes(base)
    assert len(hashes) == 13 * 11
    assert all(len(v) == 1 for v in hashes.values()), "kernels disagree"
    kernels = {line.split()[-1] for line in base if line.startswith("gemv ")}
    assert "scalar" in kernels
    # the one-pass MQ decoders reproduce decode + inverse FWHT bit for bit
    assert "features 1" in base
    kv = [line for line in base if line.startswith("kv ")]
    assert len(kv) == 8 and all(line.endswith(" 1") for line in kv), kv   # = the reference
    mq = [line for line in base if line.startswith("mq ")]
    assert mq and all(line.endswith(" 1") for line in mq), mq
    if "avx2" in kernels:       # plain and streaming stores
        assert {line.split()[3] for line in mq if line.split()[2] == "avx2"} == {"0", "1"}
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    decoders = [line for line in base if not line.startswith("gemv ")]
    for march, needs in (("x86-64-v3", ("avx2", "fma")), ("x86-64-v4", ("avx512bw",))):
        if all(f in flags for f in needs):
            # the cloned decoders built for a higher level print the same bits
            exe = _build(tmp_path, f"h_{march}", ["gcc", f"-march={march}"], decoders_only=True)
            assert _run(exe, []) == decoders, march


def test_arm64_with_and_without_sdot_matches_x86(x86_lines, tmp_path):
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cross is None or qemu is None:
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64")
    exe = _build(tmp_path, "h_arm64", [cross, "-static"])
    shared = ("mqref", "q8 ", "f16 ", "bf16 ", "kv ")
    for cpu, kernels in (("max", {"scalar", "neon-dotprod"}), ("cortex-a53", {"scalar"})):
        lines = _run(exe, [qemu, "-cpu", cpu])
        assert {line.split()[-1] for line in lines if line.startswith("gemv ")} == kernels
        assert _gemv_hashes(lines) == _gemv_hashes(x86_lines), cpu
        # arm64 decodes MQ in two passes; that reference and the raw decoders print the
        # bits x86 printed
        assert [ln for ln in lines if ln.startswith(shared)] == [
            ln for ln in x86_lines if ln.startswith(shared)]
