"""The compiled kernel objects shipped inside the package (``pagedkv/kernels/objects/``).

The build writes one AMD code object per source and arch (``kvcache.gfx90a.hsaco``)
and one NVIDIA fatbin per source (``kvcache.cuda.fatbin``: SASS for each configured
arch plus PTX of the newest). They are read through :mod:`importlib.resources`, so
wheels, zip imports and editable installs all work.
"""

from __future__ import annotations

from importlib import resources

from pagedkv.errors import NoDeviceError

__all__ = ["list_objects", "object_name", "read_object"]


def _folder():
    return resources.files("pagedkv.kernels") / "objects"


def list_objects() -> list[str]:
    """File names of every installed kernel object (empty when no compiler was found)."""
    folder = _folder()
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.is_file())


def object_name(source: str, backend: str, arch: str) -> str:
    """The file holding ``source``'s kernels for a device: per arch on AMD, one fatbin on NVIDIA."""
    return f"{source}.cuda.fatbin" if backend == "cuda" else f"{source}.{arch}.hsaco"


def read_object(source: str, backend: str, arch: str) -> bytes:
    """The bytes of ``source``'s code object for ``arch``; :class:`NoDeviceError` when this
    build has none (the device cannot run pagedkv's kernels)."""
    name = object_name(source, backend, arch)
    path = _folder() / name
    if not path.is_file():
        if backend == "cuda":
            built = ", ".join(list_objects()) or "none (no GPU compiler was found at build time)"
            raise NoDeviceError(
                f"no kernel object {name} for this {backend} device ({arch}); built: {built}")
        # an AMD code object runs only on the arch it was built for (an MI300X's gfx942 cannot
        # load gfx940's): name the arches this build has and the rebuild that adds this one
        archs = sorted({n[len(source) + 1:-len(".hsaco")] for n in list_objects()
                        if n.startswith(f"{source}.") and n.endswith(".hsaco")})
        raise NoDeviceError(
            f"no kernel object {name} for this {backend} device ({arch}): this build has AMD "
            f"code objects for {', '.join(archs) or 'no arch (hipcc was not found at build time)'}"
            f", and one runs only on the arch it was built for; rebuild pagedkv for {arch} with "
            f"a ROCm whose hipcc targets it: pip install . -Csetup-args=-Dhip_arches={arch} "
            f"(docs/kernels.md, \"Build options\")")
    return path.read_bytes()
