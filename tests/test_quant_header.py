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


@pytest.mark.parametrize("compiler", ["nvcc", "hipcc"])
def test_header_compiles_as_device_code(tmp_path, compiler):
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not found")
    _compile(tmp_path, [compiler], DEVICE_SOURCE, ".cu")
