"""Writer thread, bounded queue, durability under SIGKILL, concurrent readers
(docs/contracts/cold-tier.md, '7. Write path'; W1–W2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from cold_support import FP, open_tier
from pagedkv.cold import BlockGeometry, ColdGroup, cold_key_chain, object_name
from pagedkv.cold.store import WRITE_STEPS
from pagedkv.cold.writer import BlockJob
from pagedkv.errors import ColdTierClosed

G = BlockGeometry(4, 2, 1, 8, "float16")


def _job(i, geometry=G):
    rng = np.random.default_rng(i)
    toks = rng.integers(0, 1000, geometry.block_size, dtype=np.uint32)
    buf = rng.integers(0, 256, (geometry.num_layers, 2, geometry.slab_bytes), dtype=np.uint8)
    from pagedkv.cold import DEFAULT_FORMAT
    key = cold_key_chain(DEFAULT_FORMAT, ColdGroup.KV, FP, toks, geometry.block_size)[0]
    return BlockJob(key, FP.hex(), geometry, toks, buf)


# W2 --------------------------------------------------------------------------------------

def test_bounded_waits_with_a_wedged_writer(tmp_path):
    with open_tier(tmp_path / "root", queue_depth=1) as tier:
        tier.writer.hold()
        assert tier.enqueue(_job(0)) is True
        t0 = time.monotonic()
        assert tier.enqueue(_job(1)) is False
        assert time.monotonic() - t0 < 0.02
        assert tier.stats().queue_drops == 1
        t0 = time.monotonic()
        assert tier.enqueue_before(_job(2), time.monotonic() + 0.05) is False
        waited = time.monotonic() - t0
        assert 0.045 <= waited < 0.5
        assert tier.stats().queue_drops == 2
        t0 = time.monotonic()
        assert tier.drain(0.1) is False
        assert time.monotonic() - t0 < 0.5
        tier.writer.release()
        assert tier.enqueue_before(_job(3), time.monotonic() + 5.0) is True
        assert tier.drain(5.0) is True
        s = tier.stats()
        assert (s.enqueued, s.queue_drops, s.write_errors) == (2, 2, 0)


def test_jobs_after_close_raise_and_drain_is_true(tmp_path):
    tier = open_tier(tmp_path / "root")
    assert tier.enqueue(_job(0))
    tier.close()
    assert os.listdir(tmp_path / "root") == [object_name(_job(0).key)]  # close persisted it
    with pytest.raises(ColdTierClosed):
        tier.enqueue(_job(1))
    with pytest.raises(ColdTierClosed):
        tier.enqueue_before(_job(1), time.monotonic() + 1)
    assert tier.drain(0.1) is True


def test_writer_survives_a_malformed_job(tmp_path):
    with open_tier(tmp_path / "root") as tier:
        bad = _job(0)
        bad.buffer = bad.buffer[:1].copy()
        assert tier.enqueue(bad) and tier.drain(5.0) is False
        assert tier.stats().write_errors == 1
        assert tier.enqueue(_job(1)) and tier.drain(5.0) is True


def _unencodable(i):
    job = _job(i)
    job.buffer = job.buffer[:1].copy()  # fewer layers than its geometry: encode_block refuses
    return job


def test_unencodable_jobs_log_once_per_kind_then_a_summary(tmp_path, caplog):
    """A stream of jobs that cannot be encoded logs the first one (the job and the reason),
    counts the rest in write_errors_unlogged and summarizes them at most once per interval
    and at close, as the store's write failures are: never one WARNING per object."""
    import logging

    from pagedkv.cold.stats import WriteFailureLog
    now = [0.0]
    caplog.set_level("WARNING", logger="pagedkv.cold")
    with open_tier(tmp_path / "root") as tier:
        root = tier.store.root_path
        tier.writer.encode_failures = WriteFailureLog(
            tier.counters, logging.getLogger("pagedkv.cold"), root, interval_s=60.0,
            clock=lambda: now[0])
        for i in range(4):
            assert tier.enqueue(_unencodable(i))
        assert tier.drain(5.0) is False
        now[0] = 61.0  # past the interval: the next failure brings the summary
        assert tier.enqueue(_unencodable(4)) and tier.drain(5.0) is False
        assert tier.enqueue(_unencodable(5)) and tier.drain(5.0) is False  # summarized at close
        assert tier.enqueue(_job(6)) and tier.drain(5.0) is True  # a good job still commits
        s = tier.stats()
        assert (s.write_errors, s.write_errors_unlogged) == (6, 5)
    records = [r.getMessage() for r in caplog.records if r.name == "pagedkv.cold"]
    summary = (f"cold tier: %d more failed writes to {root} not logged one by one "
               "(%d so far; stats().write_errors_unlogged)")
    assert len(records) == 3, records
    assert records[0].startswith(f"cold tier: cannot encode {_unencodable(0)!r}: ")
    assert records[0].endswith(" (later jobs that fail to encode this way are counted in "
                               "write_errors_unlogged)")
    assert records[1:] == [summary % (4, 4), summary % (1, 5)]


