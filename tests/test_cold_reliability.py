"""Regressions of the adversarial campaign against the cold tier (issue 10): every failure
mode it found, each pinned by a test that failed before its fix (docs/reliability.md,
"Cold tier")."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from cold_support import FP, block_job, open_tier
from pagedkv.cli import main
from pagedkv.cold import (
    DEFAULT_FORMAT,
    BlockGeometry,
    ColdGroup,
    ColdSidecarLayout,
    object_name,
)
from pagedkv.cold.codec import decode_block, decode_sidecar, encode_block, encode_sidecar
from pagedkv.cold.names import is_writer_temp, parse_object_name
from pagedkv.cold.offline import open_offline_store, verify_store
from pagedkv.errors import BadMetadata

G = BlockGeometry(4, 2, 1, 8, "float16")
TAG = DEFAULT_FORMAT.tag("cold-cache-payload")
ABI = DEFAULT_FORMAT.abi


def _persist(tier, i, geometry=G):
    job = block_job(i, geometry)
    assert tier.enqueue(job) and tier.drain(5.0)
    return job


def _objects_on_disk(root):
    """Canonical object names on disk and their sizes."""
    return {n: os.path.getsize(os.path.join(root, n)) for n in os.listdir(root)
            if parse_object_name(n) is not None}


def _indexed(tier_or_store):
    store = getattr(tier_or_store, "store", tier_or_store)
    return {e.file_name: e.size for _, e in store.index.snapshot()}


# Medium 3: one key, two names -------------------------------------------------------------

def test_a_sidecar_name_sharing_a_block_key_is_quarantined_never_counted(tmp_path):
    """`<hex>.safetensors` and `<hex>.gdn_state.safetensors` share an index key: the index
    owns one of them; the other is quarantined at open, and total_bytes is exactly the sum
    of what the index owns (before the fix the loser's bytes stayed counted forever)."""
    root = tmp_path / "root"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
    block = object_name(job.key)
    planted = object_name(job.key, ColdGroup.GDN_STATE)
    (root / planted).write_bytes(b"\0" * 50_000)
    with open_tier(root) as tier:
        assert _indexed(tier) == {block: os.path.getsize(root / block)}
        assert tier.store.index.total_bytes == os.path.getsize(root / block)
        assert _objects_on_disk(root) == _indexed(tier)
        assert [n for n in os.listdir(root) if n.startswith(f".blocked.{planted}.")]
        got = tier.load_block(job.key, G)
        assert got is not None and np.array_equal(got.payload, job.buffer)


def test_an_unowned_name_never_blocks_writes(tmp_path):
    """The failure mode behind the finding: a loser larger than the quota made every later
    write refused ("no evictable object left")."""
    root = tmp_path / "root"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
        size = tier.store.index.get(job.key).size
    (root / object_name(job.key, ColdGroup.GDN_STATE)).write_bytes(b"\0" * (3 * size))
    with open_tier(root, quota_bytes=2 * size) as tier:
        for i in range(1, 5):
            _persist(tier, i)
        s = tier.stats()
        assert s.write_errors == 0 and s.bytes_written == 4 * size
        assert tier.store.index.total_bytes == sum(_objects_on_disk(root).values()) <= 2 * size


def test_offline_verify_reports_an_unowned_name_and_changes_nothing(tmp_path, capsys):
    base = tmp_path
    root = base / "pagedkv-v1"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
    planted = object_name(job.key, ColdGroup.GDN_STATE)
    (root / planted).write_bytes(b"junk")
    before = sorted(os.listdir(root))
    assert main(["cold", "stats", str(base)]) == 0
    out = capsys.readouterr().out
    assert f"objects: 1  total: {os.path.getsize(root / object_name(job.key))} B" in out
    assert "names sharing a key the index owns (not counted; quarantined by the next open " \
        "or `pagedkv cold evict`): 1" in out
    assert main(["cold", "verify", str(base)]) == 1
    out = capsys.readouterr().out
    assert f"BAD {planted}: shares its key with {object_name(job.key)}" in out
    assert sorted(os.listdir(root)) == before
    assert main(["cold", "verify", "--prune", str(base)]) == 1
    capsys.readouterr()
    assert planted not in os.listdir(root)
    assert main(["cold", "verify", str(base)]) == 0


def test_a_rewrite_under_another_name_of_the_same_key_frees_the_old_file(tmp_path):
    """A commit that replaces an index entry held by another name clears that name: the
    index and the disk keep describing the same files."""
    root = tmp_path / "root"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
        layout = ColdSidecarLayout(ColdGroup.GDN_STATE, 4, 1, 1, "float16", (4,), 8)
        from pagedkv.cold.writer import SidecarJob
        side = SidecarJob(job.key, FP.hex(), layout, np.arange(8, dtype=np.uint8).reshape(1, 8))
        assert tier.enqueue(side) and tier.drain(5.0)
        assert _objects_on_disk(root) == _indexed(tier)
        assert tier.store.index.total_bytes == sum(_objects_on_disk(root).values())


# Medium 4: an object that cannot be opened ------------------------------------------------

def _deny_open_of(monkeypatch, name):
    real = os.open

    def fake_open(path, flags, *args, **kwargs):
        if path == name and not flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", name)
        return real(path, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", fake_open)


def _assert_unreadable_object_heals(tier, root, job):
    before = tier.stats()
    assert tier.load_block(job.key, G) is None
    after = tier.stats()
    assert (after.misses, after.corruptions, after.hits) == \
        (before.misses + 1, before.corruptions, before.hits)
    # Dropped like any bad object: de-indexed and its name cleared, so the next capture
    # rewrites it instead of missing forever.
    assert not tier.contains(job.key)
    assert not os.path.lexists(root / object_name(job.key))
    assert tier.store.index.total_bytes == sum(_objects_on_disk(root).values())


def test_an_object_that_cannot_be_opened_is_dropped_and_rewritten(tmp_path, monkeypatch):
    """EACCES simulated at open(2) (the tests may run as root, where mode 000 reads fine)."""
    root = tmp_path / "root"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
        with monkeypatch.context() as m:
            _deny_open_of(m, object_name(job.key))
            _assert_unreadable_object_heals(tier, root, job)
        _persist(tier, 0)
        got = tier.load_block(job.key, G)
        assert got is not None and np.array_equal(got.payload, job.buffer)


def test_a_mode_000_object_is_dropped_and_rewritten(tmp_path):
    """The real EACCES: runs as non-root, or as root without CAP_DAC_OVERRIDE (e.g.
    ``setpriv --inh-caps=-dac_override,-dac_read_search --bounding-set=-dac_override,\
-dac_read_search python -m pytest ...``)."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    os.chmod(probe, 0)
    try:
        probe.read_bytes()
        pytest.skip("this process reads mode-000 files (root with CAP_DAC_OVERRIDE)")
    except PermissionError:
        pass
    root = tmp_path / "root"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
        os.chmod(root / object_name(job.key), 0)
        _assert_unreadable_object_heals(tier, root, job)
        _persist(tier, 0)
        assert tier.load_block(job.key, G) is not None


def test_running_out_of_descriptors_is_a_miss_that_keeps_the_object(tmp_path, monkeypatch):
    """EMFILE says nothing about the object: a miss, never a prune of a good file."""
    root = tmp_path / "root"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
        real = os.open

        def no_fds(path, flags, *args, **kwargs):
            if path == object_name(job.key):
                raise OSError(errno.EMFILE, "Too many open files")
            return real(path, flags, *args, **kwargs)
        with monkeypatch.context() as m:
            m.setattr(os, "open", no_fds)
            assert tier.load_block(job.key, G) is None
        assert tier.stats().misses == 1 and tier.contains(job.key)
        assert tier.load_block(job.key, G) is not None


def test_a_read_error_after_open_drops_the_object(tmp_path, monkeypatch):
    """EIO from read(2) on an opened regular file: the object is bad; it used to be left
    indexed because the failed read lost the file's identity."""
    root = tmp_path / "root"
    with open_tier(root) as tier:
        job = _persist(tier, 0)

        def eio(fd, buffers):
            raise OSError(errno.EIO, "Input/output error")
        with monkeypatch.context() as m:
            m.setattr(os, "readv", eio)
            assert tier.load_block(job.key, G) is None
        assert not tier.contains(job.key)
        assert not os.path.lexists(root / object_name(job.key))


# Medium 6: verify's memory is bounded by the header, not the file -----------------------

_RSS_PROBE = """
import resource, sys
from pagedkv.cli import main
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rc = main(["cold", "verify", sys.argv[1]])
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print("RSS_GROWN_KIB", grown, "RC", rc)
"""


def _verify_rss_kib(base):
    proc = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(base)], capture_output=True,
                          text=True, timeout=120, check=False,
                          env=dict(os.environ, PAGEDKV_METRICS="0"))
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RSS_GROWN_KIB"))
    _, grown, _, rc = line.split()
    return int(grown), int(rc), proc.stdout


