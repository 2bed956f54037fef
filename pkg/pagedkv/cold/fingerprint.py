"""Model fingerprints: what makes KV of one model unusable by another (docs/contracts/cold-tier.md,
'4. Fingerprint')."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagedkv.cold.format import (
    MARKER_DOWNLOAD,
    MARKER_FULL_DIGEST,
    MARKER_HFQM,
    MARKER_INDEX_JSON,
    MARKER_MANIFEST,
    ColdFormat,
)
from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = [
    "FINGERPRINT_BYTES",
    "MANIFEST_NAME",
    "ModeFingerprints",
    "WeightProvenance",
    "cold_fingerprint",
    "geometry_part",
    "hfqm_weight_identity",
    "kv_mode_fingerprint",
    "model_fingerprint",
    "weight_identity",
]

log = logging.getLogger("pagedkv.cold")

FINGERPRINT_BYTES = 32
MANIFEST_NAME = ".pagedkv-download-complete.json"
_READ_CHUNK_BYTES = 1 << 20
_REVISION = re.compile(r"[0-9a-f]{40}")  # fullmatch: no trailing newline
_u64 = struct.Struct("<Q").pack


def cold_fingerprint(fmt: ColdFormat, parts: Iterable[bytes]) -> bytes:
    """SHA-256 of the fingerprint tag, then for each part its u64 length and bytes."""
    return _tagged_digest(fmt, "cold-cache-fingerprint", parts)


def _tagged_digest(fmt: ColdFormat, tag: str, parts: Iterable[bytes]) -> bytes:
    h = hashlib.sha256(fmt.tag(tag))
    for i, part in enumerate(parts):
        if not isinstance(part, (bytes, bytearray, memoryview)):
            raise InvalidArgumentType(
                f"parts[{i}] must be bytes, got {type(part).__name__}")
        h.update(_u64(len(part)))
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class WeightProvenance:
    """Where the weights came from: hub ``repo``, 40-hex ``revision`` and shard ``files``."""

    repo: str
    revision: str
    files: Sequence[str]


def geometry_part(geometry) -> bytes:
    """Pool geometry part (docs/contracts/cold-tier.md, '4.2 Model fingerprint parts' item 6): u64
    block_size, num_layers, num_kv_heads, head_dim,
    then ``dtype\\0layout``. ``geometry`` is a ``PoolGeometry`` or anything with those fields."""
    try:
        nums = (int(geometry.block_size), int(geometry.num_layers),
                int(geometry.num_kv_heads), int(geometry.head_dim))
        dtype, layout = str(geometry.dtype), str(getattr(geometry, "layout", "nhd"))
    except AttributeError as exc:
        raise InvalidArgumentType(
            f"geometry must have block_size, num_layers, num_kv_heads, head_dim, dtype, "
            f"layout: {exc}") from None
    if min(nums) <= 0:
        raise InvalidArgument(f"geometry fields must be > 0, got {nums}")
    return b"".join(_u64(n) for n in nums) + dtype.encode() + b"\0" + layout.encode()


def kv_mode_fingerprint(fmt: ColdFormat, fingerprint: bytes, bound_geometry, geometry) -> bytes:
    """The fingerprint under which a pool bound to ``fingerprint`` at ``bound_geometry``
    stores and finds blocks once it holds ``geometry`` (docs/cold.md, "KV mode steps"):
    ``fingerprint`` itself while the geometry parts are equal, else SHA-256 of
    ``tag("cold-kv-mode-fingerprint")`` then, length-prefixed, ``fingerprint``, the bound
    geometry part and the current one. A kv_adaptive step (docs/kv-quant.md) transcodes the
    pool to another KV dtype: its blocks then live under another fingerprint, so objects
    of the two modes never share a key."""
    return ModeFingerprints(fmt, fingerprint, bound_geometry).at(geometry)


class ModeFingerprints:
    """One model binding's fingerprints across the KV modes of its pool: ``at(geometry)``
    is :func:`kv_mode_fingerprint` of ``fingerprint`` (computed for ``geometry``, the pool
    geometry it was bound at) for the pool's current geometry, memoized. Thread-safe."""

    __slots__ = ("_bound", "_derived", "_lock", "fingerprint", "fmt")

    def __init__(self, fmt: ColdFormat, fingerprint: bytes, geometry) -> None:
        if not isinstance(fingerprint, bytes) or len(fingerprint) != FINGERPRINT_BYTES:
            raise InvalidArgument("fingerprint must be 32 bytes (model_fingerprint's result)")
        self.fmt, self.fingerprint = fmt, fingerprint
        self._bound = geometry_part(geometry)
        self._derived: dict[bytes, bytes] = {self._bound: fingerprint}
        self._lock = threading.Lock()

    def at(self, geometry) -> bytes:
        part = geometry_part(geometry)
        with self._lock:
            fp = self._derived.get(part)
            if fp is None:
                fp = _tagged_digest(self.fmt, "cold-kv-mode-fingerprint",
                                    (self.fingerprint, self._bound, part))
                self._derived[part] = fp
            return fp

    def __repr__(self) -> str:
        return f"ModeFingerprints({self.fingerprint.hex()[:16]}..., modes={len(self._derived)})"