# Crash injection -------------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from cold_support import open_tier
    from test_cold_writer import _job
    step = {step!r}
    tier = open_tier({root!r})
    def hook(s):
        if s == step:
            os.kill(os.getpid(), signal.SIGKILL)
    tier.store.step_hook = hook
    tier.enqueue(_job(7))
    tier.drain(10.0)
    os.kill(os.getpid(), signal.SIGKILL)  # "after": killed once everything was committed
""")


@pytest.mark.parametrize("step", list(WRITE_STEPS) + ["after"])
def test_sigkill_at_every_step_leaves_the_whole_object_or_none(tmp_path, step):
    root = tmp_path / "root"
    code = _CHILD.format(tests=os.path.dirname(__file__), step=step, root=str(root))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                          check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    job = _job(7)
    with open_tier(root) as tier:
        names = os.listdir(root)
        assert not [n for n in names if n.endswith(".tmp")], names  # dead writer's temp gone
        if step in ("open", "write", "sync", "rename"):
            assert names == [] and not tier.contains(job.key)
        else:  # renamed: the complete object is there and verifies
            assert names == [object_name(job.key)] and tier.contains(job.key)
            got = tier.load_block(job.key, G)
            assert got is not None and np.array_equal(got.payload, job.buffer)
        assert tier.stats().corruptions == 0


# Concurrency -----------------------------------------------------------------------------

def test_concurrent_readers_while_the_writer_runs(tmp_path):
    with open_tier(tmp_path / "root") as tier:
        jobs = [_job(i) for i in range(40)]
        for j in jobs[:10]:
            assert tier.enqueue_before(j, time.monotonic() + 5)
        assert tier.drain(5.0)
        errors, loaded = [], [0]
        stop = threading.Event()

        def reader():
            while not stop.is_set():
                for j in jobs:
                    if tier.contains(j.key):
                        got = tier.load_block(j.key, G)
                        if got is None or not np.array_equal(got.payload, j.buffer):
                            errors.append(j.key.hex())
                        else:
                            loaded[0] += 1

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        for j in jobs[10:]:
            assert tier.enqueue_before(j, time.monotonic() + 5)
        assert tier.drain(10.0)
        stop.set()
        for t in threads:
            t.join()
        assert errors == [] and loaded[0] > 0
        s = tier.stats()
        assert (s.corruptions, s.misses, s.write_errors) == (0, 0, 0)
        assert all(tier.contains(j.key) for j in jobs)


def test_a_job_racing_close_is_refused_not_stranded(tmp_path):
    """A producer that read ``closed == False`` just before ``close()`` must get
    ColdTierClosed, not leave a job (and its key, marked queued) behind stopped threads."""
    tier = open_tier(tmp_path / "root")
    writer = tier.writer
    writer.close()
    assert not writer._thread.is_alive() and not writer._hasher.is_alive()
    writer._closed = False  # the producer's stale read of the flag
    job = _job(7)
    with pytest.raises(ColdTierClosed, match="the cold writer is stopped"):
        writer.enqueue_before(job, time.monotonic() + 0.05)
    assert not writer.is_queued(job.key)
    assert len(writer._queue) == 0
    assert tier.stats().enqueued == 0 and tier.stats().queue_drops == 0
    assert writer.drain(0.1) is True  # nothing pending, answered at once
    tier.close()


def _drain_in_thread(tier, results, name):
    t = threading.Thread(target=lambda: results.__setitem__(name, tier.drain(10.0)))
    t.start()
    return t


def _wait_queued(tier, n):
    deadline = time.monotonic() + 5.0
    while len(tier.writer._queue) < n:
        assert time.monotonic() < deadline, "drain barrier never queued"
        time.sleep(0.001)


def _two_drains_and_a_failing_job(tier, order):
    """Queue a failing job and drains ``"first"``/``"second"`` in ``order`` on a held writer,
    then release it; each drain's result."""
    tier.writer.hold()
    tier.writer.fail_next_jobs = 1
    results: dict[str, bool] = {}
    threads = []
    for queued, step in enumerate(order, start=1):
        if step == "job":
            assert tier.enqueue(_job(0))
        else:
            threads.append(_drain_in_thread(tier, results, step))
        _wait_queued(tier, queued)
    tier.writer.release()
    for t in threads:
        t.join(10.0)
    return results


@pytest.mark.parametrize("order, expected", [
    (("job", "first", "second"), {"first": False, "second": False}),  # both queued behind it
    (("first", "job", "second"), {"first": True, "second": False}),  # first was before it
])
def test_a_failure_reaches_every_concurrent_drain_queued_behind_it(tmp_path, order, expected):
    with open_tier(tmp_path / "root") as tier:
        assert _two_drains_and_a_failing_job(tier, order) == expected
        assert tier.stats().write_errors == 1
        # Reported to the drains that were waiting for it; a later drain starts clean.
        assert tier.drain(5.0) is True
        assert tier.enqueue(_job(1)) and tier.drain(5.0) is True


def test_a_failure_with_no_drain_waiting_goes_to_the_next_drain_only(tmp_path):
    with open_tier(tmp_path / "root") as tier:
        tier.writer.fail_next_jobs = 1
        assert tier.enqueue(_job(0))
        deadline = time.monotonic() + 5.0
        while tier.stats().write_errors == 0:  # the failure happens before any drain
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert tier.drain(5.0) is False
        assert tier.drain(5.0) is True
