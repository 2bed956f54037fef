"""The cold tier on a real Redis server shared by a fleet (docs/cold.md, "A fleet on Redis
or Valkey"): every test starts its own redis-server on a free loopback port
(tests/redis_support.py). No mock stands in for the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from cold_support import FP, FakeAllocator, FakePool, Geometry, block_job, persist_prompt
from pagedkv.cold import BlockGeometry, ColdGroup, ColdTier, RedisColdStore, object_name
from pagedkv.errors import (
    ColdBackendAuthError,
    ColdBackendError,
    ColdBackendTLSError,
    InvalidArgument,
)
from pagedkv.tiny_model import ReferenceModel
from redis_support import RedisServer, free_port, require_redis

PREFIX = "pagedkv-v1:"
#: 4 layers x 2 heads x 64 x bs 16 x float16: 32 KiB blocks, so eviction tests fill memory.
WIDE = Geometry(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)


@pytest.fixture(autouse=True)
def _generous_capture_budget(monkeypatch):
    """A loaded CI machine must not turn a capture deadline into a missing block."""
    from pagedkv.cold import knobs
    monkeypatch.setattr(knobs, "_installed_budget", None)
    monkeypatch.setenv("PAGEDKV_COLD_CAPTURE_BUDGET_MS", "60000")
    monkeypatch.setenv("PAGEDKV_COLD_CAPTURE_BLOCKS_PER_TURN", "1024")


def _tokens(n_blocks: int, bs: int = 4, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 1000, n_blocks * bs).astype(np.uint32)


def _restore(tier, tokens, geometry=None, num_blocks: int = 64):
    pool = FakePool(geometry or Geometry(), num_blocks=num_blocks)
    alloc = FakeAllocator(num_blocks=num_blocks, block_size=pool.geometry.block_size)
    ids = tier.restore(tokens=tokens, hot_blocks=0, pool=pool, allocator=alloc)
    return pool, alloc, ids


def _same_blocks(src_pool, src_ids, dst_pool, dst_ids) -> bool:
    return all(np.array_equal(src_pool.data[int(a)], dst_pool.data[int(b)])
               for a, b in zip(src_ids, dst_ids, strict=False))


# --- opening --------------------------------------------------------------------------------

def test_wrong_password_is_a_clear_error_at_open(tmp_path):
    require_redis()
    d = tmp_path / "redis"
    d.mkdir()
    server = RedisServer(d, password="s3cret").start()
    try:
        url = f"redis://:wrong@127.0.0.1:{server.port}/0"
        with pytest.raises(ColdBackendAuthError, match="refused the credentials") as info:
            ColdTier.open_remote(url)
        assert "wrong" not in str(info.value)  # the password is never echoed
        with pytest.raises(ColdBackendAuthError, match="requires a password|credentials"):
            ColdTier.open_remote(f"redis://127.0.0.1:{server.port}/0")
        tier = ColdTier.open_remote(server.url, fingerprint=FP)
        assert "s3cret" not in repr(tier) and ":***@" in tier.root
        tier.close()
    finally:
        server.stop()


def test_a_password_is_hidden_wherever_the_url_is_shown(tmp_path, monkeypatch, caplog):
    """The password never reaches a repr, a message or a log line: in the userinfo, in a
    ``?password=`` query (redis-py takes it), or in a value that is no URL at all."""
    from pagedkv.cold.knobs import cold_backend_url
    from pagedkv.cold.redis_store import redacted_url
    require_redis()
    password = "s3cret"
    gone = f"redis://127.0.0.1:{free_port()}/0?password={password}&db=0"
    with pytest.raises(ColdBackendError, match="unreachable") as info:
        ColdTier.open_remote(gone)
    assert password not in str(info.value) and "password=***" in str(info.value)
    server = RedisServer(tmp_path, password=password).start()
    try:
        tier = ColdTier.open_remote(f"redis://127.0.0.1:{server.port}/0?password={password}",
                                   fingerprint=FP)
        assert password not in repr(tier) + tier.root and "password=***" in tier.root
        tier.close()
    finally:
        server.stop()
    for value in (f"unix:///tmp/redis.sock?db=0&password={password}",
                  f"redis://:{password}@[::1/0", f"redis://:pa/{password}@host:6379/0",
                  f"redis://:{password}@host:notaport/0"):
        assert password not in redacted_url(value), value
    assert redacted_url(f"redis://u:{password}@h:1/0") == "redis://u:***@h:1/0"
    # A URL of another scheme is refused before the client sees it, still redacted.
    for other in (f"http://user:{password}@host:6379/0", f"redis//user:{password}@host/0"):
        with pytest.raises(InvalidArgument, match="not a redis://") as info:
            RedisColdStore.open(other)
        assert password not in str(info.value) and ":***@" in str(info.value)
        with pytest.raises(InvalidArgument, match="not a redis://") as info:
            ColdTier.open_remote(other)
        assert password not in str(info.value)
        with pytest.raises(InvalidArgument, match="not a redis://") as info:
            ColdTier.open_at(tmp_path / "cold", remote=other)
        assert password not in str(info.value)
    caplog.set_level("WARNING", logger="pagedkv.cold")
    for typo in (f"redis//:{password}@host:6379/0", f"http://:{password}@host:6379/0"):
        monkeypatch.setenv("PAGEDKV_COLD_BACKEND", typo)
        assert cold_backend_url() is None
    assert "ignoring PAGEDKV_COLD_BACKEND" in caplog.text and password not in caplog.text


@pytest.mark.parametrize("url", [
    "redis://:pa/s3cret@127.0.0.1:6379/0",       # an unencoded / ends the host part early
    "redis://:s3cret@127.0.0.1:notaport/0", "redis://:s3cret@127.0.0.1:99999/0",
    "redis://:s3cret@[::1/0", "redis://:s3cret@127.0.0.1:6379/O",  # letter O: was db 0
    "redis://:s3cret@127.0.0.1:6379/0?no_such_option=1",
])
def test_a_malformed_url_is_invalid_argument_and_the_directory_serves_alone(
        url, tmp_path, monkeypatch, capsys):
    """Never a bare ValueError or TypeError (from the URL parser or the client), never a
    silent db 0, never the password; the shared tier keeps its directory; the CLI says one
    line and exits 2."""
    from pagedkv.cli import main
    from pagedkv.cold.tier import _shared_tiers
    require_redis()
    with pytest.raises(InvalidArgument) as info:
        RedisColdStore.open(url, timeout_s=0.5)
    assert "s3cret" not in str(info.value)
    monkeypatch.setenv("PAGEDKV_COLD_BACKEND", url)
    tier = ColdTier.shared(str(tmp_path / "base"))
    try:
        assert tier is not None and type(tier.store).__name__ == "ColdStore"
    finally:
        tier.close()
        _shared_tiers.clear()
    assert main(["cold", "stats", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "s3cret" not in err and "Traceback" not in err


def test_tls_mismatch_and_unreachable_are_clear_errors_at_open(redis_server, tmp_path):
    # A plain server never answers a TLS hello: the handshake times out (short here).
    tls = f"rediss://127.0.0.1:{redis_server.port}/0?socket_connect_timeout=0.5&socket_timeout=0.5"
    with pytest.raises(ColdBackendTLSError, match="TLS handshake failed"):
        ColdTier.open_remote(tls)
    with pytest.raises(ColdBackendError, match="unreachable"):
        ColdTier.open_remote(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(InvalidArgument, match="not a redis://"):
        ColdTier.open_remote("http://127.0.0.1:1/0")
    # A two-level open with a refused remote leaves no directory fd behind and raises.
    with pytest.raises(ColdBackendTLSError):
        ColdTier.open_at(tmp_path / "cold", remote=tls)


# --- same keys, same bytes --------------------------------------------------------------------

def test_write_through_stores_the_directory_bytes_under_the_same_names(redis_server, tmp_path):
    tier = ColdTier.open_at(tmp_path / "cold", quota_bytes=1 << 30, reserve_bytes=0,
                            fingerprint=FP, remote=redis_server.url)
    toks = _tokens(6)
    persist_prompt(tier, toks)
    tier.close()
    client = redis_server.client()
    names = sorted(n for n in os.listdir(tmp_path / "cold") if n.endswith(".safetensors"))
    assert len(names) == 6
    assert sorted(k.decode() for k in client.keys("*")) == [PREFIX + n for n in names]
    for n in names:
        assert client.get(PREFIX + n) == (tmp_path / "cold" / n).read_bytes()


def test_writer_pipelines_commits(redis_server):
    tier = ColdTier.open_remote(redis_server.url, queue_depth=16, fingerprint=FP)
    calls = []
    real = tier.store.commit_many
    tier.store.commit_many = lambda items: calls.append(len(items)) or real(items)
    tier.writer.hold()
    jobs = [block_job(i) for i in range(16)]
    assert all(tier.enqueue(j) for j in jobs)
    tier.writer.release()
    assert tier.drain(10.0)
    assert sum(calls) == 16 and max(calls) > 1  # several objects per round trip
    assert redis_server.client().dbsize() == 16
    assert tier.stats().write_errors == 0
    tier.close()


# --- the fleet: two processes ---------------------------------------------------------------

_CHILD = ("import json, sys; sys.path.insert(0, {tests!r}); "
          "from cold_support import reference_session; "
          "print(json.dumps(reference_session({root!r}, {model!r}, persist={persist}, "
          "prompt={prompt!r}, max_new=6, remote={remote!r})))")


def _session(tmp_path, root, persist: bool, prompt, remote) -> dict:
    code = _CHILD.format(tests=os.path.dirname(__file__), root=root,
                         model=str(tmp_path / "model"), persist=persist, prompt=prompt,
                         remote=remote)
    env = dict(os.environ, PAGEDKV_METRICS="0")
    env.pop("PAGEDKV_PERSIST_PAGED_CACHE", None)
    env.pop("PAGEDKV_COLD_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_processes_share_one_redis_bit_identically(redis_server, tmp_path):
    """Replica A (its own directory in front of Redis) computes and publishes; replica B,
    another process on Redis alone, restores A's prefix and generates bit-identical logits
    to a run without any cold tier."""
    ReferenceModel().save(tmp_path / "model")
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 500, 33)]
    a = _session(tmp_path, str(tmp_path / "a"), True, prompt, redis_server.url)
    assert a["drained"] and a["enqueued"] >= 8 and a["cached_tokens"] == 0
    b = _session(tmp_path, None, True, prompt, redis_server.url)
    c = _session(tmp_path, None, False, prompt, None)
    assert b["restored_blocks"] == 8 and b["cached_tokens"] == 32
    assert b["hits"] == 8 and b["misses"] == 0 and b["corruptions"] == 0
    assert b["tokens"] == c["tokens"] == a["tokens"]
    assert b["logits_sha256"] == c["logits_sha256"] == a["logits_sha256"]


# --- the server is untrusted ----------------------------------------------------------------

def _flip(value: bytes) -> bytes:
    out = bytearray(value)
    out[-5] ^= 0x40
    return bytes(out)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "other_key", "wrong_type"])
def test_corruption_in_redis_is_a_counted_miss(redis_server, damage):
    writer = ColdTier.open_remote(redis_server.url, fingerprint=FP)
    toks = _tokens(6)
    src_pool, _, src_ids, _ = persist_prompt(writer, toks)
    keys = sorted(writer.store.index.snapshot_keys())
    writer.close()
    client = redis_server.client()
    chain = [k.decode() for k in client.keys("*")]
    # The key order of the chain: ask a fresh tier which keys its restore walks.
    from pagedkv.cold import DEFAULT_FORMAT, cold_key_chain
    order = cold_key_chain(DEFAULT_FORMAT, ColdGroup.KV, FP, toks, 4)
    assert sorted(order) == keys and len(chain) == 6
    victim = PREFIX + object_name(order[3])
    good = client.get(victim)
    if damage == "flipped":
        client.set(victim, _flip(good))
    elif damage == "truncated":
        client.set(victim, good[:len(good) // 2])
    elif damage == "other_key":
        client.set(victim, client.get(PREFIX + object_name(order[1])))
    else:
        client.delete(victim)
        client.hset(victim, "a", "b")
    reader = ColdTier.open_remote(redis_server.url, fingerprint=FP)
    pool, alloc, ids = _restore(reader, toks)
    s = reader.stats()
    assert len(ids) == 3 and _same_blocks(src_pool, src_ids[:3], pool, ids)
    assert s.hits == 3 and s.misses == 1
    assert s.corruptions == (0 if damage == "wrong_type" else 1)
    assert client.exists(victim) == 0  # pruned: the next capture rewrites it
    assert client.dbsize() == 5
    assert int(alloc.ref.sum()) == 2 * 3  # caller + table per published block, no leak
    reader.close()


def test_oversized_value_is_never_fetched_in_full(redis_server):
    tier = ColdTier.open_remote(redis_server.url, fingerprint=FP)
    toks = _tokens(2)
    persist_prompt(tier, toks)
    client = redis_server.client()
    from pagedkv.cold import DEFAULT_FORMAT, cold_key_chain
    order = cold_key_chain(DEFAULT_FORMAT, ColdGroup.KV, FP, toks, 4)
    victim = PREFIX + object_name(order[0])
    client.append(victim, b"\0" * (1 << 20))
    bound = BlockGeometry.of(Geometry()).bound
    [(status, data)] = tier.store.fetch([object_name(order[0])], bound)
    assert status == "oversized" and data is None
    _, _, ids = _restore(tier, toks)
    assert len(ids) == 0 and tier.stats().corruptions == 1 and client.exists(victim) == 0
    tier.close()


# --- the server dies or evicts --------------------------------------------------------------

def test_server_killed_mid_write_loses_nothing_acknowledged(redis_server):
    tier = ColdTier.open_remote(redis_server.url, queue_depth=4, fingerprint=FP)
    jobs = [block_job(i) for i in range(60)]
    killed = False
    for i, job in enumerate(jobs):
        tier.enqueue_before(job, 1e18)
        if i == 30:
            redis_server.kill()
            killed = True
    assert killed
    assert not tier.drain(10.0)  # the writes after the kill failed, and say so
    acked = set(tier.store.index.snapshot_keys())
    s = tier.stats()
    assert 0 < len(acked) < 60 and s.write_errors == 60 - len(acked)
    tier.close()
    redis_server.start()  # the same directory: the append-only file is replayed
    client = redis_server.client()
    stored = {k.decode() for k in client.keys("*")}
    assert {PREFIX + object_name(k) for k in acked} <= stored
    fresh = RedisColdStore.open(redis_server.url)
    from pagedkv.cold.redis_offline import verify_remote
    result = verify_remote(fresh)  # no partial value anywhere
    assert result.bad == [] and result.checked == len(stored)
    by_key = {j.key: j for j in jobs}
    for key in acked:
        block = fresh.load_block(key, fingerprint_hex=FP.hex(), expected=by_key[key].geometry)
        assert block is not None
        assert np.array_equal(block.payload.reshape(by_key[key].buffer.shape),
                              by_key[key].buffer)
    fresh.close()


def test_a_hung_server_costs_one_timeout_per_retry_interval(redis_server, tmp_path,
                                                              monkeypatch):
    """A server that stops answering without closing its sockets (SIGSTOP: a hung host, a
    partition) cost every probe, load and commit a full timeout, twice (the client's retry),
    on the serving thread. Now one round trip per retry interval tries it; the others are
    misses and write errors at once, and the first that answers brings it back."""
    import signal

    from pagedkv.cold import redis_store
    monkeypatch.setattr(redis_store, "DOWN_RETRY_S", 0.3)
    writer = ColdTier.open_remote(redis_server.url, fingerprint=FP)
    toks = _tokens(4)
    persist_prompt(writer, toks)
    writer.close()
    tier = ColdTier.open_at(tmp_path / "cold", remote=redis_server.url + "?socket_timeout=0.5",
                            fingerprint=FP)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert len(_restore(tier, toks)[2]) == 0  # pays the one timeout, not two
        assert time.monotonic() - start < 0.9
        start = time.monotonic()
        for _ in range(5):
            assert len(_restore(tier, toks)[2]) == 0
        assert time.monotonic() - start < 0.25  # each was 1 s before
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    time.sleep(0.35)
    assert len(_restore(tier, toks)[2]) == 4  # back after the retry interval
    tier.close()


def test_server_killed_mid_restore_publishes_only_verified_blocks(redis_server):
    writer = ColdTier.open_remote(redis_server.url, fingerprint=FP)
    toks = _tokens(24)
    src_pool, _, src_ids, _ = persist_prompt(writer, toks)
    writer.close()
    reader = ColdTier.open_remote(redis_server.url, fingerprint=FP)
    bound = BlockGeometry.of(Geometry()).bound
    reader.store.fetch_window_bytes = 8 * bound  # 3 pipelined windows of 8 objects

    def kill_on_second_window(window: int) -> None:
        if window == 1:
            redis_server.kill()

    reader.store.fetch_hook = kill_on_second_window
    pool, alloc, ids = _restore(reader, toks)
    s = reader.stats()
    assert len(ids) == 8 and _same_blocks(src_pool, src_ids[:8], pool, ids)
    assert s.hits == 8 and s.misses == 1 and s.corruptions == 0
    assert int(alloc.ref.sum()) == 2 * 8  # caller + table per published block, no leak
    # A dead server is a miss, never an exception, for loads and writes alike.
    assert reader.load_block(next(iter(reader.store.index.snapshot_keys())), Geometry()) \
        is None
    reader.close()
    redis_server.start()
    again = ColdTier.open_remote(redis_server.url, fingerprint=FP)
    pool2, _, ids2 = _restore(again, toks)
    assert len(ids2) == 24 and _same_blocks(src_pool, src_ids, pool2, ids2)
    again.close()


def test_eviction_by_the_server_is_a_clean_miss(redis_server):
    writer = ColdTier.open_remote(redis_server.url, queue_depth=16, fingerprint=FP)
    toks = _tokens(48, bs=WIDE.block_size)
    src_pool, _, src_ids, _ = persist_prompt(writer, toks, pool=FakePool(WIDE, 64))
    client = redis_server.client()
    assert client.dbsize() == 48
    used = client.info("memory")["used_memory"]
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", used - 24 * 32768)
    client.set("pagedkv-test:nudge", b"x" * 1024)  # a write runs the eviction loop
    deadline = time.monotonic() + 10
    while client.info("memory")["used_memory"] > used - 24 * 32768 \
            and time.monotonic() < deadline:  # the server evicts in time-boxed steps
        time.sleep(0.01)
    # Then no more: the replies of the restores below must not evict while we count.
    client.config_set("maxmemory", 0)
    left = client.dbsize() - 1
    assert 0 < left < 48
    from pagedkv.cold import DEFAULT_FORMAT, cold_key_chain
    order = cold_key_chain(DEFAULT_FORMAT, ColdGroup.KV, FP, toks, WIDE.block_size)
    present = 0
    while present < 48 and client.exists(PREFIX + object_name(order[present])):
        present += 1
    reader = ColdTier.open_remote(redis_server.url, fingerprint=FP)
    pool, _, ids = _restore(reader, toks, WIDE)
    assert len(ids) == present and _same_blocks(src_pool, src_ids, pool, ids)
    assert reader.stats().corruptions == 0 and reader.stats().misses == 0
    # The writer's index still lists an evicted key: its load is a plain miss.
    evicted = next(k for k in order if not client.exists(PREFIX + object_name(k)))
    before = writer.stats()
    assert writer.load_block(evicted, WIDE) is None
    after = writer.stats()
    assert after.misses == before.misses + 1 and after.corruptions == before.corruptions
    writer.close()
    reader.close()


def test_an_oom_server_fails_each_write_logs_it_once_and_leaves_no_object(redis_server,
                                                                          caplog):
    """A server at its maxmemory under noeviction (or a volatile-* policy: pagedkv's keys
    carry no TTL) refuses every SET with "OOM command not allowed when used memory >
    'maxmemory'". Each refused object is one write error; the first is logged with the
    maxmemory-policy hint, the rest counted in write_errors_unlogged and summarized at most
    once per interval and at close. No key, index entry or written byte appears for any of
    them, what was written before still restores whole, and writes succeed again once the
    server has room. (redis-py strips the "OOM" code from the error's text, so the hint was
    never given: the kind was told by "OOM" in the text.)"""
    import logging

    from pagedkv.cold.stats import WriteFailureLog
    now = [0.0]
    caplog.set_level("WARNING", logger="pagedkv.cold")
    tier = ColdTier.open_remote(redis_server.url, queue_depth=8, fingerprint=FP)
    store = tier.store
    store.write_failures = WriteFailureLog(tier.counters, logging.getLogger("pagedkv.cold"),
                                           store.url, interval_s=60.0, clock=lambda: now[0])
    toks = _tokens(4)
    src_pool, _, src_ids, _ = persist_prompt(tier, toks)
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)  # below what the server already uses: every SET fails
    stored, indexed, before = sorted(client.keys("*")), len(store.index), tier.stats()
    jobs = [block_job(i) for i in range(7)]
    for job in jobs[:5]:
        assert tier.enqueue(job)
    assert tier.drain(5.0) is False
    now[0] = 61.0  # past the interval: the next failure brings the summary
    assert tier.enqueue(jobs[5]) and tier.drain(5.0) is False
    assert tier.enqueue(jobs[6]) and tier.drain(5.0) is False  # summarized at close
    s = tier.stats()
    assert (s.write_errors, s.write_errors_unlogged) == (7, 6)
    assert (s.bytes_written, s.corruptions) == (before.bytes_written, 0)
    assert sorted(client.keys("*")) == stored and len(store.index) == indexed
    assert not any(store.index.contains(job.key) for job in jobs)
    pool, _, ids = _restore(tier, toks)
    assert len(ids) == 4 and _same_blocks(src_pool, src_ids, pool, ids)
    client.config_set("maxmemory", 0)
    assert tier.enqueue(jobs[0]) and tier.drain(5.0)
    assert store.index.contains(jobs[0].key)
    assert client.exists(PREFIX + object_name(jobs[0].key)) == 1
    tier.close()
    assert tier.stats().write_errors == 7
    records = [r.getMessage() for r in caplog.records if r.name == "pagedkv.cold"]
    summary = (f"cold tier: %d more failed writes to {store.url} not logged one by one "
               "(%d so far; stats().write_errors_unlogged)")
    assert records == [
        (f"cold tier: write of {object_name(jobs[0].key)} to {store.url} failed: OOM command "
         "not allowed when used memory > 'maxmemory'. (set maxmemory-policy allkeys-lru: "
         "docs/cold.md, 'Quota and sizing'); later failures of this kind are counted in "
         "write_errors_unlogged"),
        summary % (5, 5),
        summary % (1, 6),
    ]


# --- two levels -----------------------------------------------------------------------------

def test_local_directory_in_front_of_redis_reads_through_and_fills(redis_server, tmp_path):
    toks = _tokens(8)
    a = ColdTier.open_at(tmp_path / "a", quota_bytes=1 << 30, reserve_bytes=0,
                         fingerprint=FP, remote=redis_server.url)
    src_pool, _, src_ids, _ = persist_prompt(a, toks)
    a.close()
    # Replica B starts with an empty directory: every block comes from the fleet and is
    # written back to B's own disk.
    b = ColdTier.open_at(tmp_path / "b", quota_bytes=1 << 30, reserve_bytes=0,
                         fingerprint=FP, remote=redis_server.url)
    pool, _, ids = _restore(b, toks)
    assert len(ids) == 8 and _same_blocks(src_pool, src_ids, pool, ids)
    assert b.drain(10.0)
    b.close()
    assert sorted(os.listdir(tmp_path / "b")) == sorted(os.listdir(tmp_path / "a"))
    # B restarts while the fleet's store is down: its own disk serves the whole prefix.
    redis_server.stop()
    only_disk = ColdTier.open_at(tmp_path / "b", quota_bytes=1 << 30, reserve_bytes=0,
                                 fingerprint=FP)
    pool2, _, ids2 = _restore(only_disk, toks)
    assert len(ids2) == 8 and _same_blocks(src_pool, src_ids, pool2, ids2)
    only_disk.close()


def test_local_corruption_falls_back_to_the_fleet(redis_server, tmp_path):
    toks = _tokens(4)
    tier = ColdTier.open_at(tmp_path / "a", quota_bytes=1 << 30, reserve_bytes=0,
                            fingerprint=FP, remote=redis_server.url)
    src_pool, _, src_ids, _ = persist_prompt(tier, toks)
    tier.close()
    name = min(n for n in os.listdir(tmp_path / "a") if n.endswith(".safetensors"))
    path = tmp_path / "a" / name
    path.write_bytes(_flip(path.read_bytes()))
    again = ColdTier.open_at(tmp_path / "a", quota_bytes=1 << 30, reserve_bytes=0,
                             fingerprint=FP, remote=redis_server.url)
    pool, _, ids = _restore(again, toks)
    s = again.stats()
    assert len(ids) == 4 and _same_blocks(src_pool, src_ids, pool, ids)
    assert s.corruptions == 1 and s.hits == 4  # the local copy failed, the fleet served it
    assert again.drain(10.0)
    again.close()
    assert path.read_bytes() == redis_server.client().get(PREFIX + name)  # refilled


# --- the command line -----------------------------------------------------------------------

def _cli(capsys, monkeypatch, *args, env=None):
    from pagedkv.cli import main
    monkeypatch.delenv("PAGEDKV_COLD_BACKEND", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    rc = main(["cold", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


def test_cold_cli_against_redis(redis_server, capsys, monkeypatch):
    tier = ColdTier.open_remote(redis_server.url, fingerprint=FP)
    toks = _tokens(5)
    persist_prompt(tier, toks)
    size = sum(e.size for _, e in tier.store.index.snapshot())
    tier.close()
    client = redis_server.client()
    victim = sorted(k.decode() for k in client.keys("*"))[2]
    client.set(victim, _flip(client.get(victim)))
    stats = _cli(capsys, monkeypatch, "stats", redis_server.url)
    assert stats.returncode == 0, stats.stderr
    assert f"objects: 5  total: {size} B" in stats.stdout
    verify = _cli(capsys, monkeypatch, "verify", env={"PAGEDKV_COLD_BACKEND": redis_server.url})
    assert verify.returncode == 1
    assert f"BAD {victim}: {victim}: payload checksum" in verify.stdout
    assert "verified 5 objects: 4 ok, 1 bad" in verify.stdout
    assert client.exists(victim) == 1  # read-only without --prune
    pruned = _cli(capsys, monkeypatch, "verify", "--prune", redis_server.url)
    assert pruned.returncode == 1 and "(deleted)" in pruned.stdout
    assert client.exists(victim) == 0
    evict = _cli(capsys, monkeypatch, "evict", "--to", "0", redis_server.url)
    assert evict.returncode == 0, evict.stderr
    assert "evicted 4 objects" in evict.stdout and client.dbsize() == 0
    refused = _cli(capsys, monkeypatch, "stats", f"rediss://127.0.0.1:{redis_server.port}/0?socket_connect_timeout=0.5&socket_timeout=0.5")
    assert refused.returncode == 2 and "TLS" in refused.stderr


def test_verify_prune_keeps_a_value_rewritten_after_its_check(redis_server, monkeypatch):
    """``verify --prune`` deletes a value only if it is still the one judged bad: a fleet
    peer that rewrites the key between the check and the delete keeps its good object
    (counted as vanished, not bad). A bad value nobody touched is still deleted."""
    from pagedkv.cold import redis_offline
    tier = ColdTier.open_remote(redis_server.url, fingerprint=FP)
    persist_prompt(tier, _tokens(3))
    tier.close()
    client = redis_server.client()
    rewritten, untouched = sorted(k.decode() for k in client.keys("*"))[:2]
    good = client.get(rewritten)
    client.set(rewritten, _flip(good))
    client.set(untouched, _flip(client.get(untouched)))
    checked = redis_offline.check_object

    def check_then_peer_rewrites(store, size, key, group, name, *args):
        try:
            checked(store, size, key, group, name, *args)
        finally:
            if name == rewritten:
                redis_server.client().set(rewritten, good)  # another replica's fresh write
    monkeypatch.setattr(redis_offline, "check_object", check_then_peer_rewrites)
    store = RedisColdStore.open(redis_server.url)
    result = redis_offline.verify_remote(store, prune=True)
    store.close()
    assert client.get(rewritten) == good
    assert client.exists(untouched) == 0
    assert [(b.name, b.quarantined) for b in result.bad] == [(untouched, True)]
    assert result.checked == 3 and result.vanished == 1


@pytest.mark.parametrize("action", [["stats"], ["verify"], ["verify", "--prune"],
                                    ["evict", "--to", "0"]])
def test_cold_cli_says_one_line_when_redis_dies_after_the_open(redis_server, capsys,
                                                                monkeypatch, action):
    """A server that stops answering mid-command is one line on stderr and exit 2, like
    one unreachable at open: never a redis-py traceback."""
    from pagedkv.cli import main
    redis_server.client().set(PREFIX + "ab" * 32 + ".safetensors", b"x" * 100)
    opened = RedisColdStore.open

    def open_then_kill(url, *args, **kwargs):
        store = opened(url, *args, **kwargs)
        redis_server.kill()
        return store
    monkeypatch.setattr(RedisColdStore, "open", staticmethod(open_then_kill))
    assert main(["cold", *action, redis_server.url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{redis_server.url} failed during {action[0]}" in err


def test_shared_tier_uses_the_backend_env(redis_server, tmp_path, monkeypatch):
    from pagedkv.cold.tier import _shared_tiers
    monkeypatch.setenv("PAGEDKV_COLD_BACKEND", redis_server.url)
    tier = ColdTier.shared(str(tmp_path / "base"))
    try:
        assert tier is not None and tier.root.endswith(redis_server.url)
        assert type(tier.store).__name__ == "TieredColdStore"
    finally:
        tier.close()
        _shared_tiers.clear()
    monkeypatch.setenv("PAGEDKV_COLD_BACKEND", f"redis://127.0.0.1:{free_port()}/0")
    fallback = ColdTier.shared(str(tmp_path / "base2"))
    try:  # an unusable fleet store leaves the directory alone, never the tier off
        assert fallback is not None and type(fallback.store).__name__ == "ColdStore"
    finally:
        fallback.close()
        _shared_tiers.clear()


# --- sidecars -------------------------------------------------------------------------------

def test_sidecar_on_redis_round_trips_and_a_truncated_one_is_corrupt(redis_server, tmp_path):
    from pagedkv.cold import DEFAULT_FORMAT, ColdSidecarLayout, sidecar_key
    from pagedkv.cold.writer import SidecarJob
    lay = ColdSidecarLayout(group=ColdGroup.GDN_STATE, boundary_tokens=16, num_layers=3,
                            tensors_per_layer=1, dtype="bfloat16", dims=(3, 8, 2, 4, 4),
                            bytes_per_tensor=2 * (3 * 8 + 2 * 4 * 4))
    payload = np.random.default_rng(0).integers(
        0, 256, (lay.tensor_count, lay.bytes_per_tensor), dtype=np.uint8)
    key = sidecar_key(DEFAULT_FORMAT, ColdGroup.GDN_STATE, FP, _tokens(4), 4, 16)
    tier = ColdTier.open_remote(redis_server.url, fingerprint=FP)
    assert tier.enqueue(SidecarJob(key, FP.hex(), lay, payload)) and tier.drain(5.0)
    rkey = PREFIX + object_name(key, ColdGroup.GDN_STATE)
    client = redis_server.client()
    assert client.exists(rkey) == 1
    # A second replica (two levels) loads it from the fleet and fills its own disk.
    other = ColdTier.open_at(tmp_path / "b", quota_bytes=1 << 30, reserve_bytes=0,
                             fingerprint=FP, remote=redis_server.url)
    got = other.load_sidecar(key, lay)
    assert got is not None and np.array_equal(got, payload) and other.drain(5.0)
    local = tmp_path / "b" / object_name(key, ColdGroup.GDN_STATE)
    assert local.read_bytes() == client.get(rkey)
    other.close()
    assert tier.load_sidecar(key, ColdSidecarLayout(
        group=ColdGroup.GDN_STATE, boundary_tokens=32, num_layers=3, tensors_per_layer=1,
        dtype="bfloat16", dims=(3, 8, 2, 4, 4), bytes_per_tensor=lay.bytes_per_tensor)) is None
    s = tier.stats()
    assert (s.misses, s.corruptions, s.hits) == (1, 0, 0)  # another layout: a plain miss
    client.set(rkey, client.get(rkey)[:-7])
    assert tier.load_sidecar(key, lay) is None
    s = tier.stats()
    assert (s.misses, s.corruptions) == (2, 1) and client.exists(rkey) == 0
    tier.close()


def test_a_sidecar_family_restores_on_every_replica_of_the_fleet(redis_server, tmp_path):
    """Replica A persists K/V and a GDN sidecar; a fresh Redis-only replica and a fresh
    two-level one restore both (they declined with NO_BACKED_BOUNDARY: the sidecar was in
    no local index and only K/V keys were probed; found by a review). A second capture on a
    fresh replica sees the sidecar as already persisted instead of writing it again."""
    from pagedkv.cold import DEFAULT_FORMAT, ColdSidecarLayout, ColdSidecarPolicy, sidecar_key
    from pagedkv.cold.sidecar_capture import SidecarCaptureStop, capture_sidecar
    from pagedkv.cold.writer import SidecarJob
    toks = np.arange(1, 17, dtype=np.uint32)  # 4 blocks of 4
    lay = ColdSidecarLayout(group=ColdGroup.GDN_STATE, boundary_tokens=16, num_layers=1,
                            tensors_per_layer=1, dtype="bfloat16", dims=(2, 4),
                            bytes_per_tensor=16)
    policy = ColdSidecarPolicy.unscaled(lay)
    payload = np.arange(16, dtype=np.uint8).reshape(1, 16)
    a = ColdTier.open_remote(redis_server.url, fingerprint=FP)
    persist_prompt(a, toks)
    key = sidecar_key(DEFAULT_FORMAT, ColdGroup.GDN_STATE, FP, toks, 4, 16)
    assert a.enqueue(SidecarJob(key, FP.hex(), lay, payload)) and a.drain(5.0)
    a.close()
    for b in (ColdTier.open_remote(redis_server.url, fingerprint=FP),
              ColdTier.open_at(tmp_path / "b", quota_bytes=1 << 30, reserve_bytes=0,
                               fingerprint=FP, remote=redis_server.url)):
        r = b.restore_backed(tokens=toks, hot_blocks=0, pool=FakePool(),
                             allocator=FakeAllocator(), policy=policy)
        assert len(r.block_ids) == 4 and r.sidecar.boundary_tokens == 16
        assert np.array_equal(r.sidecar.payload, payload)
        assert b.stats().restore_declines == 0
        b.close()
    c = ColdTier.open_remote(redis_server.url, fingerprint=FP)
    codec = types.SimpleNamespace(group=ColdGroup.GDN_STATE)  # found before packing
    out = capture_sidecar(c, FP, codec, {16: payload}, tokens=toks, captured_blocks=4,
                          block_size=4, deadline=time.monotonic() + 5.0)
    assert out.stop is SidecarCaptureStop.ALREADY_PERSISTED
    c.close()

def test_missing_redis_server_skips_here_and_fails_under_ci(monkeypatch):
    import redis_support
    monkeypatch.setattr(redis_support, "REDIS_SERVER", None)
    monkeypatch.delenv("PAGEDKV_EXPECT_REDIS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="redis-server is not installed"):
        redis_support.require_redis()
    monkeypatch.setenv("PAGEDKV_EXPECT_REDIS", "1")
    with pytest.raises(pytest.fail.Exception, match="PAGEDKV_EXPECT_REDIS=1 but redis-server"):
        redis_support.require_redis()