@pytest.mark.parametrize("what", ["junk", "valid header, sparse tail"])
def test_verify_of_a_sparse_512_mib_object_stays_small(tmp_path, what):
    root = tmp_path / "pagedkv-v1"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
    path = root / object_name(job.key)
    if what == "junk":
        path.write_bytes(b"\xff" * 64)
    with open(path, "r+b") as f:
        f.truncate(512 << 20)  # sparse: 512 MiB that cost no disk
    grown_kib, rc, out = _verify_rss_kib(tmp_path)
    assert rc == 1 and f"BAD {path.name}" in out
    assert grown_kib < 32 << 10, f"verify grew by {grown_kib} KiB reading a 512 MiB file"


def test_verify_rejects_a_header_whose_length_exceeds_the_file_before_reading_more(tmp_path):
    root = tmp_path / "pagedkv-v1"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
    path = root / object_name(job.key)
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", len(data))  # a header as long as the whole file
    path.write_bytes(bytes(data))
    store = open_offline_store(str(root))
    try:
        result = verify_store(store)
    finally:
        store.close()
    assert (result.checked, result.vanished) == (1, 0)
    assert [b.name for b in result.bad] == [path.name]
    assert "header length" in result.bad[0].reason


# Low: an object evicted mid-scan is not a bad object --------------------------------------