def _top_level_shards(model_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(model_dir)
                  if n.endswith(".safetensors") and os.path.isfile(os.path.join(model_dir, n)))


def _read_manifest(model_dir: str, provenance: WeightProvenance | None):
    if provenance is not None:
        return {"repo": provenance.repo, "revision": provenance.revision,
                "files": list(provenance.files)}
    path = os.path.join(model_dir, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read(1 << 20))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # present but unusable: counts as a failed manifest
    return raw if isinstance(raw, dict) else {}


def _manifest_valid(manifest: dict, shards: list[str]) -> bool:
    rev, repo, files = manifest.get("revision"), manifest.get("repo"), manifest.get("files")
    if not isinstance(rev, str) or not _REVISION.fullmatch(rev) or not isinstance(repo, str):
        return False
    if not isinstance(files, (list, tuple)) or not all(isinstance(f, str) for f in files):
        return False
    return set(shards) <= set(files)


def _shard_digest(fmt: ColdFormat, path: str, size: int) -> bytes:
    h = hashlib.sha256(fmt.tag("cold-shard-full"))
    h.update(_u64(size))
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_READ_CHUNK_BYTES)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.digest()


def weight_identity(fmt: ColdFormat, model_dir: str, provenance: WeightProvenance | None = None,
                    digest_cache=None) -> bytes | None:
    """Weight identity bytes (docs/contracts/cold-tier.md, '4.3 Weight identity'), or ``None`` when
    there are no readable weight bytes.

    The manifest path stats the shards only; the full-digest fallback reads every weight
    byte once, unless ``digest_cache`` (a :class:`WeightDigestCache`) already knows it.
    """
    try:
        shards = _top_level_shards(model_dir)
        stats = {n: os.stat(os.path.join(model_dir, n)) for n in shards}
    except OSError as exc:
        log.warning("cold tier: cannot list weights in %s (%s); persistence off", model_dir, exc)
        return None
    if not shards or sum(st.st_size for st in stats.values()) == 0:
        log.warning("cold tier: no weight bytes in %s (no *.safetensors shard or 0 bytes); "
                    "persistence off", model_dir)
        return None
    manifest = _read_manifest(model_dir, provenance)
    if manifest and _manifest_valid(manifest, shards):
        out = bytearray(MARKER_MANIFEST)
        for n in shards:
            st = stats[n]
            out += n.encode() + b"\0" + _u64(st.st_size) + st.st_mtime_ns.to_bytes(16, "little")
        out += manifest["repo"].encode() + b"\0" + manifest["revision"].encode()
        return bytes(out)
    out = bytearray(MARKER_FULL_DIGEST)
    for n in shards:
        path, st = os.path.join(model_dir, n), stats[n]
        try:
            digest = digest_cache.get(st) if digest_cache is not None else None
            if digest is None:
                digest = _shard_digest(fmt, path, st.st_size)
                if digest_cache is not None:
                    digest_cache.put(st, digest)
        except OSError as exc:
            log.warning("cold tier: cannot read weight shard %s (%s); persistence off", path, exc)
            return None
        out += n.encode() + b"\0" + _u64(st.st_size) + digest
    if manifest is not None:
        repo = manifest.get("repo") if isinstance(manifest, dict) else None
        rev = manifest.get("revision") if isinstance(manifest, dict) else None
        out += MARKER_DOWNLOAD + str(repo or "").encode() + b"\0" + str(rev or "").encode()
    return bytes(out)


