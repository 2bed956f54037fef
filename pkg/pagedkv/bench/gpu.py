"""``python -m pagedkv.bench gpu``: time every kernel against the device's copy bandwidth.

Per kernel and shape: time per call, achieved GB/s (bytes the kernel must move: each
input read once, each output written once) and the fraction of the copy bandwidth
measured in the same run (device-to-device copy of >= 1 GiB, read + write bytes).
Weights rotate through copies totalling >= 4x the L2 so the loop measures memory,
not cache. Launch sequences are captured once in a graph and the graph is timed
with events (median of several replays), which keeps host launch cost out.
With PyTorch present, cuBLAS bf16 GEMV, PyTorch's tinygemm int4 GEMV
(``_weight_int4pack_mm``, group 128) and scaled_dot_product_attention on a contiguous
cache run on the same shapes in the same process; with ``PAGEDKV_VLLM_TRITON_DIR`` naming
a folder that holds vLLM's ``vllm/v1/attention/ops/triton_decode_attention.py`` (copied
unmodified from a vLLM wheel) and Triton installed, vLLM's Triton paged decode kernel runs
on the attention shape too (best of 8/16/32 splits).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import types
from functools import partial
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgument, NoDeviceError
from pagedkv.kernels import DeviceArray, Event, Graph, Stream, kvcache, open_device, weights

REPLAYS = 7


def _time_graph(device, stream, capture, calls: int) -> float:
    """Median seconds per call of ``calls`` launches captured by ``capture(stream)``."""
    graph = Graph(device, stream, capture)
    graph.launch(stream)  # warm-up
    stream.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = Event(device), Event(device)
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        times.append(end.elapsed_ms(start) / 1e3 / calls)
    return statistics.median(times)


def _repeat(fn, args: tuple, n: int, stream) -> None:
    """A capture step: ``fn(*args, stream=stream)`` ``n`` times (bind with ``partial``)."""
    for _ in range(n):
        fn(*args, stream=stream)


def _rotating(fn, weights: list, args: tuple, n: int, stream) -> None:
    """A capture step: ``fn(weights[i % len(weights)], *args, stream=stream)`` for i < n,
    cycling through weight copies so the loop measures memory, not the L2."""
    for i in range(n):
        fn(weights[i % len(weights)], *args, stream=stream)


def _rotation(device, nbytes: int) -> tuple[int, int]:
    """``(copies, calls)``: copies of an ``nbytes`` buffer totalling >= 4x the L2, so a loop
    over them measures memory, not cache, and the launches a timing graph holds (a
    multiple of the copies, about 64)."""
    copies = max(2, math.ceil(4 * device.properties.l2_cache_bytes / nbytes))
    return copies, copies * max(1, 64 // copies)


def _cycling_linear(torch, x, weights: list):
    """A torch call that multiplies ``x`` by the next of ``weights`` each time."""
    state = {"i": 0}

    def call():
        w = weights[state["i"] % len(weights)]
        state["i"] += 1
        return torch.nn.functional.linear(x, w)
    return call


def _time_events(device, stream, launch, calls: int) -> float:
    """Median seconds per call of ``calls`` direct launches between two events."""
    launch(stream)
    stream.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = Event(device), Event(device)
        start.record(stream)
        for _ in range(calls):
            launch(stream)
        end.record(stream)
        times.append(end.elapsed_ms(start) / 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth(device, stream, nbytes: int = 1 << 30) -> tuple[float, dict]:
    """Device-to-device copy of ``nbytes`` (read + write bytes per second): the runtime's
    memcpy and pagedkv's 16-byte block-copy kernel; the larger is the reference. A build
    without kernel objects (``-Dcuda=disabled -Dhip=disabled``: hip/tune.py launches only
    the variants it compiles) has no block-copy kernel: the memcpy alone is the reference
    and ``copy_kernel_GBps`` is None."""
    src, dst = device.empty(nbytes, np.uint8), device.empty(nbytes, np.uint8)
    src.fill_bytes(0x5A)
    t_memcpy = _time_events(device, stream,
                            lambda s: device.copy_dtod(dst.ptr, src.ptr, nbytes, s), 10)
    n_blocks = 64
    view_src = DeviceArray(device, src.ptr, (n_blocks, nbytes // n_blocks), np.uint8, owned=False)
    view_dst = DeviceArray(device, dst.ptr, (n_blocks, nbytes // n_blocks), np.uint8, owned=False)
    ids = device.array(np.arange(n_blocks, dtype=np.int32))
    try:
        t_kernel = _time_events(device, stream, lambda s: kvcache.copy_blocks(
            device, view_src, ids, ids, view_dst, stream=s), 10)
    except NoDeviceError:  # no kvcache object in this build (raised before any launch)
        t_kernel = math.inf
    src.free()
    dst.free()
    both = {"memcpy_GBps": 2 * nbytes / t_memcpy / 1e9,
            "copy_kernel_GBps": 2 * nbytes / t_kernel / 1e9 if t_kernel < math.inf else None}
    return 2 * nbytes / min(t_memcpy, t_kernel), both


def read_probe(device, src: DeviceArray, block_sums: DeviceArray, *, stream=None) -> None:
    """Read every byte of ``src`` (whole 16-byte vectors, 16-byte aligned) with
    hip/bench.hip's streaming kernel, one block per element of ``block_sums``
    (``uint32``), which receive the 32-bit wrapping sums of their blocks' words. The
    ceiling that bandwidth-bound kernels of the same size are measured against."""
    if (src.nbytes % 16 or src.ptr % 16 or block_sums.dtype != np.uint32
            or block_sums.size < 1):
        raise InvalidArgument(f"read_probe: src {src.nbytes} bytes at 0x{src.ptr:x} and "
                              f"block_sums {block_sums.dtype}[{block_sums.size}]: need whole "
                              f"16-byte vectors at a 16-byte aligned address and uint32 sums")
    device.kernel("bench", "pkv_read_probe", "ppq")((block_sums.size,), (256,), src, block_sums,
                                                     src.nbytes // 16, stream=stream)


def read_ceiling(device, stream, nbytes: int) -> float:
    """Seconds per streaming read of ``nbytes`` (rotating copies totalling >= 4x the L2,
    launches in a graph, 8 blocks of 256 threads per SM): what a kernel that only reads
    that many bytes takes here, launch and drain included."""
    nbytes = -(-nbytes // 16) * 16
    copies, calls = _rotation(device, nbytes)
    bufs = [device.empty(nbytes, np.uint8) for _ in range(copies)]
    sums = device.empty(8 * device.properties.multiprocessor_count, np.uint32)

    def capture(s: Stream) -> None:  # read_probe returns nothing: no list to build
        for i in range(calls):
            read_probe(device, bufs[i % copies], sums, stream=s)

    t = _time_graph(device, stream, capture, calls)
    for b in bufs + [sums]:
        b.free()
    return t


def _row(rows, kernel, shape, seconds, nbytes, copy_bw, baseline=None):
    bw = nbytes / seconds
    row = {"kernel": kernel, "shape": shape, "us": seconds * 1e6, "GB/s": bw / 1e9,
           "of_copy": bw / copy_bw}
    if baseline:
        row.update(baseline)
    rows.append(row)
    extra = "".join(f"  {k}={v:.3g}" if isinstance(v, float) else f"  {k}={v}"
                    for k, v in (baseline or {}).items())
    print(f"{kernel:<28} {shape:<26} {seconds * 1e6:10.2f} us {bw / 1e9:9.1f} GB/s "
          f"{100 * bw / copy_bw:6.1f}%{extra}", flush=True)


def _torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - torch is optional
        return None


def _torch_time(torch, fn, calls: int) -> float:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()  # warm-up (cuBLAS handles, workspace) outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(calls):
                fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    return statistics.median(times)


def tinygemm_time(torch, M: int, K: int, batch: int, group: int = 128) -> float | None:
    """Seconds per PyTorch tinygemm int4 GEMV (``_weight_int4pack_mm``, bf16 x, int4 weights
    in groups of ``group``) over rotating weights; None where this torch lacks it."""
    try:
        copies = max(2, math.ceil(4 * 60 * 2**20 / (M * K // 2)))
        ws = []
        for _ in range(copies):
            wq = torch.randint(0, 256, (M, K // 2), dtype=torch.uint8, device="cuda")
            packed = torch.ops.aten._convert_weight_to_int4pack(wq, 8)
            scales = torch.rand(K // group, M, 2, device="cuda", dtype=torch.bfloat16) * 0.01
            ws.append((packed, scales))
        x = torch.randn(batch, K, device="cuda", dtype=torch.bfloat16)
        state = {"i": 0}

        def call():
            w, sz = ws[state["i"] % copies]
            state["i"] += 1
            return torch.ops.aten._weight_int4pack_mm(x, w, group, sz)
        return _torch_time(torch, call, 2 * copies)
    except Exception as exc:  # noqa: BLE001 - an optional peer: say why and go on
        print(f"tinygemm int4 {M}x{K} b{batch}: not run ({type(exc).__name__}: "
              f"{str(exc)[:120]})", flush=True)
        return None


def vllm_triton_attention_time(torch, case) -> float | None:
    """Seconds per vLLM Triton paged decode attention (``decode_attention_fwd``, best of
    8/16/32 splits) at ``case``, f16; None without ``PAGEDKV_VLLM_TRITON_DIR`` or Triton."""
    folder = os.environ.get("PAGEDKV_VLLM_TRITON_DIR")
    if not folder:
        return None
    try:
        import triton
        import triton.language as tl
        plat = types.ModuleType("vllm.platforms")
        plat.current_platform = types.SimpleNamespace(is_rocm=lambda: False,  # type: ignore[attr-defined]
                                                      is_cuda=lambda: True)
        tu = types.ModuleType("vllm.triton_utils")
        tu.tl, tu.triton = tl, triton  # type: ignore[attr-defined]
        for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops"):
            mod = types.ModuleType(name)
            mod.__path__ = [os.path.join(folder, *name.split("."))]
            sys.modules.setdefault(name, mod)
        sys.modules.setdefault("vllm.platforms", plat)
        sys.modules.setdefault("vllm.triton_utils", tu)
        from vllm.v1.attention.ops.triton_decode_attention import (  # type: ignore[import-not-found]
            decode_attention_fwd,
        )
        S, T, H, KVH, D, P = (case["seqs"], case["tokens"], case["heads"], case["kv_heads"],
                              case["head_dim"], case["block_size"])
        pages = S * (T // P)
        k = torch.randn(pages, P, KVH, D, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(S, T // P)
        lens = torch.full((S,), T, device="cuda", dtype=torch.int32)
        q = torch.randn(S, H, D, device="cuda", dtype=torch.float16)
        o = torch.empty_like(q)
        lse = torch.empty(S, H, device="cuda", dtype=torch.float32)
        # The KV scales as device tensors, as vLLM passes a layer's: left out, the function
        # makes them with torch.tensor(1.0, device=...), a host-to-device copy that a CUDA
        # graph capture refuses (the error of the first H200 run).
        one = torch.ones((), device="cuda", dtype=torch.float32)
        best = None
        for splits in (8, 16, 32):
            logits = torch.empty(S, H, splits, D + 1, device="cuda", dtype=torch.float32)
            t = _torch_time(torch, partial(decode_attention_fwd, q, k, v, o, lse, table, lens,
                                           logits, splits, D ** -0.5, page_size=P,
                                           k_scale=one, v_scale=one), 5)
            best = t if best is None else min(best, t)
        return best
    except Exception as exc:  # noqa: BLE001 - an optional peer: say why and go on
        print(f"vLLM Triton attention: not run ({type(exc).__name__}: {str(exc)[:160]})",
              flush=True)
        return None


def rotating_weights(device, fmt: str, M: int, K: int, raw: np.ndarray, **gemv_kw):
    """``(uploaded copies of one weight, GEMV calls per timing graph)``, see _rotation;
    ``gemv_kw``: the Gemv switches that pick the layout (``wide_mma``)."""
    loader = weights.Gemv(device, fmt, M, K, **gemv_kw)  # upload() packs for the kernel
    copies, calls = _rotation(device, loader.weight_bytes)
    return [loader.upload(raw) for _ in range(copies)], calls


def bench_gemv(device, stream, rows, copy_bw, torch, shapes, batches):
    rng = np.random.default_rng(0)
    from pagedkv import quant
    for fmt in ("mq4g256v2", "hfq4g256", "mq4g256", "hfq6g256", "q8f16"):
        for (M, K) in shapes:
            w = (rng.standard_normal((M, K)) * 0.02).astype(np.float32)
            raw = quant.quantize(w, fmt)
            # HFQ6G256 / Q8F16: these rows are the CUDA-core kernel, whatever the default;
            # their tensor-core rows follow (bench_wide_tensor_cores, vs_cuda_cores)
            kw = {"wide_mma": False} if fmt in ("hfq6g256", "q8f16") else {}
            dev_w, calls = rotating_weights(device, fmt, M, K, raw, **kw)
            if fmt == "mq4g256v2":  # one ceiling per weight size
                t = read_ceiling(device, stream, raw.nbytes)
                _row(rows, "read probe (ceiling)", f"{raw.nbytes / 2**20:.1f} MiB", t,
                     raw.nbytes, copy_bw)
            for batch in batches:
                if batch > weights.max_batch(device, fmt, **kw):  # b16/b32: tensor cores
                    continue
                g = weights.Gemv(device, fmt, M, K, batch, **kw)
                x = device.array(rng.standard_normal((batch, K)).astype(np.float32))
                y = device.empty((batch, M), np.float32)
                t = _time_graph(device, stream, partial(_rotating, g.run, dev_w, (x, y), calls),
                                calls)
                nbytes = raw.nbytes + 4 * batch * (K + M)
                base = {}
                if torch is not None and fmt in ("mq4g256v2", "hfq4g256"):
                    wt = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                          for _ in range(_rotation(device, 2 * M * K)[0])]
                    xt = torch.randn(batch, K, device="cuda", dtype=torch.bfloat16)
                    tt = _torch_time(torch, _cycling_linear(torch, xt, wt), 2 * len(wt))
                    base = {"torch_bf16_us": tt * 1e6, "speedup_vs_torch": tt / t}
                    del wt
                    tg = tinygemm_time(torch, M, K, batch)
                    if tg is not None:
                        base.update({"tinygemm_us": tg * 1e6, "speedup_vs_tinygemm": tg / t})
                _row(rows, f"gemv {fmt} b{batch}", f"{M}x{K}", t, nbytes, copy_bw, base)
                other_x_path_row(device, stream, rows, copy_bw, g, dev_w, x, calls, t, nbytes,
                                 **kw)
                # The GEMV kernel alone, on an x prepared once (several weights share it)
                g.prepare(x, stream=stream)
                t = _time_graph(device, stream,
                                partial(_rotating, g.run_prepared, dev_w, (y,), calls), calls)
                _row(rows, f"gemv {fmt} b{batch} (x prepared)", f"{M}x{K}", t, nbytes, copy_bw)
            for d in dev_w:
                d.free()
            if fmt in ("hfq6g256", "q8f16"):
                bench_wide_tensor_cores(device, stream, rows, copy_bw, fmt, raw, M, K, batches,
                                        rng)


def bench_wide_tensor_cores(device, stream, rows, copy_bw, fmt, raw, M, K, batches, rng):
    """Rows ``gemv <fmt> b<B> (tensor cores)``: HFQ6G256 / Q8F16 on the int8 tensor cores
    (``Gemv(..., wide_mma=True)``; docs/kernels.md, "HFQ6 and Q8F16 on tensor cores"),
    ``vs_cuda_cores`` = the CUDA-core row's time of the same run over this one (batch 1-8;
    batch 16 and 32 run the staged kernel, which has no CUDA-core row to compare with)."""
    try:
        dev_w, calls = rotating_weights(device, fmt, M, K, raw, wide_mma=True)
    except InvalidArgument:  # no int8 tensor cores for it on this device
        return
    for batch in (b for b in batches if b <= weights.max_batch(device, fmt, wide_mma=True)):
        g = weights.Gemv(device, fmt, M, K, batch, wide_mma=True)
        x = device.array(rng.standard_normal((batch, K)).astype(np.float32))
        y = device.empty((batch, M), np.float32)
        t = _time_graph(device, stream, partial(_rotating, g.run, dev_w, (x, y), calls), calls)
        base = {}
        cc = next((r for r in rows if r["kernel"] == f"gemv {fmt} b{batch}"
                   and r["shape"] == f"{M}x{K}"), None)
        if cc is not None:
            base = {"vs_cuda_cores": cc["us"] * 1e-6 / t}
        nbytes = raw.nbytes + 4 * batch * (K + M)
        _row(rows, f"gemv {fmt} b{batch} (tensor cores)", f"{M}x{K}", t, nbytes, copy_bw, base)
        other_x_path_row(device, stream, rows, copy_bw, g, dev_w, x, calls, t, nbytes,
                         wide_mma=True)
    for d in dev_w:
        d.free()


def other_x_path_row(device, stream, rows, copy_bw, g, dev_w, x, calls, t, nbytes, **kw):
    """Where a batch 1-2 tensor-core GEMV can run either way, the row of the way ``g`` does
    not take: ``gemv <fmt> b<B> (fused x)`` (one launch, x prepared in the GEMV) or ``(prep
    + gemv)`` (two launches), with ``vs_default`` = the default row's time ``t`` over this
    one (> 1: faster than the default; weights.fused_x_by_default)."""
    if not g.tensor_cores or g.batch > 2:
        return
    try:
        other = weights.Gemv(device, g.fmt.name, g.M, g.K, g.batch, fused_x=not g.fused_x,
                             **kw)
    except InvalidArgument:  # no fused-x kernel for this launch
        return
    y = device.empty((g.batch, g.M), np.float32)
    t_other = _time_graph(device, stream, partial(_rotating, other.run, dev_w, (x, y), calls),
                          calls)
    label = "fused x" if other.fused_x else "prep + gemv"
    _row(rows, f"gemv {g.fmt.name} b{g.batch} ({label})", f"{g.M}x{g.K}", t_other, nbytes,
         copy_bw, {"vs_default": t / t_other})


def bench_dequant(device, stream, rows, copy_bw, shape):
    rng = np.random.default_rng(1)
    from pagedkv import quant
    M, K = shape
    for fmt in ("hfq4g256", "mq4g256v2", "hfq6g256", "q8f16"):
        raw = quant.quantize((rng.standard_normal((M, K)) * 0.02).astype(np.float32), fmt)
        dev_raw = device.array(raw)
        for dt in (np.float16, np.float32):
            out = device.empty((M, K), dt)
            t = _time_graph(device, stream,
                            partial(_repeat, weights.dequantize, (device, dev_raw, fmt, out), 10),
                            10)
            _row(rows, f"dequant {fmt}->{np.dtype(dt).name}", f"{M}x{K}", t,
                 raw.nbytes + out.nbytes, copy_bw)
            out.free()


def bench_fwht(device, stream, rows, copy_bw, n: int):
    x = device.array(np.random.default_rng(2).standard_normal(n).astype(np.float32))
    y = device.empty(n, np.float32)

    def capture(s: Stream) -> None:  # weights.fwht256 returns nothing: no list to build
        for _ in range(10):
            weights.fwht256(device, x, y, stream=s)

    t = _time_graph(device, stream, capture, 10)
    _row(rows, "fwht256 f32", f"{n // 256}x256", t, 8 * n, copy_bw)


#: (batch, tokens) of the partition-reduce rows: 32 query / 8 KV heads of 128, q8 KV (the
#: launch picks the partitions: 64 at 32k, 32 at batch 1 x 4k, 8 at batch 8 x 4k).
REDUCE_CASES = ((1, 32768), (8, 32768), (1, 4096), (8, 4096))


def _reduce_launch(attn, seq_lens, out, *, stream) -> None:
    attn.reduce(seq_lens, out, stream=stream)


def _serial_reduce_launch(kernel, attn, seq_lens, out, *, stream) -> None:
    """hip/bench.hip's pre-slice reduce on ``attn``'s workspace (a block of head_dim threads
    per (head, seq), as it was launched)."""
    kernel((attn.num_heads, attn.num_seqs), (attn.head_dim,), attn.part_out, attn.part_max,
           attn.part_sum, seq_lens, out, attn.num_heads, attn.head_dim, attn.max_partitions,
           attn.partition_tokens, stream=stream)


def bench_attention_reduce(device, stream, rows, copy_bw, cases=REDUCE_CASES):
    """The partition reduce alone (``PagedAttention.reduce``) on workspaces filled with
    finite values, rotating through copies totalling >= 4x the L2 (``_rotation``); bytes =
    the used partitions' outputs, maxima and sums read plus the output written. Each row
    carries ``serial_us`` (hip/bench.hip's ``pkv_bench_attention_reduce_serial``, the reduce
    before partitions were split into slices, on the same copies; ``speedup`` = serial /
    this) and ``hot_us`` (one workspace again and again: L2-resident, as in a decode step
    right after the partition kernel)."""
    heads, kv_heads, head_dim = 32, 8, 128
    rng = np.random.default_rng(6)
    serial = device.kernel("bench", "pkv_bench_attention_reduce_serial", "pppppiiii")
    for batch, tokens in cases:
        kw = {"num_seqs": batch, "num_heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
              "block_size": 16, "max_seq_len": tokens, "kv_dtype": "q8"}
        first = kvcache.PagedAttention(device, **kw)
        parts = first.max_partitions
        nbytes = (batch * heads * parts * (head_dim + 2) + batch * heads * head_dim) * 4
        copies, calls = _rotation(device, nbytes)
        attns = [first] + [kvcache.PagedAttention(device, **kw) for _ in range(copies - 1)]
        for a in attns:
            a.part_out.copy_from(rng.standard_normal(a.part_out.shape).astype(np.float32))
            a.part_max.copy_from(rng.standard_normal(a.part_max.shape).astype(np.float32))
            a.part_sum.copy_from(rng.uniform(1, 64, a.part_sum.shape).astype(np.float32))
        seq_lens = device.array(np.full(batch, tokens, np.int32))
        out = device.empty((batch, heads, head_dim), np.float32)

        t = _time_graph(device, stream, partial(_rotating, _reduce_launch, attns,
                                                (seq_lens, out), calls), calls)
        t_serial = _time_graph(device, stream, partial(
            _rotating, partial(_serial_reduce_launch, serial), attns, (seq_lens, out), calls),
            calls)
        t_hot = _time_graph(device, stream,
                            partial(_repeat, first.reduce, (seq_lens, out), calls), calls)
        _row(rows, "attention_reduce", f"b{batch} h{heads} {tokens // 1024}k {parts}x"
             f"{first.partition_tokens}", t, nbytes, copy_bw,
             {"serial_us": t_serial * 1e6, "speedup": t_serial / t, "hot_us": t_hot * 1e6,
              "threads": first._reduce_threads})
        for a in [out, seq_lens] + [arr for at in attns
                                    for arr in (at.part_out, at.part_max, at.part_sum)]:
            a.free()


ATTENTION_CASE = {"seqs": 32, "tokens": 4096, "kv_heads": 8, "heads": 32, "head_dim": 128,
                  "block_size": 16}
#: head_dim 256 (what lloyd V needs): compressed KV against f16 on the same context.
ATTENTION_CASE_256 = {"seqs": 32, "tokens": 4096, "kv_heads": 4, "heads": 16, "head_dim": 256,
                      "block_size": 16}
#: One long sequence (batch 1 x 32k tokens): 8 KV heads x 32 f16 / 64 q8 partitions to
#: spread over the SMs.
ATTENTION_CASE_LONG = {"seqs": 1, "tokens": 32768, "kv_heads": 8, "heads": 32, "head_dim": 128,
                       "block_size": 16}
#: KV dtypes timed per case: the unquantized and q8 baselines, then compressed pairs.
ATTENTION_DTYPES: dict[int, tuple[str, ...]] = {
    128: ("float16", "bfloat16", "q8", "fwht4/q8", "fwht2/q8", "fwht4/fwht4", "fwht4/fwht2"),
    256: ("float16", "q8", "fwht4/q8", "fwht4/lloyd4", "lloyd4/lloyd4", "fwht3/lloyd3",
          "fwht2/lloyd2")}


def _side_pool_host(rng, side: str, shape: tuple[int, ...]) -> np.ndarray:
    """One side of a pool with random K/V in [-2, 2): float16, bfloat16 bits, or the records
    of a KV mode (encoded on the CPU, so norms and codes are real ones)."""
    vals = rng.random(shape, dtype=np.float32) * 4 - 2
    if side == "float16":
        return vals.astype(np.float16)
    if side == "bfloat16":
        return (vals.view(np.uint32) >> 16).astype(np.uint16)
    from pagedkv.quant import kv
    return kv.encode(vals, side)


def attention_inputs(device, rng, kv_dtype: str, *, seqs, tokens, kv_heads, heads, head_dim,
                     block_size):
    """Device inputs of one decode batch (``seqs`` sequences of ``tokens`` tokens in whole
    blocks, the last one partly filled, blocks in random order, random K/V in [-2, 2) stored
    as ``kv_dtype``: a dtype for both sides or a ``<K>/<V>`` pair of KV modes): ``(args,
    nbytes, attn_kwargs)`` where ``PagedAttention(device, **attn_kwargs).run(*args)`` runs it
    and ``nbytes`` is what it must move (the ``tokens`` rows of K + V as stored, i.e.
    compressed bytes, + q + out + tables)."""
    from pagedkv.quant import kv
    blocks_per_seq = -(-tokens // block_size)
    num_blocks = seqs * blocks_per_seq
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(seqs, blocks_per_seq)
    q = rng.standard_normal((seqs, heads, head_dim)).astype(np.float32)
    pools = []
    for side in kv.split_kv_dtype(kv_dtype):
        host = _side_pool_host(rng, side, (num_blocks, block_size, kv_heads, head_dim))
        pool = device.empty(host.shape, host.dtype)
        pool.copy_from(host)
        pools.append(pool)
    k_pool, v_pool = pools
    args = (device.array(q), k_pool, v_pool, device.array(tables),
            device.array(np.full(seqs, tokens, np.int32)), device.empty(q.shape, np.float32))
    # the rows of each side the launch reads (none past `tokens`), as stored
    row_bytes = sum(p.nbytes // (num_blocks * block_size * kv_heads) for p in pools)
    nbytes = seqs * tokens * kv_heads * row_bytes + 2 * q.nbytes + tables.nbytes
    attn_kwargs = {"num_seqs": seqs, "num_heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                       "block_size": block_size, "max_seq_len": tokens, "kv_dtype": kv_dtype}
    return args, nbytes, attn_kwargs


def attention_rotation(device, kv_bytes: int) -> tuple[int, int]:
    """``(copies, calls)`` for an attention row whose K and V pools hold ``kv_bytes``: one
    pool where it passes 4x the L2, else copies totalling at least that; the launches a
    timing graph holds (at least 5, a multiple of the copies)."""
    copies = max(1, math.ceil(4 * device.properties.l2_cache_bytes / kv_bytes))
    return copies, copies * math.ceil(5 / copies)


def _cycle(fn, arg_sets: list, n: int, stream) -> None:
    """A capture step: ``fn(*arg_sets[i % len(arg_sets)], stream=stream)`` for i < n."""
    for i in range(n):
        fn(*arg_sets[i % len(arg_sets)], stream=stream)


def time_attention(device, stream, attn, args) -> float:
    """Seconds per ``attn.run(*args)``, launches in a graph: at least five, cycling over
    copies of the K and V pools that total >= 4x the L2 where one pair is smaller (as the
    GEMV rows rotate their weights): a 68 MiB pool read five times in a row is partly served
    from the L2, which a decode step, whose other layers pass between, never sees."""
    q, k_pool, v_pool, *rest = args
    copies, calls = attention_rotation(device, k_pool.nbytes + v_pool.nbytes)
    made: list = []
    arg_sets = [args]
    try:
        for _ in range(copies - 1):
            pair = [device.empty(a.shape, a.dtype) for a in (k_pool, v_pool)]
            made += pair
            for dst, src in zip(pair, (k_pool, v_pool), strict=True):
                device.copy_dtod(dst.live_ptr(), src.live_ptr(), src.nbytes)
            arg_sets.append((q, *pair, *rest))
        device.synchronize()  # the copies ran on the legacy stream; `stream` does not wait
        return _time_graph(device, stream, partial(_cycle, attn.run, arg_sets, calls), calls)
    finally:
        for a in made:
            a.free()


def bench_attention(device, stream, rows, copy_bw, torch, case=ATTENTION_CASE,
                    dtypes: tuple[str, ...] | None = None):
    """One row per KV dtype on ``case``: time, GB/s and % of copy bandwidth counted in the
    bytes the kernel must move (stored, i.e. compressed, KV); every row after float16 also
    carries ``vs_float16`` (f16 time / this time: > 1 is faster than f16 on the same
    context); float16 carries PyTorch SDPA's time when torch is there."""
    rng = np.random.default_rng(3)
    seqs, tokens, kv_heads = case["seqs"], case["tokens"], case["kv_heads"]
    heads, head_dim = case["heads"], case["head_dim"]
    t_f16 = None
    for kv_dtype in dtypes or ATTENTION_DTYPES.get(head_dim, ("float16", "bfloat16", "q8")):
        args, nbytes, attn_kwargs = attention_inputs(device, rng, kv_dtype, **case)
        # q8: the default kernel (PAGEDKV_ATTN_Q8_MMA / _STAGE as set); its two other
        # paths follow as their own rows on the same pool
        t = time_attention(device, stream, kvcache.PagedAttention(device, **attn_kwargs), args)
        base = {}
        if torch is not None and kv_dtype in ("float16", "bfloat16"):
            tdt = torch.float16 if kv_dtype == "float16" else torch.bfloat16
            qt = torch.randn(seqs, heads, 1, head_dim, device="cuda", dtype=tdt)
            kt = torch.randn(seqs, kv_heads, tokens, head_dim, device="cuda", dtype=tdt)
            vt = torch.randn_like(kt)
            tt = _torch_time(torch, partial(torch.nn.functional.scaled_dot_product_attention,
                                            qt, kt, vt, enable_gqa=True), 5)
            base = {"torch_sdpa_us": tt * 1e6, "ratio_vs_torch": t / tt}
            del kt, vt
            tv = vllm_triton_attention_time(torch, case) if kv_dtype == "float16" else None
            if tv is not None:
                base.update({"vllm_triton_us": tv * 1e6, "speedup_vs_vllm_triton": tv / t})
        if kv_dtype == "float16":
            t_f16 = t
        elif kv_dtype == "bfloat16" and t_f16 is not None:
            base["time_vs_f16"] = t / t_f16  # target <= 1.1
        elif t_f16 is not None:
            base["vs_float16"] = t_f16 / t  # > 1: faster than f16 on the same context
        _row(rows, f"paged_attention {kv_dtype}",
             f"{seqs}x{tokens} kvh{kv_heads} d{head_dim}", t, nbytes, copy_bw, base)
        if kv_dtype == "q8" and head_dim in (64, 128):
            # The other q8 kernels on the same pool: the CUDA-core one (PAGEDKV_ATTN_Q8_MMA=0);
            # the unstaged tensor-core one (q8_stage=False; the default stages rows in shared
            # memory first, the q8s kernels); q8i, the staged one with pass 1 on integer
            # tensor cores (q8_int=True, PAGEDKV_ATTN_Q8_INT=1: int_speedup > 1 when faster
            # than the default row above); the staged one with cp.async copies only
            # (q8_tma=False, PAGEDKV_ATTN_Q8_TMA=0: tma_speedup > 1 when the default's tensor
            # copies, sm_90 where they apply, are faster).
            variants: dict[str, dict[str, Any]] = {
                "cuda-cores": {"q8_mma": False},
                "unstaged": {"q8_mma": True, "q8_stage": False},
                "int pass 1": {"q8_mma": True, "q8_stage": True, "q8_int": True},
                "cp.async": {"q8_mma": True, "q8_stage": True, "q8_tma": False}}
            times = {label: time_attention(device, stream,
                                           kvcache.PagedAttention(device, **attn_kwargs, **sw),
                                           args)
                     for label, sw in variants.items()}
            t_cc, t_un = times["cuda-cores"], times["unstaged"]
            extras = {"cuda-cores": {"mma_speedup": t_cc / t},
                      "unstaged": {"staged_speedup": t_un / t, "speedup_vs_cuda_cores": t_cc / t_un},
                      "int pass 1": {"int_speedup": t / times["int pass 1"]},
                      "cp.async": {"tma_speedup": times["cp.async"] / t}}
            for label, tv in times.items():
                _row(rows, f"paged_attention q8 {label}",
                     f"{seqs}x{tokens} kvh{kv_heads} d{head_dim}", tv, nbytes, copy_bw,
                     extras[label] | ({"vs_float16": t_f16 / tv} if t_f16 else {}))
        if kv_dtype in kvcache.QUANT_KV_DTYPES and kvcache.qkv_mma_applies(kv_dtype):
            # the CUDA-core kernel of the pair (PAGEDKV_ATTN_QKV_MMA=0) on the same pool;
            # the row above ran the _mma kernel (unless the env turned it off)
            attn_cc = kvcache.PagedAttention(device, **attn_kwargs, qkv_mma=False)
            t_cc = time_attention(device, stream, attn_cc, args)
            _row(rows, f"paged_attention {kv_dtype} cuda-cores",
                 f"{seqs}x{tokens} kvh{kv_heads} d{head_dim}", t_cc, nbytes, copy_bw,
                 {"mma_speedup": t_cc / t} | ({"vs_float16": t_f16 / t_cc} if t_f16 else {}))
        for a in args:
            a.free()