def test_verify_next_to_a_live_server_skips_objects_that_vanish(tmp_path, capsys, monkeypatch):
    base = tmp_path
    root = base / "pagedkv-v1"
    with open_tier(root) as tier:
        jobs = [_persist(tier, i) for i in range(3)]
    from pagedkv.cold import offline
    real_open = offline.open_offline_store

    def open_then_evict(*args, **kwargs):
        store = real_open(*args, **kwargs)
        os.unlink(root / object_name(jobs[1].key))  # the server evicts after our scan
        return store
    monkeypatch.setattr(offline, "open_offline_store", open_then_evict)
    assert main(["cold", "verify", str(base)]) == 0
    out = capsys.readouterr().out
    assert "BAD" not in out
    assert "verified 3 objects: 2 ok, 0 bad, 1 vanished during the scan" in out


# Low: evict over a deeply nested quarantine directory -------------------------------------

def test_evict_removes_a_quarantine_tree_deeper_than_the_recursion_limit(tmp_path, capsys):
    base = tmp_path
    root = base / "pagedkv-v1"
    with open_tier(root):
        pass
    # Under a lowered recursion limit, so the tree stays small (rmdir on a disk filesystem
    # costs milliseconds): the recursive removal died at any limit, the iterative one has
    # no depth at all.
    limit, depth = 300, 500
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    os.mkdir(".blocked.deep.1.2", dir_fd=fd)
    cur = os.open(".blocked.deep.1.2", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    for _ in range(depth):
        os.mkdir("d", dir_fd=cur)
        (open("f", "wb", opener=lambda p, fl, d=cur: os.open(p, fl, 0o600, dir_fd=d))
         .close())
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
        os.close(cur)
        cur = nxt
    os.close(cur)
    old_limit = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(limit)
        try:
            rc = main(["cold", "evict", "--to", "0", str(base)])
        finally:
            sys.setrecursionlimit(old_limit)
        assert rc == 0
        out = capsys.readouterr().out
        assert out.startswith("removed 1 quarantined entries;")
        assert os.listdir(root) == []
    finally:  # pytest's own recursive cleanup of tmp_path would fail on what is left
        subprocess.run(["rm", "-rf", str(root)], check=False)


# Low: the turn trace writes only its own files in a directory it owns ---------------------

def _trace(directory):
    from pagedkv.cold import TurnTraceWriter
    return TurnTraceWriter(str(directory), enabled=True)


FIELDS = {"v": 1, "trace_id": "t", "ts_ms": 1, "model": "m", "duration_ms": 1,
          "prompt_tokens": 1, "cached_tokens": 0, "output_tokens": 1}


def _plant_symlink(victim, path):
    os.symlink(victim, path)


def _plant_hard_link(victim, path):
    os.link(victim, path)


def _plant_foreign_file(victim, path):
    if os.geteuid() != 0:
        pytest.skip("only root can make a file of another owner")
    path.write_bytes(b"")
    os.chown(path, 65534, -1)


@pytest.mark.parametrize("plant", [_plant_symlink, _plant_hard_link, _plant_foreign_file])
def test_the_trace_never_writes_through_a_planted_file(tmp_path, plant):
    traces = tmp_path / "traces"
    traces.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    writer = _trace(traces)
    path = traces / os.path.basename(writer.path())
    plant(victim, path)
    planted = path.read_bytes() if not path.is_symlink() else None
    assert writer.record(FIELDS) is None
    assert victim.read_bytes() == b"precious\n"
    if planted is not None:
        assert path.read_bytes() == planted
    os.unlink(path)
    assert writer.record(FIELDS) is not None  # a fresh file of our own: written
    with open(writer.path()) as f:
        assert json.loads(f.read())["trace_id"] == "t"


def test_the_trace_refuses_a_directory_of_another_owner(tmp_path, monkeypatch):
    traces = tmp_path / "traces"
    traces.mkdir(mode=0o755)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(traces).st_uid + 1)
    writer = _trace(traces)
    assert writer.record(FIELDS) is None
    assert os.listdir(traces) == []