def hfqm_weight_identity(fmt: ColdFormat, path: str, digest_cache=None) -> bytes | None:
    """Weight identity of a model served from one HFQM file (docs/contracts/cold-tier.md, '4.3
    Weight identity'): the file name, its size
    and the 16 hex digits of its ``quantization_hash`` (a file without one contributes its
    full digest instead). ``None`` (logged) when unreadable or empty."""
    from pagedkv.errors import PagedKVError
    from pagedkv.hfqm import HfqmFile
    try:
        st = os.stat(path)
        if st.st_size == 0:
            log.warning("cold tier: HFQM file %s is empty; persistence off", path)
            return None
        with HfqmFile(path) as f:
            qhash = f.metadata.get("quantization_hash")
        value = qhash.get("value") if isinstance(qhash, dict) else None
        out = MARKER_HFQM + os.path.basename(path).encode() + b"\0" + _u64(st.st_size)
        if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{16}", value):
            return out + value.encode()
        digest = digest_cache.get(st) if digest_cache is not None else None
        if digest is None:
            digest = _shard_digest(fmt, path, st.st_size)
            if digest_cache is not None:
                digest_cache.put(st, digest)
        return out + digest
    except (OSError, PagedKVError) as exc:
        log.warning("cold tier: cannot read HFQM file %s (%s); persistence off", path, exc)
        return None


def backend_compute_identity(backend: str) -> str:
    """The compute identity of a process computing KV with ``backend`` (``"numpy"`` or
    ``"mlx"``): the backend, its library version and (MLX) the default device, e.g.
    ``"numpy-2.4.6"`` or ``"mlx-0.32.4:Device(gpu, 0)"``. Pass it as ``model_fingerprint(...,
    compute=...)`` so KV computed by another backend, version or device never restores."""
    from importlib.metadata import version

    if backend == "mlx":
        import mlx.core as mx
        return f"mlx-{version('mlx')}:{mx.default_device()}"
    if backend == "numpy":
        import numpy
        return f"numpy-{numpy.__version__}"
    raise InvalidArgument(f"backend={backend!r}: expected 'numpy' or 'mlx'")


def model_fingerprint(fmt: ColdFormat, model_dir: str, profile, geometry,
                      provenance: WeightProvenance | None = None,
                      digest_cache=None, hfqm_file: str | None = None,
                      compute: str = "") -> bytes | None:
    """The 32-byte fingerprint of a model served with a pool geometry, or ``None``.

    Parts (docs/contracts/cold-tier.md, '4.2 Model fingerprint parts'): family name, raw
    ``config.json``, sidecar descriptor, weight identity,
    ``index.json\\0`` + the shard index (only when present), pool geometry and layout, and
    the compute identity. ``None`` (logged) means persistence is off for this model.
    ``hfqm_file``: the model is served from that HFQM file, whose identity replaces the
    safetensors shards'. ``compute``: everything else that makes this process's KV differ
    bitwise from another's for the same model (backend, library version, device, kernel
    set), e.g. ``ReferenceModel.compute_identity``; KV restored under one fingerprint is
    then bit-identical to what this process computes (docs/cold.md, "Keys and
    fingerprint"). Empty for an engine with a single compute path.
    """
    if not os.path.isdir(model_dir):
        log.warning("cold tier: model_dir %s is not a directory; persistence off", model_dir)
        return None
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            config = f.read()
    except OSError as exc:
        log.warning("cold tier: cannot read %s/config.json (%s); persistence off", model_dir, exc)
        return None
    if hfqm_file is not None:
        weights = hfqm_weight_identity(fmt, hfqm_file, digest_cache)
    else:
        weights = weight_identity(fmt, model_dir, provenance, digest_cache)
    if weights is None:
        return None
    parts = [profile.family.encode(), config, (profile.sidecar_descriptor or "").encode(),
             weights]
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        try:
            with open(index_path, "rb") as f:
                parts.append(MARKER_INDEX_JSON + f.read())
        except OSError as exc:
            log.warning("cold tier: cannot read %s (%s); persistence off", index_path, exc)
            return None
    parts.append(geometry_part(geometry))
    if not isinstance(compute, str):
        raise InvalidArgumentType(f"compute must be a str, got {type(compute).__name__}")
    parts.append(compute.encode("utf-8"))
    return cold_fingerprint(fmt, parts)
