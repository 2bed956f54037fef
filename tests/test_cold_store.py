"""Root opening, index, loads, corruption handling, quota and eviction (docs/contracts/cold-tier.md,
'5. Directory layout' and '9. Loads and corruption' and '10. Quota and eviction';
O2, W1, W3, E1–E7)."""

from __future__ import annotations

import os
import stat
import time

import numpy as np
import pytest

from cold_support import FP, open_tier
from pagedkv.cold import BlockGeometry, ColdGroup, ColdTier, cold_key_chain, object_name
from pagedkv.cold.writer import BlockJob
from pagedkv.errors import InvalidArgument

G = BlockGeometry(4, 2, 1, 8, "float16")


def _job(tier, i, geometry=G):
    rng = np.random.default_rng(i)
    toks = rng.integers(0, 1000, geometry.block_size, dtype=np.uint32)
    buf = rng.integers(0, 256, (geometry.num_layers, 2, geometry.slab_bytes), dtype=np.uint8)
    key = cold_key_chain(tier.fmt, ColdGroup.KV, FP, toks, geometry.block_size)[0]
    return BlockJob(key, FP.hex(), geometry, toks, buf)


def _persist(tier, i, geometry=G):
    job = _job(tier, i, geometry)
    assert tier.enqueue(job)
    assert tier.drain(5.0)
    return job


def _files(root):
    return sorted(os.listdir(root))


def _counters(tier):
    s = tier.stats()
    return {"hits": s.hits, "misses": s.misses, "corruptions": s.corruptions,
                "write_errors": s.write_errors, "evictions": s.evictions}


# W1 --------------------------------------------------------------------------------------