#: The decode step's attention geometries (``python -m pagedkv.bench decode``: a step over
#: C cached tokens attends over C + 1): batch 1 at 1k and 32k, batch 32 at 1k, f16 and q8.
LAUNCH_CASES = tuple((seqs, tokens, kv_dtype) for seqs, tokens in ((1, 1025), (1, 32769),
                                                                   (32, 1025))
                     for kv_dtype in ("float16", "q8"))


def bench_attention_launch(device, stream, rows, copy_bw, cases=LAUNCH_CASES, *, kv_heads=8,
                           heads=32, head_dim=128):
    """The launch ``PagedAttention`` chooses (partitions, and for q8 whether to stage) against
    the kernel's fixed most tokens per partition on the same pool: one row per case with
    ``vs_most`` (the most's time / the choice's: >= 1 when the choice is no slower) and, for
    q8, ``vs_other_staging`` (the time with the other ``q8_stage`` / the choice's)."""
    rng = np.random.default_rng(5)
    for seqs, tokens, kv_dtype in cases:
        args, nbytes, kw = attention_inputs(device, rng, kv_dtype, seqs=seqs, tokens=tokens,
                                            kv_heads=kv_heads, heads=heads, head_dim=head_dim,
                                            block_size=16)
        chosen = kvcache.PagedAttention(device, **kw)
        t = time_attention(device, stream, chosen, args)
        most = kvcache.PagedAttention(device, **kw,
                                      partition_tokens=kvcache.ATTN_PARTITION_TOKENS[kv_dtype])
        extra = {"attention_kernel": chosen.kernel_name, "partitions": chosen.max_partitions,
                 "partition_tokens": chosen.partition_tokens,
                 "vs_most": time_attention(device, stream, most, args) / t}
        if kv_dtype == "q8":
            extra["staged"] = chosen.q8_stage
            other = kvcache.PagedAttention(device, **kw, q8_stage=not chosen.q8_stage)
            extra["vs_other_staging"] = time_attention(device, stream, other, args) / t
        _row(rows, f"paged_attention {kv_dtype} launch",
             f"{seqs}x{tokens} kvh{kv_heads} d{head_dim}", t, nbytes, copy_bw, extra)
        for a in args:
            a.free()