def test_the_trace_refuses_a_symlinked_directory(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "traces")
    writer = _trace(tmp_path / "traces")
    assert writer.record(FIELDS) is None
    assert os.listdir(real) == []


def test_the_trace_creates_a_private_directory(tmp_path):
    writer = _trace(tmp_path / "a" / "traces")
    assert writer.record(FIELDS) is not None
    assert os.stat(tmp_path / "a" / "traces").st_mode & 0o777 == 0o700
    assert os.stat(writer.path()).st_mode & 0o777 == 0o600


# Low: decimals, hex and names are full matches (no trailing newline) ----------------------

def _reheader(obj: bytes, edit) -> bytes:
    """``obj`` with its JSON header parsed, edited by ``edit(header)`` and re-encoded."""
    n = struct.unpack_from("<Q", obj)[0]
    header = json.loads(obj[8:8 + n])
    edit(header)
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * ((8 - len(js) % 8) % 8)
    return struct.pack("<Q", len(js)) + js + obj[8 + n:]


def _block_bytes(job):
    header, toks, payload = encode_block(ABI, TAG, job.key.hex(), FP.hex(), G, job.tokens,
                                         job.buffer)
    return header + bytes(toks) + bytes(payload)


@pytest.mark.parametrize("field", ["block_size", "num_layers", "num_kv_heads", "head_dim",
                                   "key_bytes", "value_bytes"])
def test_a_decimal_with_a_trailing_newline_is_rejected(field):
    job = block_job(0)
    raw = _block_bytes(job)
    decode_block(_reheader(raw, lambda h: None), abi=ABI, checksum_tag=TAG, expected=G)
    bad = _reheader(raw, lambda h: h["__metadata__"].__setitem__(
        field, h["__metadata__"][field] + "\n"))
    with pytest.raises(BadMetadata, match=field):
        decode_block(bad, abi=ABI, checksum_tag=TAG, expected=G)


def test_a_checksum_with_a_trailing_newline_is_rejected():
    job = block_job(0)
    bad = _reheader(_block_bytes(job), lambda h: h["__metadata__"].__setitem__(
        "checksum", h["__metadata__"]["checksum"] + "\n"))
    with pytest.raises(BadMetadata, match="checksum"):
        decode_block(bad, abi=ABI, checksum_tag=TAG)


