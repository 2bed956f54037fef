"""Compile a hip/ source for an RDNA3 arch (gfx11: the WMMA kernels) to AMDGPU machine code
with the HIP compiler this machine has, where that compiler cannot do it alone.

Debian's HIP 5.2 (hipcc over clang 15) has no gfx11 device library, and LLVM 15's gfx11
code generation stops on WMMA ("Operand has incorrect register class"). Its front end is
fine: it type-checks the source and emits gfx11 LLVM IR. So this script

1. gives hipcc a device-library folder: the installed bitcode plus the one missing piece,
   ``oclc_isa_version_<n>.bc`` (a single constant, written from the arch name), so the HIP
   driver links and inlines ocml/ockl as it does for every other arch;
2. takes hipcc's optimized device IR for the arch (``--cuda-device-only -emit-llvm -O3``);
3. generates the code with a newer LLVM, llvmlite's (numba's LLVM binding, LLVM 20+ with the
   AMDGPU target): the IR's per-function ``target-cpu`` / ``target-features`` are dropped
   (clang 15's gfx11 feature names differ from LLVM 22's, which then drops the kernels as
   "incompatible") and the arch is given to the target machine instead.

The result is each kernel's assembly and its resource use (VGPRs, SGPRs, scratch): what a
code object for the arch would hold, short of linking it (llvmlite has no linker). A newer
ROCm builds gfx1100 code objects directly (meson's ``hip_arches`` probe then finds it).

    python hip/gfx11_codegen.py hip/weights.hip --arch gfx1100 --kernels 'pkv_gemv_mma'
    python hip/gfx11_codegen.py hip/kvcache.hip --json kvcache.gfx1100.json  # for tests
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent


class KernelCode(NamedTuple):
    """One kernel's machine code: its mnemonics counted, and the resources it asks for."""
    name: str
    vgprs: int
    sgprs: int
    scratch_bytes: int
    mnemonics: Counter

    def count(self, prefix: str) -> int:
        """Instructions whose mnemonic starts with ``prefix`` (``v_wmma_i32``)."""
        return sum(n for m, n in self.mnemonics.items() if m.startswith(prefix))


def find_hipcc() -> str | None:
    """``$HIPCC`` or ``hipcc`` on PATH."""
    return os.environ.get("HIPCC") or shutil.which("hipcc")


def installed_device_libs(prefix: Path) -> Path:
    """The folder of ocml.bc / ockl.bc / oclc_*.bc under the HIP installation's ``prefix``:
    ROCm's own layout, or Debian's multiarch one (the same search as hip/meson.build)."""
    for folder in (prefix / "amdgcn" / "bitcode",
                   prefix / "lib" / "x86_64-linux-gnu" / "amdgcn" / "bitcode",
                   prefix / "lib" / "aarch64-linux-gnu" / "amdgcn" / "bitcode"):
        if (folder / "ocml.bc").is_file():
            return folder
    raise FileNotFoundError(f"no ROCm device library (ocml.bc) under {prefix}")


def isa_version(arch: str) -> int:
    """The device library's ISA number of an arch name: gfx1100 -> 11000, gfx1151 -> 11501,
    gfx90a -> 9010 (major, then minor and stepping as hex digits)."""
    m = re.fullmatch(r"gfx(\d+)([0-9a-f])([0-9a-f])", arch)
    if not m:
        raise ValueError(f"not an AMD arch name: {arch!r}")
    return int(m[1]) * 1000 + int(m[2], 16) * 100 + int(m[3], 16)


