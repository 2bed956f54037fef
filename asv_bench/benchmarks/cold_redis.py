"""The cold tier on a loopback Redis vs the local directory (issue 17), in one run:

* restore throughput of a 2,048-block prefix (2 layers x 2 KV heads x 64 x bf16 x bs 16:
  16 KiB of K/V per block, 32 MiB in all) from Redis (one pipelined fetch, verified on the
  loader threads) vs from the directory (page cache warm): everything up to the publish;
* writer service time per ~200 KB object with the queue kept full: the directory (fsync per
  object), Redis with ``appendfsync always`` (an acknowledged object survives a server
  crash) and Redis without persistence.

A redis-server is started on a free loopback port in a temp dir (``redis-server`` must be on
PATH; asv skips these suites without it). Run as asv suites, or as a script for the table of
docs/performance.md::

    python asv_bench/benchmarks/cold_redis.py
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from pagedkv.allocator import BlockAllocator
from pagedkv.cold import ColdTier
from pagedkv.pool import LayerKVPool, PoolGeometry

try:
    from benchmarks.cold import FP, _filled, _jobs
except ImportError:  # run as a script: python asv_bench/benchmarks/cold_redis.py
    from cold import FP, _filled, _jobs  # type: ignore[no-redef]

GEOM_16K = PoolGeometry(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16,
                        dtype="bfloat16")
PREFIX_BLOCKS = 2048


class LoopbackRedis:
    """A redis-server on 127.0.0.1 with its own temp dir; ``aof``: appendfsync always."""

    def __init__(self, aof: bool) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise NotImplementedError("redis-server is not installed")
        self.dir = tempfile.mkdtemp(prefix="pagedkv-redis-bench-")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--save", "", "--appendonly", "yes" if aof else "no"]
        if aof:
            args += ["--appendfsync", "always"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        self.close()
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _open(where: str) -> ColdTier:
    if where.startswith("redis://"):
        return ColdTier.open_remote(where, queue_depth=8, fingerprint=FP)
    return ColdTier.open_at(where, quota_bytes=8 << 30, reserve_bytes=0, queue_depth=8,
                            fingerprint=FP)


def _persist_prefix(where: str, pool, alloc, ids, tokens) -> None:
    with _open(where) as tier:
        tier.install_capture_budget(len(ids), 600_000)
        out = tier.capture(tokens=tokens, block_ids=ids, pool=pool, allocator=alloc)
        assert out.enqueued == len(ids) and tier.drain(600)


def _restore_s(where: str, tokens, n_blocks: int) -> float:
    pool = LayerKVPool(GEOM_16K, n_blocks + 1)
    alloc = BlockAllocator(n_blocks + 1, block_size=16, hash_seed=0)
    with _open(where) as tier:
        t0 = time.perf_counter()
        ids = tier.restore(tokens=tokens, hot_blocks=0, pool=pool, allocator=alloc)
        dt = time.perf_counter() - t0
        assert len(ids) == n_blocks and tier.stats().corruptions == 0
    return dt


def restore_redis_vs_directory(n_blocks: int = PREFIX_BLOCKS, rounds: int = 3):
    """``(redis_bytes_per_s, dir_bytes_per_s, total_bytes)``: best of ``rounds``
    interleaved restores of the same prefix from each."""
    server = LoopbackRedis(aof=False)
    root = tempfile.mkdtemp(prefix="pagedkv-cold-bench-")
    try:
        pool, alloc, ids, tokens = _filled(GEOM_16K, n_blocks)
        _persist_prefix(root, pool, alloc, ids, tokens)
        _persist_prefix(server.url, pool, alloc, ids, tokens)
        total = sum(os.path.getsize(os.path.join(root, n)) for n in os.listdir(root)
                    if n.endswith(".safetensors"))
        _restore_s(root, tokens, n_blocks)  # page cache warm
        red, loc = [], []
        for _ in range(rounds):
            red.append(_restore_s(server.url, tokens, n_blocks))
            loc.append(_restore_s(root, tokens, n_blocks))
        return total / min(red), total / min(loc), total
    finally:
        server.close()
        shutil.rmtree(root, ignore_errors=True)


def _service_s(where: str, jobs) -> float:
    with _open(where) as tier:
        t0 = time.perf_counter()
        for job in jobs:
            tier.enqueue_before(job, time.monotonic() + 60)
        assert tier.drain(120)
        dt = (time.perf_counter() - t0) / len(jobs)
        assert tier.stats().write_errors == 0
    return dt


def writer_service(n: int = 96, rounds: int = 3) -> dict[str, float]:
    """Median seconds per ~200 KB object for each store (fresh store per round)."""
    out: dict[str, list[float]] = {"directory": [], "redis_aof_always": [], "redis_no_aof": []}
    for r in range(rounds):
        jobs = _jobs(n, seed=r)
        root = tempfile.mkdtemp(prefix="pagedkv-cold-bench-")
        durable, volatile = LoopbackRedis(aof=True), LoopbackRedis(aof=False)
        try:
            out["directory"].append(_service_s(root, jobs))
            out["redis_aof_always"].append(_service_s(durable.url, jobs))
            out["redis_no_aof"].append(_service_s(volatile.url, jobs))
        finally:
            durable.close(), volatile.close()
            shutil.rmtree(root, ignore_errors=True)
    return {k: statistics.median(v) for k, v in out.items()}


# --- asv suites -----------------------------------------------------------------------------

class RedisRestoreThroughput:
    """Restore of a 2,048-block prefix from loopback Redis over the same from the directory."""

    timeout = 600

    def setup(self):
        if shutil.which("redis-server") is None:
            raise NotImplementedError("redis-server is not installed")

    def track_redis_over_directory_restore(self):
        red, loc, _ = restore_redis_vs_directory(rounds=1)
        return red / loc
    track_redis_over_directory_restore.unit = "ratio"


class RedisWriterServiceTime:
    timeout = 600

    def setup(self):
        if shutil.which("redis-server") is None:
            raise NotImplementedError("redis-server is not installed")

    def track_redis_aof_always_over_directory(self):
        s = writer_service(32, rounds=1)
        return s["redis_aof_always"] / s["directory"]
    track_redis_aof_always_over_directory.unit = "ratio"


def main(argv: list[str]) -> int:
    red, loc, total = restore_redis_vs_directory()
    print(f"restore of {PREFIX_BLOCKS} blocks ({total / 2**20:.1f} MiB): loopback Redis "
          f"{red / 2**20:.0f} MiB/s vs directory {loc / 2**20:.0f} MiB/s "
          f"(ratio {red / loc:.2f})")
    svc = writer_service()
    print("writer service per ~200 KB object: " + ", ".join(
        f"{k} {v * 1e3:.3f} ms" for k, v in svc.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
