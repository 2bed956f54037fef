"""``python -m pagedkv.bench decode``: one full decode step of a Llama-3-8B-shaped decoder.

pagedkv's path (:class:`pagedkv.kernels.decoder.DecoderStep`, no PyTorch): 4-bit GEMVs
(HFQ4G256 / MQ4G256V2, QKV and gate/up packed), RMSNorm, RoPE, this step's K/V written
into a device ``LayerKVPool`` (f16 or q8) at the adapter's slot mapping, paged attention
over the adapter's block tables. Baseline in the same run (with PyTorch + CUDA): bf16
weights through cuBLAS (``F.linear``), ``F.rms_norm``, RoPE and SiLU in torch, and SDPA
on a contiguous bf16 KV cache, eager (every elementwise op its own kernel). With
``--torch-compile`` also the fused bf16 peer as vLLM runs it: each layer's body (norms,
QKV, RoPE, cache write, SDPA, o-proj + residual, gate/up, SiLU·up, down + residual) through
``torch.compile`` (inductor; one graph shared by the 32 layers, compiled once per
configuration outside the timing), rows then carry ``torch_compiled_us``,
``torch_compiled_tok_s`` and ``speedup_vs_torch_compiled``; the targets stay held to the
eager peer, the compiled ratio printed next to them. The SDPA backends torch has enabled
and the one it runs for each decode shape are printed and saved (``sdpa_backend``). All
are captured in graphs and timed with events (median of several replays); host bookkeeping (the adapter's ``prepare_decode``, ~13 µs for 64
sequences, docs/performance.md) is outside the timed step.

First a correctness check on fresh random inputs: a 2-layer model of the same widths
(vocab 4,096) through the adapter and a device pool, against the float64 NumPy step
(:mod:`pagedkv.kernels.numpy_decoder`). Then the table: per (weights, KV dtype, batch,
context) the step time, tokens/s, the bytes the step must move (weights + KV read + this
token's KV write) and the floor they imply at the copy bandwidth measured in the run.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from dataclasses import replace

import numpy as np

from pagedkv.bench.gpu import REPLAYS, copy_bandwidth, open_session
from pagedkv.kernels import Event, Graph
from pagedkv.kernels.decoder import (
    LLAMA3_8B,
    MATRICES,
    DecoderHostWeights,
    DecoderShape,
    DecoderStep,
    DecoderWeights,
)
from pagedkv.kernels.paged import DeviceDecodeBatch

BLOCK_SIZE = 16
FORMATS = ("hfq4g256", "mq4g256v2")
KV_DTYPES = ("float16", "q8")
FULL_GRID = [(b, c) for b in (1, 8, 32) for c in (1024, 4096, 16384, 32768)]
#: The issue's targets: b1 (any context), b32 at 1k, b8 at 32k with q8 KV.
QUICK_GRID = [(1, 1024), (1, 32768), (8, 32768), (32, 1024)]
KV_LIMIT_BYTES = 40 << 30  # skip configurations whose f16 KV alone is larger
CHECK_SHAPE = replace(LLAMA3_8B, num_layers=2, vocab=4096)
# The step check's bound on logits and the residual stream, as a fraction of their largest
# magnitude. The int8-x GEMVs' steps came out within 0.9-1.6e-6 of it in every H100/H200 run
# (docs/performance.md), so 2e-4 is 100x that; a step that loses its own token or reads a
# stale K/V row for it errs by 1.8-2.4e-3 at the check's 1,101 tokens (a review's
# simulation, 2026-12-07), which the earlier 2e-3 let through about half the time. With x
# rounded once to f16 (Gemv.f16_x, above 8 batch rows) the GEMV bound is 5.5e-4 of
# sum |w||x|: 2e-3 there.
CHECK_ERROR = 2e-4
CHECK_ERROR_F16X = 2e-3
# The checks the CLI runs first: (weights, KV dtype, contexts). The first two are batch 3 at
# up to 1,101 tokens (18 partitions of 64 tokens); the third is one sequence of 32,768, the
# launch geometry the timed batch-1 32k rows run (65 partitions of 512, the staged q8
# kernel), which no GPU test reaches. At that length a lost token moves the logits by about
# 6e-5 of their max, under the bound: it proves the partitions and their reduce, not each token.
CHECKS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("hfq4g256", "float16", (37, 300, 1100)), ("mq4g256v2", "q8", (37, 300, 1100)),
    ("hfq4g256", "q8", (32768,)))


def build_adapter(device, shape: DecoderShape, kv_dtype: str, batch: int, contexts,
                  rng) -> tuple:
    """A device pool, allocator and adapter holding ``batch`` sequences of ``contexts[i]``
    tokens, and the adapter's decode batch for their next token. Returns ``(pool,
    adapter, seq_ids, decode_batch)``; the KV of the contexts is left for the caller."""
    from pagedkv.adapter import PagedKVCacheAdapter
    from pagedkv.allocator import BlockAllocator
    from pagedkv.pool import LayerKVPool, PoolGeometry
    blocks = sum(-(-(c + 1) // BLOCK_SIZE) for c in contexts) + 1
    g = PoolGeometry(shape.num_layers, shape.kv_heads, shape.head_dim, BLOCK_SIZE, kv_dtype)
    pool = LayerKVPool(g, blocks, backend="device", device=device)
    adapter = PagedKVCacheAdapter(BlockAllocator(blocks, blocks, BLOCK_SIZE), pool,
                                  growth=False)
    seqs = [f"seq-{i}" for i in range(batch)]
    for s, n in zip(seqs, contexts, strict=True):
        adapter.reset_for_new_request(s)
        adapter.allocate_suffix_blocks(s, n)
        adapter.record_tokens(s, rng.integers(0, 32000, n, dtype=np.uint32))
    return pool, adapter, seqs


def random_context(device, shape: DecoderShape, kv_dtype: str, contexts, rng) -> tuple:
    """:func:`build_adapter` for ``len(contexts)`` sequences with random K/V in every
    layer of their contexts and a random next token recorded. Returns ``(pool, adapter,
    seq_ids, decode_batch)`` (``adapter.prepare_decode``'s batch for that token)."""
    pool, adapter, seqs = build_adapter(device, shape, kv_dtype, len(contexts), contexts, rng)
    g = pool.geometry
    for s, n in zip(seqs, contexts, strict=True):
        kv = (_pool_values(g, rng, (shape.num_layers, n, g.num_kv_heads, g.head_dim))
              for _ in range(2))
        adapter.write_kv_layers(s, *kv)
    adapter.record_decode_tokens(seqs, rng.integers(0, 32000, len(seqs), dtype=np.uint32))
    return pool, adapter, seqs, adapter.prepare_decode(seqs)


def _pool_values(g, rng, shape) -> np.ndarray:
    """Random K or V values of ``shape`` (``[..., head_dim]``) as rows of the pool's storage
    dtype (q8: ``[..., head_dim / 32 * 34]`` records)."""
    from pagedkv.kernels import numpy_kernels
    from pagedkv.pool import float32_to_bf16_bits
    vals = rng.standard_normal(shape, dtype=np.float32)
    if g.dtype == "q8":
        return numpy_kernels.kv_q8_quantize(vals)
    if g.dtype == "bfloat16":
        return float32_to_bf16_bits(vals)
    return vals.astype(np.float16)


# The float32 error of a K/V value before the pool's rounding, as a fraction of the largest
# magnitude of its (token, head) row. The device computes K and V in float32 (RMSNorm, the
# 4-bit GEMV with x split into 22-bit planes, RoPE): on the H200 the step's x and logits came
# out within 1.0-1.9e-6 of their largest magnitude of the float64 reference
# (docs/performance.md). That error is absolute on the row's scale, so for an element far
# below the row's largest it is several of the element's own f16 ulps. The 1.14 "steps" of
# the first H200 run (then |got - ref| / (|ref| 2^-10 + 1e-6)) fit such elements; a wrong
# rounding of a large one would need a float32 error ~500x the measured one.
# 2^-16 (1.5e-5) is 8-15x the measured error and at most 1/16 of f16's half-ulp at the row's
# largest value, so a write rounded the wrong way (a whole ulp off) is still caught for every
# element above 1/16 of its row's largest (bf16: above 1/128), and a wrong slot, a truncation
# or a lost token anywhere.
KV_COMPUTE_ERROR = 2.0 ** -16
# The same for a step whose GEMVs round x once to f16 (Gemv.f16_x: the default above 8 batch
# rows on NVIDIA; error at most 2^-11 of each |x|): on the H200 a 3-sequence check with
# PAGEDKV_GEMV_F16X=1 wrote K/V up to 14.3 of the 2^-16 bound, about 2^-12 of the row's
# largest value; 2^-9 is 8x that, still 1/2 of f16's half-ulp at the row's largest value.
KV_F16X_COMPUTE_ERROR = 2.0 ** -9


def _ulp(a: np.ndarray, fraction_bits: int, min_exponent: int) -> np.ndarray:
    """One unit in the last place of float64 ``a`` in a binary format of ``fraction_bits``
    stored fraction bits whose smallest normal is ``2**min_exponent`` (subnormals below)."""
    exp = np.floor(np.log2(np.maximum(np.abs(a), 2.0 ** min_exponent)))
    return 2.0 ** (exp - fraction_bits)


def rounding_steps(got: np.ndarray, ref: np.ndarray, kv_dtype: str,
                   compute_error: float = KV_COMPUTE_ERROR) -> float:
    """The largest ``|got - ref|`` of a K/V write as a fraction of what a correct write may
    differ by (``<= 1`` passes): half a rounding step of the pool dtype plus the float32
    error of the value before rounding (``compute_error`` of its row's largest |ref|:
    ``KV_COMPUTE_ERROR``, or ``KV_F16X_COMPUTE_ERROR`` after f16-activation GEMVs).

    f16/bf16: the step is one ulp of ``max(|got|, |ref|)`` (a value computed just across a
    power of two rounds in the upper binade). q8: a code step is the 32-group's largest
    ``|ref|`` / 127, and the f16 rounding of that scale moves a value by up to its group's
    largest ``|ref|`` x 2^-11 on top of the half step."""
    ref = np.asarray(ref, np.float64)
    got = np.asarray(got, np.float64)
    row_max = np.abs(ref).max(axis=-1, keepdims=True)
    allowed = compute_error * row_max
    if kv_dtype == "q8":
        amax = np.abs(ref).reshape(-1, 32).max(axis=1).repeat(32).reshape(ref.shape)
        allowed = allowed + 0.5 * amax / 127 + amax * 2.0 ** -11
    else:
        bits, emin = (7, -126) if kv_dtype == "bfloat16" else (10, -14)
        allowed = allowed + 0.5 * _ulp(np.maximum(np.abs(got), np.abs(ref)), bits, emin)
    # 1.001: the float64 evaluation of the bound itself
    return float((np.abs(got - ref) / (allowed * 1.001 + 1e-300)).max())


def check_step(device, fmt: str, kv_dtype: str, *, contexts=(37, 300, 1100), seed=None,
               shape: DecoderShape | None = None, gemv_rows: int | None = None,
               fuse: bool | None = None) -> dict:
    """One step on fresh random weights, inputs and context KV through the adapter and a
    device pool, against the float64 reference. Returns the errors and whether they are
    within tolerance: logits and the residual stream within :data:`CHECK_ERROR` of their
    largest magnitude (:data:`CHECK_ERROR_F16X` where the step rounds x to f16), this
    token's written K/V within the pool dtype's rounding of the reference's plus the float32
    error before it (:func:`rounding_steps`; the f16-activation GEMVs' larger one where the
    step runs them, ``"f16_x"`` in the result), and every other slot of the pool unchanged
    (``"other_slots_changed"``: a write to a wrong slot is otherwise invisible, the
    reference reads the pool after the step). ``seed`` (drawn when ``None``) is in the
    result, so a failed check can be run again."""
    from pagedkv.kernels import numpy_kernels
    from pagedkv.kernels.numpy_decoder import decode_step
    shape = CHECK_SHAPE if shape is None else shape
    if seed is None:
        seed = secrets.randbits(63)
    rng = np.random.default_rng(seed)
    host = DecoderHostWeights.random(shape, fmt, int(rng.integers(1 << 31)))
    weights = DecoderWeights(device, host)
    pool, adapter, seqs, batch = random_context(device, shape, kv_dtype, contexts, rng)
    g = pool.geometry
    tables = DeviceDecodeBatch.upload(device, batch)
    step = DecoderStep(device, weights, pool, len(seqs), max(contexts) + 1,
                       gemv_rows=gemv_rows, fuse=fuse)
    x = rng.standard_normal((len(seqs), shape.d_model), dtype=np.float32)
    step.x.copy_from(x)
    step.logits.fill_bytes(0xFF)

    def slot_rows() -> list[np.ndarray]:  # every layer's K and V, a row of bytes per slot
        arrays = (a.to_numpy() for layer in range(shape.num_layers) for a in pool.layer(layer))
        return [a.view(np.uint8).reshape(a.shape[0] * a.shape[1], -1) for a in arrays]

    before = slot_rows()
    step.run(tables)
    device.synchronize()
    others = np.ones(before[0].shape[0], bool)
    others[np.asarray(batch.slot_mapping)] = False
    other_slots_changed = sum(int(np.any(a[others] != b[others], axis=1).sum())
                              for a, b in zip(before, slot_rows(), strict=True))
    logits, x_out = step.logits.to_numpy(), step.x.to_numpy()

    def kv_after(layer, i):
        k, v = adapter.gather_kv(seqs[i], layer)
        return tuple(numpy_kernels.kv_pool_to_float(a.to_numpy(), g.dtype, g.head_dim)
                     for a in (k, v))

    want = decode_step(host, x, batch.seq_lens - 1, kv_after)
    errors = {"logits": float(np.abs(logits - want["logits"]).max()
                              / np.abs(want["logits"]).max()),
              "x": float(np.abs(x_out - want["x"]).max() / np.abs(want["x"]).max())}
    # This token's K/V as written: the pool dtype's rounding of a float32 value within
    # KV_COMPUTE_ERROR of the reference's (rounding_steps).
    step_rows = []
    for layer in range(shape.num_layers):
        for side, ref in ((0, want["k"][layer]), (1, want["v"][layer])):
            got = np.stack([kv_after(layer, i)[side][-1] for i in range(len(seqs))])
            step_rows.append(rounding_steps(got, ref, g.dtype, KV_F16X_COMPUTE_ERROR
                                            if step.f16_x else KV_COMPUTE_ERROR))
    errors["kv_write_steps"] = max(step_rows)
    tol = CHECK_ERROR_F16X if step.f16_x else CHECK_ERROR
    ok = (errors["logits"] <= tol and errors["x"] <= tol and errors["kv_write_steps"] <= 1.0
          and other_slots_changed == 0)
    weights.free()
    pool.close()
    name = f"{fmt} {kv_dtype}" + (f" b1 ctx {contexts[0]}" if len(contexts) == 1 else "")
    return {"check": name, "ok": bool(ok), "fused": list(step.fused),
            "f16_x": step.f16_x, "seed": seed, "tolerance": tol,
            "other_slots_changed": other_slots_changed, **errors}


def _time(device, stream, fn) -> tuple[float, int]:
    """Median seconds per ``fn(stream)`` replayed from a graph, and the graph's nodes."""
    graph = Graph(device, stream, fn)
    graph.launch(stream)
    stream.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = Event(device), Event(device)
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        times.append(end.elapsed_ms(start) / 1e3)
    return statistics.median(times), graph.num_nodes


def step_bytes(shape: DecoderShape, weight_bytes: int, kv_row_bytes: int, batch: int,
               context: int) -> int:
    """Bytes one step must move: every weight once, each sequence's KV over all layers
    (``context + 1`` tokens read, this token's written), hidden states in and logits out."""
    kv = 2 * shape.num_layers * shape.kv_heads * kv_row_bytes * batch * (context + 2)
    return weight_bytes + kv + 4 * batch * (shape.d_model + shape.vocab)


def time_pagedkv(device, stream, weights: DecoderWeights, kv_dtype: str, batch: int,
                 context: int, rng, variants
                 ) -> tuple[list[tuple[float, int, str, dict[str, list[str]]]], int]:
    """Per step variant ``(gemv_rows, fuse)`` of ``variants``: seconds per step, the step
    graph's nodes, its attention launch (``PagedAttention.launch``) and its GEMV launches
    (``DecoderStep.gemv_launches``), all over one pool; and the KV row
    bytes of the pool."""
    shape = weights.shape
    pool, adapter, seqs = build_adapter(device, shape, kv_dtype, batch, [context] * batch, rng)
    for layer in range(shape.num_layers):  # finite KV everywhere (f16 0.096, q8 4.4)
        for arr in pool.layer(layer):
            arr.fill_bytes(0x2E)
    adapter.record_decode_tokens(seqs, np.zeros(batch, np.uint32))
    tables = DeviceDecodeBatch.upload(device, adapter.prepare_decode(seqs))
    x = rng.standard_normal((batch, shape.d_model), dtype=np.float32)
    timed = []
    for gemv_rows, fuse in variants:
        step = DecoderStep(device, weights, pool, batch, context + 1, gemv_rows=gemv_rows,
                           fuse=fuse)
        step.x.copy_from(x)
        timed.append((*_time(device, stream, lambda s, step=step: step.run(tables, stream=s)),
                      step.attn.launch, step.gemv_launches))
    row_bytes = pool.geometry.row_bytes
    pool.close()
    return timed, row_bytes


class TorchDecoder:
    """The bf16 PyTorch baseline: cuBLAS projections, torch RMSNorm/RoPE/SiLU, SDPA over a
    contiguous ``[batch, kv_heads, context + 1, head_dim]`` cache per layer. Eager (every
    elementwise op its own kernel) or, with ``compiled``, each layer's body through
    ``torch.compile`` (inductor fuses the norms, RoPE, SiLU·up and the residual adds; the
    projections stay cuBLAS, attention SDPA): the fused bf16 peer."""

    def __init__(self, torch, shape: DecoderShape, device: str = "cuda") -> None:
        self.torch, self.shape, self.device = torch, shape, device
        bf = torch.bfloat16
        gen = torch.Generator(device).manual_seed(0)

        def w(name):
            m, k = shape.matrix_shape(name)
            return torch.randn(m, k, device=device, dtype=bf, generator=gen) * k ** -0.5

        self.layers = [{m: w(m) for m in MATRICES} for _ in range(shape.num_layers)]
        self.lm_head = w("lm_head")
        self.norm = torch.ones(shape.d_model, device=device, dtype=bf)
        #: the last :meth:`step_fn` with ``compiled``: graphs dynamo compiled, seconds
        self.compile_stats: dict[str, float] = {}

    def weight_bytes(self) -> int:
        return 2 * self.shape.weight_count()

    def step_fn(self, batch: int, context: int, compiled: bool = False):
        """A callable running one step (every layer, final norm, LM head) and returning
        the logits, over a fresh zero cache of ``context + 1`` tokens per sequence (this
        step's K/V written at ``context``) and a fixed random hidden state. ``compiled``:
        the layer body is one ``torch.compile(fullgraph=True, dynamic=False)`` function
        taking the layer's weights and cache as arguments, so the 32 layers share one
        graph; it is compiled (once, after ``torch._dynamo.reset()``) before this
        returns, which raises where inductor cannot run (no triton, no C compiler)."""
        torch, s, dev = self.torch, self.shape, self.device
        F = torch.nn.functional
        bf = torch.bfloat16
        cache = [(torch.zeros(batch, s.kv_heads, context + 1, s.head_dim, device=dev,
                              dtype=bf),
                  torch.zeros(batch, s.kv_heads, context + 1, s.head_dim, device=dev,
                              dtype=bf)) for _ in range(s.num_layers)]
        half = s.head_dim // 2
        inv = s.rope_theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / s.head_dim)
        ang = context * inv
        cos = torch.cat([ang.cos(), ang.cos()]).to(dev, bf)
        sin = torch.cat([ang.sin(), ang.sin()]).to(dev, bf)
        x0 = torch.randn(batch, s.d_model, device=dev, dtype=bf,
                         generator=torch.Generator(dev).manual_seed(1))
        nq, nkv = s.q_heads * s.head_dim, s.kv_heads * s.head_dim

        def rope(t, cos, sin):
            a, b = t[..., :half], t[..., half:]
            return t * cos + torch.cat([-b, a], dim=-1) * sin

        def layer_body(x, norm, qkv, o, gate_up, down, kc, vc, cos, sin):
            h = F.rms_norm(x, (s.d_model,), norm, s.eps)
            q, k, v = F.linear(h, qkv).split([nq, nkv, nkv], dim=-1)
            q = rope(q.reshape(batch, s.q_heads, 1, s.head_dim), cos, sin)
            k = rope(k.reshape(batch, s.kv_heads, 1, s.head_dim), cos, sin)
            kc[:, :, context:] = k
            vc[:, :, context:] = v.reshape(batch, s.kv_heads, 1, s.head_dim)
            a = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
            x = x + F.linear(a.reshape(batch, s.d_model), o)
            h = F.rms_norm(x, (s.d_model,), norm, s.eps)
            g, u = F.linear(h, gate_up).chunk(2, dim=-1)
            return x + F.linear(F.silu(g) * u, down)

        body = layer_body
        if compiled:
            # a fresh cache: graphs of earlier (batch, context) would count against dynamo's
            # recompile limit (8) and fall back to eager past it
            torch._dynamo.reset()
            body = torch.compile(layer_body, fullgraph=True, dynamic=False)

        def step():
            x = x0
            for layer, (kc, vc) in zip(self.layers, cache, strict=True):
                x = body(x, self.norm, layer["qkv"], layer["o"], layer["gate_up"],
                         layer["down"], kc, vc, cos, sin)
            return F.linear(F.rms_norm(x, (s.d_model,), self.norm, s.eps), self.lm_head)

        if compiled:
            from torch._dynamo.utils import counters
            graphs = counters["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            step()  # compiles on layer 0; layers 1.. must hit the same graph
            if dev == "cuda":
                torch.cuda.synchronize()
            self.compile_stats = {"graphs": counters["stats"]["unique_graphs"] - graphs,
                                  "seconds": time.perf_counter() - t0}
        return step

    def time(self, batch: int, context: int, compiled: bool = False) -> float:
        """Seconds per step (:meth:`step_fn`) captured in a CUDA graph (``_torch_time``)."""
        from pagedkv.bench.gpu import _torch_time
        return _torch_time(self.torch, self.step_fn(batch, context, compiled), 1)


def sdpa_backend(torch, batch: int, context: int, shape: DecoderShape,
                 device: str = "cuda") -> str:
    """The SDPA implementation PyTorch picks for the decode shape (one query token per
    sequence, ``context + 1`` keys, GQA), read from the ATen op one eager call runs under
    the profiler (CPU events only): ``flash``, ``efficient``, ``cudnn``, ``math`` (or the
    op's name, or ``unknown``)."""
    from torch.profiler import ProfilerActivity, profile
    bf = torch.bfloat16
    q = torch.zeros(batch, shape.q_heads, 1, shape.head_dim, device=device, dtype=bf)
    k = torch.zeros(batch, shape.kv_heads, context + 1, shape.head_dim, device=device,
                    dtype=bf)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    names = [ev.name for ev in prof.events()
             if ev.name.startswith("aten::_scaled_dot_product_")]
    for key in ("flash", "efficient", "cudnn", "math"):
        if any(key in n for n in names):
            return key
    return names[0] if names else "unknown"


def sdpa_flags(torch) -> dict[str, bool]:
    """Which SDPA backends ``torch.backends.cuda`` has enabled."""
    b = torch.backends.cuda
    flags = {"flash": b.flash_sdp_enabled(), "mem_efficient": b.mem_efficient_sdp_enabled(),
             "math": b.math_sdp_enabled()}
    if hasattr(b, "cudnn_sdp_enabled"):
        flags["cudnn"] = b.cudnn_sdp_enabled()
    return flags


#: The issue's targets: (batch, context or None for any, KV dtype or None) -> the least
#: pagedkv tokens/s over torch bf16 tokens/s.
TARGETS = {(1, None, None): 2.5, (32, 1024, None): 1.5, (8, 32768, "q8"): 1.6}


def profile_step(device, stream, torch, weights: DecoderWeights, kv_dtype: str, batch: int,
                 context: int, rng, gemv_rows: int, fuse: bool = True,
                 replays: int = 20) -> tuple[float, list[dict]]:
    """Where one step's time goes: the step's time (µs, events around the replays under
    the profiler) and the step's graph replayed ``replays`` times under
    ``torch.profiler`` (CUPTI records every kernel of a graph launch, ctypes launches
    included), summed per kernel name. Rows ``{"kernel", "calls", "us"}`` per step, the
    largest first; kernel times only (the gaps between nodes are the step time minus
    their sum)."""
    shape = weights.shape
    pool, adapter, seqs = build_adapter(device, shape, kv_dtype, batch, [context] * batch, rng)
    for layer in range(shape.num_layers):
        for arr in pool.layer(layer):
            arr.fill_bytes(0x2E)
    adapter.record_decode_tokens(seqs, np.zeros(batch, np.uint32))
    tables = DeviceDecodeBatch.upload(device, adapter.prepare_decode(seqs))
    step = DecoderStep(device, weights, pool, batch, context + 1, gemv_rows=gemv_rows,
                       fuse=fuse)
    step.x.copy_from(rng.standard_normal((batch, shape.d_model), dtype=np.float32))
    graph = Graph(device, stream, lambda s: step.run(tables, stream=s))
    graph.launch(stream)
    stream.synchronize()
    from torch.profiler import ProfilerActivity, profile
    start, end = Event(device), Event(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record(stream)
        for _ in range(replays):
            graph.launch(stream)
        end.record(stream)
        stream.synchronize()
    step_us = end.elapsed_ms(start) * 1e3 / replays
    per_name: dict[str, tuple[int, float]] = {}
    for ev in prof.events():
        if getattr(ev, "device_type", None) is None or "CUDA" not in str(ev.device_type):
            continue
        calls, us = per_name.get(ev.name, (0, 0.0))
        per_name[ev.name] = (calls + 1, us + (ev.device_time if hasattr(ev, "device_time")
                                              else ev.cuda_time))
    pool.close()
    rows = [{"kernel": n, "calls": c / replays, "us": t / replays}
            for n, (c, t) in sorted(per_name.items(), key=lambda item: -item[1][1])]
    return step_us, rows


def target_of(row: dict) -> float | None:
    """The speedup target a row is held to, or None."""
    for (b, c, kv), want in TARGETS.items():
        if row["batch"] == b and c in (None, row["context"]) and kv in (None, row["kv"]):
            return want
    return None


def print_targets(rows: list[dict]) -> None:
    """One line per targeted row: met or missed, with the measured speedup."""
    for row in rows:
        want = target_of(row)
        if want is None or "speedup_vs_torch" not in row:
            continue
        got = row["speedup_vs_torch"]
        compiled = (f"; {row['speedup_vs_torch_compiled']:.2f}x torch.compile bf16"
                    if "speedup_vs_torch_compiled" in row else "")
        print(f"target {row['weights']} kv {row['kv']} b{row['batch']} ctx {row['context']} "
              f"({row.get('path', 'gemv')}): "
              f"{got:.2f}x torch bf16 (>= {want}x) {'met' if got >= want else 'MISSED'}"
              f"{compiled}", flush=True)


def _print_row(row: dict) -> None:
    torch_part = (f" | torch {row['torch_us']:9.0f} us {row['torch_tok_s']:8.0f} tok/s "
                  f"-> {row['speedup_vs_torch']:.2f}x" if "torch_us" in row else "")
    if "torch_compiled_us" in row:
        torch_part += (f" | compiled {row['torch_compiled_us']:9.0f} us "
                       f"{row['torch_compiled_tok_s']:8.0f} tok/s "
                       f"-> {row['speedup_vs_torch_compiled']:.2f}x")
    print(f"{row['weights']:<10} kv {row['kv']:<8} b{row['batch']:<3} ctx {row['context']:>6} "
          f"{row['path']:<12} {row['nodes']:4d} nodes {row['us']:9.0f} us {row['tok_s']:8.0f} tok/s  {row['bytes'] / 2**20:8.0f} MiB "
          f"floor {row['floor_us']:8.0f} us ({100 * row['of_floor']:4.1f}%){torch_part}",
          flush=True)


def gemv_paths(device, fmt: str, batch: int) -> list[tuple[str, int]]:
    """The GEMV paths a row is timed on: ``(name, gemv_rows)``. Above 8 rows with the
    tiled tensor-core kernel, both the tiled path (one call of up to 32 rows) and the
    earlier 8-row calls, so the two are compared in the same run."""
    from pagedkv.kernels.weights import GEMV_MAX_BATCH, max_batch
    most = max_batch(device, fmt)
    if batch <= GEMV_MAX_BATCH or most <= GEMV_MAX_BATCH:
        return [("gemv", min(batch, most))]
    return [(f"tiled {most}", most), (f"chunks {GEMV_MAX_BATCH}", GEMV_MAX_BATCH)]


def step_paths(device, fmt: str, batch: int) -> list[tuple[str, int, bool]]:
    """The step variants a row is timed on: ``(name, gemv_rows, fuse)``: each GEMV path
    (:func:`gemv_paths`) with the fused launches, and the default one unfused too
    (``<path> unfused``), so a run compares node counts and times of both."""
    paths = gemv_paths(device, fmt, batch)
    name, rows = paths[0]
    return [(name, rows, True), (f"{name} unfused", rows, False)] + \
        [(n, r, True) for n, r in paths[1:]]


def torch_baselines(torch, shape: DecoderShape, grid, compiled: bool = False,
                    sdpa: dict | None = None) -> tuple[dict, dict, int]:
    """The bf16 torch step's seconds per ``(batch, context)`` of ``grid``, eager and (with
    ``compiled``) through ``torch.compile``, and the baseline's weight bytes. A compile
    that fails is reported in one line and the compiled peer skipped from there on.
    ``sdpa`` (when given) gets the SDPA backend flags and, per configuration, the backend
    the eager call ran (:func:`sdpa_backend`)."""
    eager: dict[tuple[int, int], float] = {}
    fused: dict[tuple[int, int], float] = {}
    baseline = TorchDecoder(torch, shape)
    if sdpa is not None:
        sdpa["enabled"] = sdpa_flags(torch)
        sdpa["chosen"] = {}
        print(f"torch SDPA backends enabled: {sdpa['enabled']}", flush=True)
    for b, c in grid:
        if sdpa is not None:
            try:
                sdpa["chosen"][f"b{b} ctx {c}"] = chosen = sdpa_backend(torch, b, c, shape)
            except Exception as e:  # noqa: BLE001 - a probe, never the bench's end
                chosen = f"probe failed ({type(e).__name__})"
            print(f"torch SDPA b{b} ctx {c}: {chosen}", flush=True)
        eager[(b, c)] = baseline.time(b, c)
        torch.cuda.empty_cache()  # the last configuration's contiguous cache
        if compiled:
            try:
                fused[(b, c)] = baseline.time(b, c, compiled=True)
                st = baseline.compile_stats
                print(f"torch.compile b{b} ctx {c}: {st['graphs']} graph(s) compiled in "
                      f"{st['seconds']:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - no triton, no C compiler, ...
                why = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                print(f"torch.compile peer skipped: {type(e).__name__}: {why}", flush=True)
                compiled = False
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    return eager, fused, baseline.weight_bytes()


def run_table(device, stream, copy_bw: float, torch, grid, formats, kv_dtypes,
              shape: DecoderShape = LLAMA3_8B, seed: int = 0, on_row=None,
              torch_compile: bool = False, sdpa: dict | None = None) -> list[dict]:
    """The rows of the table (see the module docstring); ``on_row(rows)`` after each one
    (the CLI rewrites its JSON, so a run cut short keeps what it measured).
    ``torch_compile``: the ``torch.compile``d bf16 peer as well; ``sdpa``: see
    :func:`torch_baselines`."""
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    torch_times: dict[tuple[int, int], float] = {}
    compiled_times: dict[tuple[int, int], float] = {}
    grid = [(b, c) for b, c in grid
            if 2 * shape.num_layers * shape.kv_heads * shape.head_dim * 2 * b * (c + 1)
            <= KV_LIMIT_BYTES]
    if torch is not None:
        torch_times, compiled_times, torch_weight_bytes = torch_baselines(
            torch, shape, grid, torch_compile, sdpa)
        torch.cuda.empty_cache()
    for fmt in formats:
        weights = DecoderWeights(device, DecoderHostWeights.tiled(shape, fmt, seed))
        for kv_dtype in kv_dtypes:
            for b, c in grid:
                paths = step_paths(device, fmt, b)
                timed, row_bytes = time_pagedkv(device, stream, weights, kv_dtype, b, c, rng,
                                                [(rows, fuse) for _, rows, fuse in paths])
                for (path, gemv_rows, fuse), (t, nodes, attention, gemvs) in zip(
                        paths, timed, strict=True):
                    nbytes = step_bytes(shape, weights.nbytes, row_bytes, b, c)
                    row = {"weights": fmt, "kv": kv_dtype, "batch": b, "context": c,
                           "path": path, "gemv_rows": gemv_rows, "fused": fuse,
                           "pdl": bool(getattr(device, "dependent_launch", False)),
                           "nodes": nodes, "attention": attention, "gemv": gemvs,
                           "nodes_per_layer": nodes / shape.num_layers,
                           "us": t * 1e6, "tok_s": b / t, "bytes": nbytes,
                           "bytes_per_row": nbytes / b,
                           "floor_us": nbytes / copy_bw * 1e6, "of_floor": nbytes / copy_bw / t}
                    if (b, c) in torch_times:
                        tt = torch_times[(b, c)]
                        tb = step_bytes(shape, torch_weight_bytes, 2 * shape.head_dim, b, c)
                        row.update({"torch_us": tt * 1e6, "torch_tok_s": b / tt,
                                    "torch_bytes": tb, "torch_floor_us": tb / copy_bw * 1e6,
                                    "speedup_vs_torch": tt / t})
                    if (b, c) in compiled_times:
                        tc = compiled_times[(b, c)]
                        row.update({"torch_compiled_us": tc * 1e6, "torch_compiled_tok_s": b / tc,
                                    "speedup_vs_torch_compiled": tc / t})
                    rows.append(row)
                    _print_row(row)
                    if on_row is not None:
                        on_row(rows)
        weights.free()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="also write the checks and rows to this JSON file")
    p.add_argument("--quick", action="store_true",
                   help=f"only the targeted configurations {QUICK_GRID}")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    p.add_argument("--torch-compile", action="store_true",
                   help="also the fused bf16 peer: each layer through torch.compile "
                   "(inductor), captured in a CUDA graph (compiles once per configuration)")
    p.add_argument("--layers", type=int, default=LLAMA3_8B.num_layers,
                   help="decoder layers of the timed model (default 32)")
    p.add_argument("--check-only", action="store_true", help="only the correctness check")
    p.add_argument("--profile", metavar="B,C", default=None,
                   help="per-kernel time of one step at batch B, context C (needs PyTorch's "
                   "profiler; programmatic dependent launch off, so each kernel's time is its "
                   "own), for each format and KV dtype, instead of the table")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    args = p.parse_args(argv)
    args.no_check = args.no_check or bool(args.profile)
    session = open_session("pagedkv.bench decode", no_torch=args.no_torch)
    if session is None:
        return 1
    device, stream, torch, when = session
    props = device.properties
    shape = replace(LLAMA3_8B, num_layers=args.layers)
    pdl = "on" if device.dependent_launch else "off"
    if args.profile and device.dependent_launch:
        # under PDL a kernel starts while its predecessor runs and waits inside itself: the
        # profiler would count that wait as the kernel's time (a 3.4 µs RMSNorm read 35 µs)
        device.dependent_launch = False
        pdl = "off for --profile"
    print(f"{props.name} ({props.arch}), {when}; torch: "
          f"{torch.__version__ if torch else 'not used'}; model {shape}; programmatic "
          f"dependent launch {pdl}", flush=True)
    checks: list[dict] = []
    rows: list[dict] = []
    copy_bw = None
    sdpa: dict = {}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": props.name, "arch": props.arch, "date": when,
                           "model": str(shape), "copy_GBps": copy_bw and copy_bw / 1e9,
                           "checks": checks, "rows": rows, "sdpa_backend": sdpa or None},
                          f, indent=1)

    if not args.no_check:
        for fmt, kv, contexts in CHECKS:
            t0 = time.perf_counter()
            result = check_step(device, fmt, kv, contexts=contexts)
            checks.append(result)
            save()
            print(f"check {result['check']}: {'ok' if result['ok'] else 'FAILED'} (logits "
                  f"{result['logits']:.2e}, x {result['x']:.2e} of their max, bound "
                  f"{result['tolerance']:.0e}; KV write {result['kv_write_steps']:.2f} of its "
                  f"bound; other slots changed: {result['other_slots_changed']}; seed "
                  f"{result['seed']}; {time.perf_counter() - t0:.0f} s)", flush=True)
    if args.profile:
        if torch is None:
            print("--profile needs PyTorch (its profiler reads the kernel times)")
            return 1
        b, c = (int(v) for v in args.profile.split(","))
        rng = np.random.default_rng(0)
        for fmt in FORMATS:
            weights = DecoderWeights(device, DecoderHostWeights.tiled(shape, fmt, 0))
            for kv_dtype in KV_DTYPES:
                for path, gemv_rows, fuse in step_paths(device, fmt, b)[:1]:
                    step_us, prof = profile_step(device, stream, torch, weights, kv_dtype, b, c, rng,
                                        gemv_rows, fuse)
                    total = sum(r["us"] for r in prof)
                    print(f"profile {fmt} {kv_dtype} batch {b} context {c} ({path}): "
                          f"step {step_us:.1f} us, kernels {total:.1f} us", flush=True)
                    for r in prof:
                        print(f"  {r['us']:9.1f} us {100 * r['us'] / total:5.1f}% "
                              f"{r['calls']:6.1f} calls  {r['kernel'][:90]}")
                    rows.append({"weights": fmt, "kv": kv_dtype, "batch": b, "context": c,
                                 "path": path, "step_us": step_us, "profile": prof})
            weights.free()
        save()
        return 0
    if not args.check_only:
        copy_bw, _ = copy_bandwidth(device, stream)
        print(f"device-to-device copy: {copy_bw / 1e9:.1f} GB/s (floors use it)", flush=True)

        def save_rows(done: list[dict]) -> None:
            rows[:] = done
            save()

        run_table(device, stream, copy_bw, torch, QUICK_GRID if args.quick else FULL_GRID,
                  FORMATS, KV_DTYPES, shape, on_row=save_rows,
                  torch_compile=args.torch_compile, sdpa=sdpa)
        print_targets(rows)
    save()
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
