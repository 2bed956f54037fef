"""Proof that compute-sanitizer sees kernels launched through pagedkv's ctypes loader.

A kernel whose last thread writes one element past its buffer is compiled with nvcc, loaded
with ``Device.load_module`` and launched like every pagedkv kernel. Under
``compute-sanitizer --tool memcheck --error-exitcode 86`` the ``--plant`` run must exit 86
(the write was seen); the ``--clean`` run (every thread in bounds) must exit 0. Without
this, "0 errors" from the sanitizer over the GPU tests could mean it never saw a launch.
``hip/device_check.sh`` runs both before the sanitized GPU tests (docs/development.md,
"GPU tests").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SOURCE = r"""
extern "C" __global__ void probe_fill(float *out, int n, int overshoot) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n + overshoot) out[i] = (float)i;
}
"""
N = 1 << 20  # a whole allocation granule, so the one-past-the-end write lands out of bounds


def build(arch: str, tmp: Path) -> bytes:
    src, out = tmp / "probe.cu", tmp / "probe.cubin"
    src.write_text(SOURCE)
    subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-O1", str(src), "-o", str(out)],
                   check=True)
    return out.read_bytes()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hip/sanitizer_probe.py", description=__doc__)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--plant", action="store_true", help="write one element past the end")
    mode.add_argument("--clean", action="store_true", help="stay in bounds")
    args = ap.parse_args(argv)

    from pagedkv.errors import NoDeviceError
    from pagedkv.kernels import open_device
    try:
        dev = open_device()
    except NoDeviceError as exc:
        print(f"hip/sanitizer_probe.py: {exc}", file=sys.stderr)
        return 2
    if dev.backend != "cuda":
        print("hip/sanitizer_probe.py: needs an NVIDIA device (nvcc + compute-sanitizer)",
              file=sys.stderr)
        return 2
    major_minor = dev.properties.arch  # e.g. "sm_90"
    with tempfile.TemporaryDirectory() as tmp:
        dev.load_module("sanitizer_probe", build(major_minor, Path(tmp)))
    kernel = dev.kernel("sanitizer_probe", "probe_fill", "pii")
    out = dev.empty(N, np.float32)
    overshoot = 1 if args.plant else 0
    kernel(((N + overshoot + 255) // 256,), (256,), out, N, overshoot)
    dev.synchronize()
    got = out.to_numpy()
    assert np.array_equal(got, np.arange(N, dtype=np.float32)), "probe kernel wrote wrong values"
    print(f"sanitizer probe: launched probe_fill with overshoot={overshoot} on {dev!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
