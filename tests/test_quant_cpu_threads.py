"""threads= of dequantize and the worker pool behind it (pagedkv.quant.cpu_pool): the bits
never depend on the thread count (every format's decoder, span_decode_loop.pxd), MQ 4-bit groups decoded in one pass equal decode + Rᵀ,
every part of a job runs once whether its workers spin or sleep, and the pool survives
concurrent callers and fork()."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

import pagedkv.quant as Q
from kernels_support import quant_header_dir
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.quant import cpu_pool
from pagedkv.quant.formats import CODECS

pytestmark = pytest.mark.filterwarnings("ignore:MQ2G256V2:UserWarning")

ALL = sorted(c.name for c in CODECS.values() if c.encodes)


def _two_pass(raw, fmt, shape):
    """The stored-basis decode, then Rᵀ per 256-group (the reference of the original basis)."""
    codec = Q.resolve(fmt)
    if not codec.rotated:
        return Q.dequantize(raw, fmt, shape)
    rot = Q.dequantize(raw, fmt, shape, basis="rotated")
    return Q.fwht256(rot.reshape(-1, 256), inverse=True).reshape(shape)


@pytest.mark.parametrize("fmt", ALL)
def test_dequantize_bits_do_not_depend_on_threads(fmt):
    rng = np.random.default_rng(len(fmt))
    shape = (67, 4096)                 # 1072 groups of 256: several per thread
    raw = Q.quantize(rng.standard_normal(shape).astype(np.float32), fmt)
    want = Q.dequantize(raw, fmt, shape)
    for threads in (2, 3, 8):
        assert Q.dequantize(raw, fmt, shape, threads=threads).tobytes() == want.tobytes()
    if Q.resolve(fmt).rotated:
        assert want.tobytes() == _two_pass(raw, fmt, shape).tobytes()


@pytest.mark.parametrize("fmt", ["mq4g256", "mq4g256v2", "mq4cg256"])
def test_one_pass_mq4_decode_equals_decode_then_inverse_rotation_on_odd_headers(fmt):
    rng = np.random.default_rng(2)
    raw = Q.quantize((rng.standard_normal((96, 256)) * rng.uniform(1e-6, 1e4, (96, 1)))
                     .astype(np.float32), fmt)
    groups = raw.reshape(96, 136)
    groups[::3, 8:] = rng.integers(0, 256, (32, 128), dtype=np.uint8)   # any codes
    got = Q.dequantize(raw, fmt, (96, 256), threads=2)
    assert got.tobytes() == _two_pass(raw, fmt, (96, 256)).tobytes()


@pytest.mark.parametrize("fmt", ["mq4g256", "mq4g256v2", "mq4cg256"])
def test_large_outputs_streamed_or_not_keep_the_bits(fmt):
    """8 MiB of output takes streaming stores when out is aligned to the vector, plain
    stores otherwise (NumPy's 16 bytes, 4 bytes): same bits."""
    rng = np.random.default_rng(6)
    shape = (2048, 1024)
    raw = Q.quantize(rng.standard_normal(shape).astype(np.float32), fmt)
    want = _two_pass(raw, fmt, shape)
    buf = np.empty(2048 * 1024 + 16, np.float32)
    start = (-buf.ctypes.data % 64) // 4
    for offset in (start, start + 4, start + 1):         # 64-, 16-, 4-byte aligned
        out = buf[offset:offset + 2048 * 1024].reshape(shape)
        for threads in (1, 3):
            out.fill(np.nan)
            Q.dequantize(raw, fmt, shape, out=out, threads=threads)
            assert out.tobytes() == want.tobytes(), (offset, threads)


def test_dequantize_allocates_a_64_byte_aligned_output_with_the_same_bits():
    rng = np.random.default_rng(7)
    shape = (2048, 1024)                                 # 8 MiB: streamed
    raw = Q.quantize(rng.standard_normal(shape).astype(np.float32), "mq4g256v2")
    got = Q.dequantize(raw, "mq4g256v2", shape)
    assert got.ctypes.data % 64 == 0 and got.shape == shape and got.flags.c_contiguous
    assert got.tobytes() == _two_pass(raw, "mq4g256v2", shape).tobytes()
    small = Q.dequantize(raw[:136], "mq4g256v2", (256,))
    assert small.ctypes.data % 64 == 0 and small.shape == (256,)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512-vnni"])
def test_the_isa_cap_picks_another_mq_decoder_with_the_same_bits(isa, monkeypatch):
    rng = np.random.default_rng(5)
    raw = Q.quantize(rng.standard_normal((64, 512)).astype(np.float32), "mq4g256v2")
    want = Q.dequantize(raw, "mq4g256v2", (64, 512))
    monkeypatch.setenv("PAGEDKV_CPU_ISA", isa)      # scalar: the two-pass path
    assert Q.dequantize(raw, "mq4g256v2", (64, 512), threads=2).tobytes() == want.tobytes()


@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256", "q8f16", "hfq3g128", "q4f16g64",
                                 "mq4g256lloyd", "mq8g256", "f16", "bf16"])
