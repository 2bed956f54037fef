"""``python -m pagedkv.bench mlx``: pagedkv.kernels.mlx on MLX's default device.

Per kernel and shape: time per call, achieved GB/s (bytes the kernel must move: each input
read once, each output written once) and the fraction of the copy bandwidth measured in
the same run (an MLX elementwise copy of 1 GiB, read + write bytes). Next to the paged
attention, MLX's own ``mx.fast.scaled_dot_product_attention`` on a contiguous cache of the
same shape; next to the 4-bit GEMV, ``mx.quantized_matmul`` (4 bits, group 64) on the same
matrix. Weights rotate through copies totalling >= 256 MiB (4x the H200's L2) so a loop
measures memory, not cache. Times are medians of several loops of calls evaluated
together (MLX queues them asynchronously), host work included, as a model sees them;
``host_us`` (GEMV, dequantize) is the host's share alone: building the same calls without
evaluating them (Python, argument checks, MLX graph construction), for ours and for
``mx.quantized_matmul``. ``eval_us`` is the other share: the same calls built first
(untimed), then evaluated and synchronized (device time, with MLX's own per-launch work
in eval: encoding the launch and, for a custom kernel, hashing its source). A row whose
``us`` is close to its ``host_us`` is bound by the host, not by the kernel. GEMV and
attention rows carry both for ours and for MLX's baseline. On MLX's CUDA backend the
GEMV and attention rows are measured twice in one run: with the kernels' headers as an
``#include`` of a cached file (the default) and, in rows marked ``[inline header]``,
with the hip/ text inline (the earlier path; pagedkv.kernels.mlx.cuda.set_header_mode).
Targets (issue 14, on the H200 through MLX CUDA): attention within 1.1x of MLX's SDPA;
4-bit GEMV faster than mx.quantized_matmul at batch 1 and 8.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from functools import partial

import numpy as np

from pagedkv.quant import kv_q8

REPEATS = 5
ROTATE_BYTES = 256 << 20


def _time(mx, fn, calls: int) -> float:
    """Median seconds per call of ``fn(i)`` for i < calls, evaluated together."""
    mx.eval(fn(0))
    mx.synchronize()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        outs = [fn(i) for i in range(calls)]
        mx.eval(outs)
        mx.synchronize()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _host_time(mx, fn, calls: int) -> float:
    """Median seconds per call spent on the host building ``fn(i)`` (Python, argument
    checks, MLX graph construction), nothing evaluated while timed: next to :func:`_time`
    it says whether a row is bound by the host or by the device."""
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        outs = [fn(i) for i in range(calls)]
        times.append((time.perf_counter() - t0) / calls)
        mx.eval(outs)
    mx.synchronize()
    return statistics.median(times)


def _eval_time(mx, fn, calls: int) -> float:
    """Median seconds per call of evaluating ``fn(i)`` for i < calls, built beforehand
    (untimed): the device's share, plus MLX's per-launch work inside ``eval``."""
    times = []
    for _ in range(REPEATS):
        outs = [fn(i) for i in range(calls)]
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _split(mx, fn, calls: int, prefix: str = "") -> dict:
    """``host_us`` and ``eval_us`` of ``fn`` (keys prefixed by ``prefix``)."""
    return {f"{prefix}host_us": _host_time(mx, fn, calls) * 1e6,
            f"{prefix}eval_us": _eval_time(mx, fn, calls) * 1e6}


def _header_modes(K) -> list:
    """``(row suffix, header mode)`` pairs to measure: on MLX CUDA the default (#include)
    and the earlier inline headers in the same run; elsewhere the one path there is."""
    if K.backend() != "cuda":
        return [("", None)]
    from pagedkv.kernels.mlx.cuda import header_mode
    current = header_mode()  # PAGEDKV_MLX_CUDA_HEADER=inline measures the old path alone
    return [("", current)] + ([(" [inline header]", "inline")] if current == "include" else [])


def _set_header_mode(mode) -> None:
    if mode is not None:
        from pagedkv.kernels.mlx.cuda import set_header_mode
        set_header_mode(mode)


def _cycling(fn, items: list):
    """``i -> fn(items[i % len(items)])``: each call takes the next copy."""
    return lambda i: fn(items[i % len(items)])


def _copies(mx, make, nbytes: int, gpu: bool) -> list:
    """``make()`` results totalling >= ROTATE_BYTES on a GPU (one on the CPU), evaluated."""
    n = max(2, math.ceil(ROTATE_BYTES / max(nbytes, 1))) if gpu else 1
    items = [make() for _ in range(n)]
    mx.eval([getattr(i, "array", i) for i in items])
    return items


def copy_bandwidth(mx, nbytes: int) -> float:
    """Read + write bytes per second of an elementwise copy of ``nbytes``."""
    x = mx.zeros((nbytes // 4,), dtype=mx.uint32)
    mx.eval(x)
    t = _time(mx, lambda i: x + 1, 4)
    return 2 * x.nbytes / t


def bench_gemv(mx, K, rows, copy_bw, shapes, batches, gpu):
    from pagedkv import quant
    from pagedkv.bench.gpu import _row
    rng = np.random.default_rng(0)
    for M, N in shapes:
        w = (rng.standard_normal((M, N)) * 0.02).astype(np.float32)
        wq_ref = mx.quantize(mx.array(w).astype(mx.float16), group_size=64, bits=4)
        refs = _copies(mx, partial(tuple, [mx.array(a) for a in wq_ref]), wq_ref[0].nbytes, gpu)
        for fmt in ("hfq4g256", "mq4g256v2"):
            raw = quant.quantize(w, fmt)
            packed = _copies(mx, partial(K.prepare_gemv, raw, fmt, M, N), raw.nbytes, gpu)
            for batch in batches:
                x = mx.array(rng.standard_normal((batch, N)).astype(np.float32))
                qmm = _cycling(partial(_qmm, mx, x.astype(mx.float16)), refs)
                t_ref = _time(mx, qmm, 4 * len(refs))
                ref_split = _split(mx, qmm, 4 * len(refs), "mlx_qmm_")
                nbytes = raw.nbytes + 4 * batch * (M + N)
                modes = _header_modes(K)
                for suffix, mode in modes:
                    _set_header_mode(mode)
                    ours = _cycling(partial(_gemv, K, x=x), packed)
                    t = _time(mx, ours, 4 * len(packed))
                    _row(rows, f"gemv {fmt} b{batch}{suffix}", f"{M}x{N}", t, nbytes, copy_bw,
                         {"mlx_qmm_4bit_us": t_ref * 1e6, "speedup_vs_mlx": t_ref / t,
                          **_split(mx, ours, 4 * len(packed)), **ref_split})
                _set_header_mode(modes[0][1])
                t, extra = _compiled_gemv_times(mx, K, x, packed, refs)
                _row(rows, f"gemv {fmt} b{batch} [mx.compile]", f"{M}x{N}", t, nbytes,
                     copy_bw, extra)


def _compiled_gemv_times(mx, K, x, packed, refs):
    """``(seconds, extra)`` of a row: the same GEMV calls, and mx.quantized_matmul's, each
    inside ``mx.compile`` (one compiled function per weight copy, the copy a constant of
    it), as a model whose step is compiled runs them: MLX traces the launches once and
    replays them, so a call builds no kernel (``host_us``)."""
    xh = x.astype(mx.float16)
    ours = [mx.compile(partial(_gemv, K, p)) for p in packed]
    theirs = [mx.compile(lambda xh, r=r: _qmm(mx, xh, r)) for r in refs]
    mx.eval([f(x) for f in ours] + [f(xh) for f in theirs])  # every trace before timing
    run_ours = _cycling(lambda f: f(x), ours)
    run_theirs = _cycling(lambda f: f(xh), theirs)
    t_ref = _time(mx, run_theirs, 4 * len(theirs))
    t = _time(mx, run_ours, 4 * len(ours))
    return t, {"mlx_qmm_4bit_us": t_ref * 1e6, "speedup_vs_mlx": t_ref / t,
               **_split(mx, run_ours, 4 * len(ours)),
               **_split(mx, run_theirs, 4 * len(theirs), "mlx_qmm_")}


def _gemv(K, weights, x):
    return K.gemv(weights, x)


def _qmm(mx, xh, ref):
    return mx.quantized_matmul(xh, *ref, transpose=True, group_size=64, bits=4)


def bench_dequant(mx, K, rows, copy_bw, shape, gpu):
    from pagedkv import quant
    from pagedkv.bench.gpu import _row
    rng = np.random.default_rng(1)
    M, N = shape
    for fmt in ("hfq4g256", "mq4g256v2", "q8f16"):
        raw = quant.quantize((rng.standard_normal((M, N)) * 0.02).astype(np.float32), fmt)
        raws = _copies(mx, partial(mx.array, raw), raw.nbytes, gpu)
        for dt, size in ((mx.float16, 2), (mx.float32, 4)):
            decode = partial(_dequant, K, fmt=fmt, shape=(M, N), dtype=dt)
            t = _time(mx, _cycling(decode, raws), 2 * len(raws))
            _row(rows, f"dequant {fmt}->{str(dt).rpartition('.')[2]}", f"{M}x{N}", t,
                 raw.nbytes + size * M * N, copy_bw,
                 {"host_us": _host_time(mx, _cycling(decode, raws), 2 * len(raws)) * 1e6})


def _dequant(K, raw, *, fmt, shape, dtype):
    return K.dequantize(raw, fmt, shape, dtype=dtype, basis="rotated")


def bench_fwht(mx, K, rows, copy_bw, n):
    from pagedkv.bench.gpu import _row
    x = mx.array(np.random.default_rng(2).standard_normal(n).astype(np.float32))
    t = _time(mx, lambda i: K.fwht256(x), 4)
    _row(rows, "fwht256 f32", f"{n // 256}x256", t, 8 * n, copy_bw)


def bench_kv_q8(mx, K, rows, copy_bw, tokens, kv_heads, head_dim):
    from pagedkv.bench.gpu import _row
    rng = np.random.default_rng(5)
    v = mx.array(rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float16))
    t = _time(mx, lambda i: K.kv_q8_quantize(v), 4)
    rec = tokens * kv_heads * head_dim // kv_q8.BLOCK_VALUES * kv_q8.RECORD_BYTES
    _row(rows, "kv_q8_quantize f16", f"{tokens}x{kv_heads}x{head_dim}", t, v.nbytes + rec,
         copy_bw)
    pool = K.kv_q8_quantize(v)
    slots = rng.permutation(tokens).astype(np.int64)
    t = _time(mx, lambda i: K.kv_q8_read(pool, slots, dtype=mx.float16), 4)
    _row(rows, "kv_q8_read ->f16", f"{tokens}x{kv_heads}x{head_dim}", t, v.nbytes + rec, copy_bw)


ATTENTION_CASE = {"seqs": 32, "tokens": 4096, "kv_heads": 8, "heads": 32, "head_dim": 128,
                  "block_size": 16}


def bench_attention(mx, K, rows, copy_bw, case):
    from pagedkv.bench.gpu import _row
    from pagedkv.kernels import numpy_kernels as ref
    rng = np.random.default_rng(3)
    seqs, tokens, kvh = case["seqs"], case["tokens"], case["kv_heads"]
    heads, hd, bs = case["heads"], case["head_dim"], case["block_size"]
    blocks_per_seq = tokens // bs
    num_blocks = seqs * blocks_per_seq
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(seqs, blocks_per_seq)
    lens = np.full(seqs, tokens, np.int32)
    q = mx.array(rng.standard_normal((seqs, heads, hd)).astype(np.float32))
    shape = (num_blocks, bs, kvh, hd)
    qs = q.astype(mx.float16).reshape(seqs, heads, 1, hd)
    kc = mx.random.normal((seqs, kvh, tokens, hd)).astype(mx.float16)
    vc = mx.random.normal((seqs, kvh, tokens, hd)).astype(mx.float16)
    mx.eval(kc, vc)
    sdpa = partial(mx.fast.scaled_dot_product_attention, qs, kc, vc, scale=hd ** -0.5)
    sdpa_calls = _cycling(lambda _: sdpa(), [None])
    t_sdpa = _time(mx, sdpa_calls, 5)
    sdpa_split = _split(mx, sdpa_calls, 5, "mlx_sdpa_")
    del kc, vc
    for kv_dtype in ("float16", "bfloat16", "q8"):
        if kv_dtype == "q8":
            pools = [mx.array(ref.kv_q8_quantize(rng.uniform(-2, 2, shape).astype(np.float32)))
                     for _ in range(2)]
        else:
            dt = mx.float16 if kv_dtype == "float16" else mx.bfloat16
            pools = [mx.random.uniform(-2, 2, shape).astype(dt) for _ in range(2)]
        mx.eval(pools)
        # as a decode step runs it per layer: tables checked once, uploaded once
        attend = partial(K.paged_attention, q, pools[0], pools[1], mx.array(tables),
                         mx.array(lens), max_seq_len=tokens, check=False)
        calls = _cycling(lambda _, f=attend: f(), [None])
        nbytes = pools[0].nbytes * 2 + 2 * q.nbytes + tables.nbytes
        modes = _header_modes(K)
        first = len(rows)  # this dtype's row in the default header mode
        for suffix, mode in modes:
            _set_header_mode(mode)
            t = _time(mx, calls, 5)
            base = _split(mx, calls, 5)
            if kv_dtype == "float16":
                base = {"mlx_sdpa_contiguous_us": t_sdpa * 1e6, "ratio_vs_mlx_sdpa": t / t_sdpa,
                        **base, **sdpa_split}
            _row(rows, f"paged_attention {kv_dtype}{suffix}", f"{seqs}x{tokens} kvh{kvh} d{hd}",
                 t, nbytes, copy_bw, base)
        _set_header_mode(modes[0][1])
        if kv_dtype == "q8" and K.backend() == "cuda":
            _q8_unstaged_row(mx, rows, rows[first], calls, f"{seqs}x{tokens} kvh{kvh} d{hd}",
                             nbytes, copy_bw)
        del pools


def _q8_unstaged_row(mx, rows, staged: dict, calls, shape: str, nbytes: int,
                     copy_bw: float) -> None:
    """MLX CUDA's q8 attention runs the staged kernels (q8s) by default; the same calls on
    the unstaged tensor-core kernel (PAGEDKV_ATTN_Q8_STAGE=0, read when a configuration's
    launch plan is built), and the staged row's ``stage_speedup`` (unstaged time / staged)."""
    import os

    from pagedkv.bench.gpu import _row
    from pagedkv.kernels.mlx import cuda
    before = os.environ.get("PAGEDKV_ATTN_Q8_STAGE")
    os.environ["PAGEDKV_ATTN_Q8_STAGE"] = "0"
    cuda._attention_plan.cache_clear()
    try:
        t = _time(mx, calls, 5)
    finally:
        if before is None:
            del os.environ["PAGEDKV_ATTN_Q8_STAGE"]
        else:
            os.environ["PAGEDKV_ATTN_Q8_STAGE"] = before
        cuda._attention_plan.cache_clear()
    _row(rows, "paged_attention q8 unstaged", shape, t, nbytes, copy_bw)
    staged["stage_speedup"] = round(t * 1e6 / staged["us"], 3)


def bench_copy_blocks(mx, K, rows, copy_bw, n_blocks, block_bytes):
    from pagedkv.bench.gpu import _row
    rng = np.random.default_rng(4)
    src = mx.zeros((n_blocks, block_bytes), dtype=mx.uint8)
    dst = mx.zeros((n_blocks, block_bytes), dtype=mx.uint8)
    mx.eval(src, dst)
    si, di = rng.permutation(n_blocks).astype(np.int32), rng.permutation(n_blocks).astype(np.int32)
    t = _time(mx, lambda i: K.copy_blocks(src, si, di, dst), 4)
    _row(rows, "copy_blocks", f"{n_blocks}x{block_bytes}B", t, 2 * src.nbytes, copy_bw)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench mlx", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--quick", action="store_true",
                   help="small shapes (a CPU run, or a smoke test of the command)")
    args = p.parse_args(argv)
    try:
        import mlx.core as mx
    except ImportError as exc:
        print(f"pagedkv.bench mlx: MLX cannot be imported ({exc})", file=sys.stderr)
        return 1
    import pagedkv.kernels.mlx as K
    backend = K.backend()
    gpu = backend != "ops"
    info = mx.device_info()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"MLX {getattr(mx, '__version__', '?')} on {mx.default_device()} ({info.get('device_name', '?')}, "
          f"{info.get('architecture', '?')}); pagedkv kernels: {backend}; {when}", flush=True)
    copy_bw = copy_bandwidth(mx, (1 << 30) if not args.quick else (64 << 20))
    print(f"elementwise copy (read+write): {copy_bw / 1e9:.1f} GB/s", flush=True)
    rows: list[dict] = []
    if args.quick:
        bench_gemv(mx, K, rows, copy_bw, [(512, 1024)], (1, 8), gpu)
        bench_dequant(mx, K, rows, copy_bw, (512, 1024), gpu)
        bench_fwht(mx, K, rows, copy_bw, 1 << 16)
        bench_kv_q8(mx, K, rows, copy_bw, 256, 8, 128)
        bench_attention(mx, K, rows, copy_bw, {**ATTENTION_CASE, "seqs": 2, "tokens": 256})
        bench_copy_blocks(mx, K, rows, copy_bw, 64, 4096)
    else:
        bench_gemv(mx, K, rows, copy_bw, [(4096, 4096), (4096, 14336), (14336, 4096)], (1, 8),
                   gpu)
        bench_dequant(mx, K, rows, copy_bw, (14336, 4096), gpu)
        bench_fwht(mx, K, rows, copy_bw, 64 << 20)
        bench_kv_q8(mx, K, rows, copy_bw, 32768, 8, 128)
        bench_attention(mx, K, rows, copy_bw, ATTENTION_CASE)
        bench_copy_blocks(mx, K, rows, copy_bw, 4096, 2 * 16 * 8 * 128)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mlx": getattr(mx, "__version__", "?"), "device": str(mx.default_device()),
                       "device_info": {k: str(v) for k, v in info.items()}, "backend": backend,
                       "date": when, "copy_GBps": copy_bw / 1e9, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
