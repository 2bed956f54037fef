"""Where pagedkv chose differently from a first reading of its contracts, and why: the explicit
cold tier keeps no free-space reserve unless asked (docs/contracts/cold-tier.md, '5.1 Root'),
and a watermark fraction is clamped per call but refused in a config
(docs/contracts/paged-kv.md, '8.8 Scheduling contract: admission and preemption')."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from cold_support import FP
from pagedkv.cold import BlockGeometry, ColdGroup, ColdTier, cold_key_chain
from pagedkv.cold.writer import BlockJob
from pagedkv.errors import InvalidArgument
from pagedkv.sizing import PagedCacheConfig

GIB = 1 << 30
G = BlockGeometry(4, 2, 1, 8, "float16")


def _job(tier, i):
    rng = np.random.default_rng(i)
    toks = rng.integers(0, 1000, G.block_size, dtype=np.uint32)
    buf = rng.integers(0, 256, (G.num_layers, 2, G.slab_bytes), dtype=np.uint8)
    key = cold_key_chain(tier.fmt, ColdGroup.KV, FP, toks, G.block_size)[0]
    return BlockJob(key, FP.hex(), G, toks, buf)


class _SmallDisk:
    """statvfs of an 8 GiB disk with 1 GiB free: less than the automatic 5 GiB reserve."""

    def __init__(self, real):
        self.real = real

    def __call__(self, fd):
        st = self.real(fd)
        frsize = st.f_frsize
        return os.statvfs_result((st.f_bsize, frsize, 8 * GIB // frsize, GIB // frsize,
                                  GIB // frsize, st.f_files, st.f_ffree, st.f_favail,
                                  st.f_flag, st.f_namemax))


@pytest.fixture
def small_disk(monkeypatch):
    monkeypatch.setattr(os, "statvfs", _SmallDisk(os.statvfs))


def test_open_at_keeps_no_reserve_by_default_so_a_small_disk_still_persists(tmp_path,
                                                                            small_disk):
    with ColdTier.open_at(str(tmp_path / "root"), fingerprint=FP) as tier:
        assert tier.store.reserve_bytes == 0
        assert tier.store.quota_bytes == 8 * GIB // 10  # quota stays automatic
        job = _job(tier, 0)
        assert tier.enqueue(job) and tier.drain(5.0)
        assert tier.contains(job.key)
        assert tier.stats().write_errors == 0


def test_the_automatic_reserve_is_asked_for_with_none_and_refuses_on_that_disk(tmp_path,
                                                                                small_disk):
    with ColdTier.open_at(str(tmp_path / "root"), reserve_bytes=None, fingerprint=FP) as tier:
        assert tier.store.reserve_bytes == 5 * GIB
        job = _job(tier, 0)
        assert tier.enqueue(job)
        tier.drain(5.0)
        assert not tier.contains(job.key)
        assert tier.stats().write_errors == 1
        assert os.listdir(tmp_path / "root") == []


def test_the_shared_tier_keeps_the_automatic_reserve(tmp_path, small_disk):
    tier = ColdTier.shared(str(tmp_path / "base"))
    try:
        assert tier.store.reserve_bytes == 5 * GIB
        assert tier.store.quota_bytes == 8 * GIB // 10
    finally:
        tier.close()


def test_a_call_clamps_the_watermark_fraction_but_a_config_refuses_it():
    from pagedkv.adapter.admission import watermark_fraction
    assert [watermark_fraction(x) for x in (-0.2, 1.5, math.nan)] == [0.0, 1.0, 0.01]
    for bad in (-0.2, 1.0, 1.5, math.nan, math.inf):
        with pytest.raises(InvalidArgument, match=r"watermark_fraction: .* is outside \[0, 1\)"):
            PagedCacheConfig(watermark_fraction=bad)
    assert PagedCacheConfig(watermark_fraction=0.0).watermark_fraction == 0.0
    assert PagedCacheConfig(watermark_fraction=0.999).watermark_fraction == 0.999