def test_a_short_last_group_with_threads(fmt):
    rng = np.random.default_rng(3)
    n = 256 * 300 + 77
    raw = Q.quantize(rng.standard_normal(n).astype(np.float32), fmt)
    want = Q.dequantize(raw, fmt, n)
    assert Q.dequantize(raw, fmt, n, threads=4).tobytes() == want.tobytes()


@pytest.mark.parametrize("fmt", ["tq2g128", "bq1g128"])
def test_decode_only_formats_bits_do_not_depend_on_threads(fmt):
    """The passthrough formats pagedkv cannot encode: any bytes decode, on any thread count
    to the same bits, including a short last group."""
    codec = Q.resolve(fmt)
    rng = np.random.default_rng(11)
    for n in (67 * 4096, 128 * 300 + 5):
        groups = -(-n // 128)
        raw = rng.integers(0, 256, groups * codec.group_bytes, dtype=np.uint8)
        raw.reshape(groups, -1)[:, 1] &= 0x3B          # finite f16 d (exponent below 31)
        want = Q.dequantize(raw, fmt, n)
        assert np.isfinite(want).all()
        for threads in (2, 3, 8):
            assert Q.dequantize(raw, fmt, n, threads=threads).tobytes() == want.tobytes()


def test_decoder_modules_refuse_zero_threads_before_writing():
    from pagedkv.quant import codebook, fp4, gaussian_codebook, half, legacy, q8, ternary
    rng = np.random.default_rng(12)
    x = rng.standard_normal(4096).astype(np.float32)
    out = np.full(4096, 7.0, np.float32)
    calls = [
        lambda raw: legacy.q4k_decode(raw, out, 0), lambda raw: legacy.q4f16g64_decode(raw, out, 0),
        lambda raw: q8.mq8_decode(raw, out, False, 0), lambda raw: q8.q8hfq_decode(raw, out, 512, 0),
        lambda raw: codebook.decode(raw, out, 4, True, False, 0),
        lambda raw: gaussian_codebook.decode(raw, out, 2, False, 0),
        lambda raw: fp4.decode(raw, out, 512, 0, False, 0),
        lambda raw: ternary.decode(raw, out, 2, 0),
        lambda raw: half.f16_to_f32(raw.view(np.uint16), out, 0),
    ]
    fmts = ["q4k", "q4f16g64", "mq8g256", "q8hfq", "mq4g256lloyd", "mq2g256gl", "hfp4g32",
            None, "f16"]
    for call, fmt in zip(calls, fmts):
        if fmt is None:
            raw = np.zeros(32 * 34, np.uint8)           # tq2g128: 32 groups of 34 bytes
        elif fmt == "q8hfq" or fmt == "hfp4g32":
            raw = Q.quantize(x.reshape(8, 512), fmt)
        else:
            raw = Q.quantize(x, fmt)
        with pytest.raises(InvalidArgument, match="threads"):
            call(raw)
        assert np.all(out == 7.0), fmt


def test_dequantize_threads_argument_errors_leave_out_untouched():
    raw = Q.quantize(np.ones((4, 256), np.float32), "hfq4g256")
    out = np.full((4, 256), 5.0, np.float32)
    for bad, exc in ((0, InvalidArgument), (-2, InvalidArgument), (True, InvalidArgumentType),
                     (2.0, InvalidArgumentType), ("2", InvalidArgumentType)):
        with pytest.raises(exc, match="threads"):
            Q.dequantize(raw, "hfq4g256", (4, 256), out=out, threads=bad)
    assert np.all(out == 5.0)


def test_pool_runs_every_part_once_with_its_count():
    for n_parts, threads in ((1, 1), (2, 2), (3, 3), (7, 7), (cpu_pool.MAX_THREADS, None),
                             (300, 2), (1000, cpu_pool.MAX_THREADS), (5, 64), (16, 1)):
        assert cpu_pool.run_parts(n_parts, threads) == [(1, n_parts)] * n_parts
    for n_parts in (1, 7, 64, 65, 4096):                  # threads=None: one per part, capped
        assert cpu_pool.run_parts(n_parts) == [(1, n_parts)] * n_parts
    for bad_parts, bad_threads in ((0, None), (0, 1), (4, 0), (4, cpu_pool.MAX_THREADS + 1)):
        with pytest.raises(InvalidArgument, match="n_parts" if bad_parts == 0 else "threads"):
            cpu_pool.run_parts(bad_parts, bad_threads)


@pytest.mark.parametrize("spin_us", [0, 1, cpu_pool.SPIN_US_DEFAULT, 100_000])
def test_pool_never_loses_a_job_whether_workers_spin_or_sleep(spin_us):
    # 0: every job wakes sleeping workers; 1: jobs race the spin's end; 100 ms: workers
    # are always spinning
    before = cpu_pool.spin_us()
    cpu_pool.set_spin_us(spin_us)
    try:
        assert cpu_pool.spin_us() == spin_us
        for i in range(400):
            n = 2 + i % 30
            assert cpu_pool.run_parts(n, 2 + i % 3) == [(1, n)] * n
    finally:
        cpu_pool.set_spin_us(before)


def test_set_spin_us_refuses_what_is_not_microseconds_and_keeps_the_value():
    before = cpu_pool.spin_us()
    for bad in (-1, 2**32, 1.5, True, "5", None):
        with pytest.raises(InvalidArgument, match="spin_us"):
            cpu_pool.set_spin_us(bad)
        assert cpu_pool.spin_us() == before


@pytest.mark.parametrize("value, expected", [("7", 7), (" 0 ", 0), ("soon", None),
                                             ("-3", None)])
def test_spin_env_knob_is_read_at_import(value, expected):
    # a fresh interpreter: the knob is read once, when cpu_pool is imported
    code = ("import logging, sys; logging.basicConfig(stream=sys.stdout); "
            "from pagedkv.quant import cpu_pool; print(cpu_pool.spin_us(), cpu_pool.SPIN_US_DEFAULT)")
    env = dict(os.environ, PAGEDKV_CPU_SPIN_US=value)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    got, default = map(int, out.split()[-2:])
    assert got == (default if expected is None else expected)
    assert ("ignoring PAGEDKV_CPU_SPIN_US" in out) == (expected is None)


_TSAN_HARNESS = r"""
#include <stdio.h>
#include "cpu_pool.h"
typedef struct { int *hits; int *out; int n; } job_t;
static void part(void *ctx, int p, int n) {
    job_t *j = ctx;
    j->hits[p] += 1;        /* a plain write: two threads on one part would race */
    j->out[p] = p * 3 + n;
}
static void *caller(void *arg) {
    int id = (int)(ptrdiff_t)arg, bad = 0;
    for (int it = 0; it < 3000; ++it) {
        int n = 1 + (it * 7 + id) % 40, th = 1 + (it + id) % 4, hits[64] = {0}, out[64] = {0};
        job_t j = {hits, out, n};   /* on this caller's stack, reused by the next job */
        if (it % 500 == 0) pkv_pool_set_spin_us(it % 1000 == 0 ? 0 : 50);
        pkv_pool_run(part, &j, n, th);
        for (int p = 0; p < n; ++p) bad += hits[p] != 1 || out[p] != p * 3 + n;
    }
    return (void *)(ptrdiff_t)bad;
}
int main(void) {
    pthread_t t[3];
    long bad = 0;
    for (int i = 0; i < 3; ++i) pthread_create(&t[i], NULL, caller, (void *)(ptrdiff_t)i);
    for (int i = 0; i < 3; ++i) {
        void *r;
        pthread_join(t[i], &r);
        bad += (long)(ptrdiff_t)r;
    }
    printf("bad %ld\n", bad);
    return bad != 0;
}
"""


def test_pool_protocol_is_race_free_under_thread_sanitizer(tmp_path):
    # three callers race for the pool with jobs of 1-40 parts on 1-4 threads, spinning and
    # sleeping workers: ThreadSanitizer sees every access a part makes to its caller's
    # stack, so a part run twice, or run for a job its ticket does not belong to, is a
    # report (one such bug, a part count read from a field the next caller had rewritten,
    # was found this way)
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    quant_dir = quant_header_dir()
    if cc is None or quant_dir is None:
        pytest.skip("needs a C compiler and the source tree's cpu_pool.h")
    src, exe = tmp_path / "pool.c", tmp_path / "pool"
    src.write_text(_TSAN_HARNESS)
    build = subprocess.run([cc, "-O1", "-g", "-fsanitize=thread", "-pthread", f"-I{quant_dir}",
                            str(src), "-o", str(exe)], capture_output=True, text=True,
                           check=False, timeout=300)
    if build.returncode != 0:
        pytest.skip(f"{cc} cannot build with -fsanitize=thread here: {build.stderr[-300:]}")
    for _ in range(3):
        run = subprocess.run([str(exe)], capture_output=True, text=True, check=False,
                             timeout=300, env=dict(os.environ, TSAN_OPTIONS="halt_on_error=1"))
        assert "ThreadSanitizer" not in run.stderr, run.stderr[-4000:]
        assert run.returncode == 0 and run.stdout.strip() == "bad 0", (run.stdout, run.stderr)


def test_pool_with_concurrent_callers():
    errors = []

    def worker():
        for _ in range(300):
            got = cpu_pool.run_parts(3)
            if got != [(1, 3)] * 3:
                errors.append(got)
    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []


def _child(q):
    q.put(cpu_pool.run_parts(4))


def test_pool_after_fork():
    cpu_pool.run_parts(4)                     # the parent has workers now
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    got = q.get(timeout=60)
    p.join(timeout=60)
    assert p.exitcode == 0 and got == [(1, 4)] * 4