def _hipcc(hipcc: str, args: list[str], cwd: Path) -> None:
    env = dict(os.environ, HIP_PLATFORM="amd", TMPDIR=str(cwd))
    done = subprocess.run([hipcc, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"hipcc {' '.join(args)} failed:\n{done.stderr[-4000:]}")


def device_libs_for(hipcc: str, arch: str, work: Path) -> tuple[Path, Path]:
    """(the HIP installation's prefix, for --rocm-path; a folder with its device libraries
    plus this arch's ISA-version bitcode, written when the installation lacks it)."""
    prefix = Path(hipcc).resolve().parent.parent  # .../bin/hipcc
    installed = installed_device_libs(prefix)
    folder = work / "device-libs"
    folder.mkdir()
    for bc in installed.glob("*.bc"):
        (folder / bc.name).symlink_to(bc)
    isa_bc = folder / f"oclc_isa_version_{arch[3:]}.bc"
    if not isa_bc.exists():
        # the data layout of this compiler's AMDGPU target, read off a probe's IR
        probe = work / "probe.ll"
        _hipcc(hipcc, [f"--offload-arch={arch}", "-nogpulib", f"--rocm-path={prefix}",
                       "--cuda-device-only", "-emit-llvm", "-S", "-x", "hip", os.devnull,
                       "-o", str(probe)], work)
        layout = re.search(r'^target datalayout = ".*"$', probe.read_text(), re.MULTILINE)
        text = work / "isa.ll"
        text.write_text(f'{layout[0] if layout else ""}\ntarget triple = "amdgcn-amd-amdhsa"\n'
                        f"@__oclc_ISA_version = linkonce_odr protected local_unnamed_addr "
                        f"addrspace(4) constant i32 {isa_version(arch)}, align 4\n")
        _hipcc(hipcc, ["-nogpulib", "--target=amdgcn-amd-amdhsa", "-c", "-emit-llvm",
                       str(text), "-o", str(isa_bc)], work)
    return prefix, folder


def device_ir(source: Path, arch: str, hipcc: str, work: Path,
              defines: tuple[str, ...] = ()) -> str:
    """hipcc's optimized device IR of ``source`` for ``arch``, device libraries linked."""
    prefix, libs = device_libs_for(hipcc, arch, work)
    out = work / (source.stem + f".{arch}.ll")
    _hipcc(hipcc, [f"--offload-arch={arch}", f"--hip-device-lib-path={libs}",
                   f"--rocm-path={prefix}", "--cuda-device-only", "-emit-llvm", "-S", "-O3",
                   "-std=c++17", f"-I{ROOT / 'pkg' / 'include'}",
                   *(f"-D{d}" for d in defines), str(source.resolve()), "-o", str(out)], work)
    return out.read_text()


def generate(ir: str, arch: str) -> str:
    """AMDGPU assembly of ``ir`` for ``arch`` from llvmlite's LLVM."""
    import llvmlite.binding as llvm

    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    ir = re.sub(r' "target-(cpu|features)"="[^"]*"', "", ir)
    module = llvm.parse_assembly(ir)
    module.verify()
    target = llvm.Target.from_triple("amdgcn-amd-amdhsa")
    return target.create_target_machine(cpu=arch, opt=3).emit_assembly(module)


def kernels(asm: str) -> dict[str, KernelCode]:
    """Each kernel of an AMDGPU assembly listing: its body's mnemonics and the resources its
    metadata records."""
    bodies = {m[1]: m[2] for m in re.finditer(r"\n([A-Za-z_]\w*):\s*(?:;[^\n]*)?\n(.*?)\n\.Lfunc_end\d+:",
                                              asm, re.DOTALL)}
    out = {}
    for meta in re.finditer(r"\n\s+- \.args:.*?(?=\n\s+- \.args:|\n\s*amdhsa\.target)", asm, re.DOTALL):
        block = meta[0]

        def field(key: str, text: str = block) -> str:
            # the kernel's own keys sit 4 spaces in; its arguments' (which may have a .name
            # too) 8
            return re.search(rf"^    \.{key}:\s+(\S+)", text, re.MULTILINE)[1]
        name = field("name")
        ops = Counter(line.split()[0] for line in bodies.get(name, "").splitlines()
                      if line.strip() and not line.lstrip().startswith((".", ";"))
                      and not line.rstrip().endswith(":"))
        out[name] = KernelCode(name, int(field("vgpr_count")), int(field("sgpr_count")),
                               int(field("private_segment_fixed_size")), ops)
    return out


def compile_kernels(source: Path, arch: str = "gfx1100", hipcc: str | None = None,
                    defines: tuple[str, ...] = ()) -> dict[str, KernelCode]:
    """``source``'s kernels compiled for ``arch``: hipcc's IR, llvmlite's code generation."""
    hipcc = hipcc or find_hipcc()
    if hipcc is None:
        raise FileNotFoundError("no hipcc: set HIPCC or put it on PATH")
    with tempfile.TemporaryDirectory(prefix="pkv-gfx11-") as tmp:
        return kernels(generate(device_ir(source, arch, hipcc, Path(tmp), defines), arch))


def write_json(found: dict[str, dict[str, KernelCode]], path: Path) -> None:
    """``{source file name: {kernel: its fields}}`` as JSON (``load_json`` reads it back)."""
    path.write_text(json.dumps({src: {name: k._asdict() for name, k in codes.items()}
                                for src, codes in found.items()}))


def load_json(path: Path) -> dict[str, dict[str, KernelCode]]:
    """What ``--json`` wrote: per source file name, its kernels."""
    return {src: {name: KernelCode(**{**fields, "mnemonics": Counter(fields["mnemonics"])})
                  for name, fields in codes.items()}
            for src, codes in json.loads(path.read_text()).items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", type=Path)
    ap.add_argument("--arch", default="gfx1100")
    ap.add_argument("--kernels", default="", help="regular expression on kernel names")
    ap.add_argument("--count", default="v_wmma", help="mnemonic prefix to count per kernel")
    ap.add_argument("--json", type=Path, help="also write every kernel's code to this file "
                    "(per source: VGPRs, SGPRs, scratch bytes, mnemonic counts)")
    args = ap.parse_args(argv)
    every: dict[str, dict[str, KernelCode]] = {}
    for source in args.sources:
        found = every[source.name] = compile_kernels(source, args.arch)
        print(f"{source} ({args.arch}): {len(found)} kernels")
        for name, k in sorted(found.items()):
            if re.search(args.kernels, name):
                print(f"  {name}: {k.count(args.count)} {args.count}*, {k.vgprs} VGPRs, "
                      f"{k.sgprs} SGPRs, {k.scratch_bytes} scratch bytes")
    if args.json is not None:
        write_json(every, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