def _sidecar_bytes():
    layout = ColdSidecarLayout(ColdGroup.GDN_STATE, 16, 2, 2, "bfloat16", (4, 2), 16)
    payload = np.arange(4 * 16, dtype=np.uint8).reshape(4, 16)
    header, body = encode_sidecar(ABI, TAG, "a" * 64, FP.hex(), layout, payload)
    return header + bytes(body)


@pytest.mark.parametrize("dims", ["4,0\n", "4\n,2", "4,2\n"])
def test_a_sidecar_dim_with_a_trailing_newline_is_rejected(dims):
    raw = _sidecar_bytes()
    fields, _ = decode_sidecar(raw, abi=ABI, checksum_tag=TAG, group="gdn_state")
    assert fields["dims"] == (4, 2)
    bad = _reheader(raw, lambda h: h["__metadata__"].__setitem__("dims", dims))
    with pytest.raises(BadMetadata, match="dims"):
        decode_sidecar(bad, abi=ABI, checksum_tag=TAG, group="gdn_state")


def test_names_and_hex_inputs_with_a_trailing_newline_are_not_accepted():
    hexkey = "ab" * 32
    assert parse_object_name(f"{hexkey}.safetensors") is not None
    assert parse_object_name(f"{hexkey}.safetensors\n") is None
    assert parse_object_name(f"{hexkey}.gdn_state.safetensors\n") is None
    assert is_writer_temp(f".{hexkey}.1.2.tmp") and not is_writer_temp(f".{hexkey}.1.2.tmp\n")
    job = block_job(0)
    with pytest.raises(ValueError, match="key_hex"):
        encode_block(ABI, TAG, job.key.hex() + "\n", FP.hex(), G, job.tokens, job.buffer)


def test_a_manifest_revision_with_a_trailing_newline_falls_back_to_the_full_digest(tmp_path):
    from pagedkv.cold.fingerprint import WeightProvenance, weight_identity
    from pagedkv.cold.format import MARKER_FULL_DIGEST, MARKER_MANIFEST
    (tmp_path / "model.safetensors").write_bytes(b"w" * 64)
    rev = "0123456789abcdef0123456789abcdef01234567"
    good = weight_identity(DEFAULT_FORMAT, str(tmp_path),
                           WeightProvenance("r", rev, ["model.safetensors"]))
    bad = weight_identity(DEFAULT_FORMAT, str(tmp_path),
                          WeightProvenance("r", rev + "\n", ["model.safetensors"]))
    assert good.startswith(MARKER_MANIFEST) and bad.startswith(MARKER_FULL_DIGEST)


def test_a_trailing_newline_object_name_is_never_indexed_or_counted(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / (("ab" * 32) + ".safetensors\n")).write_bytes(b"x" * 1000)
    with open_tier(root) as tier:
        assert len(tier.store.index) == 0 and tier.store.index.total_bytes == 0


# Medium 5: the fingerprint binds the compute path ------------------------------------------

def test_the_fingerprint_binds_the_compute_identity(tmp_path):
    from pagedkv.cold import family_profile, model_fingerprint
    from pagedkv.pool import PoolGeometry
    from pagedkv.tiny_model import ReferenceConfig, ReferenceModel
    model = ReferenceModel(ReferenceConfig(seed=0))
    model.save(tmp_path / "model")
    c = model.config
    geom = PoolGeometry(c.num_layers, c.num_kv_heads, c.head_dim, 8, "float32")
    profile = family_profile("pagedkv_reference")

    def fp(compute):
        return model_fingerprint(DEFAULT_FORMAT, str(tmp_path / "model"), profile, geom,
                                 compute=compute)
    assert fp("numpy-2.4.6") == fp("numpy-2.4.6")
    assert len({fp(""), fp("numpy-2.4.6"), fp("numpy-2.4.7"), fp("mlx-0.32.4:cpu"),
                fp("mlx-0.32.4:gpu")}) == 5


def test_the_reference_compute_identity_names_backend_library_and_device():
    from pagedkv.tiny_model import ReferenceModel
    assert ReferenceModel().compute_identity == f"numpy-{np.__version__}"
    mx = pytest.importorskip("mlx.core")
    from importlib.metadata import version
    ident = ReferenceModel(backend="mlx").compute_identity
    assert ident == f"mlx-{version('mlx')}:{mx.default_device()}"