#: (mode, head_dim, kv_heads) of the KV write rows: q8 is the baseline of the same run.
KV_WRITE_CASES = (("q8", 128, 8), ("fwht4", 128, 8), ("fwht2", 128, 8), ("q8", 256, 4),
                  ("fwht4", 256, 4), ("fwht3", 256, 4), ("lloyd4", 256, 4), ("lloyd2", 256, 4))


def bench_kv_write(device, stream, rows, copy_bw, tokens: int = 4096):
    """KV encode on the device: ``tokens`` float32 rows of K (a prefill chunk) written into a
    pool of each mode at shuffled slots (``kv_q8_write`` / ``kv_rotated_write``); bytes =
    float32 in + records out. Rotated rows carry ``vs_q8`` (q8's time on the same shape /
    this one)."""
    from pagedkv.quant import kv
    rng = np.random.default_rng(5)
    t_q8: dict[int, float] = {}
    for mode, hd, kvh in KV_WRITE_CASES:
        x = device.array(rng.standard_normal((tokens, kvh, hd)).astype(np.float32))
        slots = device.array(rng.permutation(tokens).astype(np.int64))
        row = kv.kv_mode(mode).row_bytes(hd)
        pool = device.empty((tokens // 16, 16, kvh, row), np.uint8)
        if mode == "q8":
            fn, fargs = kvcache.kv_q8_write, (device, x, slots, pool)
        else:
            fn, fargs = partial(kvcache.kv_rotated_write, mode=mode), (device, x, slots, pool)
        t = _time_graph(device, stream, partial(_repeat, fn, fargs, 10), 10)
        base = {}
        if mode == "q8":
            t_q8[hd] = t
        elif hd in t_q8:
            base = {"vs_q8": t_q8[hd] / t}
        _row(rows, f"kv_write {mode} f32", f"{tokens}x{kvh}x{hd}", t, x.nbytes + pool.nbytes,
             copy_bw, base)
        for a in (x, slots, pool):
            a.free()


def bench_copy_blocks(device, stream, rows, copy_bw, n_blocks=4096, block_bytes=2 * 16 * 8 * 128):
    src = device.empty((n_blocks, block_bytes), np.uint8)
    dst = device.empty((n_blocks, block_bytes), np.uint8)
    rng = np.random.default_rng(4)
    si = device.array(rng.permutation(n_blocks).astype(np.int32))
    di = device.array(rng.permutation(n_blocks).astype(np.int32))
    t = _time_graph(device, stream,
                    partial(_repeat, kvcache.copy_blocks, (device, src, si, di, dst), 10), 10)
    _row(rows, "copy_blocks", f"{n_blocks}x{block_bytes}B", t, 2 * src.nbytes, copy_bw)


def open_device_or_explain(prog: str):
    """The default device, or ``None`` after one line on stderr that says why there is none."""
    try:
        return open_device()
    except NoDeviceError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None


def open_session(prog: str, *, no_torch: bool):
    """``(device, stream, torch or None, "YYYY-MM-DD HH:MM UTC")`` for a bench suite, or
    ``None`` after one line on stderr when there is no GPU."""
    device = open_device_or_explain(prog)
    if device is None:
        return None
    return (device, Stream(device), None if no_torch else _torch(),
            time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench gpu", description=__doc__)
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--quick", action="store_true", help="one GEMV shape and batch")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baselines")
    args = p.parse_args(argv)
    session = open_session("pagedkv.bench gpu", no_torch=args.no_torch)
    if session is None:
        return 1
    device, stream, torch, when = session
    props = device.properties
    print(f"{props.name} ({props.arch}, {props.multiprocessor_count} SMs, L2 "
          f"{props.l2_cache_bytes / 2**20:.0f} MiB), {when}; torch: "
          f"{torch.__version__ if torch else 'not used'}", flush=True)
    copy_bw, copies = copy_bandwidth(device, stream)
    read_gbps = (1 << 30) / read_ceiling(device, stream, 1 << 30) / 1e9
    kernel_gbps = copies["copy_kernel_GBps"]  # None: a build without kernel objects
    print(f"device-to-device copy (1 GiB, read+write): {copy_bw / 1e9:.1f} GB/s "
          f"(memcpy {copies['memcpy_GBps']:.1f}, copy kernel "
          f"{'n/a' if kernel_gbps is None else f'{kernel_gbps:.1f}'}); "
          f"streaming read of 1 GiB: {read_gbps:.1f} GB/s", flush=True)
    rows: list[dict] = []
    shapes = [(4096, 4096)] if args.quick else [(4096, 4096), (4096, 14336), (14336, 4096)]
    # b16/b32: the staged tensor-core kernel (the decode step at batch 32), next to cuBLAS
    bench_gemv(device, stream, rows, copy_bw, torch, shapes,
               (1,) if args.quick else (1, 8, 16, 32))
    bench_dequant(device, stream, rows, copy_bw, (14336, 4096))
    bench_fwht(device, stream, rows, copy_bw, 64 << 20)
    bench_attention(device, stream, rows, copy_bw, torch)
    bench_attention(device, stream, rows, copy_bw, torch, ATTENTION_CASE_256)
    bench_attention(device, stream, rows, copy_bw, torch, ATTENTION_CASE_LONG,
                    ("float16", "q8"))
    bench_attention_reduce(device, stream, rows, copy_bw)
    bench_attention_launch(device, stream, rows, copy_bw)
    bench_kv_write(device, stream, rows, copy_bw)
    bench_copy_blocks(device, stream, rows, copy_bw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "arch": props.arch, "date": when,
                       "copy_GBps": copy_bw / 1e9, **copies, "read_GBps": read_gbps,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