def test_writer_is_atomic_and_the_index_rebuilds(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        assert tier.drain(1.0)
        jobs = [_persist(tier, i) for i in range(5)]
        sizes = {object_name(j.key): os.path.getsize(root / object_name(j.key)) for j in jobs}
        assert tier.stats().bytes_written == sum(sizes.values())
        assert tier.stats().enqueued == 5
    assert _files(root) == sorted(sizes)
    with open_tier(root) as again:
        snap = {e.file_name: e.size for _, e in again.store.index.snapshot()}
        assert snap == sizes
        assert again.store.index.total_bytes == sum(sizes.values())
        for j in jobs:
            assert again.contains(j.key)
        again.writer.fail_next_jobs = 1
        assert again.enqueue(_job(again, 10))
        assert again.drain(5.0) is False
        assert again.enqueue(_job(again, 11))
        assert again.drain(5.0) is True


# O2 --------------------------------------------------------------------------------------

def test_a_bit_flipped_block_is_a_counted_pruned_miss(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
        path = root / object_name(job.key)
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        before = _counters(tier)
        assert tier.load_block(job.key, G) is None
        after = _counters(tier)
        assert after["misses"] == before["misses"] + 1
        assert after["corruptions"] == before["corruptions"] + 1
        assert after["hits"] == before["hits"]
        assert not path.exists() and not tier.contains(job.key)


CORRUPTIONS = {
    "payload bit": lambda d: d.__setitem__(-5, d[-5] ^ 0x10),
    "header bit": lambda d: d.__setitem__(3, d[3] ^ 0x01),
    "metadata bit": lambda d: d.__setitem__(d.index(b'"kind"') + 2, d[d.index(b'"kind"') + 2] ^ 1),
    "checksum field": lambda d: d.__setitem__(d.index(b'"checksum":"') + 12,
                                               ord("0") if d[d.index(b'"checksum":"') + 12] != ord("0") else ord("1")),
    "missing checksum": lambda d: d.__setitem__(slice(d.index(b'"checksum"'), d.index(b'"checksum"') + 10),
                                                 b'"checksuX"'),
    "one byte past the bound": lambda d: d.extend(b"\0" * (G.bound - len(d) + 1)),
    "trailing byte": lambda d: d.extend(b"\0"),
}


@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_every_corruption_is_a_miss_counted_and_pruned(tmp_path, what):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
        path = root / object_name(job.key)
        data = bytearray(path.read_bytes())
        CORRUPTIONS[what](data)
        path.write_bytes(bytes(data))
        before = _counters(tier)
        assert tier.load_block(job.key, G) is None
        after = _counters(tier)
        assert (after["misses"], after["corruptions"], after["hits"]) == \
            (before["misses"] + 1, before["corruptions"] + 1, before["hits"])
        assert not path.exists() and not tier.contains(job.key)


def test_truncation_at_every_4k_boundary(tmp_path):
    g = BlockGeometry(16, 2, 4, 64, "float16")  # 8 KiB slabs, ~33 KiB objects
    root = tmp_path / "root"
    with open_tier(root) as tier:
        job = _persist(tier, 0, g)
        path = root / object_name(job.key)
        full = path.read_bytes()
        cuts = list(range(0, len(full), 4096))
        assert len(cuts) >= 8
        for n, cut in enumerate(cuts, 1):
            _persist(tier, 0, g)
            path.write_bytes(full[:cut])
            assert tier.load_block(job.key, g) is None
            assert tier.stats().corruptions == n and not path.exists()
        _persist(tier, 0, g)
        assert tier.load_block(job.key, g) is not None


def test_other_fingerprint_and_geometry_are_corrupt_misses(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        job = _persist(tier, 0)
        assert tier.load_block(job.key, G, fingerprint=bytes(32)) is None
        assert tier.stats().corruptions == 1 and not tier.contains(job.key)
        job = _persist(tier, 0)
        assert tier.load_block(job.key, BlockGeometry(4, 2, 1, 8, "bfloat16")) is None
        assert tier.stats().corruptions == 2
        job = _persist(tier, 0)
        good = tier.load_block(job.key, G)
        assert good is not None and np.array_equal(good.payload, job.buffer)


# E1 --------------------------------------------------------------------------------------

def test_startup_cleanup_removes_only_writer_temp_files(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    temp = root / f".{'a' * 64}.4242.7.tmp"
    for p in (temp, root / "foo.tmp", root / "data.txt"):
        p.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(temp, (old, old))  # dead or stale either way
    with open_tier(root):
        pass
    assert _files(root) == ["data.txt", "foo.tmp"]


# E2 --------------------------------------------------------------------------------------

def test_symlinked_or_file_managed_child_disables_the_tier(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    base = tmp_path / "base"
    base.mkdir()
    os.symlink(target, base / "pagedkv-v1")
    assert ColdTier.shared(str(base)) is None
    base2 = tmp_path / "base2"
    base2.mkdir()
    (base2 / "pagedkv-v1").write_bytes(b"")
    assert ColdTier.shared(str(base2)) is None
    with pytest.raises(InvalidArgument, match="symlink"):
        ColdTier.open_at(str(base / "pagedkv-v1"), quota_bytes=1 << 20)
    # A base that passes through a symlink (macOS /tmp) is fine.
    os.symlink(tmp_path / "real", tmp_path / "link")
    tier = ColdTier.shared(str(tmp_path / "link"))
    assert tier is not None and os.path.isdir(tmp_path / "real" / "pagedkv-v1")
    tier.close()


def test_the_shared_tier_is_opened_once_and_again_after_a_close(tmp_path):
    base = str(tmp_path / "base")
    tier = ColdTier.shared(base)
    assert tier is not None and ColdTier.shared(base) is tier  # once per process
    tier.close()
    again = ColdTier.shared(base)  # not the closed one: its writer would refuse every job
    assert again is not tier and not again.writer.closed
    assert ColdTier.shared(base) is again
    job = _persist(again, 0)
    assert again.contains(job.key)
    again.close()


def test_swapping_the_root_for_a_symlink_cannot_redirect_io(tmp_path):
    root = tmp_path / "root"
    attacker = tmp_path / "attacker"
    attacker.mkdir()
    with open_tier(root) as tier:
        os.rename(root, tmp_path / "moved")
        os.symlink(attacker, root)
        job = _persist(tier, 0)
        assert os.listdir(attacker) == []
        assert object_name(job.key) in os.listdir(tmp_path / "moved")


def test_root_is_made_private(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    with open_tier(root):
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


# E3 --------------------------------------------------------------------------------------

def test_read_recency_survives_restart(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        a = _persist(tier, 1)
        b = _persist(tier, 2)
        time.sleep(0.01)
        assert tier.load_block(a.key, G) is not None
        size = tier.store.index.get(a.key).size
        assert tier.store.index.get(b.key).size == size
    with open_tier(root, quota_bytes=2 * size) as tier:
        c = _persist(tier, 3)
        assert tier.contains(a.key) and tier.contains(c.key) and not tier.contains(b.key)
        assert tier.stats().evictions == 1
        assert not (root / object_name(b.key)).exists()


def test_eviction_order_is_least_recently_read(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        jobs = [_persist(tier, i) for i in range(4)]
        size = tier.store.index.get(jobs[0].key).size
        tier.load_block(jobs[0].key, G)
        tier.load_block(jobs[2].key, G)
        tier.store.quota_bytes = 4 * size
        _persist(tier, 10)
        _persist(tier, 11)
        # 1 then 3 were the least recently read.
        assert [tier.contains(j.key) for j in jobs] == [True, False, True, False]


def test_reserve_evicts_when_free_space_is_short(tmp_path, monkeypatch):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        jobs = [_persist(tier, i) for i in range(3)]
        size = tier.store.index.get(jobs[0].key).size
        free = [10 * size]
        monkeypatch.setattr(tier.store, "_free_bytes", lambda: free[0])
        tier.store.reserve_bytes = 10 * size  # needs reserve + incoming free
        cleared = tier.store.clear_name
        def clear_and_free(name):
            ok = cleared(name)
            free[0] += size
            return ok
        monkeypatch.setattr(tier.store, "clear_name", clear_and_free)
        _persist(tier, 5)
        assert not tier.contains(jobs[0].key) and tier.contains(jobs[1].key)
        assert tier.stats().evictions == 1
        free[0] = 0  # nothing reclaimable can reach the reserve: refused, nothing evicted
        tier.store.reserve_bytes = 100 * size
        before = tier.stats()
        assert tier.enqueue(_job(tier, 6)) and tier.drain(5.0) is False
        assert tier.stats().evictions == before.evictions
        assert tier.stats().write_errors == before.write_errors + 1


# E4 --------------------------------------------------------------------------------------

def test_oversized_write_is_refused_without_evicting_anything(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        a = _persist(tier, 0)
        size = tier.store.index.get(a.key).size
    big = BlockGeometry(4, 8, 1, 8, "float16")
    with open_tier(root, quota_bytes=int(1.5 * size)) as tier:
        assert tier.enqueue(_job(tier, 1, big))
        assert tier.drain(5.0) is False
        s = tier.stats()
        assert (s.evictions, s.write_errors, s.bytes_written) == (0, 1, 0)
        assert tier.contains(a.key)


# E5 --------------------------------------------------------------------------------------

def test_eviction_quarantines_a_directory_swapped_onto_the_lru_entry(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        a = _persist(tier, 0)
        b = _persist(tier, 1)
        size = tier.store.index.get(a.key).size
        name = object_name(a.key)
        os.unlink(root / name)
        os.mkdir(root / name)
        (root / name / "inner").write_bytes(b"keep me")
        tier.store.quota_bytes = 2 * size
        _persist(tier, 2)
        q = [n for n in os.listdir(root) if n.startswith(f".blocked.{name}.")]
        assert len(q) == 1 and (root / q[0] / "inner").read_bytes() == b"keep me"
        assert not tier.contains(a.key) and tier.contains(b.key)


def test_eviction_retains_an_unclearable_entry_and_terminates(tmp_path, monkeypatch):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        a = _persist(tier, 0)
        b = _persist(tier, 1)
        size = tier.store.index.get(a.key).size
        real = tier.store.clear_name
        monkeypatch.setattr(tier.store, "clear_name",
                            lambda n: False if n == object_name(a.key) else real(n))
        tier.store.quota_bytes = 2 * size
        _persist(tier, 2)
        assert tier.contains(a.key) and tier.store.index.get(a.key).unclearable
        assert not tier.contains(b.key)
        monkeypatch.setattr(tier.store, "clear_name", lambda n: False)
        assert tier.enqueue(_job(tier, 3)) and tier.drain(5.0) is False


# E7 --------------------------------------------------------------------------------------

def test_contains_moves_no_counter(tmp_path):
    with open_tier(tmp_path / "root") as tier:
        a = _persist(tier, 0)
        before = tier.stats()
        assert tier.contains(a.key) and not tier.contains(bytes(32))
        assert tier.contains_in(a.key, ColdGroup.KV)
        assert not tier.contains_in(a.key, ColdGroup.GDN_STATE)
        assert tier.stats() == before


def test_file_deleted_behind_the_tier_is_a_plain_miss(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        a = _persist(tier, 0)
        os.unlink(root / object_name(a.key))
        assert tier.load_block(a.key, G) is None
        s = tier.stats()
        assert (s.misses, s.corruptions) == (1, 0) and not tier.contains(a.key)


def test_symlink_swapped_in_is_a_miss_and_the_target_is_untouched(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        a = _persist(tier, 0)
        target = tmp_path / "target"
        target.write_bytes((root / object_name(a.key)).read_bytes())
        os.unlink(root / object_name(a.key))
        os.symlink(target, root / object_name(a.key))
        assert tier.load_block(a.key, G) is None
        assert tier.stats().misses == 1 and tier.stats().hits == 0
        assert not os.path.lexists(root / object_name(a.key)) and target.is_file()
        assert not tier.contains(a.key)


def test_fifo_or_directory_in_place_is_refused_without_blocking(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        a = _persist(tier, 0)
        os.unlink(root / object_name(a.key))
        os.mkfifo(root / object_name(a.key))
        assert tier.load_block(a.key, G) is None
        assert not os.path.lexists(root / object_name(a.key))


def test_failed_load_cleanup_spares_a_concurrent_writers_replacement(tmp_path, monkeypatch):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        a = _persist(tier, 0)
        path = root / object_name(a.key)
        good = path.read_bytes()
        bad = bytearray(good)
        bad[-1] ^= 1
        path.write_bytes(bytes(bad))
        real_prune = tier.store.prune_failed_load
        def replace_then_prune(key, name, ident):
            tmp = root / "replacement"
            tmp.write_bytes(good)
            os.rename(tmp, path)  # new inode under the same name
            real_prune(key, name, ident)
        monkeypatch.setattr(tier.store, "prune_failed_load", replace_then_prune)
        assert tier.load_block(a.key, G) is None
        assert path.read_bytes() == good


# W3 --------------------------------------------------------------------------------------

def test_repeated_write_failures_log_once_per_kind_then_a_summary(tmp_path, caplog):
    """A disk that fails every write (ENOSPC) logs the first failure of its kind with the
    hint; the rest are counted in write_errors_unlogged, summarized at most once per
    interval and at close, never one WARNING per block."""
    import logging

    from pagedkv.cold.stats import WriteFailureLog
    now = [0.0]
    caplog.set_level("WARNING", logger="pagedkv.cold")
    with open_tier(tmp_path / "root") as tier:
        store = tier.store
        store.write_failures = WriteFailureLog(tier.counters, logging.getLogger("pagedkv.cold"),
                                               store.root_path, interval_s=60.0,
                                               clock=lambda: now[0])
        kind = ["write"]

        def fail(step):
            if step == kind[0]:
                raise OSError(28, "No space left on device")
        store.step_hook = fail
        for i in range(5):
            assert tier.enqueue(_job(tier, i))
        assert tier.drain(5.0) is False
        now[0] = 61.0  # past the interval: the next failure brings the summary
        assert tier.enqueue(_job(tier, 5)) and tier.drain(5.0) is False
        kind[0] = "rename"  # same exception type: same kind, still counted only
        assert tier.enqueue(_job(tier, 6)) and tier.drain(5.0) is False
        s = tier.stats()
        assert (s.write_errors, s.write_errors_unlogged) == (7, 6)
    records = [r.getMessage() for r in caplog.records if r.name == "pagedkv.cold"]
    first = object_name(_job(tier, 0).key)
    summary = (f"cold tier: %d more failed writes to {store.root_path} not logged one by one "
               "(%d so far; stats().write_errors_unlogged)")
    assert records == [
        (f"cold tier: write of {first} failed: [Errno 28] No space left on device (check the "
         "disk's free space and permissions; later failures of this kind are counted in "
         "write_errors_unlogged)"),
        summary % (5, 5),
        summary % (1, 6),
    ]


def test_failing_rename_counts_a_write_error_and_removes_the_temp(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        def fail(step):
            if step == "rename":
                raise OSError(5, "injected rename failure")
        tier.store.step_hook = fail
        assert tier.enqueue(_job(tier, 0)) and tier.drain(5.0) is False
        s = tier.stats()
        assert (s.write_errors, s.bytes_written) == (1, 0)
        assert _files(root) == [] and len(tier.store.index) == 0



def test_a_failing_close_of_the_temp_counts_one_write_error_and_removes_the_temp(
        tmp_path, monkeypatch):
    # close(2) reporting EIO (NFS) has released the descriptor: the writer must not close
    # that number again (another thread's file by then) and must still delete the temp.
    from pagedkv import atomic_write
    root = tmp_path / "root"
    with open_tier(root) as tier:
        real, closed = os.close, []

        def close(fd):
            closed.append(fd)
            real(fd)

        def hook(step):
            if step == "sync":
                def failing_close(fd):
                    temp = os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp")
                    closed.append(fd)
                    real(fd)
                    if temp:
                        monkeypatch.setattr(atomic_write.os, "close", close)
                        raise OSError(5, "injected close failure")
                monkeypatch.setattr(atomic_write.os, "close", failing_close)
        tier.store.step_hook = hook
        assert tier.enqueue(_job(tier, 0)) and tier.drain(5.0) is False
        tier.store.step_hook = None
        monkeypatch.setattr(atomic_write.os, "close", real)
        s = tier.stats()
        assert (s.write_errors, s.bytes_written) == (1, 0)
        assert len(closed) == len(set(closed)), f"a descriptor closed twice: {closed}"
        assert _files(root) == [] and len(tier.store.index) == 0

def test_directory_sync_failure_keeps_the_index_consistent_with_disk(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        def fail(step):
            if step == "dirsync":
                raise OSError(5, "injected dir sync failure")
        tier.store.step_hook = fail
        job = _job(tier, 0)
        assert tier.enqueue(job) and tier.drain(5.0) is False
        s = tier.stats()
        assert (s.write_errors, s.bytes_written) == (1, 0)
        assert _files(root) == [object_name(job.key)] and tier.contains(job.key)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_root_counts_one_write_error_per_job(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        os.chmod(root, 0o500)
        try:
            for i in range(2):
                assert tier.enqueue(_job(tier, i))
            assert tier.drain(5.0) is False
            assert (tier.stats().write_errors, tier.stats().bytes_written) == (2, 0)
        finally:
            os.chmod(root, 0o700)


def test_deleted_root_counts_one_write_error_per_job(tmp_path):
    root2 = tmp_path / "root2"
    with open_tier(root2) as tier:
        os.rmdir(root2)
        for i in range(3):
            assert tier.enqueue(_job(tier, i))
        assert tier.drain(5.0) is False
        assert (tier.stats().write_errors, tier.stats().bytes_written) == (3, 0)


def test_a_refused_create_counts_one_write_error_per_job(tmp_path):
    """The read-only-root case as root sees it: the exclusive create fails (EROFS)."""
    import errno
    root = tmp_path / "root"
    with open_tier(root) as tier:
        def refuse(step):
            if step == "open":
                raise OSError(errno.EROFS, "injected read-only filesystem")
        tier.store.step_hook = refuse
        for i in range(3):
            assert tier.enqueue(_job(tier, i))
        assert tier.drain(5.0) is False
        s = tier.stats()
        assert (s.write_errors, s.bytes_written, s.enqueued) == (3, 0, 3)
        assert _files(root) == []


def test_open_at_validates_arguments_before_touching_disk(tmp_path):
    root = tmp_path / "root"
    for kw in ({"quota_bytes": 0}, {"reserve_bytes": -1}, {"queue_depth": 0},
               {"fingerprint": b"short"}, {"durability": "sometimes"}):
        with pytest.raises(InvalidArgument):
            ColdTier.open_at(str(root), **{"quota_bytes": 1 << 20, **kw})
    assert not root.exists()
    with open_tier(root, durability="full") as tier:  # F_FULLFSYNC on macOS, fsync here
        _persist(tier, 0)
        assert tier.stats().bytes_written > 0 and tier.stats().write_errors == 0
