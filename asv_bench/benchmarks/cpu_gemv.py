"""CPU weight kernels (issue 18): the prepared int8 GEMV, dequantize and their threads.

asv suites time pagedkv alone. Run as a script for the side-by-side table of
docs/performance.md: pagedkv in this process, llama.cpp's ggml in a worker process
(``asv_bench/peers/ggml_worker.cpp``, built against a ggml outside the repository; see
docs/performance.md, "CPU GEMV against ggml"), one measurement at a time, the order
rotated every round, single-threaded unless a row says otherwise::

    python asv_bench/benchmarks/cpu_gemv.py --ggml /path/to/ggml_worker --rounds 7
    python asv_bench/benchmarks/cpu_gemv.py --ggml /path/to/ggml_worker --cold  # from DRAM
    python asv_bench/benchmarks/cpu_gemv.py --threads-scaling 40     # 1 vs 2 threads
    python asv_bench/benchmarks/cpu_gemv.py --spin-ab 40     # 1 vs 2, workers spin or sleep
    python asv_bench/benchmarks/cpu_gemv.py --isa avx2 --only b1,b2,b4,b8 \
        --baseline /path/to/old/prepared_gemv.cpython-311-x86_64-linux-gnu.so  # before/after

Each measurement is the median of its calls (2 warm-up calls, then at least 5 and up
to ``--budget-ms``); the table shows the median and the minimum over rounds, in wall
time and in this thread's CPU time (on a shared machine the CPU time is the cost of
the code, the wall time also what the neighbours took). ``PAGEDKV_CPU_ISA`` picks the
pagedkv kernel (e.g. ``avx2``); the ggml worker runs whatever it was built for.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # before numpy loads OpenBLAS

import argparse
import importlib.util
import itertools
import json
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

import pagedkv.quant as Q
from pagedkv.quant import cpu_pool, prepared_gemv

SHAPES = [(4096, 4096), (4096, 14336)]        # (M, K)
GEMV_FORMATS = ["hfq4g256", "mq4g256v2", "q8f16", "q4k"]   # q4k: GGML Q4_K, as ggml q4_K
#: formats timed for dequantize only (threads=): a Lloyd codebook, a GL codebook, raw f16
DEQUANT_ONLY_FORMATS = ["mq4g256lloyd", "mq3g256gl", "f16"]
BATCHES = [1, 2, 4, 8]


def _weights(m: int, k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)


# --cold: every GEMV call reads another copy of the weights, cycling through at least this
# many bytes (the ggml worker's cold mode uses the same figure), so the weights come from
# DRAM as in a model's decode step, where no layer's matrices stay in the caches.
COLD_BYTES = 256 << 20


def _copies(make, cold: bool) -> list:
    """``[make()]``, or (cold) as many prepared GEMVs from ``make`` as cycle through
    COLD_BYTES."""
    first = make()
    n = -(-COLD_BYTES // first.nbytes) if cold else 1
    return [first, *(make() for _ in range(n - 1))]


def _cycling(gs: list, x: np.ndarray, **kw):
    """A call of the next copy in ``gs`` (all of them the same weights) on ``x``."""
    nxt = itertools.cycle(gs).__next__
    return lambda: nxt()(x, **kw)


class PreparedGemv:
    """``PreparedGemv.__call__`` per format and batch at 4096x4096 (one thread)."""

    params = (GEMV_FORMATS, BATCHES)
    param_names = ["fmt", "batch"]  # noqa: RUF012 (asv reads lists)

    def setup(self, fmt, batch):
        self.gemv = Q.prepare_gemv(Q.quantize(_weights(4096, 4096), fmt), fmt, (4096, 4096))
        self.x = _weights(batch, 4096, seed=1)

    def time_call(self, fmt, batch):
        self.gemv(self.x)


class PreparedGemvCold:
    """Batch-1 GEMV at 4096x4096 with the weights from DRAM, as in a model's decode step:
    every call reads the next of enough copies to cycle through COLD_BYTES
    (docs/performance.md, "Weights from DRAM")."""

    params = ["hfq4g256", "mq4g256v2", "q8f16", "q4k"]  # noqa: RUF012
    param_names = ["fmt"]  # noqa: RUF012

    def setup(self, fmt):
        raw = Q.quantize(_weights(4096, 4096), fmt)
        gs = _copies(lambda: Q.prepare_gemv(raw, fmt, (4096, 4096)), True)
        self.call = _cycling(gs, _weights(1, 4096, seed=1))

    def time_call(self, fmt):
        self.call()


class PreparedGemvAvx2Batch:
    """The AVX2 kernel (the Zen 1-3 / Haswell path) per batch, 4096x4096 and 4096x14336:
    rows per second at batch B against batch 1 (docs/performance.md, "Batch 2–8 on AVX2")."""

    params = (GEMV_FORMATS, BATCHES, ["4096x4096", "4096x14336"])
    param_names = ["fmt", "batch", "shape"]  # noqa: RUF012

    def setup(self, fmt, batch, shape):
        if "avx2" not in prepared_gemv.supported_isas():
            raise NotImplementedError("no AVX2 here")       # asv skips the case
        m, k = (int(v) for v in shape.split("x"))
        self.gemv = Q.prepare_gemv(Q.quantize(_weights(m, k), fmt), fmt, (m, k), isa="avx2")
        self.x = _weights(batch, k, seed=1)

    def time_call(self, fmt, batch, shape):
        self.gemv(self.x)


class PreparedGemvThreads:
    """The same call on 1 and 2 threads, 4096x14336, batch 1."""

    params = (["hfq4g256", "mq4g256v2", "q8f16", *DEQUANT_ONLY_FORMATS], [1, 2])
    param_names = ["fmt", "threads"]  # noqa: RUF012

    def setup(self, fmt, threads):
        self.gemv = Q.prepare_gemv(Q.quantize(_weights(4096, 14336), fmt), fmt, (4096, 14336))
        self.x = _weights(1, 14336, seed=1)

    def time_call(self, fmt, threads):
        self.gemv(self.x, threads=threads)


class Prepare:
    """Building the prepared layout of a 4096x4096 tensor (once per tensor)."""

    params = ["hfq4g256", "mq4g256v2", "q8f16"]  # noqa: RUF012
    param_names = ["fmt"]  # noqa: RUF012

    def setup(self, fmt):
        self.raw = Q.quantize(_weights(4096, 4096), fmt)

    def time_prepare(self, fmt):
        Q.prepare_gemv(self.raw, fmt, (4096, 4096))


class DequantizeThreads:
    """``dequantize`` into a reused buffer, 4096x4096, on 1 and 2 threads."""

    params = (["hfq4g256", "mq4g256v2", "q8f16", *DEQUANT_ONLY_FORMATS], [1, 2])
    param_names = ["fmt", "threads"]  # noqa: RUF012

    def setup(self, fmt, threads):
        self.raw = Q.quantize(_weights(4096, 4096), fmt)
        self.out = prepared_gemv.aligned_empty((4096, 4096), np.float32)

    def time_dequantize(self, fmt, threads):
        Q.dequantize(self.raw, fmt, (4096, 4096), out=self.out, threads=threads)


# ----------------------------------------------------------------------------- script

def _timed(call, budget_ms: float, max_calls: int = 400) -> tuple[list[int], list[int]]:
    call()
    call()
    wall, cpu = [], []
    start = time.perf_counter_ns()
    while len(wall) < max_calls and (len(wall) < 5 or time.perf_counter_ns() - start < budget_ms * 1e6):
        w0 = time.perf_counter_ns()
        c0 = time.thread_time_ns()
        call()
        c1 = time.thread_time_ns()
        wall.append(time.perf_counter_ns() - w0)
        cpu.append(c1 - c0)
    return wall, cpu


class _Ggml:
    """The ggml worker (one command per line on stdin, one ``OK ...`` reply on stdout)."""

    def __init__(self, path: str):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, bufsize=1)

    def ask(self, line: str) -> dict[str, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()
        if not reply.startswith("OK"):
            raise RuntimeError(f"ggml worker: {line!r} -> {reply!r}")
        return dict(tok.split("=", 1) for tok in reply.split()[1:])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


def _load_baseline(path: str):
    """A ``prepared_gemv`` extension built from another commit (its ``.so``), loaded beside
    this one, so a change is timed against its predecessor in the same run."""
    spec = importlib.util.spec_from_file_location("pagedkv_baseline.prepared_gemv", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path}: not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cases(m: int, k: int, ggml: _Ggml | None, isa: str | None, baseline=None,
           cold: bool = False):
    """(name, op, callable or ggml command) for one shape; callables for pagedkv. ``cold``:
    the GEMVs (pagedkv's and ggml's) cycle through copies of their weights (COLD_BYTES);
    dequantize and the float-x ``gemv()`` stay on one copy."""
    w = _weights(m, k)
    x8 = _weights(8, k, seed=1)
    out = prepared_gemv.aligned_empty((m, k), np.float32)   # as dequantize allocates it
    cases = []
    for fmt in GEMV_FORMATS:
        raw = Q.quantize(w, fmt)
        gs = _copies(lambda raw=raw, fmt=fmt: Q.prepare_gemv(raw, fmt, (m, k), isa=isa), cold)
        g = gs[0]
        for b in BATCHES:
            cases.append((f"pagedkv {fmt} b{b}", "gemv", _cycling(gs, x8[:b])))
        if baseline is not None:
            g0s = _copies(lambda raw=raw, fmt=fmt: baseline.PreparedGemv(raw, fmt, (m, k), isa=isa),
                          cold)
            for b in BATCHES:
                if g0s[0](x8[:b]).tobytes() != g(x8[:b]).tobytes():
                    raise SystemExit(f"--baseline gives other bits: {fmt} b{b}")
                cases.append((f"baseline {fmt} b{b}", "gemv", _cycling(g0s, x8[:b])))
        cases.append((f"pagedkv {fmt} b1 threads=2", "gemv", _cycling(gs, x8[:1], threads=2)))
        cases.append((f"pagedkv {fmt} gemv() f32 x", "gemv",
                      (lambda raw=raw, fmt=fmt, x=x8[0]: Q.gemv(raw, fmt, (m, k), x))))
        cases.append((f"pagedkv {fmt} dequantize", "dequant",
                      (lambda raw=raw, fmt=fmt: Q.dequantize(raw, fmt, (m, k), out=out))))
        cases.append((f"pagedkv {fmt} dequantize threads=2", "dequant",
                      (lambda raw=raw, fmt=fmt: Q.dequantize(raw, fmt, (m, k), out=out,
                                                            threads=2))))
    if ggml is not None:
        for t, mode in (("q4_0", "repack"), ("q4_K", "repack"), ("q8_0", "graph")):
            for b in (1, 4, 8) if t == "q4_0" else (1,):
                cases.append((f"ggml {t} {mode} b{b}", "gemv",
                              f"gemv {t} {mode} {m} {k} {'cold' if cold else 'hot'}", b))
        for t in ("q4_0", "q4_K", "q8_0"):
            cases.append((f"ggml {t} to_float", "dequant", f"dequant {t} x {m} {k}", 0))
    return cases


def threads_scaling(shapes, pairs: int, isa: str | None) -> None:
    """Wall time of 1 and 2 threads, called in alternation (pairs of calls), per case: the
    ratio of the medians and of the minimums (threads= on a 2-core machine)."""
    print("| shape | case | 1 thread wall ms median (min) | 2 threads | speed-up median (min) |")
    print("|---|---|---|---|---|")
    for m, k in shapes:
        w = _weights(m, k)
        x = _weights(1, k, seed=1)
        out = prepared_gemv.aligned_empty((m, k), np.float32)   # as dequantize allocates it
        for fmt in (*GEMV_FORMATS, *DEQUANT_ONLY_FORMATS):
            raw = Q.quantize(w, fmt)
            shape = (m, k)
            cases = [(f"{fmt} dequantize",
                      lambda t, raw=raw, fmt=fmt, shape=shape, out=out: Q.dequantize(
                          raw, fmt, shape, out=out, threads=t))]
            if fmt in GEMV_FORMATS:
                g = Q.prepare_gemv(raw, fmt, (m, k), isa=isa)
                cases.insert(0, (f"{fmt} gemv b1", lambda t, g=g, x=x: g(x, threads=t)))
            for name, call in cases:
                call(1)
                call(2)
                times: dict[int, list[float]] = {1: [], 2: []}
                for i in range(pairs):
                    for t in ((1, 2) if i % 2 == 0 else (2, 1)):
                        t0 = time.perf_counter()
                        call(t)
                        times[t].append(time.perf_counter() - t0)
                m1, m2 = statistics.median(times[1]), statistics.median(times[2])
                n1, n2 = min(times[1]), min(times[2])
                print(f"| {m}x{k} | {name} | {m1 * 1e3:.3f} ({n1 * 1e3:.3f}) | "
                      f"{m2 * 1e3:.3f} ({n2 * 1e3:.3f}) | {m1 / m2:.2f}x ({n1 / n2:.2f}x) |")


def _batch_scaling(results, shapes) -> list[str]:
    """Rows per second at batch B against batch 1, ``B x t(b1) / t(bB)``, from the medians
    of thread CPU time (the target of docs/performance.md, "Batch 2–8 on AVX2": >= 3x)."""
    lines = []
    for shape in shapes:
        for who in ("pagedkv", "baseline"):
            for fmt in GEMV_FORMATS:
                cpu = {b: statistics.median(c for _, c in results[(shape, f"{who} {fmt} b{b}")])
                       for b in BATCHES if (shape, f"{who} {fmt} b{b}") in results}
                if 1 in cpu and len(cpu) > 1:
                    ratios = " ".join(f"B{b}={b * cpu[1] / t:.2f}x" for b, t in cpu.items() if b > 1)
                    name = fmt if who == "pagedkv" else f"{fmt} (baseline)"
                    lines.append(f"# rows/s against b1, {shape[0]}x{shape[1]} {name}: {ratios}")
    return lines


def spin_ab(shapes, blocks: int, isa: str | None, run: int = 25) -> None:
    """threads=2 over threads=1 for the GEMV, the pool's workers spinning 200 us between
    jobs against sleeping at once, in one process: blocks alternate the spin, each block
    times ``run`` consecutive calls on 1 thread and ``run`` on 2 (as a model's GEMVs
    follow each other), so both settings see the same neighbours."""
    print("| shape | case | spin 0: 1 / 2 threads ms, speed-up | spin 200 us | ")
    print("|---|---|---|---|")
    before = cpu_pool.spin_us()
    for m, k in shapes:
        w = _weights(m, k)
        x = _weights(1, k, seed=1)
        for fmt in GEMV_FORMATS:
            g = Q.prepare_gemv(Q.quantize(w, fmt), fmt, (m, k), isa=isa)
            times: dict[tuple[int, int], list[float]] = {
                (s, t): [] for s in (0, 200) for t in (1, 2)}
            for b in range(blocks):
                spin = (0, 200)[b % 2]
                cpu_pool.set_spin_us(spin)
                time.sleep(0.001)                   # spin 0: the workers are asleep
                for t in ((1, 2) if b % 4 < 2 else (2, 1)):
                    g(x, threads=t)
                    for _ in range(run):
                        t0 = time.perf_counter()
                        g(x, threads=t)
                        times[(spin, t)].append(time.perf_counter() - t0)
            med = {key: statistics.median(v) for key, v in times.items()}
            print(f"| {m}x{k} | {fmt} gemv b1 | " + " | ".join(
                f"{med[(s, 1)] * 1e3:.3f} / {med[(s, 2)] * 1e3:.3f}, "
                f"{med[(s, 1)] / med[(s, 2)]:.2f}x" for s in (0, 200)) + " |", flush=True)
    cpu_pool.set_spin_us(before)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ggml", help="path of the ggml worker binary (asv_bench/peers)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-ms", type=float, default=150.0)
    ap.add_argument("--shape", action="append", help="MxK (default: 4096x4096 and 4096x14336)")
    ap.add_argument("--isa", help="pagedkv kernel, as PAGEDKV_CPU_ISA (default: the best here)")
    ap.add_argument("--only", help="comma-separated substrings: run the cases that match")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--cold", action="store_true",
                    help="GEMVs cycle through >= 256 MiB of weight copies (pagedkv's and "
                         "ggml's): weights from DRAM, as in a model's decode step")
    ap.add_argument("--baseline", metavar="SO",
                    help="also time the prepared_gemv extension at this path (built from "
                         "another commit), as 'baseline ...' cases, alternated with this one")
    ap.add_argument("--threads-scaling", type=int, metavar="PAIRS",
                    help="only time 1 against 2 threads, PAIRS alternated pairs of calls")
    ap.add_argument("--spin-ab", type=int, metavar="BLOCKS",
                    help="only time 1 against 2 threads with the pool's workers spinning "
                         "and sleeping, BLOCKS alternated blocks of 25 + 25 calls")
    args = ap.parse_args(argv)
    if args.isa:                         # the one-pass MQ dequantize follows it too
        os.environ["PAGEDKV_CPU_ISA"] = args.isa
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shape] if args.shape else SHAPES
    if args.threads_scaling or args.spin_ab:
        load0 = os.getloadavg()
        if args.spin_ab:
            spin_ab(shapes, args.spin_ab, args.isa)
        else:
            threads_scaling(shapes, args.threads_scaling, args.isa)
        load1 = os.getloadavg()
        print(f"# load average (1/5/15 min) at start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, "
              f"at end {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f}; {os.cpu_count()} CPUs")
        return
    ggml = _Ggml(args.ggml) if args.ggml else None
    load0 = os.getloadavg()
    info = {"cpu": platform.processor() or platform.machine(), "isa": args.isa or
            prepared_gemv.default_isa(), "supported": prepared_gemv.supported_isas(),
            "ggml": ggml.ask("info").get("features") if ggml else None,
            "start": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_start": load0,
            "weights": "cold" if args.cold else "hot"}
    print("#", json.dumps(info))
    results: dict[tuple[tuple[int, int], str], list[tuple[float, float]]] = {}
    order: list[tuple[tuple[int, int], str, str]] = []
    baseline = _load_baseline(args.baseline) if args.baseline else None
    all_cases = {shape: _cases(*shape, ggml, args.isa, baseline, args.cold) for shape in shapes}
    only = args.only.split(",") if args.only else None
    for r in range(args.rounds):
        for shape, cases in all_cases.items():
            chosen = [c for c in cases if only is None or any(o in c[0] for o in only)]
            rot = r % max(1, len(chosen))
            for name, op, what, *batch in chosen[rot:] + chosen[:rot]:
                if isinstance(what, str):
                    assert ggml is not None
                    budget = args.budget_ms if op == "gemv" else 2 * args.budget_ms
                    rep = ggml.ask(f"{what} 400 2 {budget} {batch[0]}" if op == "gemv" else
                                   f"{what} 100 1 {budget}")
                    wall = [int(v) for v in rep["wall"].split(",")]
                    cpu = [int(v) for v in rep["cpu"].split(",")]
                else:
                    wall, cpu = _timed(what, args.budget_ms if op == "gemv" else 2 * args.budget_ms)
                key = (shape, name)
                if key not in results:
                    order.append((shape, name, op))
                results.setdefault(key, []).append((statistics.median(wall) / 1e6,
                                                    statistics.median(cpu) / 1e6))
        print(f"# round {r} done, load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    if ggml is not None:
        ggml.close()
    load1 = os.getloadavg()
    print(f"# load average at start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, "
          f"at end {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f}; {args.rounds} rounds")
    print("| shape | case | wall ms median (min) | CPU ms median (min) |")
    print("|---|---|---|---|")
    for shape, name, _op in order:
        rows = results[(shape, name)]
        wall = [w for w, _ in rows]
        cpu = [c for _, c in rows]
        print(f"| {shape[0]}x{shape[1]} | {name} | {statistics.median(wall):.3f} ({min(wall):.3f}) "
              f"| {statistics.median(cpu):.3f} ({min(cpu):.3f}) |")
    for line in _batch_scaling(results, shapes):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": [
                {"shape": list(s), "case": n, "op": o, "rounds": results[(s, n)]}
                for s, n, o in order]}, f, indent=1)


if __name__ == "__main__":
    main()