def test_demo_on_numpy_then_on_mlx_over_one_cold_dir_keeps_byte_parity(tmp_path, capsys):
    """The finding: NumPy KV restored into an MLX run failed the demo's byte-parity check.
    With the backend in the fingerprint the MLX run misses NumPy's objects, and each
    backend restores only its own KV."""
    pytest.importorskip("mlx.core")
    small = ["demo", "--cold-dir", str(tmp_path / "cold"), "--requests", "3",
             "--system-tokens", "32", "--fewshot-tokens", "16", "--user-tokens", "8",
             "--new-tokens", "4", "--block-size", "8"]
    outs = []
    for backend in ("numpy", "mlx", "mlx", "numpy"):
        assert main(small + ["--backend", backend]) == 0, capsys.readouterr().out
        outs.append(capsys.readouterr().out)
    for out in outs:
        assert "parity: OK (3/3 outputs byte-identical" in out
    restored = [next(x for x in out.splitlines() if x.startswith("cold tier: ")).split()[2]
                for out in outs]
    assert restored == ["0", "0", "6", "6"]


def test_verify_of_an_object_that_shrinks_while_read_reports_it_bad(tmp_path, monkeypatch):
    """The header-first reader met a file shorter than its fstat said (truncated behind
    it): a bad object with a reason, never an exception out of verify."""
    root = tmp_path / "pagedkv-v1"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
    from pagedkv.cold import offline
    real = offline._pread_exact
    monkeypatch.setattr(offline, "_pread_exact",
                        lambda fd, n, off: real(fd, n, off)[:max(8, n // 2)])
    store = open_offline_store(str(root))
    try:
        result = verify_store(store)
    finally:
        store.close()
    assert [b.name for b in result.bad] == [object_name(job.key)]
    assert "less than the header" in result.bad[0].reason


def test_quarantine_removal_is_bounded_per_call_and_resumes(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        tree = root / ".blocked.wide.1.2"
        for i in range(4):
            (tree / f"d{i}" / "e").mkdir(parents=True)
            (tree / f"d{i}" / "e" / "f").write_bytes(b"x")
        # The top entry goes (its 4 subdirectories hoisted into the root), then the
        # budget of 3 names is spent: the hoisted subtrees wait for the next call.
        assert tier.store.remove_quarantine(max_entries=3) == 1
        left = [n for n in os.listdir(root) if n.startswith(".blocked.")]
        assert len(left) == 4 and ".blocked.wide.1.2" not in left
        tier.store.remove_quarantine()
        assert os.listdir(root) == []


def test_a_failed_load_under_another_name_keeps_the_entry_that_owns_the_key(tmp_path):
    """A sidecar load for a key the index holds as a KV block misses on the sidecar name:
    the miss must not de-index the block, whose file would then stay on disk uncounted."""
    root = tmp_path / "root"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
        layout = ColdSidecarLayout(ColdGroup.GDN_STATE, 4, 1, 1, "float16", (4,), 8)
        assert tier.load_sidecar(job.key, layout) is None
        assert tier.contains_in(job.key, ColdGroup.KV)
        assert _objects_on_disk(root) == _indexed(tier)
        assert tier.store.index.total_bytes == sum(_objects_on_disk(root).values())


def test_backend_compute_identity_names_backend_version_and_device():
    """The compute identity every cold path puts in its fingerprint (issue 10, finding 5):
    the reference models, the hybrid demo and the mlx-lm integration share one definition."""
    from importlib.metadata import version

    from pagedkv.cold.fingerprint import backend_compute_identity
    from pagedkv.errors import InvalidArgument
    from pagedkv.tiny_model import ReferenceConfig, ReferenceModel

    assert backend_compute_identity("numpy") == f"numpy-{np.__version__}"
    assert ReferenceModel(ReferenceConfig()).compute_identity == f"numpy-{np.__version__}"
    with pytest.raises(InvalidArgument, match="backend='cuda'"):
        backend_compute_identity("cuda")
    mx = pytest.importorskip("mlx.core")
    assert backend_compute_identity("mlx") == f"mlx-{version('mlx')}:{mx.default_device()}"
