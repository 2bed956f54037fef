"""The x quantization of the int8 tensor-core GEMVs (hip/gemv_prep_x.h) and of the q8i
attention's q (hip/kvcache.hip) takes the largest |x| of a group with absmax_keep_nan
(hip/mma_s8.h), so that a NaN makes the group's step NaN and poisons its batch row. With
fmaxf, which returns the other operand when one is NaN, the step stayed finite and the
Q8F16 tensor-core GEMV gave finite outputs for a NaN row (H100, 2026-12-05; docs/kernels.md,
"HFQ6 and Q8F16 on tensor cores"). The function compiled on the host here (no GPU)."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# mma_s8.h on the host: PKV_DEV plain inline, the one CUDA intrinsic it names stubbed (the
# mma body is __builtin_trap() off the GPU). Folds each line of floats from stdin, prints
# absmax_keep_nan's fold and fmaxf's.
HOST = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#define PKV_DEV static inline
static inline int __float2int_rn(float v) { return (int)std::nearbyint(v); }
#include "mma_s8.h"
int main() {
  int n;
  while (std::scanf("%d", &n) == 1) {
    float keep = 0.0f, fmax_fold = 0.0f;
    for (int i = 0; i < n; ++i) {
      unsigned bits;
      if (std::scanf("%x", &bits) != 1) return 2;
      float v;
      __builtin_memcpy(&v, &bits, 4);
      keep = absmax_keep_nan(keep, v);
      fmax_fold = fmaxf(fmax_fold, fabsf(v));
    }
    std::printf("%.9g %.9g\n", keep, fmax_fold);
  }
  return 0;
}
"""


def _bits(v: float) -> str:
    import struct
    return format(struct.unpack("<I", struct.pack("<f", v))[0], "x")


@pytest.fixture(scope="module")
def fold(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    tmp = tmp_path_factory.mktemp("absmax")
    (tmp / "t.cpp").write_text(HOST)
    exe = tmp / "t"
    subprocess.run([cxx, "-std=c++17", "-O2", f"-I{ROOT / 'hip'}", str(tmp / "t.cpp"), "-o",
                    str(exe)], check=True, capture_output=True, timeout=120)

    def run(rows: list[list[float]]) -> list[tuple[float, float]]:
        text = "".join(f"{len(r)} {' '.join(_bits(v) for v in r)}\n" for r in rows)
        out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True,
                             timeout=60).stdout.split("\n")
        return [tuple(float(w) for w in line.split()) for line in out if line]

    return run


def test_a_nan_anywhere_makes_the_maximum_nan(fold):
    nan, inf = math.nan, math.inf
    rows = [[1.0, -3.5, 2.0], [nan, 1.0, 2.0], [1.0, nan, 5.0], [1.0, 5.0, nan],
            [-inf, 1.0], [nan, inf], [0.0, -0.0], [-7.25]]
    got = fold(rows)
    keep = [g[0] for g in got]
    assert keep[0] == 3.5 and keep[4] == inf and keep[6] == 0.0 and keep[7] == 7.25
    assert all(math.isnan(k) for k in keep[1:4]) and math.isnan(keep[5])
    # what the prep had before: fmaxf drops the NaN wherever it stands
    assert [g[1] for g in got[1:4]] == [2.0, 5.0, 5.0]


def test_the_quantizers_take_their_maximum_with_it():
    for path in ("hip/gemv_prep_x.h", "hip/kvcache.hip"):
        text = (ROOT / path).read_text()
        assert "fmaxf(amax, fabsf(" not in text, path
        assert "amax = absmax_keep_nan(amax, v[" in text, path
