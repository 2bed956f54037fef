"""Another project's Cython code can ``cimport`` every public ``.pxd`` pagedkv installs.

A tiny downstream extension is generated, compiled with Cython and the C compiler against
the installed package (``.pxd`` search path: the package's parent; C headers:
``pagedkv.get_include()`` and NumPy's), imported in a fresh process, and made to call through
the cimported C-level API: results must equal the Python API's, byte for byte.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import pagedkv

INSTALLED = Path(pagedkv.__file__).resolve().parent


def public_pxd_modules() -> list[str]:
    """Dotted names of every installed ``.pxd`` whose name is not private."""
    out = []
    for p in sorted(INSTALLED.rglob("*.pxd")):
        rel = p.relative_to(INSTALLED.parent).with_suffix("")
        if not any(part.startswith("_") for part in rel.parts):
            out.append(".".join(rel.parts))
    return out


_BODY = '''
from libc.stdint cimport uint32_t
from pagedkv.quant.fwht cimport rotate256
from pagedkv.quant.quant_header cimport pkv_f16_trunc
from pagedkv.quant.affine cimport check_affine_geometry, AffineFamily


def rotate(float[::1] x):
    cdef float[::1] y = x.copy()
    rotate256(&x[0], &y[0], 1)
    return y.base


def f16_bits(float v):
    return int(pkv_f16_trunc(v))


def check_geometry(int bits, Py_ssize_t group):
    return check_affine_geometry(AffineFamily.HFQ, bits, group)
'''


def _compiler() -> str | None:
    cc = sysconfig.get_config_var("CC")
    name = cc.split()[0] if cc else "cc"
    return shutil.which(name) or shutil.which("cc")


def test_every_quant_pxd_is_installed():
    names = public_pxd_modules()
    for mod in ("affine", "fwht", "gemv_kernels", "half", "kv_q8", "q8", "quant_header"):
        assert f"pagedkv.quant.{mod}" in names


@pytest.mark.skipif(_compiler() is None, reason="no C compiler")
def test_a_downstream_extension_cimports_every_public_pxd(tmp_path):
    cython = pytest.importorskip("Cython")
    assert int(cython.__version__.split(".")[0]) >= 3
    modules = public_pxd_modules()
    src = "# cython: language_level=3\n" + "".join(f"cimport {m}\n" for m in modules) + _BODY
    (tmp_path / "downstream.pyx").write_text(src)
    run = {"capture_output": True, "text": True, "cwd": tmp_path, "timeout": 600}
    out = subprocess.run([sys.executable, "-m", "cython", "-3", "-I", str(INSTALLED.parent),
                          "downstream.pyx", "-o", "downstream.c"], check=False, **run)
    assert out.returncode == 0, out.stdout + out.stderr
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    includes = [sysconfig.get_paths()["include"], np.get_include(), pagedkv.get_include()]
    out = subprocess.run([_compiler(), "-shared", "-fPIC", "-O1", "-w",
                          *[f"-I{d}" for d in includes], "downstream.c",
                          "-o", "downstream" + ext], check=False, **run)
    assert out.returncode == 0, out.stdout + out.stderr

    probe = (
        "import sys, numpy as np; sys.path.insert(0, '.');\n"
        "import downstream\n"
        "from pagedkv.quant.fwht import fwht_rows\n"
        "from pagedkv.errors import InvalidArgument\n"
        "x = ((np.arange(256, dtype=np.float32) - 128) / 64).astype(np.float32)\n"
        "want = np.empty((1, 256), np.float32); fwht_rows(x.reshape(1, 256).copy(), want)\n"
        "got = np.asarray(downstream.rotate(x.copy()))\n"
        "print(got.tobytes() == want[0].tobytes(), downstream.f16_bits(1.0),\n"
        "      downstream.f16_bits(-2.0))\n"
        "try:\n"
        "    downstream.check_geometry(3, 7)\n"
        "except InvalidArgument as e:\n"
        "    print('InvalidArgument')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=False, **run)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["True", "15360", "49152", "InvalidArgument"]
